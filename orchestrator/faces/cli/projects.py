"""`autoresearch projects [set NAME ...]` and `autoresearch usage`: projects sharing the devices, and who used
them (orchestrator.api.sharing)."""

from __future__ import annotations

from typing import Optional

import typer

from orchestrator.faces.cli.app import app
from orchestrator.faces.cli.common import print_json, print_table, settings

projects_app = typer.Typer(help="Projects sharing the devices: shares, quotas, usage.", invoke_without_command=True,
                           no_args_is_help=False)
app.add_typer(projects_app, name="projects")


def _num(value) -> str:
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


@projects_app.callback()
def projects(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List projects: share, quota, borrow limit, decayed usage (device-hours), devices held, jobs queued."""
    if ctx.invoked_subcommand is not None:
        return
    from orchestrator.api.sharing import projects_table

    rows = projects_table(settings())
    if as_json:
        print_json(rows)
        return
    print_table("projects", ["project", "share", "quota", "borrow limit", "usage (dev-h)", "running", "queued",
                             "from"],
                [(r["name"], _num(r["share"]), _num(r["quota"]), _num(r["borrow_limit"]),
                  _num(r["usage_device_hours"]), _num(r["running_devices"]), r["queued"], r["source"])
                 for r in rows])


@projects_app.command("set")
def set_(name: str = typer.Argument(..., metavar="NAME"),
         share: Optional[float] = typer.Option(None, "--share", help="Weight in fair sharing (default 1)."),
         quota: Optional[int] = typer.Option(None, "--quota", help="Devices guaranteed to the project (default 0)."),
         borrow_limit: Optional[int] = typer.Option(None, "--borrow-limit", help="Most devices it may use beyond "
                                                    "its quota (default: no cap)."),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Declare a project or change it (what is not given keeps its value)."""
    from orchestrator.api.sharing import set_project

    row = set_project(settings(), name, share=share, quota=quota, borrow_limit=borrow_limit)
    if as_json:
        print_json(row)
    else:
        print(f"project {row['name']}: share {_num(row['share'])}, quota {row['quota']}, "
              f"borrow limit {_num(row['borrow_limit']) or 'none'}")


@app.command()
def usage(by: str = typer.Option("project", "--by", help="project, owner or session."),
          since: Optional[str] = typer.Option(None, "--since", help="Only use from then on: 7d, 12h, an ISO time."),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """Device-hours per project, owner or session from the event log (scavengers apart); GPU device-hours held
    and busy, as the service sampled them; LLM tokens and cost per session."""
    from orchestrator.agent.usage import usage as usage_rows

    rows = usage_rows(settings(), by=by, since=since)
    if as_json:
        print_json(rows)
        return
    columns = [by, "device-hours", "scavenger dev-h", "attempts", "jobs", "running"]
    gpu = any(r.get("held_hours") for r in rows)  # sampled GPUs: held and busy device-hours, busy share
    if gpu:
        columns += ["gpu held-h", "busy-h", "busy"]
    extra = by == "session" and any("llm_calls" in r for r in rows)
    if extra:
        columns += ["llm calls", "tokens", "cost $"]
    print_table("usage", columns,
                [(r[by], f"{r['device_seconds'] / 3600:.3f}", f"{r['scavenger_device_seconds'] / 3600:.3f}",
                  r["attempts"], r["jobs"], r["running"],
                  *((f"{r['held_hours']:.3f}", f"{r['busy_hours']:.3f}",
                     "-" if r["busy_share"] is None else f"{100 * r['busy_share']:.0f}%") if gpu else ()),
                  *((r.get("llm_calls", ""), (r.get("prompt_tokens", 0) + r.get("completion_tokens", 0)) or "",
                     r.get("cost_usd", "")) if extra else ()))
                 for r in rows])
