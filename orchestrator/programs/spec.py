"""A program's `autoresearch.toml`: what the agent may edit, what it must not touch, how to run and read it.

    [program]
    edit = ["train.py"]            # the only files the agent may change
    protected = ["prepare.py"]     # data and evaluation: restored and read-only in every run
    run = "python train.py"
    metric = "val_bpb"
    direction = "minimize"
    time_limit = "5m"

Optional keys (extensions of the program format): `pattern` (the output line regex, `{metric}` filled in; default
`^{metric}:\\s*<number>`), `repeats` (runs per commit for the noise gate, default 3), `max_debug` (debug
attempts per crashed trial, default 2), `max_edit_chars` (size limit of one proposal's replacement text),
`max_failures` and `patience` (the governor's limits), `image` (a container image every run uses, pinned to its
content id when the run is queued and recorded on the run; it needs python3 and autoresearch installed).

The holdout (data no search decision reads):

    holdout = ["data/test.txt"]          # files no search run can read (untracked: git must not hold them)
    holdout_eval = "python evaluate.py"  # run once at the end on the kept commit (list evaluate.py in protected)
    holdout_metric = "test_bpb"          # the line it prints (default: metric)

Holdout files must be untracked (git-ignored): a trial's worktree is made from a commit, so they are never in
it, and no run can read them from the repository's objects. Under `--sandbox` they are also hidden where they
lie (bound over with an empty file or directory). The evaluation job runs `holdout_eval` in a worktree of the
commit with the protected files restored and the holdout files copied in, with `AUTORESEARCH_OUTPUT_DIR`
naming the commit's first run's checkpoint directory (its output).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from orchestrator.core.direction import Direction
from orchestrator.core.durations import parse_duration
from orchestrator.core.errors import BadInput

# One output-line reader for programs and config-file experiments.
from orchestrator.core.metriclines import DEFAULT_PATTERN, NUMBER, compile_pattern  # noqa: F401

CONFIG = "autoresearch.toml"


def _relpath(name: object, key: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise BadInput(f"{CONFIG}: every entry of {key} must be a non-empty file name")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise BadInput(f"{CONFIG}: {key} entry {name!r} must be a path inside the program")
    return path.as_posix()


@dataclass(frozen=True)
class ProgramSpec:
    """A validated program: its folder, its repository, and the `[program]` settings."""

    root: Path  # the program's folder (where autoresearch.toml is; the job's cwd inside a worktree)
    repo: Path  # the git repository's top level
    prefix: str  # root relative to repo ("" when the program is the whole repository)
    name: str
    edit: tuple[str, ...]
    protected: tuple[str, ...]
    run: str
    metric: str
    direction: Direction = Direction.MINIMIZE
    time_limit: float = 300.0
    pattern: str = DEFAULT_PATTERN
    repeats: int = 3
    max_debug: int = 2
    max_edit_chars: int = 20_000
    max_failures: int = 5
    patience: int = 20
    image: str | None = None  # a container image every run uses (it needs autoresearch installed inside)
    holdout: tuple[str, ...] = ()  # files no search run can read (untracked)
    holdout_eval: str | None = None  # the evaluation command run on the kept commit at the end
    holdout_metric: str | None = None  # what it prints (default: metric)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "direction", Direction.of(self.direction))
        except ValueError as exc:
            raise BadInput(f"{CONFIG}: {exc}") from None
        if not re.fullmatch(r"[A-Za-z0-9_.\-/ ]{1,250}", self.metric):
            raise BadInput(f"{CONFIG}: metric {self.metric!r} is not a valid MLflow metric name")
        overlap = set(self.edit) & set(self.protected)
        if overlap:
            raise BadInput(f"{CONFIG}: {sorted(overlap)[0]} is both editable and protected")
        seen = set(self.holdout) & (set(self.edit) | set(self.protected))
        if seen:
            raise BadInput(f"{CONFIG}: {sorted(seen)[0]} is a holdout file and also editable or protected")
        if not self.edit:
            raise BadInput(f"{CONFIG}: edit must name at least one file")
        if not self.argv:
            raise BadInput(f"{CONFIG}: run must be a command, e.g. \"python train.py\"")
        try:
            self.line_regex()
        except re.error as exc:
            raise BadInput(f"{CONFIG}: bad pattern: {exc}") from None
        for key in ("repeats", "max_debug", "max_edit_chars", "max_failures", "patience"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "max_debug" else 1):
                raise BadInput(f"{CONFIG}: {key} must be a positive integer, got {value!r}")

    @property
    def argv(self) -> list[str]:
        """The run command as an argv (no shell: the command line is split like a shell would)."""
        try:
            return shlex.split(self.run)
        except ValueError as exc:
            raise BadInput(f"{CONFIG}: run: {exc}") from None

    @property
    def eval_argv(self) -> list[str]:
        """The holdout evaluation command as an argv ([] when there is none)."""
        try:
            return shlex.split(self.holdout_eval or "")
        except ValueError as exc:
            raise BadInput(f"{CONFIG}: holdout_eval: {exc}") from None

    @property
    def eval_metric(self) -> str:
        """The metric the holdout evaluation prints."""
        return self.holdout_metric or self.metric

    def line_regex(self) -> re.Pattern[str]:
        """The metric line pattern with the metric name filled in."""
        return re.compile(compile_pattern(self.pattern, self.metric).pattern, re.MULTILINE)

    def better(self, a: float, b: float) -> bool:
        """Whether metric value `a` beats `b` in this program's direction."""
        return self.direction.better(a, b)

    def repo_path(self, file: str) -> str:
        """A program-relative file name as a path in the repository."""
        return f"{self.prefix}/{file}" if self.prefix else file


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise BadInput(f"{cwd} is not inside a git repository (a program must be one): "
                       f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'git failed'}")
    return out.stdout.strip()


def load(directory: str | Path) -> ProgramSpec:
    """The program in `directory` (BadInput with a one-line reason for anything wrong)."""
    root = Path(directory).expanduser().resolve()
    if not root.is_dir():
        raise BadInput(f"--program {directory}: no such directory")
    path = root / CONFIG
    if not path.is_file():
        raise BadInput(f"--program {directory}: no {CONFIG} in it")
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: {exc}") from None
    section = data.get("program")
    if not isinstance(section, dict):
        raise BadInput(f"{path}: no [program] table")
    known = {"edit", "protected", "run", "metric", "direction", "time_limit", "pattern", "repeats", "max_debug",
             "max_edit_chars", "max_failures", "patience", "name", "image", "holdout", "holdout_eval",
             "holdout_metric"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise BadInput(f"{path}: unknown key {unknown[0]!r} in [program]")
    for key in ("edit", "run", "metric"):
        if key not in section:
            raise BadInput(f"{path}: [program] needs {key!r}")
    for key in ("edit", "protected", "holdout"):
        if not isinstance(section.get(key, []), list):
            raise BadInput(f"{path}: {key} must be a list of file names")
    if not isinstance(section["run"], str) or not isinstance(section["metric"], str):
        raise BadInput(f"{path}: run and metric must be strings")
    repo = Path(_git(root, "rev-parse", "--show-toplevel")).resolve()
    prefix = root.relative_to(repo).as_posix()
    edit = tuple(_relpath(x, "edit") for x in section["edit"])
    protected = tuple(_relpath(x, "protected") for x in section.get("protected", []))
    for name in edit + protected:
        if not (root / name).is_file():
            raise BadInput(f"{path}: {name} does not exist in the program")
    holdout = tuple(_relpath(x, "holdout") for x in section.get("holdout", []))
    for name in holdout:
        if name in edit + protected:
            raise BadInput(f"{path}: {name} is a holdout file and also editable or protected")
        if not (root / name).exists():
            raise BadInput(f"{path}: holdout {name} does not exist in the program")
        if _git(root, "ls-files", "--", name):
            raise BadInput(f"{path}: holdout {name} is tracked by git, so every trial's worktree (and the "
                           f"repository's objects) would hold it: `git rm --cached {name}` and ignore it")
    for key in ("holdout_eval", "holdout_metric"):
        if not isinstance(section.get(key, ""), str):
            raise BadInput(f"{path}: {key} must be a string")
    if not isinstance(section.get("image", ""), str):
        raise BadInput(f"{path}: image must be a string, e.g. \"localhost/train:1\"")
    if section.get("image"):  # refused now, not at the first run: an unknown image or no engine
        from orchestrator.executors import container

        container.resolve_image(container.engine_name(), section["image"])
    extra = {k: section[k] for k in ("image", "pattern", "repeats", "max_debug", "max_edit_chars", "max_failures",
                                     "patience", "direction", "holdout_eval", "holdout_metric") if k in section}
    return ProgramSpec(root=root, repo=repo, prefix="" if prefix == "." else prefix,
                       name=str(section.get("name") or root.name), edit=edit, protected=protected, holdout=holdout,
                       run=section["run"], metric=section["metric"],
                       time_limit=parse_duration(section.get("time_limit", "5m"), what="time_limit"), **extra)
