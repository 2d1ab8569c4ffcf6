"""Program trials as objects: the stored rows keep the exact keys and values the dict trials had, so a session
checkpointed before trials were objects loads and resumes (rows missing later keys, rows with unknown ones)."""

from __future__ import annotations

import json
import sqlite3

from orchestrator.programs import tree
from orchestrator.programs.trial import ACTIVE, FINAL, Kind, ProgramTrial, ProgramTrialStatus, S, Verdict

# Rows as the dict trials wrote them (json.dumps of the dict, keys in insertion order).
OLD_BASELINE = {"n": 0, "key": "s-old:0", "kind": "baseline", "step": "baseline", "node": 0, "commit": "c0",
                "parent": None, "parent_node": None, "seed": 0, "rationale": "the program as committed", "edits": [],
                "depth": 0, "status": "succeeded", "job_id": 1, "run_id": "r0", "value": 4.0, "error": "",
                "verdict": "baseline", "verdict_text": "baseline 4 over 2 run(s)", "device_s": 1.5}
OLD_PROPOSED = {"n": 2, "key": "s-old:2", "kind": "variant", "step": "draft", "node": 2, "commit": None,
                "parent": "c0", "parent_node": 0, "seed": 0, "rationale": "try",
                "edits": [{"file": "train.py", "search": "LR = 1.0", "replace": "LR = 2.0"}], "depth": 0,
                "status": "pending", "job_id": None, "run_id": None, "value": None, "error": "", "verdict": None, "verdict_text": "",
                "device_s": 0.0, "files": {"train.py": "LR = 2.0\n"}, "fingerprint": "0123456789abcdef"}
OLD_CRASHED = {"n": 3, "key": "s-old:3", "kind": "variant", "step": "debug", "node": 3, "commit": "c3",
               "parent": "c0", "parent_node": 0, "seed": 0, "rationale": "fix", "edits": [], "depth": 1,
               "status": "failed", "job_id": 4, "run_id": "r3", "value": None, "error": "exit code 1: boom",
               "verdict": "crashed", "verdict_text": "exit code 1: boom", "device_s": 0.25,
               "fingerprint": "fedcba9876543210", "log_tail": "Traceback ...\n"}


def test_old_rows_round_trip_to_the_same_bytes():
    for row in (OLD_BASELINE, OLD_PROPOSED, OLD_CRASHED):
        t = ProgramTrial.from_dict(json.loads(json.dumps(row)))
        assert json.dumps(t.to_dict(), default=str) == json.dumps(row, default=str)
    t = ProgramTrial.from_dict(OLD_CRASHED)
    assert t.kind is Kind.VARIANT and t.status is S.FAILED and t.verdict is Verdict.CRASHED
    assert t.log_tail == "Traceback ...\n" and t.files is None and "files" not in t.to_dict()


def test_new_trial_writes_what_the_dict_trial_held():
    t = tree.new_trial("s-old", 2, kind=Kind.VARIANT, step="draft", parent="c0", parent_node=0, rationale="try",
                       edits=OLD_PROPOSED["edits"])
    t.files, t.fingerprint = OLD_PROPOSED["files"], OLD_PROPOSED["fingerprint"]
    assert list(t.to_dict().items()) == [(k, OLD_PROPOSED[k]) for k in
                                         ["n", "key", "kind", "step", "node", "commit", "parent", "parent_node",
                                          "seed", "rationale", "edits", "depth", "status", "job_id", "run_id",
                                          "value", "error", "verdict", "verdict_text", "device_s", "files",
                                          "fingerprint"]]
    base = tree.new_trial("s", 0, kind=Kind.BASELINE, step="baseline", parent=None, parent_node=None, node=0)
    assert set(base.to_dict()) == set(OLD_BASELINE)  # no fingerprint, files or log tail until there is one


def test_rows_missing_later_keys_or_with_unknown_ones_load():
    sparse = {k: v for k, v in OLD_BASELINE.items() if k not in ("verdict_text", "device_s", "error", "edits")}
    t = ProgramTrial.from_dict(sparse)
    assert (t.verdict_text, t.device_s, t.error, t.edits, t.fingerprint, t.log_tail) == ("", 0.0, "", [], None, None)
    extra = ProgramTrial.from_dict({**OLD_CRASHED, "from_a_later_version": {"x": 1}})
    assert extra.to_dict() == OLD_CRASHED


def test_a_session_checkpointed_as_dicts_loads_and_judges(tmp_path):
    """Rows written by the dict code (raw SQL here) come back as trials, are judged, and are written back with
    only what changed."""
    from orchestrator.programs.judge import gate_parent, siblings

    store = tree.TreeStore(tmp_path)
    try:
        sparse = {k: v for k, v in OLD_BASELINE.items() if k != "device_s"}
        rows = [sparse, {**OLD_BASELINE, "n": 1, "key": "s-old:1", "seed": 1, "verdict": None,
                         "verdict_text": "", "unknown": True}, OLD_PROPOSED, OLD_CRASHED]
        with store.conn:
            store.conn.executemany("INSERT INTO program_trials VALUES (?, ?, ?)",
                                   [("s-old", r["n"], json.dumps(r)) for r in rows])
        trials = store.trials("s-old")
        assert [t.n for t in trials] == [0, 1, 2, 3] and [t.n for t in tree.nodes(trials)] == [0, 2, 3]
        assert tree.values_of(trials, 0) == [4.0, 4.0] and tree.summary_of(trials, 0)["n"] == 2
        assert [t.n for t in trials if t.status in ACTIVE] == [2]
        assert gate_parent(trials, trials[3]) is trials[0]
        assert [m.n for m in siblings(trials, trials[2], trials[0])] == [2]
        assert tree.history_lines(trials)[-1] == "c3 | c0 | debug | - | crashed | fix"
        assert tree.state_of(trials[2]) == "pending" and trials[2].status == "pending"  # faces compare words
        store.save("s-old", trials[0])  # the missing key is written with its default, nothing else changes
        store.save("s-old", trials[3])
    finally:
        store.close()
    stored = dict(sqlite3.connect(tmp_path / "agent" / "agent.db").execute(
        "SELECT n, data FROM program_trials WHERE session = 's-old'").fetchall())
    assert json.loads(stored[0]) == {**OLD_BASELINE, "device_s": 0.0}
    assert stored[3] == json.dumps(OLD_CRASHED)


def test_statuses_are_the_words_they_were():
    assert [s.value for s in ProgramTrialStatus] == ["pending", "queued", "running", "succeeded", "failed",
                                                     "cancelled"]
    assert ACTIVE == ("pending", "queued", "running") and FINAL == ("succeeded", "failed", "cancelled")
    assert all(s.active for s in ACTIVE) and all(s.final for s in FINAL) and not S.RUNNING.final
    assert f"{S.RUNNING} {Verdict.KEPT} {Kind.RERUN}" == "running kept rerun" and json.dumps(S.FAILED) == '"failed"'
