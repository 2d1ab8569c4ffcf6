"""Packed tar shards against small files, side by side on one slow FUSE volume, printing ratios.

    python benchmarks/shards.py                  # 5,000 files of 150 KiB, 5 ms per open, 1 GiB/s cap
    python benchmarks/shards.py --files 1000     # a quicker run

One volume holds the small files and, once packed, their shards (`autoresearch data pack`, 256 MiB shards by
default here: a few per reader, as WebDataset advises at least as many shards as workers). Contenders, on the same
mount in one run, each cold with its own empty cache:
- packing itself (runtime.data.packing.pack, SRC over the volume) against the parallel-copy recipe
  `find | xargs -P 64 cp --parents` copying the same files to local disk;
- one cold epoch of ShardDataset over the shards, of VolumeDataset over the small files, and of the `webdataset`
  library over the same shards (it streams them straight from the volume: no cache);
- a warm ShardDataset epoch against reading the small files from local disk (the page cache: the floor);
- MosaicML Streaming, from a separate venv (`--streaming-python`; never installed into this one: it downgrades
  the environment's packages, and it imports torchvision, which has no build for a CPU torch 2.13): MDSWriter
  over the same files (benchmarks/scripts/streaming_peer.py) against `pack`, and a cold StreamingDataset epoch
  over its MDS shards on the same volume against ShardDataset's. Such a venv, on x86_64:
  `python -m venv /tmp/streamvenv && /tmp/streamvenv/bin/pip install torch==2.14.1 torchvision==0.29.1
  mosaicml-streaming`. Without one (or where it does not import) it is reported as skipped with the reason.
Every epoch reads every byte of every sample (the transform returns its length) in one process, no workers.
Each contender runs `--rounds` times, alternating with the others, and its fastest run counts.
Aims: cold epoch >= 5x VolumeDataset and >= webdataset; packing no slower than the recipe.
"""

from __future__ import annotations

import argparse
import glob
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

from runtime.data.dataset import VolumeDataset  # noqa: E402
from runtime.data.packing import PackConfig, pack  # noqa: E402
from runtime.data.shards import ShardDataset  # noqa: E402
from tests.support.slowfs import SlowVolume, fuse_unavailable_reason  # noqa: E402


def file_len(path: str) -> int:
    with open(path, "rb") as fh:
        return len(fh.read())


def sample_len(sample: dict) -> int:
    return sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def make_source(root: Path, files: int, size: int, per_dir: int) -> None:
    for i in range(files):
        path = root / f"class{i // per_dir:04d}" / f"img{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def streaming_reason(python: str) -> str | None:
    """Why MosaicML Streaming cannot run from `python` (a separate venv that has it), or None when it imports."""
    done = subprocess.run([python, "-c", "import streaming"], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {done.returncode}"


def streaming_peer(python: str, mode: str, *args: object) -> dict:
    """One run of benchmarks/scripts/streaming_peer.py under `python` (Streaming's own venv): its JSON line."""
    script = Path(__file__).resolve().parent / "scripts" / "streaming_peer.py"
    done = subprocess.run([python, str(script), mode, *map(str, args)], capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"streaming_peer {mode} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def add_volume_args(parser: argparse.ArgumentParser) -> None:
    """The files, their pack and the slow volume, as this benchmark and benchmarks/shard_epoch.py take them."""
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--size-kib", type=int, default=150)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--open-latency", type=float, default=0.005, help="seconds added to every open")
    parser.add_argument("--bandwidth-mib", type=float, default=1024, help="volume bandwidth cap, MiB/s")
    parser.add_argument("--readahead-kb", type=int, default=None,
                        help="the volume's readahead window (default: FUSE's 128 KiB; 1024 reads 1 MiB per request, "
                             "as network filesystems do; needs root)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_volume_args(parser)
    parser.add_argument("--per-dir", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="each contender's fastest of this many runs")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time what bounds a cold epoch: the shards' copy into the cache alone, and `cat` of "
                             "the shards to /dev/null and to a local file (one sequential stream each)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--streaming-python", default=None,
                        help="python of a separate venv with mosaicml-streaming (never this one: it downgrades "
                             "packages)")
    args = parser.parse_args()
    reason = fuse_unavailable_reason()
    if reason:
        sys.exit(f"cannot mount the slow volume: {reason}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="shards-bench-"))
    vol_dir, mnt = work / "vol", work / "mnt"
    print(f"writing {args.files} files of {args.size_kib} KiB ...", flush=True)
    make_source(vol_dir / "files", args.files, args.size_kib << 10, args.per_dir)
    vol = SlowVolume(vol_dir, mnt, open_latency=args.open_latency, bandwidth=args.bandwidth_mib * (1 << 20),
                     readahead_kb=args.readahead_kb)
    r: dict[str, float] = {}

    def best(name: str, fn) -> object:
        """Run `fn`, keep the fastest time of the rounds: other work on a shared machine only ever adds time."""
        sec, out = timed(fn)
        r[name] = min(sec, r.get(name, sec))
        return out

    peer = streaming_reason(args.streaming_python) if args.streaming_python else "no --streaming-python given"
    try:
        import webdataset as wds

        for n in range(1, args.rounds + 1):
            print(f"round {n}/{args.rounds}: packing (SRC over the volume) ...", flush=True)
            shutil.rmtree(vol_dir / "shards", ignore_errors=True)
            index = best("pack", lambda: pack(PackConfig(mnt / "files", vol_dir / "shards",
                                                         shard_size=args.shard_mib << 20)))
            print("  find | xargs -P 64 cp --parents ...", flush=True)
            dest = work / "xargs"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            recipe = f"find . -type f | xargs -P 64 -I{{}} cp --parents {{}} {dest}"
            best("xargs recipe", lambda: subprocess.run(recipe, shell=True, cwd=mnt / "files",
                                                        stderr=subprocess.DEVNULL))
            lost = args.files - sum(1 for p in dest.rglob("*") if p.is_file())

            print("  cold epochs: ShardDataset, VolumeDataset, webdataset ...", flush=True)
            for cache in ("cache-shards", "cache-files"):
                shutil.rmtree(work / cache, ignore_errors=True)
            cold = ShardDataset(mnt / "shards", cache_dir=str(work / "cache-shards"), transform=sample_len)
            nbytes = best("ShardDataset cold", lambda: sum(cold))
            vbytes = best("VolumeDataset cold", lambda: sum(VolumeDataset(mnt / "files", transform=file_len,
                                                                          cache_dir=str(work / "cache-files"))))
            urls = sorted(glob.glob(str(mnt / "shards" / "*.tar")))
            wbytes = best("webdataset", lambda: sum(map(sample_len, wds.WebDataset(urls, shardshuffle=False,
                                                                                   empty_check=False))))
            assert nbytes == vbytes == wbytes == args.files * (args.size_kib << 10), (nbytes, vbytes, wbytes)

            print("  warm epoch and local reads ...", flush=True)
            opens = vol.stats()["opens"]
            best("ShardDataset warm", lambda: sum(cold))
            assert vol.stats()["opens"] == opens, "a warm epoch never touches the volume"
            local = sorted(str(p) for p in (vol_dir / "files").rglob("*.jpg"))
            best("local reads", lambda: sum(map(file_len, local)))

            if args.breakdown:
                print("  breakdown: the copy alone, cat to /dev/null, cat to a local file ...", flush=True)
                shutil.rmtree(work / "cache-copy", ignore_errors=True)
                copier = ShardDataset(mnt / "shards", cache_dir=str(work / "cache-copy"))
                best("copy alone", lambda: [copier.fetch(s).release() for s in range(len(copier.shards))])
                shards = " ".join(sorted(glob.glob(str(mnt / "shards" / "*.tar"))))
                best("cat to /dev/null", lambda: subprocess.run(f"cat {shards} > /dev/null", shell=True))
                best("cat to a file", lambda: subprocess.run(f"cat {shards} > {work / 'cat.out'}", shell=True))
                os.unlink(work / "cat.out")

            if peer is None:
                print("  MosaicML Streaming: MDSWriter, then a cold StreamingDataset epoch ...", flush=True)
                shutil.rmtree(vol_dir / "mds", ignore_errors=True)
                shutil.rmtree(work / "cache-mds", ignore_errors=True)
                packed = streaming_peer(args.streaming_python, "pack", mnt / "files", vol_dir / "mds",
                                        args.shard_mib << 20)
                r["streaming pack"] = min(packed["seconds"], r.get("streaming pack", packed["seconds"]))
                epoch = streaming_peer(args.streaming_python, "read", mnt / "mds", work / "cache-mds")
                assert epoch["bytes"] == nbytes and epoch["samples"] == args.files, epoch
                r["streaming cold"] = min(epoch["seconds"], r.get("streaming cold", epoch["seconds"]))
    finally:
        vol.close()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.files} files x {args.size_kib} KiB = {nbytes / 2**20:.0f} MiB in {len(index['shards'])} shards of "
          f"{args.shard_mib} MiB; volume: {args.open_latency * 1000:g} ms per open, {args.bandwidth_mib:g} MiB/s cap, "
          f"readahead {args.readahead_kb or 128} KiB; "
          f"fastest of {args.rounds} rounds each; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
          "(other work on this machine inflates every figure)")
    print("ratios (higher is better for packed shards):")
    print(f"  cold epoch, ShardDataset vs VolumeDataset on the small files: "
          f"{r['VolumeDataset cold'] / r['ShardDataset cold']:6.2f}x  (aim >= 5)")
    print(f"  cold epoch, ShardDataset vs the xargs recipe's copy alone:    "
          f"{r['xargs recipe'] / r['ShardDataset cold']:6.2f}x  (the recipe lost {lost} of {args.files} files)")
    print(f"  cold epoch, ShardDataset vs webdataset on the same shards:    "
          f"{r['webdataset'] / r['ShardDataset cold']:6.2f}x  (aim >= 1)")
    print(f"  warm epoch, ShardDataset vs local reads of the small files:   "
          f"{r['local reads'] / r['ShardDataset warm']:6.2f}x")
    print(f"  packing vs the xargs recipe on the same files:                "
          f"{r['xargs recipe'] / r['pack']:6.2f}x  (aim >= 1)")
    # The volume cannot deliver the bytes faster than its cap: no reader of them, shards or not, takes less than
    # this floor, so VolumeDataset's time over it is the largest ratio any reader could show on this volume.
    floor = nbytes / (args.bandwidth_mib * 2**20)
    print(f"  the ceiling: VolumeDataset vs the cap's floor (bytes / cap):   "
          f"{r['VolumeDataset cold'] / floor:6.2f}x  (no reader can beat VolumeDataset by more here)")
    print(f"  ShardDataset's cold epoch over that floor:                    "
          f"{r['ShardDataset cold'] / floor:6.2f}x  (1.00x: every byte at the cap)")
    if args.breakdown:
        for name in ("copy alone", "cat to /dev/null", "cat to a file"):
            print(f"  {name + ' over the floor:':<62}{r[name] / floor:6.2f}x")
    if peer:
        print(f"  MosaicML Streaming: skipped: {peer}")
    else:
        print(f"  cold epoch, ShardDataset vs MosaicML Streaming (MDS shards):  "
              f"{r['streaming cold'] / r['ShardDataset cold']:6.2f}x  (aim >= 1)")
        print(f"  packing vs MosaicML Streaming's MDSWriter on the same files:  "
              f"{r['streaming pack'] / r['pack']:6.2f}x")


if __name__ == "__main__":
    main()
