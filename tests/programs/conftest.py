"""Program-mode fixtures: a small real git repository holding a program, and answers in the program format's shape.

The program is plain Python (no torch) so a run takes a fraction of a second: `prepare.py` (protected) scores
a learning rate, `train.py` (editable) prints `score: <number>` with seed noise, as karpathy/autoresearch's
`train.py` prints `val_bpb: ...`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


PREPARE = '''"""Data and evaluation: protected."""


def evaluate(lr):
    return (lr - 3.0) ** 2
'''

TRAIN = '''import os
import random
import time

from prepare import evaluate

LR = 1.0
SLEEP = {sleep}

random.seed(int(os.environ.get("AUTORESEARCH_SEED", "0")))
time.sleep(SLEEP)
print(f"score: {{evaluate(LR) + random.gauss(0, 0.01):.6f}}", flush=True)
'''


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def make_program(root: Path, *, sleep: float = 0.0, time_limit: str = "60s", repeats: int = 3,
                 extra: str = "", train: str | None = None) -> Path:
    """A git repository with one program at its top; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "prepare.py").write_text(PREPARE)
    (root / "train.py").write_text(train if train is not None else TRAIN.format(sleep=sleep))
    (root / "autoresearch.toml").write_text(
        f'[program]\nedit = ["train.py"]\nprotected = ["prepare.py"]\nrun = "{sys.executable} train.py"\n'
        f'metric = "score"\ndirection = "minimize"\ntime_limit = "{time_limit}"\nrepeats = {repeats}\n{extra}')
    git(root, "init", "-q", "-b", "main")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "the program")
    return root


def edit(search: str, replace: str, *, file: str = "train.py", parent: str = "best", why: str = "an idea") -> dict:
    """One proposal with one search/replace block."""
    return {"parent": parent, "rationale": why, "edits": [{"file": file, "search": search, "replace": replace}]}


def answer(*proposals: dict) -> str:
    return json.dumps({"proposals": list(proposals)})


@pytest.fixture
def program(tmp_path) -> Path:
    return make_program(tmp_path / "proj")
