"""The bundled program `experiments/charlm_program`: its spec loads, and one short run reports val_bpb."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.programs import spec as specs

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "experiments" / "charlm_program"


def test_charlm_program_spec_is_a_folder_of_this_repository():
    spec = specs.load(PROGRAM)
    assert spec.prefix == "experiments/charlm_program" and spec.edit == ("train.py",)
    assert spec.protected == ("prepare.py",) and (spec.metric, spec.direction) == ("val_bpb", "minimize")


def _run(budget: str) -> tuple[int, float]:
    """(steps, val_bpb) of one run of the program with a training budget of `budget` seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHARLM_TIME_BUDGET": budget, "CHARLM_EVAL_BYTES": "2048"}
    env.pop("MLFLOW_RUN_ID", None)
    out = subprocess.run([sys.executable, "-m", "orchestrator.programs.wrap", "--metric", "val_bpb", "--",
                          sys.executable, "train.py"], cwd=PROGRAM, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    return int(out.stdout.split("steps:")[1].split()[0]), float(out.stdout.split("val_bpb:")[1].split()[0])


@pytest.mark.slow
def test_charlm_program_trains_within_its_budget_and_prints_val_bpb():
    # The baseline is the same program with no training step: its untrained model's val_bpb on the same slice.
    none, untrained = _run("0")
    steps, value = _run("1")
    assert none == 0 and steps > 0 and value < untrained, (steps, value, untrained)
