"""The tables of the GPU busy share (`orchestrator.queue.gpuuse` reads and writes them; the service's sampler,
`orchestrator.service.gpuwatch`, feeds them).

`device_use`: one row per (host, GPU): the last NVML sample (utilisation, memory, compute pids) and running
integrals since the row was made: seconds observed, busy-seconds (utilisation/100 x seconds), seconds while any
job held the device, and busy-seconds while held. `job_gpu_use`: one row per job that held a GPU: wall seconds
held, device-seconds held (its share of each device x seconds: a `--gpus 0.25` job counts a quarter), busy
device-seconds (the device's utilisation x its share x seconds), the peak device memory used seen while it held
it, and when the service logged these to the job's MLflow run.

Registered on `SQLModel.metadata` by `orchestrator.queue.models` (which imports this module), so `Database`
creates them with the rest.
"""

from __future__ import annotations

from typing import Optional

from sqlalchemy import JSON, BigInteger, Column, Index, text
from sqlmodel import Field, SQLModel


class DeviceUse(SQLModel, table=True):
    """One GPU's last sample and its running integrals."""

    __tablename__ = "device_use"

    host: str = Field(primary_key=True)
    device: str = Field(primary_key=True)
    sampled_at: float = 0.0
    util: float = 0.0  # percent, the last sample
    mem_used: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    mem_total: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    pids: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    seconds: float = 0.0  # observed
    busy_seconds: float = 0.0  # util/100 x dt
    held_seconds: float = 0.0  # dt while any job held it
    busy_held_seconds: float = 0.0  # util/100 x dt while held


class JobGpuUse(SQLModel, table=True):
    """One job's use of the GPUs it held, over all its attempts."""

    __tablename__ = "job_gpu_use"
    # The jobs whose figures are not on their MLflow run yet (the sampler looks every sample): a partial index, so
    # that look never reads every job that ever held a GPU.
    __table_args__ = (Index("ix_job_gpu_use_unlogged", "job_id", sqlite_where=text("logged_at IS NULL"),
                            postgresql_where=text("logged_at IS NULL")),)

    job_id: int = Field(primary_key=True)
    seconds: float = 0.0  # wall seconds it held GPUs
    held_seconds: float = 0.0  # device-seconds held (share x devices x dt)
    busy_seconds: float = 0.0  # busy device-seconds (util/100 x share x dt, summed over its devices)
    peak_memory: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    updated_at: float = 0.0
    logged_at: Optional[float] = None  # the figures went to its MLflow run then (None: not yet)
