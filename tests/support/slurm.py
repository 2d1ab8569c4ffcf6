"""The one-host Slurm cluster the Slurm executor's tests use (`.ci/slurm-setup.sh` sets it up).

`slurm_node()` is the fixture body: the node's name once `sinfo` shows it up, else the test is skipped
with the reason (failed under CI, tests/support/requires.py). `cancel_jobs(store)` ends what a test left in
Slurm; `node_state`/`set_node` drain and resume the node.
"""

from __future__ import annotations

import shutil
import subprocess

from tests.support.requires import require


def _sinfo() -> tuple[str | None, str | None]:
    """(node name, None) when the cluster's debug partition has a usable node, else (None, why not)."""
    if shutil.which("sinfo") is None:
        return None, "no `sinfo` on PATH (run .ci/slurm-setup.sh)"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N|%T"], capture_output=True,
                             text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None, "sinfo did not answer within 20 s (slurmctld down? run .ci/slurm-setup.sh)"
    if out.returncode != 0:
        return None, (out.stderr.strip().splitlines() or ["sinfo failed"])[0] + " (run .ci/slurm-setup.sh)"
    for line in out.stdout.splitlines():
        node, _, state = line.partition("|")
        if state.rstrip("*~#") in ("idle", "mixed", "allocated", "completing"):
            return node, None
    return None, f"no node of partition debug is up (sinfo: {out.stdout.strip() or 'nothing'})"


def slurm_node() -> str:
    """The cluster's node, or skip (fail under CI) with the reason it is unusable."""
    node, reason = _sinfo()
    require("a Slurm cluster (slurmctld, slurmd, munge)", reason)
    return node  # type: ignore[return-value]


def accounting() -> str | None:
    """None when the cluster enforces accounts through slurmdbd (what .ci/slurm-setup.sh sets up), else why not."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
    conf = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    conf = {k.strip(): v.strip() for k, v in conf.items()}
    if conf.get("AccountingStorageType") != "accounting_storage/slurmdbd":
        return "the cluster has no slurmdbd (run .ci/slurm-setup.sh)"
    if "associations" not in conf.get("AccountingStorageEnforce", ""):
        return "the cluster does not enforce associations (run .ci/slurm-setup.sh)"
    return None


def scontrol(*args: str) -> str:
    """Run scontrol; its stdout (raises on failure)."""
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def node_state(node: str) -> str:
    """The node's state as sinfo prints it (idle, mixed, drained, draining ...)."""
    return subprocess.run(["sinfo", "-h", "-n", node, "-N", "-o", "%T"], capture_output=True, text=True,
                          timeout=20).stdout.split("\n")[0].strip()


def cancel_jobs(store) -> None:
    """Cancel the Slurm jobs of every job in `store` (what a test left behind; other tests' jobs are not
    touched, so test runs may share the cluster)."""
    ids = [job.proc_start.split(":", 1)[1] for job in store.list()
           if (job.proc_start or "").startswith("slurm:") and not job.final]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=20)


def stop_services(services) -> None:
    """A test's teardown of the in-process services it started on Slurm: their jobs killed, the services
    stopped, and whatever Slurm jobs they left cancelled."""
    import signal

    from orchestrator.queue.states import HOLDING

    for svc in services:
        if svc._home_lock.fh is not None:
            for job in svc.store.list(HOLDING):
                svc.executor.signal(job, signal.SIGKILL)
            svc.stop()
        cancel_jobs(svc.store)


def resume(node: str) -> None:
    """Put the node back in service after a test drained it or set it down (nothing when it is back already:
    `ReturnToService=2` returns a DOWN node whose slurmd answers)."""
    done = subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0 and not node_state(node).startswith(("idle", "mixed", "alloc")):
        raise RuntimeError(f"could not resume node {node}: {done.stderr.strip()}")


# -- the emulated nodes of partition multi (node1..node3: `slurmd -N` daemons on this machine) ------------------

MULTI = "multi"
MULTI_LOCK = "/tmp/autoresearch-slurm-multi.lock"


def multi_states() -> dict[str, str]:
    """The state of each node of partition multi as sinfo prints it (`idle`, `mixed`, `down*` ...); {} if none."""
    if shutil.which("sinfo") is None:
        return {}
    out = subprocess.run(["sinfo", "-h", "-N", "-p", MULTI, "-o", "%N|%T"], capture_output=True, text=True,
                         timeout=20)
    return dict(line.split("|", 1) for line in out.stdout.splitlines() if "|" in line)


def multi_idle(nodes: list[str]) -> bool:
    """Whether all of `nodes` are idle (no job left completing on them)."""
    states = multi_states()
    return all(states.get(node) == "idle" for node in nodes)


def multi_nodes() -> list[str]:
    """The emulated nodes of partition multi once all are up, or skip (fail under CI) with the reason."""
    states = multi_states()
    up = [node for node, state in states.items() if state.rstrip("~#") in ("idle", "mixed", "allocated", "completing")]
    reason = None if len(up) >= 3 else (
        f"partition {MULTI} has {len(up)} of 3 emulated nodes up (sinfo: {states or 'nothing'}; run "
        ".ci/slurm-setup.sh)")
    require("a Slurm cluster with emulated nodes (partition multi)", reason)
    return sorted(up)


def slurmd_pid(node: str) -> int | None:
    """The pid of an emulated node's slurmd (its pid file), None when it does not run."""
    import os

    try:
        pid = int(open(f"/run/slurmd-{node}.pid").read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def kill_node(node: str) -> list[int]:
    """What losing a machine does to an emulated node: SIGKILL to its slurmd, to every process Slurm started
    there (they carry SLURMD_NODENAME=node) and to their slurmstepd. Returns the pids killed."""
    import os
    import signal

    import psutil

    killed = []
    pid = slurmd_pid(node)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    victims: set[psutil.Process] = set()
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.environ().get("SLURMD_NODENAME") == node:
                victims.add(proc)
                parent = proc.parent()
                if parent is not None and parent.name() == "slurmstepd":
                    victims.add(parent)
        except psutil.Error:
            continue
    for proc in victims:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.Error:
            pass
    return killed


def revive_node(node: str) -> None:
    """Start an emulated node's slurmd again (if a test killed it) and return the node to service."""
    if slurmd_pid(node) is None:
        subprocess.run(["slurmd", "-N", node], capture_output=True, timeout=30)
        # What the killed node ran stays `completing` until the controller's next retry reaches the new slurmd
        # (about 20 s); set DOWN, the node drops it at once, and the resume below returns it idle.
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=autoresearch test: revived"],
                       capture_output=True, text=True, timeout=30)
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, text=True,
                   timeout=30)


def restore_multi(nodes: list[str]) -> bool:
    """One step of putting the emulated nodes back as a test found them: every node not idle, allocated or
    completing (drained, down, not responding: what a test or the product did to it), or whose slurmd a test
    killed while Slurm still calls it idle, is revived, again on every call until it is back (an `scontrol
    update` refused by a busy controller is simply repeated). Whether all of `nodes` are idle now."""
    states = multi_states()
    for node in nodes:
        state = states.get(node, "")
        if not state.rstrip("~#*").startswith(("idle", "alloc", "mix", "comp")) or state.endswith("*") \
                or slurmd_pid(node) is None:  # killed while idle: Slurm has not noticed yet
            revive_node(node)
    return multi_idle(nodes)
