"""Experiments from a config file: `autoresearch.toml`'s `[experiment]` and `[space]` as an `ExperimentSpec`.

    [experiment]
    run = "python train.py --out_dir={checkpoint_dir} {args}"
    metric = "val_loss"
    direction = "minimize"
    [space]
    lr = { type = "float", low = 1e-4, high = 1e-2, log = true, default = 1e-3 }

    spec = load("./tinygpt")       # the folder, the toml, or a W&B sweep .yaml (experiments.sweep)
    spec = from_dict({"experiment": {...}, "space": {...}}, folder="./tinygpt")

The script knows nothing of autoresearch: its job runs the `run` command in the toml's folder with the
placeholders filled in (`experiments.command`), and its metric comes from MLflow when it logs one, else from
its output lines. Every mistake is one `ConfigError` line naming the key (the CLI exits 2 on it).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

from experiments.experiment import ExperimentSpec, UnknownExperiment
from experiments.space import Categorical, Dimension, Float, Int, SearchSpace, SpaceError
from orchestrator.core.direction import Direction

CONFIG = "autoresearch.toml"
SEED = "seed"  # the space's name for the seed parameter (experiments.registry, the agent's search)
SEED_RANGE = (0, 2**31 - 1)
DEFAULT_ARGS = "--{name}={value}"
JOB_PLACEHOLDERS = ("args", "checkpoint_dir", "seed", "job_id")
EXPERIMENT_KEYS = ("name", "description", "run", "args", "metric", "direction", "pattern", "resume", "fixed",
                   "seed", "time_limit", "image", "holdout_metric", "bools", "mutable", "steps")
TYPE_KEYS = {"float": ("type", "low", "high", "log", "default", "help"),
             "int": ("type", "low", "high", "log", "default", "help"),
             "choice": ("type", "values", "default", "help")}
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")


class ConfigError(UnknownExperiment):
    """A config file that cannot be used; the message is one line naming the file and the key."""


def looks_like_path(name: str) -> bool:
    """Whether `--experiment name` names a file or folder rather than an experiment."""
    if "/" in name or os.sep in name or name in (".", "..") or name.startswith("~"):
        return True
    if name.endswith((".toml", ".yaml", ".yml")):
        return True
    return (Path(name) / CONFIG).is_file()


def load(path: str | os.PathLike) -> ExperimentSpec:
    """The experiment of a folder holding `autoresearch.toml`, of the toml itself, or of a W&B sweep YAML."""
    given = str(path)
    target = Path(given).expanduser()
    if target.is_dir():
        target = target / CONFIG
        if not target.is_file():
            raise ConfigError(f"{given}: no {CONFIG} in this folder")
    elif not target.is_file():
        raise ConfigError(f"{given}: no such file or folder")
    target = target.resolve()
    if target.suffix in (".yaml", ".yml"):
        data = _sweep(target)
    else:
        try:
            with target.open("rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{target}: not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{target}: {exc.strerror}") from None
    return from_dict(data, source=str(target), folder=target.parent)


def _sweep(path: Path) -> dict[str, Any]:
    """A W&B sweep file read into this module's schema (`experiments.sweep`, loaded only when asked)."""
    try:
        from experiments.sweep import read_sweep
    except ImportError:
        raise ConfigError(f"{path}: W&B sweep files are not supported by this installation") from None
    try:
        return read_sweep(path)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0] if str(exc) else f"{path}: not a usable sweep") from None


def from_dict(data: Mapping[str, Any], *, source: str | None = None, folder: str | os.PathLike | None = None
              ) -> ExperimentSpec:
    """An `ExperimentSpec` from the toml's tables (`experiment`, `space`; a `program` table is left alone)."""
    where = source or CONFIG
    unknown = sorted(set(data) - {"experiment", "space", "program"})
    if unknown:
        raise ConfigError(f"{where}: unknown table {unknown[0]!r} (expected [experiment] and [space])")
    section = data.get("experiment")
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where}: no [experiment] table")
    unknown = sorted(set(section) - set(EXPERIMENT_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} in [experiment]; known: {', '.join(EXPERIMENT_KEYS)}")
    for key in ("run", "metric", "direction"):
        if key not in section:
            raise ConfigError(f"{where}: [experiment] needs {key!r}")
    for key in ("name", "description", "run", "args", "metric", "direction", "pattern", "resume", "seed", "image",
                "holdout_metric", "steps"):
        if key in section and not isinstance(section[key], str):
            raise ConfigError(f"{where}: {key} must be a string, got {section[key]!r}")
    root = Path(folder).resolve() if folder is not None else Path.cwd()
    name = section.get("name") or root.name
    if not NAME.fullmatch(name):
        raise ConfigError(f"{where}: name {name!r} must be letters, digits, '_', '.' or '-'")
    metric = section["metric"]
    if not re.fullmatch(r"[A-Za-z0-9_.\-/ ]{1,250}", metric):
        raise ConfigError(f"{where}: metric {metric!r} is not a valid MLflow metric name")
    if section["direction"] not in tuple(Direction):
        raise ConfigError(f"{where}: direction must be \"minimize\" or \"maximize\", got {section['direction']!r}")
    space_table = data.get("space", {})
    if not isinstance(space_table, Mapping):
        raise ConfigError(f"{where}: [space] must be a table of parameters")
    dims = {key: parse_dimension(key, value, where) for key, value in space_table.items()}
    fixed = _fixed(section.get("fixed", {}), dims, where)
    seed_param = section.get("seed") or None
    if seed_param is not None:
        if seed_param in dims or seed_param in fixed:
            raise ConfigError(f"{where}: seed names {seed_param!r}, which is also in "
                              f"{'[space]' if seed_param in dims else 'fixed'}; the seed is never searched")
        if SEED in dims:
            raise ConfigError(f"{where}: [space] has a parameter named {SEED!r}; with seed = {seed_param!r} "
                              "rename it")
        dims[SEED] = Int(*SEED_RANGE, default=0, help=f"the seed (the script's {seed_param})")
    args_format = section.get("args", DEFAULT_ARGS)
    if "{value}" not in args_format:
        raise ConfigError(f"{where}: args must contain {{value}} (and usually {{name}}), e.g. {DEFAULT_ARGS!r}")
    _check_run(section["run"], dims, fixed, seed_param, where)
    if section.get("resume"):
        known = set(JOB_PLACEHOLDERS) | set(dims) | set(fixed) | ({seed_param} if seed_param else set())
        unknown_names = [n for n in placeholders(section["resume"]) if n not in known]
        if unknown_names:
            raise ConfigError(f"{where}: resume has an unknown placeholder {{{unknown_names[0]}}}; known: "
                              f"{', '.join(sorted(known))}")
    pattern = section.get("pattern")
    if pattern is not None:
        _check_pattern(pattern, metric, where)
    time_limit = None
    if "time_limit" in section:
        from orchestrator.core.durations import parse_duration
        from orchestrator.core.errors import BadInput

        try:
            time_limit = parse_duration(section["time_limit"], what="time_limit")
        except BadInput as exc:
            raise ConfigError(f"{where}: {exc}") from None
    bools = section.get("bools", ["True", "False"])
    if not (isinstance(bools, list) and len(bools) == 2 and all(isinstance(b, str) and b for b in bools)
            and bools[0] != bools[1]):
        raise ConfigError(f"{where}: bools must be the two words for true and false, e.g. [\"true\", \"false\"], "
                          f"got {bools!r}")
    holdout_metric = section.get("holdout_metric") or None
    if holdout_metric is not None and holdout_metric == metric:
        raise ConfigError(f"{where}: holdout_metric {holdout_metric!r} is the searched metric; name the one the "
                          "script logs on its held-out data")
    mutable = section.get("mutable", [])
    if not (isinstance(mutable, list) and all(isinstance(m, str) for m in mutable)):
        raise ConfigError(f"{where}: mutable must be a list of [space] parameter names, got {mutable!r}")
    for key in mutable:
        if not isinstance(dims.get(key), (Float, Int)):
            raise ConfigError(f"{where}: mutable {key!r} must name a float or int parameter of [space] (what "
                              "may change mid-training: a learning rate, weight decay, dropout; never the "
                              "architecture)")
    steps = section.get("steps") or None
    if steps is not None:
        _check_steps(steps, dims, fixed, mutable, where)
    description = section.get("description") or (
        f"A training script run as `{section['run']}` (in {root.name}/); {section['direction']} {metric}.")
    return ExperimentSpec(name=name, description=description, space=SearchSpace(dims), metric=metric,
                          direction=section["direction"], entrypoint="", progress_metric=metric,
                          image=section.get("image") or None, run=section["run"], args_format=args_format,
                          pattern=pattern, resume=section.get("resume") or None, fixed=fixed,
                          seed_param=seed_param, time_limit=time_limit, cwd=str(root), source=source,
                          holdout_metric=holdout_metric, bools=(bools[0], bools[1]), mutable=tuple(mutable),
                          steps=steps)


def parse_dimension(key: str, table: Any, where: str = CONFIG) -> Dimension:
    """One `[space]` entry (`{ type = "float" | "int" | "choice", ... }`) as a search-space dimension."""
    at = f"{where}: [space] {key}"
    if not NAME.fullmatch(key) or key in JOB_PLACEHOLDERS:
        raise ConfigError(f"{at}: not a usable parameter name (letters, digits, '_', '.', '-'; not a placeholder)")
    if not isinstance(table, Mapping):
        raise ConfigError(f"{at}: expected a table such as {{ type = \"float\", low = 0.0, high = 1.0 }}")
    kind = table.get("type")
    if kind is None and table and all(isinstance(v, Mapping) for v in table.values()):
        inner = next(iter(table))
        raise ConfigError(f"{at}: TOML read {key}.{inner} as a table inside {key}: quote a dotted name, "
                          f"\"{key}.{inner}\" = {{ type = ... }}")
    if kind not in TYPE_KEYS:
        raise ConfigError(f"{at}: type must be \"float\", \"int\" or \"choice\", got {kind!r}")
    unknown = sorted(set(table) - set(TYPE_KEYS[kind]))
    if unknown:
        raise ConfigError(f"{at}: unknown key {unknown[0]!r} for a {kind}; known: {', '.join(TYPE_KEYS[kind])}")
    help_text = table.get("help", "")
    if not isinstance(help_text, str):
        raise ConfigError(f"{at}: help must be a string")
    if kind == "choice":
        values = table.get("values")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{at}: values must be a non-empty list")
        if not all(isinstance(v, (str, int, float, bool)) for v in values) or len(set(map(repr, values))) < len(values):
            raise ConfigError(f"{at}: values must be distinct strings, numbers or booleans")
        dim: Dimension = Categorical(tuple(values), help=help_text)
    else:
        bounds = {}
        for end in ("low", "high"):
            if end not in table:
                raise ConfigError(f"{at}: a {kind} needs {end!r}")
            value = table[end]
            ok = isinstance(value, int) if kind == "int" else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ConfigError(f"{at}: {end} must be {'an integer' if kind == 'int' else 'a number'}, "
                                  f"got {value!r}")
            bounds[end] = value
        log = table.get("log", False)
        if not isinstance(log, bool):
            raise ConfigError(f"{at}: log must be true or false")
        low, high = bounds["low"], bounds["high"]
        if not low < high:
            raise ConfigError(f"{at}: low ({low}) must be below high ({high})")
        if log and low <= 0:
            raise ConfigError(f"{at}: a log range must lie above 0, got low = {low}")
        cls = Int if kind == "int" else Float
        dim = cls(low if kind == "int" else float(low), high if kind == "int" else float(high), log=log,
                  help=help_text)
    if "default" in table:
        default = table["default"]
        try:
            if isinstance(default, bool) and not isinstance(dim, Categorical):
                raise SpaceError(key, f"expected a {dim.describe()}, got {default!r}")
            coerced = dim.coerce(key, default)
        except SpaceError as exc:
            raise ConfigError(f"{at}: default {default!r} is not allowed: {str(exc).split(': ', 1)[1]}") from None
        import dataclasses

        dim = dataclasses.replace(dim, default=coerced)
    return dim


def _fixed(table: Any, dims: Mapping[str, Dimension], where: str) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: fixed must be a table, e.g. {{ max_iters = 200 }}")
    out = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            inner = next(iter(value), "name")
            raise ConfigError(f"{where}: fixed {key}: TOML read {key}.{inner} as a table inside {key}: quote a "
                              f"dotted name, {{ \"{key}.{inner}\" = ... }}")
        if key in dims:
            raise ConfigError(f"{where}: fixed {key} is also in [space]; a parameter is either searched or fixed")
        if not NAME.fullmatch(key) or key in JOB_PLACEHOLDERS:
            raise ConfigError(f"{where}: fixed {key!r} is not a usable parameter name")
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{where}: fixed {key} must be a string, number or boolean, got {value!r}")
        out[key] = value
    return out


def _check_steps(steps: str, dims: Mapping[str, Dimension], fixed: Mapping[str, Any], mutable: list[str],
                 where: str) -> None:
    """`steps` names the int parameter that says where a run stops (fixed or in [space], never the seed)."""
    dim = dims.get(steps)
    if steps == SEED or (dim is None and steps not in fixed):
        raise ConfigError(f"{where}: steps {steps!r} must name the parameter (fixed or in [space]) that says after "
                          "how many steps the script stops, e.g. steps = \"max_iters\"")
    if (dim is not None and not isinstance(dim, Int)) or (
            dim is None and (isinstance(fixed[steps], bool) or not isinstance(fixed[steps], int) or fixed[steps] < 1)):
        raise ConfigError(f"{where}: steps {steps!r} must be an int parameter (a number of steps >= 1)")
    if steps in mutable:
        raise ConfigError(f"{where}: steps {steps!r} is also mutable; where a run stops is not a hyperparameter")


def placeholders(run: str) -> list[str]:
    """The `{...}` names in a command template (`{{` and `}}` are literal braces)."""
    return [m.group(1) for m in PLACEHOLDER.finditer(run) if m.group(1) is not None]


def _check_run(run: str, dims: Mapping[str, Dimension], fixed: Mapping[str, Any], seed_param: str | None,
               where: str) -> None:
    if not run.strip():
        raise ConfigError(f"{where}: run must be a command, e.g. \"python train.py {{args}}\"")
    names = placeholders(run)
    params = set(dims) | set(fixed) | ({seed_param} if seed_param else set())
    for name in names:
        if name not in JOB_PLACEHOLDERS and name not in params:
            raise ConfigError(f"{where}: run has an unknown placeholder {{{name}}}; known: "
                              f"{', '.join(sorted(set(JOB_PLACEHOLDERS) | params))}")
    if "seed" in names and seed_param is None:
        raise ConfigError(f"{where}: run uses {{seed}} but no seed parameter is declared (seed = \"...\")")
    searched = [d for d in dims if d != SEED]
    if searched and "args" not in names and not any(n in searched for n in names):
        raise ConfigError(f"{where}: run must pass the parameters: add {{args}} (or {{NAME}} for each), "
                          f"e.g. \"{run.strip()} {{args}}\"")
    from experiments.command import split

    try:
        split(run)
    except ValueError as exc:
        raise ConfigError(f"{where}: run: {exc}") from None


def _check_pattern(pattern: str, metric: str, where: str) -> None:
    from orchestrator.core.metriclines import compile_pattern

    try:
        regex = compile_pattern(pattern, metric)
    except re.error as exc:
        raise ConfigError(f"{where}: pattern is not a regular expression: {exc}") from None
    if "value" not in regex.groupindex:
        raise ConfigError(f"{where}: pattern needs a (?P<value>...) group for the metric's number")
