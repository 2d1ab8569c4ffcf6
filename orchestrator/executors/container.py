"""Containers: a job with an image runs as `podman run` (or `docker run`) under the local executor's wrapper.

The container *is* the job's process, so it keeps the process contract of `executors.local`:
- launch: the wrapper runs the engine's foreground `run` (`--rm`, a name derived from the home and the
  attempt, `--init` so the job is not PID 1 and a SIGTERM reaches it), and records its exit code, which is the
  job's own (75 included);
- the job protocol's environment goes in by name only (`-e KEY`: values come from the engine client's environment,
  so none shows up in an argv, a log header or `ps`), never the service's PATH or other variables, which
  would hide the image's own;
- the home (checkpoints, heartbeats, the data cache, a default SQLite MLflow store), the workdir, and what of
  the checkpoint dir, log and file-based tracking store lies outside the home are bind-mounted at the same
  paths, `--mount`s where they say, and the job's devices go in the engine's way (CDI `nvidia.com/gpu=IDX`;
  nothing on cpu slots);
- stop: signals go through the engine (`kill --signal`), which reaches the container whether or not its
  client still runs; a SIGKILL also removes it (`rm -f`), as does adopting an attempt whose client is gone.
Which engine: the `container_engine` setting (`AUTORESEARCH_CONTAINER_ENGINE`): podman, docker, or auto
(podman when it is installed, else docker). Engine options of a particular host (an OCI runtime, ulimits)
belong in the engine's own configuration (containers.conf, daemon.json), not here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal as signals
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from orchestrator.core.errors import BadInput
from orchestrator.core.layout import Layout
from orchestrator.queue.models import Job
from runtime import protocol

log = logging.getLogger(__name__)

ENGINES = ("podman", "docker")
CALL_TIMEOUT = 60.0  # seconds an engine command may take (an image inspect, a kill, a removal)
# The job protocol's variables plus the runtime's own: what a job inside needs from the service's side.
CONTRACT_VARS = (protocol.JOB_ID, protocol.ATTEMPT, protocol.CHECKPOINT_DIR, protocol.PARAMS, protocol.HOME,
                 protocol.HEARTBEAT_FILE, protocol.FAULTS, protocol.TRACKING_URI, protocol.RUN_ID,
                 protocol.VISIBLE_DEVICES, protocol.DEVICE_ORDER)


def engine_name(setting: Optional[str] = None) -> str:
    """The engine to use: `setting` (else the `container_engine` setting), `auto` meaning podman when present,
    else docker. BadInput when the chosen engine is not installed."""
    if not setting:
        from orchestrator.core.config import Settings

        setting = Settings.load().container_engine
    choice = (setting or "auto").strip().lower()
    if choice not in ("auto", *ENGINES):
        raise BadInput(f"container engine must be auto, podman or docker, got {choice!r}")
    candidates = ENGINES if choice == "auto" else (choice,)
    for name in candidates:
        if shutil.which(name):
            return name
    raise BadInput(f"--image needs a container engine, but {' or '.join(candidates)} is not installed "
                   "(apt-get install -y podman)")


def container_name(home: Path, job_id: int, attempt: int) -> str:
    """The container of one attempt: unique per home, found again by a restarted service."""
    tag = hashlib.sha1(str(Path(home).resolve()).encode()).hexdigest()[:8]
    return f"autoresearch-{tag}-{job_id}-{attempt}"


def _call(engine: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([engine, *args], capture_output=True, text=True, timeout=CALL_TIMEOUT,
                          stdin=subprocess.DEVNULL)


def resolve_image(engine: str, image: str) -> str:
    """The image's content id (`sha256:...`) on this host: what the job will run, whatever the tag points to
    later. BadInput when the engine has no such image (no registry is asked: pull it first)."""
    if not image or not image.strip() or image.startswith("-"):
        raise BadInput(f"bad --image {image!r}")
    try:
        out = _call(engine, "image", "inspect", "--format", "{{.Id}}", image)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BadInput(f"--image {image}: {engine} did not answer: {exc}") from None
    if out.returncode != 0 or not out.stdout.strip():
        why = (out.stderr.strip().splitlines() or ["not found"])[-1]
        raise BadInput(f"--image {image}: no such image in {engine} ({why}); `{engine} pull {image}` first")
    digest = out.stdout.strip().splitlines()[0]
    return digest if digest.startswith("sha256:") else f"sha256:{digest}"


def parse_mount(text: str) -> str:
    """`SRC:DST[:ro]` with SRC an existing path (made absolute) and DST absolute; BadInput otherwise."""
    parts = str(text).split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1] or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise BadInput(f"bad --mount {text!r}: expected SRC:DST or SRC:DST:ro")
    src, dst = os.path.abspath(os.path.expanduser(parts[0])), parts[1]
    if not os.path.exists(src):
        raise BadInput(f"--mount {text}: {src} does not exist")
    if not dst.startswith("/"):
        raise BadInput(f"--mount {text}: the destination must be an absolute path")
    return ":".join([src, dst, *parts[2:]])


def device_args(devices: Iterable[str]) -> list[str]:
    """The engine's device flags for the job's GPUs (CDI names); none for virtual cpu slots."""
    out = []
    for dev in devices:
        if str(dev).isdigit():
            out += ["--device", f"nvidia.com/gpu={dev}"]
    return out


def same_path_mounts(job: Job, env: dict[str, str], layout: Layout) -> list[str]:
    """What the job reaches at the host's paths: the home (checkpoints, heartbeats, the data cache, and the
    default SQLite MLflow store its MLFLOW_TRACKING_URI names), its checkpoint dir and log where they live
    elsewhere, a file-based tracking store outside the home, and the workdir. Never the host's root."""
    paths = [str(layout.home), job.checkpoint_dir, job.log_path, job.cwd,
             _tracking_dir(env.get(protocol.TRACKING_URI))]
    home = os.path.abspath(layout.home)
    out = []
    for path in paths:
        if not path or not os.path.exists(path) or os.path.abspath(path) == "/":
            continue
        path = os.path.abspath(path)
        if path != home and path.startswith(home + os.sep):
            continue  # inside the home, which is mounted already
        out.append(f"{path}:{path}")
    return list(dict.fromkeys(out))


def _tracking_dir(uri: Optional[str]) -> Optional[str]:
    """The directory of a file-based MLflow store (`sqlite:////abs/mlflow.db`, `file:///dir`, a plain path)."""
    if not uri or ("://" in uri and not uri.startswith(("sqlite:///", "file://"))):
        return None  # a tracking server: reached over the (host) network
    path = uri.split("sqlite:///", 1)[-1] if uri.startswith("sqlite:///") else uri.removeprefix("file://")
    return os.path.dirname(path) if uri.startswith("sqlite") else path


def inner_argv(job: Job) -> list[str]:
    """What runs inside: the command, through the image's own torchrun for multi-device jobs."""
    argv = [str(a) for a in job.argv]
    if job.gpus > 1:
        return ["torchrun", "--standalone", f"--nproc-per-node={job.gpus}", "--no-python", *argv]
    return argv


def run_argv(job: Job, env: dict[str, str], layout: Layout, engine: str) -> list[str]:
    """The engine command line that runs `job`'s current attempt in its image, in the foreground."""
    name = container_name(layout.home, job.id, job.attempts)
    argv = [engine, "run", "--rm", "--name", name, "--init", "--network", "host", "--ipc", "host",
            "--label", f"autoresearch.job={job.id}", "--label", f"autoresearch.attempt={job.attempts}"]
    if engine == "podman":
        argv.append("--sig-proxy=false")  # stops go through `kill` (below), never twice through the client
    for mount in same_path_mounts(job, env, layout) + list(job.mounts or []):
        argv += ["-v", mount]
    if job.cwd:
        argv += ["--workdir", job.cwd]
    for key in sorted(inside_keys(job, env)):
        argv += ["-e", key]
    argv += device_args(job.devices or [])
    argv.append(job.image_id or job.image or "")
    return argv + inner_argv(job)


def inside_keys(job: Job, env: dict[str, str]) -> set[str]:
    """The variables the container gets: the job's own (--env, --env-file) and the job protocol's ones."""
    wanted = set(job.env or {}) | set(CONTRACT_VARS)
    return {k for k in wanted if k in env}


def signal(engine: str, name: str, sig: int) -> bool:
    """Send `sig` to the container's init (which passes it on to the job); False when no such container runs."""
    try:
        out = _call(engine, "kill", "--signal", str(int(sig)), name)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def engine_for(job: Job, setting: Optional[str] = None) -> Optional[str]:
    """The engine of an --image job; None for other jobs, or when the engine has gone missing since the
    submit (its processes are then stopped like any others)."""
    if not job.image:
        return None
    try:
        return engine_name(setting)
    except BadInput as exc:
        log.warning("job %s: %s", job.id, exc)
        return None


def deliver(engine: str, name: str, sig: int, starting: Callable[[], bool], within: float) -> None:
    """A stop for the container: `sig` to its init (and so, once, to the job), whether or not its engine
    client still runs. A SIGTERM sent while the engine is still starting it is delivered once it runs (for
    at most `within` seconds, while `starting()`), so the job saves its checkpoint instead of meeting the
    SIGKILL at the end of its grace. A SIGKILL also removes it: the client's --rm may be cut short."""
    if sig == signals.SIGKILL:
        signal(engine, name, sig)
        remove(engine, name)
    elif not signal(engine, name, sig):
        threading.Thread(target=signal_when_up, args=(engine, name, sig, starting, within), daemon=True).start()


def signal_when_up(engine: str, name: str, sig: int, starting: Callable[[], bool], within: float) -> bool:
    """Send `sig` as soon as the container runs, while `starting()` (its engine client lives) and for at most
    `within` seconds; whether it was delivered."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if signal(engine, name, sig):
            return True
        if not starting():
            return False
        time.sleep(0.25)
    return False


def running(engine: str, name: str) -> Optional[bool]:
    """Whether the container runs (None: the engine did not answer)."""
    try:
        out = _call(engine, "ps", "--filter", f"name=^{name}$", "--format", "{{.Names}}")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return name in out.stdout.split()


def remove(engine: str, name: str) -> None:
    """Remove the container, whether it ran to its end or was killed (no error when it is gone already)."""
    try:
        _call(engine, "rm", "-f", name)
    except (OSError, subprocess.TimeoutExpired):
        pass
