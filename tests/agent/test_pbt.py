"""Population-based training: its rules, the refusals, and sessions on the real digits and charlm experiments
(cpu slots, the embedded queue service, MLflow), one killed with -9 mid-exploit and resumed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.common import lr_at
from experiments.config_file import ConfigError, load
from orchestrator.agent import schedule as sched

ROOT = Path(__file__).resolve().parents[2]
TOTAL = 64  # digits' steps at --param epochs=4 (1,077 images, batches of 64, 16 an epoch)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from orchestrator.faces.cli import main; main()", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


# -- the rules ---------------------------------------------------------------------------------------------------

def test_the_bottom_quantile_copies_the_top_and_explores_within_the_range():
    values = {0: 0.5, 1: 0.9, 2: 0.7, 3: 0.1, 4: 0.8, 5: 0.3, 6: 0.6, 7: 0.2}
    pairs = sched.pairs(values, "maximize", random.Random(0))
    assert sorted(loser for loser, _ in pairs) == [3, 7]  # the worst quarter of 8
    assert all(donor in (1, 4) for _, donor in pairs)  # each copies one of the best quarter
    assert sched.pairs({0: 1.0}, "minimize", random.Random(0)) == []  # nobody to copy
    assert [loser for loser, _ in sched.pairs({0: 2.0, 1: 1.0}, "minimize", random.Random(0))] == [0]
    from experiments.digits.spec import SPEC

    params = SPEC.space.defaults()
    for seed in range(50):
        out = sched.perturb(SPEC.space, SPEC.mutable, params, random.Random(seed))
        SPEC.space.validate(out)  # always inside the space
        assert {k for k in out if out[k] != params[k]} <= set(SPEC.mutable)  # never the architecture
    scaled = sched.perturb(SPEC.space, ["lr"], params, random.Random(1), resample=0.0)
    assert scaled["lr"] == pytest.approx(params["lr"] * 0.8) or scaled["lr"] == pytest.approx(params["lr"] * 1.2)


def test_a_lineage_and_its_replays_are_one_configuration_apart_from_plain_runs():
    lineage = [[0, {"lr": 0.003}], [32, {"lr": 0.01}]]
    leaf = sched.row_params({"arch": "mlp", "lr": 0.01, "seed": 0}, lineage)
    replay = sched.row_params({"arch": "mlp", "lr": 0.003, "seed": 7}, lineage)
    assert {k: v for k, v in leaf.items() if k != "seed"} == {k: v for k, v in replay.items() if k != "seed"}
    assert sched.row_params({"arch": "mlp", "lr": 0.003}, None) == {"arch": "mlp", "lr": 0.003}
    assert sched.table(leaf[sched.SCHEDULE_KEY]) == [{"step": 0, "lr": 0.003}, {"step": 32, "lr": 0.01}]


def test_an_experiments_own_schedule_param_is_kept_apart_from_a_lineages_schedule(capsys):
    """digits, charlm and tabular have an lr `schedule` param: a lineage's schedule must not overwrite it, and the
    leaderboard must show a board whose best entry is a plain run of it, with the table of the lineage below it."""
    from orchestrator.faces.cli.agent import show
    from orchestrator.tracking.client import leaderboard

    lineage = [[0, {"lr": 0.003}], [32, {"lr": 0.01}]]
    cosine = sched.row_params({"lr": 0.01, "schedule": "cosine"}, lineage)
    constant = sched.row_params({"lr": 0.01, "schedule": "constant"}, lineage)
    assert cosine["schedule"] == "cosine" and cosine != constant  # two configurations, each its lr schedule
    rows = [{"params": {"lr": 0.003, "schedule": "cosine", "seed": s}, "value": 0.9 + s / 100, "baseline": True,
             "job_id": s} for s in range(3)]
    rows += [{"params": {**constant, "seed": s}, "value": 0.5, "job_id": 10 + s} for s in range(2)]
    board = {"experiment": "digits", "metric": "val_accuracy", **leaderboard(rows, "maximize")}
    assert board["entries"][0]["baseline"] and board["entries"][0]["params"]["schedule"] == "cosine"
    assert board["winner"] is None and board["entries"][1]["gated"]
    show([board])  # the best entry is a plain run with schedule="cosine"; the re-run lineage's table still shows
    out = capsys.readouterr().out
    assert "schedule=constant + PBT schedule" in out and "schedule of #2 (the re-run candidate):" in out
    assert "0.003" in out.split("schedule of #2")[1] and "32" in out.split("schedule of #2")[1]
    show([{**board, "entries": board["entries"][:1]}])  # no lineage on the board: no table, no error
    assert "schedule of #" not in capsys.readouterr().out
    board["entries"].reverse()
    show([board])  # the lineage first: its table of steps
    assert "schedule of #" in capsys.readouterr().out


def test_mutable_params_in_a_config_file(tmp_path):
    base = ('[experiment]\nrun = "python train.py {args}"\nmetric = "loss"\ndirection = "minimize"\n{extra}\n'
            '[space]\nlr = { type = "float", low = 1e-4, high = 1e-1, log = true, default = 1e-3 }\n'
            'act = { type = "choice", values = ["relu", "gelu"], default = "relu" }\n')
    (tmp_path / "autoresearch.toml").write_text(base.replace("{extra}", 'mutable = ["lr"]'))
    assert load(tmp_path).mutable == ("lr",)
    (tmp_path / "autoresearch.toml").write_text(base.replace("{extra}", 'mutable = ["act"]'))
    with pytest.raises(ConfigError, match="mutable 'act' must name a float or int"):
        load(tmp_path)


def test_pbt_is_refused_without_mutable_params_or_a_population(home):
    procs = [subprocess.Popen(_cli("start", "--experiment", exp, "--proposer", "pbt", *extra, "--devices", "cpu:2"),
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for exp, extra in (("tabular", ["--population", "2", "--perturbation-interval", "5"]),
                                ("digits", ["--perturbation-interval", "5"]),
                                ("digits", ["--population", "4"]))]
    (no_mutable, no_population, no_interval) = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for _, err, rc in (no_mutable, no_population, no_interval):
        assert rc == 2 and err.count("\n") == 1, err
    assert "experiment tabular declares no mutable params" in no_mutable[1]
    assert "--population N" in no_population[1] and "--perturbation-interval K" in no_interval[1]


# -- sessions on the real experiments ----------------------------------------------------------------------------

def _runs(tracker, job_ids):
    from orchestrator.core.config import Settings
    from orchestrator.queue.store import JobStore

    store = JobStore(Settings.load().db_url)
    return {j: tracker.client.get_run(store.get(j).mlflow_run_id) for j in job_ids}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a real session of 7 jobs: minutes on a loaded 2-core box
def test_pbt_on_digits_forks_the_top_member_and_gates_the_replayed_schedule(home):
    # Two members over 4 epochs of 16 steps, judged at step 32: the worse one takes the better one's checkpoint
    # at step 32 (however far the better one got before the copy), so the child always has training left to do.
    done = subprocess.run(_cli("start", "--experiment", "digits", "--proposer", "pbt", "--population", "2",
                               "--perturbation-interval", "32", "--param", "epochs=4", "--devices", "cpu:2",
                               "--baseline-seeds", "2", "--confirm-seeds", "2", "--json"),
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    from orchestrator.core.config import Settings
    from orchestrator.core.layout import Layout
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

    settings = Settings.load()
    store, tracker, layout = JobStore(settings.db_url), Tracker.from_settings(settings), Layout(settings.home)
    jobs = store.list(owner=summary["session"])
    by_phase = {}
    for j in jobs:
        by_phase.setdefault(j.phase, []).append(j)
    assert len(by_phase["search"]) == 3 and len(by_phase["baseline"]) == 2 and len(by_phase["confirm"]) == 2
    child = by_phase["search"][2]
    run = tracker.client.get_run(child.mlflow_run_id)
    tags = run.data.tags
    donor_job = next(j for j in by_phase["search"][:2] if j.mlflow_run_id == tags["autoresearch.pbt.parent_run"])
    loser_job = next(j for j in by_phase["search"][:2] if j is not donor_job)
    fork_step = int(tags["autoresearch.pbt.fork_step"])
    assert 32 <= fork_step < TOTAL and tags["autoresearch.pbt.replaced_trial"] == str(by_phase["search"].index(loser_job))
    # The loser was the worse member at step 32 (the first report at or past it).
    at = {j.id: sched.value_at(tracker.history(j.mlflow_run_id, "val_accuracy"), 32) for j in (donor_job, loser_job)}
    assert at[donor_job.id] >= at[loser_job.id]
    assert store.get(loser_job.id).state == "CANCELLED"
    # The fork is the donor's checkpoint at that step, byte for byte.
    fork = layout.fork_dir(child.idempotency_key) / f"step_{fork_step:010d}"
    donor_ckpt = layout.checkpoint_dir(donor_job.id) / fork.name
    if donor_ckpt.exists():  # still kept by the donor's retention
        assert sorted(p.name for p in fork.iterdir()) == sorted(p.name for p in donor_ckpt.iterdir())
        for p in donor_ckpt.iterdir():
            if p.is_file():
                assert p.read_bytes() == (fork / p.name).read_bytes()
    # Params before (the donor's) and after (the child's), and the child resumed at the fork with its new lr.
    before, after = json.loads(tags["autoresearch.pbt.params_before"]), json.loads(tags["autoresearch.pbt.params_after"])
    assert before == {k: donor_job.params[k] for k in before} and after == {k: child.params[k] for k in after}
    assert before != after
    log = layout.log_path(child.id).read_text()
    assert f"resuming at step {fork_step}" in log
    lrs = tracker.history(child.mlflow_run_id, "lr")  # from the fork's own epoch end on: the new peak's schedule
    assert lrs[0][0] >= fork_step and lrs[-1][0] == TOTAL
    assert [v for _, v in lrs] == pytest.approx([lr_at(s - 1, TOTAL, after["lr"], 0, "cosine") for s, _ in lrs])
    # The winner's schedule was replayed from scratch on two fresh seeds and only those replays were gated.
    winner = next(e for e in summary["ranking"] if e["gated"])
    table = sched.table(winner["params"][sched.SCHEDULE_KEY])
    for replay in by_phase["confirm"]:
        assert replay.env["AUTORESEARCH_SCHEDULE"] == winner["params"][sched.SCHEDULE_KEY]
        assert "from scratch" in layout.log_path(replay.id).read_text()
        assert replay.params["lr"] == table[0]["lr"] and replay.params["seed"] != 0
    assert winner["n_fresh"] == 2 and sorted(winner["job_ids"])[-2:] == sorted(j.id for j in by_phase["confirm"])
    if len(table) > 1:  # a forked lineage: the replay changed its lr at the fork step
        lrs = tracker.history(by_phase["confirm"][0].mlflow_run_id, "lr")
        step, lr = next((s, v) for s, v in lrs if s - 1 >= table[1]["step"])
        assert lr == pytest.approx(lr_at(step - 1, TOTAL, table[1]["lr"], 0, "cosine"))
    board = subprocess.run(_cli("leaderboard", "--experiment", "digits"), cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert board.returncode == 0 and "schedule of #" in board.stdout, board.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pbt_on_charlm_killed_mid_exploit_resumes_without_losing_or_copying_twice(home):
    args = ("--experiment", "charlm", "--proposer", "pbt", "--population", "2", "--perturbation-interval", "30",
            "--param", "max_steps=60", "--param", "width=32", "--param", "layers=1",
            "--param", "block_size=32", "--param", "batch_size=8", "--devices", "cpu:2", "--baseline-seeds", "1", "--confirm-seeds", "0")
    proc = subprocess.Popen(_cli("start", *args, "--json"), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = []
    deadline = time.time() + 600
    for line in proc.stderr:  # the exploit is decided: kill before (or while) the child is copied and queued
        first.append(line)
        if " copies trial " in line or time.time() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(" copies trial " in line for line in first), "".join(first)[-3000:]
    from orchestrator.agent.session import Registry
    from orchestrator.core.config import Settings
    from orchestrator.core.layout import Layout
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

    settings = Settings.load()
    (row,) = Registry(settings.home).all()
    assert row["status"] == "interrupted"
    done = subprocess.run(_cli("resume", row["id"], "--devices", "cpu:2", "--json"), cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = JobStore(settings.db_url).list(owner=row["id"])
    keys = [j.idempotency_key for j in jobs]
    assert sorted(keys) == sorted(f"{row['id']}:{n}" for n in range(len(keys))) and len(keys) == 2 + 1 + 1
    copies = "".join(first).count("(checkpoint copied)") + done.stderr.count("(checkpoint copied)")
    assert copies == 1  # one child, one copy, whichever process made it
    child = next(j for j in jobs if j.phase == "search" and "AUTORESEARCH_INIT_CHECKPOINT" in j.env)
    tags = Tracker.from_settings(settings).client.get_run(child.mlflow_run_id).data.tags
    fork_step = int(tags["autoresearch.pbt.fork_step"])
    assert f"resuming at step {fork_step}" in Layout(settings.home).log_path(child.id).read_text()
    assert Registry(settings.home).get(row["id"])["status"] == "finished"
    counts = json.loads(done.stdout)["counts"]
    # The loser ends stopped, or succeeded when it finished its budget while the session was dead (it still counts).
    assert counts.get("succeeded", 0) >= 3 and counts.get("succeeded", 0) + counts.get("stopped", 0) == 4


def test_a_child_starts_from_the_donor_as_it_was_judged_never_from_its_end(tmp_path):
    """The copy is the donor's checkpoint at the judged interval; when its retention dropped that one, the newest
    with training left after it; the final one only when nothing else is left."""
    from orchestrator.agent.pbt import _pick

    steps = {n: tmp_path / f"step_{n:010d}" for n in (32, 48, 64)}
    assert _pick([steps[32], steps[64]], 32, 64) == steps[32]  # the donor finished before the copy
    assert _pick([steps[48], steps[64]], 32, 64) == steps[48]
    assert _pick([steps[64]], 32, 64) == steps[64]
    assert _pick([], 32, 64) is None


def test_a_child_waits_for_its_donors_checkpoint_at_the_interval_and_never_copies_an_older_one(home):
    """The donor's report at the judged step can reach MLflow before the checkpoint that follows it is
    committed (CI saw a session crash on it). The child stays proposed, no job, until the donor's checkpoint of
    that step is there; then it is copied and the child queued from it. A child whose donor ended with no
    checkpoint at all is cancelled, and says why; the session goes on."""
    import dataclasses

    from experiments.common import INIT_CHECKPOINT_ENV
    from orchestrator.agent.pbt import METADATA, agent
    from orchestrator.agent.trial import load
    from orchestrator.core.config import Settings
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker
    from tests.agent.synthetic import SPEC
    from tests.agent.test_agent_trust import SID, config, state

    settings = Settings.load()
    store, tracker = JobStore(settings.db_url), Tracker.from_settings(settings)
    spec = dataclasses.replace(SPEC, mutable=("x",))
    a = agent(session_id=SID, config=config(proposer="pbt", population=2, perturbation_interval=4), spec=spec,
                store=store, tracker=tracker, parallel=2, settings=settings)
    parent = tracker.session_run(SID, spec.name, {})

    def child(n: int, donor) -> dict:
        c = a._record(n, "search", spec.space.validate({"x": 0.5}), "pbt", "exploit")
        c.update(member=1, lineage={"parent": donor.n, "parent_run": None, "fork_step": None, "replaced": 1, "at": 4,
                                    "before": {"x": 0.4}, "after": {"x": 0.5}})
        return c

    donor = a._record(0, "search", spec.space.validate({"x": 0.4}), "pbt", "member 0")
    donor.update(status="running", job_id=9001, member=0, total=9, schedule=[[0, {"x": 0.4}]])
    kept = a.strategy.layout.checkpoint_dir(9001)

    def commit(step: int) -> None:
        (kept / f"step_{step:010d}").mkdir(parents=True)
        (kept / f"step_{step:010d}" / "model.pt").write_text(f"state at {step}")
        (kept / f"step_{step:010d}" / METADATA).write_text("{}")

    commit(2)  # an older interval's checkpoint; the one at step 4 is still being written
    (kept / "step_0000000004").mkdir()
    s = state(parent, [donor, child(1, donor)])
    out = a.submit(s)
    assert out["trials"][1]["status"] == "proposed" and store.find_by_key(f"{SID}:1") is None
    assert not a.strategy.wakes(load(out["trials"])) and not a.strategy.layout.fork_dir(f"{SID}:1").exists()
    (kept / "step_0000000004" / "model.pt").write_text("state at 4")
    (kept / "step_0000000004" / METADATA).write_text("{}")
    assert a.strategy.wakes(load(out["trials"]))  # the monitor's wait ends: the copy can be made
    out = a.submit({**s, "trials": out["trials"]})
    queued = out["trials"][1]
    job = store.find_by_key(f"{SID}:1")
    assert queued["status"] == "queued" and queued["lineage"]["fork_step"] == 4 and job is not None
    fork = Path(job.env[INIT_CHECKPOINT_ENV])
    assert (fork / "step_0000000004" / "model.pt").read_text() == "state at 4"
    assert queued["schedule"] == [[0, {"x": 0.4}], [4, {"x": 0.5}]]

    gone = a._record(2, "search", spec.space.validate({"x": 0.3}), "pbt", "member 2")
    gone.update(status="failed", ended=True, job_id=9002, member=2, total=9)  # died before any checkpoint
    out = a.submit(state(parent, [gone, child(3, gone)]))
    orphan = out["trials"][1]
    assert orphan["status"] == "cancelled" and "no checkpoint" in orphan["error"]
    assert store.find_by_key(f"{SID}:3") is None
