"""Settings: flags first, then `AUTORESEARCH_*` environment variables, then `AUTORESEARCH_HOME/config.toml`.

One `Settings` object is resolved per command (or per service) and handed to each part: the store (retry
backoff), the service (devices, executor, preemption, health checks), the agent (LLM). Nothing else merges
flags, environment and file by hand.

Everything a home holds (queue.db, mlflow.db, artifacts, logs, checkpoints, the data cache, agent state)
lives under one directory so a test or benchmark can point `AUTORESEARCH_HOME` at a temp dir.

config.toml uses the field names below as flat keys, e.g.::

    devices = "cpu:4"
    preempt_after = 120
    hang_timeout = 0
    llm_model = "gpt-4o-mini"

A malformed file, or a value of the wrong type from any source, is `BadInput`: one line naming where the
value came from (exit 2 from every command). So is a key or table no release knows (`preemt_after = 5`,
`[serve]`): an error, not a warning, because a misspelled setting silently falls back to its default (a
`preempt_after` of 60 s where the user wrote 5) and a warning on stderr scrolls away under `serve`'s log. A key of a
newer release met by an older one fails the same way, naming the key, which is one edit to fix; guessing it
harmless is not safe for settings that decide what gets preempted. The keys that parts read themselves (not
`Settings` fields) are listed in `EXTRA_KEYS` and kept in `extra`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

from orchestrator.core.errors import BadInput
from runtime.protocol import home_dir


def home() -> Path:
    """The autoresearch home directory (created if missing). Only the environment can move it: the home is
    where config.toml lives."""
    path = home_dir().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _file_settings(root: Path) -> dict[str, Any]:
    cfg = root / "config.toml"
    try:
        with cfg.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{cfg}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise BadInput(f"{cfg}: cannot read it: {exc.strerror or exc}") from None


def _number(raw: Any) -> float:
    try:
        if isinstance(raw, bool):
            raise ValueError
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError("not a number") from None


def _integer(raw: Any) -> int:
    try:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError("not an integer") from None


def _switch(raw: Any) -> bool:
    """On or off: true/false (a toml bool), 1/0, on/off, yes/no."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "on", "true", "yes"):
        return True
    if text in ("0", "off", "false", "no"):
        return False
    raise ValueError("not on or off (1/0, on/off, true/false)")


def _text(raw: Any) -> str:
    if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
        raise ValueError("not a string")
    return str(raw)


# field -> (environment variable, converter). The environment names are the documented ones; MLflow's and
# OpenAI's own variables keep their names so their clients and ours agree.
_SOURCES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "db_url": ("AUTORESEARCH_DB_URL", _text),
    "tracking_uri": ("MLFLOW_TRACKING_URI", _text),
    "devices": ("AUTORESEARCH_DEVICES", _text),
    "executor": ("AUTORESEARCH_EXECUTOR", _text),
    "ray_address": ("AUTORESEARCH_RAY_ADDRESS", _text),
    "slurm_partition": ("AUTORESEARCH_SLURM_PARTITION", _text),
    "slurm_account": ("AUTORESEARCH_SLURM_ACCOUNT", _text),
    "slurm_qos": ("AUTORESEARCH_SLURM_QOS", _text),
    "preempt_after": ("AUTORESEARCH_PREEMPT_AFTER", _number),
    "retry_backoff": ("AUTORESEARCH_RETRY_BACKOFF", _number),
    "retry_backoff_cap": ("AUTORESEARCH_RETRY_BACKOFF_CAP", _number),
    "preflight": ("AUTORESEARCH_PREFLIGHT", _text),
    "preflight_ttl": ("AUTORESEARCH_PREFLIGHT_TTL", _number),
    "recheck_level": ("AUTORESEARCH_RECHECK_LEVEL", _text),
    "recheck_every": ("AUTORESEARCH_RECHECK_EVERY", _number),
    "monitor_every": ("AUTORESEARCH_MONITOR_EVERY", _number),
    "hang_timeout": ("AUTORESEARCH_HANG_TIMEOUT", _number),
    "monitor_hits": ("AUTORESEARCH_MONITOR_HITS", _integer),
    "nvml_timeout": ("AUTORESEARCH_NVML_TIMEOUT", _number),
    "gpu_sample_interval": ("AUTORESEARCH_GPU_SAMPLE_INTERVAL", _number),
    "llm_model": ("AUTORESEARCH_LLM_MODEL", _text),
    "llm_base_url": ("OPENAI_BASE_URL", _text),
    "llm_price": ("AUTORESEARCH_LLM_PRICE", _text),
    "llm_budget_usd": ("AUTORESEARCH_LLM_BUDGET_USD", _number),
    "llm_budget_tokens": ("AUTORESEARCH_LLM_BUDGET_TOKENS", _integer),
    "pack_target_busy": ("AUTORESEARCH_PACK_TARGET_BUSY", _number),
    "container_engine": ("AUTORESEARCH_CONTAINER_ENGINE", _text),
    "usage_half_life": ("AUTORESEARCH_USAGE_HALF_LIFE", _number),
    "backfill": ("AUTORESEARCH_BACKFILL", _text),
    "retention": ("AUTORESEARCH_RETENTION", _text),
    "keep_best": ("AUTORESEARCH_KEEP_BEST", _integer),
    "keep_people": ("AUTORESEARCH_KEEP_PEOPLE", _text),
    "gc_every": ("AUTORESEARCH_GC_EVERY", _number),
    "log_max_bytes": ("AUTORESEARCH_LOG_MAX_BYTES", _integer),
    "log_compress_days": ("AUTORESEARCH_LOG_COMPRESS_DAYS", _number),
    "log_delete_days": ("AUTORESEARCH_LOG_DELETE_DAYS", _number),
    "events_compact_days": ("AUTORESEARCH_EVENTS_COMPACT_DAYS", _number),
    "disk_min_free_mb": ("AUTORESEARCH_DISK_MIN_FREE_MB", _number),
    "warm": ("AUTORESEARCH_WARM", _switch),
    "mps": ("AUTORESEARCH_MPS", _switch),
    "cgroup": ("AUTORESEARCH_CGROUP", _text),
    "node": ("AUTORESEARCH_NODE", _text),
}


# config.toml tables that are not Settings fields but that a part reads from `Settings.extra` itself: the projects
# (`[projects.NAME]`, orchestrator.queue.projects) and the notifications (`[[notify]]`, orchestrator.service.
# notify). Any other key is refused (see the module docstring for why an error).
EXTRA_KEYS = frozenset({"projects", "notify"})


def environment_value(name: str) -> Optional[str]:
    """Setting `name` as the environment alone gives it (None when unset): for the fast paths that hand a
    request to a running service, which has resolved the rest of its settings itself."""
    return os.environ.get(_SOURCES[name][0]) or None


def known_keys() -> frozenset[str]:
    """Every key config.toml may hold (fastcli checks a file against these before it answers without us)."""
    return frozenset(_SOURCES) | EXTRA_KEYS


def _check_keys(file: dict[str, Any], cfg: Path) -> None:
    known = known_keys()
    for key, value in file.items():
        if key in known:
            continue
        hint = _close(key, known)
        if isinstance(value, dict):
            raise BadInput(f"{cfg}: unknown table [{key}]; config.toml takes flat setting names "
                           "(devices = \"cpu:4\", preempt_after = 120), [projects.NAME] and [[notify]]")
        raise BadInput(f"{cfg}: unknown key {key!r}" + (f" (did you mean {hint!r}?)" if hint else ""))


def _close(key: str, known: frozenset[str]) -> Optional[str]:
    import difflib

    found = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return found[0] if found else None


@dataclass(frozen=True)
class Settings:
    """Resolved settings for one home. Build with `Settings.load(**flags)`; derive with `with_flags`."""

    home: Path
    db_url: str
    tracking_uri: str
    devices: str = "auto"
    executor: str = "local"
    ray_address: Optional[str] = None
    # --executor slurm: where attempts are submitted (None: the cluster's default partition, the user's
    # default account and QoS)
    slurm_partition: Optional[str] = None
    slurm_account: Optional[str] = None
    slurm_qos: Optional[str] = None
    preempt_after: float = 60.0  # minimum runtime (s) before a job may be preempted
    retry_backoff: float = 5.0  # first retry of a failed job after this many seconds, doubling ...
    retry_backoff_cap: float = 300.0  # ... up to this
    # A job's seconds between SIGTERM and SIGKILL when its submitter names none (`--grace`): not a config.toml
    # key, since a job's grace is its own, but declared here once for every face and the queue.
    stop_grace: float = 30.0
    # Device health (see orchestrator.service.health.HealthConfig for their meaning).
    preflight: str = "quick"
    preflight_ttl: float = 30.0
    recheck_level: str = "full"
    recheck_every: float = 600.0
    monitor_every: float = 5.0
    hang_timeout: float = 1800.0
    monitor_hits: int = 3  # consecutive throttle samples before a device counts as faulty
    nvml_timeout: float = 5.0  # seconds an NVML call may take
    # Seconds between the service's samples of its GPUs' utilisation and memory (`top`, `usage`, the busy share
    # on a job's MLflow run and in a session's report); 0: no sampling.
    gpu_sample_interval: float = 2.0
    # The agent's LLM (OPENAI_API_KEY stays in the environment only: never in a file we write or read).
    llm_model: Optional[str] = None
    llm_base_url: Optional[str] = None
    llm_price: Optional[str] = None
    # Default caps on an agent session's LLM spend (`start --llm-budget-usd/--llm-budget-tokens` override).
    llm_budget_usd: Optional[float] = None
    llm_budget_tokens: Optional[int] = None
    # `start --trials-per-gpu auto`: pack trials until the device is about this busy (a share of 1).
    pack_target_busy: float = 0.8
    container_engine: str = "auto"  # for --image jobs: podman, docker, or auto (podman when installed)
    # Projects sharing the devices (orchestrator.queue.projects): the half-life (s) of the usage fair sharing
    # weighs, and whether jobs with a time limit may backfill behind a blocked job ("on" | "off").
    usage_half_life: float = 86400.0
    backfill: str = "on"
    # Retention (orchestrator.service.retention, docs/guides/long-running.md): `ranked` keeps the checkpoints that
    # matter (the best `keep_best` trials of each session, baselines' and confirmations' latest, people's jobs
    # as `keep_people` says), `off` keeps every checkpoint. The service applies it every `gc_every` seconds.
    retention: str = "ranked"
    keep_best: int = 3
    keep_people: str = "all"
    gc_every: float = 60.0
    log_max_bytes: int = 8 * 1024 * 1024  # a job's log keeps its last half of this once it grows past it
    log_compress_days: float = 7.0  # finished jobs' logs are gzipped after this many days (0: never)
    log_delete_days: float = 180.0  # ... and deleted after this many (0: never)
    events_compact_days: float = 90.0  # jobs finished longer ago keep only their first and last events (0: never)
    disk_min_free_mb: float = 1024.0  # below this free on the checkpoint or log filesystem, no job starts
    # The local executor forks Python attempts from a pool with torch and the runtime imported
    # (orchestrator.executors.local.warmstart); off: every attempt starts a fresh interpreter.
    warm: bool = True
    mps: bool = False  # one NVIDIA MPS control daemon per GPU; jobs sharing a GPU run as its clients
    cgroup: str = "auto"  # the local executor's process tracking: auto (cgroup v2 where writable) or off (psutil)
    node: Optional[str] = None  # this host's name in a shared queue (default: the host name plus the home's hash)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("preempt_after", "retry_backoff", "retry_backoff_cap"):
            if getattr(self, name) < 0:
                raise BadInput(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.usage_half_life <= 0:
            raise BadInput(f"usage_half_life must be more than 0 seconds, got {self.usage_half_life!r}")
        if self.backfill not in ("on", "off"):
            raise BadInput(f"backfill must be on or off, got {self.backfill!r}")
        if self.retention not in ("ranked", "off"):
            raise BadInput(f"retention must be ranked or off, got {self.retention!r}")
        if self.keep_people not in ("all", "latest", "none"):
            raise BadInput(f"keep_people must be all, latest or none, got {self.keep_people!r}")
        for name in ("keep_best", "gc_every", "gpu_sample_interval", "log_max_bytes", "log_compress_days",
                     "log_delete_days", "events_compact_days", "disk_min_free_mb"):
            if getattr(self, name) < 0:
                raise BadInput(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.pack_target_busy <= 1:
            raise BadInput(f"pack_target_busy must be in (0, 1], got {self.pack_target_busy!r}")
        if self.executor not in ("local", "ray", "slurm"):
            raise BadInput(f"unknown executor {self.executor!r}; expected local, ray or slurm")

    @classmethod
    def load(cls, **flags: Any) -> "Settings":
        """Resolve settings; a flag given as None falls through to env, then config.toml, then the default."""
        root = home()
        file = _file_settings(root)
        cfg_path = root / "config.toml"
        _check_keys(file, cfg_path)
        defaults = {f.name: f.default for f in fields(cls) if f.name in _SOURCES}
        defaults["db_url"] = f"sqlite:///{root / 'queue.db'}"
        defaults["tracking_uri"] = f"sqlite:///{root / 'mlflow.db'}"
        unknown = set(flags) - set(_SOURCES)
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, (env, convert) in _SOURCES.items():
            if flags.get(name) is not None:
                raw, where = flags[name], f"--{name.replace('_', '-')}"
            elif os.environ.get(env):
                raw, where = os.environ[env], env
            elif name in file:
                raw, where = file[name], f"{cfg_path}: {name}"
            else:
                values[name] = defaults[name]
                continue
            values[name] = _convert(convert, raw, where)
        extra = {k: v for k, v in file.items() if k not in _SOURCES}
        if values.get("ray_address"):
            extra["ray_address"] = values["ray_address"]  # executors that read `extra` still find it
        return cls(home=root, extra=extra, **values)

    def with_flags(self, **flags: Any) -> "Settings":
        """These settings with some flags on top (None: keep the resolved value). Flags win over everything."""
        unknown = set(flags) - set(_SOURCES)
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        given = {k: _convert(_SOURCES[k][1], v, f"--{k.replace('_', '-')}") for k, v in flags.items() if v is not None}
        if not given:
            return self
        extra = dict(self.extra)
        if given.get("ray_address"):
            extra["ray_address"] = given["ray_address"]
        return replace(self, extra=extra, **given)

    @property
    def llm_key_set(self) -> bool:
        """Whether `OPENAI_API_KEY` is set. The key stays in the environment, where the openai client reads it
        (never in a file we write or read): this is the one place that looks for it."""
        return bool(os.environ.get("OPENAI_API_KEY"))

    @property
    def llm_configured(self) -> bool:
        """Whether an OpenAI-compatible endpoint (`llm_base_url`) or a key is configured: the LLM proposes."""
        return bool(self.llm_base_url) or self.llm_key_set

    @property
    def logs_dir(self) -> Path:
        from orchestrator.core.layout import Layout  # the one owner of where a job's files live

        return Layout(self.home).logs_dir

    @property
    def checkpoints_dir(self) -> Path:
        from orchestrator.core.layout import Layout

        return Layout(self.home).checkpoints_dir

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "mlartifacts"


def _convert(convert: Callable[[Any], Any], raw: Any, where: str) -> Any:
    try:
        return convert(raw)
    except (TypeError, ValueError) as exc:
        raise BadInput(f"{where}: {raw!r} is {exc}") from None
