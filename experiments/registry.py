"""The experiment registry: find an experiment by a bundled name, a config file, or a name used before.

`get(name)` resolves, in this order:
- a bundled experiment: `experiments/<name>/spec.py` (no torch import) defines `SPEC`, an `ExperimentSpec`
  whose training entry point is a module run as `python -m <entrypoint>`;
- a path: a folder holding `autoresearch.toml`, the toml itself, or a W&B sweep `.yaml`/`.yml`
  (`experiments.config_file`); the experiment is then remembered by its name in the home;
- a name remembered from such a file (`experiments.memory`);
- `package.module:ATTRIBUTE`: an `ExperimentSpec` defined in Python by a project (importable from the
  current directory), for experiments that need conditions between parameters or other code.
"""

from __future__ import annotations

import importlib
import os
import sys
from experiments.experiment import ExperimentSpec, UnknownExperiment

__all__ = ["ExperimentSpec", "UnknownExperiment", "KNOWN", "get", "names", "all_names"]

KNOWN = ("digits", "charlm", "tabular")


def get(name: str, home: str | os.PathLike | None = None) -> ExperimentSpec:
    """The spec of experiment `name` (a bundled name, a path, a remembered name or `package.module:SPEC`, see
    the module's docstring); UnknownExperiment (a ValueError, listing the known names) otherwise. A config
    file's experiment is remembered under `home` (default: AUTORESEARCH_HOME)."""
    if name in KNOWN:
        return importlib.import_module(f"experiments.{name}.spec").SPEC
    from experiments import config_file, memory

    if config_file.looks_like_path(name):
        spec = config_file.load(name)
        if spec.name in KNOWN:
            raise config_file.ConfigError(f"{spec.source}: name {spec.name!r} is a bundled experiment's; "
                                          "choose another `name`")
        memory.remember(spec, home)
        return spec
    if ":" in name and not name.startswith(("/", ".")):
        return _python_spec(name)
    found = memory.lookup(name, home)
    if found is not None:
        return config_file.load(found)
    known = [*KNOWN, *memory.names(home)]
    raise UnknownExperiment(f"unknown experiment {name!r}; known: {', '.join(known)} (or give a folder holding "
                            f"{config_file.CONFIG}, the toml, or a W&B sweep .yaml)")


def _python_spec(name: str) -> ExperimentSpec:
    """An `ExperimentSpec` named `package.module:ATTRIBUTE`, importable from the current directory."""
    module, _, attr = name.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # as `python -m` would: a project's own experiments resolve from its root
    try:
        spec = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownExperiment(f"cannot load experiment {name!r}: {exc}") from None
    if not isinstance(spec, ExperimentSpec):
        raise UnknownExperiment(f"{name!r} is not an ExperimentSpec")
    return spec


def names() -> tuple[str, ...]:
    """Names of the bundled experiments."""
    return KNOWN


def all_names(home: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Names of the bundled experiments, then of the config-file experiments remembered in `home`."""
    from experiments import memory

    return (*KNOWN, *memory.names(home))
