"""The chaos soak, short and with a fixed seed: 90 seconds of mixed work on three services (two on a PostgreSQL
queue of the soak's own cluster, one on SQLite) while faults land, then zero violations of every invariant
(`benchmarks/chaos_soak.py` runs it for as long as one likes; benchmarks/RESULTS.md has the long runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.requires import require

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_ninety_seconds_of_chaos_lose_nothing_and_break_no_invariant():
    from benchmarks.chaos.cluster import _bin

    try:
        _bin("initdb")
    except RuntimeError as exc:
        require("PostgreSQL's initdb and pg_ctl (the soak runs a cluster of its own)", str(exc))
    soak = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "chaos_soak.py"), "--minutes", "1.5",
                             "--seed", "39", "--mean-gap", "8", "--job-gap", "5", "--trials", "3",
                             "--drain-minutes", "3"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out = soak.communicate(timeout=660)[0]
    finally:
        if soak.poll() is None:  # stopped from outside: the soak's SIGTERM handler removes its cluster and mount
            soak.terminate()
            soak.communicate(timeout=120)
    assert soak.returncode == 0, out[-6000:]
    checks = re.findall(r"^\s+(ok  |FAIL) (.+?)\s+checked\s+(\d+)\s+violations (\d+)$", out, re.M)
    assert len(checks) == 8 and all(status == "ok  " and n == "0" for status, _, _, n in checks), out[-6000:]
    faults = int(re.search(r"^faults: (\d+)$", out, re.M).group(1))
    assert faults >= 6, out[-6000:]  # the chaos landed: a fault every 8 s on average for 90 s
    checked = {name: int(n) for _, name, n, _ in checks}
    assert checked["every submitted job final or still queued"] >= 4  # hand jobs were there to lose (fewer while
    # the full disk refuses their submits)
