"""Config-file experiments against Python specs: the same search on digits declared both ways.

    python benchmarks/own_experiment.py [--trials 6] [--epochs 1] [--slots 2] [--rounds 1] [--proposer random]

One side is an `ExperimentSpec` in Python (digits' own entry point, params in AUTORESEARCH_PARAMS); the other is
an `autoresearch.toml` in a temporary folder running `python -m experiments.digits.train {args}` through the
config-file job wrapper (the command filled in when the attempt starts, output lines read, the metric still
logged to MLflow by digits itself). Both search the same five parameters with the same sampler seed and the
same session id (so the same confirmation seeds); the random sampler's draws do not depend on how trials
finish, so both sides propose the same trials, and digits is deterministic on CPU, so both must reach the same
values and verdict (TPE's proposals depend on which trials have finished when it is asked, a matter of timing).
Each session runs in a fresh AUTORESEARCH_HOME with its own embedded service (`--slots` cpu slots); the digits
volume is built once beforehand. Reported: each side's verdict and device-seconds, and the ratio toml/python
(aim: at most 1.05); `--rounds N` alternates the order N times and reports the median ratio. First, the
wrapper's own cost per attempt: a trivial script started directly and through the wrapper, `--starts` times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOML = """
[experiment]
name = "digits-toml"
description = "digits, declared in a config file"
run = "python -m experiments.digits.train {{args}}"
metric = "val_accuracy"
direction = "maximize"
fixed = {{ epochs = {epochs} }}
seed = "seed"

[space]
lr = {{ type = "float", low = 1e-4, high = 0.1, log = true, default = 3e-3 }}
dropout = {{ type = "float", low = 0.0, high = 0.5, default = 0.1 }}
weight_decay = {{ type = "float", low = 0.0, high = 0.1, default = 1e-4 }}
batch_size = {{ type = "int", low = 16, high = 256, log = true, default = 64 }}
activation = {{ type = "choice", values = ["relu", "gelu", "silu", "tanh"], default = "relu" }}
"""


def python_spec(epochs: int):
    """The same experiment as a Python `ExperimentSpec` (the bundled way)."""
    from experiments.registry import ExperimentSpec
    from experiments.space import Categorical, Float, Int, SearchSpace

    return ExperimentSpec(
        name="digits-py", description="digits, declared in Python",
        space=SearchSpace({"lr": Float(1e-4, 0.1, log=True, default=3e-3), "dropout": Float(0.0, 0.5, default=0.1),
                           "weight_decay": Float(0.0, 0.1, default=1e-4),
                           "batch_size": Int(16, 256, log=True, default=64),
                           "activation": Categorical(("relu", "gelu", "silu", "tanh"), default="relu"),
                           "epochs": Int(1, 200, default=epochs), "seed": Int(0, 2**31 - 1, default=0)}),
        metric="val_accuracy", direction="maximize", entrypoint="experiments.digits.train",
        budget={"epochs": epochs}, progress_metric="val_accuracy")


def session(side: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One full agent session in a fresh home; returns its summary and wall time."""
    home = Path(tempfile.mkdtemp(prefix=f"own-{side}-", dir=workdir))
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig

    if side == "toml":
        folder = workdir / "digits-toml"
        folder.mkdir(exist_ok=True)
        (folder / "autoresearch.toml").write_text(textwrap.dedent(TOML.format(epochs=args.epochs)))
        experiment = str(folder)
    else:
        module = workdir / "own_python_spec.py"
        module.write_text("from benchmarks.own_experiment import python_spec\n"
                          f"SPEC = python_spec({args.epochs})\n")
        sys.path.insert(0, str(workdir))
        experiment = "own_python_spec:SPEC"
    config = SessionConfig(goal="raise val_accuracy", experiment=experiment, proposer=args.proposer,
                           trials=args.trials,
                           parallel=args.slots, poll=0.2, baseline_seeds=2, confirm_seeds=2, confirm_top=1,
                           early_stopping=False)
    start = time.time()
    summary = runner.start(config, devices=f"cpu:{args.slots}", session_id="s-0own0exp")
    return {"summary": summary, "wall": time.time() - start}


def wrapper_overhead(starts: int) -> None:
    """Seconds per start of a trivial script, directly and through the config-file job wrapper."""
    import json
    import subprocess

    from experiments.config_file import from_dict

    spec = from_dict({"experiment": {"run": "python -c pass", "metric": "m", "direction": "minimize"}},
                     folder=tempfile.mkdtemp())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTORESEARCH_PARAMS": json.dumps({})}
    env.pop("MLFLOW_RUN_ID", None)
    times = {}
    for side, argv in (("direct", [sys.executable, "-c", "pass"]), ("wrapper", spec.argv())):
        t = time.perf_counter()
        for _ in range(starts):
            subprocess.run(argv, env={**env, "AUTORESEARCH_CHECKPOINT_DIR": tempfile.mkdtemp()}, cwd=spec.cwd,
                           stdout=subprocess.DEVNULL, check=side == "direct")
        times[side] = (time.perf_counter() - t) / starts
    print(f"per attempt: direct {times['direct'] * 1000:.0f} ms, through the wrapper {times['wrapper'] * 1000:.0f} ms"
          f" (+{(times['wrapper'] - times['direct']) * 1000:.0f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--proposer", default="random")
    parser.add_argument("--starts", type=int, default=20)
    args = parser.parse_args()
    wrapper_overhead(args.starts)
    workdir = Path(tempfile.mkdtemp(prefix="own-experiment-"))
    os.environ["AUTORESEARCH_VOLUMES"] = str(workdir / "volumes")
    from experiments.digits import prepare

    prepare.ensure()  # once, outside both sides' time
    ratios = []
    for r in range(args.rounds):
        results = {}
        for side in (("python", "toml") if r % 2 == 0 else ("toml", "python")):
            results[side] = session(side, args, workdir)
        py, tm = results["python"]["summary"], results["toml"]["summary"]
        same_values = sorted(t for t in _values(py)) == sorted(t for t in _values(tm))
        ratio = tm["device_seconds"] / py["device_seconds"]
        ratios.append(ratio)
        for side, res in results.items():
            s = res["summary"]
            print(f"round {r + 1} {side:6s}: {s['trials']} trials, {s['device_seconds']:.1f} device-s, "
                  f"{res['wall']:.1f} s wall; verdict: {s['headline']}")
        print(f"round {r + 1}: same verdict: {py['headline'] == tm['headline']}; same values: {same_values}; "
              f"device time toml/python: {ratio:.3f}x")
    print(f"median device time ratio toml/python over {len(ratios)} round(s): {statistics.median(ratios):.3f}x "
          "(aim <= 1.05)")


def _values(summary: dict) -> list[float]:
    return [round(v, 6) for e in summary["ranking"] for v in e["values"]]


if __name__ == "__main__":
    main()
