"""Program mode, the parts that run no job: the spec, edit validation, answer parsing, git plumbing, governor."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.core.errors import BadInput
from orchestrator.programs import answers, edits, spec as specs, tree
from orchestrator.programs.judge import Judge
from orchestrator.programs.governor import CHANGE, CONTINUE, STOP, Governor
from orchestrator.programs.repo import Repo
from orchestrator.programs.trial import Kind, ProgramTrial, S, Verdict
from tests.programs.conftest import git, make_program


def test_spec_reads_contract_keys_and_refuses_bad_ones(program):
    spec = specs.load(program)
    assert (spec.edit, spec.protected, spec.metric, spec.direction) == (("train.py",), ("prepare.py",), "score",
                                                                        "minimize")
    assert spec.time_limit == 60 and spec.repo == program.resolve() and spec.prefix == ""
    assert spec.line_regex().search("score: 1.5e-3").group(1) == "1.5e-3"
    assert specs.parse_duration("5m") == 300 and specs.parse_duration("1.5h") == 5400
    toml = program / "autoresearch.toml"
    good = toml.read_text()
    (program / "prepare.py.bak").write_text("x")
    subprocess.run(["git", "add", "prepare.py.bak"], cwd=program, check=True)  # staged: tracked from here on
    for bad, why in [(good.replace('"minimize"', '"lowest"'), "direction"),
                     (good.replace('edit = ["train.py"]', 'edit = ["prepare.py"]'), "both editable and protected"),
                     (good.replace('time_limit = "60s"', 'time_limit = "soon"'), "bad time_limit"),
                     (good.replace('edit = ["train.py"]', 'edit = ["../x.py"]'), "inside the program"),
                     (good + "\nfoo = 1\n", "unknown key"),
                     (good + 'holdout = ["train.py"]\n', "holdout file and also editable"),
                     (good + 'holdout = ["nothere.txt"]\n', "holdout nothere.txt does not exist"),
                     (good + 'holdout = ["prepare.py.bak"]\n', "tracked by git")]:
        toml.write_text(bad)
        with pytest.raises(BadInput, match=why):
            specs.load(program)
    with pytest.raises(BadInput, match="no autoresearch.toml"):
        specs.load(program.parent)


def test_edits_apply_exactly_once_and_refuse_everything_else(program):
    spec = specs.load(program)
    read = lambda f: (program / f).read_text()  # noqa: E731
    out = edits.apply(spec, read, [{"file": "train.py", "search": "LR = 1.0", "replace": "LR = 2.0"}])
    assert "LR = 2.0" in out["train.py"] and "LR = 1.0" not in out["train.py"]
    cases = [
        ([{"file": "prepare.py", "search": "3.0", "replace": "0"}], "protected"),
        ([{"file": "setup.py", "search": "x", "replace": "y"}], "not editable"),
        ([{"file": "train.py", "search": "", "replace": "y"}], "non-empty"),
        ([{"file": "train.py", "search": "LR = 7", "replace": "y"}], "does not occur"),
        ([{"file": "train.py", "search": "import", "replace": "y"}], "occurs 4 times"),
        ([{"file": "train.py", "search": "LR = 1.0", "replace": "LR = (1.0"}], "does not compile"),
        ([{"file": "train.py", "search": "LR = 1.0", "replace": "x" * 30_000}], "limit"),
        ([], "non-empty list"),
    ]
    for blocks, why in cases:
        with pytest.raises(edits.EditRejected, match=why):
            edits.apply(spec, read, blocks)


def test_answers_parse_the_contract_shape_and_explain_the_rest():
    text = '{"proposals": [{"parent": "best", "rationale": "r\\u0007 x", "edits": []}, {"x": 1}]}'
    got, errors = answers.parse(text, 5)
    assert [(p.parent, p.rationale) for p in got] == [("best", "r x")]
    assert errors == ['proposal 1: expected an object with an "edits" list']
    assert answers.parse("Sure! here", 1) == ([], ["the answer is not valid JSON"])


def test_commits_never_touch_the_users_checkout_and_keep_every_variant(program, tmp_path):
    repo = Repo(program)
    head = repo.head()
    (program / "notes.txt").write_text("uncommitted work of the user\n")
    c1 = repo.commit(head, {"train.py": "LR = 2.0\n"}, "trial 1")
    c2 = repo.commit(head, {"train.py": "LR = 5.0\n"}, "trial 2")
    repo.set_ref(repo.trial_ref("s-x", 1), c1)
    repo.set_ref(repo.trial_ref("s-x", 2), c2)
    repo.set_ref(repo.branch("s-x"), c1)
    assert repo.head() == head and git(program, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert git(program, "status", "--porcelain") == "?? notes.txt"
    assert repo.show(c2, "train.py") == "LR = 5.0\n" and repo.show(c1, "prepare.py") == repo.show(head, "prepare.py")
    assert git(program, "rev-parse", "autoresearch/s-x") == c1
    assert git(program, "for-each-ref", "--format=%(objectname)", "refs/autoresearch/s-x") .split() == [c1, c2]
    wt = repo.add_worktree(tmp_path / "wt" / "1", c1)
    repo.restore_protected(wt, head, ["prepare.py"])
    assert (wt / "train.py").read_text() == "LR = 2.0\n" and not (wt / "prepare.py").stat().st_mode & 0o222
    repo.remove_worktree(wt)
    assert not wt.exists() and repo.resolve(c1) == c1


def test_program_in_a_subfolder_commits_under_its_prefix(tmp_path):
    top = tmp_path / "mono"
    make_program(top / "sub")
    subprocess.run(["rm", "-rf", str(top / "sub" / ".git")], check=True)
    (top / "README").write_text("a bigger repository\n")
    git(top, "init", "-q")
    git(top, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(top, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "mono")
    spec = specs.load(top / "sub")
    assert spec.prefix == "sub" and spec.repo == top.resolve() and spec.repo_path("train.py") == "sub/train.py"
    repo = Repo(spec.repo)
    c = repo.commit(repo.head(), {spec.repo_path("train.py"): "LR = 2.0\n"}, "t")
    assert repo.show(c, "sub/train.py") == "LR = 2.0\n" and repo.show(c, "README") == "a bigger repository\n"


def test_governor_changes_course_then_stops_with_a_reason():
    gov = Governor(max_failures=2, patience=3)
    assert [gov.record("failed"), gov.record("failed")] == [CONTINUE, CHANGE]
    assert "2 failed variants in a row" in gov.reason
    assert [gov.record("failed"), gov.record("failed")] == [CONTINUE, STOP]
    assert gov.reason == "2 failed variants in a row"
    gov = Governor(max_failures=5, patience=2)
    assert [gov.record("discarded"), gov.record("discarded")] == [CONTINUE, CHANGE]
    assert gov.record("improved") == CONTINUE and gov.course_changes == 0


def test_wrapper_reads_metric_lines_and_stops_a_run_past_its_time_limit(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import time\nprint('score: 1.25', flush=True)\ntime.sleep(30)\n")
    out = subprocess.run([sys.executable, "-m", "orchestrator.programs.wrap", "--metric", "score", "--time-limit",
                          "1", "--grace", "1", "--", sys.executable, str(script)], capture_output=True, text=True,
                         timeout=25, start_new_session=True)
    assert out.returncode == 124 and "score: 1.25" in out.stdout and "time limit exceeded" in out.stdout


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    full = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", *args], capture_output=True, text=True,
                          env=full, timeout=120)


def test_start_program_bad_input_is_one_line_and_exit_2(home, program):
    cases = [(["--program", str(program / "nowhere")], "no such directory"),
             (["--program", str(program), "--experiment", "digits"], "exactly one of"),
             (["--program", str(program)], "needs an LLM")]
    for args, why in cases:
        out = _cli("start", "--goal", "lower", *args, "--devices", "cpu:1")
        assert out.returncode == 2 and why in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = _cli("tree", "s-00000000")
    assert out.returncode == 2 and "no session" in out.stderr
    assert not (home / "agent" / "agent.db").exists() or "s-" not in _cli("sessions", "--json").stdout


class _Session:
    """A hand-built session for the judge: real spec, repo and governor; no jobs, no tracker (no run ids)."""

    def __init__(self, program, trials):
        self.spec = specs.load(program)
        self.repo, self.sid, self.trials = Repo(self.spec.repo), "s-judge", trials
        self.gov, self.state = Governor(), {"incumbent": 0, "pending_debug": [], "stop_reason": ""}
        self.parallel, self.tracker = 1, None

    def say(self, text):
        pass

    def _add(self, t):
        self.trials.append(t)
        return t

    def _save(self, t=None):
        pass


def _judged(program, trials) -> _Session:
    """The session after its judge has ruled on every node it can."""
    session = _Session(program, trials)
    Judge(session)()
    return session


def _tree(program, children: list[list[float]]) -> list[ProgramTrial]:
    """A measured baseline (node 0, 3 seeds) and `children` drafted from it, each run on 3 seeds."""
    head = Repo(program).head()
    trials = [tree.new_trial("s", i, kind=Kind.BASELINE, step="baseline", parent=None, parent_node=None, node=0,
                             commit=head, seed=i).update(status=S.SUCCEEDED, value=v)
              for i, v in enumerate([1.00, 1.01, 0.99])]
    for values in children:
        node = len(trials)
        for seed, v in enumerate(values):
            trials.append(tree.new_trial("s", len(trials), kind=Kind.VARIANT, step="draft", parent=head,
                                         parent_node=0, node=node, commit=head, seed=seed)
                          .update(status=S.SUCCEEDED, value=v))
    return trials


def test_judge_corrects_for_several_children_of_one_parent(program):
    # 0.025 better than a baseline of 1.00 ± 0.01 on 3 seeds each: kept at 95% when it is the parent's only
    # child, but with a sibling judged against the same parent both are gated at 97.5% (Bonferroni) and it is not.
    close, clear = [0.975, 0.985, 0.965], [0.95, 0.96, 0.94]
    alone = _judged(program, _tree(program, [close]))
    assert alone.trials[3].verdict is Verdict.KEPT and "95% CI" in alone.trials[3].verdict_text
    pair = _judged(program, _tree(program, [close, clear]))
    assert pair.trials[3].verdict is Verdict.DISCARDED and "97.5% CI" in pair.trials[3].verdict_text
    assert pair.trials[6].verdict is Verdict.KEPT and pair.state["incumbent"] == 6
    # A crashed sibling was never tested: it does not widen the others' intervals.
    crashed = _tree(program, [close])
    crashed.append(tree.new_trial("s", 6, kind=Kind.VARIANT, step="draft", parent=None, parent_node=0)
                   .update(status=S.FAILED, error="boom"))
    one = _judged(program, crashed)
    assert one.trials[3].verdict is Verdict.KEPT and one.trials[6].verdict is Verdict.CRASHED


def test_earlier_sessions_memory_stays_within_its_size_and_matches_program_and_commit(tmp_path):
    from orchestrator.programs import tree
    from orchestrator.programs.memory import HEADER, Memory

    trees = tree.TreeStore(tmp_path)
    try:
        for sid, program, root in [("s-a", "/p", "c0"), ("s-b", "/p", "c0"), ("s-other", "/q", "c0"),
                                   ("s-old", "/p", "c9")]:
            trees.save_state(sid, {"program": program, "root": root})
            trees.save(sid, tree.new_trial(sid, 0, kind=Kind.BASELINE, step="baseline", parent=None,
                                           parent_node=None, commit="c0").update(status=S.SUCCEEDED, value=4.0))
            for n in range(1, 41):
                t = tree.new_trial(sid, n, kind=Kind.VARIANT, step="improve", parent="c0", parent_node=0,
                                   commit=f"{sid}{n:08d}", rationale=f"idea {n} of {sid} " + "x" * 60)
                t.update(status=S.SUCCEEDED, value=4.0 - n / 100, verdict=Verdict.DISCARDED if n % 2 else Verdict.KEPT,
                         fingerprint=f"{sid}-{n}")
                trees.save(sid, t)
        memory = Memory.of(trees, "s-new", program="/p", root="c0", chars=2000)
    finally:
        trees.close()
    assert len(memory.tried) == 80 and ("c0", "s-a-1") in memory.tried and ("c0", "s-other-1") not in memory.tried
    text = "\n".join(memory.lines)
    assert memory.lines[0] == HEADER and len(text) <= 2000
    assert "idea 40 of s-b" in text and "-0.4 vs baseline" in text  # the newest, with its effect
    assert "older variant(s):" in memory.lines[1] and "kept" in memory.lines[1] and "discarded" in memory.lines[1]
    assert "s-other" not in text and "s-old" not in text


def test_the_sandbox_finds_an_interpreter_named_through_a_link_under_tmp():
    """A venv used through a link under /tmp (a scratch checkout whose `.venv` points at the real one): the
    sandbox's private /tmp must not hide the interpreter by the name the job is started with."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from tests.support.requires import require

    require("bubblewrap", None if shutil.which("bwrap") else "no bwrap on PATH (apt-get install -y bubblewrap)")
    root = Path(__file__).resolve().parents[2]
    probe = ("import subprocess, sys; from orchestrator.programs import sandbox; "
             "cmd = sandbox.command([sys.executable, '-c', 'import sys; print(sys.prefix)'], cwd=sys.argv[1], "
             "writable=[sys.argv[1]], protected=[]); sys.exit(subprocess.run(cmd).returncode)")
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:  # under /tmp itself, whatever TMPDIR says
        link, work = Path(scratch) / "venv", Path(scratch) / "work"
        link.symlink_to(Path(sys.prefix).resolve())
        work.mkdir()
        done = subprocess.run([str(link / "bin" / "python"), "-c", probe, str(work)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(link)
