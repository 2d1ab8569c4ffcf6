"""Executors: the only code that knows processes (pids, `/proc`, exit files, Ray handles). `base` is the
interface every executor implements (and a job's environment and argv, which every one of them builds the same
way); `local/` runs attempts as process trees on this host, `ray/` as Ray jobs, `slurm/` as Slurm batch jobs; `container` and `torchrun` wrap
an attempt's command. `executor_class` picks one by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package stays empty at import: the spawner processes import executors.local.spawner
    from orchestrator.executors.base import Executor


def executor_class(name: str) -> type[Executor]:
    """The executor class called `name` (local, ray or slurm), without starting it."""
    if name == "local":
        from orchestrator.executors.local.executor import LocalExecutor

        return LocalExecutor
    if name == "ray":
        from orchestrator.executors.ray.executor import RayExecutor  # Ray itself is imported when one is made

        return RayExecutor
    if name == "slurm":
        from orchestrator.executors.slurm.executor import SlurmExecutor

        return SlurmExecutor
    from orchestrator.core.errors import BadInput

    raise BadInput(f"unknown executor {name!r}; expected local, ray or slurm")
