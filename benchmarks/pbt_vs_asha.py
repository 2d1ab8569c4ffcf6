"""Population-based training against ASHA+TPE and ASHA+random on charlm, at the same device budget.

    python benchmarks/pbt_vs_asha.py [--seeds 5] [--slots P] [--max-steps 300] [--population 4]
                                     [--interval 60] [--methods pbt,tpe,random] [--experiment DIR]
                                     [--budget-minutes M] [--first-seed S]

Each (method, seed) is one full agent session through the real queue, in a fresh AUTORESEARCH_HOME with its own
embedded service on `cpu:SLOTS`, real charlm trials and a real MLflow store, as `autoresearch start` runs it:

- pbt: `--proposer pbt --population P --perturbation-interval I`: P members to `--max-steps` steps each, the
  bottom quarter copying the top quarter's checkpoint every I steps; then the best member's schedule replayed
  from scratch on 3 fresh seeds beside the baseline's 3 runs.
- tpe, random: the usual session: the baseline's 3 runs, search trials with ASHA pausing the losers at each
  rung, the top 2 configurations re-run on 3 fresh seeds each.

The device budget is the same for the three sessions of one seed: the PBT session runs first, to its end (its
budget is its population's total steps), and the ASHA sessions then get its wall time on the same slots as
`--budget-minutes` (they stop searching when only the time for their re-runs is left); each row reports the
device-seconds its sessions really used. Every session is judged by the same gate (Welch's t-test
on fresh-seed runs only, against the baseline's): a row reports the share of seeds whose session found a gated
win, the mean gated improvement in val_loss (nats per byte; 0 where none), and the best finished single run.
Ratios are printed against ASHA+random. `--experiment examples/tinyreg` runs the same comparison on a
config-file experiment (PBT in resumed segments of the script's own checkpoints). PBT is expected to pay on
schedules (a learning rate that should fall), not on architectures, which it never changes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_session(method: str, seed: int, args: argparse.Namespace, minutes: float | None) -> dict:
    """One full session in a fresh home; its summary with wall time."""
    home = Path(tempfile.mkdtemp(prefix=f"bench-pbt-{method}-{seed}-"))
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig
    from orchestrator.core.config import Settings

    extra = ({"population": args.population, "perturbation_interval": args.interval} if method == "pbt"
             else {"trials": 1000})
    charlm = args.experiment == "charlm"
    fixed = {"max_steps": args.max_steps, "scale": 1} if charlm else {}
    experiment = "charlm" if charlm else str(Path(args.experiment).resolve())
    config = SessionConfig(goal="lowest val_loss", experiment=experiment, proposer=method,
                           budget_minutes=minutes, parallel=args.slots, seed=seed, poll=0.5,
                           fixed=fixed, baseline_seeds=args.baseline_seeds,
                           confirm_seeds=args.confirm_seeds, **extra)
    t0 = time.time()
    summary = runner.start(config, settings=Settings.load(), devices=f"cpu:{args.slots}")
    summary["wall_s"] = time.time() - t0
    return summary


def row(method: str, summaries: list[dict], direction: str = "minimize") -> dict:
    """What one method's sessions found: gated wins, mean gated improvement, best run, device-seconds."""
    wins = [s for s in summaries if s.get("winner")]
    gains = [(s.get("verdict") or {}).get("delta") or 0.0 for s in summaries]
    bests = [(s.get("best") or {}).get("value") for s in summaries]
    bests = [b for b in bests if b is not None]
    return {"method": method, "seeds": len(summaries), "wins": len(wins), "gain": statistics.fmean(gains),
            "best": (min if direction == "minimize" else max)(bests) if bests else None,
            "device_s": statistics.fmean(s["device_seconds"] for s in summaries),
            "wall_s": statistics.fmean(s["wall_s"] for s in summaries),
            "baseline": statistics.fmean(s["baseline"]["mean"] for s in summaries if s.get("baseline"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--slots", type=int, default=None, help="cpu:N device slots per session (default: the "
                        "population, which PBT trains at once)")
    parser.add_argument("--experiment", default="charlm", help="charlm, or a config-file experiment's folder "
                        "(its own step budget; e.g. examples/tinyreg)")
    parser.add_argument("--max-steps", type=int, default=300, help="charlm's step budget per trial")
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--interval", type=int, default=60, help="pbt's perturbation interval in steps")
    parser.add_argument("--baseline-seeds", type=int, default=3)
    parser.add_argument("--confirm-seeds", type=int, default=3)
    parser.add_argument("--methods", default="pbt,tpe,random")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--budget-minutes", type=float, default=None, help="the ASHA sessions' budget (default: "
                        "the pbt session's wall time; required when pbt is not among --methods)")
    args = parser.parse_args()
    if "pbt" not in args.methods.split(",") and args.budget_minutes is None:
        parser.error("--budget-minutes is needed without pbt among --methods (its wall time is the default)")
    args.slots = args.slots or args.population
    methods = args.methods.split(",")
    found: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        minutes = args.budget_minutes
        for method in sorted(methods, key=lambda m: m != "pbt"):  # pbt first: its wall time is the others' budget
            s = run_session(method, seed, args, None if method == "pbt" else minutes)
            if method == "pbt" and args.budget_minutes is None:
                minutes = s["wall_s"] / 60
            found[method].append(s)
            print(f"{method} seed {seed}: {s['headline']} ({s['device_seconds']:.0f} device-s, "
                  f"{s['wall_s']:.0f} s, {s['stop_reason']})", flush=True)
    rows = [row(m, found[m]) for m in methods]
    ref = next((r for r in rows if r["method"] == "random"), rows[-1])
    what = f"charlm, {args.max_steps} steps per trial" if args.experiment == "charlm" else args.experiment
    budget = (f"{args.budget_minutes:g} minutes for each ASHA session" if args.budget_minutes is not None
              else "the pbt session's wall time for each")
    print(f"\n{what}, cpu:{args.slots}, {budget}, "
          f"{args.seeds} seeds; pbt: population {args.population}, interval {args.interval}")
    print(f"{'method':8} {'wins':>6} {'gain':>9} {'best run':>9} {'device-s':>9} {'vs ' + ref['method']:>14}")
    for r in rows:
        best = f"{r['best']:.4f}" if r["best"] is not None else "-"
        ratio = f"{r['device_s'] / ref['device_s']:.2f}x dev-s" if ref["device_s"] else "-"
        print(f"{r['method']:8} {r['wins']}/{r['seeds']:<4} {r['gain']:+9.4f} {best:>9} {r['device_s']:9.0f} "
              f"{ratio:>14}")
    print(f"(baseline val_loss, mean over sessions: {statistics.fmean(r['baseline'] for r in rows):.4f}; gain is "
          "the gated improvement, 0 for a session without a win)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
