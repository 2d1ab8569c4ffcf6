"""Build the tabular volume: a Delta table of a known generative process, exported to Parquet for training.

Each row has six numeric features x0..x5 ~ N(0, 1), two categorical features c0 (12 levels, skewed
frequencies) and c1 (6 levels), and a target

    y = mean(x, c0, c1) + noise,   noise ~ N(0, 0.5^2)

where `mean` (below) mixes per-level offsets, a level-dependent slope, a sine, a product of two features,
a hinge and a square. No model can beat the noise: the best achievable validation MSE is 0.25 in
expectation, and exactly `bayes_mse` (the noise's mean square on the validation rows, in the manifest) on
this table. The table is written as a Delta table (delta-rs, in chunks: never all rows in memory) with a
`split` column, then exported three times with `runtime.data.parquet_export` (`--where "split = 'train'"`,
`'val'` and `'test'`), the way a team exports a large table to a volume. About 20% of the rows are
validation (the same rows as in version 1, which had no test split) and 10% test, taken from version 1's
training rows; only the end of a run scores the test rows (`test_mse`): no search decision reads them.

    $AUTORESEARCH_HOME/volumes/tabular-<rows>/delta/  train/  val/  test/  MANIFEST.json

Runs by itself the first time a trial needs the data (`ensure(rows)`), safely when several jobs start at
once. By hand: `python -m experiments.tabular.prepare --rows 1000000 [--out DIR]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.common import prepare_once, read_manifest

NAME = "tabular"
VERSION = 2  # bump when the process or layout changes: old volumes are rebuilt
NOISE_STD = 0.5
VAL_FRACTION = 0.2
TEST_FRACTION = 0.1
NUMERIC = tuple(f"x{i}" for i in range(6))
LEVELS = {"c0": 12, "c1": 6}
CHUNK_ROWS = 1 << 20
ROW_GROUP_ROWS = 16384
FILES = 4


def _coefficients():
    import numpy as np

    rng = np.random.default_rng(20240611)  # fixed: the process is part of the experiment's definition
    return {"offset": rng.normal(0.0, 1.0, LEVELS["c0"]), "slope": rng.normal(0.0, 0.8, LEVELS["c1"]),
            "c0_p": rng.dirichlet(np.full(LEVELS["c0"], 0.7))}


def mean(x, c0, c1):
    """E[y | features]: x is (n, 6) float, c0 and c1 integer codes. The best any model can predict."""
    import numpy as np

    k = _coefficients()
    return (k["offset"][c0] + k["slope"][c1] * x[:, 0] + np.sin(2.0 * x[:, 1]) + 0.7 * x[:, 2] * x[:, 3]
            + 0.8 * np.maximum(x[:, 4], 0.0) - 0.3 * x[:, 5] ** 2 + 0.3)


def _chunk(start: int, rows: int):
    """Rows [start, start + rows) of the table, the same whatever the chunking (seeded by chunk index)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng([7, start // CHUNK_ROWS])
    k = _coefficients()
    x = rng.standard_normal((rows, len(NUMERIC)))
    c0 = rng.choice(LEVELS["c0"], size=rows, p=k["c0_p"])
    c1 = rng.integers(0, LEVELS["c1"], size=rows)
    mu = mean(x, c0, c1)
    noise = rng.normal(0.0, NOISE_STD, rows)
    draw = rng.random(rows)  # one draw a row: the validation rows do not depend on TEST_FRACTION
    split = np.where(draw < VAL_FRACTION, "val", np.where(draw < VAL_FRACTION + TEST_FRACTION, "test", "train"))
    cols = {"id": np.arange(start, start + rows, dtype=np.int64), "split": split}
    cols.update({name: x[:, i].astype(np.float32) for i, name in enumerate(NUMERIC)})
    cols.update({"c0": c0.astype(np.int32), "c1": c1.astype(np.int32), "y": (mu + noise).astype(np.float32),
                 "noise": noise.astype(np.float32)})
    return pa.table(cols)


def build(out: Path, rows: int) -> dict:
    """Write the Delta table and its three exports into the empty directory `out`; return manifest facts."""
    import pyarrow.compute as pc
    from deltalake import write_deltalake

    from runtime.data.parquet_export import ExportConfig, export_delta

    table_uri = str(out / "delta")
    noise_sq = val_rows = 0.0
    for start in range(0, rows, CHUNK_ROWS):
        chunk = _chunk(start, min(CHUNK_ROWS, rows - start))
        val = chunk.filter(pc.equal(chunk.column("split"), "val"))
        noise_sq += float(pc.sum(pc.multiply(pc.cast(val.column("noise"), "float64"),
                                             pc.cast(val.column("noise"), "float64"))).as_py() or 0.0)
        val_rows += val.num_rows
        write_deltalake(table_uri, chunk, mode="append")
    columns = ["id", *NUMERIC, "c0", "c1", "y"]  # not `split` (constant per export) nor `noise` (the answer)
    facts = {"rows": rows, "noise_std": NOISE_STD, "bayes_mse": noise_sq / max(val_rows, 1), "levels": LEVELS,
             "numeric": list(NUMERIC), "target": "y", "delta": "delta"}
    for split in ("train", "val", "test"):
        manifest = export_delta(ExportConfig(table_uri, str(out / split), files=FILES, columns=columns,
                                             where=f"split = '{split}'", row_group_rows=ROW_GROUP_ROWS))
        facts[f"{split}_rows"] = manifest["rows"]
    return facts


def ensure(rows: int, target: Path | None = None) -> Path:
    """The volume directory for `rows` rows, built on first use (idempotent; concurrent callers wait)."""
    from experiments.common import volume_dir

    return prepare_once(NAME, VERSION, lambda out: build(out, rows), target or volume_dir(f"{NAME}-{rows}"))


def facts(volume: Path) -> dict:
    """The manifest of a built volume (rows per split, bayes_mse, ...)."""
    manifest = read_manifest(volume)
    if manifest is None:
        raise FileNotFoundError(f"no tabular volume at {volume}")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows in the table (default 100,000)")
    parser.add_argument("--out", type=Path, default=None, help="volume directory (default: under the home)")
    args = parser.parse_args(argv)
    print(ensure(args.rows, args.out))


if __name__ == "__main__":
    main()
