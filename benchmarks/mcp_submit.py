"""An outside agent submitting through `autoresearch mcp` (one stdio session) vs one `autoresearch submit` process
per job (what an agent that shells out does), on the same home with a real service on cpu slots.

Prints the MCP server's start-up, per-call submit latency (median, p90), the time until all jobs finished, the
CLI's per-submit wall time, the ratio, and what one `top --once` frame costs on that queue.
Run: ``python benchmarks/mcp_submit.py [--jobs 100] [--cli-jobs 20] [--slots 8]`` from the repository root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100, help="jobs submitted through MCP")
    ap.add_argument("--cli-jobs", type=int, default=20, help="jobs submitted with one CLI process each")
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()

    home = tempfile.mkdtemp(prefix="mcp-bench-")
    os.environ.update(AUTORESEARCH_HOME=home, AUTORESEARCH_PREFLIGHT="off",
                      MLFLOW_TRACKING_URI=f"sqlite:///{home}/mlflow.db",
                      PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    sys.path.insert(0, str(ROOT))
    from orchestrator.core.config import Settings
    from orchestrator.service.daemon import Service

    service = Service(Settings.load(), devices=f"cpu:{args.slots}", tick=0.2).start()
    env = {k: os.environ[k] for k in ("AUTORESEARCH_HOME", "AUTORESEARCH_PREFLIGHT", "MLFLOW_TRACKING_URI",
                                      "PYTHONPATH", "PATH")}
    try:
        result = anyio.run(_through_mcp, env, args.jobs)
        cli = []
        for i in range(args.cli_jobs):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "submit", "--no-track", "--name", f"c{i}",
                            "--", "true"], env=env, check=True, capture_output=True)
            cli.append(time.perf_counter() - t)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "orchestrator.faces.cli", "top", "--once", "--width", "80"], env=env,
                       check=True, capture_output=True)
        top_s = time.perf_counter() - t
    finally:
        service.stop()
    start, lat, done = result
    mcp_ms, cli_ms = statistics.median(lat) * 1000, statistics.median(cli) * 1000
    print(f"mcp: server start + initialize {start:.2f} s; {len(lat)} submit_job calls, median {mcp_ms:.1f} ms, "
          f"p90 {sorted(lat)[int(0.9 * len(lat))] * 1000:.1f} ms; all finished {done:.2f} s after the first submit")
    print(f"cli: {len(cli)} `autoresearch submit` processes, median {cli_ms:.0f} ms each")
    print(f"ratio: a submit through MCP takes {mcp_ms / cli_ms:.3f}x the time of a CLI process "
          f"({cli_ms / mcp_ms:.0f}x faster), start-up paid once per session")
    print(f"top --once on that home: {top_s:.2f} s (a process: imports included)")


async def _through_mcp(env: dict, jobs: int) -> tuple[float, list[float], float]:
    t0 = time.perf_counter()
    params = StdioServerParameters(command=sys.executable, args=["-m", "orchestrator.faces.cli", "mcp"], env=env)
    async with stdio_client(params, errlog=open(os.devnull, "w")) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            t1 = time.perf_counter()
            lat = []
            for i in range(jobs):
                a = time.perf_counter()
                res = await session.call_tool("submit_job", {"command": ["true"], "name": f"v{i}"})
                if res.is_error:
                    raise SystemExit(f"submit_job failed: {res.content[0].text}")
                lat.append(time.perf_counter() - a)
            while (await session.call_tool("list_jobs", {})).structured_content["jobs"]:
                await anyio.sleep(0.1)
            return t1 - t0, lat, time.perf_counter() - t1


if __name__ == "__main__":
    main()
