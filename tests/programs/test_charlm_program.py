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


@pytest.mark.slow
def test_charlm_program_trains_within_its_budget_and_prints_val_bpb():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHARLM_TIME_BUDGET": "1", "CHARLM_EVAL_BYTES": "2048"}
    env.pop("MLFLOW_RUN_ID", None)
    out = subprocess.run([sys.executable, "-m", "orchestrator.programs.wrap", "--metric", "val_bpb", "--",
                          sys.executable, "train.py"], cwd=PROGRAM, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]
    value = float(out.stdout.split("val_bpb:")[1].split()[0])
    assert 0.5 < value < 8.5  # a trained byte model beats uniform (8 bits per byte)
