"""The soak's own PostgreSQL cluster: `initdb` and `pg_ctl` on a free port in a temp dir.

The soak restarts PostgreSQL as one of its faults, so it never touches a shared server: this cluster is its
alone, made at start and removed at the end. PostgreSQL refuses to run as root, so as root the cluster runs as
the `postgres` user (its directory handed to that user)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if not found:
        raise RuntimeError(f"{name} not found: the soak needs a PostgreSQL server installed (initdb, pg_ctl)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One PostgreSQL cluster under `root` (data dir and log), listening on 127.0.0.1 on a port of its own."""

    def __init__(self, root: Path | None = None):
        # A directory of its own in /tmp (not under the soak's private temp dir: the postgres user must reach it).
        self.root = root or Path(tempfile.mkdtemp(prefix="chaos-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = _free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the `soak` database (trust auth on loopback)."""
        user = "postgres" if self._as else os.environ.get("USER", "postgres")
        return f"postgresql+psycopg2://{user}@127.0.0.1:{self.port}/soak"

    def _run(self, *argv: str) -> None:
        done = subprocess.run([*self._as, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise RuntimeError(f"{Path(argv[0]).name} failed: {done.stderr.strip()[-500:]}")

    def create(self) -> "Cluster":
        """initdb, start, and create the `soak` database."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self._as:
            shutil.chown(self.root, "postgres", "postgres")
        self._run(_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres" if self._as else
                  os.environ.get("USER", "postgres"), "--no-sync")
        with open(self.data / "postgresql.conf", "a") as fh:
            # Fast restarts and no disk syncs: the soak tests the product's recovery, not PostgreSQL's.
            fh.write(f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{self.root}'"
                     "\nfsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n")
        self.start()
        self._run(_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
                  "postgres" if self._as else os.environ.get("USER", "postgres"), "soak")
        return self

    def start(self) -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def restart(self) -> float:
        """Restart the server (fast shutdown: every connection dropped); returns the seconds it was down."""
        t0 = time.time()
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "restart", "-l",
                  str(self.log))
        return time.time() - t0

    def halt(self) -> None:
        """Stop the server (fast shutdown), keeping its data: `start` brings it back."""
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def destroy(self) -> None:
        """Stop the server (immediate) and remove its directory."""
        try:
            self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except RuntimeError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
