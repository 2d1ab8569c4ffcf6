"""The Python API (`import orchestrator`, `import autoresearch`) against a real service on cpu slots, real agent
sessions in background processes, and the guide's notebook run block by block."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator as ar
from tests.orchestrator.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "python-api.md"
SYNTHETIC = "tests.agent.synthetic:SPEC"  # a noisy bowl in a few fast steps (tests/agent/synthetic.py)


@pytest.fixture
def importable(monkeypatch):
    """Background sessions and their jobs import this checkout (and `tests.agent.synthetic`) first."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("AUTORESEARCH_PREFLIGHT", "off")


@pytest.fixture
def no_session_left(home):
    """A test that fails half-way leaves no background session process running."""
    yield
    for left in ar.sessions():
        if left.status == "running":
            left.stop()


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the full `autoresearch` CLI run in this process."""
    from orchestrator.faces.cli import main

    with pytest.raises(SystemExit) as done:
        main(list(args))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def test_import_loads_nothing_until_a_name_is_used_and_autoresearch_is_the_same_api():
    probe = ("import sys, orchestrator; before = sorted(m for m in sys.modules if m.startswith('orchestrator.')); "
             "import autoresearch; still = sorted(m for m in sys.modules if m.startswith('orchestrator.')); "
             "same = autoresearch.submit is orchestrator.submit and autoresearch.Session is orchestrator.Session; "
             "print(before, still, same)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "[]", "True"]  # the CLI pays nothing for the API
    assert all(getattr(ar, name) is not None for name in ar.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ar.nope  # noqa: B018


def test_bad_input_raises_bad_input_with_the_clis_line_and_queues_nothing(home, capsys):
    cases = [
        (("submit", "--gpus", "0.3", "--", "true"), lambda: ar.submit(["true"], gpus=0.3)),
        (("submit", "--time-limit", "5 parsecs", "--", "true"), lambda: ar.submit("true", time_limit="5 parsecs")),
        (("submit", "--scavenger", "--no-preempt", "--", "true"),
         lambda: ar.submit(["true"], scavenger=True, no_preempt=True)),
        (("submit", "--param", "lr=0.1", "--", "true"), lambda: ar.submit(["true"], params={"lr": 0.1})),
        (("submit", "--experiment", "digits", "--param", "lr=x"),
         lambda: ar.submit(experiment="digits", params={"lr": "x"})),
        (("submit", "--experiment", "nope"), lambda: ar.submit(experiment="nope")),
        (("cancel", "12345"), lambda: ar.cancel(12345)),
        (("show", "12345"), lambda: ar.job(12345)),
        (("leaderboard", "--experiment", "nope"), lambda: ar.leaderboard("nope")),
        (("start", "--experiment", "digits", "--proposer", "nope"),
         lambda: ar.start_session("digits", proposer="nope")),
        (("start", "--experiment", "digits", "--param", "epochs=lots"),
         lambda: ar.start_session("digits", params={"epochs": "lots"})),
    ]
    for args, call in cases:
        code, _, err = cli(capsys, *args)
        with pytest.raises(ar.BadInput) as refused:
            call()
        assert code == 2 and err == f"autoresearch: {refused.value}\n", (args, err)
    assert ar.jobs(all=True) == [] and ar.sessions() == []


def test_submit_jobs_job_wait_and_cancel_round_trip_on_cpu_slots(home, make_service, importable, capsys):
    make_service("cpu:2")
    quick = ar.submit([sys.executable, "-c", "import os; print('hi', os.environ['GREETING'])"], name="quick",
                      time_limit="1m", env={"GREETING": "there"})
    assert isinstance(quick, ar.Job) and quick.service_running
    assert (quick.name, quick.priority, quick.time_limit, quick.owner) == ("quick", 10, 60.0, "human")
    sleeper = ar.submit([sys.executable, "-c", "import time; time.sleep(300)"], name="sleeper", priority=20,
                        grace=2, no_preempt=True, time_limit=600)
    wait_for(lambda: ar.job(sleeper.id).state == "RUNNING", timeout=60, what="the sleeper to run")
    assert sleeper.id in [j.id for j in ar.jobs()] and not any(j.is_finished for j in ar.jobs())

    done = ar.wait(quick, timeout=60)
    assert done.succeeded and [e.to for e in done.events] == ["QUEUED", "STARTING", "RUNNING", "SUCCEEDED"]
    assert "hi there" in ar.logs(done)
    code, out, _ = cli(capsys, "show", str(done.id), "--json")  # the CLI prints what the API returns
    assert code == 0 and json.loads(out) == json.loads(json.dumps(ar.job(done.id).to_dict(), default=str))

    assert ar.cancel(sleeper.id).state in ("CANCELLING", "CANCELLED")
    cancelled = ar.wait(sleeper.id, timeout=60)
    assert cancelled.state == "CANCELLED" and not cancelled.preemptions
    assert ar.jobs() == [] and {j.id for j in ar.jobs(all=True)} == {quick.id, sleeper.id}
    with pytest.raises(ar.BadInput):
        ar.cancel(sleeper.id)  # finished jobs never change


@pytest.mark.slow
def test_a_session_streams_its_events_is_stopped_resumed_and_ends_with_a_verdict(home, make_service, importable,
                                                                                  monkeypatch, no_session_left):
    monkeypatch.setenv("STEP_SECONDS", "0.05")  # the synthetic job's pace, inherited by its jobs
    make_service("cpu:2")
    session = ar.start_session(SYNTHETIC, goal="lowest loss", proposer="tpe", trials=4, parallel=2,
                               baseline_seeds=2, confirm_top=1, confirm_seeds=2, no_early_stop=True)
    assert session.status == "running" and session.pid

    seen = []
    for event in session.events():  # follows the running session
        seen.append(event)
        if event.kind == "succeeded":
            break
    assert seen[-1].data["value"] is not None and any(e.kind == "submitted" for e in seen)
    stopped = session.stop()
    assert stopped["status"] == "interrupted" and session.status == "interrupted"
    with pytest.raises(ar.BadInput, match="no session 's-nothere'"):
        ar.session("s-nothere")

    session.resume()
    with pytest.raises(ar.BadInput, match="still running"):
        session.resume()
    verdict = session.wait(timeout=180)
    assert verdict.status == "finished" and verdict.metric == "loss" and verdict.direction == "minimize"
    assert verdict.baseline is not None and verdict.headline and verdict.stop_reason
    events = list(session.events(follow=False))  # both runs of it, in order
    kinds = [e.kind for e in events]
    assert kinds[:len(seen)] == [e.kind for e in seen] and "phase" in kinds  # the confirm phase, after resume
    # A stop costs no trial: those it cancelled ran again, and every planned trial has its result.
    cut_short = [ar.job(j) for j in stopped["cancelled_jobs"]]  # in flight at the stop
    cut_short = [j for j in cut_short if j.state == "CANCELLED"]  # (one may have finished as it was cancelled)
    assert all(j.reason.startswith(f"stopped with session {session.id}; resume runs it again") for j in cut_short)
    # Each ran again, unless its job had reached the end of its budget as the stop's cancel landed (it exited 0
    # while CANCELLING): then its result counts as it is.
    trial_of = {e.data["job"]: e.data["trial"] for e in events if e.kind == "submitted"}
    rerun = {e.data["job"] for e in events if e.kind == "rerun"}
    kept = {e.data["trial"] for e in events if e.kind == "succeeded"
            and "finished its full budget before it was stopped" in (e.data.get("error") or "")}
    assert all((j.id in rerun) != (trial_of[j.id] in kept) for j in cut_short), (rerun, kept, cut_short)
    assert kinds.count("rerun") == len(rerun) == len(cut_short) - len(kept)
    assert kinds.count("succeeded") >= verdict.summary["counts"]["succeeded"] >= 4
    phases = ar.session(session.id).progress()["phases"]  # the cancelled jobs are not counted as trials done
    assert phases["baseline"]["done"] == 2 and phases["search"]["done"] + phases["confirm"]["done"] == 4, phases
    with pytest.raises(ar.BadInput, match="already finished"):
        session.stop()
    with pytest.raises(ar.BadInput, match="already finished"):
        session.resume()
    assert [s.id for s in ar.sessions()] == [session.id] and ar.session(session.id).status == "finished"
    board = ar.leaderboard(SYNTHETIC)[0]
    assert board.experiment == "synthetic" and board.baseline is not None and board.baseline.n >= 2
    assert board.headline == verdict.headline


@pytest.mark.slow
def test_a_program_session_stopped_mid_trial_runs_those_trials_again_on_resume(home, make_service, importable,
                                                                               monkeypatch, tmp_path,
                                                                               no_session_left):
    from tests.agent.fake_llm import FakeLLM, ok
    from tests.programs.conftest import answer, edit, make_program

    program = make_program(tmp_path / "proj", repeats=2, sleep=6.0)  # each run takes seconds: a stop lands mid-run
    service = make_service("cpu:2")
    with FakeLLM([ok(answer(edit("LR = 1.0", "LR = 2.0", why="the optimum is near 3")))] * 3) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        session = ar.start_session(program=str(program), goal="lower the score", trials=4, parallel=2)
        wait_for(lambda: [j for j in service.store.list() if j.owner == session.id and j.state == "RUNNING"],
                 timeout=120, what="a trial of the program session running")
        stopped = session.stop()
        assert stopped["cancelled_jobs"], [(j.id, j.state, j.reason) for j in service.store.list()]
        ended = wait_for(lambda: (lambda js: js if all(j.state in ("SUCCEEDED", "FAILED", "CANCELLED") for j in js) else None)(
            [ar.job(i) for i in stopped["cancelled_jobs"]]), timeout=60, what="the cancelled jobs to end")
        cut_short = [j for j in ended if j.state == "CANCELLED"]  # (one may have finished as it was cancelled)
        assert cut_short and all(j.reason.startswith(f"stopped with session {session.id}") for j in cut_short)
        assert ar.session(session.id).progress()["phases"]["baseline"]["done"] == 0  # cancelled: not done
        session.resume()
        verdict = session.wait(timeout=240)
    assert verdict.status == "finished" and verdict.baseline is not None
    said = [e.text for e in session.events(follow=False) if e.kind == "message"]
    again = [line for line in said if "was cancelled when the session stopped; running it again" in line]
    assert len(again) == len(cut_short), said
    jobs = [j for j in service.store.list() if j.owner == session.id]
    assert sum(j.state == "SUCCEEDED" for j in jobs) == 4  # the whole budget ran: the stop cost no trial
    assert {j.state for j in jobs} == {"SUCCEEDED", "CANCELLED"} and len(jobs) == 4 + len(cut_short)


def guide_blocks() -> list[str]:
    """The guide's Python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", GUIDE.read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.mark.slow
def test_the_guide_runs_block_by_block_as_a_notebook(home, importable, tmp_path, monkeypatch, capsys,
                                                      no_session_left):
    monkeypatch.chdir(tmp_path)
    blocks = guide_blocks()
    assert len(blocks) >= 8
    space: dict = {}
    try:
        for i, block in enumerate(blocks):
            try:
                exec(compile(block, f"{GUIDE.name} block {i + 1}", "exec"), space)
            except Exception as exc:
                raise AssertionError(f"block {i + 1} of {GUIDE.name} failed:\n{block}") from exc
    finally:  # a block failed: leave no service behind (nor a session: no_session_left)
        if "service" in space and i < len(blocks) - 1:
            space["service"].stop()
    out = capsys.readouterr().out
    assert "hello from a job" in out and "CANCELLED" in out and "val_accuracy maximize" in out
    assert space["verdict"].status == "finished" and space["board"].baseline is not None
    assert "trial 0" in out and space["board"].headline in out


@pytest.mark.slow
def test_a_program_session_runs_in_the_background_and_reports_its_verdict(home, make_service, importable,
                                                                           monkeypatch, tmp_path, no_session_left):
    from tests.agent.fake_llm import FakeLLM, ok
    from tests.programs.conftest import answer, edit, make_program

    program = make_program(tmp_path / "proj", repeats=2)  # two runs each: the gate sees the noise
    make_service("cpu:2")
    with FakeLLM([ok(answer(edit("LR = 1.0", "LR = 2.0", why="the optimum is near 3")))]) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)  # the background process inherits it
        session = ar.start_session(program=str(program), goal="lower the score", trials=4, parallel=2)
        assert session.is_program
        verdict = session.wait(timeout=180)
    assert verdict.status == "finished" and verdict.metric == "score" and verdict.improved
    assert verdict.params["change"] == "the optimum is near 3" and verdict.best < verdict.baseline
    assert verdict.headline.startswith("score ")
    assert any(e.kind == "message" and e.text for e in session.events(follow=False))  # it reports in words
