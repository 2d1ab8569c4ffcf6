"""JobContext: the job protocol's environment, signals, heartbeat, MLflow logging (real sqlite tracking store)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.context import ContextConfig, JobContext, read_heartbeat
from runtime.errors import RuntimeJobError

ROOT = Path(__file__).resolve().parents[2]
JOB_VARS = ("AUTORESEARCH_JOB_ID", "AUTORESEARCH_ATTEMPT", "AUTORESEARCH_CHECKPOINT_DIR", "AUTORESEARCH_PARAMS",
            "AUTORESEARCH_HEARTBEAT_FILE", "MLFLOW_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture
def clean_env(home, monkeypatch):
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return home


def test_standalone_defaults(clean_env):
    ctx = JobContext.from_env(ContextConfig(handle_signals=False))
    assert (ctx.job_id, ctx.attempt, ctx.params, ctx.rank, ctx.world_size) == (None, 0, {}, 0, 1)
    assert ctx.is_main and ctx.device == "cpu"
    assert ctx.checkpoint_dir.parent == clean_env / "checkpoints" / "standalone"
    assert ctx.heartbeat_file == ctx.checkpoint_dir / "heartbeat.json"


def test_job_environment(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTORESEARCH_JOB_ID", "42")
    monkeypatch.setenv("AUTORESEARCH_ATTEMPT", "3")
    monkeypatch.setenv("AUTORESEARCH_CHECKPOINT_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("AUTORESEARCH_PARAMS", '{"lr": 0.1, "depth": 4}')
    monkeypatch.setenv("AUTORESEARCH_HEARTBEAT_FILE", str(tmp_path / "hb.json"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ctx = JobContext.from_env(ContextConfig(handle_signals=False))
    assert (ctx.job_id, ctx.attempt, ctx.params) == (42, 3, {"lr": 0.1, "depth": 4})
    assert ctx.checkpoint_dir == tmp_path / "ck" and not ctx.is_main
    assert not ctx.heartbeat(5, force=True)  # only rank 0 writes progress
    monkeypatch.setenv("AUTORESEARCH_PARAMS", "[1, 2]")
    with pytest.raises(RuntimeJobError):
        JobContext.from_env(ContextConfig(handle_signals=False))
    with pytest.raises(ValueError):
        ContextConfig(heartbeat_interval_s=-1)


def test_sigterm_becomes_a_flag_and_handlers_are_restored(clean_env):
    before = signal.getsignal(signal.SIGTERM)
    ctx = JobContext.from_env()
    assert not ctx.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    assert ctx.should_stop()
    ctx.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_in_a_real_job_process_exits_75(clean_env, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        from runtime.context import JobContext
        with JobContext.from_env() as ctx:
            print("ready", flush=True)
            while not ctx.should_stop():
                time.sleep(0.01)
            ctx.exit_preempted()
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 75


def test_heartbeat_is_atomic_throttled_and_readable(clean_env, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTORESEARCH_HEARTBEAT_FILE", str(tmp_path / "hb" / "beat.json"))
    ctx = JobContext.from_env(ContextConfig(heartbeat_interval_s=3600, handle_signals=False))
    assert ctx.heartbeat(1)
    assert not ctx.heartbeat(2)  # throttled
    assert ctx.heartbeat(3, force=True)
    beat = read_heartbeat(tmp_path / "hb" / "beat.json")
    assert beat["step"] == 3 and beat["pid"] == os.getpid() and beat["time"] > 0
    assert [p.name for p in (tmp_path / "hb").iterdir()] == ["beat.json"]  # no tmp files left behind
    (tmp_path / "bad.json").write_text("{torn")
    assert read_heartbeat(tmp_path / "bad.json") is None
    assert read_heartbeat(tmp_path / "absent.json") is None


def test_mlflow_logging_to_the_job_run(clean_env, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = os.environ["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("exp")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    ctx = JobContext.from_env(ContextConfig(handle_signals=False))
    ctx.log_params({"lr": 0.1})
    ctx.log_params({"lr": 0.1})  # a resumed attempt logs the same params again: harmless
    ctx.log_metrics({"loss": 1.5}, step=1)
    ctx.log_metrics({"loss": 0.5}, step=2)
    assert client.get_run(run_id).data.params == {"lr": "0.1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 1.5), (2, 0.5)]


def test_mlflow_without_run_id_creates_one_or_skips(clean_env, monkeypatch):
    ctx = JobContext.from_env(ContextConfig(handle_signals=False))
    ctx.log_metrics({"loss": 1.0}, step=0)
    assert ctx.run_id is not None  # a tracking URI but no run: a new run in experiment "standalone"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    quiet = JobContext.from_env(ContextConfig(handle_signals=False))
    quiet.log_metrics({"loss": 1.0}, step=0)  # nowhere to log: skipped, no error
    assert quiet.run_id is None


def test_complete_marks_this_attempt_finished_for_the_queue(clean_env, monkeypatch, tmp_path):
    from runtime.protocol import COMPLETE_FILE, completed_attempt

    monkeypatch.setenv("AUTORESEARCH_JOB_ID", "7")
    monkeypatch.setenv("AUTORESEARCH_ATTEMPT", "2")
    monkeypatch.setenv("AUTORESEARCH_CHECKPOINT_DIR", str(tmp_path / "ck"))
    ctx = JobContext.from_env(ContextConfig(handle_signals=False))
    assert completed_attempt(tmp_path / "ck") is None
    ctx.complete()
    ctx.complete()  # idempotent
    assert completed_attempt(tmp_path / "ck") == 2
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [COMPLETE_FILE]  # atomic: no tmp left
    monkeypatch.setenv("RANK", "1")
    other = JobContext.from_env(ContextConfig(handle_signals=False))
    other.attempt = 3
    other.complete()  # only rank 0 writes
    assert completed_attempt(tmp_path / "ck") == 2


def test_leaving_the_block_completes_unless_a_stop_was_requested(clean_env, monkeypatch, tmp_path):
    from runtime.protocol import completed_attempt

    monkeypatch.setenv("AUTORESEARCH_JOB_ID", "7")
    monkeypatch.setenv("AUTORESEARCH_ATTEMPT", "1")
    for name, stop, fail in (("clean", False, False), ("stopped", True, False), ("raised", False, True)):
        monkeypatch.setenv("AUTORESEARCH_CHECKPOINT_DIR", str(tmp_path / name))
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            with JobContext.from_env(ContextConfig(handle_signals=False)) as ctx:
                if stop:
                    ctx.request_stop()  # what SIGTERM does: the job stopped early, e.g. with `break`
                if fail:
                    raise RuntimeError("training crashed")
        assert completed_attempt(tmp_path / name) == (1 if name == "clean" else None), name
    monkeypatch.delenv("AUTORESEARCH_JOB_ID")  # run by hand: nothing to tell a queue
    monkeypatch.setenv("AUTORESEARCH_CHECKPOINT_DIR", str(tmp_path / "by-hand"))
    with JobContext.from_env(ContextConfig(handle_signals=False)):
        pass
    assert not (tmp_path / "by-hand").exists()



def test_the_runtime_never_imports_the_service(clean_env, tmp_path):
    # Training jobs import the runtime; the service's settings, store or CLI have no business in them.
    (tmp_path / "shard.bin").write_bytes(b"x")
    code = ("import pkgutil, importlib, sys, runtime\n"
            "for m in pkgutil.iter_modules(runtime.__path__): importlib.import_module('runtime.' + m.name)\n"
            "from runtime.data.dataset import VolumeDataset\n"
            f"ds = VolumeDataset({str(tmp_path)!r})  # the default cache dir is under the home\n"
            "assert ds.cache_dir.endswith('/cache'), ds.cache_dir\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'orchestrator'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
