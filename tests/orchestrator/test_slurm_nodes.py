"""The rules that tell a lost node from a failing job, and what `show` says of a multi-node job's attempts
(`orchestrator.executors.slurm.nodes`), on records as the node launchers write them; and `--nodes` at submit."""

from __future__ import annotations

import pytest

from orchestrator.core.errors import BadInput
from orchestrator.executors.slurm import nodes as sn
from orchestrator.queue.models import JobSpec

NOW = 1_000.0


def rec(node, **fields):
    return {"node": node, "node_rank": 0, "started": NOW - 30, **fields}


def test_a_silent_launcher_is_lost_while_stopped_or_ended_ones_are_not():
    recs = {"a": rec("a", beat=NOW - 1), "b": rec("b", beat=NOW - sn.LOST_AFTER - 1),
            "c": rec("c", beat=NOW - 60, stopping=NOW - 50), "d": rec("d", beat=NOW - 60, exit=1)}
    assert list(sn.lost(recs, {}, ended=False, now=NOW)) == ["b"]


def test_once_the_attempt_ended_a_launcher_that_neither_stopped_nor_ended_was_lost():
    recs = {"a": rec("a", beat=NOW - 1, exit=1), "b": rec("b", beat=NOW - 1)}
    assert list(sn.lost(recs, {}, ended=True, now=NOW)) == ["b"]
    assert sn.lost(recs, {}, ended=False, now=NOW) == {}  # still beating: the run may go on


def test_slurms_word_on_a_node_replaces_the_inference_from_its_launchers_missing_end():
    """Slurm failing a node kills its launcher before or after the SIGTERM is recorded, as the load falls: the
    reason is Slurm's either way; our own observation of a silent launcher stays ours."""
    unended = {"a": rec("a", beat=NOW - 1)}
    assert sn.lost(unended, {}, ended=True, now=NOW) == {"a": f"node a lost: {sn.UNENDED}"}
    assert sn.lost(unended, {"a": "down"}, ended=True, now=NOW) == {"a": "node a is down in Slurm"}
    assert sn.lost(unended, {"a": "idle"}, ended=True, now=NOW, srun_failed=["a"]) == {
        "a": "node a failed (Slurm: node failure)"}  # back in service at once: srun's report stays
    silent = {"a": rec("a", beat=NOW - sn.LOST_AFTER - 1)}
    assert sn.lost(silent, {"a": "down"}, ended=True, now=NOW) == {"a": "node a lost: no heartbeat from its "
                                                                         f"launcher for {sn.LOST_AFTER + 1:.0f}s"}


def test_of_launchers_silent_together_only_those_whose_node_no_longer_answers_are_lost():
    # The head node died: its launcher and, with the step it carried, the other node's launcher went silent.
    recs = {"head": rec("head", beat=NOW - sn.LOST_AFTER - 1), "b": rec("b", beat=NOW - sn.LOST_AFTER - 1)}
    answers = {"head": False, "b": True}
    assert list(sn.lost(recs, {}, ended=True, now=NOW, answers=answers.get)) == ["head"]
    # Nothing known of the daemons, or none answers (the machines gone together): every silent one is lost.
    assert sorted(sn.lost(recs, {}, ended=True, now=NOW, answers=lambda node: None)) == ["b", "head"]
    assert sorted(sn.lost(recs, {}, ended=True, now=NOW, answers=lambda node: False)) == ["b", "head"]
    # One silent launcher is lost whatever its daemon says (its processes killed, its slurmd alive).
    one = {"a": rec("a", beat=NOW - 1, exit=1), "b": rec("b", beat=NOW - sn.LOST_AFTER - 1)}
    assert list(sn.lost(one, {}, ended=True, now=NOW, answers=lambda node: True)) == ["b"]


def test_slurmd_answers_says_whether_a_nodes_daemon_takes_a_connection():
    from tests.support import slurm as cluster

    node = cluster.slurm_node()
    assert sn.slurmd_answers(node) is True
    assert sn.slurmd_answers("no-such-node") is None


def test_preflight_health_and_slurms_word_fail_a_node():
    recs = {"a": rec("a", exit=75, preflight="preflight failed on node a: ecc"),
            "b": rec("b", exit=75, health="device fault on node b: ecc"), "c": rec("c", exit=75)}
    assert sn.lost(recs, {}, ended=False, now=NOW, silent_only=True) == {}  # they stop by themselves
    failed = sn.lost(recs, {"c": "down*", "d": "idle"}, ended=True, now=NOW)
    assert failed == {"a": "preflight failed on node a: ecc", "b": "device fault on node b: ecc",
                      "c": "node c is down* in Slurm"}
    assert [s for s in ("idle", "mixed", "allocated", "drained", "down*", "idle*") if sn.is_bad(s)] == [
        "drained", "down*", "idle*"]


def test_show_says_when_an_attempt_ran_on_fewer_nodes_and_resharded():
    state = {"attempts": {"1": {"nodes": ["n1", "n2"], "asked": 2, "per_node": 2, "failed": {"n2": "lost"}},
                          "2": {"nodes": ["n1"], "asked": 2, "per_node": 2}}}
    assert sn.describe_attempts(state) == [
        "attempt 1: n1,n2 (2 of 2 nodes, 4 ranks); failed: n2",
        "attempt 2: n1 (1 of 2 nodes, 2 ranks); fewer nodes than attempt 1: its checkpoint resharded on load "
        "from 4 ranks to 2"]


def test_exclusions_are_remembered_per_job(tmp_path):
    sn.exclude(tmp_path, 7, {"n2": "node n2 lost"})
    sn.exclude(tmp_path, 7, {"n3": "preflight failed on node n3"})
    assert sn.excluded(tmp_path, 7) == ["n2", "n3"] and sn.excluded(tmp_path, 8) == []


@pytest.mark.parametrize("options, words", [
    ({"nodes": 0}, "--nodes must be an integer from 1"),
    ({"nodes": 2, "min_nodes": 3}, "--min-nodes must be an integer from 1 to --nodes (2)"),
    ({"nodes": 2, "gpus": 0.5}, "a share of one GPU runs on one node"),
])
def test_bad_node_requests_are_refused_in_one_line(options, words):
    with pytest.raises(BadInput, match=words.replace("(", r"\(").replace(")", r"\)")):
        JobSpec(argv=["true"], **options)


def test_srun_says_which_node_failed_in_this_attempts_part_of_the_log(tmp_path):
    log = tmp_path / "7.log"
    log.write_text("srun: error: Node failure on n9\n")
    start = log.stat().st_size
    with open(log, "a") as fh:
        fh.write("step 3\nsrun: error: Node failure on n2\nsrun: error: n1: task 0: Exited with exit code 1\n")
    assert sn.srun_node_failures(str(log), start) == ["n2"]
    assert sn.srun_node_failures(None) == [] and sn.srun_node_failures(str(tmp_path / "none.log")) == []
