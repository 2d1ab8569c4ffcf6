"""One node's part of a multi-node attempt: what `srun` starts once on every node of the Slurm allocation.

    python -m orchestrator.executors.slurm.nodelaunch RECORDS_DIR NPROC GRACE -- ARGV...

On each node it:
- writes the node's record (`RECORDS_DIR/NODE.json`: node name, node rank, the allocation's nodes) before
  anything else, so the executor knows every node that started;
- runs the preflight of the node (the quick checks of `runtime.preflight` on its devices unless
  AUTORESEARCH_PREFLIGHT is off; `AUTORESEARCH_FAULTS` entries `node@NODE:preflight` fail it, for drills on cpu
  slots): a node that fails it records why and exits 75 with its name, before any rank starts;
- runs `torchrun --nnodes N --nproc-per-node NPROC` with a c10d rendezvous on the first node of the allocation
  (id `autoresearch-JOB-ATTEMPT`: unique per attempt; port from the Slurm job id), the job's environment on every
  rank plus NODE_RANK (Slurm's node index), WORLD_SIZE and MASTER_ADDR (torchrun's);
- watches the node's devices while the ranks train (`health_watch`): a fault stops the whole job through the
  runtime's all-reduced stop (every rank checkpoints the same step, exit 75) and fails the node;
- records the exit code. A SIGTERM (a stop, Slurm ending the job) is recorded as `stopping` at once and passed
  to torchrun, which stops its ranks.

Why the records: a node that died (its slurmd and processes killed, the machine gone) leaves a record that
started and neither stopped nor ended, while every node Slurm or the queue stopped says so; the executor tells a
lost node from a failing job by that (`orchestrator.executors.slurm.nodes`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from orchestrator.executors.slurm.nodes import BEAT, write_json
from runtime import faults, protocol

PREFLIGHT_CHECK = "preflight"
HEALTH_CHECK = "health"
HEALTH_EVERY = 2.0  # seconds between two samples of the node's devices while its ranks train
PORT_BASE, PORT_SPAN = 20000, 20000  # rendezvous ports: PORT_BASE + Slurm job id % PORT_SPAN


_WRITING = threading.Lock()


def write_record(path: Path, record: dict) -> None:
    """Write a node's record atomically (readers on other nodes see the old or the new one), from the main
    thread or the heartbeat's."""
    with _WRITING:
        write_json(path, record)


def beat(path: Path, record: dict, done: threading.Event) -> None:
    """The heartbeat: the record again with `beat` every BEAT seconds until the ranks end (a node whose launcher
    stops beating without a stop or an exit is lost)."""
    while not done.wait(BEAT):
        record["beat"] = time.time()
        write_record(path, record)


def hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm node list (`node[1-3]` -> node1, node2, node3), as Slurm expands them."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    names = out.stdout.split()
    return names or [nodelist]


def node_address(node: str) -> str:
    """Where a node's processes are reached (its NodeAddr): the rendezvous host. Its name when Slurm says nothing."""
    out = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True, text=True, timeout=30)
    for word in out.stdout.split():
        key, _, value = word.partition("=")
        if key == "NodeAddr" and value:
            return value
    return node


def torchrun_argv(*, nnodes: int, nproc: int, node_rank: int, master: str, port: int, rdzv_id: str,
                  shutdown_timeout: int, argv: list[str]) -> list[str]:
    """This node's torchrun command line (our torchrun wrapper: a rank's exit 75 stays the node's 75)."""
    return [sys.executable, "-m", "orchestrator.executors.torchrun", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{port}",
            f"--rdzv-id={rdzv_id}", f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}",
            "--max-restarts=0", f"--shutdown-timeout={shutdown_timeout}", "--no-python", *argv]


def node_devices(nproc: int) -> list[str]:
    """The devices this node gives the job: the GPUs Slurm made visible, else `nproc` cpu slots."""
    visible = [d.strip() for d in os.environ.get(protocol.VISIBLE_DEVICES, "").split(",") if d.strip()]
    return visible or [f"cpu:{i}" for i in range(nproc)]


def preflight(node: str, nproc: int) -> str:
    """Why this node fails its preflight (the quick device checks of `runtime.preflight` on its devices, unless
    AUTORESEARCH_PREFLIGHT is off; an injected `node@NODE:preflight` fault always counts), or "" when it passes."""
    if faults.injected(f"node@{node}", PREFLIGHT_CHECK):
        return faults.INJECTED
    if os.environ.get("AUTORESEARCH_PREFLIGHT", "quick").strip().lower() in ("off", "0", "false", "no"):
        return ""
    from runtime.preflight import healthy, reason, run

    results = run(node_devices(nproc), "quick")
    return "" if healthy(results) else reason(results)


def node_health(node: str, devices: list[str]) -> str:
    """Why this node's devices are faulty now (the run-time sample of `runtime.preflight`: NVML's ECC, retired
    pages and throttling on its GPUs; an injected `node@NODE:health` fault), or "" when they are fine."""
    if faults.injected(f"node@{node}", HEALTH_CHECK):
        return faults.INJECTED
    gpus = [d for d in devices if not d.startswith("cpu:")]
    if not gpus:
        return ""
    from runtime.preflight import healthy, monitor_sample, reason

    results = monitor_sample(gpus)
    return "" if healthy(results) else reason(results)


def first_step_done(since: float) -> bool:
    """Whether this attempt has done a step (rank 0's heartbeat, written after `since`): from then on its ranks
    have their stop handlers and checkpoint when stopped."""
    try:
        with open(os.environ.get(protocol.HEARTBEAT_FILE) or "", encoding="utf-8") as fh:
            beat = json.load(fh)
        return int(beat.get("step", 0)) > 0 and float(beat.get("time", 0)) >= since
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def health_watch(node: str, devices: list[str], torchrun: subprocess.Popen, path: Path, record: dict,
                 done: threading.Event) -> None:
    """Sample the node's devices every HEALTH_EVERY seconds once training has begun; on a fault, SIGTERM this
    node's ranks: the runtime's all-reduced stop then stops every rank of every node at the same step, each
    checkpoints it and exits 75, and the executor excludes this node from the job's next attempts."""
    while not done.wait(HEALTH_EVERY):
        if not first_step_done(record["started"]):
            continue
        why = node_health(node, devices)
        if not why:
            continue
        record["health"] = f"device fault on node {node}: {why}"
        write_record(path, record)
        say(node, record["health"] + "; stopping every rank at its next step")
        try:
            import psutil

            for rank in psutil.Process(torchrun.pid).children():
                rank.send_signal(signal.SIGTERM)
        except Exception as exc:  # noqa: BLE001 - ranks gone already: nothing left to stop
            say(node, f"could not signal the ranks: {exc}")
        return


def say(node: str, message: str) -> None:
    print(f"autoresearch[{node}]: {message}", flush=True)


def main(args: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if args is None else args
    if len(args) < 5 or args[3] != "--":
        print("usage: python -m orchestrator.executors.slurm.nodelaunch RECORDS_DIR NPROC GRACE -- ARGV...",
              file=sys.stderr)
        return 2
    records, nproc, grace, argv = Path(args[0]), int(args[1]), float(args[2]), args[4:]
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    node_rank = int(os.environ.get("SLURM_NODEID") or 0)
    nodes = hostnames(os.environ.get("SLURM_JOB_NODELIST") or node)
    record = {"node": node, "node_rank": node_rank, "nodes": nodes, "pid": os.getpid(), "started": time.time()}
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{node}.json"
    write_record(path, record)
    done = threading.Event()
    threading.Thread(target=beat, args=(path, record, done), daemon=True).start()
    child: list[subprocess.Popen] = []

    def on_term(signum: int, _frame: object) -> None:
        if "stopping" not in record:
            record["stopping"] = time.time()
            write_record(path, record)
        for proc in child:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    failed = preflight(node, nproc)
    if failed:
        done.set()
        record.update(exit=protocol.EX_TEMPFAIL, preflight=f"preflight failed on node {node}: {failed}")
        write_record(path, record)
        say(node, record["preflight"])
        return protocol.EX_TEMPFAIL
    master = node_address(nodes[0])
    slurm_job = int(os.environ.get("SLURM_JOB_ID") or 0)
    rdzv_id = f"autoresearch-{os.environ.get(protocol.JOB_ID, 0)}-{os.environ.get(protocol.ATTEMPT, 0)}-{slurm_job}"
    env = {**os.environ, "NODE_RANK": str(node_rank), "MASTER_ADDR": master,
           "WORLD_SIZE": str(len(nodes) * nproc)}
    command = torchrun_argv(nnodes=len(nodes), nproc=nproc, node_rank=node_rank, master=master,
                            port=PORT_BASE + slurm_job % PORT_SPAN, rdzv_id=rdzv_id,
                            shutdown_timeout=max(1, int(grace * 0.8)), argv=argv)
    say(node, f"node {node_rank} of {len(nodes)} ({','.join(nodes)}): {nproc} ranks, rendezvous {rdzv_id} on "
              f"{master}")
    child.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
    threading.Thread(target=health_watch, args=(node, node_devices(nproc), child[0], path, record, done),
                     daemon=True).start()
    while True:
        try:
            code = child[0].wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
    code = 128 - code if code < 0 else code
    done.set()
    record["exit"] = code
    write_record(path, record)
    return code


if __name__ == "__main__":
    sys.exit(main())
