"""The engine command lines, for podman and docker, without running an engine (the real runs are in
test_containers.py): what a user would otherwise only see go wrong on a GPU box."""

from __future__ import annotations

import pytest

from orchestrator.core.errors import BadInput
from orchestrator.executors import container
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Job


def job(tmp_path, **kw) -> Job:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    base = dict(id=7, attempts=2, argv=["python3", "train.py", "--lr", "0.1"], gpus=1, devices=["cpu:0"],
                image="localhost/train:1", image_id="sha256:abc", cwd=str(tmp_path), checkpoint_dir=str(ckpt),
                env={"TOKEN": "s3cret"})
    base.update(kw)
    return Job(**base)


def test_podman_runs_the_pinned_image_with_names_not_values_and_same_path_mounts(tmp_path):
    layout = Layout(tmp_path / "home").ensure()
    env = {"TOKEN": "s3cret", "PATH": "/host/venv/bin", "AUTORESEARCH_JOB_ID": "7", "MLFLOW_RUN_ID": "r1"}
    argv = container.run_argv(job(tmp_path, mounts=["/data:/data:ro"]), env, layout, "podman")
    assert argv[:2] == ["podman", "run"] and "--rm" in argv and "--init" in argv and "--sig-proxy=false" in argv
    assert argv[argv.index("--name") + 1] == container.container_name(layout.home, 7, 2)
    tail = argv[argv.index("sha256:abc"):]
    assert tail == ["sha256:abc", "python3", "train.py", "--lr", "0.1"]  # the content id, not the tag
    names = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert sorted(names) == ["AUTORESEARCH_JOB_ID", "MLFLOW_RUN_ID", "TOKEN"]  # no host PATH over the image's
    assert "s3cret" not in " ".join(argv)
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    # The home (heartbeats, the default SQLite MLflow store), the checkpoint dir outside it, the workdir.
    assert mounts == [f"{layout.home}:{layout.home}", f"{tmp_path}/ckpt:{tmp_path}/ckpt",
                      f"{tmp_path}:{tmp_path}", "/data:/data:ro"] and argv[argv.index("--workdir") + 1] == str(tmp_path)
    assert "--device" not in argv  # cpu slots: no device


def test_a_file_based_tracking_store_outside_the_home_is_mounted_a_server_is_not(tmp_path):
    layout = Layout(tmp_path / "home").ensure()
    (tmp_path / "ml").mkdir()
    for uri, extra in ((f"sqlite:///{tmp_path}/ml/mlflow.db", f"{tmp_path}/ml"), ("http://mlflow:5000", None),
                       (f"sqlite:///{layout.home}/mlflow.db", None)):
        argv = container.run_argv(job(tmp_path, cwd=str(layout.home)), {"MLFLOW_TRACKING_URI": uri}, layout, "podman")
        mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
        assert mounts == [f"{layout.home}:{layout.home}", f"{tmp_path}/ckpt:{tmp_path}/ckpt"] + \
            ([f"{extra}:{extra}"] if extra else [])


def test_a_job_submitted_from_the_root_does_not_mount_the_hosts_root(tmp_path):
    argv = container.run_argv(job(tmp_path, cwd="/"), {}, Layout(tmp_path / "h"), "podman")
    assert "/:/" not in argv and argv[argv.index("--workdir") + 1] == "/"


def test_gpus_go_in_as_cdi_devices_and_multi_gpu_through_the_images_torchrun(tmp_path):
    argv = container.run_argv(job(tmp_path, gpus=2, devices=["1", "3"]), {}, Layout(tmp_path / "h"), "docker")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--device"] == ["nvidia.com/gpu=1", "nvidia.com/gpu=3"]
    assert "--sig-proxy=false" not in argv  # docker's foreground run does not proxy without a tty anyway
    tail = argv[argv.index("sha256:abc") + 1:]
    assert tail[:3] == ["torchrun", "--standalone", "--nproc-per-node=2"] and tail[-4:] == job(tmp_path).argv


def test_engine_choice(monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\n")
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("AUTORESEARCH_CONTAINER_ENGINE", raising=False)
    assert container.engine_name() == "docker"  # auto: podman when present, else docker
    with pytest.raises(BadInput, match="podman is not installed"):
        container.engine_name("podman")
    with pytest.raises(BadInput, match="auto, podman or docker"):
        container.engine_name("lxc")


@pytest.mark.parametrize("text, says", [("rel:/x", None), ("/nope:/x", "does not exist"),
                                        ("/tmp:rel", "absolute"), ("/tmp:/x:rx", "expected SRC:DST")])
def test_mounts(text, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    if says is None:
        assert container.parse_mount(text) == f"{tmp_path}/rel:/x"
    else:
        with pytest.raises(BadInput, match=says):
            container.parse_mount(text)


def test_under_ray_an_image_becomes_rays_image_uri(tmp_path):
    from orchestrator.executors.ray.executor import runtime_env_of

    assert runtime_env_of(job(tmp_path), {"A": "1"}) == {"env_vars": {"A": "1"}, "image_uri": "localhost/train:1"}
    assert runtime_env_of(job(tmp_path, image=None), {}) == {"env_vars": {}}
