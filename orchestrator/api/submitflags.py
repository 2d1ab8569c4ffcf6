"""The flags of `autoresearch submit`, declared once: the typer command (`orchestrator.faces.cli.jobs.submit`) takes
its names, defaults and help from `FLAGS`, and the console script's lean path (`orchestrator.faces.fastcli`) reads
the same flags from argv with `scan` and hands their values to the running service. Both turn the values into a
`JobSpec`'s fields with `spec_options`, so a flag means the same thing on either path.

Light at import time: the lean path imports this module, so it holds only names and the standard library's
`typing`, which that path has imported already; the default of a flag that is a setting's (`--grace`) is read
from `Settings` when asked for.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

Value = Union[str, int, float, bool, None, list[str]]


class Flag:
    """One submit flag. `key` is the typer parameter and the key of its value; `kind` converts a given value
    (bool: a switch that takes none); `repeat` collects every occurrence; `lean`: the lean path reads it itself
    (otherwise a submit using it goes to the full CLI); `setting`: the `Settings` field declaring its default.
    A plain class: building a dataclass or a NamedTuple would cost every lean submit more than its parse."""

    __slots__ = ("name", "key", "kind", "default", "help", "repeat", "lean", "setting", "metavar")

    def __init__(self, name: str, key: str, kind: type, default: Value, help: str, repeat: bool = False,
                 lean: bool = True, setting: Optional[str] = None, metavar: Optional[str] = None):
        self.name, self.key, self.kind, self.default, self.help = name, key, kind, default, help
        self.repeat, self.lean, self.setting, self.metavar = repeat, lean, setting, metavar


FLAGS: tuple[Flag, ...] = (
    Flag("--name", "name", str, "", "A name for people."),
    Flag("--priority", "priority", int, 10, "Higher wins; agent trials use 0."),
    Flag("--gpus", "gpus", str, "1", "Devices the job needs (all at once), or a share of one GPU: 0.5, 0.25, "
         "... (1/k, k up to 16).", metavar="N|SHARE"),
    Flag("--gpu-memory", "gpu_memory", str, None, "GPU memory a job on a share of a GPU needs (10GiB, 512MiB); "
         "default: its share of the device's.", metavar="SIZE"),
    Flag("--nodes", "nodes", int, 1, "Nodes the job runs across, --gpus on each (all at once; the Slurm "
         "executor).", lean=False),
    Flag("--min-nodes", "min_nodes", int, None, "The fewest nodes a multi-node job may start on (default: "
         "--nodes); its checkpoint reshards on load.", lean=False),
    Flag("--max-attempts", "max_attempts", int, 1, "Attempts before the job stays FAILED."),
    Flag("--grace", "grace", float, None, "Seconds between SIGTERM and SIGKILL.", setting="stop_grace"),
    Flag("--no-preempt", "no_preempt", bool, False, "Never preempt this job."),
    Flag("--experiment", "experiment", str, None, "Run an experiment: a bundled name, a folder holding "
         "autoresearch.toml (or its path), or a name used before.", lean=False),
    Flag("--param", "param", str, [], "KEY=VALUE for --experiment (repeatable).", repeat=True, lean=False),
    Flag("--env", "env", str, [], "KEY=VALUE added to the job's environment (repeatable).", repeat=True),
    Flag("--env-file", "env_file", str, None, "A dotenv file of KEY=VALUE lines added to the job's environment "
         "(--env wins); values are never shown.", lean=False),
    Flag("--workdir", "workdir", str, None, "Directory the job runs in (default: here).", lean=False),
    Flag("--image", "image", str, None, "Run the job in this container image (podman, or docker: the "
         "container_engine setting).", lean=False),
    Flag("--mount", "mount", str, [], "SRC:DST[:ro] bind mount for --image (repeatable).", repeat=True, lean=False),
    Flag("--no-track", "no_track", bool, False, "Create no MLflow run for this job."),
    Flag("--time-limit", "time_limit", str, None, "Stop an attempt that runs longer (90s, 5m, 2h): SIGTERM, "
         "SIGKILL after --grace, then FAILED."),
    Flag("--project", "project", str, None, "The project charged for the job (`autoresearch projects`; "
         "default: the default project)."),
    Flag("--scavenger", "scavenger", bool, False, "Use only idle devices; preempted by any job, first; not "
         "charged to the project."),
    Flag("--deadline", "deadline", str, None, "Finish by this time (\"2026-12-03 18:00\", ISO, or 2h): not "
         "started when it can no longer (now + --time-limit)."),
    Flag("--keep-checkpoint", "keep_checkpoint", str, None, "What the job keeps of its checkpoint dir once it "
         "ends: all, latest or none (default: the keep_people setting).", lean=False),
    Flag("--json", "as_json", bool, False, "Print the job as JSON."),
)
BY_NAME: dict[str, Flag] = {flag.name: flag for flag in FLAGS}


def default(flag: Flag) -> Value:
    """A flag's value when not given (a fresh list for a repeatable one)."""
    if flag.setting is not None:
        from orchestrator.core.config import Settings

        return getattr(Settings, flag.setting)
    return list(flag.default) if isinstance(flag.default, list) else flag.default


def defaults() -> dict[str, Value]:
    """Every flag's value when not given, by key."""
    return {flag.key: default(flag) for flag in FLAGS}


def scan(args: list[str]) -> Optional[tuple[list[str], dict[str, Value]]]:
    """(command, values by key of the flags given) of `submit ARGS` when every option before the command is a
    lean flag given well, else None: the full CLI then handles it (experiments, --help, unknown or malformed
    options, where typer gives its usual message). The command starts at `--` or at the first word that is not an
    option."""
    values: dict[str, Value] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return args[i + 1:], values
        if not arg.startswith("-"):
            return args[i:], values  # no interspersed options, as the typer command
        flag = BY_NAME.get(arg)
        if flag is None or not flag.lean:
            return None
        if flag.kind is bool:
            values[flag.key] = True
            i += 1
            continue
        if i + 1 >= len(args):
            return None
        try:
            value = flag.kind(args[i + 1])
        except ValueError:
            return None
        if flag.repeat:
            values[flag.key] = [*values.get(flag.key, []), value]  # type: ignore[misc]
        else:
            values[flag.key] = value
        i += 2
    return [], values


def spec_options(values: Mapping[str, Value]) -> dict[str, object]:
    """The `JobSpec` fields (all but the command) that submit's flag values stand for; the flags not given take
    their defaults. BadInput for values no job may have (a scavenger that may not be preempted, a malformed
    --time-limit, --deadline or --env). `--experiment`, `--param` and `--json` are the caller's business."""
    from orchestrator.api.jobs import parse_params
    from orchestrator.api.sharing import parse_deadline
    from orchestrator.core.durations import parse_duration
    from orchestrator.core.gpushare import parse_gpus, parse_size
    from orchestrator.queue.plantypes import check_preemptible

    v = {**defaults(), **values}
    gpus, share = parse_gpus(v["gpus"])
    check_preemptible(not v["no_preempt"], v["scavenger"])
    return dict(project=v["project"] or "default", scavenger=bool(v["scavenger"]),
                deadline=None if v["deadline"] is None else parse_deadline(v["deadline"]),
                name=v["name"], priority=v["priority"], gpus=gpus, gpu_share=share,
                gpu_memory=None if v["gpu_memory"] is None else parse_size(v["gpu_memory"]),
                max_attempts=v["max_attempts"], nodes=v["nodes"], min_nodes=v["min_nodes"],
                grace=v["grace"], preemptible=not v["no_preempt"], env=parse_params(list(v["env"] or [])),
                track=not v["no_track"], env_file=v["env_file"], cwd=v["workdir"], image=v["image"],
                mounts=list(v["mount"] or []) or None, keep_checkpoint=v["keep_checkpoint"],
                time_limit=None if v["time_limit"] is None else parse_duration(str(v["time_limit"]),
                                                                               what="--time-limit"))
