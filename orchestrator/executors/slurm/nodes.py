"""The nodes of multi-node attempts on Slurm: which node each attempt ran on, which nodes a job excludes, and
which nodes failed (and how often in a row).

Files, under the home's `slurm/nodes/` (the home is on a filesystem every node shares):
- `JOB/ATTEMPT/NODE.json`: one node's record of one attempt, written by its launcher
  (`orchestrator.executors.slurm.nodelaunch`): started, a heartbeat every `BEAT` seconds, `stopping` once it was
  told to stop, `exit` once its ranks ended, `preflight` when the node failed its preflight;
- `JOB/state.json`: the job's own: `excluded` nodes (passed as `sbatch --exclude` to every later attempt, with the
  reason of each) and each attempt's nodes (`show` prints both);
- `health.json`: per node, its failures in a row (reset by an attempt that ends well on it); at `DRAIN_AFTER`
  the node is drained in Slurm with the reason, so no job of this queue lands there again until a person resumes it.

A node is lost when its launcher's heartbeat is older than `LOST_AFTER` while it neither stopped nor ended (its
slurmd and processes killed, the machine gone: the ranks elsewhere may hang in a collective, or fail), when it
failed its preflight, or when Slurm says it is down, drained, failed or not responding.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

BEAT = 1.0  # seconds between two heartbeats of a node's launcher
LOST_AFTER = 6.0  # seconds without a heartbeat (and without a stop or an exit) after which a node is lost
DRAIN_AFTER = 2  # failures in a row after which a node is drained
UNENDED = "its launcher neither stopped nor ended with the job"
BAD_STATES = ("down", "drain", "fail", "not_responding", "no_respond", "*")


def root(home: Path) -> Path:
    return Path(home) / "slurm" / "nodes"


def records_dir(home: Path, job_id: int, attempt: int) -> Path:
    """Where the launchers of one attempt write their records."""
    return root(home) / str(job_id) / str(attempt)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def records(home: Path, job_id: int, attempt: int) -> dict[str, dict]:
    """The node records of one attempt, by node name."""
    folder = records_dir(home, job_id, attempt)
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return {}
    out = {}
    for path in paths:
        data = read_json(path)
        if data.get("node"):
            out[data["node"]] = data
    return out


def job_state(home: Path, job_id: int) -> dict:
    """The job's node state: {"excluded": {node: reason}, "attempts": {attempt: {...}}} (empty when none)."""
    return read_json(root(home) / str(job_id) / "state.json")


def excluded(home: Path, job_id: int) -> list[str]:
    """The nodes every later attempt of the job excludes."""
    return sorted(job_state(home, job_id).get("excluded") or {})


def note_attempt(home: Path, job_id: int, attempt: int, **fields: Any) -> None:
    """Add what is known of an attempt (its nodes, how many were asked) to the job's node state."""
    state = job_state(home, job_id)
    attempts = state.setdefault("attempts", {})
    attempts.setdefault(str(attempt), {}).update(fields)
    write_json(root(home) / str(job_id) / "state.json", state)


def exclude(home: Path, job_id: int, failed: dict[str, str]) -> None:
    """Remember `failed` (node -> reason) as excluded from the job's later attempts."""
    state = job_state(home, job_id)
    state.setdefault("excluded", {}).update(failed)
    write_json(root(home) / str(job_id) / "state.json", state)


def lost(recs: dict[str, dict], slurm_states: dict[str, str], *, ended: bool,
         now: Optional[float] = None, silent_only: bool = False,
         answers: Optional[Callable[[str], Optional[bool]]] = None, srun_failed: Iterable[str] = ()) -> dict[str, str]:
    """The nodes of an attempt that failed it, with why: a preflight failure or a device fault, a launcher silent
    for `LOST_AFTER` without having stopped or ended (once the attempt `ended`, any such launcher), or Slurm's
    word on the node. `silent_only`: the silent ones alone (a running gang whose node found a device fault
    stops by itself, every rank checkpointing one step: it must not be cut short).

    `answers(node)`: whether the node's slurmd takes a connection (None: unknown). When several launchers fell
    silent together and some of their nodes still answer, only those that do not are lost: the others went
    down with it (the head node holds the batch shell and `srun`; losing it ends the step on every node).

    Slurm's word (a bad node state, then `srun_failed`: the nodes srun reported failed) replaces our inference
    from a launcher's missing end: a node Slurm failed kills its launcher before or after the SIGTERM is
    recorded, as the load falls."""
    now = time.time() if now is None else now
    out = {}
    quiet = []  # nodes whose launcher fell silent
    for node, rec in recs.items():
        if rec.get("preflight") or rec.get("health"):
            if silent_only:
                continue
            out[node] = str(rec.get("preflight") or rec.get("health"))
        elif "exit" not in rec and "stopping" not in rec:
            silent = now - float(rec.get("beat") or rec.get("started") or now)
            if silent > LOST_AFTER:
                out[node] = f"node {node} lost: no heartbeat from its launcher for {silent:.0f}s"
            elif ended:  # Slurm stops every launcher with a SIGTERM first, which each records at once
                out[node] = f"node {node} lost: {UNENDED}"
            else:
                continue
            quiet.append(node)
    if answers is not None and len(quiet) > 1:
        gone = [node for node in quiet if answers(node) is False]
        if gone and len(gone) < len(quiet):
            for node in quiet:
                if node not in gone:
                    del out[node]
    slurms_word = [(node, f"is {state} in Slurm") for node, state in slurm_states.items() if is_bad(state)]
    for node, why in slurms_word + [(node, "failed (Slurm: node failure)") for node in srun_failed]:
        if node not in out or out[node].endswith(UNENDED):
            out[node] = f"node {node} {why}"
    return out


def slurmd_answers(node: str, timeout: float = 2.0) -> Optional[bool]:
    """Whether the node's slurmd takes a TCP connection at the address and port Slurm knows it by; None when
    Slurm does not say where it is."""
    import socket

    try:
        out = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = dict(word.partition("=")[::2] for word in out.split() if "=" in word)
    addr, port = fields.get("NodeAddr"), fields.get("Port") or _slurmd_port()
    if not addr or not port:
        return None
    try:
        with socket.create_connection((addr, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _slurmd_port() -> Optional[str]:
    """The cluster's SlurmdPort (what a node without a Port of its own listens on)."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^SlurmdPort\s*=\s*(\d+)", out, re.M)
    return found.group(1) if found else None


def is_bad(state: str) -> bool:
    """Whether a node in this Slurm state (sinfo's long form) takes no new work: down, drained, failed or not
    responding (`*`)."""
    return any(bad in state.lower() for bad in BAD_STATES)


def slurm_states(nodes: Iterable[str]) -> dict[str, str]:
    """Slurm's state of each node (`sinfo`'s long state, with `*` when it does not respond); {} when unknown."""
    names = sorted(set(nodes))
    if not names:
        return {}
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N|%T"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in out.splitlines():
        node, _, state = line.partition("|")
        if node in names:
            states[node] = state.strip()
    return states


def record_failures(home: Path, failed: dict[str, str], job_id: int) -> list[str]:
    """Count a failure in a row for each failed node; drain in Slurm those at `DRAIN_AFTER` (with the reason).
    Returns the nodes drained now."""
    path = root(home) / "health.json"
    health = read_json(path)
    drained = []
    for node, why in failed.items():
        entry = health.setdefault(node, {"failures": 0})
        entry["failures"] = int(entry.get("failures", 0)) + 1
        entry["last"] = f"job {job_id}: {why}"
        if entry["failures"] >= DRAIN_AFTER and not entry.get("drained"):
            reason = f"autoresearch: failed {entry['failures']} times in a row; last: {entry['last']}"[:200]
            done = subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode == 0:
                entry["drained"] = reason
                drained.append(node)
    write_json(path, health)
    return drained


def record_success(home: Path, nodes: Iterable[str]) -> None:
    """An attempt ended well on these nodes: their failures in a row start again from 0."""
    path = root(home) / "health.json"
    health = read_json(path)
    changed = False
    for node in nodes:
        if health.get(node, {}).get("failures") or health.get(node, {}).get("drained"):
            health[node]["failures"] = 0
            health[node].pop("drained", None)  # back in service (a person resumed it): counted afresh
            changed = True
    if changed:
        write_json(path, health)


def health(home: Path) -> dict[str, dict]:
    """Per node: failures in a row, the last one, and the drain reason when this queue drained it."""
    return read_json(root(home) / "health.json")


def describe_attempts(state: dict) -> list[str]:
    """One line per attempt of a multi-node job for `show`: its nodes, and when it ran on fewer than the one
    before, that its checkpoint was resharded on load to the smaller world."""
    lines, before = [], None
    attempts = state.get("attempts") or {}
    for key in sorted(attempts, key=int):
        entry = attempts[key]
        ran = entry.get("nodes") or []
        asked, per = int(entry.get("asked") or 0), int(entry.get("per_node") or 1)
        line = f"attempt {key}: {','.join(ran) or 'not started'}"
        if ran:
            line += f" ({len(ran)} of {asked} nodes, {len(ran) * per} ranks)"
            if before is not None and len(ran) != before:
                line += (f"; fewer nodes than attempt {int(key) - 1}: its checkpoint resharded on load from "
                         f"{before * per} ranks to {len(ran) * per}") if len(ran) < before else \
                    f"; more nodes than before: its checkpoint resharded on load to {len(ran) * per} ranks"
            before = len(ran)
        if entry.get("failed"):
            line += "; failed: " + ", ".join(sorted(entry["failed"]))
        lines.append(line)
    return lines


_SRUN_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)", re.M)


def srun_node_failures(log: Optional[str], start: int = 0) -> list[str]:
    """The nodes srun reported failed in an attempt's part of the job's log (from byte `start`): Slurm's own word,
    which outlives the node's DOWN state when the cluster returns nodes to service as soon as they answer."""
    if not log:
        return []
    try:
        with open(log, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return sorted(set(_SRUN_NODE_FAILURE.findall(text)))
