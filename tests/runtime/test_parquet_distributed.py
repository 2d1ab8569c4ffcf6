"""Two real ranks through torchrun (gloo), two DataLoader workers each, over a real Delta export: equal row
and batch counts per rank, disjoint slices covering the table, and a mid-epoch resume (with one worker)
that delivers exactly the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from runtime.data.parquet_export import ExportConfig, export_delta
from tests.support.tabular import write_delta

ROOT = Path(__file__).resolve().parents[2]
N = 301  # odd: one row must be padded in so both ranks get 151

RANK_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from runtime.data.loader import DataLoader
from runtime.data.parquet import ParquetDataset

source, cache, out = sys.argv[1:4]
dist.init_process_group("gloo")
rank = dist.get_rank()

def make(workers):
    ds = ParquetDataset(source, columns=["id"], batch_rows=16, shuffle_rows=48, seed=5, cache_dir=cache)
    return DataLoader(ds, batch_size=None, num_workers=workers)

whole = [b["id"].tolist() for b in make(2)]
first = make(2)
seen, steps = [], 0
for batch in first:
    seen += batch["id"].tolist()
    steps += 1
    total = torch.tensor([steps]); dist.all_reduce(total)  # a collective per step, as DDP does
    if steps == 3:
        state = first.state_dict()
        break
resumed = make(1)
resumed.load_state_dict(json.loads(json.dumps(state)))
rest = []
for batch in resumed:
    rest += batch["id"].tolist()
    total = torch.tensor([1]); dist.all_reduce(total)
gathered = [None, None]
dist.all_gather_object(gathered, {"whole": whole, "seen": seen, "rest": rest, "len": len(first.dataset)})
if rank == 0:
    with open(out, "w") as fh:
        json.dump(gathered, fh)
dist.destroy_process_group()
"""


def test_two_ranks_two_workers_get_equal_disjoint_slices_and_resume_exactly(tmp_path):
    write_delta(tmp_path / "table", N, chunks=3)
    export_delta(ExportConfig(str(tmp_path / "table"), str(tmp_path / "export"), files=3, row_group_rows=20))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path / "export"), str(tmp_path / "cache"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(out.read_text())
    per_rank = -(-N // 2)
    for r in ranks:
        rows = [x for b in r["whole"] for x in b]
        assert len(rows) == per_rank and len(r["whole"]) == r["len"] == -(-per_rank // 16), \
            "same rows and same number of steps on every rank"
        assert all(len(b) == 16 for b in r["whole"][:-1]), "only the last batch of a rank may be short"
        assert sorted(r["seen"] + r["rest"]) == sorted(rows), "resumed with one worker: the rest, exactly"
        assert len(r["seen"]) == 3 * 16
    epoch = Counter(x for r in ranks for b in r["whole"] for x in b)
    assert set(epoch) == set(range(N)), "the ranks together cover every row"
    assert sum(epoch.values()) == N + 1 and list(epoch.values()).count(2) == 1, "exactly one padded repeat"
