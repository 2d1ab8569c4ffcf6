"""Population-based training of a config-file experiment (a script that knows nothing of autoresearch), and PBT
under a time budget: the wrapper's segments (rules, a replayed schedule, a stopped segment resumed), then real
sessions through the queue on cpu slots."""

from __future__ import annotations

import json
import shutil
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.config_file import ConfigError, load
from orchestrator.agent import schedule as sched
from orchestrator.core import outputmetrics
from orchestrator.core.errors import BadInput
from orchestrator.executors import segments

ROOT = Path(__file__).resolve().parents[2]
TINYREG = ROOT / "examples" / "tinyreg"
TOTAL = 400  # the steps of a tinyreg member in the PBT test

# A stdlib-only script with its own checkpoint format (state.json), a resume flag and a SIGTERM handler that
# saves and exits 0, as many training scripts do. `--sleep` paces its steps in wall time.
SCRIPT = '''
import argparse, json, os, random, signal, time
p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--out", required=True)
p.add_argument("--resume", action="store_true")
a = p.parse_args()
path = os.path.join(a.out, "state.json")
step, w = 0, 0.0
if a.resume and os.path.exists(path):
    saved = json.load(open(path))
    step, w = saved["step"], saved["w"]
    print(f"resumed at step {step}", flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
def save():
    json.dump({"step": step, "w": w}, open(path + ".tmp", "w"))
    os.replace(path + ".tmp", path)
while step < a.steps and not stop:
    step += 1
    w += a.lr * (1.0 - w)
    time.sleep(a.sleep)
    if step % 10 == 0 or step == a.steps:
        noise = 0.002 * random.Random(a.seed * 100003 + step).random()
        print(f"loss: {(1 - w) ** 2 + noise:.6f}", flush=True)
        save()
save()
'''
TOML = '''[experiment]
run = "python fit.py --out={checkpoint_dir} {args}"
metric = "loss"
direction = "minimize"
resume = "--resume"
seed = "seed"
steps = "steps"
mutable = ["lr"]
fixed = { steps = STEPS, sleep = SLEEP }
[space]
lr = { type = "float", low = 0.001, high = 0.05, log = true, default = 0.004 }
'''


def _folder(tmp_path: Path, steps: int = 100, sleep: float = 0.0) -> Path:
    folder = tmp_path / "fit"
    folder.mkdir()
    (folder / "fit.py").write_text(SCRIPT)
    (folder / "autoresearch.toml").write_text(TOML.replace("STEPS", str(steps)).replace("SLEEP", str(sleep)))
    return folder


def _wrapper(spec, ckdir: Path, params: dict, env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen(spec.argv(), cwd=spec.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "AUTORESEARCH_CHECKPOINT_DIR": str(ckdir),
                                 "AUTORESEARCH_PARAMS": json.dumps(params), **env}, **kw)


def _plain(folder: Path, out: Path, *segments_: tuple[float, int]) -> float:
    """The script run by hand: each (lr, steps) a run resuming the one before; its last loss."""
    out.mkdir()
    last = None
    for i, (lr, steps) in enumerate(segments_):
        text = subprocess.run([sys.executable, "fit.py", f"--out={out}", f"--lr={lr}", f"--steps={steps}",
                               "--seed=0", *(["--resume"] if i else [])], cwd=folder, capture_output=True,
                              text=True, check=True).stdout
        last = float([line for line in text.splitlines() if line.startswith("loss:")][-1].split()[1])
    return last


# -- the rules -----------------------------------------------------------------------------------------------------

def test_segments_end_at_every_interval_and_every_schedule_change(tmp_path):
    assert segments.boundaries(200, 40, [(0, {}), (100, {})]) == [40, 80, 100, 120, 160, 200]
    assert segments.boundaries(200, None, [(0, {}), (80, {}), (200, {})]) == [80, 200]
    assert segments.boundaries(50, None, []) == [50]
    # A snapshot is run/ at a step, complete once .metadata is in; the two newest are kept, one made is kept.
    ck = tmp_path / "ck"
    (ck / "run").mkdir(parents=True)
    for step in (20, 40, 60):
        (ck / "run" / "state.json").write_text(str(step))
        assert segments.snapshot(ck, step)
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000000040", "step_0000000060"]
    assert not segments.snapshot(ck, 60)  # made before a kill: not made again
    assert (ck / "step_0000000060" / "state.json").read_text() == "60"
    # A forked trial's run/ is the newest complete snapshot, without the marker; an incomplete one never counts.
    (ck / "step_0000000080").mkdir()
    child = tmp_path / "child" / "run"
    child.parent.mkdir()
    assert segments.seed_from_fork(child, str(ck)) == 60
    assert sorted(p.name for p in child.iterdir()) == ["state.json"] and (child / "state.json").read_text() == "60"
    assert segments.seed_from_fork(child, None) is None
    with pytest.raises(RuntimeError, match="no complete snapshot"):
        segments.seed_from_fork(child, str(tmp_path / "nowhere"))


def test_pbt_on_a_config_file_needs_steps_and_resume(tmp_path):
    from orchestrator.agent.pbt import check

    folder = _folder(tmp_path)
    toml = folder / "autoresearch.toml"
    assert load(folder).steps == "steps"
    check(load(folder))
    for old, new, message in (('steps = "steps"\n', "", "needs steps in"),
                              ('resume = "--resume"\n', "", "needs resume in"),
                              ('steps = "steps"', 'steps = "lr"', "steps 'lr' must be an int parameter"),
                              ('steps = "steps"', 'steps = "epochs"', "steps 'epochs' must name the parameter"),
                              ('steps = "steps"', 'steps = "seed"', "steps 'seed' must name the parameter"),
                              ("--out={checkpoint_dir}", "--out=out", "run must pass {checkpoint_dir}"),
                              ('steps = "steps"\nmutable = ["lr"]\nfixed = { steps = 100, sleep = 0 }',
                               'steps = "n"\nmutable = ["lr", "n"]\nfixed = { steps = 100, sleep = 0 }\n[space.n]\n'
                               'type = "int"\nlow = 1\nhigh = 9', "steps 'n' is also mutable")):
        toml.write_text(TOML.replace("STEPS", "100").replace("SLEEP", "0").replace(old, new))
        with pytest.raises((BadInput, ConfigError), match=message) as caught:
            check(load(folder))
        assert "\n" not in str(caught.value)


# -- the wrapper's segments ----------------------------------------------------------------------------------------

def test_a_replayed_schedule_runs_as_resumed_segments_and_ends_where_a_hand_run_does(tmp_path):
    folder = _folder(tmp_path)
    spec = load(folder)
    ck = tmp_path / "ck"
    schedule = json.dumps([[0, {"lr": 0.004}], [50, {"lr": 0.03}]])
    proc = _wrapper(spec, ck, {"lr": 0.004, "seed": 0}, {"AUTORESEARCH_SCHEDULE": schedule})
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, log
    runs = [line for line in log.splitlines() if line.startswith("autoresearch: running:")]
    assert len(runs) == 2
    assert "--lr=0.004" in runs[0] and "--steps=50" in runs[0] and "--resume" not in runs[0]
    assert "--lr=0.03" in runs[1] and "--steps=100" in runs[1] and runs[1].endswith("--resume")
    assert "resumed at step 50" in log and f"--out={ck / 'run'}" in runs[0]
    reports = outputmetrics.read(ck)
    assert [s for s, _ in reports] == [50, 100]  # one report per segment, at its end
    assert reports[-1][1] == _plain(folder, tmp_path / "by-hand", (0.004, 50), (0.03, 100))
    assert not list(ck.glob("step_*"))  # a replay keeps no snapshots: nobody forks from it


def test_a_member_stopped_mid_segment_resumes_it_and_reports_each_interval_once(tmp_path):
    folder = _folder(tmp_path, sleep=0.02)
    spec = load(folder)
    ck = tmp_path / "ck"
    env = {"AUTORESEARCH_CHECKPOINT_EVERY": "20", "AUTORESEARCH_SCHEDULE": json.dumps([[0, {"lr": 0.01}]])}
    proc = _wrapper(spec, ck, {"lr": 0.01, "seed": 0}, env, start_new_session=True)
    deadline = time.time() + 60
    while [s for s, _ in outputmetrics.read(ck)] != [20, 40] and time.time() < deadline:
        time.sleep(0.02)
    # Inside the segment to step 60: frozen at once (not after a guessed sleep, which a busy machine stretches
    # past step 60), then the queue's cancel or preemption reaches the whole group as it resumes.
    os.killpg(proc.pid, signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGCONT)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 75, log  # the script exited 0 on SIGTERM, but its segment did not finish
    assert "the segment to step 60 was stopped" in log
    assert json.loads((ck / ".autoresearch-attempts.json").read_text())["at"] == 40
    assert (ck / "step_0000000040" / ".metadata").exists()
    again = _wrapper(spec, ck, {"lr": 0.01, "seed": 0}, env)
    log = again.communicate(timeout=120)[0]
    assert again.returncode == 0, log
    assert "segment to step 60 of 100, resuming from step 40" in log
    reports = outputmetrics.read(ck)
    assert [s for s, _ in reports] == [20, 40, 60, 80, 100]
    assert reports[-1][1] == _plain(folder, tmp_path / "by-hand", (0.01, 100))
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000000060", "step_0000000080"]


# -- sessions ------------------------------------------------------------------------------------------------------

def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from orchestrator.faces.cli import main; main()", *args]


def _start(*args: str, timeout: int = 600) -> dict:
    done = subprocess.run(_cli("start", *args, "--json"), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pbt_on_tinyreg_forks_the_scripts_own_checkpoint_and_gates_the_replays(home, tmp_path):
    # The example as shipped, with twice its steps: PBT judges an interval while members run, and a member of
    # 200 numpy steps (5 segments) can end before the session looks (a race, seen once members ran on one
    # thread each); 10 segments leave the session the time of several.
    folder = tmp_path / "tinyreg"
    shutil.copytree(TINYREG, folder, ignore=shutil.ignore_patterns("out", "__pycache__"))
    toml = folder / "autoresearch.toml"
    toml.write_text(toml.read_text().replace("fixed = { steps = 200,", f"fixed = {{ steps = {TOTAL},"))
    summary = _start("--experiment", str(folder), "--proposer", "pbt", "--population", "4",
                     "--perturbation-interval", "40", "--devices", "cpu:4", "--baseline-seeds", "2",
                     "--confirm-seeds", "2")
    from orchestrator.core.config import Settings
    from orchestrator.core.layout import Layout
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

    settings = Settings.load()
    store, tracker, layout = JobStore(settings.db_url), Tracker.from_settings(settings), Layout(settings.home)
    jobs = store.list(owner=summary["session"])
    search = [j for j in jobs if j.phase == "search"]
    children = [j for j in search if "AUTORESEARCH_INIT_CHECKPOINT" in j.env]
    assert len(search) == 4 + len(children) and children  # 4 members, and at least one exploit
    for child in children:
        tags = tracker.client.get_run(child.mlflow_run_id).data.tags
        fork_step = int(tags["autoresearch.pbt.fork_step"])
        assert fork_step % 40 == 0 and 40 <= fork_step < TOTAL
        donor = next(j for j in search if j.mlflow_run_id == tags["autoresearch.pbt.parent_run"])
        after = json.loads(tags["autoresearch.pbt.params_after"])
        assert after == {k: child.params[k] for k in ("lr", "l2")}
        assert donor.params["degree"] == child.params["degree"]  # never the architecture
        log = layout.log_path(child.id).read_text()
        # The script's own checkpoint, copied from the donor at the fork, resumed with the new params.
        assert f"starting from the fork's checkpoint at step {fork_step}" in log
        assert f"resumed at step {fork_step}" in log
        first = next(line for line in log.splitlines() if line.startswith("autoresearch: running:"))
        assert f"--lr={after['lr']!r}" in first and f"--steps={fork_step + 40}" in first and "--resume" in first
        fork = layout.fork_dir(child.idempotency_key) / f"step_{fork_step:010d}"
        assert (fork / ".metadata").exists() and (fork / "state.npz").exists()
        steps = [s for s, _ in tracker.history(child.mlflow_run_id, "val_loss")]
        # One report per segment after the fork, to the end; a child itself replaced at a later interval (its
        # job cancelled) stops where it was.
        expected = list(range(fork_step + 40, TOTAL + 1, 40))
        assert steps == expected if child.state == "SUCCEEDED" else (
            child.state == "CANCELLED" and steps == expected[:len(steps)])
    confirm = [j for j in jobs if j.phase == "confirm"]
    winner = next(e for e in summary["ranking"] if e["gated"])
    for replay in confirm:
        assert replay.env["AUTORESEARCH_SCHEDULE"] == winner["params"][sched.SCHEDULE_KEY]
        assert "from scratch" in layout.log_path(replay.id).read_text()
    assert winner["n_fresh"] == 2 and summary["headline"].startswith(("improvement", "no improvement"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pbt_under_a_time_budget_keeps_the_time_to_replay_the_leader(home, tmp_path):
    # A member takes about 24 s (240 paced steps): the search would take that and the verdict's runs as long
    # again, which 42 s cannot hold. The members stop early enough for the leader's replays and the baseline.
    folder = _folder(tmp_path, steps=240, sleep=0.1)
    summary = _start("--experiment", str(folder), "--proposer", "pbt", "--population", "2",
                     "--perturbation-interval", "20", "--devices", "cpu:4", "--baseline-seeds", "2",
                     "--confirm-seeds", "2", "--budget-minutes", "0.7")
    assert summary["stop_reason"] == "time left only for the baseline and the replays", summary["headline"]
    from orchestrator.core.config import Settings
    from orchestrator.core.layout import Layout
    from orchestrator.queue.store import JobStore
    from orchestrator.tracking.client import Tracker

    settings = Settings.load()
    jobs = JobStore(settings.db_url).list(owner=summary["session"])
    tracker = Tracker.from_settings(settings)
    judged = [j for j in jobs if j.phase in ("baseline", "confirm")]
    assert len(judged) == 4 and all(j.state == "SUCCEEDED" for j in judged)
    layout = Layout(settings.home)
    for job in judged:  # full runs, not cut ones (a replay's script keeps its state in run/)
        state = next(layout.checkpoint_dir(job.id).glob("**/state.json"))
        assert json.loads(state.read_text())["step"] == 240
    (replay,) = {j.env["AUTORESEARCH_SCHEDULE"] for j in judged if j.phase == "confirm"}
    assert tracker.history(next(j for j in judged if j.phase == "confirm").mlflow_run_id, "loss")[-1][0] == 240
    assert all(j.state in ("CANCELLED", "SUCCEEDED") for j in jobs if j.phase == "search")
    assert any(j.state == "CANCELLED" for j in jobs if j.phase == "search")  # the search was cut short
    # Judged by the gate on the replays: a gated win or "no improvement", never "no candidate was re-run".
    assert any(e["gated"] for e in summary["ranking"]), summary["headline"]
