"""`make demo` (`python -m orchestrator.faces.demo`), as a new user runs it after `make install`: a real session on
digits through the embedded service, ending with the gate's verdict against the measured baseline."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_demo_measures_its_baseline_and_ends_with_a_verdict(home, monkeypatch):
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):  # no LLM endpoint: the demo searches with Optuna TPE
        monkeypatch.delenv(var, raising=False)
    # 4 jobs: one search trial and the candidate's three fresh re-runs, after the baseline's five seeds.
    done = subprocess.run([sys.executable, "-m", "orchestrator.faces.demo", "--trials", "4"], capture_output=True,
                          text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0 and "Traceback" not in out + done.stderr, out[-3000:] + done.stderr[-3000:]
    first = out.splitlines()[0]
    assert re.match(r"autoresearch demo: session s-\S+ on digits, 4 trials or 3 minutes on cpu:2; proposer: tpe",
                    first), first
    assert re.search(r"^baseline: val_accuracy \S+ ± \S+ over 5 seed\(s\)", out, re.M), out[-3000:]
    # A win only against the measured baseline and its noise; otherwise it says so.
    assert re.search(r"^(improvement \+\S+ \(95% CI .+\) over baseline|no improvement over the baseline found)",
                     out, re.M), out[-3000:]
