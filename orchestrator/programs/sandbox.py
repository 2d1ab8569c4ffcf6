"""`--sandbox`: run a variant under bubblewrap (Debian package `bubblewrap`).

What it does: the whole filesystem is mounted read-only; writable are only the trial's worktree, its
checkpoint directory and a private, empty `/tmp`; the protected files are bound read-only on top of the
worktree (so even a root process cannot rewrite them in place); the program's holdout files read as empty
where they lie (a directory as an empty one); the network is a fresh namespace with only
loopback (`--unshare-net`: no connection leaves the box); the sandbox dies with the job.

What it does not do: it is not a security boundary against a determined attacker. The code still runs as the
same user, can read everything that user can read (secrets in files included), can use all CPU, memory and
GPUs it is given, talk to the GPU driver, spawn processes, and fill the writable directories. Kernel bugs in
namespaces, bwrap itself and device access are out of scope. Read what the model wrote before trusting it.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path
from typing import Sequence

from orchestrator.core.errors import BadInput


def available() -> str:
    """The bwrap binary (BadInput with the install hint when missing)."""
    path = shutil.which("bwrap")
    if path is None:
        raise BadInput("--sandbox needs bubblewrap: apt-get install -y bubblewrap")
    return path


def command(argv: Sequence[str], *, cwd: Path, writable: Sequence[Path], protected: Sequence[Path],
            hidden: Sequence[Path] = ()) -> list[str]:
    """`argv` wrapped in bwrap: read-only root, `writable` dirs and a private /tmp, `protected` read-only,
    `hidden` (the holdout) bound over with an empty file (/dev/null) or an empty directory."""
    out = [available(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for path in _code_under_tmp():  # the private /tmp must not hide the interpreter or the code it imports
        out += ["--ro-bind", str(path), str(path)]
    # The minimal /dev above has no GPUs: pass the NVIDIA and DRM device nodes through (CUDA_VISIBLE_DEVICES
    # still selects the job's own).
    for node in sorted(glob.glob("/dev/nvidia*")) + (["/dev/dri"] if os.path.exists("/dev/dri") else []):
        out += ["--dev-bind", node, node]
    for path in writable:
        path = Path(path).resolve()
        path.mkdir(parents=True, exist_ok=True)
        out += ["--bind", str(path), str(path)]
    for path in protected:
        path = Path(path).resolve()
        if path.exists():
            out += ["--ro-bind", str(path), str(path)]
    for path in hidden:
        path = Path(path).resolve()
        if path.is_dir():
            out += ["--tmpfs", str(path), "--remount-ro", str(path)]
        elif path.exists():
            out += ["--ro-bind", "/dev/null", str(path)]
    out += ["--unshare-net", "--die-with-parent", "--chdir", str(Path(cwd).resolve()),
            "--setenv", "TMPDIR", "/tmp", "--", *argv]
    return out


def _code_under_tmp() -> list[Path]:
    """This Python's installation and import paths that live under /tmp (a venv or checkout there), outermost
    first, so the sandbox can bind them back read-only over its private /tmp. A path counts both as named and
    as resolved: a venv named through a link under /tmp (`/tmp/x/.venv` -> `/home/me/.venv`) is where the job's
    interpreter is looked for, though it lives elsewhere."""
    import sys

    found: list[Path] = []
    here = Path(__file__).resolve().parents[2]  # the checkout holding `runtime`, which programs may import
    candidates = [sys.prefix, sys.base_prefix, here, *sys.path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    for raw in candidates:
        if not str(raw):
            continue
        for path in {Path(os.path.abspath(raw)), Path(raw).resolve()}:
            if path.is_relative_to("/tmp") and path != Path("/tmp") and path.exists():
                found.append(path)
    found = sorted(set(found), key=lambda p: len(p.parts))
    return [p for i, p in enumerate(found) if not any(p.is_relative_to(q) for q in found[:i])]


def writable_dirs(worktree: Path) -> list[Path]:
    """The trial's worktree and its checkpoint dir (from the job's environment)."""
    dirs = [Path(worktree)]
    ckpt = os.environ.get("AUTORESEARCH_CHECKPOINT_DIR")
    if ckpt:
        dirs.append(Path(ckpt))
    return dirs
