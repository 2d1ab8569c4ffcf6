"""`autoresearch init -- python train.py`: a starter `autoresearch.toml` from a script's own command-line options.

The script runs in a subprocess (`experiments/starter_probe.py`, its own interpreter) only until it builds its
argparse parser or click/typer command; the options become the toml (the config-file experiment format):

- numbers with a default -> `[space]`, a range around the default marked `# review` (a float: a log range
  default/10..default*10, or 0..0.5 for a default of 0 or a dropout-like rate up to 0.25; an int: a log range
  default/4..default*4 for powers of two from 16, else default/2..default*2); a click IntRange/FloatRange or an
  argparse `choices=range(...)` gives its own bounds; `choices` -> a choice;
- the budget (epochs, iterations, steps) -> `fixed`; a seed option -> `fixed` and `seed = "NAME"`;
- an output folder option (out_dir, save_dir, checkpoint_dir ...) -> `--out_dir={checkpoint_dir}` in `run`, so
  that concurrent trials never share it;
- flags, strings without choices, paths, lists and infrastructure options (workers, device, intervals) -> comments;
- options given on the `init` command line stay in `run` as given and are not searched.

`run` is the command given, with `{args}` and `args = "--{name}={value}"` when every flag is `--` + its name;
otherwise (`--learning-rate` for parameter learning_rate) each parameter is placed in `run` with its own flag,
`--learning-rate={learning_rate}`. `metric`, `direction` and `pattern` are left commented for the user.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from experiments import starter_frameworks as frameworks

DEFAULT_TIMEOUT_S = 60.0
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?")
_PY_VALUED = {"-X", "-W", "-Q"}  # interpreter options that take the next word
_BUDGET = re.compile(r"(^|_)(epochs?|iters?|iterations?|steps?|updates|budget)$")
_SEED = re.compile(r"^(seed|random_seed|rng_seed|manual_seed)$")
_OUTDIR = re.compile(r"^(out|output|save|checkpoint|ckpt|run)_?dir$")
_INFRA = {"worker", "workers", "device", "devices", "gpu", "gpus", "cuda", "rank", "world", "port", "host",
          "interval", "every", "freq", "frequency", "log", "logging", "verbose", "verbosity", "debug", "print",
          "wandb", "compile", "profile", "proc", "threads", "jobs", "cache", "prefetch", "pin"}
_RATE = re.compile(r"(dropout|drop_?rate|drop_path|prob|_p$|^p$)")
_BETA = re.compile(r"beta|momentum|ema|decay_rate")
_RESUME = re.compile(r"^(resume|init_from|resume_from|resume_from_checkpoint|restore)$")


class StarterError(ValueError):
    """The command cannot be turned into a starter toml; one line for the user (the CLI exits 2)."""


@dataclass(frozen=True)
class Starter:
    """The starter file: where it goes (next to the script) and its text."""

    path: Path
    text: str


def starter_toml(argv: list[str], cwd: Path, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """The text of a starter `autoresearch.toml` for the command `argv` (run from `cwd`)."""
    return build_starter(argv, cwd, timeout).text


def build_starter(argv: list[str], cwd: Path, timeout: float = DEFAULT_TIMEOUT_S) -> Starter:
    """The starter toml for the command `argv` run from `cwd`, and the path it belongs at (the script's folder)."""
    cwd = Path(cwd).resolve()
    command = _Command.parse(argv, cwd)
    report = _probe(command, cwd, timeout)
    return Starter(command.folder / "autoresearch.toml", _render(command, report))


def write_starter(argv: list[str], cwd: Path, *, force: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> Path:
    """Write the starter toml next to the script and return its path; an existing one is refused unless `force`.

    The file appears whole or not at all (written aside, then renamed)."""
    starter = build_starter(argv, cwd, timeout)
    if starter.path.exists() and not force:
        raise StarterError(f"{starter.path} exists: --force replaces it, --print shows the starter instead")
    aside = starter.path.with_name(f".{starter.path.name}.{os.getpid()}.tmp")
    try:
        aside.write_text(starter.text)
        os.replace(aside, starter.path)
    except OSError as exc:
        aside.unlink(missing_ok=True)
        raise StarterError(f"{starter.path}: cannot be written ({exc.strerror or exc})") from None
    return starter.path


@dataclass(frozen=True)
class _Command:
    """The user's command, split: the interpreter, the script (a file or `-m module`) and the script's arguments."""

    words: list[str]       # the command as the toml's `run` has it (the script named from its own folder)
    interpreter: str       # the Python that runs the probe
    target: list[str]      # [script path] or ["-m", module]
    script_args: list[str]
    folder: Path           # where the toml goes and `run` runs
    script_name: str

    @classmethod
    def parse(cls, argv: list[str], cwd: Path) -> "_Command":
        if not argv:
            raise StarterError("give the command that trains, after --: autoresearch init -- python train.py")
        words = list(argv)
        at = next((i for i, w in enumerate(words) if _PYTHON.fullmatch(os.path.basename(w))), None)
        if at is not None:
            named = words[at]
            interpreter = (str(cwd / named) if os.sep in named else shutil.which(named)) or named
            i = at + 1
            while i < len(words) and words[i].startswith("-") and words[i] not in ("-m", "-c"):
                i += 2 if words[i] in _PY_VALUED else 1
            if i >= len(words):
                raise StarterError(f"`{shlex.join(argv)}` names no script after {words[at]}")
            if words[i] == "-c":
                raise StarterError("python -c has no script to read options from: give python SCRIPT.py")
            if words[i] == "-m":
                if i + 1 >= len(words):
                    raise StarterError("python -m needs a module name")
                return cls(words, interpreter, ["-m", words[i + 1]], words[i + 2:], cwd, words[i + 1])
        else:  # torchrun / accelerate launch / ./train.py: the first *.py word is the script
            i = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
            if i is None:
                raise StarterError(f"cannot tell which Python script `{shlex.join(argv)}` runs: give python "
                                   "SCRIPT.py ...")
            interpreter = shutil.which("python3") or shutil.which("python") or sys.executable
        script = (cwd / words[i]).resolve()
        if not script.is_file():
            raise StarterError(f"{words[i]}: no such file (from {cwd})")
        words[i] = script.name  # `run` runs in the toml's folder, the script's
        return cls(words, interpreter, [str(script)], words[i + 1:], script.parent, script.name)


def _probe(command: _Command, cwd: Path, timeout: float) -> dict:
    """Run the script up to its parser in a subprocess; the parser's options as the probe wrote them."""
    probe = Path(__file__).with_name("starter_probe.py")
    with tempfile.TemporaryDirectory(prefix="autoresearch-init-") as tmp:
        out = Path(tmp) / "parser.json"
        try:
            proc = subprocess.Popen(
                [command.interpreter, str(probe), str(out), *command.target, *command.script_args],
                cwd=str(cwd if command.target[0] == "-m" else command.folder), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                env={**os.environ, "AUTORESEARCH_INIT": "1"})
        except OSError as exc:
            raise StarterError(f"cannot run {command.interpreter}: {exc.strerror or exc}") from None
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise StarterError(f"{command.script_name} built no parser within {timeout:g} s (it was stopped); "
                               "use --timeout for a slow import") from None
        finally:
            _kill(proc)  # the script's own children, if it started any before parsing
        if out.is_file():
            report = json.loads(out.read_text())
        elif proc.returncode == 0:
            raise StarterError(f"{command.script_name} ended without building an argparse, click or typer parser: "
                               "write autoresearch.toml by hand (see docs/guides/init-and-sweeps.md)")
        else:
            last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "no message")
            raise StarterError(f"{command.script_name} failed before building its parser (exit {proc.returncode}):"
                               f" {last.strip()[:300]}")
    if report.get("error") == "sub-commands":
        prefix = " ".join(report["path"] + [""])
        raise StarterError(f"{command.script_name} has sub-commands ({', '.join(report['commands'])}): name one, "
                           f"e.g. autoresearch init -- {shlex.join(command.words)} {prefix}{report['commands'][0]}")
    return report


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# ---- rendering ---------------------------------------------------------------------------------------------

@dataclass
class _Plan:
    """What each option became: searched, fixed, placed in `run`, or a comment."""

    space: list[tuple[str, str, dict]]   # (name, flag, entry)
    fixed: list[tuple[str, str, object, str]]  # (name, flag, value, why)
    placed: list[str]                    # words added to `run` ({checkpoint_dir} outputs)
    notes: list[str]
    seed: str | None
    resume: str | None


def _render(command: _Command, report: dict) -> str:
    hints = _metric_hints(command)
    given = {a.split("=", 1)[0] for a in command.script_args if a.startswith("-")}
    framework = frameworks.detect(report, _source(command), given, hints)
    plan = _plan(report["options"], command.script_args, framework)
    params = [(n, f) for n, f, _ in plan.space] + [(n, f) for n, f, _, _ in plan.fixed]
    plain = all(flag == f"--{name}" for name, flag in params)
    words = [shlex.quote(w) for w in command.words] + plan.placed  # placed words are ours: no quoting
    if framework:
        words += list(framework.placed)
    if plain:
        run = " ".join(words + (["{args}"] if params else []))
    else:
        run = " ".join(words + [f"{flag}={{{name}}}" for name, flag in params])
    metric = framework.metric if framework else hints[0] if hints else "val_loss"
    maximize = re.search(r"acc|f1|auc|score|reward|bleu|precision|recall|return", metric, re.I)
    direction = framework.direction if framework else "maximize" if maximize else "minimize"
    own = " ".join(report["description"].split())  # a sub-command's is the framework's (fit: "Runs the full ...")
    description = (_docstring(command) if report.get("path") else "") or own or _docstring(command) or (
        f"trains with {command.script_name}")
    what = framework.name + " options" if framework else {
        "argparse": "argparse options", "click": "click options", "typer": "typer options"}[report["kind"]]
    if framework and framework.pattern:
        pattern = f"pattern = {_toml(framework.pattern)}  # its printed lines, read when MLflow lacks the metric"
    else:
        pattern = (f"# pattern = 'step (?P<step>\\d+):.* {metric} (?P<value>[0-9.eE+-]+)'  # optional: when its "
                   "lines look different (a value group; a step group for progress)")
    lines = [
        f"# A starter written by `autoresearch init` from {command.script_name}'s {what}.",
        "# Review every line marked `# review`: the ranges are guesses around the defaults, the metric a guess.",
        "# The keys: docs/guides/init-and-sweeps.md. `run` runs in this folder.",
        "",
        "[experiment]",
        f"name = {_toml(command.folder.name)}",
        f"description = {_toml(description)}  # review: what the LLM proposer is told",
        f"run = {_toml(run)}",
        'args = "--{name}={value}"  # how {args} writes each parameter' if plain else
        "# each parameter has its own flag in run (the script's flags are not --NAME)",
        f"metric = {_toml(metric)}  # review: the number your script prints as `{metric}: 0.42` or logs to "
        "MLflow" + (f" (it seems to report: {', '.join(hints)})" if hints and not framework else ""),
        f'direction = "{direction}"  # review: minimize or maximize',
        pattern,
    ]
    if plan.resume and framework:
        lines.append(f"resume = {_toml(plan.resume)}  # added when the job's checkpoint dir is not empty")
    elif plan.resume:
        lines.append(f"# resume = {_toml(plan.resume)}  # review: added when the job's checkpoint dir is not empty")
    if plan.fixed:
        lines.append("fixed = { " + ", ".join(f"{_key(n)} = {_toml(v)}" for n, _, v, _ in plan.fixed) + " }  # "
                     + "; ".join(f"{n}: {why}" for n, _, _, why in plan.fixed))
    if plan.seed:
        lines.append(f"seed = {_toml(plan.seed)}  # the parameter that carries the seed of re-runs")
    lines += ["", "[space]"]
    for name, _, entry in plan.space:
        lines.append(f"{_key(name)} = {{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in entry.items())
                     + " }  # review")
    if not plan.space:
        lines.append("# nothing searchable was found: add parameters here")
    if plan.notes:
        lines += ["", "# Not searched (move into [space] or fixed to use them):"]
        lines += [f"# {note}" for note in plan.notes]
    if framework:
        lines += ["", f"# {framework.name}:"] + [f"# {note}" for note in framework.notes]
    return "\n".join(lines) + "\n"


def _source(command: _Command) -> str:
    """The script's text ("" for a module or an unreadable file)."""
    if command.target[0] == "-m":
        return ""
    try:
        return Path(command.target[0]).read_text(errors="replace")
    except OSError:
        return ""


def _docstring(command: _Command) -> str:
    """The first paragraph of the script's docstring, on one line ("" when it has none)."""
    try:
        text = ast.get_docstring(ast.parse(_source(command))) or ""
    except (SyntaxError, ValueError):
        return ""
    return " ".join(text.split("\n\n")[0].split())


def _metric_hints(command: _Command) -> list[str]:
    """Names the script seems to report (`print(f"val_loss: ...")`, `log_metric("acc", ...)`, Lightning's
    `self.log("val_loss", ...)`), validation first."""
    source = _source(command)
    found: list[str] = []
    for pattern in (r"""print\(\s*f?["']([A-Za-z_][\w./-]*)\s*[:=]""",
                    r"""self\.log\(\s*["']([A-Za-z_][\w./-]*)["']""",
                    r"""log_metrics?\(\s*\{?\s*["']([A-Za-z_][\w./-]*)["']""",
                    r"""\.log\(\s*\{\s*["']([A-Za-z_][\w./-]*)["']"""):
        for name in re.findall(pattern, source):
            if name not in found:
                found.append(name)
    found.sort(key=lambda n: 0 if re.match(r"(val|valid|eval|test)", n) else 1)  # the result, not training's
    return found[:5]


def _flag(option: dict) -> str:
    flags = option["flags"]
    return next((f for f in flags if f.startswith("--")), max(flags, key=len))


def _name(option: dict) -> str:
    """The parameter's name: the long flag as an identifier (`--learning-rate` -> learning_rate)."""
    flag = _flag(option).lstrip("-").replace("-", "_")
    return flag if flag.isidentifier() else option["name"]


def _plan(options: list[dict], args: list[str], framework: frameworks.Framework | None = None) -> _Plan:
    given = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    positional_given = any(not a.startswith("-") for a in args)
    plan = _Plan([], [], [], [], None, framework.resume if framework else None)
    for opt in options:
        if framework and opt["name"] == framework.seed:
            plan.seed = None if any(f in given for f in opt["flags"]) else opt["name"]
            continue
        if framework and not framework.keeps(opt):
            continue  # the framework's own machinery (see experiments.starter_frameworks)
        if framework and opt["name"] in framework.entries and not any(f in given for f in opt["flags"]):
            plan.space.append((_name(opt), _flag(opt), dict(framework.entries[opt["name"]])))
            continue
        if opt["kind"] in ("help", "positional"):
            if opt["kind"] == "positional" and opt["required"] and not positional_given:
                plan.notes.append(f"{opt['name']}: a positional argument; give it in run")
            continue
        flag, name = _flag(opt), _name(opt)
        if _RESUME.match(name) and not framework:
            plan.resume = (f"{flag}=resume" if "resume" in (opt["choices"] or []) else
                           flag if opt["kind"] == "flag" else f"{flag}={{checkpoint_dir}}")
            plan.notes.append(f"{flag}: resuming, see `resume` above")
        elif any(f in given for f in opt["flags"]):
            plan.notes.append(f"{flag}: given in the command, kept in run as given")
        elif _OUTDIR.match(name) and opt["kind"] == "store":
            plan.placed.append(f"{flag}={{checkpoint_dir}}")  # each trial its own folder
        else:
            _classify(plan, opt, name, flag)
    return plan


def _classify(plan: _Plan, opt: dict, name: str, flag: str) -> None:
    kind, default = opt["type"], opt["default"]
    shown = f"{flag} (default {default!r})"
    if opt["kind"] == "flag":
        plan.notes.append(f"{flag}: a flag (default {'on' if opt['negated'] else 'off'}); add it to run to change it")
    elif opt["kind"] != "store":
        plan.notes.append(f"{shown}: takes a list or repeats")
    elif opt["choices"] and len(opt["choices"]) > 1:
        values = list(opt["choices"])
        if default is not None and default not in values:
            plan.notes.append(f"{shown}: its default is not one of its choices {values}")
        else:
            plan.space.append((name, flag, {"type": "choice", "values": values,
                                            "default": values[0] if default is None else default}))
    elif default is None or isinstance(default, str) and kind in ("int", "float"):
        plan.notes.append(f"{flag}: {'required, ' if opt['required'] else ''}no default; add it to run or to "
                          "[space] with a range")
    elif _SEED.match(name) and kind == "int":
        plan.seed = name  # the product gives every trial its seed: never also fixed
    elif kind == "bool" and isinstance(default, bool):
        plan.space.append((name, flag, {"type": "choice", "values": [default, not default], "default": default}))
    elif kind not in ("int", "float") or isinstance(default, bool) or not isinstance(default, (int, float)):
        plan.notes.append(f"{shown}: a path" if kind == "path" else
                          f"{shown}: a {kind.split(':')[-1]}; list values with type = \"choice\" to search it")
    elif _BUDGET.search(name) and "warmup" not in name:
        plan.fixed.append((name, flag, float(default) if kind == "float" else default, "the budget, never searched"))
    elif _INFRA & set(name.lower().split("_")):
        plan.notes.append(f"{shown}: looks like a setting of the run, not of the model")
    else:
        span = opt["range"]
        if span and not span[0] <= default <= span[1] or span and not span[0] < span[1]:
            span = None  # a declared range that misses the default (or is one point) is no range to search
        entry = _int_range(int(default), span) if kind == "int" else _float_range(name, float(default), span)
        plan.space.append((name, flag, entry))


def _int_range(d: int, span) -> dict:
    if span:
        low, high = span
    elif d >= 16 and d & (d - 1) == 0:  # widths and batch sizes: powers of two, on a log scale
        return {"type": "int", "low": d // 4, "high": d * 4, "log": True, "default": d}
    elif d > 0:
        low, high = max(1, d // 2), max(d * 2, d + 2)
    elif d == 0:
        low, high = 0, 10
    else:
        low, high = 2 * d, 0
    return {"type": "int", "low": int(low), "high": int(high), "default": d}


def _float_range(name: str, d: float, span) -> dict:
    if span:
        return {"type": "float", "low": float(span[0]), "high": float(span[1]), "default": d}
    if _BETA.search(name) and 0.5 < d < 1:  # Adam's betas, momentum, EMA decay: near 1, never at or above it
        return {"type": "float", "low": _round(1 - (1 - d) * 2), "high": _round(1 - (1 - d) / 10), "default": d}
    if d > 0 and not (_RATE.search(name) and d < 1):
        return {"type": "float", "low": _round(d / 10), "high": _round(d * 10), "log": True, "default": d}
    if 0 <= d < 1:
        return {"type": "float", "low": 0.0, "high": 0.5 if d <= 0.25 else 0.99 if d < 0.99 else 1.0, "default": d}
    return {"type": "float", "low": _round(2 * d), "high": 0.0, "default": d}  # negative


def _round(x: float) -> float:
    return float(f"{x:.6g}")  # 3e-4/10 is 2.9999999999999997e-05


_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _key(name: str) -> str:
    return name if _BARE.fullmatch(name) else json.dumps(name)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else json.dumps(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)
