"""A job's software environment, checked and resolved at submit: workdir, env file, container image, mounts.

Everything here runs on the submitter's side, before anything is queued, so bad input is one line (exit 2)
and nothing changes: a workdir that is not a directory, an env file that cannot be read or parsed, a mount
whose source does not exist, no container engine, an image the engine does not have. What it resolves is
stored with the job: the env file's values (merged under `--env`, which wins), and the image's content id,
which is what runs, even if the tag moves on before the job starts.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from orchestrator.core.errors import BadInput
from orchestrator.queue.models import JobSpec


def read_env_file(path: str) -> dict[str, str]:
    """The variables of a dotenv file (`KEY=VALUE`, `export KEY=VALUE`, quotes, comments; python-dotenv's
    format). BadInput naming the file (and a key, never a value) when it cannot be used."""
    from dotenv import dotenv_values

    if not os.path.isfile(path):
        raise BadInput(f"--env-file {path}: no such file")
    try:
        values = dotenv_values(path, interpolate=False)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"--env-file {path}: cannot read it: {exc}") from None
    for key, value in values.items():
        if value is None:
            raise BadInput(f"--env-file {path}: {key} has no value (expected KEY=VALUE)")
        if not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise BadInput(f"--env-file {path}: {key!r} is not a variable name")
    return {k: v for k, v in values.items() if v is not None}


def prepare(spec: JobSpec, engine_setting: Optional[str] = None) -> JobSpec:
    """`spec` with its workdir checked, its env file read into `env`, its mounts checked and its image
    resolved to a content id (the engine from `engine_setting`: auto, podman or docker)."""
    changes: dict = {}
    if spec.cwd is not None:
        cwd = os.path.abspath(os.path.expanduser(spec.cwd))
        if not os.path.isdir(cwd):
            raise BadInput(f"--workdir {spec.cwd}: not a directory")
        changes["cwd"] = cwd
    if spec.env_file:
        path = os.path.abspath(os.path.expanduser(spec.env_file))
        changes["env"] = {**read_env_file(path), **spec.env}
        changes["env_file"] = path
    if spec.image:
        from orchestrator.executors import container

        mounts = [container.parse_mount(m) for m in spec.mounts or []]
        engine = container.engine_name(engine_setting)
        changes["image_id"] = spec.image_id or container.resolve_image(engine, spec.image)
        changes["mounts"] = mounts or None
    return replace(spec, **changes) if changes else spec
