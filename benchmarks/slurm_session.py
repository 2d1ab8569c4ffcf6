"""An agent session through Slurm against the same session on the local executor: device time and verdict.

    python benchmarks/slurm_session.py [--trials 12] [--slots 2] [--seed 0] [--proposer tpe]

The same digits session (the demo's setting: 6 epochs, scale 1, 3 baseline seeds, the top candidate re-run)
runs twice, each in a fresh home with its own embedded service on `--slots` cpu slots: once with
`--executor local` (the trials are processes of this host), once with `--executor slurm` (each trial one
`sbatch` of the wrapper on the cluster's default partition, one Slurm CPU a slot). Both use the same seed,
so the proposer asks for the same first trials. Printed per executor: the jobs, device-seconds (what the
queue recorded the trials holding their slots), wall seconds and the verdict; then the ratios (slurm / local).
Needs a Slurm cluster (`.ci/slurm-setup.sh` makes a one-host one); the local run goes first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_session(executor: str, trials: int, slots: int, seed: int, proposer: str) -> dict:
    """One digits session in a fresh home on `executor`; its summary with the wall time."""
    home = Path(tempfile.mkdtemp(prefix=f"slurm-session-{executor}-"))
    os.environ.update(AUTORESEARCH_HOME=str(home), AUTORESEARCH_PREFLIGHT="off",
                      MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}")
    from orchestrator.agent import runner
    from orchestrator.agent.session import SessionConfig
    from orchestrator.core.config import Settings

    config = SessionConfig(goal="find a real improvement over the defaults", experiment="digits",
                           proposer=proposer, trials=trials, parallel=slots, fixed={"epochs": 6, "scale": 1},
                           seed=seed, poll=0.25, baseline_seeds=3, confirm_top=1)
    t0 = time.time()
    summary = runner.start(config, settings=Settings.load(executor=executor), devices=f"cpu:{slots}")
    summary["wall_s"] = time.time() - t0
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--proposer", default="tpe")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)
    print(f"digits session, {args.trials} trials (+3 baseline runs), proposer {args.proposer}, seed {args.seed}, "
          f"cpu:{args.slots}", flush=True)
    out = {}
    for executor in ("local", "slurm"):
        s = run_session(executor, args.trials, args.slots, args.seed, args.proposer)
        out[executor] = s
        print(f"  {executor:>5}: {s['trials']} jobs, {s['device_seconds']:.0f} device-s, {s['wall_s']:.0f} s wall"
              f" | {s['headline']}", flush=True)
    lo, sl = out["local"], out["slurm"]
    print(f"  ratio (slurm / local): device-s {sl['device_seconds'] / lo['device_seconds']:.2f}x, "
          f"wall {sl['wall_s'] / lo['wall_s']:.2f}x; same verdict: "
          f"{bool(lo.get('winner')) == bool(sl.get('winner'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
