"""One cold ShardDataset epoch over the slow FUSE volume, alone, several rounds: its time over the volume's floor
(the bytes over its bandwidth cap) and the CPU it took, the reader's and the volume daemon's, each round with an
empty cache. For comparing changes to the copy path: run it at two commits, alternated, on the same machine.

    python benchmarks/shard_epoch.py --rounds 3 [--readahead-kb 1024] [--open-latency 0.05]
    for i in 1 2 3; do git checkout -q OLD -- runtime; python benchmarks/shard_epoch.py; \
                       git checkout -q NEW -- runtime; python benchmarks/shard_epoch.py; done

The pack (5,000 files of 150 KiB in 3 shards of 256 MiB, as benchmarks/shards.py) is written once under --workdir
and kept for the next run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.shards import add_volume_args, make_source, sample_len  # noqa: E402  (the same volume)
from runtime.data.packing import PackConfig, pack  # noqa: E402
from runtime.data.shards import ShardDataset  # noqa: E402
from tests.support.slowfs import SlowVolume, fuse_unavailable_reason  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_volume_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shard-epoch-bench"))
    args = parser.parse_args()
    reason = fuse_unavailable_reason()
    if reason:
        sys.exit(f"cannot mount the slow volume: {reason}")
    work = Path(args.workdir)
    vol_dir = work / f"vol-{args.files}x{args.size_kib}k-{args.shard_mib}m"
    if not (vol_dir / "shards" / "index.json").exists():
        print(f"writing and packing {args.files} files of {args.size_kib} KiB ...", flush=True)
        make_source(vol_dir / "files", args.files, args.size_kib << 10, 100)
        pack(PackConfig(str(vol_dir / "files"), str(vol_dir / "shards"), shard_size=args.shard_mib << 20))
        shutil.rmtree(vol_dir / "files")
    cache = work / "cache"
    times, mine, daemon = [], [], []
    with SlowVolume(vol_dir, work / "mnt", open_latency=args.open_latency,
                    bandwidth=args.bandwidth_mib * (1 << 20), readahead_kb=args.readahead_kb) as vol:
        nbytes = 0
        for n in range(args.rounds):
            shutil.rmtree(cache, ignore_errors=True)
            ds = ShardDataset(str(work / "mnt" / "shards"), cache_dir=str(cache), transform=sample_len)
            c0, d0, t0 = os.times(), cpu_seconds(vol.pid), time.perf_counter()
            nbytes = sum(ds)
            times.append(time.perf_counter() - t0)
            c1 = os.times()
            mine.append(c1.user - c0.user + c1.system - c0.system)
            daemon.append(cpu_seconds(vol.pid) - d0)
            print(f"  round {n + 1}: {times[-1]:.3f} s, reader {mine[-1]:.2f} CPU-s, daemon {daemon[-1]:.2f} CPU-s",
                  flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    floor = nbytes / (args.bandwidth_mib * 2**20)
    print(f"cold epoch over the floor: fastest {min(times) / floor:.2f}x, "
          f"median {statistics.median(times) / floor:.2f}x; CPU per epoch (median): "
          f"reader {statistics.median(mine):.2f} s, volume daemon "
          f"{statistics.median(daemon):.2f} s ({args.open_latency * 1000:g} ms per open, readahead "
          f"{args.readahead_kb or 128} KiB, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
