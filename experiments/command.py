"""Writing a config-file experiment's command: its parameters as the script's own options.

    render("python train.py --out={checkpoint_dir} {args}", "--{name}={value}", {"lr": 0.001, "layers": 2},
           checkpoint_dir="/ck/7", job_id=7)
    -> "python train.py --out=/ck/7 --lr=0.001 --layers=2"

Rules: `{args}` writes every parameter (searched and fixed) with the `args` format, except those the template
places itself as `{NAME}`; `{checkpoint_dir}`, `{seed}` and `{job_id}` are the job's own; `{{` and `}}` are
literal braces. A float is always written as a float (`0.0`, `1e-05`: Python's shortest round-trip form), an
int as an int, a bool as `True`/`False`; a value is quoted for the shell only when it needs it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from typing import Any, Mapping

PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
SEED = "seed"


BOOLS = ("True", "False")  # how a bool is written unless the experiment says otherwise (`bools`)


def format_value(value: Any, bools: tuple[str, str] = BOOLS) -> str:
    """A parameter's text on a command line (unquoted); `bools`: the words for True and False."""
    if isinstance(value, bool):
        return bools[0] if value else bools[1]
    if isinstance(value, float):
        return repr(value)  # 0.0, 1e-05, 0.003: always readable back as the same float, never as an int
    return str(value)


def script_params(params: Mapping[str, Any], fixed: Mapping[str, Any], seed_param: str | None) -> dict[str, Any]:
    """The parameters under the script's own names: the seed under `seed_param`, the fixed ones added."""
    out = {}
    for key, value in params.items():
        out[seed_param if key == SEED and seed_param else key] = value
    out.update(fixed)
    return out


def render(run: str, args_format: str, params: Mapping[str, Any], *, checkpoint_dir: str, job_id: Any,
           seed_param: str | None = None, bools: tuple[str, str] = BOOLS) -> str:
    """The shell command of one attempt; `params` are under the script's names (`script_params`)."""
    named = {m.group(1) for m in PLACEHOLDER.finditer(run) if m.group(1)}
    seed_value = params.get(seed_param) if seed_param else None
    if seed_param and SEED in named:
        named.add(seed_param)  # written by {seed}: not again by {args}
    args = " ".join(args_format.replace("{name}", key).replace("{value}", shlex.quote(format_value(value, bools)))
                    for key, value in params.items() if key not in named)
    job = {"args": args, "checkpoint_dir": shlex.quote(str(checkpoint_dir)), "job_id": str(job_id)}
    if seed_value is not None:
        job["seed"] = shlex.quote(format_value(seed_value, bools))

    def fill(m: re.Match[str]) -> str:
        text, name = m.group(0), m.group(1)
        if name is None:
            return text[0]  # `{{` -> `{`, `}}` -> `}`
        if name in job:
            return job[name]
        if name in params:
            return shlex.quote(format_value(params[name], bools))
        return text  # a placeholder with no value (checked when the file was read)

    return PLACEHOLDER.sub(fill, run).strip()


def words(command: str) -> list[tuple[int, int]]:
    """Where each word of `command` starts and ends, as /bin/sh splits them: at whitespace outside quotes,
    escapes, `$(...)` and backquotes (the words' text is left as written)."""
    spans, start, i, depth, quote = [], None, 0, 0, ""
    while i < len(command):
        c = command[i]
        if start is None and not c.isspace():
            start = i
        if quote == "'":
            quote = "" if c == "'" else quote
        elif c == "\\":
            i += 1
        elif quote == '"':
            quote = "" if c == '"' else quote
        elif c in "'\"":
            quote = c
        elif command.startswith("$(", i):
            depth, i = depth + 1, i + 1
        elif c == ")" and depth:
            depth -= 1
        elif c == "`":
            quote = "`" if quote != "`" else ""
        elif c.isspace() and start is not None and not depth:
            spans.append((start, i))
            start = None
        i += 1
    if start is not None:
        spans.append((start, len(command)))
    return spans


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def assignments(command: str) -> tuple[list[str], str]:
    """The command's leading variable assignments (`OMP_NUM_THREADS=1 python ...`), as written, and the rest."""
    spans = words(command)
    k = next((i for i, (a, _) in enumerate(spans) if not _ASSIGNMENT.match(command, a)), len(spans))
    rest = command[spans[k][0]:] if k < len(spans) else ""
    return [command[a:b] for a, b in spans[:k]], rest


def with_interpreter(command: str, python: str) -> str:
    """`python`/`python3` at the head of the command (after its assignments) means the interpreter autoresearch's
    jobs run with."""
    assigned, rest = assignments(command)
    head, sep, tail = rest.partition(" ")
    if head in ("python", "python3"):
        return " ".join([*assigned, shlex.quote(python) + sep + tail])
    return command


def exec_form(command: str) -> str:
    """`exec COMMAND` for a simple command, so the shell becomes the script (a signal and the exit code are the
    script's own, not the shell's); a pipeline or a list (`a && b`) is left to the shell. Leading assignments
    stay in front (`A=1 exec python ...`: the shell exports them to what it execs)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return command
    if any(tok and all(c in "();<>|&" for c in tok) for tok in tokens):
        return command
    assigned, rest = assignments(command)
    if not rest:
        return command
    return " ".join([*assigned, "exec", rest])


_EXPANDS = re.compile(r"[$`*?\[~]")


def expand(command: str, env: dict[str, str], cwd: str | None = None) -> tuple[list[str], dict[str, str]]:
    """A simple command's argv and the variables it assigns, as /bin/sh expands them in `env` (parameters,
    command substitution, quotes, globs, `~`): what a process started without the shell must be given to see
    what one started through it sees. ValueError when it is not a simple command or the shell refuses it."""
    if exec_form(command) == command:
        raise ValueError("not a simple command")
    assigned, rest = assignments(command)
    names = [a.split("=", 1)[0] for a in assigned]
    if not _EXPANDS.search(command):
        return shlex.split(rest), {a.split("=", 1)[0]: shlex.split(a.split("=", 1)[1] or "''")[0] for a in assigned}
    # The shell expands the words first (in the caller's variables), then the assignments, in order.
    script = f"printf '%s\\0' {rest}; " + "".join(f"{a}; " for a in assigned) + (
        "printf '%s\\0' " + " ".join(f'"${n}"' for n in names) if names else ":")
    done = subprocess.run(["/bin/sh", "-c", script], env=env, cwd=cwd, capture_output=True, timeout=60)
    if done.returncode != 0:
        raise ValueError(done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}")
    fields = done.stdout.decode(errors="surrogateescape").split("\0")[:-1]
    values = fields[len(fields) - len(names):] if names else []
    return fields[:len(fields) - len(names)], dict(zip(names, values))


def split(run: str) -> list[str]:
    """The template split as a shell would (ValueError for an unclosed quote)."""
    return shlex.split(PLACEHOLDER.sub("x", run))
