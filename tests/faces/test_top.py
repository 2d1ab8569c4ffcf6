"""`autoresearch top`: the next plan it shows, frames cut to the terminal, --once, and the live view under tmux."""

from __future__ import annotations

import io
import shutil
import subprocess
import re
import sys

import pytest
from rich.console import Console

from orchestrator.queue.models import Device, Job, JobEvent, ServiceRecord
from orchestrator.faces.views.snapshot import Snapshot, plan_queue, take
from orchestrator.faces.views.top import render
from tests.orchestrator.helpers import wait_for
from tests.support.requires import require

NOW = 10_000.0


def _job(id, state="QUEUED", priority=0, gpus=1, devices=(), started=None, host="h", name=None):
    return Job(id=id, name=name or f"job-{id}", argv=["true"], state=state, priority=priority, gpus=gpus,
               devices=list(devices), started_at=started, submitted_at=NOW - 100 + id, host=host, owner="human")


def _devices(n, host="h"):
    return [Device(host=host, name=f"cpu:{i}", position=i) for i in range(n)]


SERVICE = ServiceRecord(host="h", pid=1, devices=["cpu:0", "cpu:1", "cpu:2"], heartbeat_at=NOW)


def test_the_next_plan_says_who_starts_who_preempts_whom_and_who_waits():
    running = [_job(1, "RUNNING", 0, devices=["cpu:0"], started=NOW - 500),
               _job(2, "RUNNING", 0, devices=["cpu:1"], started=NOW - 400),   # younger: preempted first
               _job(3, "RUNNING", 30, devices=["cpu:2"], started=NOW - 900)]
    waiting = [_job(10, priority=20), _job(11, priority=15), _job(12, priority=5, gpus=2), _job(13, priority=1),
               _job(14, priority=1, gpus=4)]
    rows, victims = plan_queue(waiting, running, _devices(3), [SERVICE], NOW, preempt_after=60)
    assert victims == {2: 10, 1: 11}
    assert [r.plan for r in rows] == ["preempts #2", "preempts #1", "next, needs 2", "waits behind #12",
                                      "no service has 4 devices"]

    # Too young to preempt: the head of the line waits; a free device starts the first job that fits.
    young = [_job(1, "RUNNING", 0, devices=["cpu:0"], started=NOW - 5)]
    rows, victims = plan_queue([_job(10, priority=20), _job(11)], young, _devices(2), [SERVICE], NOW, 60)
    assert victims == {} and [r.plan for r in rows] == ["starts on cpu:1", "next, needs 1"]
    # Too young now, old enough later: the head of the line says when it preempts whom, and so holds the line.
    full = [_job(1, "RUNNING", 0, devices=["cpu:0"], started=NOW - 5),
            _job(2, "RUNNING", 0, devices=["cpu:1"], started=NOW - 20)]
    rows, victims = plan_queue([_job(10, priority=20), _job(11, priority=10)], full, _devices(2), [SERVICE], NOW, 60)
    assert victims == {} and [r.plan for r in rows] == [
        "will preempt #2 in 40 s (its minimum runtime, --preempt-after 60)", "waits behind #10"]
    own = ServiceRecord(host="h", pid=1, devices=["cpu:0", "cpu:1"], heartbeat_at=NOW, preempt_after=30)
    rows, _ = plan_queue([_job(10, priority=20)], full, _devices(2), [own], NOW, 60)
    assert rows[0].plan == "will preempt #2 in 10 s (its minimum runtime, --preempt-after 30)"  # the service's own
    rows, _ = plan_queue([_job(10)], [], _devices(2), [], NOW, 60)
    assert rows[0].plan == "no service running"


def _busy_snapshot(devices=12, queued=30, events=20) -> Snapshot:
    devs = _devices(devices)
    running = [_job(i + 1, "RUNNING", 0, devices=[d.name], started=NOW - 60 * i, name=f"a-rather-long-job-name-{i}")
               for i, d in enumerate(devs)]
    waiting = sorted((_job(100 + i, priority=i % 3, name=f"waiting-{i}") for i in range(queued)),
                     key=lambda j: (-j.priority, j.submitted_at, j.id))  # line order, as `take` gives it
    service = ServiceRecord(host="h", pid=1, devices=[d.name for d in devs], heartbeat_at=NOW)
    rows, victims = plan_queue(waiting, running, devs, [service], NOW, 60)
    from orchestrator.faces.views.snapshot import DeviceRow

    drows = [DeviceRow("h", d.name, "available", "", running[i], NOW - 2, 7) for i, d in enumerate(devs)]
    drows[0].util, drows[0].mem_used, drows[0].mem_total = 97, 70 * 2**30, 140 * 2**30  # as NVML reports a GPU
    evs = [(JobEvent(job_id=1, at=NOW - i, src="QUEUED", dst="STARTING", reason=f"placed on cpu:{i} " * 5), "x")
           for i in range(events)]
    sessions = [{"session": "s-0000000a", "experiment": "digits", "status": "running", "trials": {"RUNNING": 2},
                 "phases": {"baseline": {"done": 3, "submitted": 3, "planned": 3},
                            "search": {"done": 2, "submitted": 4, "planned": 14},
                            "confirm": {"done": 0, "submitted": 0, "planned": 6}}, "best": 0.97, "baseline": 0.961, "direction": "maximize", "goal": "g",
                 "holdout": {"delta": 0.0042, "confirmed": False}}]
    return Snapshot(at=NOW, home="/h", services=[service], devices=drows, queue=rows, victims=victims,
                    running=running, events=evs, sessions=sessions, counts={"RUNNING": devices, "QUEUED": queued})


def _lines(snap, width, height):
    console = Console(file=io.StringIO(), width=width, height=height, force_terminal=False)
    console.print(render(snap, height=height, live=True))
    return console.file.getvalue().rstrip("\n").split("\n")


@pytest.mark.parametrize("width,height", [(80, 24), (132, 43), (60, 15)])
def test_a_frame_fits_the_terminal_it_gets(width, height):
    lines = _lines(_busy_snapshot(), width, height)
    assert len(lines) <= height and max(map(len, lines)) <= width
    text = "\n".join(lines)
    assert "cpu:0" in text and "+" in text and "more" in text  # a cut section says how much it hides
    assert "97% 70/140G" in text
    if height >= 24:
        assert "queue" in text and "waiting-" in text and "s-0000000a" in text and "recent events" in text
        assert "yields to #" in text and "preempts #" in text  # who will preempt whom, from both sides
    wide = _lines(_busy_snapshot(), 200, height)
    assert max(map(len, wide)) > width  # a wider terminal is used, not left blank


def test_a_small_queue_shows_every_row_and_a_frame_without_a_height_shows_all():
    snap = _busy_snapshot(devices=2, queued=3, events=4)
    text = "\n".join(_lines(snap, 80, 24))
    assert "more" not in text and text.count("waiting-") == 3
    console = Console(file=io.StringIO(), width=80)
    console.print(render(_busy_snapshot()))
    assert console.file.getvalue().count("waiting-") == 30


def test_a_frame_reads_the_head_of_a_long_line_and_counts_the_rest(home, monkeypatch):
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.store import JobStore
    from orchestrator.faces.views import snapshot

    monkeypatch.setattr(snapshot, "QUEUE_ROWS", 5)  # 200 in life: more than a screen, far fewer than 10,000
    settings = Settings.load()
    store = JobStore(settings.db_url)
    for i in range(12):
        store.submit(JobSpec(argv=["true"], name=f"w-{i}", priority=i % 3))
    snap = take(settings, store=store, with_gpus=False)
    assert [r.job.id for r in snap.queue] == [3, 6, 9, 12, 2] and snap.counts == {"QUEUED": 12}
    console = Console(file=io.StringIO(), width=80)
    console.print(render(snap))
    assert "+7 more" in console.file.getvalue()


def _setup_queue(make_service):
    """Two long jobs on cpu:0/1 (too young to preempt), an urgent job at the head of the line, one behind it."""
    from orchestrator.api import jobs as api
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec

    service = make_service(devices="cpu:2", preempt_after=3600)
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    for name in ("long-a", "long-b"):
        api.submit(JobSpec(argv=sleep, name=name, priority=0, track=False), Settings.load())
    wait_for(lambda: service.store.count_in("RUNNING") == 2, timeout=60, what="two running jobs")
    api.submit(JobSpec(argv=["true"], name="urgent", priority=20, track=False), Settings.load())
    api.submit(JobSpec(argv=["true"], name="behind", priority=1, track=False), Settings.load())
    return service


@pytest.mark.slow
def test_once_prints_one_frame_of_a_running_service(child_env, make_service):
    _setup_queue(make_service)
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "top", "--once", "--width", "100"],
                         env=child_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 100 and "q quits" not in out.stdout
    assert any("cpu:0" in line and "#1 long-a" in line for line in lines)
    assert any("#3 urgent" in line and re.search(r"will preempt #[12] in \d+ s", line) for line in lines)
    assert any("#4 behind" in line and "waits behind #3" in line for line in lines)
    assert "1 service" in lines[0] and "2 running" in lines[0] and "2 queued" in lines[0]

    bad = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "top", "--interval", "0"], env=child_env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--interval" in bad.stderr


def test_take_reads_a_home_without_a_service(home):
    from orchestrator.core.config import Settings

    snap = take(Settings.load())
    assert snap.services == [] and snap.queue == [] and snap.devices == []
    text = "\n".join(_lines(snap, 80, 24))
    assert "no service running" in text and "start `autoresearch serve`" in text and "nothing waiting" in text


class Tmux:
    """A private tmux server (its own socket) with one 80x24 pane running a shell command."""

    def __init__(self, tmp_path, command: str):
        require("tmux", None if shutil.which("tmux") else "tmux is not installed (apt-get install -y tmux)")
        self.socket = str(tmp_path / "tmux.sock")
        self.run("new-session", "-d", "-x", "80", "-y", "24", "-s", "top", command)

    def run(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "top")

    def wait_for(self, needle: str, timeout: float = 60) -> str:
        return wait_for(lambda: needle in (s := self.screen()) and s, timeout=timeout, interval=0.2,
                        what=f"{needle!r} on the tmux screen")

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["q", "C-c"])
def test_live_view_in_80x24_under_tmux_exits_on_a_key_and_restores_the_terminal(child_env, make_service, tmp_path,
                                                                                   key):
    _setup_queue(make_service)
    env = " ".join(f"{k}='{v}'" for k, v in child_env.items() if k in ("AUTORESEARCH_HOME", "MLFLOW_TRACKING_URI",
                                                                        "PYTHONPATH", "AUTORESEARCH_PREFLIGHT"))
    before, after = tmp_path / "stty.before", tmp_path / "stty.after"
    command = (f"stty -g > {before}; env {env} {sys.executable} -m orchestrator.faces.cli top --interval 0.5; "
               f"echo EXITED rc=$?; stty -g > {after}; sleep 60")
    tmux = Tmux(tmp_path, command)
    try:
        screen = tmux.wait_for("#4 behind")
        lines = screen.rstrip("\n").split("\n")
        assert len(lines) <= 24 and max(map(len, lines)) <= 80
        assert lines[0].startswith("autoresearch top") and "q quits" in lines[0]
        assert any("cpu:0" in line and "long-a" in line for line in lines)
        assert any("cpu:1" in line and "long-b" in line for line in lines)
        assert any("#3 urgent" in line and "will preempt #" in line for line in lines), screen  # cut at 80 columns

        def later_frame():  # the clock in the header has moved on
            now = tmux.screen().rstrip("\n").split("\n")
            return now if now[0] != lines[0] else None

        # Frames later it still shows one frame, not frames stacked or scrolled.
        again = wait_for(later_frame, timeout=30, what="a later frame")
        assert again[0].startswith("autoresearch top") and sum("autoresearch top" in x for x in again) == 1
        tmux.run("send-keys", "-t", "top", key)
        done = tmux.wait_for("EXITED rc=", timeout=30)
        assert "EXITED rc=0" in done and "Traceback" not in done
        assert "autoresearch top" not in done  # the alternate screen is gone: the shell's screen is back
        wait_for(lambda: after.exists() and after.read_text(), timeout=10, what="stty after")
        assert after.read_text() == before.read_text()  # echo and line mode restored
    finally:
        tmux.close()


def test_session_progress_counts_its_trials_and_reads_best_and_baseline(home):
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.store import JobStore
    from orchestrator.agent.background import progress

    store = JobStore.from_settings(Settings.load())
    for name, phase in (("a", "baseline"), ("b", "search"), ("c", "search")):
        store.submit(JobSpec(argv=["true"], name=name, owner="s-0000beef", track=False, phase=phase))
    store.cancel(1)
    row = {"id": "s-0000beef", "experiment": "digits", "goal": "g", "status": "finished",
           "config": {"trials": 8, "baseline_seeds": 1},
           "summary": {"winner": None, "best": {"value": 0.975}, "baseline": {"mean": 0.961, "n": 2},
                       "metric": "val_accuracy", "direction": "maximize", "stop_reason": "trials"}}
    p = progress(row, store, home)
    assert p["trials"] == {"CANCELLED": 1, "QUEUED": 2}
    # Of --trials 8: 5 search trials and 3 re-runs (SessionConfig.split), the baseline's one seed on top.
    assert p["tally"] == "baseline 1/1, search 0/5, confirm 0/3"
    assert (p["best"], p["baseline"], p["direction"], p["stop_reason"]) == (0.975, 0.961, "maximize", "trials")
    running = progress({**row, "status": "running", "summary": {}}, store, home)
    assert running["best"] is None and running["direction"] == "maximize"  # from the experiment's spec
    text = "\n".join(_lines(_busy_snapshot(), 100, 40))
    assert "0.97" in text and "0.961" in text and "baseline 3/3, search 2/14, confirm 0/6" in text
    assert "holdout" in text and "+0.0042" in text  # the winner's holdout lead, once its session has read it
    held = {"text": "holdout +0.01 (95% CI -0.002..+0.022)", "delta": 0.01, "confirmed": False}
    done = progress({**row, "summary": {**row["summary"], "holdout": held, "usage": {"calls": 3}}}, store, home)
    assert done["holdout"] == held and done["usage"] == {"calls": 3}  # what MCP session_status returns
