"""`autoresearch serve`: run the queue service in the foreground."""

from __future__ import annotations

import logging
from typing import Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import info, settings
from orchestrator.core.errors import BadInput


@app.command()
def serve(
    devices: Optional[str] = typer.Option(None, "--devices", help="auto | cpu:N | a list like 0,1,3"),
    executor: Optional[str] = typer.Option(None, "--executor", help="local | ray | slurm"),
    preempt_after: Optional[float] = typer.Option(None, "--preempt-after",
                                                  help="Minimum runtime (s) before a job may be preempted."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster address (with --executor ray)."),
    partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition (with --executor slurm)."),
    account: Optional[str] = typer.Option(None, "--account", help="Slurm account (with --executor slurm)."),
    qos: Optional[str] = typer.Option(None, "--qos", help="Slurm QoS (with --executor slurm)."),
    preflight: Optional[str] = typer.Option(None, "--preflight", help="quick (before every start, default) | off"),
    hang_timeout: Optional[float] = typer.Option(
        None, "--hang-timeout", help="Seconds without a heartbeat before a job is stopped and requeued "
                                     "(default 1800; 0: never)."),
    recheck_every: Optional[float] = typer.Option(None, "--recheck-every",
                                                  help="Seconds between checks of idle devices (default 600)."),
    mps: Optional[bool] = typer.Option(None, "--mps", help="One NVIDIA MPS control daemon per GPU: jobs sharing "
                                                          "a GPU run side by side with their share."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the queue service (stops on SIGINT/SIGTERM; running jobs keep running and are adopted on restart)."""
    from orchestrator.core import devices as devspec
    from orchestrator.service.daemon import Service
    from orchestrator.service.health import HealthConfig

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    if preempt_after is not None and preempt_after < 0:
        raise BadInput("--preempt-after must be >= 0")
    chosen = settings(devices=devices, executor=executor, preempt_after=preempt_after, ray_address=ray_address,
                      slurm_partition=partition, slurm_account=account, slurm_qos=qos, preflight=preflight,
                      hang_timeout=hang_timeout, recheck_every=recheck_every, mps=mps)
    if chosen.mps and chosen.executor != "local":
        raise BadInput(f"--mps runs MPS daemons on this host: it needs --executor local, not {chosen.executor}")
    if chosen.executor == "local":
        devspec.parse(chosen.devices)  # bad spec: exit 2 before anything is touched
    if chosen.executor == "slurm":
        from orchestrator.executors.slurm.target import check_target

        check_target(chosen)  # a partition, account or QoS Slurm refuses: exit 2 before anything is touched
    HealthConfig.from_settings(chosen)  # bad health settings: exit 2 before anything is touched
    service = Service(chosen)
    service.serve_forever(on_started=lambda: info(
        f"autoresearch: serving {chosen.home} (executor {chosen.executor}, devices {chosen.devices}"
        f"{', MPS' if chosen.mps else ''}); Ctrl-C stops (running jobs keep running)"))
