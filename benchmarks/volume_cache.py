"""VolumeDataset against what users do by hand, side by side on one slow FUSE volume, printing ratios.

    python benchmarks/volume_cache.py                 # ~5,000 files of 150 KiB, 5 ms per open
    python benchmarks/volume_cache.py --files 1000    # a quicker run

Contenders, all on the same mount in one run: serial `cp -r`; the parallel-copy recipe
`find | xargs -P 64 cp --parents` (and how many files it lost); a VolumeDataset cold epoch (listing
included) and warm epoch; reading every file straight from the volume (one reader, and 16 threads); and
our loader and torch's DataLoader (same dataset, workers, prefetch; alternating) feeding a simulated 20 ms
compute step, with the share of time spent waiting for data and the ratio between the two.
Aims: cold >= the xargs recipe, warm >= 20x direct reads, data wait < 5% from the second epoch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

from runtime.data.dataset import VolumeDataset  # noqa: E402
from runtime.data.loader import DataLoader  # noqa: E402
from tests.support.slowfs import SlowVolume, fuse_unavailable_reason  # noqa: E402


def read_bytes(path: str) -> int:
    """What a decoder does first: read the whole file. Module level, so worker processes can use it."""
    with open(path, "rb") as fh:
        return len(fh.read())


def make_source(root: Path, files: int, size: int, per_dir: int) -> list[str]:
    rels = []
    for i in range(files):
        rel = f"class{i // per_dir:04d}/img{i:06d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(size))
        rels.append(rel)
    return rels


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def listed(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def make_loader(kind: str, mount: Path, cache: Path):
    """Our DataLoader, or torch's with the same dataset, workers, persistence and prefetch (the real peer)."""
    ds = VolumeDataset(mount, cache_dir=str(cache), transform=read_bytes)
    if kind == "ours":
        return DataLoader(ds, batch_size=32, num_workers=2)
    return torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2, persistent_workers=True, prefetch_factor=4,
                                       pin_memory=torch.cuda.is_available())


def loader_epochs(dl, epochs: int, step_s: float) -> list[tuple[float, float, float]]:
    """(data wait, total, median wait per batch) seconds per epoch of a loop with a fixed compute step."""
    out = []
    for _ in range(epochs):
        waits, t0 = [], time.perf_counter()
        it = iter(dl)
        while True:
            t = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t)
            time.sleep(step_s)  # the model's step; the GIL is free, as it is while a GPU kernel runs
        out.append((sum(waits), time.perf_counter() - t0, sorted(waits)[len(waits) // 2]))
    return out


def compare_loaders(source: Path, cache: Path, args) -> dict[str, list]:
    """Our loader and torch's, alternating `args.loader_rounds` times, 3 epochs each."""
    print("loaders with a simulated compute step (ours and torch's, alternating) ...", flush=True)
    epochs: dict[str, list] = {"ours": [], "torch": []}
    for _ in range(args.loader_rounds):
        for kind in epochs:
            dl = make_loader(kind, source, cache)
            epochs[kind].append(loader_epochs(dl, 3, args.step_ms / 1000))
            del dl
    return epochs


def report_loaders(epochs: dict[str, list]) -> None:
    share = {}
    for kind, rounds in epochs.items():
        for r_i, per_epoch in enumerate(rounds, 1):
            for i, (wait, total, median) in enumerate(per_epoch, 1):
                print(f"  {kind:5} loader, round {r_i}, epoch {i}: data wait {100 * wait / total:5.1f}% of the epoch, "
                      f"median {median * 1000:.2f} ms per batch" + ("" if i > 1 or r_i > 1 else "  (cold)"))
        warm = [(w, t, m) for per_epoch in rounds for w, t, m in per_epoch[1:]]
        share[kind] = (sum(w for w, _, _ in warm) / sum(t for _, t, _ in warm),
                       statistics.median(m for _, _, m in warm))
    print(f"  from the second epoch: our loader waits {100 * share['ours'][0]:.1f}% of the time (aim < 5%), torch's "
          f"DataLoader {100 * share['torch'][0]:.1f}%: {share['ours'][0] / share['torch'][0]:.2f}x; median per batch "
          f"{share['ours'][1] * 1000:.2f} vs {share['torch'][1] * 1000:.2f} ms: {share['ours'][1] / share['torch'][1]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--size-kib", type=int, default=150)
    parser.add_argument("--per-dir", type=int, default=100, help="files per directory (class folders)")
    parser.add_argument("--open-latency", type=float, default=0.005, help="seconds added to every open")
    parser.add_argument("--bandwidth-mib", type=float, default=1024, help="volume bandwidth cap, MiB/s")
    parser.add_argument("--step-ms", type=float, default=20)
    parser.add_argument("--loader-rounds", type=int, default=2, help="alternating runs of each loader")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--loader-only", action="store_true",
                        help="only the two loaders, on a local directory (no FUSE needed; epochs 2+ read the cache)")
    args = parser.parse_args()
    if args.loader_only:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="volume-bench-"))
        try:
            make_source(work / "src", args.files, args.size_kib << 10, args.per_dir)
            epochs = compare_loaders(work / "src", work / "cache", args)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"\n{args.files} files x {args.size_kib} KiB, local directory; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}; CUDA {'available (pinned batches)' if torch.cuda.is_available() else 'absent'}")
        report_loaders(epochs)
        return
    reason = fuse_unavailable_reason()
    if reason:
        sys.exit(f"cannot mount the slow volume: {reason}")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volume-bench-"))
    src, mnt = work / "src", work / "mnt"
    print(f"writing {args.files} files of {args.size_kib} KiB ...", flush=True)
    rels = set(make_source(src, args.files, args.size_kib << 10, args.per_dir))
    vol = SlowVolume(src, mnt, open_latency=args.open_latency, bandwidth=args.bandwidth_mib * (1 << 20))
    r: dict[str, float] = {}
    try:
        print("serial cp -r ...", flush=True)
        r["cp -r (serial)"], _ = timed(lambda: subprocess.run(["cp", "-r", str(mnt), str(work / "cp")], check=True))

        print("find | xargs -P 64 cp --parents ...", flush=True)
        dest = work / "xargs"
        dest.mkdir()
        recipe = f"find . -type f | xargs -P 64 -I{{}} cp --parents {{}} {dest}"
        r["xargs -P 64 cp --parents"], _ = timed(
            lambda: subprocess.run(recipe, shell=True, cwd=mnt, stderr=subprocess.DEVNULL))
        lost = len(rels - listed(dest))

        print("VolumeDataset cold and warm epochs ...", flush=True)
        cache = work / "cache"

        def cold():
            ds = VolumeDataset(mnt, cache_dir=str(cache), transform=read_bytes)  # listing included
            return ds, sum(ds)

        r["VolumeDataset cold epoch"], (ds, nbytes) = timed(cold)
        r["VolumeDataset warm epoch"], _ = timed(lambda: sum(ds))
        r["VolumeDataset warm epoch, new job (listing)"], _ = timed(
            lambda: sum(VolumeDataset(mnt, cache_dir=str(cache), transform=read_bytes)))
        opens_before = vol.stats()["opens"]
        print("direct volume reads ...", flush=True)
        paths = sorted(str(mnt / rel) for rel in rels)
        r["direct reads, 1 reader"], _ = timed(lambda: sum(map(read_bytes, paths)))
        with ThreadPoolExecutor(16) as pool:
            r["direct reads, 16 threads"], _ = timed(lambda: sum(pool.map(read_bytes, paths)))
        assert vol.stats()["opens"] - opens_before == 2 * len(paths)

        epochs = compare_loaders(mnt, work / "cache-loader", args)
    finally:
        vol.close()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.files} files x {args.size_kib} KiB = {nbytes / 2**20:.0f} MiB; volume: "
          f"{args.open_latency * 1000:g} ms per open, {args.bandwidth_mib:g} MiB/s cap; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} (other work on this machine inflates every figure)")
    base = r["cp -r (serial)"]
    for name, sec in r.items():
        print(f"  {name:<44} {sec:8.2f} s   {base / sec:7.1f}x serial cp")
    print(f"  xargs recipe lost {lost} of {args.files} files")
    cold_vs_xargs = r["xargs -P 64 cp --parents"] / r["VolumeDataset cold epoch"]
    warm_vs_direct = r["direct reads, 1 reader"] / r["VolumeDataset warm epoch"]
    warm_vs_threads = r["direct reads, 16 threads"] / r["VolumeDataset warm epoch"]
    print("ratios:")
    print(f"  cold epoch vs xargs recipe:              {cold_vs_xargs:6.2f}x faster  (aim >= 1)")
    print(f"  warm epoch vs direct reads (1 reader):   {warm_vs_direct:6.1f}x faster  (aim >= 20)")
    print(f"  warm epoch vs direct reads (16 threads): {warm_vs_threads:6.1f}x faster")
    report_loaders(epochs)

if __name__ == "__main__":
    main()
