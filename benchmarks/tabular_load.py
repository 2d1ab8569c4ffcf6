"""ParquetDataset against the usual recipes for a table exported to Parquet on a slow volume, side by side,
printing ratios: rows per second and peak memory of one full, shuffled epoch in batches of 1,024 rows.

    python benchmarks/tabular_load.py                  # 1,000,000 rows, 5 ms per open, 200 MiB/s
    python benchmarks/tabular_load.py --rows 200000    # a quicker run

Contenders, each in a fresh process (peak RSS: the kernel's VmHWM of that process), cold (nothing
cached: the files come through the slow FUSE volume) and then warm:
- ParquetDataset: streams row groups through the local cache, shuffles per row group and window.
- pandas.read_parquet of the whole table, then shuffled batches (pandas has no cache: warm = page cache).
- Hugging Face datasets.load_dataset("parquet"), the seed's recipe: builds its Arrow cache on the first run,
  memory-maps it afterwards; shuffle() + iter(batch_size) with the torch format.
Every contender yields the same thing per batch: a dict of torch tensors of the chosen columns.
Aim: rows/s >= the faster of the two peers at a fraction of their memory.

`datasets` and `pandas` are benchmark-only (pip install 'autoresearch[bench]'); the FUSE volume needs
fuse3 and mfusepy, as for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 1024
COLUMNS = ["x0", "x1", "x2", "x3", "x4", "x5", "c0", "c1", "y"]


def status_kib(field: str) -> int:
    """A memory figure of this process from the kernel (VmRSS now, VmHWM: the peak RSS of this program;
    unlike wait4's ru_maxrss it does not inherit the parent's peak across fork and exec)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


# -- the contenders (run in a child process each) ---------------------------------------------------------------
def run_parquet_dataset(data: Path, cache: Path) -> int:
    from runtime.data.parquet import ParquetDataset

    ds = ParquetDataset(str(data), columns=COLUMNS, batch_rows=BATCH, seed=0, cache_dir=str(cache))
    return sum(len(batch["y"]) for batch in ds)


def run_pandas(data: Path, cache: Path) -> int:
    import numpy as np
    import pandas as pd
    import torch

    files = sorted(str(p) for p in data.glob("*.parquet"))
    df = pd.read_parquet(files, columns=COLUMNS)
    order = np.random.default_rng(0).permutation(len(df))
    rows = 0
    for lo in range(0, len(df), BATCH):
        part = df.iloc[order[lo:lo + BATCH]]
        batch = {c: torch.from_numpy(part[c].to_numpy()) for c in COLUMNS}
        rows += len(batch["y"])
    return rows


def run_datasets(data: Path, cache: Path) -> int:
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    files = sorted(str(p) for p in data.glob("*.parquet"))
    ds = load_dataset("parquet", data_files=files, split="train", cache_dir=str(cache), columns=COLUMNS)
    ds = ds.shuffle(seed=0).with_format("torch")
    return sum(len(batch["y"]) for batch in ds.iter(batch_size=BATCH))


CONTENDERS = {"ParquetDataset": run_parquet_dataset, "pandas.read_parquet": run_pandas,
              "datasets.load_dataset": run_datasets}


def child(name: str, data: str, cache: str) -> None:
    import numpy  # noqa: F401  (imports are part of the baseline every contender pays)
    import pyarrow  # noqa: F401
    import torch  # noqa: F401

    if name == "ParquetDataset":
        import runtime.data.parquet  # noqa: F401
    if name == "datasets.load_dataset":
        import datasets  # noqa: F401
    if name == "pandas.read_parquet":
        import pandas  # noqa: F401
    base = status_kib("VmRSS")
    t0 = time.perf_counter()
    rows = CONTENDERS[name](Path(data), Path(cache))
    seconds = time.perf_counter() - t0
    print(json.dumps({"rows": rows, "seconds": seconds, "base_kib": base, "peak_kib": status_kib("VmHWM")}))


def measure(name: str, data: Path, cache: Path) -> dict:
    """Run one contender in a fresh process (its memory peak is its own, measured by the kernel)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", name, str(data), str(cache)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["rows_per_s"] = result["rows"] / result["seconds"]
    return result


# -- setup and report --------------------------------------------------------------------------------------------
def build(work: Path, rows: int) -> Path:
    """The tabular experiment's table (a Delta table of a known process), exported like prepare does."""
    from experiments.tabular import prepare

    volume = prepare.ensure(rows, work / "volume")
    return volume / "train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--open-latency", type=float, default=0.005, help="seconds added to every open")
    parser.add_argument("--bandwidth-mib", type=float, default=200, help="volume bandwidth cap, MiB/s")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", nargs=3, metavar=("NAME", "DATA", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)

    from tests.support.slowfs import SlowVolume, fuse_unavailable_reason

    reason = fuse_unavailable_reason()
    if reason:
        sys.exit(f"cannot mount the slow volume: {reason}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tabular-bench-"))
    print(f"preparing {args.rows:,} rows (Delta table, exported to Parquet) ...", flush=True)
    export = build(work, args.rows)
    size = sum(p.stat().st_size for p in export.glob("*.parquet"))
    vol = SlowVolume(export.parent, work / "mnt", open_latency=args.open_latency,
                     bandwidth=args.bandwidth_mib * (1 << 20))
    results: dict[tuple[str, str], dict] = {}
    try:
        data = work / "mnt" / "train"
        for name in CONTENDERS:
            cache = work / "cache" / name
            shutil.rmtree(cache, ignore_errors=True)
            for phase in ("cold", "warm"):
                print(f"{name} {phase} ...", flush=True)
                results[(name, phase)] = measure(name, data, cache)
    finally:
        vol.close()
    expected = results[("ParquetDataset", "cold")]["rows"]
    assert all(r["rows"] == expected for r in results.values()), "every contender read the whole table"

    print(f"\n{expected:,} training rows, {size / 2**20:.1f} MiB of Parquet on a volume with "
          f"{args.open_latency * 1000:.0f} ms per open and {args.bandwidth_mib:.0f} MiB/s; batches of {BATCH}")
    print(f"{'contender':24} {'phase':5} {'seconds':>8} {'rows/s':>12} {'peak RSS':>10} {'above imports':>14}")
    for (name, phase), r in results.items():
        print(f"{name:24} {phase:5} {r['seconds']:8.2f} {r['rows_per_s']:12,.0f} {r['peak_kib'] / 1024:8.0f}Mi "
              f"{(r['peak_kib'] - r['base_kib']) / 1024:12.0f}Mi")
    print()
    for phase in ("cold", "warm"):
        ours = results[("ParquetDataset", phase)]
        peers = [results[(n, phase)] for n in CONTENDERS if n != "ParquetDataset"]
        fastest = max(peers, key=lambda r: r["rows_per_s"])
        name = next(n for n in CONTENDERS if results.get((n, phase)) is fastest)
        speed = ours["rows_per_s"] / fastest["rows_per_s"]
        memory = [(ours["peak_kib"] - ours["base_kib"]) / max(1, p["peak_kib"] - p["base_kib"]) for p in peers]
        print(f"{phase}: ParquetDataset rows/s = {speed:.2f}x the faster peer ({name}); memory above imports = "
              + ", ".join(f"{m:.2f}x {n}" for m, n in zip(memory, [n for n in CONTENDERS if n != "ParquetDataset"])))


if __name__ == "__main__":
    main()
