"""Tables whose rows name themselves (an `id` column, and `x = id / 2`), written as plain Parquet files or as
a Delta table, so the tests can see exactly which rows a rank, worker or resumed run got."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa


def id_table(start: int, rows: int) -> pa.Table:
    """Rows `start` .. `start + rows - 1`: id, x = id / 2 (float32), and a string tag."""
    ids = np.arange(start, start + rows, dtype=np.int64)
    return pa.table({"id": ids, "x": (ids / 2).astype(np.float32),
                     "tag": pa.array([f"r{i}" for i in ids]), "split": np.where(ids % 4 == 0, "val", "train")})


def write_parquet(root: Path, sizes: list[int], row_group_rows: int) -> list[Path]:
    """One Parquet file per entry of `sizes` (its row count), ids consecutive across files."""
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for i, rows in enumerate(sizes):
        path = root / f"part-{i:03d}.parquet"
        pq.write_table(id_table(start, rows), path, row_group_size=row_group_rows)
        paths.append(path)
        start += rows
    return paths


def write_delta(uri: Path, rows: int, chunks: int = 1) -> None:
    """A Delta table of `rows` id rows, committed in `chunks` appends (so it has several versions)."""
    from deltalake import write_deltalake

    per = -(-rows // chunks)
    for start in range(0, rows, per):
        write_deltalake(str(uri), id_table(start, min(per, rows - start)), mode="append")
