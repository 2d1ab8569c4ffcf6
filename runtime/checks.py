"""The result of one health check, shared by `runtime.preflight`, `runtime.allreduce` and `runtime.nvml` users.

Kept apart from `runtime.preflight` so the all-reduce check (which preflight runs) needs nothing of preflight:
no import circle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from runtime import faults

STATUSES = ("pass", "fail", "skipped")


@dataclass(frozen=True)
class CheckResult:
    """One check on one device. `value` is what was measured, `threshold` what it was held against."""

    check: str
    device: str
    status: str
    value: Any = None
    threshold: Any = None
    message: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def outcome(check: str, device: str, fn: Callable[[], tuple], skip: str | None = None) -> CheckResult:
    """Run `fn` (returning status, value, threshold, message) as check `check` on `device`: an injected fault
    fails it without running, `skip` skips it, and an exception fails it with its message."""
    if faults.injected(device, check):
        return CheckResult(check, device, "fail", message=faults.INJECTED)
    if skip:
        return CheckResult(check, device, "skipped", message=skip)
    try:
        status, value, threshold, message = fn()
    except Exception as exc:
        status, value, threshold, message = "fail", None, None, f"{type(exc).__name__}: {exc}"
    return CheckResult(check, device, status, value, threshold, message)


def healthy(results: Iterable[CheckResult]) -> bool:
    """True when no check failed (skipped is fine)."""
    return all(r.status != "fail" for r in results)


def reason(results: Iterable[CheckResult]) -> str:
    """A one-line summary of the failures, for a quarantine reason ('' when healthy)."""
    return "; ".join(f"{r.device}:{r.check}: {r.message}" for r in results if r.status == "fail")
