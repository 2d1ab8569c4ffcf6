"""The checkpoint retention policy: which finished jobs keep their checkpoint dirs, and how much of them.

A pure function from the final jobs (as the queue records them) and the sessions' states to one action per
job (`keep`, `latest`, `remove`); `orchestrator.service.gc` applies it. The rules, first match wins:

1. `retention = "off"`: every job keeps everything.
2. A job marked to keep (`submit --keep-checkpoint all|latest|none`, `gc --keep ID`): what it says.
3. A person's job (its owner is no agent session): `keep_people` (default `all`).
4. A session trial among the best `keep_best` of its session and experiment by the session's ranking
   (`Job.score`, higher is better, recorded by the session): keep everything.
5. A baseline or confirmation run: keep its latest checkpoint.
6. A trial of a session that has not ended and has no score yet (its value may still come): keep.
7. Any other session trial: remove (its value is known and can no longer win: scores only get beaten).

Jobs that are not final (queued, running, preempted and back in line, retrying, ASHA-paused trials, which
wait in line) are never given to the policy: their checkpoints are what they resume from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional
from orchestrator.core.config import Settings

KEEP, LATEST, REMOVE = "keep", "latest", "remove"
_MODE_ACTION = {"all": KEEP, "latest": LATEST, "none": REMOVE}
PEOPLE = "human"  # the owner of jobs submitted by a person (JobSpec.owner's default)


@dataclass(frozen=True)
class Policy:
    """The retention settings (`Settings.retention`, `keep_best`, `keep_people`)."""

    mode: str = "ranked"  # ranked | off
    keep_best: int = 3
    keep_people: str = "all"  # all | latest | none

    def __post_init__(self) -> None:
        if self.mode not in ("ranked", "off"):
            raise ValueError(f"retention must be ranked or off, got {self.mode!r}")
        if self.keep_people not in _MODE_ACTION:
            raise ValueError(f"keep_people must be all, latest or none, got {self.keep_people!r}")
        if self.keep_best < 0:
            raise ValueError("keep_best must be >= 0")

    @classmethod
    def from_settings(cls, settings: Settings) -> "Policy":
        """The policy of a `Settings`."""
        return cls(mode=settings.retention, keep_best=settings.keep_best, keep_people=settings.keep_people)


@dataclass(frozen=True)
class Decision:
    """What retention does to one job's checkpoint dir, and why (shown by `gc --dry-run`)."""

    job_id: int
    action: str  # keep | latest | remove
    why: str


def decide(jobs: Iterable[Mapping[str, Any]], sessions: Mapping[str, bool], policy: Policy) -> list[Decision]:
    """One decision per final job. `jobs`: rows of `KeepRecords.retention_rows` (id, owner, experiment,
    keep_checkpoint, phase, score, ...); `sessions`: agent session id -> whether it has ended. A job whose
    owner is not in `sessions` is a person's."""
    jobs = list(jobs)
    best = _best(jobs, sessions, policy.keep_best)
    out = []
    for job in jobs:
        action, why = _rule(job, sessions, policy, best)
        out.append(Decision(job["id"], action, why))
    return out


def _best(jobs: list[Mapping[str, Any]], sessions: Mapping[str, bool], k: int) -> set[int]:
    """Ids of the best `k` scored trials of each (session, experiment)."""
    groups: dict[tuple[str, Optional[str]], list[Mapping[str, Any]]] = {}
    for job in jobs:
        if job["owner"] in sessions and job.get("score") is not None:
            groups.setdefault((job["owner"], job.get("experiment")), []).append(job)
    out: set[int] = set()
    for members in groups.values():
        members.sort(key=lambda j: (-j["score"], j["id"]))  # ties: the earlier trial
        out.update(j["id"] for j in members[:k])
    return out


def _rule(job: Mapping[str, Any], sessions: Mapping[str, bool], policy: Policy, best: set[int]) -> tuple[str, str]:
    if policy.mode == "off":
        return KEEP, "retention is off"
    marked = job.get("keep_checkpoint")
    if marked in _MODE_ACTION:
        return _MODE_ACTION[marked], f"marked --keep-checkpoint {marked}"
    owner = job["owner"]
    if owner not in sessions:
        return _MODE_ACTION[policy.keep_people], f"a person's job (keep_people = {policy.keep_people})"
    if job["id"] in best:
        return KEEP, f"among the best {policy.keep_best} of session {owner}"
    if job.get("phase") in ("baseline", "confirm"):
        return LATEST, f"a {job['phase']} run: its latest checkpoint"
    if not sessions[owner] and job.get("score") is None:
        return KEEP, f"session {owner} is still going and this trial has no value yet"
    return REMOVE, f"outside the best {policy.keep_best} of session {owner}"


def pending(decisions: Iterable[Decision], jobs: Iterable[Mapping[str, Any]]) -> list[Decision]:
    """The decisions that still change something: not `keep`, and not done already (a dir removed stays
    removed; a dir trimmed to its latest needs trimming again only to remove it)."""
    done = {job["id"]: job.get("checkpoint_gc") for job in jobs}
    out = []
    for d in decisions:
        if d.action == KEEP or done.get(d.job_id) == "removed":
            continue
        if d.action == LATEST and done.get(d.job_id) == "trimmed":
            continue
        out.append(d)
    return out
