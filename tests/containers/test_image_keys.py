"""An image named by an experiment's spec or a program's autoresearch.toml: agent variants and submits run in
the environment the researcher chose, pinned to the image's content id and recorded on the MLflow run."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import mlflow
import pytest

from experiments.digits import spec as digits
from orchestrator.api import jobs as api
from orchestrator.core.errors import BadInput
from orchestrator.programs import spec as programs

# Its tests share a session-wide image that one worker builds: under xdist they run on that one worker.
pytestmark = pytest.mark.xdist_group("podman-image")


def test_an_experiment_that_names_an_image_runs_in_it_unless_submit_says_otherwise(home, image, monkeypatch):
    monkeypatch.setattr(digits, "SPEC", replace(digits.SPEC, image=image))
    job, _ = api.submit(api.experiment_spec("digits", {}))
    assert job.image == image and job.image_id.startswith("sha256:")
    assert job.argv[0] == "python3"  # the image's python, not this venv's
    from orchestrator.tracking.jobruns import ensure_job_run
    from orchestrator.tracking.client import Tracker

    run_id = ensure_job_run(Tracker(mlflow.get_tracking_uri()), job)
    tags = mlflow.MlflowClient().get_run(run_id).data.tags
    assert tags["autoresearch.image"] == image and tags["autoresearch.image_digest"] == job.image_id
    with pytest.raises(BadInput, match="no such image"):
        api.submit(api.experiment_spec("digits", {}, image="localhost/no-such-image:0"))
    assert [j.id for j in api.open_store().list()] == [job.id]  # nothing more queued


def program(tmp_path, image_line: str):
    root = tmp_path / "prog"
    root.mkdir(parents=True)
    (root / "train.py").write_text("print('score: 1.0')\n")
    (root / "autoresearch.toml").write_text(f'[program]\nedit = ["train.py"]\nrun = "python3 train.py"\n'
                                            f'metric = "score"\n{image_line}\n')
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "p"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    return root


def test_a_program_names_its_image_in_autoresearch_toml(tmp_path, image):
    assert programs.load(program(tmp_path / "a", f'image = "{image}"')).image == image
    with pytest.raises(BadInput, match="--image localhost/no-such-image:0: no such image"):
        programs.load(program(tmp_path / "b", 'image = "localhost/no-such-image:0"'))
    with pytest.raises(BadInput, match="image must be a string"):
        programs.load(program(tmp_path / "c", "image = 3"))
