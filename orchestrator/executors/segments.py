"""Population-based training of a config-file experiment: its run cut into segments that resume each other.

A script knows nothing of PBT. What it offers is a parameter that says after how many steps it stops (`steps`
in the toml, e.g. `steps = "max_iters"`) and a resume flag. With those, the job wrapper
(`orchestrator.executors.scriptjob`) runs a population member (its job has AUTORESEARCH_CHECKPOINT_EVERY) or a
replay of a schedule (AUTORESEARCH_SCHEDULE) as a chain of segments:

    segment (a, b]: the command with `steps` = b and the params the schedule gives at a, the resume flag added
    once the script's folder holds anything; its last metric line is the report at step b.

The boundaries are every perturbation interval, every step where the schedule changes a param, and the run's
end (`boundaries`). The script's own files live in `run/` under the job's checkpoint dir (what
`{checkpoint_dir}` is then). When a member's segment ends at an interval, `run/` is copied to `step_<b>/` (under
a temporary name, `.metadata` written last, then renamed), the snapshot a PBT child forks from, as the bundled
experiments' DCP checkpoints are; the newest `KEEP` are kept. A child's first attempt copies its fork's
snapshot into its own `run/` (`seed_from_fork`). How far the script's checkpoint is (`at`) is in the wrapper's
state file, so a preempted segment resumes where it was and a finished one never runs twice.

A segment is only as exact as the script's resume: a schedule horizon (a cosine decay's length) should come
from a parameter other than `steps`, which now says where each segment stops.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from experiments.common import CHECKPOINT_EVERY_ENV, SCHEDULE_ENV

RUN = "run"  # the script's own folder under the job's checkpoint dir
METADATA = ".metadata"  # a snapshot counts once this is written (as a DCP checkpoint's)
KEEP = 2


def wanted(plan: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Whether this attempt runs in segments: the experiment names its `steps` parameter and a resume flag,
    and the job is a PBT member or replays a schedule."""
    pbt = env.get(CHECKPOINT_EVERY_ENV) or env.get(SCHEDULE_ENV)
    return bool(plan.get("steps") and plan.get("resume") and pbt)


def boundaries(total: int, every: int | None, plan: list[tuple[int, dict[str, Any]]]) -> list[int]:
    """Where segments end: each multiple of `every` below `total`, each schedule change inside the run, `total`."""
    ends = set(range(every, total, every)) if every else set()
    ends.update(step for step, _ in plan if 0 < step < total)
    ends.add(total)
    return sorted(ends)


def snapshot_step(path: Path) -> int:
    return int(path.name.split("_")[1])


def seed_from_fork(run_dir: Path, source: str | None) -> int | None:
    """Copy the newest snapshot of the fork dir `source` into `run_dir` (a copy under a temporary name,
    renamed, so a kill mid-copy leaves nothing half made); the step it is at, None without a fork."""
    if not source:
        return None
    snaps = sorted(p for p in Path(source).glob("step_*") if (p / METADATA).exists())
    if not snaps:
        raise RuntimeError(f"{source}: no complete snapshot to start from")
    tmp = run_dir.with_name(f".seeding-{RUN}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(snaps[-1], tmp, ignore=shutil.ignore_patterns(METADATA))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    os.replace(tmp, run_dir)
    return snapshot_step(snaps[-1])


def snapshot(checkpoint_dir: Path, step: int) -> bool:
    """`run/` as it is at `step`, kept as `step_<step>/` for a PBT child to fork from; the older ones beyond the
    newest `KEEP` are removed. False when the snapshot was already there (made before a kill)."""
    target = checkpoint_dir / f"step_{step:010d}"
    made = not (target / METADATA).exists()
    if made:
        tmp = checkpoint_dir / f".snapshot-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(checkpoint_dir / RUN, tmp)
        (tmp / METADATA).write_text(json.dumps({"step": step}))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    for old in sorted(checkpoint_dir.glob("step_*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return made
