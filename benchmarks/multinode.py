"""Jobs across nodes on the emulated Slurm nodes (partition multi, `.ci/slurm-setup.sh`): what losing a node costs,
and what a checkpoint of a sharded state costs each rank.

    python benchmarks/multinode.py [--steps 60] [--every 10] [--delay 0.1] [--mib 64] [--saves 3]

1. Recovery. A 2-node x 2-rank DDP run (tests/orchestrator/scripts/gang_train.py: a DCP checkpoint every
   `--every` steps) through an in-process service on partition multi; once two checkpoints are committed the
   second node is killed (its slurmd, its job step and ranks: SIGKILL). Printed, each from its own record: the
   executor's detection (kill -> the attempt requeued, from the job's events), the requeue -> sbatch of the new
   attempt (QUEUED -> STARTING), the `sbatch` accepted (-> RUNNING), the wait for Slurm's scheduler to start it
   (its StartTime: a node still completing the killed attempt waits for a backfill pass, `bf_interval`), the
   restart of the ranks on the new nodes (torchrun, the c10d rendezvous, imports, the DCP load: -> every rank's
   record), their first step, the total from the kill to training resumed, and the steps lost (the last step the
   first attempt reached minus the step the second resumed from; at most one checkpoint interval).
2. Checkpoint. 2 nodes x 2 ranks, each holding `--mib` MiB of its own state (a sharded model's rank), saved
   `--saves` times by the runtime's async DCP (every rank writes its shard in parallel) and by `torch.save` of
   everything gathered to rank 0 (the monolithic approach): the stall per rank (what the training loop waits)
   and the aggregate write throughput (all bytes / the time to the commit), with their ratios.

Every emulated node is this machine and writes the same disk: the throughput says what parallel writers gain on
one disk, not what a parallel file system gives.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRAIN = ROOT / "tests" / "orchestrator" / "scripts" / "gang_train.py"
CKPT = ROOT / "benchmarks" / "scripts" / "ckpt_ranks.py"


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in ckpt.glob("step_*/.metadata"))


def steps_of(log: str) -> list[tuple[int, float]]:
    """(step, time) of every step rank 0 printed, either attempt (told apart by their times)."""
    return [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"^step (\d+) loss \S+ at (\S+)$", log, re.M)]


def recovery(args, home: Path) -> dict:
    from orchestrator.api import jobs as api
    from orchestrator.core.config import Settings
    from orchestrator.queue.models import JobSpec
    from orchestrator.service.daemon import Service
    from tests.orchestrator.helpers import wait_for
    from tests.support import slurm as cluster

    out = home / "ranks"
    out.mkdir()
    lock = open(cluster.MULTI_LOCK, "w")  # the emulated nodes are the tests' too: one user at a time
    fcntl.flock(lock, fcntl.LOCK_EX)
    svc = Service(Settings.load(devices="cpu:12", executor="slurm", slurm_partition="multi"), preempt_after=0,
                  tick=0.2).start()
    victim = None
    try:
        job = api.submit(JobSpec(argv=[sys.executable, str(TRAIN), str(args.steps), str(args.every), str(out),
                                       str(args.delay)], nodes=2, gpus=2, track=False))[0]
        ckpt = Path(wait_for(lambda: svc.store.get(job.id).checkpoint_dir, 120, what="checkpoint dir"))
        wait_for(lambda: committed(ckpt) and committed(ckpt)[-1] >= 2 * args.every, 300, what="two checkpoints")
        ranks1 = [json.loads(p.read_text()) for p in out.glob("1.*.json")]
        victim = next(r["node"] for r in ranks1 if r["node_rank"] == "1")
        killed_at = time.time()
        cluster.kill_node(victim)
        wait_for(lambda: svc.store.get(job.id).final, 600, interval=0.5, what="the job to finish")
        final = svc.store.get(job.id)
        log = Path(final.log_path).read_text(errors="replace")
        events = svc.store.record(job.id)["events"]
    finally:
        svc.stop()
        cluster.cancel_jobs(svc.store)
        if victim:
            cluster.revive_node(victim)
        lock.close()
    assert final.state == "SUCCEEDED" and final.attempts == 2, (final.state, final.reason)
    after = [e for e in events if e["at"] >= killed_at]
    requeued = next(e["at"] for e in after if e["to"] == "QUEUED")
    starting = next(e["at"] for e in after if e["to"] == "STARTING")
    running = next(e["at"] for e in after if e["to"] == "RUNNING")
    started = slurm_start(final.proc_start)  # when Slurm's scheduler started the new attempt (1 s resolution)
    ranks2 = [json.loads(p.read_text()) for p in out.glob("2.*.json")]
    restored = max(r["at"] for r in ranks2)
    steps = steps_of(log)
    first = min((t, s) for s, t in steps if t > restored)[::-1]  # the resumed attempt's first step
    last1 = max((s for s, t in steps if t < requeued), default=0)  # the first attempt's last (node1 may do one more)
    resumed = min(r["start"] for r in ranks2)
    return {"node_killed": victim, "resumed_on": sorted({r["node"] for r in ranks2}),
            "detect_s": round(requeued - killed_at, 2), "requeue_to_sbatch_s": round(starting - requeued, 2),
            "sbatch_to_running_s": round(running - starting, 2),
            "slurm_start_s": round(max(started - running, 0.0), 2),
            "ranks_restored_s": round(restored - max(started, running), 2),
            "first_step_s": round(first[1] - restored, 2), "total_s": round(first[1] - killed_at, 2),
            "last_step_before_kill": last1, "resumed_from": resumed, "steps_lost": last1 - resumed,
            "checkpoint_every": args.every}


def slurm_start(proc_start: str | None) -> float:
    """The StartTime Slurm gives the attempt's batch job (`slurm:ID`), as seconds since the epoch."""
    from datetime import datetime

    from orchestrator.executors.slurm.jobs import parse_handle

    sid = parse_handle(proc_start) or ""
    out = subprocess.run(["scontrol", "show", "job", "-o", sid], capture_output=True, text=True, timeout=30).stdout
    stamp = re.search(r"\bStartTime=(\S+)", out)
    if not stamp:
        raise RuntimeError(f"no StartTime for Slurm job {sid!r}: {out.strip()[:300]}")
    return datetime.strptime(stamp.group(1), "%Y-%m-%dT%H:%M:%S").timestamp()


def checkpoint(args, home: Path) -> dict:
    out = home / "ckpt"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTORESEARCH_PREFLIGHT": "off", "OMP_NUM_THREADS": "1",
           "AUTORESEARCH_CHECKPOINT_DIR": str(out / "ctx")}
    env.pop("AUTORESEARCH_JOB_ID", None)
    cmd = ["srun", "-p", "multi", "-N2", "--ntasks-per-node=1", "--cpus-per-task=2", "--kill-on-bad-exit=1",
           sys.executable, "-m", "orchestrator.executors.slurm.nodelaunch", str(out / "records"), "2", "60", "--",
           sys.executable, str(CKPT), str(args.mib), str(args.saves), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the checkpoint run failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads((out / "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.1)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--skip", choices=("recovery", "checkpoint"), action="append", default=[])
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="autoresearch-multinode-"))
    os.environ["AUTORESEARCH_HOME"] = str(home)
    os.environ["AUTORESEARCH_PREFLIGHT"] = "off"
    try:
        if "recovery" not in args.skip:
            rec = recovery(args, home)
            print("recovery from a lost node (2 nodes x 2 ranks, CPU, gloo):")
            for key, value in rec.items():
                print(f"  {key:>22}: {value}")
        if "checkpoint" not in args.skip:
            ck = checkpoint(args, home)
            print(f"checkpoint of {ck['bytes_total'] / 2**20:.0f} MiB ({ck['world']} ranks x "
                  f"{ck['bytes_per_rank'] / 2**20:.0f} MiB), mean of {ck['saves']} saves:")
            for r, row in enumerate(ck["per_rank"]):
                print(f"  rank {r}: stall dcp {row['dcp_stall_mean_s']:.3f}s (max {row['dcp_stall_max_s']:.3f}s), "
                      f"torch.save {row['torch_save_stall_s']:.3f}s")
            dcp = statistics.mean(r["dcp_stall_mean_s"] for r in ck["per_rank"])
            mono = statistics.mean(r["torch_save_stall_s"] for r in ck["per_rank"])
            print(f"  mean stall per rank: dcp {dcp:.3f}s, torch.save {mono:.3f}s (ratio {mono / max(dcp, 1e-9):.1f}x)")
            print(f"  aggregate write: dcp {ck['dcp_mb_s']} MB/s (commit {ck['dcp_commit_s']}s), torch.save from "
                  f"rank 0 {ck['torch_save_mb_s']} MB/s ({ck['torch_save_s']}s): "
                  f"ratio {ck['dcp_mb_s'] / max(ck['torch_save_mb_s'], 1e-9):.2f}x")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
