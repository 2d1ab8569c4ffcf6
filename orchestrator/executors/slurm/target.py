"""Where a Slurm executor's attempts go: the partition, account and QoS of the settings, as sbatch options and
in messages, and checked once at `serve` (`sbatch --test-only`, the partition's nodes) so that a target Slurm
refuses is one line and exit 2 before anything is touched."""

from __future__ import annotations

from typing import Optional

from orchestrator.core import devices as devspec
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.executors.slurm import jobs as sj


def placement_options(partition: Optional[str], account: Optional[str], qos: Optional[str]) -> list[str]:
    """The sbatch options that say where attempts go."""
    options = [f"--partition={partition}"] if partition else []
    options += [f"--account={account}"] if account else []
    return options + ([f"--qos={qos}"] if qos else [])


def describe_target(partition: Optional[str], account: Optional[str], qos: Optional[str]) -> str:
    """`partition P, account A, qos Q` for messages."""
    parts = [f"partition {partition}" if partition else "the default partition"]
    parts += [f"account {account}"] if account else []
    return ", ".join(parts + ([f"qos {qos}"] if qos else []))


def check_target(settings: Settings) -> list[tuple[str, int, int]]:
    """The nodes (name, CPUs, GPUs) of the partition the settings name, once the controller has said that a
    job there under the account and QoS would be accepted (`sbatch --test-only`); BadInput (one line)
    when it would not, or when Slurm cannot be asked."""
    target = (getattr(settings, "slurm_partition", None), getattr(settings, "slurm_account", None),
              getattr(settings, "slurm_qos", None))
    try:
        nodes = sj.partition_nodes(target[0])
        if not nodes:
            what = f"partition {target[0]!r}" if target[0] else "default partition"
            raise BadInput(f"the Slurm cluster has no {what} with nodes (see `sinfo`)")
        sj.check_submit(placement_options(*target))
    except sj.SlurmError as exc:
        raise BadInput(f"slurm refuses {describe_target(*target)}: {exc}") from None
    spec = str(settings.devices or "auto")
    if spec.startswith("cpu:"):
        devspec.parse(spec)
    elif spec != "auto":
        raise BadInput(f"with --executor slurm, --devices is auto (the partition's GPUs) or cpu:N, not "
                       f"{spec!r}: Slurm picks the GPUs itself")
    elif sum(n[2] for n in nodes) < 1:
        raise BadInput(f"{describe_target(*target)} has no GPUs (gres gpu); use --devices cpu:N for N slots "
                       "of one Slurm CPU each")
    return nodes
