"""SQLModel tables of the queue: jobs, their event log, devices, and live services.

Times are UNIX seconds (floats): comparable across hosts, cheap to index, exact in SQLite and PostgreSQL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from sqlalchemy import JSON, BigInteger, Column, Index, UniqueConstraint, text
from sqlmodel import Field, SQLModel

from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.core.gpushare import gpu_request, parse_gpus
from orchestrator.queue.plantypes import check_preemptible
from orchestrator.queue.states import FINISHED, JobState, StopCause
from orchestrator.queue.policy import DEFAULT_PROJECT
from runtime import protocol

# Stated bounds of what a submitter may ask for: both backends store these as 32-bit integers, and a number
# beyond them is a typo, not a plan.
PRIORITY_RANGE = (-1_000_000, 1_000_000)
MAX_GPUS = 1_000_000
MAX_ATTEMPTS = 1_000
MAX_NODES = 10_000
KEEP_MODES = ("all", "latest", "none")  # what a finished job keeps of its checkpoint dir (--keep-checkpoint)


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class JobSpec:
    """What a submitter asks for. Validated here so every entry point (CLI, agent, API) gets the same rules."""

    argv: list[str]
    name: str = ""
    priority: int = 10
    # Whole devices, or a share of one as a float 1/k (0.25: a quarter of one GPU); a share is kept as
    # `gpu_share` with `gpus` 1 once validated. `gpu_memory`: bytes of GPU memory a sharing job needs.
    gpus: Union[int, float] = 1
    gpu_share: Optional[float] = None
    gpu_memory: Optional[int] = None
    max_attempts: int = 1
    grace: float = Settings.stop_grace
    preemptible: bool = True
    owner: str = "human"
    experiment: Optional[str] = None
    params: Optional[dict[str, Any]] = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    track: bool = True  # create an MLflow run for the job (MLFLOW_RUN_ID); --no-track skips it
    mlflow_run_id: Optional[str] = None
    idempotency_key: Optional[str] = None
    time_limit: Optional[float] = None  # seconds an attempt may run; then stopped and FAILED ("time limit exceeded")
    # The job's software environment (orchestrator.api.jobenv checks and resolves these at submit): the dotenv
    # file whose values are merged into `env` (its path is shown; its values never are), a container image
    # and the content id it resolved to, bind mounts `SRC:DST[:ro]`.
    env_file: Optional[str] = None
    image: Optional[str] = None
    image_id: Optional[str] = None
    mounts: Optional[list[str]] = None
    # Sharing the devices (orchestrator.queue.projects): the project charged for the job, whether it only uses
    # idle devices (never charged, preempted first), and the time (UNIX seconds) it must finish by.
    project: str = DEFAULT_PROJECT
    scavenger: bool = False
    deadline: Optional[float] = None
    # Checkpoint retention (orchestrator.service.retention): all | latest | none, None for the policy's default; and
    # for agent trials, the phase (baseline | search | confirm) that decides what of them is kept.
    keep_checkpoint: Optional[str] = None
    phase: Optional[str] = None
    # A job across nodes (`--nodes N [--min-nodes M]`): `gpus` is then per node, and a cluster executor (Slurm)
    # places all N nodes at once; with `min_nodes` it may start on fewer (its checkpoint reshards on load).
    nodes: int = 1
    min_nodes: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv) or not self.argv[0].strip():
            raise BadInput("the command is empty: give it after `--`, e.g. autoresearch submit -- python train.py")
        check_priority(self.priority)
        if self.gpu_share is None and isinstance(self.gpus, float):
            gpus, share = parse_gpus(self.gpus)
            object.__setattr__(self, "gpus", gpus)
            object.__setattr__(self, "gpu_share", share)
        elif self.gpu_share is not None:
            if self.gpus != 1:
                raise BadInput("a share of one GPU needs gpus 1 (pass --gpus 0.25 alone)")
            object.__setattr__(self, "gpu_share", parse_gpus(self.gpu_share)[1])
        if not _int_in(self.gpus, 1, MAX_GPUS):
            raise BadInput(f"--gpus must be an integer from 1 to {MAX_GPUS} or a share of one GPU "
                           f"(0.5, 0.25, ...), got {self.gpus!r}")
        if self.gpu_memory is not None:
            if self.gpu_share is None:
                raise BadInput("--gpu-memory goes with a share of one GPU (--gpus 0.5 --gpu-memory 20GiB): a "
                               "job on whole GPUs has all of their memory")
            if not _int_in(self.gpu_memory, 1, 2**62):
                raise BadInput(f"--gpu-memory must be a positive number of bytes, got {self.gpu_memory!r}")
        if not _int_in(self.max_attempts, 1, MAX_ATTEMPTS):
            raise BadInput(f"--max-attempts must be an integer from 1 to {MAX_ATTEMPTS}, got {self.max_attempts!r}")
        if not (isinstance(self.grace, (int, float)) and 0 <= self.grace <= 86400):
            raise BadInput(f"--grace must be between 0 and 86400 seconds, got {self.grace!r}")
        if self.time_limit is not None and not (isinstance(self.time_limit, (int, float))
                                                and not isinstance(self.time_limit, bool)
                                                and 0 < self.time_limit <= 30 * 86400):
            raise BadInput(f"--time-limit must be more than 0 and at most 30 days, got {self.time_limit!r}")
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in self.env.items()):
            raise BadInput("env overrides must map strings to strings")
        taken = sorted(set(self.env) & set(protocol.SET_BY_EXECUTOR))
        if taken:
            raise BadInput(f"--env {taken[0]}: set by autoresearch for every attempt (the job protocol); "
                           "pass the value another way, e.g. --param or a variable of your own")
        if self.mounts and not self.image:
            raise BadInput("--mount needs --image (a job without an image sees the host's files already)")
        check_preemptible(self.preemptible, self.scavenger)
        if not isinstance(self.project, str) or not self.project.strip():
            raise BadInput("--project must be a non-empty name")
        if self.deadline is not None and not (isinstance(self.deadline, (int, float))
                                              and not isinstance(self.deadline, bool)):
            raise BadInput(f"--deadline must be a time, got {self.deadline!r}")
        check_nodes(self.nodes, self.min_nodes)
        if self.nodes > 1 and self.gpu_share is not None:
            raise BadInput("a share of one GPU runs on one node: drop --nodes or give whole GPUs per node")
        if self.keep_checkpoint is not None and self.keep_checkpoint not in KEEP_MODES:
            raise BadInput(f"--keep-checkpoint must be one of {', '.join(KEEP_MODES)}, got {self.keep_checkpoint!r}")


def check_nodes(nodes: Any, min_nodes: Any) -> None:
    """BadInput unless `nodes` is a node count and `min_nodes` None or a count up to it (`--nodes`, `--min-nodes`:
    a job's, or each trial's of a session)."""
    if not _int_in(nodes, 1, MAX_NODES):
        raise BadInput(f"--nodes must be an integer from 1 to {MAX_NODES}, got {nodes!r}")
    if min_nodes is not None and not _int_in(min_nodes, 1, nodes):
        raise BadInput(f"--min-nodes must be an integer from 1 to --nodes ({nodes}), got {min_nodes!r}")


def check_priority(priority: Any) -> int:
    """`priority` if it is an integer within PRIORITY_RANGE, else BadInput naming the range."""
    low, high = PRIORITY_RANGE
    if not _int_in(priority, low, high):
        raise BadInput(f"--priority must be an integer from {low} to {high}, got {priority!r}")
    return priority

# `Job.retrying` in SQL, as text with literals (see `ix_jobs_retrying`).
RETRYING_SQL = f"state = '{JobState.FAILED.value}' AND failures < max_attempts"


class Job(SQLModel, table=True):
    """One queued command and everything known about its attempts."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_state_priority", "state", "priority", "submitted_at"),
        # Line order exactly (priority descending, then submit time, then id): a dispatch pass reads the first
        # few queued jobs from this index instead of sorting every queued job (which grows with the queue).
        Index("ix_jobs_line", "state", text("priority DESC"), "submitted_at", "id"),
        # Jobs awaiting a retry (housekeeping reads those due every second; `queue` lists them): a partial
        # index, so neither reads every FAILED job, most of which failed for good. Queries spell its condition
        # with literals (`RETRYING_SQL`): a planner can only match a partial index on constants.
        Index("ix_jobs_retrying", "state", "not_before", sqlite_where=text(RETRYING_SQL),
              postgresql_where=text(RETRYING_SQL)),
        # Jobs whose MLflow run the service made and has not ended (orchestrator.queue.runs): a few at any time.
        Index("ix_jobs_runs_open", "finished_at", sqlite_where=text("run_open_at IS NOT NULL"),
              postgresql_where=text("run_open_at IS NOT NULL")),
        # A project's line (a pass reads the first few of each project's, orchestrator.queue.projects).
        Index("ix_jobs_project_line", "state", "project", "scavenger", text("priority DESC"), "submitted_at",
              "id"),
        # Queued jobs with a deadline (housekeeping ends those that can no longer meet it): a partial index.
        Index("ix_jobs_deadline", "state", "deadline", sqlite_where=text("deadline IS NOT NULL"),
              postgresql_where=text("deadline IS NOT NULL")),
        UniqueConstraint("idempotency_key", name="uq_jobs_idempotency_key"),
    )

    id: Optional[int] = Field(default=None, sa_column_kwargs={"autoincrement": True}, primary_key=True)
    name: str = ""
    argv: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    env: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    cwd: Optional[str] = None
    track: bool = True
    priority: int = 10
    gpus: int = 1
    max_attempts: int = 1
    grace: float = Settings.stop_grace
    preemptible: bool = True
    owner: str = Field(default="human", index=True)
    experiment: Optional[str] = Field(default=None, index=True)
    params: Optional[dict] = Field(default=None, sa_column=Column(JSON, nullable=True))
    idempotency_key: Optional[str] = None
    time_limit: Optional[float] = None
    image: Optional[str] = None  # container image as given; None: runs in the service's environment
    image_id: Optional[str] = None  # the image's content id at submit (sha256:...): what runs
    mounts: Optional[list] = Field(default=None, sa_column=Column(JSON, nullable=True))
    env_file: Optional[str] = None  # where `env` values came from (shown instead of them)
    # Projects, scavengers and deadlines (nullable, with server defaults: `add_missing_columns` fills them in older databases).
    project: Optional[str] = Field(default=DEFAULT_PROJECT, sa_column_kwargs={"server_default": DEFAULT_PROJECT})
    scavenger: Optional[bool] = Field(default=False, sa_column_kwargs={"server_default": "0"})
    deadline: Optional[float] = None  # UNIX seconds the job must finish by (not started when it cannot)
    # Sharing one GPU (`--gpus 0.25`): the job's share of its one device (1/k, k from 2 to 16; None: whole
    # devices, `gpus` of them) and the GPU memory it asked for, in bytes (None: its share of the device's).
    gpu_share: Optional[float] = None
    gpu_memory: Optional[int] = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    # Checkpoint retention (orchestrator.service.retention): the submitter's wish (all | latest | none; None: the
    # policy's default), an agent trial's phase, and its score in its session's ranking (higher is better,
    # set by the session once the trial's value is known). What retention did: when, and `removed`/`trimmed`.
    keep_checkpoint: Optional[str] = None
    phase: Optional[str] = None
    score: Optional[float] = None
    checkpoint_gc_at: Optional[float] = None
    checkpoint_gc: Optional[str] = None
    # A job across nodes: how many (None: one) and the fewest it may start on (None: all of them). `gpus` is then
    # what the job holds in all (nodes x per node: what the queue counts); `gpus_per_node` what each node gives.
    nodes: Optional[int] = None
    min_nodes: Optional[int] = None

    state: str = Field(default=JobState.QUEUED.value, index=True)
    reason: str = ""
    attempts: int = 0  # times started (AUTORESEARCH_ATTEMPT)
    failures: int = 0  # failed attempts; retried while failures < max_attempts
    preemptions: int = 0
    devices: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    host: Optional[str] = None
    pid: Optional[int] = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    proc_start: Optional[str] = None  # /proc start time of pid, to tell a reused pid from ours
    exit_code: Optional[int] = None
    log_path: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    mlflow_run_id: Optional[str] = None

    submitted_at: float = 0.0
    started_at: Optional[float] = None  # current/last attempt entered RUNNING
    finished_at: Optional[float] = None
    not_before: Optional[float] = None  # retry backoff: not requeued before this time
    stop_sent_at: Optional[float] = None  # SIGTERM sent for PREEMPTING/CANCELLING; SIGKILL after grace
    run_open_at: Optional[float] = None  # the service made this job's MLflow run then, and has not ended it
    stop_cause: Optional[str] = None  # why the service stopped it, as data (`StopCause`); None: it was not

    @property
    def job_state(self) -> JobState:
        return JobState(self.state)

    @property
    def shares_gpu(self) -> bool:
        """Whether the job runs on a share of one GPU (`--gpus 0.25`) beside other jobs."""
        return self.gpu_share is not None and self.gpu_share < 1

    @property
    def node_count(self) -> int:
        """The nodes the job asks for (1 for a job on one host)."""
        return int(self.nodes or 1)

    @property
    def gpus_per_node(self) -> int:
        """The devices each of the job's nodes gives it."""
        return max(1, int(self.gpus) // self.node_count)

    @property
    def gpu_request(self) -> Union[int, float]:
        """Whole devices, or the share of one (what projects, quotas and the usage ledger count)."""
        return gpu_request(self.gpus, self.gpu_share)

    # ---- the job's rules: the one place that decides whether a job is final or will be retried ----------

    @property
    def retrying(self) -> bool:
        """FAILED with attempts left: it goes back in line after its backoff (the job states)."""
        return self.state == JobState.FAILED.value and self.failures < self.max_attempts

    @property
    def timed_out(self) -> bool:
        """Stopped (or being stopped) for running past its time limit: FAILED for good once it has exited."""
        return self.stop_cause == StopCause.TIME_LIMIT.value

    @property
    def is_remote(self) -> bool:
        """Whether the attempt's handle is a remote executor's (`ray:SID@ADDRESS`), not a local process's."""
        return bool(self.proc_start) and ":" in str(self.proc_start)

    @property
    def needs_run(self) -> bool:
        """Tracked and without its MLflow run yet: the service makes the run before the job starts."""
        return bool(self.track) and self.mlflow_run_id is None

    @classmethod
    def needs_run_sql(cls) -> Any:
        """`needs_run` as a SQL expression, for reads over many jobs."""
        return cls.__table__.c.track & cls.__table__.c.mlflow_run_id.is_(None)

    @property
    def final(self) -> bool:
        """Finished for good: SUCCEEDED, CANCELLED, or FAILED with no attempts left. Never changes again."""
        return JobState(self.state) in FINISHED and not self.retrying

    @property
    def retries_after_failure(self) -> bool:
        """Whether this attempt failing (one more failure) would still leave an attempt to retry with."""
        return self.failures + 1 < self.max_attempts

    @classmethod
    def retrying_sql(cls) -> Any:
        """`retrying` as a SQL condition, for queries over many jobs (it matches `ix_jobs_retrying`)."""
        return text(RETRYING_SQL)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `queue --json` / `show --json` (the CLI's documented fields first)."""
        return job_dict({name: getattr(self, name) for name in self.__table__.columns.keys()})


def job_dict(job: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON shape of `queue --json` / `show --json` (the CLI's documented fields first) from the jobs table's column
    values by name: a `Job`'s, or a SQLAlchemy Core row's as a plain dict (listings read those: at 10,000 jobs
    an ORM object, or even attribute access on a Core row, per job cost more than the query)."""
    return {
        "id": job["id"], "name": job["name"], "state": job["state"], "priority": job["priority"],
        "gpus": gpu_request(job["gpus"], job.get("gpu_share")), "gpu_memory": job.get("gpu_memory"),
        "devices": list(job["devices"] or []), "attempts": job["attempts"],
        "preemptions": job["preemptions"], "exit_code": job["exit_code"], "mlflow_run_id": job["mlflow_run_id"],
        "owner": job["owner"], "experiment": job["experiment"], "params": job["params"],
        "argv": list(job["argv"] or []), "cwd": job["cwd"], "max_attempts": job["max_attempts"],
        "failures": job["failures"], "grace": job["grace"], "preemptible": job["preemptible"],
        "reason": job["reason"], "host": job["host"], "pid": job["pid"], "log_path": job["log_path"],
        "checkpoint_dir": job["checkpoint_dir"], "submitted_at": job["submitted_at"],
        "started_at": job["started_at"], "finished_at": job["finished_at"], "not_before": job["not_before"],
        "idempotency_key": job["idempotency_key"], "time_limit": job["time_limit"],
        # Names only: values may be secrets (--env-file), and `show`/`queue` never print them.
        "env": sorted((job["env"] or {}).keys()), "env_file": job["env_file"],
        "image": job["image"], "image_id": job["image_id"], "mounts": list(job["mounts"] or []),
        # The attempt's job on a cluster executor (`slurm:ID`, `ray:SID@ADDRESS`); None for local processes.
        "cluster_job": job["proc_start"] if ":" in str(job["proc_start"] or "") else None,
        "project": job["project"] or DEFAULT_PROJECT, "scavenger": bool(job["scavenger"]), "deadline": job["deadline"],
        "keep_checkpoint": job.get("keep_checkpoint"), "phase": job.get("phase"), "score": job.get("score"),
        "checkpoint_gc": job.get("checkpoint_gc"), "checkpoint_gc_at": job.get("checkpoint_gc_at"),
        "nodes": job.get("nodes") or 1, "min_nodes": job.get("min_nodes"),
    }


class ProjectRecord(SQLModel, table=True):
    """A project sharing the devices (`autoresearch projects set`): its fair-share weight, its guaranteed
    devices and how many devices beyond them it may borrow (None: no cap). config.toml may declare more."""

    __tablename__ = "projects"

    name: str = Field(primary_key=True)
    share: float = 1.0
    quota: int = 0
    borrow_limit: Optional[int] = None
    updated_at: float = 0.0


class JobEvent(SQLModel, table=True):
    """One state transition of one job: the audit log behind `autoresearch show`."""

    __tablename__ = "job_events"

    id: Optional[int] = Field(default=None, primary_key=True)
    job_id: int = Field(index=True)
    at: float
    src: Optional[str] = None
    dst: str
    reason: str = ""
    host: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return event_dict(self)


def event_dict(event: Any) -> dict[str, Any]:
    """The JSON shape of one event in `show --json`, of a `JobEvent` or a Core row of its table (a handful
    per job: attribute access is cheap enough here)."""
    return {"at": event.at, "from": event.src, "to": event.dst, "reason": event.reason, "host": event.host}


class Device(SQLModel, table=True):
    """A schedulable device of one host: a GPU index or a virtual `cpu:N` slot."""

    __tablename__ = "devices"

    host: str = Field(primary_key=True)
    name: str = Field(primary_key=True)
    position: int = 0
    state: str = "available"  # available | disabled (by a person) | quarantined (by a check)
    reason: str = ""
    checked_at: Optional[float] = None
    last_check: Optional[dict] = Field(default=None, sa_column=Column(JSON, nullable=True))

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "device": self.name, "state": self.state, "reason": self.reason,
                "checked_at": self.checked_at, "last_check": self.last_check}


class ServiceRecord(SQLModel, table=True):
    """A running `serve` process: its heartbeat tells submitters and other hosts whether it is alive."""

    __tablename__ = "services"

    host: str = Field(primary_key=True)
    pid: int = 0
    home: str = ""
    devices: list = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    # The service's --preempt-after: what `top` and `queue` plan with for its devices (None: an older release).
    preempt_after: Optional[float] = Field(default=None, nullable=True)
    disk: Optional[str] = None  # why no job starts for want of disk space (orchestrator.service.diskspace), else None
    executor: Optional[str] = None  # where it runs jobs (local, ray, slurm): a submit across nodes needs slurm


# The GPU busy share's tables live in their own module; importing it here registers them on SQLModel.metadata
# wherever the job tables are (so `Database` creates them).
from orchestrator.queue import gpumodels as _gpumodels  # noqa: E402,F401
