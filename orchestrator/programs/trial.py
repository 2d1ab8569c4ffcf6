"""One trial of a program session: one job running one commit on one seed, and what it measured.

The first run of a commit is its node (`node == n`); re-runs on other seeds point at it. A node also carries
the judge's verdict on its commit. `tree.TreeStore` keeps trials as plain JSON dicts (`to_dict`), with the
same keys and values as before trials were objects, so the rows of a session checkpointed by an older version
still load (`from_dict` ignores keys it does not know) and resume.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from orchestrator.agent.session import rerun_key
from orchestrator.core.records import Record


class _Word(str, Enum):
    """A str enum that formats as its value, so prompt lines and printed tables read as they did with words."""

    def __str__(self) -> str:
        return str(self.value)


class ProgramTrialStatus(_Word):
    """Where a trial's job stands (the session's view: `pending` is recorded, not yet submitted)."""

    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # its job succeeded and reported the metric
    FAILED = "failed"  # crashed, timed out, or succeeded without the metric
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        """It holds (or is about to hold) one of the session's slots."""
        return self in ACTIVE

    @property
    def final(self) -> bool:
        """Its outcome is known and will not change."""
        return self in FINAL


S = ProgramTrialStatus
ACTIVE = (S.PENDING, S.QUEUED, S.RUNNING)
FINAL = (S.SUCCEEDED, S.FAILED, S.CANCELLED)


class Kind(_Word):
    """Why a trial runs: the program as committed, a node of a proposed variant, or a re-run of a node."""

    BASELINE = "baseline"
    VARIANT = "variant"
    RERUN = "rerun"


class Verdict(_Word):
    """The judge's word on a node's commit (`None` on a trial until it is judged, and on every re-run)."""

    BASELINE = "baseline"  # the baseline, measured
    KEPT = "kept"  # passed the noise gate against its parent
    DISCARDED = "discarded"  # did not pass it (or its re-runs failed)
    CRASHED = "crashed"  # its first run did not succeed


@dataclass
class ProgramTrial(Record):
    """One trial; `key` (`<session>:<n>`) is its job's idempotency key and its MLflow run's tag.

    `files`, `fingerprint` and `log_tail` are absent from the stored dict while unset (None), as they were
    before: `files` lives only from the proposal to its commit, `fingerprint` only on variants, `log_tail`
    only on failed runs."""

    n: int
    key: str
    kind: Kind
    step: str  # baseline | rerun | the proposal's step (draft, improve, debug)
    node: int  # the trial whose commit this runs (itself for a node)
    commit: str | None = None  # None until a variant's commit is made
    parent: str | None = None  # the parent commit
    parent_node: int | None = None
    seed: int = 0
    rationale: str = ""
    edits: list[dict[str, Any]] = field(default_factory=list)  # the model's search/replace edits, as given
    depth: int = 0  # debug steps in a row that led to it
    status: ProgramTrialStatus = ProgramTrialStatus.PENDING
    job_id: int | None = None
    run_id: str | None = None
    value: float | None = None
    error: str = ""
    verdict: Verdict | None = None
    verdict_text: str = ""
    device_s: float = 0.0
    files: dict[str, str] | None = None  # the variant's new file texts (repo-relative keys: the spec's `edit`)
    fingerprint: str | None = None
    log_tail: str | None = None
    attempt: int = 0  # runs of it cut short by a `stop` of its session (`run_again`)

    def __post_init__(self) -> None:
        self.kind = Kind(self.kind)
        self.status = ProgramTrialStatus(self.status)
        self.verdict = None if self.verdict is None else Verdict(self.verdict)

    @property
    def job_key(self) -> str:
        """Its current job's idempotency key (and its MLflow run's): `key`, then `key~1`, ... once run again."""
        return rerun_key(self.key, self.attempt)

    def run_again(self) -> None:
        """Its job was cancelled by a `stop` of its session: on resume it runs again as it was (the same commit
        and seed, a fresh job and run), so a stop costs no trial of the session's budget."""
        self.attempt += 1
        self.status, self.job_id, self.run_id, self.value, self.error = ProgramTrialStatus.PENDING, None, None, None, ""
        self.device_s, self.log_tail = 0.0, None

    @property
    def is_node(self) -> bool:
        """It is the first run of its commit."""
        return self.node == self.n

    def to_dict(self) -> dict[str, Any]:
        """The stored form: plain JSON-able data, keys in the order trials have always been written."""
        out = dataclasses.asdict(self)
        out["kind"], out["status"] = self.kind.value, self.status.value
        out["verdict"] = None if self.verdict is None else self.verdict.value
        for optional in ("files", "fingerprint", "log_tail"):
            if out[optional] is None:
                del out[optional]
        if not out["attempt"]:
            del out["attempt"]
        return out
