"""The Hugging Face Trainer and Lightning guide pages, run as written: their scripts (real `transformers` and
`lightning`, tiny models from configs, data made in code, no download) through `init`, a run by hand that is
preempted and resumes, and a short session, on a real queue service, real processes and a real MLflow store.

The toml on each page is compared with what `init` writes as data (tomllib), not as text: the comments `init`
adds are its own to word. The ranges come from the frameworks' defaults, which the pinned minor versions fix.
"""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import sys
import time
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GUIDES = {"huggingface": "hf-tiny", "lightning": "lightning-tiny"}  # page -> the folder its toml is named after


def blocks(page: str, lang: str) -> list[str]:
    """The page's fenced blocks in `lang`."""
    return re.findall(rf"^```{lang}\n(.*?)^```", page, re.S | re.M)


def block(page: str, lang: str) -> str:
    """The page's one fenced block in `lang`."""
    found = blocks(page, lang)
    assert len(found) == 1, f"expected one {lang} block"
    return found[0]


def project(guide: str, where: Path) -> tuple[Path, str, list[str]]:
    """The page's script in a folder named as its toml says; the page's toml text and init command."""
    page = (ROOT / "docs" / "guides" / f"{guide}.md").read_text()
    folder = where / GUIDES[guide]
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(block(page, "python"))
    lines = [line for text in blocks(page, "sh") for line in text.splitlines()]
    init = next(line for line in lines if line.startswith("autoresearch init"))
    words = shlex.split(init)
    return folder, block(page, "toml"), words[words.index("--") + 1:]


@pytest.fixture(params=sorted(GUIDES))
def guide(request) -> str:
    return request.param


@pytest.fixture
def python_first(monkeypatch):
    """`python` in a command is this environment's (as on a user's PATH with the venv active)."""
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_init_writes_the_page_toml_and_trains_nothing(guide, tmp_path, python_first):
    from experiments.config_file import load
    from experiments.starter import write_starter

    folder, toml, argv = project(guide, tmp_path)
    written = write_starter(argv, folder)
    assert tomllib.loads(written.read_text()) == tomllib.loads(toml)
    assert sorted(p.name for p in folder.iterdir()) == ["autoresearch.toml", "train.py"]  # no run, no folder
    spec = load(folder)  # the product takes the starter as it is
    assert spec.seed_param not in spec.fixed and spec.metric in ("eval_loss", "val_loss")


def checkpointed(guide: str, checkpoint_dir: str | None) -> bool:
    """Whether the trial's first attempt has saved something it can resume from."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return False
    found = Path(checkpoint_dir).glob("checkpoint-*/trainer_state.json" if guide == "huggingface" else "**/last.ckpt")
    return any(True for _ in found)


def stray_runs(home: Path) -> list[tuple[str, str]]:
    """Active MLflow runs that belong to no job: in `Default`, or made by a job's script beside its run."""
    with sqlite3.connect(home / "mlflow.db") as db:
        return db.execute(
            "SELECT r.run_uuid, e.name FROM runs r JOIN experiments e ON e.experiment_id = r.experiment_id "
            "WHERE r.lifecycle_stage = 'active' AND (e.name = 'Default' OR r.run_uuid IN "
            "(SELECT run_uuid FROM tags WHERE key = 'autoresearch.job_run'))").fetchall()


def test_a_run_by_hand_is_preempted_and_resumes_where_it_stopped(guide, home, tmp_path, python_first):
    from orchestrator.api import jobs as api
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.queue.store import JobStore
    from orchestrator.service.daemon import Service
    from orchestrator.tracking.client import Tracker

    folder, toml, _ = project(guide, tmp_path)
    (folder / "autoresearch.toml").write_text(toml)
    settings = Settings.load()
    service = Service(settings, devices="cpu:1", preempt_after=0).start()
    store = JobStore(settings.db_url)
    try:
        job, _ = api.submit(api.experiment_spec(str(folder), {}, priority=0), settings)
        wait_for(lambda: checkpointed(guide, store.get(job.id).checkpoint_dir), 180, "a checkpoint")
        urgent, _ = api.submit(JobSpec(argv=[sys.executable, "-c", "pass"], priority=20, track=False), settings)
        wait_for(lambda: store.get(job.id).final, 240, "the resumed trial")
    finally:
        service.stop()
    done = store.get(job.id)
    log = Path(done.log_path).read_text(errors="replace")
    assert (done.state, done.preemptions, store.get(urgent.id).state) == ("SUCCEEDED", 1, "SUCCEEDED"), log[-3000:]
    assert "starts again from scratch" not in log
    metric = tomllib.loads(toml)["experiment"]["metric"]
    steps = [s for s, _ in Tracker.from_settings(settings).history(done.mlflow_run_id, metric)]
    if guide == "huggingface":
        assert "no resume flag; the checkpoint dir holds" in log  # get_last_checkpoint resumes it by itself
        assert sorted(set(steps)) == [4, 8, 12]  # the Trainer's steps: they went on, none started over
        assert "Changing param values" not in log  # the values the Trainer logs are the job's own
    else:
        assert "resuming from the checkpoint dir" in log and "--ckpt_path=last" in log
        assert len(set(steps)) == 20 and steps == sorted(steps)  # one val_loss an epoch, global steps
    assert stray_runs(home) == []


def test_a_short_session_searches_the_script(guide, home, tmp_path, python_first):
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig
    from orchestrator.core.config import Settings
    from orchestrator.queue.store import JobStore

    folder, toml, _ = project(guide, tmp_path)
    (folder / "autoresearch.toml").write_text(toml)
    config = SessionConfig(goal="lower the loss", experiment=str(folder), proposer="random", trials=2, parallel=2,
                           poll=0.2, baseline_seeds=1, confirm_seeds=0, early_stopping=False)
    summary = runner.start(config, devices="cpu:2")
    failed = [Path(j.log_path).read_text(errors="replace")[-2000:] for j in JobStore(Settings.load().db_url).list(
        owner=summary["session"]) if j.state != "SUCCEEDED"]
    assert summary["experiment"] == GUIDES[guide] and summary["counts"] == {"succeeded": 3}, failed
    assert stray_runs(home) == []
