"""Search efficiency: does each proposer find a real improvement over the baseline, and at what device cost?

    python benchmarks/search_efficiency.py [--seeds 10] [--trials 16] [--proposers random,tpe,cmaes]
                                           [--experiment synthetic|digits] [--slots 2] [--step-seconds 0.3]
    python benchmarks/search_efficiency.py --experiment digits --proposers tpe --trials 14 --minutes 3 \
        --baseline-seeds 5 --confirm-top 1 --no-queue-section  # the demo

Each (proposer, seed) is one full agent session through the real queue, in a fresh AUTORESEARCH_HOME with its
own embedded service, real trial processes and a real MLflow store, exactly as `autoresearch start` runs it:
the baseline (the experiment's defaults) on `--baseline-seeds` seeds (3) first, then `--trials` trials (search,
ASHA, and the top `--confirm-top` candidates (2) re-run on three fresh seeds each), then the noise gate against the
baseline (Welch's t-test on the fresh re-runs only, Bonferroni-corrected over the candidates gated: 97.5% CIs for two).
Reported: a baseline row (the defaults' mean and seed spread), and per proposer the share of seeds whose
session found a gated win, the mean improvement, and the device-seconds the winning sessions used (the time
to get there: the win is only known once its re-runs are done). `llm` and `hybrid` are measured only when an
endpoint is configured (OPENAI_BASE_URL/OPENAI_API_KEY): a scripted fake says nothing about search quality.
Aims: tpe and cmaes beat random; the demo's default proposer (tpe) wins on digits in at least 8 of 10 seeds.
On an experiment with a holdout (digits: `test_accuracy`, 360 test images no search decision reads), each
gated win is also judged on the holdout (the winner's fresh re-runs against the baseline's runs, read once at
the session's end): reported are the share of gated wins the holdout confirms (its 95% CI above zero), the
mean holdout improvement, and the mean validation-minus-holdout lead of the winners (how much of the validation
lead is fitted to the validation split).

`--experiment digits` is the demo's own task (digits, 6 epochs, scale 1: 10-50 s per trial on 2 shared CPU
cores, so 10 seeds take most of an hour per proposer). The default objective is synthetic, so that many
seeds fit in minutes: each trial is still a real queue job (a process started by the service that logs a
learning curve to MLflow step by step and checkpoints on SIGTERM; only the "training" is a formula, a
6-parameter landscape with interactions, a categorical choice, seeded evaluation noise, and a convergence speed
that depends on the learning rate, so early rankings are informative but imperfect). A last section runs the
samplers alone on that formula (no queue, no start-up cost), the same gate deciding, for a quick large-N view.
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
    """One job (the job protocol): resume from the checkpoint, log the curve to MLflow, exit 75 on SIGTERM."""
    import signal

    p = SPEC.space.validate(json.loads(os.environ["AUTORESEARCH_PARAMS"]))
    ckpt = Path(os.environ.get("AUTORESEARCH_CHECKPOINT_DIR") or ".") / "state.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client, run = MlflowClient(os.environ["MLFLOW_TRACKING_URI"]), os.environ["MLFLOW_RUN_ID"]
    if start == 0:  # the full budget, so the agent knows when a run is complete
        from mlflow.entities import Param

        client.log_batch(run, params=[Param("total_steps", str(p["steps"]))])
    pace = float(os.environ.get("BENCH_STEP_SECONDS", "1.0"))
    for step in range(start + 1, p["steps"] + 1):
        time.sleep(pace)
        client.log_batch(run, metrics=[Metric("loss", loss_at(p, step), int(time.time() * 1000), step)])
        if stop["flag"] and step < p["steps"]:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_text(json.dumps({"step": step}))
            sys.exit(75)


# -- the benchmark --------------------------------------------------------------------------------------------

EXPERIMENTS = {  # name -> (experiment, params held fixed)
    "synthetic": ("benchmarks.search_efficiency:SPEC", {}),
    "digits": ("digits", {"epochs": 6, "scale": 1}),
}


def run_session(experiment: str, proposer: str, seed: int, trials: int, slots: int,
                minutes: float | None = None, baseline_seeds: int = 3, confirm_top: int = 2) -> dict:
    """One full agent session in a fresh home; its summary plus the device-seconds it used."""
    home = Path(tempfile.mkdtemp(prefix=f"bench-{proposer}-{seed}-"))
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig
    from orchestrator.core.config import Settings

    name, fixed = EXPERIMENTS[experiment]
    config = SessionConfig(goal="find a real improvement over the defaults", experiment=name, proposer=proposer,
                           trials=trials, budget_minutes=minutes, parallel=slots, fixed=fixed, seed=seed,
                           poll=0.25, baseline_seeds=baseline_seeds, confirm_top=confirm_top)
    t0 = time.time()
    summary = runner.start(config, settings=Settings.load(), devices=f"cpu:{slots}")
    summary["wall_s"] = time.time() - t0
    return summary


def proposers_only(seeds: int, trials: int, kinds: list[str]) -> dict[str, dict]:
    """The samplers alone on the synthetic formula: baseline on 3 seeds, `trials` proposals from it, the top
    candidate re-evaluated on 3 fresh seeds (its selecting run left out), and the gate. No queue, no start-up cost."""
    from orchestrator.core.gate import gate
    from orchestrator.agent.proposers.base import Observation
    from orchestrator.agent.proposers.optuna_ import SamplerProposer
    from orchestrator.agent.search import baseline_params, fixed_params, project, reduced

    fixed = fixed_params(SPEC, {}, 0)
    searched = reduced(SPEC, fixed)
    base_params = baseline_params(SPEC, {}, fixed)
    value = lambda params, s: loss_at(SPEC.space.validate({**params, "seed": s, "steps": STEPS}), STEPS)  # noqa
    out = {}
    for kind in kinds:
        wins, gains = 0, []
        for seed in range(seeds):
            seeds3 = [seed * 1000, seed * 1000 + 1, seed * 1000 + 2]
            base = [value(base_params, s) for s in seeds3]
            proposer = SamplerProposer(searched, kind, seed=seed, baseline=project(base_params, searched.space))
            history = [Observation(project(base_params, searched.space), "complete", v, proposer="baseline")
                       for v in base]
            while len(history) < 3 + trials:
                for p in proposer.propose(2, history):
                    history.append(Observation(p.params, "complete", value(p.params, seeds3[0]), proposer=kind))
            best = min(history[3:], key=lambda o: o.value)
            # Judged on fresh seeds only: its selecting run (seed seeds3[0]) is the best of many draws.
            fresh = [*seeds3[1:], seed * 1000 + 3]
            v = gate(base, [value(best.params, s) for s in fresh], direction="minimize")
            wins += v.win
            gains.append(v.delta)
        out[kind] = {"wins": wins, "seeds": seeds, "gain": statistics.fmean(gains)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0, help="the seeds are FIRST.. FIRST+SEEDS-1 (to add "
                        "seeds to an earlier run)")
    parser.add_argument("--trials", type=int, default=16, help="search trials + re-runs per session (the "
                        "baseline's 3 runs come on top)")
    parser.add_argument("--proposers", default="random,tpe,cmaes",
                        help="comma-separated; llm and hybrid are added when an endpoint is configured")
    parser.add_argument("--experiment", default="synthetic", choices=sorted(EXPERIMENTS))
    parser.add_argument("--slots", type=int, default=2, help="cpu:N device slots per session")
    parser.add_argument("--step-seconds", type=float, default=0.3, help="synthetic: seconds per logged step")
    parser.add_argument("--minutes", type=float, default=None,
                        help="a time budget per session too (the demo: --experiment digits --proposers tpe "
                        "--trials 14 --minutes 3 --baseline-seeds 5 --confirm-top 1)")
    parser.add_argument("--baseline-seeds", type=int, default=3, help="seeds the baseline runs on (the demo: 5)")
    parser.add_argument("--confirm-top", type=int, default=2, help="candidates re-run on fresh seeds (the demo: 1)")
    parser.add_argument("--no-queue-section", action="store_true", help="skip the proposers-only section")
    args = parser.parse_args()
    os.environ["BENCH_STEP_SECONDS"] = str(args.step_seconds)
    from orchestrator.agent.proposers.factory import llm_configured

    kinds = [k.strip() for k in args.proposers.split(",") if k.strip()]
    if llm_configured():
        kinds += [k for k in ("llm", "hybrid") if k not in kinds]
    else:
        kinds = [k for k in kinds if k not in ("llm", "hybrid")]
    import logging

    logging.disable(logging.WARNING)
    print(f"search efficiency on {args.experiment}: {', '.join(kinds)}; {args.seeds} seeds; {args.trials} trials "
          f"per session (+{args.baseline_seeds} baseline runs) on cpu:{args.slots}; a win = the noise gate "
          "(Welch on fresh re-runs, Bonferroni) passes",
          flush=True)
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for kind in kinds:
            s = run_session(args.experiment, kind, seed, args.trials, args.slots, args.minutes, args.baseline_seeds,
                            args.confirm_top)
            results[kind].append(s)
            base = s.get("baseline") or {}
            print(f"seed {seed} {kind:>6}: {s['headline']} | {s['trials']} jobs, {s['device_seconds']:.0f} "
                  f"device-s, {s['wall_s']:.0f} s wall | baseline {base.get('mean', float('nan')):.4g}", flush=True)
    mean = statistics.fmean
    print()
    bases = [s["baseline"] for r in results.values() for s in r if s.get("baseline")]
    if bases:
        spreads = [b["spread"] for b in bases if b["spread"] is not None]
        print(f"{'baseline':>8}: mean {mean([b['mean'] for b in bases]):.4g}, seed spread "
              f"{mean(spreads) if spreads else float('nan'):.2g} (mean std over {len(bases)} sessions x "
              f"{bases[0]['n']} seeds)")
    for kind, sessions in results.items():
        won = [s for s in sessions if s.get("winner")]
        gain = [s["verdict"]["delta"] for s in won]
        print(f"{kind:>8}: beat the baseline by more than the noise in {len(won)}/{len(sessions)} seeds; "
              f"mean improvement when it did {mean(gain) if gain else float('nan'):+.4g}; device-s to get there "
              f"{mean([s['device_seconds'] for s in won]) if won else float('nan'):.0f} (all sessions: "
              f"{mean([s['device_seconds'] for s in sessions]):.0f})")
        held = [s["holdout"] for s in won if s.get("holdout")]
        if held:
            gaps = [s["verdict"]["delta"] - s["holdout"]["delta"] for s in won if s.get("holdout")]
            print(f"{'':>8}  holdout: confirms {sum(h['confirmed'] for h in held)}/{len(won)} gated wins; mean "
                  f"holdout improvement {mean([h['delta'] for h in held]):+.4g}; mean validation-minus-holdout "
                  f"lead {mean(gaps):+.4g}")
    if not args.no_queue_section:
        quick = proposers_only(max(args.seeds, 10), args.trials, [k for k in kinds if k in ("random", "tpe", "cmaes")])
        print("proposers alone on the synthetic formula (no queue; same gate): " + "; ".join(
            f"{k} {r['wins']}/{r['seeds']} wins, mean gain {r['gain']:+.3f}" for k, r in quick.items()))
    return 0


if __name__ == "__main__":
    if os.environ.get("AUTORESEARCH_JOB_ID") and os.environ.get("AUTORESEARCH_PARAMS"):
        trial()  # started by the queue as one trial
    else:
        sys.exit(main())
