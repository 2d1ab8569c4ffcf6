"""Checkpoint retention: what a finished job keeps of its checkpoint dir, applied by `gc` and by the service.

Jobs move through the real store's transitions (claim, running, finish, preempt) and write real checkpoint
dirs; sessions are rows of the real agent registry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent.session import Registry
from orchestrator.core.config import Settings
from orchestrator.service.gc import Collector, cap_log, run_gc
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.service.retention import Policy, decide
from tests.orchestrator.helpers import wait_for

HOST = "h"
MB = 1024 * 1024


def _session(home: Path, sid: str, status: str) -> None:
    registry = Registry(home)
    try:
        with registry.conn:
            registry.conn.execute("INSERT INTO sessions (id, experiment, status, created_at, updated_at) "
                                  "VALUES (?, 'digits', ?, 0, 0)", (sid, status))
    finally:
        registry.close()


def _write_steps(directory: Path, steps=(10, 20), size=64 * 1024) -> None:
    for step in steps:
        d = directory / f"step_{step:010d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "data.distcp").write_bytes(b"x" * size)
        (d / ".metadata").write_bytes(b"m")


def _job(store: JobStore, root: Path, *, owner="human", phase=None, keep=None, code=0, score=None,
         run=True) -> int:
    """A job with a checkpoint dir of two complete steps, finished with `code` (run=False: left QUEUED)."""
    job = store.submit(JobSpec(argv=["true"], owner=owner, experiment="digits", phase=phase,
                               keep_checkpoint=keep, track=False))
    store.claim([(job.id, ["cpu:0"])], HOST, checkpoint_root=str(root), log_root=str(root.parent / "logs"))
    _write_steps(root / str(job.id))
    if not run:
        store.requeue(job.id, "back in line", HOST)
        return job.id
    store.mark_running(job.id, os.getpid(), None, HOST)
    store.finish(job.id, code, HOST)
    if score is not None:
        store.keeping.set_scores({job.id: score})
    return job.id


@pytest.fixture
def stocked(home):
    """A finished session s1 (a baseline, five ranked search trials, one failed, one marked keep), a session
    s2 still running (one scored trial, one unscored), a person's job, a queued and a preempted job."""
    settings = Settings.load()
    store = JobStore.from_settings(settings)
    root = settings.checkpoints_dir
    root.mkdir(parents=True, exist_ok=True)
    _session(home, "s1", "finished")
    _session(home, "s2", "running")
    ids = {
        "baseline": _job(store, root, owner="s1", phase="baseline", score=0.5),
        **{f"t{i}": _job(store, root, owner="s1", phase="search", score=s)
           for i, s in enumerate([0.9, 0.7, 0.95, 0.6, 0.8])},
        "failed": _job(store, root, owner="s1", phase="search", code=1),
        "marked": _job(store, root, owner="s1", phase="search", score=0.1, keep="all"),
        "s2_low": _job(store, root, owner="s2", phase="search", score=-5.0),
        "s2_unscored": _job(store, root, owner="s2", phase="search"),
        "person": _job(store, root),
        "person_none": _job(store, root, keep="none"),
        "queued": _job(store, root, owner="s1", phase="search", run=False),
    }
    pre = store.submit(JobSpec(argv=["true"], owner="s1", experiment="digits", phase="search", track=False))
    store.claim([(pre.id, ["cpu:1"])], HOST, checkpoint_root=str(root))
    _write_steps(root / str(pre.id))
    store.mark_running(pre.id, os.getpid(), None, HOST)
    store.preempt([pre.id], "preempted for a higher-priority job", HOST)
    store.finish(pre.id, 143, HOST)
    assert store.get(pre.id).state == "QUEUED" and store.get(pre.id).preemptions == 1
    ids["preempted"] = pre.id
    return settings, store, root, ids


def _steps(root: Path, job_id: int) -> list[str]:
    d = root / str(job_id)
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_the_policy_keeps_what_matters_and_removes_the_rest(stocked):
    settings, store, root, ids = stocked
    settings = Settings.load().with_flags()  # keep_best = 3 by default
    dry = run_gc(settings, dry_run=True)
    planned = {c["id"]: c["action"] for c in dry.checkpoints}
    assert all(len(_steps(root, i)) == 2 for i in ids.values()), "--dry-run changed nothing"
    assert dry.checkpoint_bytes > 0

    report = run_gc(settings)
    assert {c["id"]: c["action"] for c in report.checkpoints} == planned
    assert report.checkpoint_bytes == dry.checkpoint_bytes
    both = ["step_0000000010", "step_0000000020"]
    # The best three of session s1 by its ranking (0.95, 0.9, 0.8) keep everything; the other two go.
    for name in ("t0", "t2", "t4"):
        assert _steps(root, ids[name]) == both, name
    for name in ("t1", "t3", "failed"):
        assert _steps(root, ids[name]) == [], name
        assert store.get(ids[name]).checkpoint_gc == "removed"
    assert _steps(root, ids["baseline"]) == ["step_0000000020"]  # its latest complete checkpoint
    assert _steps(root, ids["marked"]) == both
    # A running session: a trial whose value is known and cannot win is out of its best three only if three
    # beat it; with one scored trial it is among them. The unscored one waits for its value.
    assert _steps(root, ids["s2_low"]) == both and _steps(root, ids["s2_unscored"]) == both
    assert _steps(root, ids["person"]) == both and _steps(root, ids["person_none"]) == []
    # Jobs that are not final are never touched: they resume from these.
    assert _steps(root, ids["queued"]) == both and _steps(root, ids["preempted"]) == both
    assert run_gc(settings).checkpoints == []  # done once: a second pass has nothing left to do


def test_retention_off_and_keep_best_settings(stocked, monkeypatch):
    _, _, root, ids = stocked
    monkeypatch.setenv("AUTORESEARCH_RETENTION", "off")
    assert run_gc(Settings.load()).checkpoints == []
    monkeypatch.setenv("AUTORESEARCH_RETENTION", "ranked")
    monkeypatch.setenv("AUTORESEARCH_KEEP_BEST", "1")
    run_gc(Settings.load())
    assert _steps(root, ids["t2"]) and not _steps(root, ids["t0"]) and not _steps(root, ids["t4"])


def test_best_k_is_per_session_and_experiment():
    rows = [{"id": i, "owner": o, "experiment": e, "score": s, "phase": "search"}
            for i, (o, e, s) in enumerate([("a", "x", 1), ("a", "x", 2), ("a", "y", 0), ("b", "x", -1)])]
    decided = {d.job_id: d.action for d in decide(rows, {"a": True, "b": True}, Policy(keep_best=1))}
    assert decided == {0: "remove", 1: "keep", 2: "keep", 3: "keep"}


def test_gc_cli_dry_run_json_and_keep(stocked):
    _, store, root, ids = stocked
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cli = [sys.executable, "-m", "orchestrator.faces.fastcli", "gc"]
    out = subprocess.run(cli + ["--dry-run", "--json"], capture_output=True, text=True, env=env, check=True)
    report = json.loads(out.stdout)
    assert report["dry_run"] and report["bytes_freed"] > 0
    assert ids["t1"] in {c["id"] for c in report["checkpoints"]}
    assert _steps(root, ids["t1"])
    done = subprocess.run(cli + ["--keep", str(ids["t1"])], capture_output=True, text=True, env=env, check=True)
    assert "freed" in done.stdout
    assert _steps(root, ids["t1"]) and not _steps(root, ids["t3"])
    bad = subprocess.run(cli + ["--keep", str(ids["t1"]), "--keep-mode", "most"], capture_output=True, text=True,
                         env=env)
    assert bad.returncode == 2 and "keep mode" in bad.stderr


def test_a_log_is_capped_to_its_tail(tmp_path):
    path = tmp_path / "1.log"
    path.write_bytes(b"".join(f"line {i}\n".encode() for i in range(200_000)))
    assert cap_log(path, 64 * 1024) > 0
    text = path.read_text()
    assert len(text) <= 64 * 1024 // 2 + 200
    assert text.startswith("[autoresearch: ") and text.endswith("line 199999\n")
    assert text.splitlines()[1].startswith("line ")  # from a line start


def test_the_service_applies_the_policy_and_tags_the_run(home, make_service, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("AUTORESEARCH_GC_EVERY", "0.3")
    monkeypatch.setenv("AUTORESEARCH_LOG_MAX_BYTES", str(64 * 1024))
    service = make_service(devices="cpu:1")
    script = ("import os,sys; d=os.environ['AUTORESEARCH_CHECKPOINT_DIR']; os.makedirs(d+'/step_1',exist_ok=True);"
              "open(d+'/step_1/.metadata','w').write('m'); sys.stdout.write('y'*300000+'\\nend\\n')")
    job = service.store.submit(JobSpec(argv=[sys.executable, "-c", script], keep_checkpoint="none"))
    wait_for(lambda: service.store.get(job.id).checkpoint_gc == "removed", timeout=60, what="retention")
    done = service.store.get(job.id)
    assert done.state == "SUCCEEDED" and not Path(done.checkpoint_dir).exists()
    log = Path(done.log_path)
    wait_for(lambda: log.stat().st_size <= 64 * 1024, timeout=30, what="the log capped")
    assert log.read_text().endswith("end\n")
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    wait_for(lambda: client.get_run(done.mlflow_run_id).data.tags.get("autoresearch.checkpoint") == "removed",
             timeout=30, what="the run's tag")


def test_old_logs_are_compressed_then_deleted_and_old_events_compacted(home, monkeypatch):
    settings = Settings.load()
    store = JobStore.from_settings(settings)
    logs = settings.logs_dir
    logs.mkdir(parents=True, exist_ok=True)
    old, recent = [store.submit(JobSpec(argv=["true"], track=False)) for _ in range(2)]
    for job in (old, recent):
        store.claim([(job.id, ["cpu:0"])], HOST, log_root=str(logs))
        Path(store.get(job.id).log_path).write_text(f"output of {job.id}\n" * 1000)
        store.mark_running(job.id, os.getpid(), None, HOST)
        store.finish(job.id, 0, HOST)
    recent_events = store.record(recent.id)["events"]
    assert len(store.record(old.id)["events"]) == 4
    with store.db.tx() as session:  # the first job finished 10 days ago
        session.connection().exec_driver_sql(f"UPDATE jobs SET finished_at = {time.time() - 10 * 86400} "
                                             f"WHERE id = {old.id}")
    monkeypatch.setenv("AUTORESEARCH_EVENTS_COMPACT_DAYS", "5")
    report = Collector(Settings.load(), store).collect()
    assert report.logs_compressed == 1 and report.log_bytes > 0 and report.events_dropped == 2
    old_log = Path(store.get(old.id).log_path)
    assert not old_log.exists() and Path(f"{old_log}.gz").exists()
    assert Path(store.get(recent.id).log_path).exists()
    events = store.record(old.id)["events"]
    assert [e["to"] for e in events] == ["QUEUED", "SUCCEEDED"]
    assert store.record(recent.id)["events"] == recent_events  # what `show` prints for recent jobs
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    shown = subprocess.run([sys.executable, "-m", "orchestrator.faces.fastcli", "logs", str(old.id)], env=env,
                           capture_output=True, text=True, check=True)
    assert shown.stdout == f"output of {old.id}\n" * 1000  # `logs` reads the compressed log
    monkeypatch.setenv("AUTORESEARCH_LOG_DELETE_DAYS", "8")
    assert Collector(Settings.load(), store).collect().logs_deleted == 1
    assert not Path(f"{old_log}.gz").exists()


def test_the_service_pass_decides_again_only_when_something_changed(stocked, monkeypatch):
    """The service's pass over a settled home reads no job rows (a home of months of finished jobs costs
    one aggregate query a pass), yet acts at its next pass on a new score, a mark, an ended session."""
    settings, store, root, ids = stocked
    collector = Collector(settings, store)
    first = collector.collect(everything=False)  # the first pass does everything
    assert {c["id"] for c in first.checkpoints} >= {ids["t1"], ids["t3"]}
    collector.collect(everything=False)  # its own record_gc changed the rows: one more look, nothing to do
    reads = []
    real = store.keeping.retention_rows
    monkeypatch.setattr(store.keeping, "retention_rows", lambda: reads.append(1) or real())
    assert collector.collect(everything=False).checkpoints == [] and reads == []
    store.keeping.set_scores({ids["t4"]: 0.1})  # s1's third best drops out of the best three: its dir goes
    assert [c["id"] for c in collector.collect(everything=False).checkpoints] == [ids["t4"]]
    store.keeping.set_keep(ids["person"], "none")
    assert [c["id"] for c in collector.collect(everything=False).checkpoints] == [ids["person"]]
    _session(settings.home, "s3", "running")
    s3 = _job(store, root, owner="s3", phase="search", score=1.0)
    collector.collect(everything=False)
    assert _steps(root, s3) == ["step_0000000010", "step_0000000020"]  # still the best of a live session
    reads.clear()
    collector.collect(everything=False)  # settled again
    assert reads == []


def test_pbt_forks_go_once_their_session_has_ended(home):
    """The checkpoint copies PBT children start from stay while their session can resume, and go with it."""
    from orchestrator.core.layout import Layout

    settings = Settings.load()
    layout = Layout(settings.home)
    _session(settings.home, "s-ended01", "finished")
    _session(settings.home, "s-live0001", "interrupted")
    for key in ("s-ended01:5", "s-live0001:5"):
        _write_steps(layout.fork_dir(key), steps=(30,))
    torn = layout.fork_dir("s-ended01:6").with_name(".s-ended01-6.4242")  # a copy a crash left half-made
    _write_steps(torn, steps=(30,))
    dry = run_gc(settings, dry_run=True)
    assert sorted(f["name"] for f in dry.forks) == [".s-ended01-6.4242", "s-ended01-5"]
    assert dry.fork_bytes >= 2 * 64 * 1024 and layout.fork_dir("s-ended01:5").exists()
    report = run_gc(settings)
    assert report.bytes_freed >= report.fork_bytes == dry.fork_bytes
    assert not layout.fork_dir("s-ended01:5").exists() and not torn.exists()
    assert _steps_in(layout.fork_dir("s-live0001:5"))  # its session may resume: the child still needs it


def _steps_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("step_*"))
