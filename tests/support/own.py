"""Third-party training scripts for the config-file experiment tests: argparse, print the metric, no import of ours.

`folder(tmp, toml, script)` writes a script and its autoresearch.toml into a fresh folder, as a user would.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

# A deterministic "training" of a 2-D bowl: prints `val_loss: X` after each of --steps steps. It refuses to
# share its output folder: a second trial writing into the same --out_dir would fail, not pass silently.
BOWL = '''
import argparse, os, sys, time

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--width", type=int, default=8)
p.add_argument("--act", choices=["relu", "gelu"], default="relu")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--out_dir", required=True)
a = p.parse_args()
raw = [x.split("=", 1)[1] for x in sys.argv if x.startswith("--lr=")][0]
if raw.lstrip("-").isdigit():
    sys.exit("lr arrived written as an int: " + raw)
os.makedirs(a.out_dir, exist_ok=True)
mine = os.path.join(a.out_dir, "owner")
if os.path.exists(mine) and open(mine).read() != str(os.getpid()):
    others = open(mine).read()
    if os.path.exists("/proc/" + others):
        sys.exit("another live trial writes into " + a.out_dir)
open(mine, "w").write(str(os.getpid()))
import math
base = (math.log10(a.lr) + 2.0) ** 2 + ((a.width - 20) / 10.0) ** 2 + (0.0 if a.act == "gelu" else 0.2)
for step in range(1, a.steps + 1):
    time.sleep(a.sleep)
    print("val_loss: %.6f" % (base + 1.0 / step), flush=True)
'''

BOWL_TOML = '''
[experiment]
name = "{name}"
run = "python train.py --out_dir={{checkpoint_dir}}/out {{args}}"
metric = "val_loss"
direction = "minimize"
fixed = {{ steps = 3 }}

[space]
lr = {{ type = "float", low = 1e-4, high = 1.0, log = true, default = 1e-3 }}
width = {{ type = "int", low = 2, high = 64, default = 4 }}
act = {{ type = "choice", values = ["relu", "gelu"], default = "relu" }}
'''


def folder(tmp: Path, toml: str, script: str = BOWL, name: str = "mine", script_name: str = "train.py") -> Path:
    """A fresh project folder `tmp/name` holding the script and its autoresearch.toml."""
    root = tmp / name
    root.mkdir(parents=True, exist_ok=True)
    (root / script_name).write_text(textwrap.dedent(script).lstrip())
    (root / "autoresearch.toml").write_text(textwrap.dedent(toml).lstrip())
    return root
