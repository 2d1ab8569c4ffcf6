"""Run a training script only until it builds its command-line parser, and write the parser's options as JSON.

Run as a file by `experiments.starter`, with the script's own interpreter (standard library only, so it works in
any environment that runs the script):

    python starter_probe.py OUT.json SCRIPT.py|-m MODULE [SCRIPT ARGS...]

argparse's `parse_known_args` (which `parse_args` calls), click's `Command.main` and typer's `Typer.__call__`
are replaced before the script starts; the first call writes the parser's options to OUT.json and ends the
process with `os._exit(0)`, so nothing after the parse (no training, no `finally`, no atexit) runs. A sub-command
named in SCRIPT ARGS is followed (its own options are the ones {args} can reach). A script that ends without
parsing leaves no OUT.json.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import runpy
import sys

_OUT = sys.argv[1] if __name__ == "__main__" else ""
_ARGS: list[str] = []


def _jsonable(value):
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return str(value)


def _finish(report: dict) -> None:
    with open(_OUT, "w") as fh:
        json.dump(report, fh)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a script may have replaced or closed them
            pass
    os._exit(0)


def _first_word(args: list[str]):
    """The first argument that is not an option (a sub-command's name), or None."""
    return next((a for a in args if not a.startswith("-")), None)


# ---- argparse ----------------------------------------------------------------------------------------------

def _argparse_type(action: argparse.Action) -> str:
    kind = action.type
    if kind in (int, float, str, bool):
        return kind.__name__
    if kind is None:
        default = action.default
        return type(default).__name__ if isinstance(default, (bool, int, float)) else "str"
    name = getattr(kind, "__name__", type(kind).__name__).lower()
    if "bool" in name:
        return "bool"  # str2bool and its kin
    if "path" in name or isinstance(kind, argparse.FileType):
        return "path"
    return "other:" + getattr(kind, "__name__", type(kind).__name__)


def _argparse_action(action: argparse.Action) -> dict:
    kinds = {argparse._StoreAction: "store", argparse._StoreTrueAction: "flag", argparse._StoreFalseAction: "flag",
             argparse._CountAction: "multi", argparse._AppendAction: "multi", argparse._ExtendAction: "multi",
             argparse._StoreConstAction: "const", argparse._AppendConstAction: "multi",
             argparse._HelpAction: "help", argparse._VersionAction: "help"}
    kind = kinds.get(type(action), "other")
    if getattr(argparse, "BooleanOptionalAction", None) and isinstance(action, argparse.BooleanOptionalAction):
        kind = "flag"
    if type(action).__name__ == "ActionTypeHint" and action.nargs in (None, "?"):
        kind = "store"  # jsonargparse's typed option (`--model.lr`), read from its type hint
    if kind == "store" and action.nargs not in (None, "?", 1):
        kind = "multi"
    if not action.option_strings and kind != "help":
        kind = "positional"
    default = action.default
    if isinstance(default, str) and action.type in (int, float):
        try:  # argparse applies `type` to a string default
            default = action.type(default)
        except ValueError:
            pass
    choices = action.choices
    span = None
    if isinstance(choices, range) and choices.step == 1 and len(choices) > 1:
        span, choices = [choices.start, choices.stop - 1], None
    return {
        "name": action.dest, "flags": list(action.option_strings), "kind": kind, "type": _argparse_type(action),
        "default": None if default is argparse.SUPPRESS else _jsonable(default),
        "choices": None if choices is None else [_jsonable(c) for c in choices], "range": span,
        "required": bool(action.required), "help": action.help if isinstance(action.help, str) else "",
        "negated": isinstance(action, argparse._StoreFalseAction),
    }


def _argparse_report(parser: argparse.ArgumentParser, args: list[str]) -> dict:
    path = []
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            break
        word = _first_word(args)
        if word not in sub.choices:
            return {"error": "sub-commands", "commands": sorted(sub.choices), "path": path}
        path.append(word)
        args = args[args.index(word) + 1:]
        parser = sub.choices[word]
    return {"kind": "argparse", "framework": _framework(parser), "description": parser.description or "",
            "path": path, "options": [dict(_argparse_action(a), group=_group(parser, a)) for a in parser._actions]}


def _framework(parser: argparse.ArgumentParser) -> str:
    """The library that built the parser: "transformers" (HfArgumentParser), "lightning" (LightningCLI's
    jsonargparse), "jsonargparse", or "" for argparse itself."""
    if hasattr(parser, "dataclass_types"):
        return "transformers"
    if any(c.__module__.startswith("jsonargparse") for c in type(parser).__mro__):
        return "lightning" if "lightning.pytorch.cli" in sys.modules or "pytorch_lightning.cli" in sys.modules \
            else "jsonargparse"
    return ""


def _group(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """For an HfArgumentParser: "trainer" for an option of TrainingArguments (or a subclass), else the name of
    the user's dataclass that declares it; "" otherwise."""
    for kind in getattr(parser, "dataclass_types", ()) or ():
        if action.dest in getattr(kind, "__dataclass_fields__", {}):
            names = [c.__name__ for c in getattr(kind, "__mro__", ())]
            return "trainer" if "TrainingArguments" in names else kind.__name__
    return ""


_original_parse_known_args = argparse.ArgumentParser.parse_known_args


def _parse_known_args(self, args=None, namespace=None):
    _finish(_argparse_report(self, list(sys.argv[1:] if args is None else args)))
    return _original_parse_known_args(self, args, namespace)  # pragma: no cover - _finish never returns


# ---- click and typer (duck-typed: typer >= 0.16 ships its own copy of click) ----------------------------------

def _annotation_type(param) -> tuple[str, list | None, list | None]:
    """typer >= 0.2x keeps the Python annotation, not a click type."""
    kind = param.type_descriptor.annotation
    args = [a for a in getattr(kind, "__args__", ()) if a is not type(None)]
    kind = args[0] if len(args) == 1 else kind  # Optional[int]
    lo, hi = getattr(param, "min", None), getattr(param, "max", None)
    span = [lo, hi] if lo is not None and hi is not None else None
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "str", [_jsonable(m) for m in kind], None
    if kind in (bool, int, float, str):
        return kind.__name__, None, span if kind in (int, float) else None
    name = getattr(kind, "__name__", str(kind))
    return ("path" if "path" in name.lower() else "other:" + name), None, None


def _click_type(param) -> tuple[str, list | None, list | None]:
    if not hasattr(param, "type") and hasattr(param, "type_descriptor"):
        return _annotation_type(param)
    kind = getattr(param, "type", None)
    name = getattr(kind, "name", "")
    choices = getattr(kind, "choices", None)
    if choices is not None:
        return "str", [_jsonable(c) for c in choices], None
    lo, hi = getattr(kind, "min", None), getattr(kind, "max", None)
    span = [lo, hi] if lo is not None and hi is not None else None
    if name in ("integer", "integer range"):
        return "int", None, span
    if name in ("float", "float range"):
        return "float", None, span
    if name == "boolean":
        return "bool", None, None
    if name in ("path", "filename", "file"):
        return "path", None, None
    return ("str" if name in ("text", "") else "other:" + name), None, None


def _click_param(param) -> dict:
    kind, choices, span = _click_type(param)
    default = getattr(param, "default", None)
    if callable(default):
        default = None
    opts = list(getattr(param, "opts", []))
    is_option = type(param).__name__.endswith("Option") or any(o.startswith("-") for o in opts)
    if not is_option:
        shape = "positional"
    elif getattr(param, "is_flag", False) or getattr(param, "count", False):
        shape = "flag" if getattr(param, "is_flag", False) else "multi"
    elif getattr(param, "multiple", False) or getattr(param, "nargs", 1) != 1:
        shape = "multi"
    else:
        shape = "store"
    if (getattr(param, "hidden", False) or not getattr(param, "expose_value", True)
            or getattr(param, "is_eager", False) and shape == "flag"):
        shape = "help"  # --help, --version, --install-completion
    return {"name": param.name, "flags": [o for o in opts if o.startswith("-")], "kind": shape, "type": kind,
            "default": _jsonable(default), "choices": choices, "range": span,
            "required": bool(getattr(param, "required", False)), "help": getattr(param, "help", None) or "",
            "negated": False}


def _click_report(command, args: list[str], kind: str = "click") -> dict:
    path = []
    while hasattr(command, "commands") and getattr(command, "commands", None):
        word = _first_word(args)
        if word not in command.commands:
            return {"error": "sub-commands", "commands": sorted(command.commands), "path": path}
        path.append(word)
        args = args[args.index(word) + 1:]
        command = command.commands[word]
    return {"kind": kind, "description": (getattr(command, "help", None) or "").strip().split("\n\n")[0],
            "path": path, "options": [_click_param(p) for p in command.params]}


def _patch_click() -> None:
    try:
        import click.core
    except ImportError:
        return

    def main(self, args=None, *rest, **kwargs):
        _finish(_click_report(self, list(sys.argv[1:] if args is None else args)))

    click.core.Command.main = main  # Group inherits it


def _patch_typer() -> None:
    try:
        import typer.main
    except ImportError:
        return

    def call(self, *args, **kwargs):
        _finish(_click_report(typer.main.get_command(self), list(sys.argv[1:]), "typer"))

    typer.main.Typer.__call__ = call


def _patch_jsonargparse() -> None:
    """jsonargparse (LightningCLI's parser) parses without argparse's `parse_known_args`: stop at its own."""
    try:
        import jsonargparse
    except ImportError:
        return

    def parse_args(self, args=None, *rest, **kwargs):
        _finish(_argparse_report(self, list(sys.argv[1:] if args is None else args)))

    jsonargparse.ArgumentParser.parse_args = parse_args


def main() -> None:
    """Patch the parsers, then run the script as `python SCRIPT ARGS` or `python -m MODULE ARGS` would."""
    target, args = sys.argv[2], sys.argv[3:]
    argparse.ArgumentParser.parse_known_args = _parse_known_args
    _patch_jsonargparse()
    _patch_click()
    _patch_typer()
    if target == "-m":
        module, args = args[0], args[1:]
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # not this probe's folder
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
