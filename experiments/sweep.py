"""A Weights & Biases sweep configuration read as a config-file experiment (the config-file experiment format).

`read_sweep(path)` returns the plain dict an `autoresearch.toml` parses to (`{"experiment": {...}, "space":
{...}}`), so one loader turns either file into an `ExperimentSpec`. What maps, and how:

- `program` and `command` -> `run`: the macros as the W&B agent expands them: `${env}` (dropped: `/usr/bin/env`
  only looks the program up on PATH, as the shell does), `${interpreter}` -> `python`, `${program}` -> the program,
  `${args}` -> `{args}` with `args = "--{name}={value}"`, `${args_no_hyphens}` -> `{args}` with `"{name}={value}"`,
  `${args_no_boolean_flags}` -> as `${args}` when no parameter is a bool. No `command`: W&B's default,
  `${env} ${interpreter} ${program} ${args}`. Literal words are quoted for the shell when they need it.
- `metric: {name, goal}` -> `metric`, `direction` (W&B's default goal: minimize).
- `parameters`: `value` (or a single-item `values`) -> `fixed`; `values` -> a choice; `min`/`max` with
  `int_uniform`, `uniform`, `log_uniform_values`, `inv_log_uniform_values` (the same law: ln X uniform),
  `log_uniform`/`inv_log_uniform` (bounds are exponents: e^min..e^max, e^-max..e^-min) -> an int or float range;
  `q_uniform` -> an int range when q = 1 on integer bounds, else a choice of the multiples of q (at most 64);
  `q_log_uniform(_values)` with q = 1 -> a log int range.
- `method` (grid, random, bayes), `name`, `description`, `project`, `entity`, `run_cap`, `controller`, `kind`,
  `apiVersion`, `metric.target`/`impute`/`impute_while_running` and an `early_terminate` of type hyperband are
  accepted and change nothing: the session's proposer, budget and ASHA decide.

W&B gives no default; this reader chooses one (the first trial of a session runs it, as the baseline): the
geometric middle of a log range, the arithmetic middle of a linear one (three significant digits), the first of
`values`. Anything else (nested `parameters`, `probabilities`, the normal/beta laws, `${args_json}`, unknown keys)
is a `SweepError` naming the key: one line, nothing guessed.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from orchestrator.core.direction import Direction

_TOP = {"program", "command", "method", "metric", "parameters", "early_terminate", "name", "description",
        "project", "entity", "run_cap", "controller", "kind", "apiVersion"}
_REFUSED_TOP = {"job": "a W&B Launch job", "image_uri": "a W&B Launch image"}
_METRIC = {"name", "goal", "target", "impute", "impute_while_running"}
_HYPERBAND = {"type", "min_iter", "max_iter", "s", "eta", "strict"}
_PARAM = {"value", "values", "distribution", "min", "max", "q"}
_UNBOUNDED = {"normal", "q_normal", "log_normal", "q_log_normal", "beta", "q_beta"}
_MAX_GRID = 64  # a q_uniform with more multiples than this is better written as a range by the user
_ARGS_MACROS = {"${args}": "--{name}={value}", "${args_no_boolean_flags}": "--{name}={value}",
                "${args_no_hyphens}": "{name}={value}"}
_DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]


class SweepError(ValueError):
    """The sweep file cannot be read or has something this reader cannot map; one line naming the key."""


def read_sweep(path: Path) -> dict:
    """The `autoresearch.toml` dict (`experiment` and `space` tables) equivalent to the W&B sweep YAML at `path`.

    Raises `SweepError` (a ValueError) with one line naming the file and the key for anything it cannot map."""
    path = Path(path)
    doc = _load(path)
    where = path.name

    def fail(key: str, message: str) -> SweepError:
        return SweepError(f"{where}: {key}: {message}")

    for key in doc:
        if key in _REFUSED_TOP:
            raise fail(key, f"{_REFUSED_TOP[key]} is not a script autoresearch can run; give `program`")
        if key not in _TOP:
            raise fail(key, "not a W&B sweep key (known: " + ", ".join(sorted(_TOP)) + ")")
    method = doc.get("method", "random")
    if method not in ("grid", "random", "bayes"):
        raise fail("method", f"{method!r} is not one of grid, random, bayes")
    _check_early_terminate(doc.get("early_terminate"), fail)
    metric, direction = _metric(doc.get("metric"), fail)
    fixed, space = _parameters(doc.get("parameters"), fail)
    run, args = _command(doc, path.parent, {**fixed, **{k: v.get("values") for k, v in space.items()}}, fail)
    name = doc.get("name")
    if name is not None and not isinstance(name, str):
        raise fail("name", f"expected a string, got {name!r}")
    description = doc.get("description")
    if description is not None and not isinstance(description, str):
        raise fail("description", f"expected a string, got {description!r}")
    experiment = {
        "name": name or path.resolve().parent.name,
        "description": description or f"the W&B sweep {where}: {direction} {metric} of `{run}`",
        "run": run,
        "args": args,
        "metric": metric,
        "direction": direction,
        "fixed": fixed,
    }
    return {"experiment": experiment, "space": space}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading `1e-4` as a float (YAML 1.2 does; PyYAML's 1.1 rules make it a string,
    and a sweep's `min: 1e-4` is meant as a number)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _load(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SweepError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SweepError(f"{path}: cannot be read ({exc.__class__.__name__})") from None
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise SweepError(f"{path.name}: not valid YAML{at}: {problem}") from None
    if not isinstance(doc, dict):
        raise SweepError(f"{path.name}: a W&B sweep is a mapping of keys (program, metric, parameters ...)")
    return doc


def _check_early_terminate(spec: Any, fail) -> None:
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise fail("early_terminate", f"expected a mapping, got {spec!r}")
    kind = spec.get("type")
    if kind != "hyperband":
        raise fail("early_terminate.type", f"{kind!r} is not supported (only hyperband, which ASHA stands for)")
    for key in spec:
        if key not in _HYPERBAND:
            raise fail(f"early_terminate.{key}", "not a hyperband key")


def _metric(spec: Any, fail) -> tuple[str, str]:
    if spec is None:
        raise fail("metric", "missing: autoresearch needs the metric to optimise ({name, goal})")
    if not isinstance(spec, dict):
        raise fail("metric", f"expected a mapping with name and goal, got {spec!r}")
    for key in spec:
        if key not in _METRIC:
            raise fail(f"metric.{key}", "not a W&B metric key (name, goal, target, impute)")
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise fail("metric.name", "missing: the name the script reports its result under")
    goal = spec.get("goal", "minimize")
    if goal not in tuple(Direction):
        raise fail("metric.goal", f"{goal!r} is not minimize or maximize")
    return name, goal


def _parameters(spec: Any, fail) -> tuple[dict, dict]:
    if not isinstance(spec, dict) or not spec:
        raise fail("parameters", "missing: a mapping of parameter names to their values or ranges")
    fixed: dict[str, Any] = {}
    space: dict[str, dict] = {}
    for name, param in spec.items():
        key = f"parameters.{name}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
            raise fail(key, "not a parameter name (a letter or _, then letters, digits, _ . -)")
        if not isinstance(param, dict):
            raise fail(key, f"expected a mapping (value, values, or min/max), got {param!r}")
        if "parameters" in param:
            raise fail(f"{key}.parameters", "nested parameters cannot be written as command-line arguments")
        for k in param:
            if k not in _PARAM:
                what = "weighted choices have no equivalent" if k in ("probabilities",) else (
                    "only bounded laws (min/max) have an equivalent" if k in ("mu", "sigma", "a", "b")
                    else "not a W&B parameter key")
                raise fail(f"{key}.{k}", what)
        kind, entry = _parameter(key, param, fail)
        if kind == "fixed":
            fixed[name] = entry
        else:
            space[name] = entry
    return fixed, space


def _scalar(key: str, value: Any, fail) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise fail(key, f"{value!r} is not a finite number")
    if not isinstance(value, (str, int, float, bool)):
        raise fail(key, f"{value!r} is not a single string, number or bool (it cannot be one argument)")
    return value


def _parameter(key: str, param: dict, fail) -> tuple[str, Any]:
    dist = param.get("distribution")
    if "value" in param:
        if dist not in (None, "constant") or set(param) - {"value", "distribution"}:
            raise fail(key, "`value` (a constant) goes alone")
        return "fixed", _scalar(f"{key}.value", param["value"], fail)
    if "values" in param:
        if dist not in (None, "categorical") or set(param) - {"values", "distribution"}:
            raise fail(key, "`values` (a choice) goes alone or with distribution: categorical")
        values = param["values"]
        if not isinstance(values, list) or not values:
            raise fail(f"{key}.values", "expected a non-empty list")
        values = [_scalar(f"{key}.values", v, fail) for v in values]
        if len(values) == 1:
            return "fixed", values[0]  # a one-item choice is a constant; nothing to search
        if len({(type(v), v) for v in values}) != len(values):
            raise fail(f"{key}.values", "lists a value twice")
        return "space", {"type": "choice", "values": values, "default": values[0]}
    if dist in _UNBOUNDED:
        raise fail(f"{key}.distribution", f"{dist!r} is unbounded or weighted: no range of the search space "
                   "equals it (use min/max with uniform or log_uniform_values)")
    if dist == "constant":
        raise fail(f"{key}.value", "missing: distribution constant needs a value")
    if dist == "categorical":
        raise fail(f"{key}.values", "missing: distribution categorical needs values")
    if "min" not in param or "max" not in param:
        raise fail(f"{key}.{'min' if 'min' not in param else 'max'}", "missing: give value, values, or min and max")
    low, high = param["min"], param["max"]
    for bound, value in (("min", low), ("max", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise fail(f"{key}.{bound}", f"expected a number, got {value!r}")
    if dist is None:  # W&B infers the law from the bounds' types
        dist = "int_uniform" if isinstance(low, int) and isinstance(high, int) else "uniform"
    if "q" in param and not dist.startswith("q_"):
        raise fail(f"{key}.q", f"only the q_* distributions take q (this one is {dist})")
    if not low < high:
        raise fail(f"{key}.min", f"min {low!r} is not below max {high!r}")
    return "space", _ranged(key, dist, low, high, param.get("q", 1.0), fail)


def _ranged(key: str, dist: str, low: float, high: float, q: Any, fail) -> dict:
    if dist == "int_uniform":
        if not (float(low).is_integer() and float(high).is_integer()):
            raise fail(f"{key}.min", "int_uniform needs integer bounds")
        return _int(int(low), int(high), log=False)
    if dist == "uniform":
        return _float(float(low), float(high), log=False)
    if dist in ("log_uniform_values", "inv_log_uniform_values"):
        if low <= 0:
            raise fail(f"{key}.min", f"{dist} needs min > 0, got {low!r}")
        return _float(float(low), float(high), log=True)
    if dist in ("log_uniform", "inv_log_uniform"):  # bounds are natural-log exponents
        lo, hi = (low, high) if dist == "log_uniform" else (-high, -low)
        return _float(_exp(f"{key}.min", lo, fail), _exp(f"{key}.max", hi, fail), log=True)
    if dist in ("q_uniform", "q_log_uniform", "q_log_uniform_values"):
        return _quantized(key, dist, low, high, q, fail)
    raise fail(f"{key}.distribution", f"{dist!r} is not a W&B distribution")


def _quantized(key: str, dist: str, low: float, high: float, q: Any, fail) -> dict:
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not q > 0:
        raise fail(f"{key}.q", f"expected a number > 0, got {q!r}")
    if dist != "q_uniform":
        if q != 1:
            raise fail(f"{key}.q", f"{dist} with q != 1 (multiples of q spread on a log scale) has no equivalent")
        if dist == "q_log_uniform":
            low, high = _exp(f"{key}.min", low, fail), _exp(f"{key}.max", high, fail)
        lo, hi = round(low), round(high)  # W&B rounds each sample to the nearest integer
        if lo < 1 or not lo < hi:
            raise fail(f"{key}.min", f"{dist} with q = 1 spans integers {lo}..{hi}: a log range needs 1 <= low < high")
        return _int(lo, hi, log=True)
    if q == 1 and float(low).is_integer() and float(high).is_integer():
        return _int(int(low), int(high), log=False)
    first, last = round(low / q), round(high / q)
    if last - first + 1 > _MAX_GRID:
        raise fail(f"{key}.q", f"{last - first + 1} multiples of {q} (more than {_MAX_GRID}): write it as a "
                   "uniform range, or list the values")
    as_int = isinstance(q, int) and float(low).is_integer()
    values = [k * q if as_int else float(f"{k * q:.12g}") for k in range(first, last + 1)]
    if len(values) < 2:
        raise fail(f"{key}.q", f"q = {q} leaves a single value in [{low}, {high}]")
    return {"type": "choice", "values": values, "default": values[len(values) // 2]}


def _exp(key: str, exponent: float, fail) -> float:
    try:
        value = math.exp(exponent)
    except OverflowError:
        value = math.inf
    if value == 0.0 or not math.isfinite(value):
        raise fail(key, f"e^{exponent} is out of a float's range")
    return float(f"{value:.12g}")  # e^ln(1e-4) is 1.0000000000000005e-4: keep the number the user meant


def _middle(low: float, high: float, log: bool) -> float:
    exact = math.sqrt(low * high) if log else (low + high) / 2
    rounded = float(f"{exact:.3g}")
    return rounded if low <= rounded <= high else exact


def _float(low: float, high: float, *, log: bool) -> dict:
    return {"type": "float", "low": low, "high": high, "log": log, "default": _middle(low, high, log)}


def _int(low: int, high: int, *, log: bool) -> dict:
    middle = round(math.sqrt(low * high)) if log else (low + high) // 2
    return {"type": "int", "low": low, "high": high, "log": log, "default": min(max(middle, low), high)}


def _command(doc: dict, folder: Path, values: dict, fail) -> tuple[str, str]:
    """(`run`, `args`) from `command` and `program`, the macros expanded as the W&B agent does."""
    command = doc.get("command", _DEFAULT_COMMAND)
    if not isinstance(command, list) or not command or not all(isinstance(w, (str, int, float)) for w in command):
        raise fail("command", "expected a list of words, e.g. [\"${env}\", \"${interpreter}\", \"${program}\", "
                   "\"${args}\"]")
    program = doc.get("program")
    words: list[str] = []
    args = None
    for word in map(str, command):
        if word == "${env}":
            continue
        if word == "${interpreter}":
            words.append("python")
        elif word == "${program}":
            if not isinstance(program, str) or not program:
                raise fail("program", "missing: the command runs ${program}")
            if not (folder / program).is_file():
                raise fail("program", f"{program!r} is not a file next to the sweep file")
            words.append(shlex.quote(program))
        elif word in _ARGS_MACROS:
            if args is not None:
                raise fail("command", f"{word}: the parameters are written once")
            if word == "${args_no_boolean_flags}":
                for name, value in values.items():
                    if any(isinstance(v, bool) for v in (value if isinstance(value, list) else [value])):
                        raise fail("command", "${args_no_boolean_flags} writes bool parameter "
                                   f"{name!r} as a bare flag, which autoresearch's {{args}} cannot; use ${{args}}")
            args = _ARGS_MACROS[word]
            words.append("{args}")
        elif "${" in word:
            raise fail("command", f"{word!r}: only ${{env}}, ${{interpreter}}, ${{program}}, ${{args}}, "
                       "${args_no_hyphens} and ${args_no_boolean_flags} can be mapped")
        elif "{" in word or "}" in word:
            raise fail("command", f"{word!r}: braces would read as autoresearch placeholders")
        else:
            words.append(shlex.quote(word))
    if args is None:
        raise fail("command", "no ${args}: the script would get its parameters only from wandb.config, which "
                   "autoresearch does not fill")
    return " ".join(words), args
