"""How `--help` labels parameters: the click command tree of the typer app, with plain labels.

Typer labels every parameter with its Python annotation (`--help <bool>`, `--param <list[str]>`, `argv
<list[str]>`), even flags, which take no value. `command()` builds the click command once and gives each
parameter the label a reader expects instead: none for a flag, the option's own metavar when it has one, else
a click-style word for its type (`INTEGER`, `FLOAT`, `TEXT`, `PATH`, `a|b` for choices); arguments are
named in capitals (`ID`, `ARGV`) and carry no type label, as in click. The console script, the help test and
the CLI reference all use this one tree, so what they show is the same.
"""

from __future__ import annotations

import enum
import pathlib
from typing import Any, Iterator, Optional, get_args, get_origin

import typer

_WORDS = {bool: "BOOLEAN", int: "INTEGER", float: "FLOAT", str: "TEXT", pathlib.PurePath: "PATH"}  # bool before int


def command(app: typer.Typer) -> Any:
    """The click command of `app` with every parameter's help label made plain (see the module docstring)."""
    root = typer.main.get_command(app)
    for _, cmd in walk(root):
        # The help option is made on first use and then cached on the command: make it now to label it too.
        cmd.get_help_option(cmd.context_class(cmd))
        for param in [*cmd.params, getattr(cmd, "_help_option", None)]:
            if param is not None:
                _relabel(param)
    return root


def walk(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command under `cmd` (itself first) with its path of sub-command names, in registration order.
    Commands are typer's (its own copy of click), so groups are told by their `commands`, not by class."""
    yield path, cmd
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        yield from walk(sub, path + (name,))


def _relabel(param: Any) -> None:
    if param.param_type_name == "argument":
        if param.metavar is None and param.name:
            param.metavar = param.name.upper()
        label = None
    elif getattr(param, "is_flag", False) or getattr(param, "count", False):
        label = None
    elif param.metavar is not None:
        label = param.metavar
    else:
        label = _type_word(param)
    # Typer asks this method for the label in its rich and its plain help; an instance attribute answers first.
    param.display_type_rich = lambda ctx, label=label: label  # type: ignore[method-assign]


def _type_word(param: Any) -> str:
    descriptor = getattr(param, "type_descriptor", None)
    annotation: Any = getattr(descriptor, "annotation", None)
    if get_origin(annotation) in (list, tuple):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        annotation = args[0] if args else str
    choices = getattr(descriptor, "choices", None) if getattr(descriptor, "is_choice", False) else None
    if choices:
        return "|".join(str(c.value if isinstance(c, enum.Enum) else c) for c in choices)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "|".join(str(m.value) for m in annotation)
    return _word(annotation) or param.type.name.upper()


def _word(annotation: Any) -> Optional[str]:
    if isinstance(annotation, type):
        for kind, word in _WORDS.items():
            if issubclass(annotation, kind):
                return word
    return None
