"""What the suite needs from outside Python (a PostgreSQL server, FUSE), and what happens when it is missing.

On a developer's machine a missing service skips the tests that need it, with the reason. Under CI
(`CI` set to true, as CI systems and `.ci/run` do) the same absence fails them: a green CI run must mean
the PostgreSQL store, the reaper, the FUSE volume and the rest were really tested, not quietly skipped.
"""

from __future__ import annotations

import os

import pytest

TRUE = ("1", "true", "yes", "on")


def in_ci(env: dict[str, str] | None = None) -> bool:
    """Whether this run is a CI run (`CI` is 1/true/yes/on, any case)."""
    return (env if env is not None else os.environ).get("CI", "").strip().lower() in TRUE


def require(what: str, reason: str | None) -> None:
    """Go on when `reason` is None; otherwise skip the test with the reason, or fail it under CI."""
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"{what} is required under CI={os.environ.get('CI')} but unavailable: {reason}", pytrace=False)
    pytest.skip(f"{what} unavailable: {reason}")
