"""Settings: flags first, then `AUTORESEARCH_*` environment variables, then `AUTORESEARCH_HOME/config.toml`.

Everything a home holds (queue.db, mlflow.db, artifacts, logs, checkpoints, the data cache, agent state)
lives under one directory so a test or benchmark can point `AUTORESEARCH_HOME` at a temp dir.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def home() -> Path:
    """The autoresearch home directory (created if missing)."""
    path = Path(os.environ.get("AUTORESEARCH_HOME") or Path.home() / ".autoresearch").expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _file_settings(root: Path) -> dict[str, Any]:
    cfg = root / "config.toml"
    if not cfg.exists():
        return {}
    with cfg.open("rb") as fh:
        return tomllib.load(fh)


@dataclass(frozen=True)
class Settings:
    """Resolved settings for one home. Build with `Settings.load(**flags)`."""

    home: Path
    db_url: str
    tracking_uri: str
    devices: str = "auto"
    executor: str = "local"
    preempt_after: float = 60.0
    llm_model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, **flags: Any) -> "Settings":
        """Resolve settings; a flag given as None falls through to env, then config.toml, then the default."""
        root = home()
        file = _file_settings(root)

        def pick(key: str, env: str, default: Any) -> Any:
            if flags.get(key) is not None:
                return flags[key]
            if os.environ.get(env):
                return os.environ[env]
            if key in file:
                return file[key]
            return default

        return cls(
            home=root,
            db_url=pick("db_url", "AUTORESEARCH_DB_URL", f"sqlite:///{root / 'queue.db'}"),
            tracking_uri=pick("tracking_uri", "MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}"),
            devices=str(pick("devices", "AUTORESEARCH_DEVICES", "auto")),
            executor=str(pick("executor", "AUTORESEARCH_EXECUTOR", "local")),
            preempt_after=float(pick("preempt_after", "AUTORESEARCH_PREEMPT_AFTER", 60.0)),
            llm_model=pick("llm_model", "AUTORESEARCH_LLM_MODEL", None),
            extra={k: v for k, v in file.items()},
        )

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def checkpoints_dir(self) -> Path:
        return self.home / "checkpoints"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "mlartifacts"
