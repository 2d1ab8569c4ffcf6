"""Jobs across nodes on the emulated nodes of the test cluster (partition multi: node1..node3, each a `slurmd -N`
daemon on this machine, `.ci/slurm-setup.sh`): a 2-node x 2-rank DDP run through `submit --nodes 2` with its ranks
on both nodes (from the ranks' own records), a node killed mid-run (its slurmd and job steps) -> the job requeued
without it and resumed from its DCP checkpoint, bitwise on a third node or resharded on the one node left with
--min-nodes 1, a preflight failure on one node, cancel leaving no rank anywhere; and the local executor's refusal.

Every other gang here runs one rank on each node (`--gpus 1`): what those tests check is per node, and each rank
costs seconds of CPU (torch, gloo, DCP) on a machine the whole suite shares.

The emulated nodes are one shared resource: every test here holds an exclusive lock on them (and is in one xdist
group), so two of them never run at once, whatever the workers.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.api import jobs as api
from orchestrator.core.config import Settings
from orchestrator.executors.slurm import jobs as sj
from orchestrator.executors.slurm import nodes as sn
from orchestrator.queue.models import JobSpec
from tests.orchestrator.helpers import wait_for
from tests.support import slurm as cluster

pytestmark = [pytest.mark.multinode, pytest.mark.xdist_group("slurm-multi")]
SCRIPT = Path(__file__).parent / "scripts" / "gang_train.py"


@pytest.fixture
def nodes():
    """The emulated nodes, held for this test alone; every one back in service afterwards."""
    with open(cluster.MULTI_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # What an earlier test left (a job still completing on a node it killed, a node it drained whose resume a
        # busy controller refused) is over before this one starts.
        wait_for(lambda: cluster.restore_multi(sorted(cluster.multi_states())), timeout=90, interval=0.5,
                 what="the emulated nodes idle")
        up = cluster.multi_nodes()
        try:
            yield up
        finally:
            wait_for(lambda: cluster.restore_multi(up), timeout=90, interval=0.5, what="the emulated nodes back, idle")


@pytest.fixture
def service(home, nodes, monkeypatch):
    """service(devices=..., **env): an in-process service on partition multi (by default cpu:12 slots: 3 nodes x 4
    CPUs)."""
    from orchestrator.service.daemon import Service

    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")
    started = []

    def start(devices="cpu:12", **env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        svc = Service(Settings.load(devices=devices, executor="slurm", slurm_partition=cluster.MULTI),
                      preempt_after=0, tick=0.2).start()
        started.append(svc)
        return svc

    yield start
    cluster.stop_services(started)


def gang(out: Path, steps: int, every: int, delay: float, **kw) -> JobSpec:
    kw.setdefault("track", False)
    kw.setdefault("nodes", 2)
    kw.setdefault("gpus", 1)
    return JobSpec(argv=[sys.executable, str(SCRIPT), str(steps), str(every), str(out), str(delay)], **kw)


def ranks(out: Path, attempt: int) -> list[dict]:
    """The ranks' own records of one attempt."""
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{attempt}.*.json"))]


def log_of(svc, job_id) -> str:
    path = svc.store.get(job_id).log_path
    return Path(path).read_text(errors="replace") if path and os.path.exists(path) else ""


def committed_steps(checkpoint_dir: str) -> list[int]:
    """The steps of the job's committed DCP checkpoints (those with their .metadata)."""
    return sorted(int(p.parent.name.split("_")[1]) for p in Path(checkpoint_dir).glob("step_*/.metadata"))


def finish(svc, job_id, timeout=120):
    job = wait_for(lambda: (lambda j: j if j.final else None)(svc.store.get(job_id)), timeout=timeout,
                   what=f"job {job_id} to finish")
    assert job.state == "SUCCEEDED", log_of(svc, job_id)
    return job


def test_a_two_node_job_runs_two_ranks_on_each_node(service, tmp_path):
    svc = service()
    job = api.submit(gang(tmp_path, steps=12, every=6, delay=0.02, gpus=2))[0]
    finish(svc, job.id)
    seen = ranks(tmp_path, 1)
    assert sorted(r["rank"] for r in seen) == [0, 1, 2, 3] and {r["world"] for r in seen} == {4}
    by_node = {}
    for r in seen:
        by_node.setdefault(r["node"], []).append(r["rank"])
    assert len(by_node) == 2 and all(len(v) == 2 for v in by_node.values()), by_node
    assert {r["node_rank"] for r in seen} == {"0", "1"} and all(r["master"] for r in seen)
    record = svc.store.record(job.id)
    assert record["nodes"] == 2 and record["gpus"] == 4
    attempts = sn.job_state(svc.layout.home, job.id)["attempts"]
    assert sorted(attempts["1"]["nodes"]) == sorted(by_node)


def test_a_node_lost_mid_run_is_excluded_and_the_job_resumes_bitwise_on_a_third(service, tmp_path):
    svc = service()
    out, ref = tmp_path / "run", tmp_path / "reference"
    out.mkdir()
    ref.mkdir()
    steps, every = 40, 5
    job = api.submit(gang(out, steps=steps, every=every, delay=0.15))[0]
    # The same run uninterrupted, 2 ranks on this machine (torchrun --standalone), for the bitwise comparison.
    env = {**os.environ, "AUTORESEARCH_CHECKPOINT_DIR": str(tmp_path / "ref-ckpt"), "AUTORESEARCH_JOB_ID": "",
           "MLFLOW_TRACKING_URI": "", "OMP_NUM_THREADS": "1"}
    reference = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                  str(SCRIPT), str(steps), str(every), str(ref), "0"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ckpt = wait_for(lambda: svc.store.get(job.id).checkpoint_dir, timeout=60, what="the job's checkpoint dir")
    wait_for(lambda: committed_steps(ckpt) and committed_steps(ckpt)[-1] >= 2 * every, timeout=90,
             what="two committed checkpoints")
    first = ranks(out, 1)
    victim = next(r["node"] for r in first if r["node_rank"] == "1")  # not the head: the batch shell lives there
    cluster.kill_node(victim)
    job2 = finish(svc, job.id, timeout=150)
    second = ranks(out, 2)
    assert job2.attempts == 2 and job2.failures == 0, log_of(svc, job.id)
    assert victim not in {r["node"] for r in second} and len({r["node"] for r in second}) == 2
    assert {r["start"] for r in second} == {max(s for s in committed_steps(ckpt) if s <= steps)} or \
        min(r["start"] for r in second) >= 2 * every  # resumed from a committed checkpoint, not from scratch
    record = svc.store.record(job.id)
    reasons = " ".join(e["reason"] for e in record["events"])
    assert f"node {victim} lost" in reasons and f"--exclude={victim}" in reasons, reasons
    assert sn.excluded(svc.layout.home, job.id) == [victim]
    assert reference.wait(timeout=120) == 0
    assert json.loads((out / "final.json").read_text())["weights"] == json.loads((ref / "final.json").read_text())[
        "weights"]


def test_with_min_nodes_1_a_lost_node_leaves_one_node_and_the_checkpoint_reshards(service, tmp_path, nodes):
    spare = nodes[2]
    cluster.scontrol("update", f"nodename={spare}", "state=drain", "reason=autoresearch test: two nodes only")
    svc = service()
    job = api.submit(gang(tmp_path, steps=30, every=5, delay=0.15, min_nodes=1))[0]
    ckpt = wait_for(lambda: svc.store.get(job.id).checkpoint_dir, timeout=60, what="the job's checkpoint dir")
    wait_for(lambda: committed_steps(ckpt) and committed_steps(ckpt)[-1] >= 10, timeout=90, what="a checkpoint")
    victim = next(r["node"] for r in ranks(tmp_path, 1) if r["node_rank"] == "1")
    cluster.kill_node(victim)
    finish(svc, job.id, timeout=150)
    second = ranks(tmp_path, 2)
    assert {r["world"] for r in second} == {1} and len({r["node"] for r in second}) == 1
    assert min(r["start"] for r in second) >= 10  # resumed, 2 ranks' checkpoint loaded by 1
    shown = svc.store.record(job.id)
    from orchestrator.faces.views.snapshot import job_record

    shown = job_record(svc.settings, svc.store, job.id)
    assert "1 of 2 nodes" in json.dumps(shown["node_attempts"]) and "resharded" in json.dumps(shown["node_attempts"])


def test_a_node_failing_preflight_ends_the_attempt_and_is_excluded(service, tmp_path, nodes):
    svc = service(AUTORESEARCH_FAULTS=f"node@{nodes[1]}:preflight")
    job = api.submit(gang(tmp_path, steps=6, every=3, delay=0.02))[0]
    finish(svc, job.id, timeout=150)
    record = svc.store.record(job.id)
    reasons = " ".join(e["reason"] for e in record["events"])
    assert f"preflight failed on node {nodes[1]}" in reasons, reasons
    assert nodes[1] not in {r["node"] for r in ranks(tmp_path, record["attempts"])}
    assert record["failures"] == 0  # a bad node is not the job's failure


def test_cancel_leaves_no_rank_on_any_node(service, tmp_path):
    import psutil

    svc = service()
    job = api.submit(gang(tmp_path, steps=1000, every=100, delay=0.1))[0]
    seen = wait_for(lambda: len(ranks(tmp_path, 1)) == 2 and ranks(tmp_path, 1), timeout=90, what="2 ranks")
    assert len({r["node"] for r in seen}) == 2
    api.cancel(job.id)
    wait_for(lambda: svc.store.get(job.id).state == "CANCELLED", timeout=60, what="the job cancelled")

    def alive():
        return [r["pid"] for r in seen if psutil.pid_exists(r["pid"])
                and psutil.Process(r["pid"]).status() != psutil.STATUS_ZOMBIE]

    wait_for(lambda: not alive(), timeout=30, what="every rank gone")
    sid = sj.parse_handle(svc.store.get(job.id).proc_start)
    wait_for(lambda: (lambda row: row is None or row.terminal)(sj.queue([sid]).get(sid)), timeout=30,
             what="the Slurm job ended")


def test_the_local_executor_refuses_a_job_across_nodes_in_one_line(home):
    done = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "submit", "--nodes", "2", "--gpus", "2",
                           "--", "true"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--executor slurm" in lines[0] and "local" in lines[0], done.stderr


def test_a_node_failing_twice_in_a_row_is_drained_in_slurm_with_its_reason(home, nodes):
    node = nodes[2]
    assert sn.record_failures(home, {node: f"node {node} lost: no heartbeat"}, 1) == []
    sn.record_success(home, [node])  # an attempt that ended well on it: the count starts again
    assert sn.record_failures(home, {node: f"node {node} lost: no heartbeat"}, 2) == []
    assert cluster.multi_states()[node] in ("idle", "mixed")
    assert sn.record_failures(home, {node: f"preflight failed on node {node}: ecc"}, 3) == [node]
    assert cluster.multi_states()[node].startswith("drain")
    reason = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%E"], capture_output=True, text=True).stdout
    assert "failed 2 times in a row" in reason and "job 3: preflight failed" in reason, reason
    assert sn.health(home)[node]["drained"]
    shown = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "gpus"], capture_output=True, text=True,
                           timeout=120).stdout
    assert "slurm nodes" in shown and node in shown and "drained" in shown, shown
    frame = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "top", "--once", "--width", "80"],
                           capture_output=True, text=True, timeout=120).stdout
    assert f"! slurm node {node} drained: autoresearch: failed 2 times in a row" in frame, frame


def test_a_device_fault_on_one_node_stops_every_rank_at_one_step_and_requeues_without_it(service, tmp_path, nodes):
    import re

    svc = service(AUTORESEARCH_FAULTS=f"node@{nodes[1]}:health")
    # Long enough for the node's health watch (every 2 s once the first step is done) to meet the fault.
    job = api.submit(gang(tmp_path, steps=150, every=50, delay=0.05))[0]
    finish(svc, job.id, timeout=200)
    log = log_of(svc, job.id)
    stops = set(re.findall(r"^rank (\d) stopped on request at step (\d+)$", log, re.M))
    assert len(stops) == 2 and len({step for _, step in stops}) == 1, log[-3000:]  # both ranks, one step
    step = int(next(iter(stops))[1])
    reasons = " ".join(e["reason"] for e in svc.store.record(job.id)["events"])
    assert f"device fault on node {nodes[1]}" in reasons, reasons
    second = ranks(tmp_path, 2)
    assert {r["start"] for r in second} == {step} and nodes[1] not in {r["node"] for r in second}
    assert svc.store.get(job.id).failures == 0


def test_a_node_slurm_sets_down_mid_run_is_excluded_and_the_job_resumes_elsewhere(service, tmp_path):
    svc = service()
    job = api.submit(gang(tmp_path, steps=60, every=5, delay=0.15))[0]
    ckpt = wait_for(lambda: svc.store.get(job.id).checkpoint_dir, timeout=60, what="the job's checkpoint dir")
    wait_for(lambda: committed_steps(ckpt) and committed_steps(ckpt)[-1] >= 5, timeout=90, what="a checkpoint")
    victim = next(r["node"] for r in ranks(tmp_path, 1) if r["node_rank"] == "1")
    cluster.scontrol("update", f"nodename={victim}", "state=down", "reason=autoresearch test: node failure")
    finish(svc, job.id, timeout=150)
    reasons = " ".join(e["reason"] for e in svc.store.record(job.id)["events"])
    # Slurm's word on the node, whichever came first: its state when the service looked (DOWN, until its slurmd
    # registers again), or srun's report of the node it lost
    said = (f"node {victim} is down in Slurm", f"node {victim} failed (Slurm: node failure)")
    assert any(words in reasons for words in said) and f"--exclude={victim}" in reasons, reasons
    second = ranks(tmp_path, 2)
    assert victim not in {r["node"] for r in second} and min(r["start"] for r in second) >= 5
    assert svc.store.get(job.id).failures == 0


def test_a_gang_never_starts_on_part_of_its_nodes(service, tmp_path, nodes):
    for node in nodes[1:]:
        cluster.scontrol("update", f"nodename={node}", "state=drain", "reason=autoresearch test: one node left")
    svc = service()
    job = api.submit(gang(tmp_path, steps=4, every=2, delay=0.01))[0]
    sid = wait_for(lambda: sj.parse_handle(svc.store.get(job.id).proc_start), timeout=60, what="the sbatch")
    wait_for(lambda: (lambda row: row is not None and row.state == "PENDING")(sj.queue([sid]).get(sid)), timeout=30,
             what="Slurm holding the gang")
    assert not ranks(tmp_path, 1) and not sn.records(svc.layout.home, job.id, 1)  # nothing of it runs anywhere
    cluster.revive_node(nodes[2])
    finish(svc, job.id, timeout=120)
    assert {r["node"] for r in ranks(tmp_path, 1)} == {nodes[0], nodes[2]}


def test_an_agent_session_runs_each_trial_across_two_nodes(service, tmp_path, nodes):
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig

    svc = service(SYNTHETIC_RANKS=str(tmp_path), STEP_SECONDS="0.02")
    # Every trial runs to its end: which trial ASHA stops depends on which reaches a rung first (the machine's
    # load), and this test is about where trials run, not about ASHA.
    config = SessionConfig(goal="", experiment="tests.agent.synthetic:SPEC", proposer="random", trials=3,
                           baseline_seeds=1, confirm_seeds=1, confirm_top=1, nodes=2, min_nodes=1,
                           early_stopping=False)
    summary = runner.start(config, settings=Settings.load())
    assert summary["parallel"] == 6  # cpu:12 over 3 nodes; a trial holds one slot on each of 2
    jobs = [j for j in svc.store.list() if j.owner == summary["session"]]
    assert len(jobs) == summary["trials"] == 4 and all(j.state == "SUCCEEDED" for j in jobs), \
        [(j.id, j.state, j.reason) for j in jobs]
    for job in jobs:
        record = svc.store.record(job.id)
        assert record["nodes"] == 2 and record["min_nodes"] == 1 and record["gpus"] == 2
        seen = [json.loads(p.read_text()) for p in tmp_path.glob(f"{job.id}.*.json")]
        assert sorted(r["rank"] for r in seen) == [0, 1] and len({r["node"] for r in seen}) == 2, seen
    assert summary["baseline"] and summary["tally"]  # rank 0's metrics reached MLflow and were judged
    assert "on each of 2 nodes" in " ".join(summary.get("packing", {}).get("decisions", []))


def test_start_with_nodes_on_the_local_executor_is_refused_in_one_line(home):
    done = subprocess.run([sys.executable, "-m", "orchestrator.faces.fastcli", "start", "--experiment",
                           "tests.agent.synthetic:SPEC", "--proposer", "random", "--nodes", "2", "--devices", "cpu:2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nodes 2" in lines[0] and "--executor slurm" in lines[0], done.stderr
    from orchestrator.agent.session import Registry

    registry = Registry(home)
    try:
        assert registry.all() == []  # refused before anything was recorded
    finally:
        registry.close()


def test_preemption_stops_every_rank_of_a_gang_at_one_step_and_it_resumes_from_that_step(service, tmp_path):
    import psutil

    svc = service(devices="cpu:4")  # 4 slots of the partition's 12 CPUs: the low gang holds 2 of them
    low_out, high_out = tmp_path / "low", tmp_path / "high"
    low_out.mkdir()
    high_out.mkdir()
    low = api.submit(gang(low_out, steps=60, every=50, delay=0.1, priority=0))[0]
    seen = wait_for(lambda: len(ranks(low_out, 1)) == 2 and ranks(low_out, 1), timeout=90, what="the low gang's ranks")
    wait_for(lambda: "step 3 " in log_of(svc, low.id), timeout=60, what="the low gang training")
    # Every slot, at a higher priority: the low gang must make way.
    high = api.submit(gang(high_out, steps=3, every=3, delay=0.02, nodes=2, gpus=2, priority=10))[0]
    finish(svc, high.id, timeout=180)
    first_high = min(r["at"] for r in ranks(high_out, 1))
    stopped = [int(line.split()[-1]) for line in log_of(svc, low.id).splitlines() if "stopped on request" in line]
    assert len(stopped) == 2 and len(set(stopped)) == 1, stopped  # every rank, the same step
    assert not [r["pid"] for r in seen if psutil.pid_exists(r["pid"])
                and psutil.Process(r["pid"]).status() != psutil.STATUS_ZOMBIE]  # no rank outlived its attempt
    assert any("preempt" in (e.reason or "") for e in svc.store.events(low.id) if e.dst == "QUEUED")
    finish(svc, low.id, timeout=180)
    second = ranks(low_out, 2)
    assert len(second) == 2 and {r["start"] for r in second} == {stopped[0]}  # resumed at the step it stopped
    assert min(r["at"] for r in second) > first_high  # after the high gang had its nodes


def test_losing_the_head_node_where_the_batch_shell_and_rendezvous_live_is_survived_the_same_way(service, tmp_path):
    import psutil

    svc = service()
    job = api.submit(gang(tmp_path, steps=30, every=5, delay=0.15))[0]
    ckpt = wait_for(lambda: svc.store.get(job.id).checkpoint_dir, timeout=60, what="the job's checkpoint dir")
    wait_for(lambda: committed_steps(ckpt) and committed_steps(ckpt)[-1] >= 10, timeout=90, what="a checkpoint")
    first = ranks(tmp_path, 1)
    head = next(r["node"] for r in first if r["node_rank"] == "0")
    assert all(r["master"] for r in first)  # the rendezvous is on the head node
    cluster.kill_node(head)
    done = finish(svc, job.id, timeout=150)
    assert done.attempts == 2 and done.failures == 0, log_of(svc, job.id)
    second = ranks(tmp_path, 2)
    assert head not in {r["node"] for r in second} and len({r["node"] for r in second}) == 2
    assert min(r["start"] for r in second) >= 10  # from the last committed checkpoint
    assert sn.excluded(svc.layout.home, job.id) == [head]
    assert not [r["pid"] for r in first if psutil.pid_exists(r["pid"])
                and psutil.Process(r["pid"]).status() != psutil.STATUS_ZOMBIE]  # no rank of the lost attempt left
