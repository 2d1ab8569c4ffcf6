"""A Slurm attempt's shape: one task on one node, or a gang of one launcher per node (`sbatch --nodes=N
--ntasks-per-node=1`, without the nodes the job excludes) whose `srun` starts
`orchestrator.executors.slurm.nodelaunch` on every node."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from orchestrator.executors.slurm import nodes as sn
from orchestrator.queue.models import Job


def shape(home: Path, job: Job, partition_nodes: list[tuple[str, int, int]]) -> list[str]:
    """sbatch's node options: one task on one node, or a gang of one launcher per node without the nodes this
    job excludes. A job that may start on fewer nodes (`min_nodes`) asks for as many as the partition has
    usable now (not excluded, down or drained), at least its minimum: Slurm, given a range, picks the fewest
    that fit one task each, and a fixed task count could never start on fewer."""
    if job.node_count == 1:
        return ["-N1", "-n1"]
    skip = sn.excluded(home, job.id)
    count = job.node_count
    if job.min_nodes and job.min_nodes < count:
        states = sn.slurm_states(n[0] for n in partition_nodes)
        usable = [n for n, state in states.items() if n not in skip and not sn.is_bad(state)]
        count = max(job.min_nodes, min(count, len(usable)))
    options = [f"--nodes={count}", "--ntasks-per-node=1"]
    return options + ([f"--exclude={','.join(skip)}"] if skip else [])


def argv(home: Path, job: Job) -> list[str]:
    """A gang's command: `srun` starts one launcher per node (orchestrator.executors.slurm.nodelaunch), which runs
    torchrun with the job's ranks there; a failed node ends the step everywhere (--kill-on-bad-exit). The
    attempt's node records start empty."""
    records = sn.records_dir(home, job.id, job.attempts)
    if records.exists():
        shutil.rmtree(records, ignore_errors=True)
    records.mkdir(parents=True, exist_ok=True)
    return ["srun", "--kill-on-bad-exit=1", "--export=ALL", sys.executable, "-m",
            "orchestrator.executors.slurm.nodelaunch", str(records), str(job.gpus_per_node), str(job.grace),
            "--", *[str(a) for a in job.argv]]
