"""Search efficiency: random search against TPE with ASHA, at the same device-time budget, through the real queue.

    python benchmarks/search_efficiency.py [--seeds 5] [--minutes 1.0] [--slots 4] [--step-seconds 0.4]

For each seed, two agent sessions run on the same number of device slots for the same wall-clock budget
(so the same device-time): `random` with no early stopping, and `tpe` with ASHA. Each runs in a fresh
AUTORESEARCH_HOME with its own embedded queue service, real trial processes and a real MLflow store.
Reported: the mean best metric per method, the device-time each needed to reach random search's final best,
and the device utilisation of the sessions. Aims: TPE+ASHA reaches random's best in at most half the
device-time; utilisation at least 95%.

The objective is synthetic on purpose: a digits trial takes 10-50 s on 2 shared CPU cores, and 5 seeds x 2
methods x dozens of trials would take hours. Each trial here is still a real queue job: a process started by the
service that logs a learning curve to MLflow step by step (`--step-seconds` per step) and checkpoints on
SIGTERM, so queueing, start-up (about 2-3 s of Python and MLflow imports per trial, counted as device time),
preemption by demotion and monitoring are all real; only the "training" is a formula: a 6-parameter
landscape with interactions, a categorical choice, seeded noise, and convergence speed that depends on the
learning rate, so early rankings are informative but imperfect.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.registry import ExperimentSpec  # noqa: E402  (light: no torch)
from experiments.space import Categorical, Float, Int, SearchSpace  # noqa: E402

STEPS = 9
SPEC = ExperimentSpec(
    name="synthetic-bench",
    description="A synthetic training curve over a 6-parameter space (benchmark objective).",
    space=SearchSpace({
        "lr": Float(1e-4, 1.0, log=True, default=1e-2),
        "width": Int(8, 512, log=True, default=64),
        "depth": Int(1, 6, default=2),
        "activation": Categorical(("relu", "gelu", "tanh"), default="relu"),
        "dropout": Float(0.0, 0.5, default=0.1),
        "weight_decay": Float(1e-6, 1e-1, log=True, default=1e-4),
        "seed": Int(0, 2**31 - 1, default=0),
        "steps": Int(1, 100, default=STEPS),
    }),
    metric="loss",
    direction="minimize",
    entrypoint="benchmarks.search_efficiency",
    budget={"steps": STEPS},
    progress_metric="loss",
)


def final_loss(p: dict) -> float:
    """Where a configuration converges: a valley around lr 3e-3, width 128, depth 3, with interactions."""
    llr = math.log10(p["lr"]) + 2.5
    lw = math.log2(p["width"]) - 7.0
    lwd = math.log10(p["weight_decay"]) + 3.5
    return (0.5 * llr**2 + 0.08 * lw**2 + 0.12 * (p["depth"] - 3) ** 2 + 0.15 * lwd**2 / (1 + p["dropout"] * 4)
            + {"relu": 0.1, "gelu": 0.0, "tanh": 0.35}[p["activation"]] + 2.0 * (p["dropout"] - 0.15) ** 2
            + 0.1 * max(0.0, llr) * max(0.0, lw))


def loss_at(p: dict, step: int) -> float:
    """The curve: faster convergence with a higher learning rate, plus seeded evaluation noise."""
    speed = 2.0 + 1.5 * math.tanh(math.log10(p["lr"]) + 2.5)
    noise = random.Random(f"{p['seed']}:{step}").gauss(0.0, 0.03)
    return final_loss(p) + 2.5 * math.exp(-speed * step / p["steps"]) + noise


def trial() -> None:
    """One job (Contract 3): resume from the checkpoint, log the curve to MLflow, exit 75 on SIGTERM."""
    import signal

    p = SPEC.space.validate(json.loads(os.environ["AUTORESEARCH_PARAMS"]))
    ckpt = Path(os.environ.get("AUTORESEARCH_CHECKPOINT_DIR") or ".") / "state.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client, run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]), os.environ["MLFLOW_RUN_ID"]
    pace = float(os.environ.get("BENCH_STEP_SECONDS", "1.0"))
    for step in range(start + 1, p["steps"] + 1):
        time.sleep(pace)
        client.log_batch(run, metrics=[Metric("loss", loss_at(p, step), int(time.time() * 1000), step)])
        if stop["flag"] and step < p["steps"]:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_text(json.dumps({"step": step}))
            sys.exit(75)


# -- the benchmark --------------------------------------------------------------------------------------------

def run_session(method: str, seed: int, minutes: float, slots: int) -> dict:
    """`method` is random, tpe (no early stopping) or tpe+asha."""
    """One session in a fresh home; returns its trials' (finish time, value) and device-time accounting."""
    home = Path(tempfile.mkdtemp(prefix=f"bench-{method}-{seed}-"))
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    from orchestrator.agent import runner
    from orchestrator.agent.history import held_intervals
    from orchestrator.agent.session import SessionConfig
    from orchestrator.config import Settings
    from orchestrator.queue.store import JobStore

    config = SessionConfig(goal="minimise the loss", experiment="benchmarks.search_efficiency:SPEC",
                           proposer="random" if method == "random" else "tpe", budget_minutes=minutes,
                           parallel=slots, early_stopping=method.endswith("+asha"), confirm_seeds=0, seed=seed, poll=0.25)
    summary = runner.start(config, settings=Settings.load(), devices=f"cpu:{slots}")
    store = JobStore(Settings.load().db_url)
    jobs = store.list(owner=summary["session"])
    intervals = [iv for j in jobs for iv in held_intervals(store, j)]
    t0 = min(j.submitted_at for j in jobs)
    # The window is the search itself, first submit to the end of the budget; after it, in-flight trials are
    # being cancelled (their device-time still counts toward the totals below, not toward utilisation).
    t1 = min(max(end or time.time() for _, end in intervals), t0 + minutes * 60)
    busy = sum(max(0.0, min(end or t1, t1) - start) for start, end in intervals)
    total = sum((end or time.time()) - start for start, end in intervals)
    from orchestrator.tracking import Tracker

    tracker = Tracker.from_settings(Settings.load())
    done = []
    for j in jobs:
        if j.state == "SUCCEEDED":
            value = tracker.final(j.mlflow_run_id, "loss")
            if value is not None:
                done.append((j.finished_at, value))
    return {"method": method, "seed": seed, "done": sorted(done), "intervals": intervals, "t0": t0, "t1": t1,
            "utilisation": busy / (slots * (t1 - t0)), "trials": len(jobs), "device_s": total,
            "stopped": summary["counts"].get("stopped", 0)}


def device_time_until(session: dict, when: float) -> float:
    """Device-seconds the session had used by wall time `when`."""
    return sum(max(0.0, min(end or when, when) - start) for start, end in session["intervals"])


def time_to_reach(session: dict, level: float) -> float | None:
    """Device-seconds until the session's best first reached `level` (None: never)."""
    for finished, value in session["done"]:
        if value <= level:
            return device_time_until(session, finished)
    return None


def proposer_only(seeds: int, budget: int = 80, batch: int = 4) -> dict[str, list[float]]:
    """The same proposers without the queue: best final loss after 10/20/40/80 trials, mean over seeds.

    Context for the queue figures: it shows how many trials TPE needs before it pulls ahead of random search,
    with no start-up cost, no early stopping and synchronous batches of `batch`.
    """
    from orchestrator.agent.proposers.base import Observation
    from orchestrator.agent.proposers.optuna_ import SamplerProposer
    from orchestrator.agent.search import fixed_params, reduced

    searched = reduced(SPEC, fixed_params(SPEC, {}, 0))
    out = {}
    for kind in ("random", "tpe"):
        curves = []
        for seed in range(seeds):
            proposer, history = SamplerProposer(searched, kind, seed=seed), []
            while len(history) < budget:
                for p in proposer.propose(batch, history):
                    full = SPEC.space.validate({**p.params, "seed": 0, "steps": STEPS})
                    history.append(Observation(p.params, "complete", loss_at(full, STEPS)))
            curves.append([min(o.value for o in history[:k]) for k in (10, 20, 40, 80)])
        out[kind] = [statistics.fmean(c[i] for c in curves) for i in range(4)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--minutes", type=float, default=1.5, help="wall-clock budget per session")
    parser.add_argument("--slots", type=int, default=4, help="cpu:N device slots per session")
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--method", default="tpe+asha", choices=("tpe+asha", "tpe"),
                        help="the method compared with random search (tpe: the ablation without early stopping)")
    args = parser.parse_args()
    os.environ["BENCH_STEP_SECONDS"] = str(args.step_seconds)
    os.environ.pop("OPENAI_API_KEY", None)
    os.environ.pop("OPENAI_BASE_URL", None)
    import logging

    logging.disable(logging.WARNING)
    name = {"tpe+asha": "tpe+ASHA", "tpe": "tpe"}[args.method]
    print(f"search efficiency: random vs {name}, {args.seeds} seeds, {args.minutes:g} min x {args.slots} slots "
          f"= {args.minutes * 60 * args.slots:.0f} device-s per session; synthetic objective through the real "
          f"queue ({STEPS} steps x {args.step_seconds:g} s per trial + process start-up)", flush=True)
    rows = []
    for seed in range(args.seeds):
        rnd = run_session("random", seed, args.minutes, args.slots)
        tpe = run_session(args.method, seed, args.minutes, args.slots)
        r_best = min(v for _, v in rnd["done"])
        t_best = min(v for _, v in tpe["done"])
        r_time = time_to_reach(rnd, r_best)
        t_time = time_to_reach(tpe, r_best)
        rows.append({"seed": seed, "random_best": r_best, "tpe_best": t_best, "random_time": r_time,
                     "tpe_time": t_time, "random_trials": rnd["trials"], "tpe_trials": tpe["trials"],
                     "tpe_stopped": tpe["stopped"], "util_random": rnd["utilisation"],
                     "util_tpe": tpe["utilisation"], "budget": rnd["device_s"]})
        print(f"seed {seed}: random best {r_best:.4f} ({rnd['trials']} trials, reached at {r_time:.0f} device-s) | "
              f"{name} best {t_best:.4f} ({tpe['trials']} trials, {tpe['stopped']} stopped early; reached "
              f"random's best at {'never' if t_time is None else f'{t_time:.0f} device-s'}) | utilisation "
              f"random {rnd['utilisation']:.1%}, tpe {tpe['utilisation']:.1%}", flush=True)
    mean = statistics.fmean
    reached = [r for r in rows if r["tpe_time"] is not None]
    ratios = [r["tpe_time"] / r["random_time"] for r in reached]
    budget = mean([r["budget"] for r in rows])
    print()
    print(f"mean best loss:   random {mean([r['random_best'] for r in rows]):.4f}   "
          f"{name} {mean([r['tpe_best'] for r in rows]):.4f}   (lower is better; optimum about 0.0)")
    print(f"device-time to reach random's final best: random {mean([r['random_time'] for r in rows]):.0f} s, "
          f"{name} {mean([r['tpe_time'] if r['tpe_time'] is not None else budget for r in rows]):.0f} s "
          f"(reached in {len(reached)}/{len(rows)} seeds; unreached counted as the whole budget)")
    if ratios:
        print(f"{name} / random device-time ratio: mean {mean(ratios):.2f}, median {statistics.median(ratios):.2f} "
              f"(aim <= 0.50)")
    util = mean([r["util_tpe"] for r in rows])
    curves = proposer_only(args.seeds)
    print("without the queue (proposers only, batches of 4, no start-up cost): mean best loss after "
          "10/20/40/80 trials: " + "; ".join(f"{k} " + "/".join(f"{v:.3f}" for v in c) for k, c in curves.items()))
    print(f"device utilisation of the agent ({name}) sessions: {util:.1%} (aim >= 95%); "
          f"random sessions {mean([r['util_random'] for r in rows]):.1%}")
    return 0


if __name__ == "__main__":
    if os.environ.get("AUTORESEARCH_JOB_ID") and os.environ.get("AUTORESEARCH_PARAMS"):
        trial()  # started by the queue as one trial
    else:
        sys.exit(main())
