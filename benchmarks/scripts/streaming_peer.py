"""MosaicML Streaming's side of benchmarks/shards.py, run by the python of a separate venv that has it.

    python streaming_peer.py pack SRC OUT SHARD_BYTES   # MDSWriter over SRC's files -> OUT (MDS shards)
    python streaming_peer.py read REMOTE LOCAL          # one cold epoch of StreamingDataset(REMOTE, LOCAL)

Each prints one JSON line: {"seconds": ..., "bytes": ..., "samples": ...}. Packing reads the source with 64
threads in order (as a user feeding MDSWriter would) and writes one sequential stream of shards, uncompressed,
of the benchmark's shard size; the epoch reads every byte of every sample in one process, as the other
contenders do.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pack(src: str, out: str, shard_bytes: int) -> dict:
    from streaming import MDSWriter

    paths = sorted(os.path.join(d, n) for d, _, names in os.walk(src) for n in names)
    t0, total = time.perf_counter(), 0
    with ThreadPoolExecutor(64) as pool, MDSWriter(out=out, columns={"key": "str", "data": "bytes"},
                                                   size_limit=shard_bytes) as writer:
        for path, data in zip(paths, pool.map(_read, paths)):
            writer.write({"key": os.path.relpath(path, src), "data": data})
            total += len(data)
    return {"seconds": time.perf_counter() - t0, "bytes": total, "samples": len(paths)}


def read(remote: str, local: str) -> dict:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    t0, total, n = time.perf_counter(), 0, 0
    dataset = StreamingDataset(remote=remote, local=local, shuffle=False, batch_size=1)
    for sample in dataset:
        total += len(sample["data"])
        n += 1
    return {"seconds": time.perf_counter() - t0, "bytes": total, "samples": n}


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    out = pack(rest[0], rest[1], int(rest[2])) if mode == "pack" else read(rest[0], rest[1])
    print(json.dumps(out), flush=True)
