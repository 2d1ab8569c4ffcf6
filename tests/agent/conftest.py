"""Agent-test fixtures: every test's MLflow store starts as a copy of one already-migrated empty database.

Creating an MLflow SQLite store runs its schema migrations (seconds on a busy 2-core machine); the tests here
make one per test, so they copy a template made once per run instead (`mlflow_template`, tests/conftest.py).
The store is still a real, fresh one.
"""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(autouse=True)
def _fresh_mlflow_from_template(request):
    if "home" not in request.fixturenames:
        return
    home = request.getfixturevalue("home")
    if not (home / "mlflow.db").exists():
        shutil.copy(request.getfixturevalue("mlflow_template"), home / "mlflow.db")
