"""A cheap synthetic experiment for agent tests: a noisy 2-D bowl "trained" for a few fast steps.

Run as a real queue job (`python -m tests.agent.synthetic`) following the job protocol: params from
AUTORESEARCH_PARAMS, metrics to MLFLOW_RUN_ID, progress kept in AUTORESEARCH_CHECKPOINT_DIR, SIGTERM ->
save and exit 75 (so a demoted trial resumes where it stopped). STEP_SECONDS sets the pace. It logs
`total_steps` like the bundled experiments, so a run that reached its full budget is known to be complete, and
a holdout (`test_loss`) once at the end, as they do.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

from experiments.registry import ExperimentSpec
from experiments.space import Categorical, Float, Int, SearchSpace

SPEC = ExperimentSpec(
    name="synthetic",
    description="Minimise a noisy bowl centred at x=1.5, y=-2 (kind 'b' is a little better).",
    space=SearchSpace({
        "x": Float(-5.0, 5.0, default=0.0),
        "y": Float(-5.0, 5.0, default=0.0),
        "kind": Categorical(("a", "b"), default="a"),
        "seed": Int(0, 2**31 - 1, default=0),
        "steps": Int(1, 100, default=9),
    }),
    metric="loss",
    direction="minimize",
    entrypoint="tests.agent.synthetic",
    budget={"steps": 9},
    progress_metric="loss",
    holdout_metric="test_loss",
)


def objective(p: dict, step: int, steps: int) -> float:
    """The loss after `step` of `steps`: the bowl's value plus a decaying training term and seeded noise."""
    base = (p["x"] - 1.5) ** 2 + (p["y"] + 2.0) ** 2 + (0.0 if p["kind"] == "b" else 0.3)
    noise = random.Random(f"{p['seed']}:{step}").gauss(0.0, 0.05)
    return base + 2.0 * math.exp(-3.0 * step / steps) + noise


def holdout(p: dict) -> float:
    """The finished "model" scored on held-out data: the bowl again, with its own seeded noise and a small
    offset (HOLDOUT_SHIFT, default 0.1), so it tracks the validation loss without equalling it."""
    base = (p["x"] - 1.5) ** 2 + (p["y"] + 2.0) ** 2 + (0.0 if p["kind"] == "b" else 0.3)
    shift = float(os.environ.get("HOLDOUT_SHIFT", "0.1"))
    return base + shift + random.Random(f"holdout:{p['seed']}").gauss(0.0, 0.05)


def main() -> None:
    params = json.loads(os.environ["AUTORESEARCH_PARAMS"])
    p = SPEC.space.validate(params)
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("SYNTHETIC_RANKS"):  # where each rank of a trial across nodes ran (tests of `start --nodes`)
        record = {"job": os.environ["AUTORESEARCH_JOB_ID"], "rank": rank, "world": os.environ.get("WORLD_SIZE"),
                  "node": os.environ.get("SLURMD_NODENAME")}
        Path(os.environ["SYNTHETIC_RANKS"], f"{record['job']}.{rank}.json").write_text(json.dumps(record))
    if rank != 0:  # rank 0 alone reports, as a data-parallel script does (this toy's ranks never talk: done)
        return
    if p["x"] > 4.5:  # a corner of the space where "training" crashes, as real ones have
        sys.exit(3)
    ckpt = Path(os.environ.get("AUTORESEARCH_CHECKPOINT_DIR") or ".") / "state.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = os.environ["MLFLOW_RUN_ID"]
    if start == 0:  # the full budget, as the bundled experiments log it: the agent knows when a run is complete
        from mlflow.entities import Param

        client.log_batch(run, params=[Param("total_steps", str(p["steps"]))])
    pace = float(os.environ.get("STEP_SECONDS", "0.15"))
    for step in range(start + 1, p["steps"] + 1):
        time.sleep(pace)
        value = objective(p, step, p["steps"])
        client.log_batch(run, metrics=[Metric("loss", value, int(time.time() * 1000), step)])
        if stop["flag"] and step < p["steps"]:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_text(json.dumps({"step": step}))
            sys.exit(75)
    client.log_batch(run, metrics=[Metric("test_loss", holdout(p), int(time.time() * 1000), p["steps"])])


if __name__ == "__main__":
    main()
