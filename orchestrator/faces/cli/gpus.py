"""`autoresearch gpus`: device states (available, disabled by a person, quarantined by a check)."""

from __future__ import annotations

import datetime as dt

import typer

from orchestrator.api import jobs as api
from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, print_json, print_table, settings

gpus_app = typer.Typer(help="Devices and their health.", invoke_without_command=True, no_args_is_help=False)
app.add_typer(gpus_app, name="gpus")


def _resolve(store, idx: str):
    from orchestrator.core.errors import BadInput
    from orchestrator.core.layout import node_name

    host = node_name(settings().home, settings().node)
    names = {d.name for d in store.hosts.devices(host)}
    if not names:
        raise BadInput("no devices known for this home yet: start `autoresearch serve` first")
    for candidate in (idx, f"cpu:{idx}"):
        if candidate in names:
            return host, candidate
    raise BadInput(f"no device {idx!r}; known: {', '.join(sorted(names))}")


@gpus_app.callback()
def gpus(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List devices with their state and last check."""
    if ctx.invoked_subcommand is not None:
        return
    from orchestrator.queue.states import HOLDING
    from orchestrator.faces.views.top import device_state

    store = api.open_store(settings())
    devs = store.hosts.devices()
    on = {(j.host or "", dev): j.id for j in store.list(HOLDING) for dev in j.devices or ()}
    if as_json:  # `state` stays the device's own (available, disabled, quarantined); `job`: who holds it now
        print_json([{**d.to_dict(), "job": on.get((d.host, d.name))} for d in devs])
        return
    when = lambda t: dt.datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else ""  # noqa: E731
    print_table("devices", ["host", "device", "state", "job", "reason", "last check"],
                [(d.host, d.name, device_state(d.state, on.get((d.host, d.name))),
                  f"#{on[(d.host, d.name)]}" if (d.host, d.name) in on else "", d.reason, when(d.checked_at))
                 for d in devs])
    if devs and not api.live_services(store):
        info("no service is running for this home: these are the last known states")
    _slurm_nodes()


def _slurm_nodes() -> None:
    """The Slurm nodes this home's multi-node jobs saw fail: failures in a row, drained or not, the last reason."""
    from orchestrator.executors.slurm import nodes as slurm_nodes

    health = slurm_nodes.health(settings().home)
    rows = [(node, entry.get("failures", 0), "drained" if entry.get("drained") else "in service",
             entry.get("drained") or entry.get("last", "")) for node, entry in sorted(health.items())]
    if rows:
        print_table("slurm nodes", ["node", "failures in a row", "state", "reason"], rows)


@gpus_app.command()
def disable(idx: str = typer.Argument(..., metavar="IDX"),
            reason: str = typer.Option("disabled by a person", "--reason")) -> None:
    """Take a device out of scheduling (running jobs on it finish)."""
    store = api.open_store(settings())
    host, name = _resolve(store, idx)
    store.hosts.set_device_state(host, name, "disabled", reason)
    print(f"{name}: disabled")


@gpus_app.command()
def enable(idx: str = typer.Argument(..., metavar="IDX")) -> None:
    """Return a disabled or quarantined device to scheduling."""
    store = api.open_store(settings())
    host, name = _resolve(store, idx)
    store.hosts.set_device_state(host, name, "available", "")
    from orchestrator.core.wakeup import notify

    notify(settings().home)
    print(f"{name}: available")
