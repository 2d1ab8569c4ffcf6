"""Listings (`queue`, `show`, the MCP list tool): the first N jobs in listing order, counts of the rest by state,
the JSON shape, bad limits, and a table that fits 80 columns. Read through SQLAlchemy Core on every backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.core.errors import BadInput, JobNotFound
from orchestrator.faces.fastcli import parse_queue
from orchestrator.queue.listing import Listing, check_limit
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore
from orchestrator.faces.cli.common import fit_widths


@pytest.fixture
def store(db_url):
    s = JobStore(db_url)
    yield s
    s.close()


def _fill(store):
    """ids 1..8: 1 SUCCEEDED, 2 RUNNING, 3 FAILED awaiting a retry, 4 FAILED for good, 5-8 QUEUED (5 and 7 at
    priority 20, 7 owned by an agent session)."""
    ids = [store.submit(JobSpec(argv=["true"], name=f"j{i}", priority=20 if i in (5, 7) else 10,
                                max_attempts=2 if i == 3 else 1, owner="s-1" if i == 7 else "human")).id
           for i in range(1, 9)]
    for job_id in (1, 2, 3, 4):
        store.claim([(job_id, [f"cpu:{job_id}"])], "h1")
        store.mark_running(job_id, 4242, None, "h1")
    store.finish(1, 0)
    store.finish(3, 1)
    store.finish(4, 1)
    return ids


def test_the_listing_is_running_then_the_line_then_retries_and_counts_what_it_leaves_out(store):
    _fill(store)
    full = store.listing(limit=None)
    # Holding devices first, then the line in start order (priority, then submit time), then FAILED awaiting retry.
    assert [j["id"] for j in full.jobs] == [2, 5, 7, 6, 8, 3]
    assert full.counts == {"QUEUED": 4, "RUNNING": 1, "FAILED": 1} and full.more == 0 and full.more_line() == ""

    first = store.listing(limit=2)
    assert [j["id"] for j in first.jobs] == [2, 5] and first.total == 6 and first.more == 4
    assert first.hidden() == {"QUEUED": 3, "FAILED": 1}
    assert first.more_line() == "... and 4 more: 3 queued, 1 failed (--limit 0 for all)"
    assert store.listing(limit=4).more_line() == "... and 2 more: 1 queued, 1 failed (--limit 0 for all)"
    assert store.listing(limit=5).more_line() == "... and 1 more failed (--limit 0 for all)"

    # --all: the same, then finished jobs newest first.
    every = store.listing(finished=True, limit=None)
    assert [j["id"] for j in every.jobs] == [2, 5, 7, 6, 8, 3, 4, 1]
    assert store.listing(finished=True, limit=7).hidden() == {"SUCCEEDED": 1}
    assert every.counts == {"QUEUED": 4, "RUNNING": 1, "SUCCEEDED": 1, "FAILED": 2}

    mine = store.listing(owner="s-1", finished=True)
    assert [j["id"] for j in mine.jobs] == [7] and mine.total == 1
    assert Listing(mine.jobs, mine.counts).to_dict() == {"jobs": mine.jobs, "total": 1, "more": 0,
                                                         "counts": {"QUEUED": 1}}


def test_listed_jobs_and_show_have_the_orm_jobs_json_shape(store):
    _fill(store)
    job = store.get(3)
    listed = {j["id"]: j for j in store.listing(finished=True, limit=None).jobs}
    assert listed[3] == job.to_dict()
    shown = store.record(3)
    assert shown == {**job.to_dict(), "events": [e.to_dict() for e in store.events(3)]}
    assert [e["to"] for e in shown["events"]] == ["QUEUED", "STARTING", "RUNNING", "FAILED"]
    with pytest.raises(JobNotFound):
        store.record(999)


def test_limits_as_flags_parse_the_same_on_both_paths():
    assert check_limit(50) == 50 and check_limit(0) is None
    for bad in (-1, 1.5, "3", True, None):
        with pytest.raises(BadInput, match="--limit must be an integer >= 0"):
            check_limit(bad)
    assert parse_queue([]) == {"op": "queue", "all": False}
    assert parse_queue(["--all", "--limit", "5"]) == {"op": "queue", "all": True, "limit": 5}
    assert parse_queue(["--limit=0"]) == {"op": "queue", "all": False, "limit": 0}
    for bad in (["--limit", "-1"], ["--limit", "x"], ["--limit", "²"], ["--limit"], ["--mine"]):
        assert parse_queue(bad) is None  # the full CLI answers it, with its one-line message


def test_columns_share_the_width_left_by_those_never_cut():
    # id, name (ratio 3, min 8), state, reason (ratio 2, min 6) in 30 characters: the fixed ones whole.
    assert fit_widths([3, 40, 10, 30], [None, 3, None, 2], [1, 8, 1, 6], 30) == [3, 10, 10, 7]
    assert fit_widths([3, 5, 10, 6], [None, 3, None, 2], [1, 8, 1, 6], 80) == [3, 5, 10, 6]  # nothing to cut


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "80", **(env or {})})


def test_queue_shows_the_first_n_in_80_columns_with_the_rest_counted(home):
    store = JobStore(f"sqlite:///{home / 'queue.db'}")
    for i in range(7):
        store.submit(JobSpec(argv=["true"], name=f"a-rather-long-experiment-name-{i}", priority=i,
                             owner="s-0000000a"))
    store.note({7: "waiting for 2 devices; no live service has 2 devices; largest has 1"})
    out = cli("queue", "--limit", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.rstrip("\n").splitlines()
    assert max(map(len, lines)) <= 80
    assert lines[0].split() == ["id", "name", "owner", "state", "prio", "gpus", "devices", "att", "pre", "exit",
                                "submitted", "reason"]
    rows = [line.split() for line in lines[1:-1]]
    assert [(r[0], r[3], r[4]) for r in rows] == [("7", "QUEUED", "6"), ("6", "QUEUED", "5"), ("5", "QUEUED", "4")]
    assert lines[-1] == "... and 4 more queued (--limit 0 for all)"

    listed = cli("queue", "--json", "--limit", "2")
    assert [j["id"] for j in json.loads(listed.stdout)] == [7, 6]
    assert listed.stderr.strip() == "... and 5 more queued (--limit 0 for all)"
    everything = cli("queue", "--json", "--limit", "0")
    assert len(json.loads(everything.stdout)) == 7 and everything.stderr == ""
