"""Program sessions end to end: a real git repository, the real queue service and processes, real MLflow, and
the OpenAI-compatible fake LLM answering from a script of program-format answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.core.config import Settings
from orchestrator.programs.session import ProgramConfig, lineage, start
from orchestrator.queue.store import JobStore
from tests.agent.fake_llm import FakeLLM, ok
from tests.programs.conftest import answer, edit, git, make_program

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LLM = {"timeout": 10.0, "backoff": 0.01}


def config(program: Path, **kw) -> ProgramConfig:
    return ProgramConfig(**{"goal": "lower the score", "program": str(program), "poll": 0.2, "llm": LLM,
                            "max_reasks": 3, **kw})


def user_messages(fake: FakeLLM) -> list[str]:
    return [r["body"]["messages"][-1]["content"] for r in fake.requests]


def jobs(session: str):
    return JobStore(Settings.load().db_url).list(owner=session)


def run_tags(run_id: str) -> tuple[dict, list[str]]:
    from orchestrator.tracking.client import Tracker

    client = Tracker.from_settings(Settings.load()).client
    return client.get_run(run_id).data.tags, [a.path for a in client.list_artifacts(run_id)]


def test_improving_edit_is_kept_after_reruns_and_bad_edits_are_reasked(home, tmp_path, monkeypatch):
    program = make_program(tmp_path / "proj", repeats=2)
    head = git(program, "rev-parse", "HEAD")
    script = [ok(answer(edit("return (lr - 3.0) ** 2", "return 0.0", file="prepare.py"))),   # protected
              ok(answer(edit("x", "y", file="setup.py"))),                                    # outside `edit`
              ok(answer(edit("LR = 1.0", "LR = (1.0"))),                                      # does not compile
              ok(answer(edit("LR = 1.0", "LR = 2.0", why="the optimum is near 3")))]
    with FakeLLM(script) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        summary = start(config(program, trials=4, parallel=2), devices="cpu:2")
    asked = user_messages(fake)
    assert len(asked) == 4
    assert "protected" in asked[1] and "not editable" in asked[2] and "does not compile" in asked[3]
    assert summary["stop_reason"] == "trial budget used" and summary["variants"] == {"kept": 1}
    best = summary["best"]
    assert best["runs"] == 2 and 0.9 < best["mean"] < 1.1 and 3.9 < summary["baseline"] < 4.1
    assert "improvement" in best["verdict"]
    sid = summary["session"]
    # The user's branch, HEAD and working tree are untouched; the session branch holds the kept commit.
    assert git(program, "rev-parse", "HEAD") == head and git(program, "status", "--porcelain") == ""
    assert git(program, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert git(program, "rev-parse", f"autoresearch/{sid}") == best["commit"]
    assert git(program, "show", f"{best['commit']}:train.py").count("LR = 2.0") == 1
    assert git(program, "rev-parse", f"{best['commit']}^") == head
    rows = lineage(sid)
    assert [(r["step"], r["state"], r["runs"]) for r in rows] == [("baseline", "baseline", 2), ("draft", "kept", 2)]
    variant_jobs = [j for j in jobs(sid) if j.params["commit"] == best["commit"]]
    assert len(variant_jobs) == 2 and all(j.state == "SUCCEEDED" for j in variant_jobs)
    tags, artifacts = run_tags(variant_jobs[0].mlflow_run_id)
    assert tags["autoresearch.commit"] == best["commit"] and tags["autoresearch.parent"] == head
    assert tags["autoresearch.rationale"] == "the optimum is near 3" and "patch.diff" in artifacts
    # The CLI faces: the tree and the sessions list.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "tree", sid, "--json"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [r["state"] for r in json.loads(out.stdout)] == ["baseline", "kept"]
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "sessions", "--json"], capture_output=True,
                         text=True, env=env, timeout=120)
    (row,) = json.loads(out.stdout)
    assert row["status"] == "finished" and row["summary"]["stop_reason"] == "trial budget used"
    assert row["experiment"] == "program:proj"
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "leaderboard", "--experiment", "program:proj",
                          "--json"], capture_output=True, text=True, env=env, timeout=120)
    (board,) = json.loads(out.stdout)
    assert board["metric"] == "score" and board["entries"][0]["params"]["commit"] == best["commit"][:10]
    assert board["entries"][0]["n"] == 2 and board["entries"][1]["params"]["change"] == "the program as committed"


def test_crash_gets_a_debug_step_with_its_log_tail(home, tmp_path, monkeypatch):
    program = make_program(tmp_path / "proj", repeats=2)
    script = [ok(answer(edit("LR = 1.0", "LR = 2.0\nraise RuntimeError('boom in step 7')", why="bigger steps"))),
              ok(answer(edit("raise RuntimeError('boom in step 7')", "pass", why="remove the stray raise")))]
    with FakeLLM(script) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        summary = start(config(program, trials=5, parallel=1), devices="cpu:2")
    asked = user_messages(fake)
    assert len(asked) == 2
    assert "crashed" in asked[1] and "boom in step 7" in asked[1]  # the debug step carries the log tail
    rows = lineage(summary["session"])
    assert [(r["step"], r["state"]) for r in rows] == [("baseline", "baseline"), ("draft", "crashed"),
                                                       ("debug", "kept")]
    crashed, fixed = rows[1], rows[2]
    assert fixed["parent"] == crashed["commit"] and "exit code 1" in crashed["detail"]
    assert summary["best"]["commit"] == fixed["commit"]
    # The failed variant keeps its commit and its ref: nothing was reset away.
    sid = summary["session"]
    assert git(program, "rev-parse", f"refs/autoresearch/{sid}/{crashed['trial']}") == crashed["commit"]


def test_run_past_its_time_limit_is_stopped(home, tmp_path, monkeypatch):
    program = make_program(tmp_path / "proj", sleep=60, time_limit="2s", repeats=1)
    with FakeLLM() as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        summary = start(config(program, trials=1, parallel=1), devices="cpu:1")
    assert "time limit exceeded" in summary["stop_reason"]
    (job,) = jobs(summary["session"])
    assert job.state == "FAILED" and job.finished_at - job.started_at < 30


def _overlap(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = now = 0
    for _, d in points:
        now += d
        best = max(best, now)
    return best


def drafts(body: dict):
    """As many proposals as the prompt asks for, each a different learning rate."""
    n = int(re.search(r"Propose (\d+)", body["messages"][-1]["content"]).group(1))
    lrs = [2.0, 2.5, 3.5, 4.0, 1.5, 2.2, 2.8, 3.2][:n]
    drafts.count += n
    return ok(answer(*[edit("LR = 1.0", f"LR = {lr + drafts.count / 100}", why=f"lr {lr}") for lr in lrs]))


def test_four_variants_run_at_once_on_four_slots(home, tmp_path, monkeypatch):
    # A barrier instead of a sleep: each variant waits (up to 30 s) until all four have started, so they overlap
    # only if they really ran at once.
    barrier = tmp_path / "barrier"
    slow = ("import os, pathlib, random, time\nfrom prepare import evaluate\nLR = 1.0\n"
            f"gate = pathlib.Path({str(barrier)!r})\n"
            "if LR != 1.0:\n    gate.mkdir(exist_ok=True)\n    (gate / str(os.getpid())).touch()\n"
            "    end = time.time() + 30\n"
            "    while len(list(gate.iterdir())) < 4 and time.time() < end:\n        time.sleep(0.05)\n"
            "random.seed(int(os.environ.get('AUTORESEARCH_SEED', '0')))\n"
            "print(f'score: {evaluate(LR) + random.gauss(0, 0.01):.6f}', flush=True)\n")
    program = make_program(tmp_path / "proj", repeats=2, train=slow)
    drafts.count = 0
    with FakeLLM(default=drafts) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        summary = start(config(program, trials=10, parallel=4), devices="cpu:4")
    rows = lineage(summary["session"])
    variants = [r for r in rows if r["step"] != "baseline"]
    assert len(variants) == 4 and all(r["runs"] == 2 for r in variants)
    assert len({r["commit"] for r in variants}) == 4
    store = JobStore(Settings.load().db_url)
    first_runs = [store.get(r["job_ids"][0]) for r in variants]
    assert _overlap([(j.started_at, j.finished_at) for j in first_runs]) == 4


def test_kill_9_mid_run_and_resume_loses_no_trial_and_no_commit(home, tmp_path, monkeypatch):
    from orchestrator.programs import session as program_session
    from orchestrator.programs.tree import TreeStore
    from orchestrator.programs.trial import Kind, S

    program = make_program(tmp_path / "proj", sleep=1.0, repeats=2)
    drafts.count = 0
    with FakeLLM(default=drafts) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        code = ("import sys; from orchestrator.programs.session import ProgramConfig, start; "
                f"start(ProgramConfig(goal='g', program={str(program)!r}, trials=8, parallel=2, poll=0.2, "
                f"llm={LLM!r}), session_id='s-killme00', devices='cpu:2')")
        proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        trees = TreeStore(home)
        import time

        deadline = time.time() + 120
        while time.time() < deadline:
            running = [t for t in trees.trials("s-killme00") if t.kind is Kind.VARIANT and t.status is S.RUNNING]
            if running:
                break
            time.sleep(0.2)
        assert running, "no variant started"
        proc.kill()
        proc.wait()
        before = {t.n: t.commit for t in trees.trials("s-killme00")}
        summary = program_session.resume("s-killme00", devices="cpu:2")
    after = trees.trials("s-killme00")
    trees.close()
    assert all(after[n].commit == commit for n, commit in before.items() if commit)
    assert all(t.status in (S.SUCCEEDED, S.FAILED) for t in after)
    session_jobs = jobs("s-killme00")
    assert sorted(j.idempotency_key for j in session_jobs) == sorted(t.key for t in after)  # each ran once
    for t in after:
        if t.kind is Kind.VARIANT:
            assert git(program, "rev-parse", f"refs/autoresearch/s-killme00/{t.n}") == t.commit
    assert summary["trials"] == len(after) == 8


def test_sandbox_fails_a_variant_that_writes_the_protected_file_or_opens_a_socket(home, tmp_path, monkeypatch):
    import shutil
    import socket

    from tests.support.requires import require

    require("bubblewrap", None if shutil.which("bwrap") else "no bwrap on PATH (apt-get install -y bubblewrap)")

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    program = make_program(tmp_path / "proj", repeats=2, extra="max_debug = 0\nmax_failures = 1\n")
    writes = "LR = 1.0\nopen('prepare.py', 'w').write('def evaluate(lr):\\n    return -1.0\\n')"
    connects = f"LR = 1.0\nimport socket\nsocket.create_connection(('{_host_ip()}', {port}), timeout=3)"
    script = [ok(answer(edit("LR = 1.0", writes, why="cheat"))), ok(answer(edit("LR = 1.0", connects, why="call")))]
    with FakeLLM(script) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        summary = start(config(program, trials=6, parallel=2, sandbox=True), devices="cpu:2")
    listener.close()
    rows = lineage(summary["session"])
    assert [r["state"] for r in rows] == ["baseline", "crashed", "crashed"]
    assert all("exit code 1" in r["detail"] for r in rows[1:])
    assert summary["stop_reason"]  # the governor stopped it: every variant failed
    assert "return (lr - 3.0) ** 2" in (program / "prepare.py").read_text()
    store = JobStore(Settings.load().db_url)
    logs = [Path(store.get(r["job_ids"][0]).log_path).read_text() for r in rows[1:]]
    # The variant ran in its own worktree (cwd): its copy of prepare.py is under a read-only bind, not merely
    # mode 0444 (which gives "Permission denied", and which root ignores).
    assert "Read-only file system: 'prepare.py'" in logs[0], logs[0][-2000:]
    assert "Network is unreachable" in logs[1] or "Connection refused" in logs[1], logs[1]


def _host_ip() -> str:
    return "127.0.0.1"


def test_start_program_with_a_project_shows_its_llm_spend_while_running_and_notifies_its_end(home, tmp_path,
                                                                                              monkeypatch):
    """`start --program --project`: every run is charged to the project (job and MLflow run), `usage --by
    session` shows the LLM spend while the session still runs, and its end is notified like an experiment's."""
    import time

    from orchestrator.agent.session import Registry
    from orchestrator.agent.usage import usage
    from orchestrator.api.sharing import set_project

    settings = Settings.load()
    set_project(settings, "nlp", share=1)
    got = tmp_path / "events.jsonl"
    (home / "config.toml").write_text(f'[[notify]]\ncommand = "cat >> {got}; echo >> {got}"\n'
                                      'events = ["session.finished", "session.paused"]\n')
    program = make_program(tmp_path / "proj", sleep=1.5, repeats=1)
    script = [ok(answer(edit("LR = 1.0", "LR = 2.0", why="the optimum is near 3")))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with FakeLLM(script) as fake:
        env["OPENAI_BASE_URL"] = fake.base_url
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.faces.cli", "start", "--goal", "lower it",
                                 "--program", str(program), "--project", "nlp", "--trials", "2", "--parallel", "1",
                                 "--devices", "cpu:1", "--json"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        live, deadline = None, time.monotonic() + 120
        while live is None and proc.poll() is None and time.monotonic() < deadline:
            rows = [r for r in usage(settings, by="session") if r.get("llm_calls")]
            registry = Registry(home)
            try:
                running = [r["id"] for r in registry.all() if r["status"] == "running"]
            finally:
                registry.close()
            if rows and rows[0]["session"] in running:  # read before the session ended: the live record
                live = rows[0]
            time.sleep(0.05)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert live is not None and live["session"] == summary["session"], "no LLM spend seen while it ran"
    assert live["llm_calls"] == 1 and live["prompt_tokens"] > 0
    [after] = [r for r in usage(settings, by="session") if r["session"] == summary["session"]]
    assert after["llm_calls"] == 1 and after["device_seconds"] > 0
    runs = jobs(summary["session"])
    assert len(runs) == 2 and {j.project for j in runs} == {"nlp"}
    tags, _ = run_tags(runs[0].mlflow_run_id)
    assert tags["autoresearch.project"] == "nlp"
    [event] = [json.loads(line) for line in got.read_text().splitlines() if line.strip()]
    assert event["event"] == "session.finished" and event["session"] == summary["session"]
    assert event["experiment"] == "program:proj" and "score" in event["verdict"]
    assert event["stop_reason"] == summary["stop_reason"]


def test_an_undeclared_project_on_start_program_is_refused(home, tmp_path):
    from orchestrator.api.sharing import set_project

    set_project(Settings.load(), "nlp", share=1)
    program = make_program(tmp_path / "proj")
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "start", "--goal", "g", "--program",
                          str(program), "--project", "ghost"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 2 and "ghost" in out.stderr and len(out.stderr.strip().splitlines()) == 1


EVALUATE = '''import pathlib, re
lr = float(re.search(r"^LR = (.*)$", pathlib.Path("train.py").read_text(), re.M).group(1))
shift = float(pathlib.Path("holdout.txt").read_text())
print(f"score: {(lr - 3.0 - shift) ** 2:.6f}")
'''


def holdout_program(root: Path) -> Path:
    """The test program with a holdout: `holdout.txt` (untracked, ignored) shifts the optimum; the protected
    `evaluate.py` scores the commit's LR on it."""
    root.mkdir(parents=True)
    (root / ".gitignore").write_text("holdout.txt\n")
    (root / "evaluate.py").write_text(EVALUATE)
    program = make_program(root, repeats=2, extra=f'holdout = ["holdout.txt"]\nholdout_eval = "{sys.executable} '
                           'evaluate.py"\nmax_debug = 0\n')
    toml = (program / "autoresearch.toml").read_text().replace('protected = ["prepare.py"]',
                                                               'protected = ["prepare.py", "evaluate.py"]')
    (program / "autoresearch.toml").write_text(toml)
    git(program, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "evaluate.py is protected")
    (program / "holdout.txt").write_text("0.5\n")
    return program


def test_holdout_files_never_reach_a_search_run_and_the_kept_commit_is_scored_on_them(home, tmp_path, monkeypatch):
    import shutil

    from tests.support.requires import require

    program = holdout_program(tmp_path / "proj")
    looks = ("LR = 2.0\ntry:\n    LEAK = open('holdout.txt').read()\nexcept FileNotFoundError:\n    LEAK = None\n"
             "print('leak:', LEAK)")
    with FakeLLM([ok(answer(edit("LR = 1.0", looks, why="peek at the test data")))]) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        summary = start(config(program, trials=4, parallel=2), devices="cpu:2")
    assert not any("0.5" in m for m in user_messages(fake))  # the prompt never shows it either
    rows = lineage(summary["session"])
    assert [r["state"] for r in rows] == ["baseline", "kept"]
    store = JobStore(Settings.load().db_url)
    assert "leak: None" in Path(store.get(rows[1]["job_ids"][0]).log_path).read_text()  # not in its worktree
    # Read once at the end, by the protected evaluator on the kept commit and on the baseline.
    held = summary["holdout"]
    assert held["trial"] == rows[1]["trial"]
    assert held["value"] == pytest.approx(2.25) and held["baseline"] == pytest.approx(6.25)
    assert [r["holdout"] for r in rows] == [pytest.approx(6.25), pytest.approx(2.25)]
    assert summary["trials"] == 4  # the evaluation jobs are not trials
    evals = [j for j in jobs(summary["session"]) if (j.params or {}).get("holdout")]
    assert len(evals) == 2 and all(j.state == "SUCCEEDED" for j in evals)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "tree", summary["session"]],
                         capture_output=True, text=True, env=env, timeout=120)
    assert "holdout: trial 0 (baseline) 6.25" in out.stdout, out.stdout
    assert f"trial {held['trial']} (kept) 2.25" in out.stdout, out.stdout

    # Under --sandbox the file is not readable where it lies either: it reads as empty.
    require("bubblewrap", None if shutil.which("bwrap") else "no bwrap on PATH (apt-get install -y bubblewrap)")
    reads = f"LR = 2.0\nassert open({str(program / 'holdout.txt')!r}).read().strip(), 'the holdout is hidden'"
    with FakeLLM([ok(answer(edit("LR = 1.0", reads, why="read it from the program folder")))]) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        sandboxed = start(config(program, trials=4, parallel=1, sandbox=True), devices="cpu:2")
    rows = lineage(sandboxed["session"])
    assert [r["state"] for r in rows] == ["baseline", "crashed"]
    assert "the holdout is hidden" in Path(store.get(rows[1]["job_ids"][0]).log_path).read_text()
    assert (program / "holdout.txt").read_text() == "0.5\n"


def test_a_second_session_is_told_what_the_first_measured_and_never_runs_it_again(home, tmp_path, monkeypatch):
    program = make_program(tmp_path / "proj", repeats=2)
    two = edit("LR = 1.0", "LR = 2.0", why="move towards 3")
    with FakeLLM([ok(answer(two))]) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        first = start(config(program, trials=4, parallel=1), devices="cpu:2")
    assert [r["state"] for r in lineage(first["session"])] == ["baseline", "kept"]
    # The same change again (already measured by the first session), then a new one.
    with FakeLLM([ok(answer(two)), ok(answer(edit("LR = 1.0", "LR = 2.5", why="closer still")))]) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        second = start(config(program, trials=4, parallel=1), devices="cpu:2")
    asked = user_messages(fake)
    assert "Earlier sessions on this program" in asked[0] and "move towards 3" in asked[0]
    assert "kept" in asked[0].split("Earlier sessions")[1] and first["session"] in asked[0]
    assert "already tried" in asked[1]
    rows = lineage(second["session"])
    assert [(r["state"], r["rationale"]) for r in rows] == [("baseline", "the program as committed"),
                                                            ("kept", "closer still")]
