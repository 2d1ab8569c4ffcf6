"""Checkpoint/resume with real processes, real DCP files and real signals (CPU)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime.checkpoint.manager import CheckpointConfig, CheckpointManager, TrainState
from runtime.checkpoint.io import METADATA, VolumeReader, lower_this_thread
from runtime.checkpoint.stage import SnapshotStager
from runtime.context import read_heartbeat
from runtime.errors import CheckpointError
from runtime.protocol import EX_TEMPFAIL

SCRIPT = Path(__file__).parent / "scripts" / "train_tiny.py"
ROOT = Path(__file__).resolve().parents[2]
STEPS, INTERVAL = 40, 10
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def start(tmp: Path, name: str, *, ranks: int = 1, sleep: float = 0.0, faults: str = "") -> subprocess.Popen:
    env = dict(os.environ)
    env.update({
        "AUTORESEARCH_JOB_ID": "7", "AUTORESEARCH_CHECKPOINT_DIR": str(tmp / f"ckpt-{name}"),
        "AUTORESEARCH_PARAMS": json.dumps({"steps": STEPS, "interval": INTERVAL, "sleep": sleep,
                                           "out": str(tmp / f"out-{name}")}),
        "AUTORESEARCH_FAULTS": faults, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
        "AUTORESEARCH_CKPT_STAGE": str(tmp / "stage"),
    })
    env.pop("MLFLOW_RUN_ID", None)
    cmd = [sys.executable, str(SCRIPT)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(SCRIPT)]
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: float = 90) -> int:
    out, _ = proc.communicate(timeout=timeout)
    proc.output = out.decode(errors="replace")  # type: ignore[attr-defined]
    return proc.returncode


def wait_for_step(tmp: Path, name: str, step: int, proc: subprocess.Popen, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = read_heartbeat(tmp / f"ckpt-{name}" / "heartbeat.json")
        if beat and beat["step"] >= step:
            return beat["step"]
        assert proc.poll() is None, proc.communicate()[0].decode()
        time.sleep(0.01)
    raise AssertionError("job made no progress")


def losses(out: Path, rank: int = 0) -> dict[int, str]:
    curve: dict[int, str] = {}
    for line in (out / f"losses-rank{rank}.txt").read_text().splitlines():
        step, value = line.split()
        curve[int(step)] = value  # a resumed attempt overwrites steps it repeats
    return curve


def assert_same_run(ref: Path, tmp: Path, other: str, ranks: int = 1) -> None:
    """The run in tmp/out-<other> ended bitwise as the uninterrupted reference whose output is in `ref`."""
    a = torch.load(ref / "final.pt")
    b = torch.load(tmp / f"out-{other}" / "final.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bitwise, not allclose
    for rank in range(ranks):
        assert losses(ref, rank) == losses(tmp / f"out-{other}", rank)
        assert sorted(losses(ref, rank)) == list(range(STEPS))


# -- real processes: stopped or killed, then resumed --------------------------------------------------------
# Each scenario is a chain of single-threaded processes (OMP_NUM_THREADS=1) that spend most of their life
# importing torch, so the scenarios run at once, each in a directory of its own (one module fixture), and
# each test reports its own scenario's outcome. The single-process scenarios share one uninterrupted
# reference run: its params are theirs (steps, interval, no sleep, no fault), so its output is theirs too.


def reference(tmp: Path, ranks: int = 1) -> Path:
    """An uninterrupted run; returns its output directory once it has ended well."""
    ref = start(tmp, "ref", ranks=ranks)
    assert finish(ref) == 0, ref.output
    return tmp / "out-ref"


def sigterm_then_resume(tmp: Path, ref) -> None:
    run = start(tmp, "run", sleep=0.05)
    wait_for_step(tmp, "run", 13, run)
    os.killpg(run.pid, signal.SIGTERM)
    assert finish(run) == EX_TEMPFAIL, run.output
    stopped = int(read_heartbeat(tmp / "ckpt-run" / "heartbeat.json")["step"])
    assert 13 <= stopped < STEPS
    assert (tmp / "ckpt-run" / f"step_{stopped:010d}" / METADATA).exists()  # saved where it stopped
    resumed = start(tmp, "run")
    assert finish(resumed) == 0, resumed.output
    assert int((tmp / "out-run" / "resumed.txt").read_text()) == stopped
    assert_same_run(ref(), tmp, "run")


def two_rank_stop_then_resume(tmp: Path, _ref) -> None:
    ref, run = start(tmp, "ref", ranks=2), start(tmp, "run", ranks=2, sleep=0.05)
    wait_for_step(tmp, "run", 12, run)
    # Signal rank 1 only: rank 0 must learn it through the all-reduce and stop at the same step.
    os.kill(int((tmp / "out-run" / "pid-rank1").read_text()), signal.SIGTERM)
    finish(run)  # torchrun reports a worker exiting 75 as a failure; what matters is the checkpoint
    curves = [losses(tmp / "out-run", r) for r in (0, 1)]
    assert max(curves[0]) == max(curves[1]), "ranks stopped at different steps"
    stopped = max(curves[0]) + 1
    assert stopped < STEPS
    assert (tmp / "ckpt-run" / f"step_{stopped:010d}" / METADATA).exists()
    assert finish(ref) == 0, ref.output
    resumed = start(tmp, "run", ranks=2)
    assert finish(resumed) == 0, resumed.output
    assert int((tmp / "out-run" / "resumed.txt").read_text()) == stopped
    assert_same_run(tmp / "out-ref", tmp, "run", ranks=2)


def sigkill_mid_save(tmp: Path, ref) -> None:
    run = start(tmp, "run", faults="checkpoint@20:crash")
    assert finish(run) == -signal.SIGKILL, run.output
    ckpt = tmp / "ckpt-run"
    assert (ckpt / "step_0000000010" / METADATA).exists()
    assert (ckpt / "step_0000000020").is_dir() and not (ckpt / "step_0000000020" / METADATA).exists()
    resumed = start(tmp, "run")
    assert finish(resumed) == 0, resumed.output
    assert (tmp / "out-run" / "resumed.txt").read_text() == "10"
    assert_same_run(ref(), tmp, "run")


def sigkill_during_staging(tmp: Path, ref) -> None:
    # Killed in the async save's background copy of step 20's parameters and optimizer state (half of them
    # copied into the host buffers), while the loop has already moved on: no step 20 may count, and the run
    # resumes from step 10 exactly as if step 20 had never been attempted.
    run = start(tmp, "run", faults="checkpoint@20:crash-staging")
    assert finish(run) == -signal.SIGKILL, run.output
    ckpt = tmp / "ckpt-run"
    assert (ckpt / "step_0000000010" / METADATA).exists()
    assert not (ckpt / "step_0000000020" / METADATA).exists()
    # Step 21's optimizer.step() waits for the copy (the manager's pre-hook): it never ran.
    assert max(losses(tmp / "out-run")) == 19
    resumed = start(tmp, "run")
    assert finish(resumed) == 0, resumed.output
    assert (tmp / "out-run" / "resumed.txt").read_text() == "10"
    assert_same_run(ref(), tmp, "run")


SCENARIOS = {"sigterm": sigterm_then_resume, "two-rank": two_rank_stop_then_resume,
             "sigkill-mid-save": sigkill_mid_save, "sigkill-staging": sigkill_during_staging}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """Every scenario run at once: {name: None (it passed) or the exception it raised}."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1 + len(SCENARIOS)) as pool:
        shared = pool.submit(reference, tmp_path_factory.mktemp("ref"))
        futures = {name: pool.submit(scenario, tmp_path_factory.mktemp(name), shared.result)
                   for name, scenario in SCENARIOS.items()}
    return {name: future.exception() for name, future in futures.items()}


def outcome(scenarios, name: str) -> None:
    if scenarios[name] is not None:
        raise scenarios[name]


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-scenarios")  # one worker runs the module fixture once
def test_sigterm_then_resume_is_bitwise_identical(scenarios):
    outcome(scenarios, "sigterm")


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-scenarios")  # one worker runs the module fixture once
def test_two_rank_gloo_stop_is_agreed_and_resume_is_bitwise_identical(scenarios):
    outcome(scenarios, "two-rank")


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-scenarios")  # one worker runs the module fixture once
def test_sigkill_mid_save_resumes_from_previous_complete(scenarios):
    outcome(scenarios, "sigkill-mid-save")


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-scenarios")  # one worker runs the module fixture once
def test_sigkill_during_the_staging_copy_resumes_from_previous_complete(scenarios):
    outcome(scenarios, "sigkill-staging")


# -- in-process: corrupt checkpoints, retention, config ---------------------------------------------------


def _train(state: TrainState, steps: int, mgr: CheckpointManager, start: int = 0) -> None:
    for step in range(start, steps):
        loss = state.model(torch.randn(4, 8)).square().mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.step = step + 1
        mgr.maybe_save(step + 1, state)
    mgr.wait()


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    return TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.1))


@pytest.mark.parametrize("damage", ["no-metadata", "garbage-metadata", "truncated-data", "missing-data"])
def test_torn_or_corrupt_newest_is_skipped(tmp_path, damage):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=3, interval_steps=2, stage_dir=str(tmp_path / "stage"))
    state = _state()
    _train(state, 6, mgr)
    newest = mgr.path_for(6)
    data = next(newest.glob("*.distcp"))
    if damage == "no-metadata":
        (newest / METADATA).unlink()
    elif damage == "garbage-metadata":
        (newest / METADATA).write_bytes(b"\x80\x04 not a pickle")
    elif damage == "truncated-data":
        data.write_bytes(data.read_bytes()[:-7])
    else:
        data.unlink()
    if damage != "no-metadata":
        with pytest.raises(CheckpointError):
            VolumeReader(newest).validate()
    fresh = _state()
    assert CheckpointManager(tmp_path / "ck", keep_last=3, interval_steps=2).load_latest(fresh) == 4
    assert fresh.step == 4


def test_load_latest_none_when_empty(tmp_path):
    assert CheckpointManager(tmp_path / "empty").load_latest(_state()) is None


def test_retention_keeps_newest_k(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2, interval_steps=1)
    _train(_state(), 5, mgr)
    assert mgr.complete_steps() == [4, 5]
    mgr.path_for(9).mkdir()  # an incomplete dir newer than every complete one may be a save in progress
    mgr._retain()
    assert mgr.path_for(9).exists()


def test_retention_never_deletes_the_only_loadable(tmp_path):
    import shutil

    mgr = CheckpointManager(tmp_path / "ck", keep_last=1, interval_steps=1)
    _train(_state(), 3, mgr)
    assert mgr.complete_steps() == [3]
    # A committed but torn newest checkpoint must not push out the last loadable one.
    shutil.copytree(mgr.path_for(3), mgr.path_for(4))
    next(mgr.path_for(4).glob("*.distcp")).write_bytes(b"")
    mgr._retain()
    assert mgr.complete_steps() == [3, 4]
    assert CheckpointManager(tmp_path / "ck").load_latest(_state()) == 3


def test_an_interval_in_minutes_saves_about_that_often_by_the_pace_of_the_steps(tmp_path, monkeypatch):
    from runtime.checkpoint import interval

    clock = [0.0]
    monkeypatch.setattr(interval, "_now", lambda: clock[0])
    mgr = CheckpointManager(tmp_path / "ck", keep_last=10, interval_minutes=0.5)
    state, saved = _state(), []
    for step in range(1, 101):  # a step takes one second, then two from step 50
        clock[0] += 1.0 if step <= 50 else 2.0
        if mgr.maybe_save(step, state):
            saved.append(step)
    mgr.wait()
    # Timed from step 1 (t = 1 s): every save 30 s (within a step) after the one before, across the change of pace.
    times = [s if s <= 50 else 50 + 2 * (s - 50) for s in saved]  # each saved step's time on the clock
    gaps = [b - a for a, b in zip([1, *times], times)]
    assert saved[0] == 31 and len(saved) == 4 and all(29 <= g <= 32 for g in gaps), (saved, gaps)
    assert mgr.complete_steps() == saved
    with pytest.raises(ValueError, match="interval_minutes must be > 0"):
        CheckpointManager(tmp_path / "ck2", interval_minutes=0)


@pytest.mark.slow
def test_with_ranks_on_different_clocks_every_rank_saves_the_steps_rank_0s_clock_says(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(SCRIPT.parent / "clock_ranks.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = (json.loads((tmp_path / f"clock-rank{r}.json").read_text()) for r in (0, 1))
    assert r0["saved"] == r1["saved"] == [31, 61, 91]  # 30 s apart on rank 0's clock (rank 1's says 210 s)
    assert r0["complete"] == [31, 61, 91]


def test_cross_filesystem_stage_is_copied_and_committed(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem for the staging dir")
    stage = shm / f"ar-test-{os.getpid()}"
    mgr = CheckpointManager(tmp_path / "ck", interval_steps=3, stage_dir=str(stage))
    state = _state()
    _train(state, 3, mgr)
    VolumeReader(mgr.path_for(3)).validate()
    assert not any(stage.iterdir()) if stage.exists() else True  # staged files moved off the scratch disk
    saved = {k: v.clone() for k, v in state.model.state_dict().items()}
    fresh = _state()
    assert CheckpointManager(tmp_path / "ck").load_latest(fresh) == 3
    assert all(torch.equal(saved[k], v) for k, v in fresh.model.state_dict().items())


def test_rng_and_loader_state_round_trip(tmp_path):
    class Pos:
        def __init__(self):
            self.pos = 0

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, s):
            self.pos = s["pos"]

    state = _state()
    state.loader = Pos()
    state.loader.pos = 41
    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save_now(1, state)
    expected = torch.rand(4)
    fresh = _state()
    fresh.loader = Pos()
    torch.rand(100)  # move the RNG on: loading must put it back
    assert mgr.load_latest(fresh) == 1
    assert fresh.loader.pos == 41
    assert torch.equal(torch.rand(4), expected)
    blob = fresh.state_dict()["rank0"]
    assert pickle.loads(blob.numpy().tobytes())["loader"] == {"pos": 41}


def test_config_is_validated():
    with pytest.raises(ValueError):
        CheckpointConfig(keep_last=0)
    with pytest.raises(ValueError):
        CheckpointConfig(interval_steps=0)
    with pytest.raises(ValueError):
        CheckpointConfig(background_nice=20)


def test_the_waiting_thread_makes_the_copies_the_background_has_not_started():
    # The training thread never waits on a background copy that has not even begun: it makes it itself,
    # and the staged state is still the state as of stage(), whoever copied what.
    stager = SnapshotStager()
    gate = threading.Event()
    stager._pool.submit(gate.wait)  # the staging thread is busy elsewhere
    params = [torch.full((1000,), float(i)) for i in range(3)]
    stager.deferred = {p.untyped_storage().data_ptr() for p in params}
    try:
        staged = stager.stage({"p": list(params), "step": torch.tensor(7)})
        waiter = threading.Thread(target=stager.wait)
        waiter.start()
        waiter.join(60)  # a guard against hanging the suite, not a timing: it returns at once or never
        assert not waiter.is_alive(), "wait() waited for a staging thread that had not started"
        for p in params:
            p.add_(100)  # what optimizer.step() does next
    finally:
        gate.set()
    out = staged.result()
    assert [t.tolist() for t in out["p"]] == [[float(i)] * 1000 for i in range(3)] and int(out["step"]) == 7
    stager.close()


def test_background_threads_run_niced():
    seen = []

    def probe():
        lower_this_thread(5)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    before = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen == [min(19, before + 5)] and os.getpriority(os.PRIO_PROCESS, 0) == before  # the caller keeps its own


def test_load_latest_through_a_slow_fuse_volume(tmp_path, slow_volume):
    src = tmp_path / "ck"
    mgr = CheckpointManager(src, keep_last=2, interval_steps=2)
    state = _state()
    _train(state, 4, mgr)
    (mgr.path_for(6)).mkdir()  # a torn newer attempt on the volume
    saved = {k: v.clone() for k, v in state.model.state_dict().items()}
    vol = slow_volume(src, open_latency=0.01)
    fresh = _state()
    assert CheckpointManager(vol.mountpoint).load_latest(fresh) == 4
    assert all(torch.equal(saved[k], v) for k, v in fresh.model.state_dict().items())


def test_a_checkpoint_of_another_model_is_skipped_not_fatal(tmp_path):
    # DCP raises CheckpointException (a BaseException) on a shape mismatch: the manager must skip it.
    small = torch.nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path / "ck", async_save=False)
    manager.save_now(5, TrainState(small))
    other = torch.nn.Linear(8, 8)
    before = other.weight.detach().clone()
    assert CheckpointManager(tmp_path / "ck", async_save=False).load_latest(TrainState(other)) is None
    assert torch.equal(other.weight, before)


@pytest.mark.slow
def test_ranks_stage_only_what_they_write_in_exact_sized_buffers(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", AUTORESEARCH_CKPT_STAGE=str(tmp_path / "stage"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(SCRIPT.parent / "stage_ranks.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = (json.loads((tmp_path / f"stage-rank{r}.json").read_text()) for r in (0, 1))
    assert r0["loaded"] == r1["loaded"] == 3 and r0["same"] and r1["same"]  # the async checkpoint loads
    # Rank 0 holds one copy of the replicated state, at its size (plus <= 63 bytes of alignment a tensor).
    assert r0["deferred"] <= r0["staged"] <= r0["deferred"] + 64 * 20
    assert r1["staged"] == 0 and r1["left"] > 0  # rank 1 stages none of it: rank 0 writes it
    assert r0["freed"] == r1["freed"] == 0  # close() releases the buffer
