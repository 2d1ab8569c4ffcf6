"""A test's AUTORESEARCH_HOME, made the same way wherever it lies."""

from __future__ import annotations

from pathlib import Path


def prepare_home(root: Path, monkeypatch, mlflow_template: Path) -> Path:
    """Make `root` this test's AUTORESEARCH_HOME (a copy of the migrated MLflow store inside, the queue and LLM
    variables cleared); the `home` fixture and homes on other filesystems use it."""
    import shutil

    root.mkdir()
    shutil.copy(mlflow_template, root / "mlflow.db")
    monkeypatch.setenv("AUTORESEARCH_HOME", str(root))
    monkeypatch.delenv("AUTORESEARCH_DB_URL", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    # Warm pools (executors.local.warmstart) import only the runtime's context: how attempts are forked is the
    # same, without torch's seconds of CPU per service (the executor contract suite covers both modes).
    monkeypatch.setenv("AUTORESEARCH_WARM_PRELOAD", "runtime.context")
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "AUTORESEARCH_DEVICES", "AUTORESEARCH_FAULTS"):
        monkeypatch.delenv(var, raising=False)
    return root
