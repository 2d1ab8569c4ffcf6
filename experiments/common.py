"""Helpers both bundled experiments share: where their data volume lives, building it exactly once, and the
few pieces of training-loop plumbing (device, determinism, learning-rate schedule) that would otherwise be
copied into every train.py.

Kept free of torch at import time so `prepare.py` can run without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from runtime import protocol

VOLUMES_ENV = "AUTORESEARCH_VOLUMES"
MANIFEST = "MANIFEST.json"


def volume_dir(name: str) -> Path:
    """Where experiment `name` keeps its data: `$AUTORESEARCH_VOLUMES/<name>` when set (e.g. a shared or
    FUSE-mounted volume), else `$AUTORESEARCH_HOME/volumes/<name>`."""
    root = os.environ.get(VOLUMES_ENV)
    if not root:
        root = str(protocol.home_dir() / "volumes")
    return Path(root).expanduser().resolve() / name


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a finished volume at `path`, or None when there is none (missing or half-built)."""
    try:
        return json.loads((path / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def prepare_once(name: str, version: int, build: Callable[[Path], dict[str, Any]],
                 target: Path | None = None) -> Path:
    """Make sure the data volume of experiment `name` exists at `target` (default `volume_dir(name)`) and
    return its path.

    `build(tmp_dir)` writes every file into an empty temporary directory and returns facts for the manifest.
    The manifest is written last and the directory renamed into place, so a reader never sees a half-built
    volume, and a crash mid-build leaves only a temp dir that the next build ignores. A file lock next to the
    volume makes concurrent callers (two jobs starting at once, or every rank of a torchrun job) wait for
    one builder instead of racing. Idempotent: a complete volume of the same `version` is returned as is.
    """
    final = Path(target) if target is not None else volume_dir(name)
    if _is_current(final, version):
        return final  # the common case costs one small file read and no lock
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if _is_current(final, version):
            return final  # someone else built it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
        try:
            facts = build(tmp)
            manifest = {"name": name, "version": version, **facts}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            if final.exists():  # an older version or a leftover without manifest
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _is_current(path: Path, version: int) -> bool:
    manifest = read_manifest(path)
    return manifest is not None and manifest.get("version") == version


# ---------------------------------------------------------------------------------------------------------
# Training-loop plumbing (torch is imported lazily: these run inside jobs only)


def setup_torch(device: Any, seed: int):
    """Seed every RNG, make CPU runs bitwise repeatable, and return an autocast context factory.

    Determinism is what lets a preempted trial resume to the same final metric: on CPU we ask torch for
    deterministic kernels (cheap there). On CUDA we allow TF32 and use bf16 autocast instead, trading exact
    repeatability for speed as GPU users expect.
    """
    import torch

    torch.manual_seed(seed)
    device = torch.device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    # One intra-op thread per CPU job unless OMP_NUM_THREADS says otherwise: `serve --devices cpu:N` runs
    # N jobs side by side on the same cores, and torch's default of a thread per core then oversubscribes
    # them; OpenMP's spinning barriers make that many times slower than one thread each (benchmarks/RESULTS.md).
    # A fixed count also keeps float reductions in the same order on every attempt of a trial.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    # The public torch.use_deterministic_algorithms(True) also imports torch._inductor.config (seconds of
    # import time on a small box) to configure compiled kernels, which these experiments never use.
    set_deterministic = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_deterministic is not None:
        set_deterministic(True)
    else:
        torch.use_deterministic_algorithms(True)
    return contextlib.nullcontext


def lr_at(step: int, total: int, peak: float, warmup: int, schedule: str, floor: float = 0.1) -> float:
    """Learning rate at `step` (0-based) of `total`: linear warmup over `warmup` steps, then cosine, linear or
    constant down to `floor * peak`. A pure function of the step, so a resumed run needs no scheduler state."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (floor + (1.0 - floor) * shape)


def evenly_spaced(total: int, count: int) -> set[int]:
    """`count` step numbers spread over 1..total, always including the last one (for evals and progress)."""
    return {max(1, round(total * (i + 1) / count)) for i in range(count)}


def standalone_checkpoints(ctx: Any, experiment: str, params: dict[str, Any]) -> None:
    """Run by hand (no AUTORESEARCH_CHECKPOINT_DIR), checkpoint under one dir per experiment and params.

    The runtime's by-hand default is one dir per script name, and every experiment's script is `train`: a
    digits run would then try to resume charlm's checkpoint, or a run with new params an old run's. A queued
    job keeps the dir the service gave it (the same for every attempt)."""
    if os.environ.get(protocol.CHECKPOINT_DIR):
        return
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    ctx.checkpoint_dir = Path(ctx.checkpoint_dir).parent / f"{experiment}-{digest}"


def distribute(model: Any, ctx: Any) -> Any:
    """Wrap `model` in DistributedDataParallel when the job runs on several ranks (torchrun), else as is."""
    if ctx.world_size <= 1:
        return model
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device(ctx.device)
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def loader_workers(device: Any) -> int:
    """DataLoader worker processes: decoding runs beside the GPU there; on a small CPU box worker processes
    would only compete with the training threads for the same cores, and the dataset's copy threads already
    fetch ahead."""
    return 2 if str(device).startswith("cuda") else 0


def read_all(dataset: Any, decode: Callable[[str], Any]) -> list[Any]:
    """Every file of a VolumeDataset, decoded, in file order, on every rank (no partitioning): for small
    validation sets that each rank scores whole, so no all-reduce of metrics is needed."""
    from runtime.data import warm

    warm(dataset)  # parallel copies into the cache, then cheap sequential reads
    out = []
    for info in dataset.files:
        with dataset.fetch(info) as pin:
            out.append(decode(pin.path))
    return out


class WithCounters:
    """A data loader plus a few loop counters (running train-loss sums), checkpointed together: TrainState
    carries one `loader` object, and the counters must resume exactly too."""

    def __init__(self, loader: Any, **counters: Any):
        self.loader = loader
        self.counters = dict(counters)

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "counters": dict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.counters.update(state["counters"])


# ---------------------------------------------------------------------------------------------------------
# Population-based training (orchestrator.agent.pbt): a trial that starts from a copy of another's checkpoint,
# a checkpoint at every perturbation interval, and a schedule of mutable params to apply at given steps.

INIT_CHECKPOINT_ENV = "AUTORESEARCH_INIT_CHECKPOINT"  # a checkpoint dir to start from when the job's own is empty
CHECKPOINT_EVERY_ENV = "AUTORESEARCH_CHECKPOINT_EVERY"  # save every N steps (the perturbation interval)
SCHEDULE_ENV = "AUTORESEARCH_SCHEDULE"  # JSON [[step, {param: value}], ...]: params that change at a step


def checkpoint_every(total: int) -> int:
    """Steps between periodic checkpoints: the job's `AUTORESEARCH_CHECKPOINT_EVERY`, else a quarter of the run."""
    every = os.environ.get(CHECKPOINT_EVERY_ENV)
    return max(1, int(every)) if every else max(1, total // 4)


def seed_checkpoint(checkpoint_dir: str | Path) -> bool:
    """Copy the checkpoints of `AUTORESEARCH_INIT_CHECKPOINT` into the job's own dir when that holds none yet (the
    first attempt of a forked trial; later attempts resume from their own). Each step dir is copied under a
    temporary name and renamed, so a copy cut short by a kill is never taken for a checkpoint. True for a job
    that starts from such a copy (whichever attempt)."""
    source = os.environ.get(INIT_CHECKPOINT_ENV)
    target = Path(checkpoint_dir)
    if not source:
        return False
    if any(target.glob("step_*")):
        return True
    target.mkdir(parents=True, exist_ok=True)
    for step_dir in sorted(Path(source).glob("step_*")):
        tmp = target / f".seeding-{step_dir.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(step_dir, tmp)
        os.replace(tmp, target / step_dir.name)
    return True


def schedule() -> list[tuple[int, dict[str, Any]]]:
    """The job's schedule of mutable params (`AUTORESEARCH_SCHEDULE`), by step; [] when it has none."""
    raw = os.environ.get(SCHEDULE_ENV)
    if not raw:
        return []
    return sorted(((int(step), dict(values)) for step, values in json.loads(raw)), key=lambda e: e[0])


def params_at(params: dict[str, Any], plan: list[tuple[int, dict[str, Any]]], step: int) -> dict[str, Any]:
    """`params` with every schedule entry at or before `step` applied (in order)."""
    out = dict(params)
    for at, values in plan:
        if at <= step:
            out.update(values)
    return out


def apply_mutable(model: Any, optimizer: Any, params: dict[str, Any], decay_groups: Any = None) -> None:
    """Set the weight decay of the optimizer's groups that decay (`decay_groups`: their indices; None: all) and
    every dropout's rate from `params`, over what a restored checkpoint brought back; the learning rate is set
    each step from the params, so a restored optimizer's lr never outlives a change."""
    import torch

    for i, group in enumerate(optimizer.param_groups):
        if decay_groups is None or i in decay_groups:
            group["weight_decay"] = params["weight_decay"]
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = params["dropout"]
        elif isinstance(getattr(module, "dropout", None), float):  # attention's dropout_p
            module.dropout = params["dropout"]
