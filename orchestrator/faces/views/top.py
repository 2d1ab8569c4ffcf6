"""`autoresearch top`: a live view of devices, the queue with its next plan, agent sessions and recent events.

Drawn with rich: `Live` on the terminal's alternate screen, redrawn in place (no clearing, so no flicker) every
`interval` seconds or at once on a key press; `q` (or Ctrl-C) leaves and restores the terminal. Every frame is
cut to the terminal's size at that moment (sections share the rows in the order devices, queue, sessions,
events; a cut section ends with "+N more"), so it works in 80x24 over SSH and uses a wider one.
`--once` prints one frame, every row, for scripts.
"""

from __future__ import annotations

import datetime as dt
import os
import select
import sys
import time
from typing import Any, Optional

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from orchestrator.agent import tally
from orchestrator.core.config import Settings
from orchestrator.core.direction import Direction
from orchestrator.faces.views.snapshot import Snapshot, reserved, take

STATE_STYLE = {"RUNNING": "green", "STARTING": "cyan", "PREEMPTING": "yellow", "CANCELLING": "yellow",
               "QUEUED": "white", "SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "magenta",
               "available": "green", "busy": "cyan", "disabled": "yellow", "quarantined": "red"}
SECTION_OVERHEAD = 2  # title and header lines of a section


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _table(title: str, *columns: tuple[str, dict]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", box=None, padding=(0, 1),
                  expand=True, header_style="dim", show_edge=False, pad_edge=False)
    for name, opts in columns:
        table.add_column(name, no_wrap=True, overflow="ellipsis", **opts)
    return table


def _more(table: Table, hidden: int) -> None:
    # A caption, not a row: a row would widen the first column to fit the note.
    if hidden > 0:
        table.caption, table.caption_justify, table.caption_style = f"+{hidden} more", "left", "dim"


def _state(text: str) -> Text:
    return Text(text, style=STATE_STYLE.get(text, ""))


def device_state(state: str, job: Any) -> str:
    """What a device is doing, for people: `busy` while a job holds an available device (`gpus` says the same)."""
    return "busy" if job is not None and state == "available" else state


def _empty(title: str, note: str) -> Group:
    return Group(Text(title, style="bold"), Text(note, style="dim", no_wrap=True, overflow="ellipsis"))


def _holders(snap: Snapshot, jobs: list) -> Text:
    """The jobs on one device: `#12 0.25` for each (a job sharing the GPU shows its share), and when one job
    holds it, what is about to happen to it and its name."""
    desc = Text()
    for job in jobs:
        # What is about to happen to a job comes before its name, which is what a narrow column cuts.
        share = getattr(job, "gpu_share", None)
        desc.append(f"#{job.id} " + (f"{share:g} " if share else ""),
                    style="yellow" if len(jobs) > 1 and job.id in snap.victims else "")
    if len(jobs) == 1:
        job = jobs[0]
        if job.id in snap.victims:
            desc.append(f"yields to #{snap.victims[job.id]} ", style="yellow")
        if job.state != "RUNNING":
            desc.append(f"{job.state.lower()} ", style=STATE_STYLE.get(job.state, ""))
        desc.append(job.name)
    desc.rstrip()
    return desc


def devices_table(snap: Snapshot, limit: Optional[int]) -> Any:
    """Devices: state, the jobs on it (with their share when they share a GPU), priority, runtime and last
    heartbeat of the first; GPU busy % and memory used/total where known."""
    if not snap.devices:
        return _empty("devices", "no devices known yet: start `autoresearch serve`")
    table = _table("devices", ("device", {"min_width": 6, "max_width": 24}), ("state", {"min_width": 5}),
                   ("job", {"ratio": 4, "min_width": 8}), ("prio", {"justify": "right"}),
                   ("run", {"justify": "right"}), ("beat", {"justify": "right"}), ("gpu", {"min_width": 3}))
    hosts = {d.host for d in snap.devices}
    held = reserved(snap.queue)
    rows = snap.devices if limit is None else snap.devices[:limit]
    for d in rows:
        name = d.name if len(hosts) < 2 else f"{d.host}/{d.name}"
        job = d.job
        if job is None:
            idle = "idle, reserved for the line" if held and d.state == "available" else "idle"
            desc, prio, run, beat = Text(d.reason or idle, style="dim"), "", "", ""
        else:
            desc = _holders(snap, d.jobs or [job])
            prio, run = str(job.priority), _age(snap.at - job.started_at) if job.started_at else "-"
            beat = _age(snap.at - d.heartbeat_at) if d.heartbeat_at else "-"
        gpu = "" if d.util is None else f"{d.util}% {d.mem_used / 2**30:.0f}/{d.mem_total / 2**30:.0f}G"
        table.add_row(name, _state(device_state(d.state, job)), desc, prio, run, beat, gpu)
    _more(table, len(snap.devices) - len(rows))
    return table


def queue_table(snap: Snapshot, limit: Optional[int]) -> Any:
    """Waiting jobs in line order with what the next scheduling pass does for each."""
    if not snap.queue:
        return _empty("queue", "nothing waiting")
    table = _table("queue (line order, next plan)", ("#", {"justify": "right"}), ("job", {"ratio": 3, "min_width": 8}),
                   ("prio", {"justify": "right"}), ("gpus", {"justify": "right"}), ("owner", {"ratio": 1, "min_width": 5}),
                   ("wait", {"justify": "right"}), ("next", {"ratio": 3, "min_width": 10}))
    rows = snap.queue if limit is None else snap.queue[:limit]
    for row in rows:
        job = row.job
        style = "green" if row.starts else "yellow" if row.preempts else "dim" if "behind" in row.plan else ""
        table.add_row(str(row.position), f"#{job.id} {job.name}", str(job.priority), str(job.gpus), job.owner,
                      _age(snap.at - job.submitted_at), Text(row.plan, style=style))
    _more(table, max(len(snap.queue), snap.counts.get("QUEUED", 0)) - len(rows))  # the snapshot reads a screenful
    return table


def sessions_table(snap: Snapshot, limit: Optional[int]) -> Table:
    """Agent sessions: status, trials done (of the budget), best so far against the baseline."""
    rows = snap.sessions if limit is None else snap.sessions[:limit]
    counts = [tally.text(s["phases"]) for s in rows]  # never cut: the goal gives way first
    table = _table("agent sessions", ("session", {"min_width": 10}), ("exp", {"ratio": 1, "min_width": 6}),
                   ("status", {"min_width": 6}), ("trials", {"justify": "right", "min_width": max(map(len, counts),
                                                                                                default=6)}),
                   ("running", {"justify": "right"}),
                   ("best", {"justify": "right"}), ("baseline", {"justify": "right"}),
                   ("holdout", {"justify": "right"}), ("goal", {"ratio": 2}))
    for s, done in zip(rows, counts):
        trials = s["trials"]
        active = sum(trials.get(k, 0) for k in ("RUNNING", "STARTING", "PREEMPTING", "CANCELLING"))
        best, base = s.get("best"), s.get("baseline")
        best_text = Text(_num(best))
        if best is not None and base is not None and s.get("direction") and best != base:
            better = Direction.of(s["direction"]).better(best, base)
            best_text.stylize("green" if better else "red")
        held = s.get("holdout") or {}
        # The winner's lead on the holdout (read once, after its session): red when it does not confirm it.
        held_text = Text(f"{held['delta']:+.3g}" if held else "", style="" if held.get("confirmed", True) else "red")
        table.add_row(s["session"], s.get("experiment") or "", _state(s["status"]), done, str(active), best_text,
                      _num(base), held_text, s.get("goal") or "")
    _more(table, len(snap.sessions) - len(rows))
    return table


def events_table(snap: Snapshot, limit: Optional[int]) -> Table:
    """The latest state transitions of any job, newest first."""
    table = _table("recent events", ("time", {}), ("job", {"ratio": 2, "min_width": 6}), ("to", {}),
                   ("reason", {"ratio": 4}))
    rows = snap.events if limit is None else snap.events[:limit]
    for event, name in rows:
        table.add_row(dt.datetime.fromtimestamp(event.at).strftime("%H:%M:%S"), f"#{event.job_id} {name}",
                      _state(event.dst), event.reason)
    return table


def header(snap: Snapshot, live: bool) -> Text:
    """One line: home, time, services, job counts, and how to leave."""
    counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(snap.counts.items())) or "no jobs"
    services = (f"{len(snap.services)} service" + ("s" if len(snap.services) != 1 else "")) if snap.services \
        else "no service running"
    text = Text.assemble(("autoresearch top", "bold"), f"  {dt.datetime.fromtimestamp(snap.at):%H:%M:%S}  ",
                         (services, "green" if snap.services else "red"), f"  {counts}",
                         no_wrap=True, overflow="ellipsis")
    if live:
        text.append("  q quits", style="dim")
    return text


def projects_line(snap: Snapshot) -> Text:
    """One line: each project's share, quota, decayed usage (device-hours), devices running and jobs queued."""
    parts = []
    for r in snap.projects:
        if r["source"] == "scavenger":
            parts.append(f"scavengers q{r['queued']}")
            continue
        quota = f"/{r['quota']}" if r["quota"] else ""
        parts.append(f"{r['name']} x{r['share']:g}{quota} {r['usage_device_hours']:.1f}h "
                     f"run {r['running_devices']} q{r['queued']}")
    return Text.assemble(("projects ", "bold"), "  ".join(parts), no_wrap=True, overflow="ellipsis")


def budget(snap: Snapshot, height: Optional[int]) -> dict[str, Optional[int]]:
    """Rows each section may show in `height` lines (None: all). Devices first, then queue, sessions, events."""
    need = {"devices": max(1, len(snap.devices)), "queue": max(1, len(snap.queue)),
            "sessions": len(snap.sessions), "events": len(snap.events)}
    if height is None:
        return {k: None for k in need}
    left = height - 1 - bool(snap.projects)  # the header line, and the projects line when there is one
    shown = {k: 0 for k in need}
    # First pass: a little of everything that exists; then the rest in priority order.
    for key, first in (("devices", 4), ("queue", 4), ("sessions", 2), ("events", 3)):
        if need[key] and left > SECTION_OVERHEAD:
            shown[key] = min(need[key], first, left - SECTION_OVERHEAD)
            left -= shown[key] + SECTION_OVERHEAD
    for key in ("devices", "queue", "sessions", "events"):
        if shown[key] and need[key] > shown[key] and left > 0:
            extra = min(need[key] - shown[key], left)
            shown[key] += extra
            left -= extra
    # A cut section spends its last row on "+N more".
    return {k: (max(0, v - 1) if need[k] > v and k != "events" and v else v) for k, v in shown.items()}


def banners(snap: Snapshot) -> list[Text]:
    """A line per live service that starts no job for want of disk space (or whose disk is full), and one per
    Slurm node this queue drained (until a person resumes it in Slurm)."""
    disk = [Text(f"! {svc.host}: {svc.disk}", style="bold red", no_wrap=True, overflow="ellipsis")
            for svc in snap.services if getattr(svc, "disk", None)]
    return disk + [Text(f"! slurm node {node} drained: {why}", style="bold yellow", no_wrap=True, overflow="ellipsis")
                   for node, why in snap.drained.items()]


def render(snap: Snapshot, height: Optional[int] = None, live: bool = False) -> Group:
    """One frame, fitted to `height` lines (None: every row)."""
    warnings = banners(snap)
    rows = budget(snap, None if height is None else max(1, height - len(warnings)))
    parts: list[Any] = [header(snap, live), *warnings]
    if snap.projects:
        parts.append(projects_line(snap))
    drawn = {"devices": devices_table, "queue": queue_table, "sessions": sessions_table, "events": events_table}
    for key, make in drawn.items():
        if height is None or rows[key] or (key in ("devices", "queue") and height - 1 > SECTION_OVERHEAD):
            if key in ("sessions", "events") and not (snap.sessions if key == "sessions" else snap.events):
                continue
            parts.append(make(snap, rows[key]))
    return Group(*parts)


def print_once(settings: Settings, width: Optional[int] = None) -> None:
    """Print one frame (every row) and return."""
    console = Console(width=width) if width else Console()
    console.print(render(take(settings)))


def run(settings: Settings, interval: float = 1.0) -> None:
    """The live view until q or Ctrl-C; the terminal is restored however it ends."""
    from rich.live import Live

    from orchestrator.api import jobs as api

    console = Console()
    store = api.open_store(settings)
    keys = _Keys()
    try:
        with keys, Live(console=console, screen=True, auto_refresh=False, transient=True,
                        vertical_overflow="crop") as live:
            while True:
                snap = take(settings, store=store)
                live.update(render(snap, height=console.size.height, live=True), refresh=True)
                if keys.wait(interval) == "q":
                    return
    except KeyboardInterrupt:
        return


class _Keys:
    """Single key presses from the terminal (cbreak mode, no echo) while the view runs; restored on exit."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None
        self.saved: Any = None

    def __enter__(self) -> "_Keys":
        if self.fd is not None:
            import termios
            import tty

            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)  # keys arrive one at a time; Ctrl-C still raises KeyboardInterrupt
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def wait(self, timeout: float) -> Optional[str]:
        """The key pressed within `timeout` seconds (lower case), or None."""
        if self.fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return None
        data = os.read(self.fd, 32).decode(errors="ignore")
        return "q" if "q" in data.lower() else data[:1] or None
