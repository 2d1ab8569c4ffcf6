"""The governor: when a program session changes course, and when it gives up.

Two signals: failed variants in a row (crashes, missing metrics, proposals rejected after every re-ask) and
variants judged since the last gated improvement. Crossing either limit the first time changes course (back
to the incumbent, a note to the model); crossing it again after that stops the session with the reason, so
nobody finds thousands of failed experiments later. A gated improvement resets both counters and the course.
The state is a plain dict so it lives in the session's checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

CONTINUE, CHANGE, STOP = "continue", "change_course", "stop"


@dataclass
class Governor:
    """Counts outcomes and says continue, change course, or stop (with `reason`)."""

    max_failures: int = 5
    patience: int = 20
    failures_in_row: int = 0
    since_improvement: int = 0
    course_changes: int = 0
    reason: str = ""

    def record(self, outcome: str) -> str:
        """Record a variant's outcome (`failed`, `kept`, `improved`, `discarded`); the action to take."""
        if outcome == "improved":
            self.failures_in_row = self.since_improvement = self.course_changes = 0
            return CONTINUE
        self.since_improvement += 1
        self.failures_in_row = self.failures_in_row + 1 if outcome == "failed" else 0
        if self.failures_in_row >= self.max_failures:
            return self._escalate(f"{self.failures_in_row} failed variants in a row")
        if self.since_improvement >= self.patience:
            return self._escalate(f"no gated improvement in {self.since_improvement} variants")
        return CONTINUE

    def _escalate(self, why: str) -> str:
        if self.course_changes >= 1:
            self.reason = why
            return STOP
        self.course_changes += 1
        self.failures_in_row = 0
        self.since_improvement = 0
        self.reason = f"changed course after {why}"
        return CHANGE

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Governor":
        return cls(**data)
