"""A checkpoint interval in time: `CheckpointManager(dir, interval_minutes=M)` saves about every M minutes.

The first `CALIBRATE_STEPS` steps are timed; then at each decision step rank 0 says whether the interval has
passed (within half a step) and at which step to decide next, and every rank takes its word: the ranks' clocks
never disagree about a save, and only a decision step costs a collective (on a gloo group of its own, since an
upload may be using the manager's). The next decision comes after half the steps left at the pace since the
last one (all of them when a few are left), so a change of pace (a slower phase, a shared machine) moves the
save by a few steps, not by a whole interval: a few collectives an interval.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

_now = time.monotonic  # the clock the interval reads
CALIBRATE_STEPS = 10  # steps timed before the first decision


class TimedInterval:
    """`due(step)`: whether `step` is a save step, about every `minutes` of training (see the module doc)."""

    def __init__(self, minutes: float, distributed: bool) -> None:
        self.seconds = minutes * 60
        self._group = dist.new_group(backend="gloo") if distributed else None  # collective: every rank builds one
        self._clock: tuple[float, int, float] | None = None  # (last save, step, time) of the last decision
        self._next_step = 0  # the step at which it decides next

    def due(self, step: int) -> bool:
        now = _now()
        if self._clock is None:  # the first step seen (after any load): time from here
            self._clock, self._next_step = (now, step, now), step + CALIBRATE_STEPS
            return False
        if step < self._next_step:
            return False
        last_save, since_step, since = self._clock
        pace = (now - since) / max(1, step - since_step)
        elapsed = now - last_save
        save = elapsed + pace / 2 >= self.seconds
        left = self.seconds if save else self.seconds - elapsed
        steps_left = left / pace if pace > 0 else 1.0
        ahead = steps_left if steps_left <= 4 else steps_left / 2
        decision = torch.tensor([int(save), step + max(1, round(ahead))], dtype=torch.int64)
        if self._group is not None:  # rank 0's clock decides for every rank
            dist.broadcast(decision, src=0, group=self._group)
        save, self._next_step = bool(decision[0]), int(decision[1])
        self._clock = (now if save else last_save, step, now)
        return save
