"""Two real ranks through torchrun (gloo): equal per-rank counts (DDP never hangs on a tail), disjoint
slices whose union is the epoch, and a resume with a different worker count that finishes the epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from runtime.data.dataset import epoch_order, rank_order
from tests.support import write_files

ROOT = Path(__file__).resolve().parents[2]
N = 37  # odd: one file must be padded in so both ranks get 19

RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from runtime.data.dataset import VolumeDataset
from runtime.data.loader import DataLoader
from tests.support import sample_index

source, cache, out = sys.argv[1:4]
dist.init_process_group("gloo")
rank = dist.get_rank()

def make(workers):
    ds = VolumeDataset(source, cache_dir=cache, seed=5, transform=sample_index)
    return DataLoader(ds, batch_size=3, num_workers=workers)

first = make(2)
seen, steps = [], 0
for batch in first:
    seen += batch.tolist()
    steps += 1
    total = torch.tensor([steps]); dist.all_reduce(total)  # a collective per step, as DDP does
    if steps == 2:
        state = first.state_dict()
        break
resumed = make(1)
resumed.load_state_dict(json.loads(json.dumps(state)))
rest = []
for batch in resumed:
    rest += batch.tolist()
    total = torch.tensor([1]); dist.all_reduce(total)
gathered = [None, None]
dist.all_gather_object(gathered, {"seen": seen, "rest": rest, "state": state, "len": len(resumed.dataset)})
if rank == 0:
    with open(out, "w") as fh:
        json.dump(gathered, fh)
dist.destroy_process_group()
"""


def test_two_ranks_get_equal_disjoint_slices_and_resume_exactly(data_dir, tmp_path):
    ids = [int(Path(rel).stem) for rel in write_files(data_dir, N, size=256)]
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(data_dir), str(tmp_path / "cache"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(out.read_text())
    for rank, r in enumerate(ranks):
        expected = [ids[i] for i in rank_order(epoch_order(N, 5, 0), 0, rank, 2)]
        assert r["seen"] + r["rest"] == expected, "resumed with another worker count: none twice, none skipped"
        assert r["len"] == 19 and len(r["seen"]) + len(r["rest"]) == 19, "same sample count on every rank"
        assert r["state"]["samples_consumed"] == 2 * 3 * 2, "position counts both ranks"
    epoch = Counter(x for r in ranks for x in r["seen"] + r["rest"])
    assert set(epoch) == set(range(N)), "the ranks together cover every file"
    assert sum(epoch.values()) == N + 1 and list(epoch.values()).count(2) == 1, "exactly one padded repeat"
    assert not set(ranks[0]["seen"] + ranks[0]["rest"]) & set(ranks[1]["seen"] + ranks[1]["rest"]) - {
        x for x, c in epoch.items() if c == 2}, "rank slices are disjoint apart from the padding"
