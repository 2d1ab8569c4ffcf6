"""Which one-parameter moves from the digits defaults really improve them, at the demo's budget?

    python benchmarks/digits_moves.py [--seeds 0,1,2] [--epochs 6] [--moves lr=0.01,arch=cnn,...]
    python benchmarks/digits_moves.py --search tpe [--sessions 10] [--search-trials 8]

Each configuration is the experiment's defaults (epochs 6, scale 1: the demo's fixed budget) with one parameter
changed, trained in this process (no queue, no job start-up) on each seed; reported is its mean
val_accuracy, its seed spread, and the gap to the defaults on the same seeds. A study of the space the demo
searches, to tell which directions a sampler's first neighbours of the baseline should try; not a test.

`--search KIND`: the demo's search without the queue (no ASHA, no start-up cost), to compare proposers quickly:
the baseline on 5 seeds, `--search-trials` proposals (3 in flight, one asked as each finishes, as the session
does on 2 slots), the top configurations by mean re-run on 3 fresh seeds each, and the session's gate
(Welch on the fresh re-runs, Bonferroni over the candidates), with the top 1 and the top 2 re-run. The
baseline's seeds are 0-4 and the re-runs' 1-3 in every session, so runs repeat across sessions and are trained
once. Reported: gated wins out of `--sessions`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One move per line: a direction each numeric parameter can go, and each other category.
MOVES = [
    {},  # the defaults
    {"lr": 1e-3}, {"lr": 1e-2}, {"lr": 3e-2},
    {"hidden": 64}, {"hidden": 256}, {"hidden": 512},
    {"depth": 1}, {"depth": 3},
    {"arch": "cnn"}, {"arch": "cnn", "channels": 32},
    {"activation": "gelu"}, {"activation": "silu"}, {"activation": "tanh"},
    {"norm": "batchnorm"}, {"norm": "layernorm"},
    {"dropout": 0.0}, {"dropout": 0.25},
    {"optimizer": "sgd", "lr": 3e-2},
    {"weight_decay": 0.01}, {"weight_decay": 0.05},
    {"schedule": "constant"},
    {"label_smoothing": 0.1},
    {"batch_size": 16}, {"batch_size": 32}, {"batch_size": 128},
]


_DONE: dict[str, float] = {}


def run(params: dict) -> float:
    """Train one configuration in this process; its final val_accuracy (remembered: training is deterministic
    on CPU, so a configuration and seed seen before is not trained again)."""
    import json

    key = json.dumps(params, sort_keys=True)
    if key not in _DONE:
        _DONE[key] = _train(params)
    return _DONE[key]


def _train(params: dict) -> float:
    from experiments.digits.spec import SPEC
    from experiments.digits.train import train
    from runtime.context import ContextConfig, JobContext

    p = SPEC.validate(params)
    got: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = JobContext(job_id=None, attempt=0, params=p, checkpoint_dir=Path(tmp),
                         config=ContextConfig(handle_signals=False))
        ctx.log_metrics = lambda metrics, step=None: got.update(metrics)  # no MLflow: keep the last values
        ctx.log_params = lambda params: None
        with contextlib.redirect_stdout(io.StringIO()):
            train(ctx, p)
    return got["val_accuracy"]


def parse_moves(text: str) -> list[dict]:
    """`lr=0.01,arch=cnn` -> [{}, {"lr": 0.01}, {"arch": "cnn"}] (the defaults first)."""
    from experiments.digits.spec import SPEC

    out: list[dict] = [{}]
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out.append({key: SPEC.space.dims[key].coerce(key, value)})
    return out


def search_session(kind: str, seed: int, trials: int, epochs: int, baseline_seeds: int = 5) -> dict:
    """One offline session of sampler `kind` (see the module doc); its verdict and the moves it tried."""
    from experiments.digits.spec import SPEC
    from orchestrator.agent import search
    from orchestrator.agent.proposers.base import Observation
    from orchestrator.agent.proposers.optuna_ import SamplerProposer
    from orchestrator.tracking.client import leaderboard

    fixed = search.fixed_params(SPEC, {"epochs": epochs, "scale": 1}, 0)
    searched = search.reduced(SPEC, fixed)
    base = search.baseline_params(SPEC, {}, fixed)
    seeds = list(range(max(baseline_seeds, 4)))  # the same for every session: their runs are trained once
    proposer = SamplerProposer(searched, kind, seed=seed, baseline=search.project(base, searched.space))
    rows, history = [], []
    for s in seeds[:baseline_seeds]:
        v = run(search.seeded(SPEC, base, s))
        rows.append({"params": search.seeded(SPEC, base, s), "value": v, "baseline": True})
        history.append(Observation(search.project(base, searched.space), "complete", v, proposer="baseline"))
    pending: list[dict] = []
    asked = 0
    while asked < trials or pending:
        while len(pending) < 3 and asked < trials:
            running = [Observation(p, "running") for p in pending]
            pending.append(proposer.propose(1, history + running)[0].params)
            asked += 1
        params = pending.pop(0)
        v = run(search.full(SPEC, params, fixed))
        history.append(Observation(params, "complete", v, proposer=kind))
        rows.append({"params": search.full(SPEC, params, fixed), "value": v, "selection": True})
    board = leaderboard(rows, "maximize")
    tops = [e for e in board["entries"] if not e["baseline"]][:2]
    out = {}
    for k, e in enumerate(tops, 1):  # --confirm-top 1, then 2
        for s in seeds[1:4]:
            rows.append({"params": search.seeded(SPEC, {**e["params"], **fixed}, s), "value": run(
                search.seeded(SPEC, {**e["params"], **fixed}, s))})
        board = leaderboard(rows, "maximize")
        out[f"win{k}"] = board["winner"] is not None
        out["headline"] = board["headline"]
    out["tried"] = [e["diff"] for e in board["entries"] if not e["baseline"]][:3]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--epochs", type=int, default=6, help="the fixed budget (the demo: 6)")
    parser.add_argument("--moves", default=None, help="k=v,... one move each (default: the built-in grid)")
    parser.add_argument("--search", default=None, help="a sampler (tpe, cmaes, random): offline sessions")
    parser.add_argument("--sessions", type=int, default=10, help="--search: sessions (sampler seeds 0..N-1)")
    parser.add_argument("--search-trials", type=int, default=8, help="--search: search trials per session")
    args = parser.parse_args()
    if args.search:
        from experiments.digits import prepare

        prepare.ensure()
        wins = [0, 0]
        for seed in range(args.sessions):
            t0 = time.perf_counter()
            out = search_session(args.search, seed, args.search_trials, args.epochs)
            wins = [wins[0] + out.get("win1", False), wins[1] + out.get("win2", False)]
            print(f"seed {seed}: {out['headline']} | top: {out['tried']} | {time.perf_counter() - t0:.0f} s",
                  flush=True)
        print(f"{args.search}, {args.search_trials} search trials: gated wins {wins[0]}/{args.sessions} with the "
              f"top candidate re-run (--confirm-top 1), {wins[1]}/{args.sessions} with the top 2")
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    moves = parse_moves(args.moves) if args.moves else MOVES
    from experiments.digits import prepare

    prepare.ensure()
    base: list[float] = []
    print(f"digits, epochs {args.epochs}, scale 1, seeds {seeds}: one move from the defaults per row", flush=True)
    for move in moves:
        t0 = time.perf_counter()
        values = [run({**move, "epochs": args.epochs, "scale": 1, "seed": s}) for s in seeds]
        if not move:
            base = values
        gaps = [v - b for v, b in zip(values, base)]
        name = ", ".join(f"{k}={v}" for k, v in move.items()) or "defaults"
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{name:>28}: {statistics.fmean(values):.4f} ± {spread:.4f}  gap {statistics.fmean(gaps):+.4f} "
              f"(min {min(gaps):+.4f})  [{' '.join(f'{v:.4f}' for v in values)}]  "
              f"{(time.perf_counter() - t0) / len(seeds):.1f} s/run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
