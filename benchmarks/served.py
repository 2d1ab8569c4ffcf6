"""`autoresearch serve` in its own process on a fresh home, as users run it: shared by the queue benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


class Served:
    """A service on `cpu:SLOTS` for `home`; this process's environment points at the same home, so the library
    API (`api.submit`, `self.store`) talks to it."""

    def __init__(self, home: Path, slots: int):
        home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "AUTORESEARCH_HOME": str(home),
                    "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}"}
        self.env.pop("AUTORESEARCH_DB_URL", None)
        os.environ.pop("AUTORESEARCH_DB_URL", None)
        os.environ.update(self.env)
        from orchestrator.core.config import Settings
        from orchestrator.queue.store import JobStore

        self.settings = Settings.load()
        self.store = JobStore(self.settings.db_url)
        self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--devices",
                                      f"cpu:{slots}", "--preempt-after", "0"], env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while not self.store.hosts.services(max_age=10):
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("autoresearch serve did not come up")
            time.sleep(0.05)
        # Time the steady state: the service's start-up device check holds its devices out of scheduling until
        # it ends (the first job after a start waits for it), so wait for every device's first check.
        while os.environ.get("AUTORESEARCH_PREFLIGHT") != "off" and not all(d.checked_at
                                                                            for d in self.store.hosts.devices()):
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("autoresearch serve did not finish its start-up check")
            time.sleep(0.05)
        time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
