"""A session's packing as it runs: k from the baseline's MLflow measurements, rounds timed from the queue's event
log, every decision an event and in the checkpointed state; `--trials-per-gpu` on the CLI, MCP and config.

The graph's nodes (wrapped as `build` wraps them) run here against a real SQLite queue and a real MLflow store
with hand-made job histories; the queue's clock is the test's, so each trial holds its device for a set time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from orchestrator.agent.graph import Agent
from orchestrator.agent.session import SessionConfig
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.queue import transitions
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.tracking.client import Tracker
from runtime.protocol import DEVICE_MEMORY_METRIC, PEAK_MEMORY_METRIC, UTILIZATION_METRIC
from tests.agent.synthetic import SPEC
from tests.orchestrator.conftest import make_service  # noqa: F401  (an in-process service on cpu slots)

EXP = "tests.agent.synthetic:SPEC"
SID = "s-0000cafe"
ROOT = Path(__file__).resolve().parents[2]
H200 = 143_771.0


class Clock:
    """The queue's clock (its transitions' timestamps): the test moves it."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


class Never:
    name = "tpe"

    def propose(self, n, history):  # pragma: no cover - called only if the test is wrong
        raise AssertionError("no proposal expected")


@pytest.fixture
def world(home, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(transitions, "time", types.SimpleNamespace(time=clock.time))
    settings = Settings.load()
    return types.SimpleNamespace(store=JobStore(settings.db_url), tracker=Tracker.from_settings(settings),
                                 clock=clock, settings=settings, events=[])


def make(world, devices=("0",), parallel=None, **kw) -> Agent:
    base = dict(goal="g", experiment=EXP, proposer="tpe", trials=40, parallel=parallel, poll=0.05, baseline_seeds=3,
                early_stopping=False, confirm_seeds=0)
    config = SessionConfig(**{**base, **kw})
    return Agent(session_id=SID, config=config, spec=SPEC, store=world.store, tracker=world.tracker,
                 parallel=parallel or len(devices), proposer=Never(), settings=world.settings,
                 devices=list(devices), on_event=world.events.append)


def lines(world) -> list[str]:
    return [e["message"] for e in world.events if e["event"] == "packing"]


def run_jobs(world, job_ids: list[int], seconds: float, *, loss: float = 1.0, use=None) -> None:
    """The jobs start together, hold their device `seconds`, log their metric (and their GPU use) and succeed."""
    from mlflow.entities import Metric

    store = world.store
    store.claim([(j, ["0"]) for j in job_ids], "host")
    for j in job_ids:
        store.mark_running(j, 4242, None)
    world.clock.now += seconds
    for j in job_ids:
        metrics = [Metric("loss", loss, 0, 9)] + [Metric(k, v, 0, 0) for k, v in (use or {}).items()]
        world.tracker.client.log_batch(store.get(j).mlflow_run_id, metrics=metrics)
        store.finish(j, 0)


def baseline_done(world, a: Agent, use=None, seconds: float = 100.0) -> dict:
    """A session's first steps: the baseline proposed and submitted, each run alone (one after the other on the
    one device), then seen ended and analysed. Returns the state."""
    parent = world.tracker.session_run(SID, SPEC.name, {})
    s = {"session": SID, "parent_run": parent, "phase": "search", "trials": [], "elapsed": 0.0, "best": None,
         "usage": {}}
    s.update(a.packed("propose", a.propose)(s))
    s.update(a.packed("submit", a.submit)(s))
    for t in s["trials"]:
        run_jobs(world, [t["job_id"]], seconds, use=use)
    return step(a, s)


def step(a: Agent, s: dict, monitor: bool = True) -> dict:
    """monitor (it sees ended jobs; it would wait out its heartbeat with nothing ending) and analyse."""
    if monitor:
        s.update(a.packed("monitor", a.monitor)(s))
    s.update(a.packed("analyse", a.analyse)(s))
    return s


def packed_round(world, a: Agent, s: dict, count: int, seconds: float) -> dict:
    """`count` search trials recorded now, their jobs queued (whole-device requests: the share is the service's
    business, tested apart) and run side by side for `seconds`."""
    trials = list(s["trials"])
    ids = []
    for _ in range(count):
        t = a._record(len(trials), "search", SPEC.space.validate({"x": 1.0}), "tpe", "")
        job = world.store.submit(JobSpec(argv=["true"], priority=0, owner=SID, mlflow_run_id=world.tracker.trial_run(
            s["parent_run"], SPEC.name, key=t.key, name=t.key, params=t.params, tags={}), idempotency_key=t.key))
        t.update(status="queued", job_id=job.id, run_id=job.mlflow_run_id)
        trials.append(t.to_dict())
        ids.append(job.id)
    s["trials"] = trials
    run_jobs(world, ids, seconds)
    return step(a, s)


DIGITS_USE = {PEAK_MEMORY_METRIC: 2400.0, DEVICE_MEMORY_METRIC: H200, UTILIZATION_METRIC: 12.0}


def test_auto_measures_the_baseline_then_raises_k_while_it_pays_and_steps_back(world):
    a = make(world)
    s = baseline_done(world, a, use=DIGITS_USE, seconds=100.0)
    assert [world.store.get(t["job_id"]).gpus for t in s["trials"]] == [1, 1, 1]  # the baseline ran alone
    assert lines(world) == [
        "packing: k=1 while the baseline runs alone; its GPU use then decides k",
        "packing: k=4: 3 baseline run(s) peak 2.4 GB of 144 GB, busy 12% -> fits 47, busy target 80% -> 7; chose 4 "
        "(a power of two at most 7; the throughput check raises it if it pays)"]
    assert (a.k, a.parallel, a.capacity, a.gpus()) == (4, 4, 5, 0.25)
    assert s["packing"]["controller"]["prev_tph"] == 36.0  # the baseline alone: 1 device / 100 s

    s = packed_round(world, a, s, 4, 80.0)  # 4 side by side, 80 s each: 180 trials/hour
    assert lines(world)[-1] == "packing: k 4 -> 8 (trials/hour 36 -> 180, +400%); trying 8"
    assert (a.k, a.parallel) == (8, 8)
    s = packed_round(world, a, s, 8, 170.0)  # 8 side by side, 170 s each: 169 trials/hour, less than at 4
    assert lines(world)[-1] == "packing: k 8 -> 4 (trials/hour 180 -> 169, -6%, under +15%); holding 4"
    assert a.k == 4
    s = packed_round(world, a, s, 4, 10.0)  # held: a fast round changes nothing
    assert len(lines(world)) == 4 and a.k == 4

    # Stored with the session: the checkpointed state, the session run's metric and tag; a resumed agent
    # continues at k=4.
    assert s["packing"]["k"] == 4 and s["packing"]["log"][-1].startswith("k 8 -> 4")
    history = world.tracker.client.get_metric_history(s["parent_run"], "trials_per_gpu")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [4, 8, 4]
    assert world.tracker.tags(s["parent_run"])["autoresearch.packing"].startswith("k 8 -> 4")
    again = make(world)
    again.packed("monitor", lambda state: {})(json.loads(json.dumps(s)))
    assert (again.k, again.parallel) == (4, 4)


def test_a_packed_trial_out_of_gpu_memory_steps_k_back_and_is_not_a_failure(world):
    a = make(world)
    s = baseline_done(world, a, use=DIGITS_USE)
    t = a._record(len(s["trials"]), "search", SPEC.space.validate({"x": 1.0}), "tpe", "")
    job = world.store.submit(JobSpec(argv=["true"], priority=0, owner=SID, idempotency_key=t.key))
    t.update(status="running", job_id=job.id)
    s["trials"] = [*s["trials"], t.to_dict()]
    world.store.claim([(job.id, ["0"])], "host")
    world.store.mark_running(job.id, 4242, None)
    world.store.requeue(job.id, "out of GPU memory while sharing device 0 (attempt 1): requeued to run alone")
    s = step(a, s, monitor=False)
    assert lines(world)[-1] == (f"packing: k 4 -> 2 (trial 3 (job {job.id}) ran out of GPU memory at k=4); "
                                "holding 2")
    assert a.k == 2 and s["packing"]["oom_jobs"] == [job.id]
    assert s["trials"][-1]["status"] == "running" and not s["trials"][-1]["ended"]  # one trial, still in flight
    s = step(a, s, monitor=False)
    assert len(lines(world)) == 3  # seen once


def test_missing_measurements_keep_one_per_gpu_and_say_why(world):
    a = make(world)
    s = baseline_done(world, a, use=None)
    assert lines(world)[-1] == ("packing: k=1: 3 baseline run(s) did not log their GPU peak memory, device memory, "
                                "utilisation; trials run one per GPU")
    assert a.k == 1 and s["packing"]["controller"]["held"]
    packed_round(world, a, s, 1, 10.0)
    assert a.k == 1 and len(lines(world)) == 2


def test_parallel_caps_k(world):
    a = make(world, parallel=2)
    baseline_done(world, a, use=DIGITS_USE)
    assert a.k == 2 and a.parallel == 2 and lines(world)[-1].startswith("packing: k=4: ")  # 4 measured, 2 allowed


def test_cpu_slots_run_one_per_slot_unless_told(world):
    a = make(world, devices=("cpu:0", "cpu:1"))
    s = baseline_done(world, a, use=DIGITS_USE)
    assert lines(world) == ["packing: k=1 (cpu slots: auto runs one trial per slot; --trials-per-gpu N packs N)"]
    assert (a.k, a.parallel, a.gpus()) == (1, 2, 1) and s["packing"]["mode"] == "cpu"

    world.events.clear()
    b = make(world, devices=("cpu:0", "cpu:1"), trials_per_gpu=4)
    assert (b.k, b.parallel, b.capacity, b.gpus()) == (4, 8, 9, 0.25)  # before its first node, too
    s = {"session": SID, "trials": [], "phase": "search", "elapsed": 0.0}
    out = b.packed("decide", lambda state: {"route": "monitor"})(s)
    assert out["packing"]["mode"] == "fixed" and out["route"] == "monitor"
    assert lines(world) == ["packing: k=4 (--trials-per-gpu 4): each trial asks for 1/4 of a device"]


def test_unknown_devices_pack_nothing_and_say_nothing(world):
    a = make(world, devices=())
    out = a.packed("propose", lambda state: {})({"trials": []})
    assert a.k == 1 and out["packing"]["mode"] == "off" and lines(world) == []


def test_submit_asks_for_the_share(world):
    a = make(world, devices=("cpu:0",), trials_per_gpu=4, baseline_seeds=16)  # all in flight: the baseline
    parent = world.tracker.session_run(SID, SPEC.name, {})
    s = {"session": SID, "parent_run": parent, "phase": "search", "trials": [], "elapsed": 0.0, "best": None,
         "usage": {}}
    s.update(a.packed("propose", a.propose)(s))
    s.update(a.packed("submit", a.submit)(s))
    jobs = [world.store.get(t["job_id"]) for t in s["trials"]]
    assert all(j.gpus == 1 and j.gpu_share == 0.25 for j in jobs)


# -- config, CLI, MCP --------------------------------------------------------------------------------------------------

def test_session_config_keeps_trials_per_gpu_and_reads_older_configs():
    c = SessionConfig(goal="g", experiment=EXP)
    assert c.trials_per_gpu == "auto"
    assert SessionConfig(goal="g", experiment=EXP, trials_per_gpu="8").trials_per_gpu == 8
    saved = json.loads(json.dumps(SessionConfig(goal="g", experiment=EXP, trials_per_gpu=4).to_dict()))
    assert SessionConfig.from_dict(saved).trials_per_gpu == 4
    old = {k: v for k, v in c.to_dict().items() if k != "trials_per_gpu"}  # a session from before packing
    assert SessionConfig.from_dict(old).trials_per_gpu == "auto"
    with pytest.raises(BadInput, match="--trials-per-gpu must be auto or an integer from 1 to 16, got 17"):
        SessionConfig(goal="g", experiment=EXP, trials_per_gpu=17)


def test_session_config_trials_across_nodes_take_whole_devices_and_are_checked():
    from orchestrator.faces.pyapi.sessionapi import no_nodes

    c = SessionConfig(goal="g", experiment=EXP, nodes=2, min_nodes=1)
    assert SessionConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    old = {k: v for k, v in c.to_dict().items() if k not in ("gpus", "nodes", "min_nodes")}  # from before them
    assert (SessionConfig.from_dict(old).nodes, SessionConfig.from_dict(old).gpus) == (1, 1)
    with pytest.raises(BadInput, match="--min-nodes must be an integer from 1 to --nodes \\(2\\), got 3"):
        SessionConfig(goal="g", experiment=EXP, nodes=2, min_nodes=3)
    with pytest.raises(BadInput, match="--nodes must be an integer from 1"):
        SessionConfig(goal="g", experiment=EXP, nodes=0)
    with pytest.raises(BadInput, match="--trials-per-gpu 4 packs trials on one device; a trial across --nodes 2"):
        SessionConfig(goal="g", experiment=EXP, nodes=2, trials_per_gpu=4)
    with pytest.raises(BadInput, match="--gpus, --nodes and --min-nodes go with --experiment"):
        no_nodes(2, None)
    with pytest.raises(BadInput, match="--gpus \\(devices per trial\\) must be an integer from 1 to 1024, got 0"):
        SessionConfig(goal="g", experiment=EXP, gpus=0)
    with pytest.raises(BadInput, match="a trial of --gpus 2 takes whole devices"):
        SessionConfig(goal="g", experiment=EXP, gpus=2, trials_per_gpu=2)


def test_trials_across_nodes_are_never_packed_and_hold_a_device_per_node(world):
    a = make(world, devices=("cpu:0", "cpu:1", "cpu:2", "cpu:3"), nodes=2)
    assert a.parallel == 2 and a.gpus() == 1
    state = a.packed("propose", lambda s: {})({"trials": []})
    assert state["packing"]["mode"] == "whole" and a.k == 1
    assert "1 whole device(s) on each of 2 nodes" in state["packing"]["log"][0]


def test_trials_of_several_devices_hold_them_whole_and_fewer_run_at_once(world):
    devices = tuple(f"cpu:{i}" for i in range(8))
    a = make(world, devices=devices, gpus=2)
    assert a.parallel == 4 and a.gpus() == 2  # eight devices, two per trial
    b = make(world, devices=devices, gpus=2, nodes=2)
    assert b.parallel == 2 and b.gpus() == 2  # two per node on each of two nodes: four per trial
    state = b.packed("propose", lambda s: {})({"trials": []})
    assert state["packing"]["mode"] == "whole" and "2 whole device(s) on each of 2 nodes" in state["packing"]["log"][0]


def test_a_trial_larger_than_the_queues_devices_is_refused_before_the_session_starts(home, make_service):
    from orchestrator.agent import runner

    too_big = SessionConfig(goal="", experiment=EXP, proposer="random", gpus=4)
    with pytest.raises(BadInput, match="--gpus 4: a trial needs 4 devices; the session's service would have 2 "
                                       "\\(cpu:2\\)"):
        runner.check(too_big, Settings.load(), devices="cpu:2")
    make_service(devices="cpu:3")  # a live service decides once there is one
    with pytest.raises(BadInput, match="--gpus 4: no live service has 4 devices; largest has 3"):
        runner.check(too_big, Settings.load())
    runner.check(SessionConfig(goal="", experiment=EXP, proposer="random", gpus=3), Settings.load())


def test_settings_target_busy(home, monkeypatch):
    assert Settings.load().pack_target_busy == 0.8
    monkeypatch.setenv("AUTORESEARCH_PACK_TARGET_BUSY", "0.5")
    assert Settings.load().pack_target_busy == 0.5
    monkeypatch.setenv("AUTORESEARCH_PACK_TARGET_BUSY", "1.5")
    with pytest.raises(BadInput, match=r"pack_target_busy must be in \(0, 1\]"):
        Settings.load()


@pytest.mark.parametrize("bad", ["0", "17", "half", "0.5"])
def test_start_refuses_a_bad_trials_per_gpu_in_one_line(home, bad):
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "start", "--experiment", "digits",
                          "--trials-per-gpu", bad], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (f"autoresearch: --trials-per-gpu must be auto or an integer from 1 to 16, "
                                  f"got {bad!r}")


def test_mcp_start_session_takes_trials_per_gpu(home):
    import anyio

    from orchestrator.faces.mcp_server import build_server

    server = build_server(Settings.load())

    async def main():
        tools = {t.name: t for t in await server.list_tools()}
        try:
            await server.call_tool("start_session", {"experiment": "digits", "trials_per_gpu": 40})
        except Exception as exc:  # the tool's one-line error
            return tools, str(exc)
        return tools, None

    tools, error = anyio.run(main)
    assert "trials_per_gpu" in tools["start_session"].input_schema["properties"]
    assert error is not None and "--trials-per-gpu must be auto or an integer from 1 to 16, got 40" in error


def test_auto_proposes_nothing_more_until_the_baseline_has_decided_k(world):
    """A trial proposed while the last baseline run still decides k would ask for a whole device, and the shares
    proposed a moment later could not join it there until it ended: auto proposes nothing more until then."""
    a = make(world, baseline_seeds=2)
    parent = world.tracker.session_run(SID, SPEC.name, {})
    s = {"session": SID, "parent_run": parent, "phase": "search", "trials": [], "elapsed": 0.0, "best": None,
         "usage": {}}
    s.update(a.packed("propose", a.propose)(s))
    s.update(a.packed("submit", a.submit)(s))
    first, second = s["trials"]
    run_jobs(world, [first["job_id"]], 100.0, use=DIGITS_USE)
    s = step(a, s)
    s.update(a.packed("propose", a.propose)(s))  # a place is free, but k is not known yet
    assert len(s["trials"]) == 2 and a.k == 1
    run_jobs(world, [second["job_id"]], 100.0, use=DIGITS_USE)
    s = step(a, s)
    assert a.k == 4 and a.capacity == 5
