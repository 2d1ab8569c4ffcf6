"""`serve --mps`: one MPS control daemon per GPU, found again after a crash, stopped at shutdown, and the
environment that makes a job sharing a GPU its client.

No machine here has a GPU or the driver's MPS, so `nvidia-cuda-mps-control` is a stand-in put first on PATH
(the edge): it records every call (argv, the MPS variables, stdin) and, like the real one, daemonises with
`-d` (a process of its own that writes its pid file in the pipe folder and runs until told `quit`), refuses a
second daemon on the same folder, and answers `get_server_list` with 0 only while a daemon runs there. The
real program's behaviour it copies was seen on an H200 (driver 580): see orchestrator.executors.local.mps.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from orchestrator.core.config import Settings
from orchestrator.core.layout import Layout
from orchestrator.executors.base import job_env
from orchestrator.executors.local import mps
from orchestrator.executors.local.mps import MAX_PIPE_DIR, MISSING, MpsControl
from orchestrator.queue.models import Job
from tests.orchestrator.helpers import wait_for

UUID_0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"  # what the stand-in NVML says GPU 0 is
UUID_B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"  # a GPU the service was given by UUID

FAKE = r'''
import json, os, sys, time

record = os.environ["FAKE_MPS_RECORD"]
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")


def note(**what):
    with open(record, "a") as fh:
        fh.write(json.dumps(what) + "\n")


def running():
    try:
        pid = int(open(pid_file).read())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


stdin = "" if "-d" in sys.argv else sys.stdin.read()
note(argv=sys.argv[1:], stdin=stdin, **{k: os.environ.get(k) for k in
     ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")})
if "-d" in sys.argv:
    if running():
        print("An instance of this daemon is already running")
        sys.exit(1)
    if os.fork():
        sys.exit(0)  # like the real one: returns once it has daemonised
    os.setsid()
    if os.fork():
        os._exit(0)
    time.sleep(0.1)  # the real daemon's folder is not ready the instant `-d` returns either
    with open(pid_file + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)
    note(daemon=os.getpid(), pipe=pipe)
    quit_file = os.path.join(pipe, "quit")
    while not os.path.exists(quit_file):
        time.sleep(0.02)
    os.unlink(quit_file)
    os.unlink(pid_file)
    os._exit(0)
if not running():
    print("Cannot find MPS control daemon process")
    sys.exit(1)
if stdin.strip() == "quit":
    open(os.path.join(pipe, "quit"), "w").close()
'''


class FakeMps:
    """The stand-in on PATH and what it recorded."""

    def __init__(self, root: Path):
        self.bin = root / "bin"
        self.bin.mkdir()
        self.record = root / "mps-calls.jsonl"
        self.record.touch()
        exe = self.bin / "nvidia-cuda-mps-control"
        exe.write_text(f"#!{sys.executable}\n{FAKE}")
        exe.chmod(0o755)

    def calls(self) -> list[dict]:
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def starts(self) -> list[dict]:
        return [c for c in self.calls() if c.get("argv") == ["-d"]]

    def commands(self, text: str) -> list[dict]:
        return [c for c in self.calls() if c.get("stdin", "").strip() == text]

    def daemons(self) -> dict[str, int]:
        """Pipe folder -> pid of each daemon the stand-in started."""
        return {c["pipe"]: c["daemon"] for c in self.calls() if "daemon" in c}

    def kill_all(self) -> None:
        for pid in self.daemons().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def fake(tmp_path, monkeypatch):
    stand_in = FakeMps(tmp_path)
    monkeypatch.setenv("PATH", f"{stand_in.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(stand_in.record))
    yield stand_in
    stand_in.kill_all()


@pytest.fixture
def short_home():
    """A home whose pipe folders fit (pytest's tmp_path may be long enough to need the /tmp fallback)."""
    path = Path(tempfile.mkdtemp(prefix="arh-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def nvml(names: list[str]) -> dict[str, str]:
    """The stand-in NVML: GPU 0 only."""
    return {n: UUID_0 for n in names if n == "0"}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def private(path: Path) -> bool:
    info = path.stat()
    return info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700


def test_start_runs_one_daemon_per_gpu_with_its_own_short_folders(fake, short_home):
    control = MpsControl(short_home, ["cpu:0", "0", UUID_B], uuids=nvml).start()
    try:
        assert sorted(control.daemons) == ["0", UUID_B] and not control.notes  # never a cpu slot
        starts = fake.starts()
        assert len(starts) == 2
        key_b = mps.device_key(UUID_B)
        want = {UUID_0: short_home / "mps" / "0", UUID_B: short_home / "mps" / key_b}
        for call in starts:  # the daemon sees its GPU by UUID, the name its clients use too
            base = want[call["CUDA_VISIBLE_DEVICES"]]
            assert call["CUDA_MPS_PIPE_DIRECTORY"] == str(base / "pipe")
            assert call["CUDA_MPS_LOG_DIRECTORY"] == str(base / "log")
            assert len(call["CUDA_MPS_PIPE_DIRECTORY"].encode()) <= MAX_PIPE_DIR
            assert private(base / "pipe")
        daemons = fake.daemons()
        assert len(daemons) == 2 and not any(gone(pid) for pid in daemons.values())
    finally:
        control.stop()


def test_a_home_too_long_for_a_socket_path_gets_a_private_pipe_folder_under_tmp(fake, tmp_path):
    home = tmp_path / ("h" * 90)
    control = MpsControl(home, ["0"], uuids=nvml).start()
    root = mps.short_root(home)
    try:
        [call] = fake.starts()
        assert call["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "0")
        assert len(call["CUDA_MPS_PIPE_DIRECTORY"].encode()) <= MAX_PIPE_DIR
        assert call["CUDA_MPS_LOG_DIRECTORY"] == str(home / "mps" / "0" / "log")  # logs stay in the home
        assert private(root) and private(root / "0")
        assert control.client_env("0", 0.5)["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "0")
    finally:
        control.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_job_sharing_a_gpu_gets_its_daemon_and_its_share(fake, short_home):
    control = MpsControl(short_home, ["0", "1", UUID_B], uuids=nvml).start()
    try:
        base = short_home / "mps" / "0"
        assert control.client_env("0", 0.25, 10 * 2**30) == {
            "CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(base / "log"),
            "CUDA_VISIBLE_DEVICES": UUID_0,  # the server shows its one GPU as device 0: an index would be wrong
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        }
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in control.client_env(UUID_B, 0.5)  # no limit named
        assert control.client_env(UUID_B, 1 / 3)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "33"
        assert control.client_env(UUID_B, 0.001)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
        assert control.client_env("0", None) == {}  # a whole GPU: not a client
        # GPU 1: NVML names no UUID for it, so it is left out of MPS, with its line.
        assert control.client_env("1", 0.25) == {} and not control.manages("1")
        assert control.notes == ["serve --mps: GPU 1: no UUID from NVML to name it to MPS clients; "
                                 "its jobs share it by time-slicing"]
    finally:
        control.stop()


def test_stop_tells_each_daemon_to_quit_and_it_is_gone(fake, short_home):
    control = MpsControl(short_home, ["0", UUID_B], uuids=nvml).start()
    daemons = fake.daemons()
    control.stop()
    quits = fake.commands("quit")
    assert sorted(c["CUDA_MPS_PIPE_DIRECTORY"] for c in quits) == sorted(daemons)
    for pid in daemons.values():
        wait_for(lambda: gone(pid), timeout=10, what=f"daemon {pid} to end")
    assert control.daemons == {}


def test_a_daemon_left_by_a_killed_service_is_adopted_not_started_twice(fake, short_home):
    first = MpsControl(short_home, ["0"], uuids=nvml).start()
    [pid] = fake.daemons().values()
    del first  # the service was kill -9ed: nothing stopped its daemon
    second = MpsControl(short_home, ["0"], uuids=nvml).start()
    assert second.daemons["0"].adopted and second.daemons["0"].pid() == pid
    assert len(fake.starts()) == 1 and not gone(pid)
    assert second.client_env("0", 0.5)["CUDA_MPS_PIPE_DIRECTORY"] == str(short_home / "mps" / "0" / "pipe")
    second.stop()
    wait_for(lambda: gone(pid), timeout=10, what="the adopted daemon to end")


def test_a_daemon_whose_clients_still_run_outlives_the_service_for_the_next_to_adopt(fake, short_home):
    control = MpsControl(short_home, ["0"], uuids=nvml).start()
    [pid] = fake.daemons().values()
    client = subprocess.Popen(["sleep", "60"], env={**os.environ, **control.client_env("0", 0.5)})
    try:
        control.stop()  # a job left running when the service stops is still its client
        assert fake.commands("quit") == [] and not gone(pid)
    finally:
        client.kill()
        client.wait()
    again = MpsControl(short_home, ["0"], uuids=nvml).start()
    assert again.daemons["0"].adopted and len(fake.starts()) == 1
    again.stop()
    wait_for(lambda: gone(pid), timeout=10, what="the daemon to end")


def test_without_the_control_program_one_line_and_no_mps(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    with caplog.at_level(logging.WARNING, logger=mps.__name__):
        control = MpsControl(tmp_path / "home", ["0", UUID_B], uuids=nvml).start()
    assert control.notes == [MISSING]
    assert [r.getMessage() for r in caplog.records] == [MISSING]
    assert MISSING == ("serve --mps: nvidia-cuda-mps-control not found on PATH; jobs share GPUs by time-slicing")
    assert control.client_env(UUID_B, 0.25) == {}
    control.stop()  # nothing to stop: no error


def test_the_local_executor_makes_sharing_jobs_clients_and_stops_the_daemon_on_close(fake, short_home,
                                                                                      monkeypatch):
    """The wiring: `mps` on (as `serve --mps` sets it), the executor starts the daemons, gives a sharing job
    the client variables at launch (a whole-GPU job none) and stops the daemons when it closes."""
    from orchestrator.executors.local.executor import LocalExecutor

    monkeypatch.setenv("AUTORESEARCH_HOME", str(short_home))
    monkeypatch.setenv("AUTORESEARCH_MPS", "1")
    settings = Settings.load(devices=UUID_B, warm=False)
    assert settings.mps
    layout = Layout(short_home)
    exits: queue.Queue = queue.Queue()
    executor = LocalExecutor.create(settings, layout, exits.put)
    [daemon] = fake.daemons().values()
    try:
        for job_id, share in ((1, 0.25), (2, None)):
            dump = ("import json, os; "
                    f"json.dump(dict(os.environ), open({str(short_home / f'env-{job_id}.json')!r}, 'w'))")
            job = Job(id=job_id, attempts=1, gpus=1, devices=[UUID_B], gpu_share=share, gpu_memory=2 * 2**30,
                      argv=[sys.executable, "-c", dump],
                      cwd=str(short_home), grace=2.0, log_path=str(short_home / f"{job_id}.log"), track=False)
            executor.launch(job, job_env(job, base=dict(os.environ), layout=layout, tracking_uri=""))
            assert exits.get(timeout=30).code == 0
        shared, whole = (json.loads((short_home / f"env-{i}.json").read_text()) for i in (1, 2))
        assert shared["CUDA_MPS_PIPE_DIRECTORY"] == str(mps.pipe_and_log_dirs(short_home, UUID_B)[0])
        assert shared["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert shared["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
        assert shared["CUDA_VISIBLE_DEVICES"] == UUID_B
        assert not any(k.startswith("CUDA_MPS_") for k in whole) and whole["CUDA_VISIBLE_DEVICES"] == UUID_B
    finally:
        executor.close()
    wait_for(lambda: gone(daemon), timeout=10, what="the daemon to end at close")


def test_serve_mps_is_refused_off_the_local_executor_in_one_line(home):
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "serve", "--mps", "--executor", "ray"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("autoresearch: --mps runs MPS daemons on this host: it needs --executor local, "
                                  "not ray")
