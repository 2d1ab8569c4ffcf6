"""Shared fixtures: every test gets its own AUTORESEARCH_HOME and MLflow store under a temp dir."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh AUTORESEARCH_HOME with SQLite queue and MLflow stores inside it."""
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv("AUTORESEARCH_HOME", str(root))
    monkeypatch.delenv("AUTORESEARCH_DB_URL", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "AUTORESEARCH_DEVICES", "AUTORESEARCH_FAULTS"):
        monkeypatch.delenv(var, raising=False)
    return root
