"""`autoresearch data export-delta` as a user runs it, over real Delta tables: layout and manifest, one-line
errors with nothing written, a full disk, and an export killed half-way that is never read as complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from orchestrator.faces.cli import main
from runtime.errors import VolumeError
from runtime.data.parquet import ParquetDataset
from tests.support.tabular import write_delta

ROOT = Path(__file__).resolve().parents[2]
N = 500


def cli(capsys, *args: str) -> subprocess.CompletedProcess:
    """Run the console-script entry point in this process (the same code path as the installed command)."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.fixture
def table(tmp_path) -> Path:
    write_delta(tmp_path / "table", N, chunks=3)  # versions 0, 1, 2
    return tmp_path / "table"


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".export-" in p.name]


def test_export_lays_out_even_row_groups_and_a_manifest_that_reads_back(table, tmp_path, capsys):
    dest = tmp_path / "vol" / "train"
    dest.parent.mkdir()
    done = cli(capsys, "data", "export-delta", str(table), str(dest), "--files", "3", "--row-group-rows", "40",
               "--columns", "id,x", "--where", "split = 'train'", "--json")
    assert done.returncode == 0, done.stderr
    manifest = json.loads(done.stdout)
    train = [i for i in range(N) if i % 4]
    assert manifest["rows"] == len(train) == 375 and manifest["table_version"] == 2
    assert manifest["columns"] == ["id", "x"] and [f["name"] for f in manifest["schema"]] == ["id", "x"]
    groups = [g for f in manifest["files"] for g in f["row_groups"]]
    assert groups == [40] * 9 + [15], "every row group the stated size but the very last"
    assert [len(f["row_groups"]) for f in manifest["files"]] == [4, 3, 3], "files differ by one group at most"
    for f in manifest["files"]:
        meta = pq.read_metadata(dest / f["path"])
        assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == f["row_groups"]
        assert (dest / f["path"]).stat().st_size == f["bytes"]
    ds = ParquetDataset(str(dest), batch_rows=50, cache_dir=str(tmp_path / "cache"))
    assert sorted(int(i) for b in ds for i in b["id"]) == train
    assert leftovers(dest.parent) == []


def test_an_older_version_can_be_exported(table, tmp_path, capsys):
    done = cli(capsys, "data", "export-delta", str(table), str(tmp_path / "v0"), "--version", "0", "--json")
    assert done.returncode == 0, done.stderr
    manifest = json.loads(done.stdout)
    assert (manifest["table_version"], manifest["rows"]) == (0, 167)


@pytest.mark.parametrize("args,says", [
    (["{missing}", "{dest}"], "autoresearch: no Delta table at {missing}"),
    (["{table}", "{dest}", "--columns", "id,nope"],
     "autoresearch: no column 'nope' in {table}; it has: id, x, tag, split"),
    (["{table}", "{dest}", "--where", "nope > 3"], "autoresearch: bad --where 'nope > 3': "),
    (["{table}", "{existing}"], "autoresearch: {existing} already exists; export to a new directory"),
    (["{table}", "{dest}", "--files", "0"], "autoresearch: --files must be >= 1, got 0"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(table, tmp_path, capsys, args, says):
    names = {"missing": str(tmp_path / "no-table"), "table": str(table), "dest": str(tmp_path / "out"),
             "existing": str(tmp_path / "taken")}
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    done = cli(capsys, "data", "export-delta", *[a.format(**names) for a in args])
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(says.format(**names)), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing written"
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB filesystem (tmpfs), so writes fail with ENOSPC."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:  # skipped on a laptop without the privilege; under CI that is a failure
        from tests.support.requires import require

        require("a tmpfs mount (for ENOSPC)", f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_is_one_line_exit_1_and_leaves_nothing(tmp_path, small_disk, capsys):
    write_delta(tmp_path / "big", 60_000)  # a few MB of Parquet: more than the disk holds
    done = cli(capsys, "data", "export-delta", str(tmp_path / "big"), str(small_disk / "out"),
               "--row-group-rows", "5000")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (f"autoresearch: error: no space left on the device of "
                                            f"{small_disk / 'out'}; nothing was kept"), done.stderr
    assert list(small_disk.iterdir()) == [], "neither DEST nor a temporary directory is left"


KILL_MID_EXPORT = """
import os, signal, sys
from runtime.data.parquet_export import ExportConfig, export_delta

def progress(done, total):
    if done >= 100:  # a row group or two are on disk: die the hard way, as a kill -9 or a crash would
        os.kill(os.getpid(), signal.SIGKILL)

export_delta(ExportConfig(sys.argv[1], sys.argv[2], files=2, row_group_rows=50), progress=progress)
"""


def test_an_export_killed_half_way_is_never_read_as_complete(table, tmp_path, capsys):
    dest = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILL_MID_EXPORT, str(table), str(dest)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    assert killed.returncode == -9
    assert not dest.exists(), "DEST appears only once complete"
    [torn] = leftovers(tmp_path)
    assert list((tmp_path / torn).glob("*.parquet")), "the killed export had written files"
    with pytest.raises(VolumeError, match="data volume not found"):
        ParquetDataset(str(dest), cache_dir=str(tmp_path / "cache"))
    # Moved into place by hand (or by a copy that is not atomic), the torn files are still refused.
    os.rename(tmp_path / torn, dest)
    with pytest.raises(VolumeError, match=r"not a complete Parquet export \(no MANIFEST.json\)"):
        ParquetDataset(str(dest), cache_dir=str(tmp_path / "cache"))
    os.rename(dest, tmp_path / torn)

    # The next export to the same place sweeps the dead one's leftovers and completes.
    done = cli(capsys, "data", "export-delta", str(table), str(dest), "--json")
    assert done.returncode == 0, done.stderr
    assert leftovers(tmp_path) == [] and json.loads(done.stdout)["rows"] == N


def test_a_damaged_export_is_refused_naming_the_file(table, tmp_path, capsys):
    dest = tmp_path / "out"
    assert cli(capsys, "data", "export-delta", str(table), str(dest), "--files", "2",
               "--row-group-rows", "100").returncode == 0
    part = dest / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(VolumeError, match=r"is damaged: part-00001.parquet is not the size its manifest says"):
        ParquetDataset(str(dest), cache_dir=str(tmp_path / "cache"))
