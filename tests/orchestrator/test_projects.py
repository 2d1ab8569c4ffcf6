"""Projects, the usage ledger and their bad input: the library and the CLI in-process, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import time

import pytest

from orchestrator.api import jobs as api
from orchestrator.agent import usage as ledger
from orchestrator.api import sharing
from orchestrator.faces.cli import main
from orchestrator.core.config import Settings
from orchestrator.core.errors import BadInput
from orchestrator.queue.models import JobSpec
from orchestrator.queue.store import JobStore


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run the CLI in this process (a subprocess spends a second importing): (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def spec(**kw) -> JobSpec:
    kw.setdefault("track", False)
    return JobSpec(argv=["true"], **kw)


def test_projects_set_list_and_config_toml(home, capsys):
    (home / "config.toml").write_text('[projects.vision]\nshare = 2\nquota = 1\n')
    code, out, err = cli(capsys, "projects", "set", "nlp", "--share", "1", "--borrow-limit", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["borrow_limit"] == 2
    code, out, _ = cli(capsys, "projects", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["vision"]["share"] == 2.0 and rows["vision"]["quota"] == 1 and rows["vision"]["source"] == "config"
    assert rows["nlp"]["source"] == "table" and "default" in rows
    # The table wins over the file for the same name (what a person set last).
    assert cli(capsys, "projects", "set", "vision", "--quota", "0")[0] == 0
    rows = {r["name"]: r for r in json.loads(cli(capsys, "projects", "--json")[1])}
    assert rows["vision"]["quota"] == 0 and rows["vision"]["share"] == 2.0


def test_bad_input_is_one_line_and_exit_2_with_nothing_written(home, capsys):
    store = JobStore.from_settings(Settings.load())
    store.hosts.heartbeat("h1", os.getpid(), str(home), ["cpu:0", "cpu:1"], time.time())
    assert cli(capsys, "projects", "set", "vision", "--share", "2")[0] == 0
    cases = [
        ("projects", "set", "nlp", "--share", "-1"),
        ("projects", "set", "nlp", "--quota", "3"),  # the live services have 2 devices
        ("submit", "--project", "visoin", "--", "true"),
        ("submit", "--deadline", "2020-01-01 10:00", "--", "true"),
        ("submit", "--deadline", "next tuesday", "--", "true"),
        ("submit", "--scavenger", "--no-preempt", "--", "true"),
        ("usage", "--by", "colour"),
        ("usage", "--since", "last week"),
    ]
    for args in cases:
        code, _, err = cli(capsys, *args)
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("autoresearch: "), (args, err)
    assert store.count() == 0
    assert [r["name"] for r in sharing.projects_table(Settings.load(), store) if r["source"] == "table"] == ["vision"]
    (home / "config.toml").write_text('[projects.x]\nshare = 0\n')
    code, _, err = cli(capsys, "projects")
    assert code == 2 and "share" in err


def test_submit_records_project_scavenger_and_deadline(home, capsys):
    assert cli(capsys, "projects", "set", "vision", "--share", "2")[0] == 0
    code, out, err = cli(capsys, "submit", "--project", "vision", "--deadline", "2h", "--time-limit", "5m",
                         "--no-track", "--json", "--", "true")
    assert code == 0, err
    job = json.loads(out)
    assert job["project"] == "vision" and job["scavenger"] is False
    assert 7100 < job["deadline"] - time.time() <= 7200
    job = json.loads(cli(capsys, "submit", "--scavenger", "--no-track", "--json", "--", "true")[1])
    assert job["project"] == "default" and job["scavenger"] is True
    assert sharing.parse_deadline("2026-12-03 18:00", now=0) > 0
    with pytest.raises(BadInput):
        api.submit(spec(deadline=time.time() - 5))


def test_an_old_queue_database_gains_the_columns_with_their_defaults(tmp_path):
    """A queue.db made before projects: its jobs are in the default project, not scavengers."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'queue.db'}"
    JobStore(url).submit(spec())
    conn = sqlite3.connect(tmp_path / "queue.db")
    conn.execute("DROP INDEX ix_jobs_project_line")
    conn.execute("DROP INDEX ix_jobs_deadline")
    for column in ("project", "scavenger", "deadline"):
        conn.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    conn.execute("DROP TABLE projects")
    conn.commit()
    conn.close()
    store = JobStore(url)
    [job] = store.list()
    assert (job.project, job.scavenger, job.deadline) == ("default", False, None)
    assert store.snapshot("h", capacity=4, limit=5)[0][0].id == job.id


def _attempt(store: JobStore, job_id: int, host: str, seconds: float, code=0) -> None:
    store.claim([(job_id, [f"cpu:{job_id}"])], host)
    store.mark_running(job_id, 1, None, host)
    time.sleep(seconds)
    store.finish(job_id, code, host)


def test_usage_matches_the_event_log(db_url, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTORESEARCH_HOME", str(tmp_path))
    monkeypatch.setenv("AUTORESEARCH_DB_URL", db_url)
    settings = Settings.load()
    store = JobStore(db_url)
    a1 = store.submit(spec(project="a", owner="s-1234abcd", gpus=2)).id
    a2 = store.submit(spec(project="a", owner="human")).id
    b1 = store.submit(spec(project="b", owner="s-1234abcd")).id
    sc = store.submit(spec(project="b", scavenger=True)).id
    _attempt(store, a1, "h", 0.05)
    _attempt(store, a2, "h", 0.02, code=1)
    _attempt(store, sc, "h", 0.03)
    store.claim([(b1, ["cpu:9"])], "h")  # still holding: counted up to now
    now = time.time()

    def held(job_id) -> float:  # device-seconds from the event log, read here on its own
        job, total, start = store.get(job_id), 0.0, None
        for e in store.events(job_id):
            if e.dst == "STARTING":
                start = e.at
            elif start is not None and e.dst in ("QUEUED", "SUCCEEDED", "FAILED", "CANCELLED"):
                total, start = total + job.gpus * (e.at - start), None
        return total + (job.gpus * (now - start) if start is not None else 0.0)

    rows = {r["project"]: r for r in ledger.usage(settings, by="project", store=store, now=now)}
    assert rows["a"]["device_seconds"] == pytest.approx(held(a1) + held(a2))
    assert rows["b"]["device_seconds"] == pytest.approx(held(b1))
    assert rows["b"]["scavenger_device_seconds"] == pytest.approx(held(sc)) and held(sc) > 0
    assert (rows["a"]["attempts"], rows["a"]["jobs"], rows["b"]["running"]) == (2, 2, 1)
    sessions = {r["session"]: r for r in ledger.usage(settings, by="session", store=store, now=now)}
    assert list(sessions) == ["s-1234abcd"]
    assert sessions["s-1234abcd"]["device_seconds"] == pytest.approx(held(a1) + held(b1))
    owners = {r["owner"] for r in ledger.usage(settings, by="owner", store=store, now=now)}
    assert owners == {"s-1234abcd", "human"}
    # --since cuts attempts at that time: nothing before it counts.
    later = ledger.usage(settings, by="project", since="0.001s", store=store, now=now)
    assert sum(r["device_seconds"] for r in later) <= 0.001 * 2 + 1e-9


def test_usage_by_session_adds_the_llm_tokens_and_cost_the_session_recorded(home):
    from orchestrator.agent.session import Registry, SessionConfig

    settings = Settings.load()
    store = JobStore.from_settings(settings)
    job = store.submit(spec(owner="s-0000beef")).id
    _attempt(store, job, "h", 0.01)
    registry = Registry(home)
    registry.create("s-0000beef", SessionConfig(goal="g", experiment="digits"))
    registry.update("s-0000beef", status="finished", summary={"usage": {"calls": 3, "prompt_tokens": 1200,
                                                                         "completion_tokens": 300,
                                                                         "cost_usd": 0.0042}})
    registry.close()
    [row] = ledger.usage(settings, by="session", store=store)
    assert row["session"] == "s-0000beef" and row["attempts"] == 1
    assert (row["llm_calls"], row["prompt_tokens"], row["completion_tokens"], row["cost_usd"]) == (3, 1200, 300, 0.0042)
