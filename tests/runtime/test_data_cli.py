"""`autoresearch cache warm | stats | clear` as a user runs them: exit codes, one-line errors, JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestrator.faces.cli import main
from tests.support import write_files

ROOT = Path(__file__).resolve().parents[2]


def cli(capsys, *args: str) -> subprocess.CompletedProcess:
    """Run the console-script entry point in this process (the same code path, without a torch import)."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_warm_fills_the_cache_in_parallel_then_stats_and_clear_report_it(home, data_dir, slow_volume, capsys):
    write_files(data_dir, 24, size=4096)
    vol = slow_volume(data_dir, open_latency=0.05)
    warm = cli(capsys, "cache", "warm", str(vol.mountpoint), "--threads", "8", "--json")
    assert warm.returncode == 0, warm.stderr
    report = json.loads(warm.stdout)
    assert (report["files"], report["bytes"], report["copied_files"]) == (24, 24 * 4096, 24)
    assert report["cache_dir"] == str(home / "cache")
    assert vol.stats()["max_inflight"] >= 4, "warm copies in parallel"

    again = json.loads(cli(capsys, "cache", "warm", str(vol.mountpoint), "--json").stdout)
    assert again["copied_files"] == 0 and vol.stats()["opens"] == 24, "a warm cache copies nothing"

    stats = json.loads(cli(capsys, "cache", "stats", "--json").stdout)
    assert (stats["files"], stats["bytes"], stats["partial_files"]) == (24, 24 * 4096, 0)
    cleared = json.loads(cli(capsys, "cache", "clear", "--json").stdout)
    assert (cleared["removed"], cleared["kept_in_use"]) == (24, 0)
    assert json.loads(cli(capsys, "cache", "stats", "--json").stdout)["files"] == 0


def test_warm_of_a_missing_path_is_bad_input_with_one_line(home, tmp_path, capsys):
    done = cli(capsys, "cache", "warm", str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert done.stderr == f"autoresearch: data volume not found: {tmp_path / 'nowhere'}\n"


def test_the_cache_commands_do_not_import_torch():
    code = "import sys, orchestrator.faces.cli.cache; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", "registering the cache commands must keep `submit` fast"


def test_pack_shows_files_and_bytes_then_reports_and_bad_input_is_one_line(home, data_dir, tmp_path, capsys):
    write_files(data_dir, 12, size=4096)
    done = cli(capsys, "data", "pack", str(data_dir), str(tmp_path / "shards"), "--shard-size", "16KiB", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["files"], report["samples"], report["bytes"]) == (12, 12, 12 * 4096) and report["shards"] >= 3
    assert (tmp_path / "shards" / "index.json").exists()
    shown = cli(capsys, "data", "pack", str(data_dir), str(tmp_path / "shards2"), "--shard-size", "16KiB")
    assert shown.returncode == 0 and "12/12 files" in shown.stderr, "the bar counts files and bytes"
    for args, message in ((["nowhere", "x"], "data volume not found"),
                          ([str(data_dir), str(tmp_path / "y"), "--shard-size", "big"], "not a size: 'big'"),
                          ([str(data_dir), str(data_dir / "d0")], "is inside source")):
        bad = cli(capsys, "data", "pack", *args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr
    assert not (tmp_path / "y").exists()


def test_the_data_commands_do_not_import_torch():
    code = "import sys, orchestrator.faces.cli.data; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False"
