"""A real container engine and a small image, built once per machine and test session.

No registry is reachable from these machines, so the image is built from Debian packages:
`mmdebstrap --variant=minbase --include=python3 bookworm` then `podman import` (about 30 s and 210 MB, once;
cached under /tmp by a hash of the recipe, and as an image in podman's store). The engine's settings for
this kind of host live in the fixture's own containers.conf (CONTAINERS_CONF), not in product code: Debian's
podman 4.3 needs the runc runtime (crun refuses hybrid cgroups) and explicit ulimits (raising rlimits is not
permitted in these sandboxes).

Without podman or mmdebstrap the tests that need an image skip with the reason, and fail under CI=true.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.orchestrator.conftest import make_service  # noqa: F401  (an in-process service on cpu slots)
from tests.support.requires import require

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
RECIPE = ["mmdebstrap", "--variant=minbase", "--format=tar", "--include=python3", "bookworm"]
TAG = hashlib.sha1(("\n".join(RECIPE) + CONTAINERS_CONF).encode()).hexdigest()[:10]
IMAGE = f"localhost/autoresearch-test:{TAG}"
CACHE = Path("/tmp") / f"autoresearch-test-image-{TAG}"


def _engine_ready() -> str | None:
    """None when podman can run a container here, else why not."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install -y podman)"
    return None


@pytest.fixture(scope="session")
def image() -> str:
    """The test image's name in podman (python3 from Debian bookworm), with CONTAINERS_CONF set for the
    session (jobs' engine clients inherit it through the service)."""
    require("podman", _engine_ready())
    CACHE.mkdir(parents=True, exist_ok=True)
    conf = CACHE / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    os.environ["CONTAINERS_CONF"] = str(conf)
    os.environ["AUTORESEARCH_CONTAINER_ENGINE"] = "podman"
    from filelock import FileLock

    with FileLock(str(CACHE / "build.lock")):  # one builder at a time (two test runs, or workers, on this machine)
        _build()
    out = subprocess.run(["podman", "run", "--rm", IMAGE, "true"], capture_output=True, text=True, timeout=120)
    require("podman run", None if out.returncode == 0 else out.stderr.strip()[-300:])
    return IMAGE


def _build() -> None:
    """Import the test image into podman unless it is there, building its root filesystem first if needed."""
    if subprocess.run(["podman", "image", "exists", IMAGE]).returncode != 0:
        rootfs = CACHE / "rootfs.tar"
        if not rootfs.exists():
            require("mmdebstrap",
                    None if shutil.which("mmdebstrap") else "not installed (apt-get install -y mmdebstrap)")
            part = CACHE / "rootfs.tar.part"
            out = subprocess.run([*RECIPE, str(part)], capture_output=True, text=True)
            require("a Debian image built by mmdebstrap", None if out.returncode == 0 else out.stderr.strip()[-300:])
            part.rename(rootfs)
        out = subprocess.run(["podman", "import", str(rootfs), IMAGE], capture_output=True, text=True)
        require("podman import", None if out.returncode == 0 else out.stderr.strip()[-300:])


def containers_of(home: Path) -> list[str]:
    """Names of the containers (running or not) that jobs of `home` left in podman."""
    from orchestrator.executors.container import container_name

    prefix = container_name(home, 0, 0).rsplit("-", 2)[0]
    out = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    return [n for n in out.stdout.split() if n.startswith(prefix + "-")]
