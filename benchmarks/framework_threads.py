"""CPU threads per job, measured on a Hugging Face Trainer script: a session's wall time against one trial's.

    python benchmarks/framework_threads.py [--trials 8] [--slots 2] [--oversubscribe]

The script and toml are the Hugging Face guide page's (docs/guides/huggingface.md), in a temporary folder. First
one trial runs alone on `cpu:SLOTS` (its job's wall time from start to end, T1); then a random-search session of
`--trials` trials (one baseline run, no confirmation, no early stopping) runs on the same slots, in a fresh
home. Reported: the session's wall time against T1 x jobs / slots (1.0x: packed trials run as fast as one
alone would, side by side). `--oversubscribe` gives the service OMP_NUM_THREADS = the host's cores, what every
job had before a job's threads were its slot's cores (torch's default: one thread per core), for a side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def project(where: Path) -> Path:
    """The guide page's script and toml in a folder named as the toml says."""
    page = (ROOT / "docs" / "guides" / "huggingface.md").read_text()
    folder = where / "hf-tiny"
    folder.mkdir()
    (folder / "train.py").write_text(re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)[0])
    (folder / "autoresearch.toml").write_text(re.findall(r"^```toml\n(.*?)^```", page, re.S | re.M)[0])
    return folder


def fresh_home(where: Path, name: str) -> None:
    home = where / name
    home.mkdir()
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.pop("AUTORESEARCH_DB_URL", None)


def wall(store, job) -> float:
    """Seconds from the job's first RUNNING event to its end."""
    events = store.events(job.id)
    started = min(e.at for e in events if e.dst == "RUNNING")
    return max(e.at for e in events) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--oversubscribe", action="store_true")
    args = parser.parse_args()
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    if args.oversubscribe:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(os.cpu_count())
    devices = f"cpu:{args.slots}"
    with tempfile.TemporaryDirectory(prefix="framework-threads-") as tmp:
        folder = project(Path(tmp))
        from orchestrator.agent import runner
        from orchestrator.agent.session import SessionConfig
        from orchestrator.api import jobs as api
        from orchestrator.core.config import Settings
        from orchestrator.queue.store import JobStore
        from orchestrator.service.daemon import Service

        fresh_home(Path(tmp), "alone")
        settings = Settings.load()
        service = Service(settings, devices=devices).start()
        store = JobStore(settings.db_url)
        try:
            job, _ = api.submit(api.experiment_spec(str(folder), {}), settings)
            while not store.get(job.id).final:
                time.sleep(0.5)
        finally:
            service.stop()
        assert store.get(job.id).state == "SUCCEEDED", Path(store.get(job.id).log_path).read_text()[-2000:]
        alone = wall(store, store.get(job.id))

        fresh_home(Path(tmp), "session")
        config = SessionConfig(goal="lower eval_loss", experiment=str(folder), proposer="random", trials=args.trials,
                               parallel=args.slots, poll=0.2, baseline_seeds=1, confirm_seeds=0,
                               early_stopping=False)
        began = time.time()
        summary = runner.start(config, devices=devices)
        took = time.time() - began
        jobs = sum(summary["counts"].values())
        ideal = alone * jobs / args.slots
        print(f"threads: {'OMP_NUM_THREADS=' + os.environ['OMP_NUM_THREADS'] if args.oversubscribe else 'per slot'}; "
              f"one trial alone {alone:.1f} s; session of {jobs} jobs on {devices}: {took:.1f} s "
              f"({summary['counts']}); one trial x {jobs} / {args.slots} = {ideal:.1f} s; ratio {took / ideal:.2f}x; "
              f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
