"""prepare.py for both experiments: real data, idempotent, one builder when two processes race."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.charlm import prepare as charlm_prepare
from experiments.common import prepare_once, read_manifest, volume_dir
from experiments.digits import prepare as digits_prepare

ROOT = Path(__file__).resolve().parents[2]


def test_volume_dir_follows_home_and_override(home, monkeypatch, tmp_path):
    assert volume_dir("digits") == home.resolve() / "volumes" / "digits"
    monkeypatch.setenv("AUTORESEARCH_VOLUMES", str(tmp_path / "vol"))
    assert volume_dir("digits") == (tmp_path / "vol" / "digits").resolve()


def test_digits_volume_is_pngs_with_labels(home):
    from PIL import Image

    path = digits_prepare.ensure()
    train, val, test = (sorted((path / split).glob("*.png")) for split in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (1077, 360, 360)
    assert {digits_prepare.label_of(p) for p in val} == {digits_prepare.label_of(p) for p in test} == set(range(10))
    names = [{p.name for p in split} for split in (train, val, test)]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])  # no image in two splits
    img = Image.open(train[0])
    assert img.size == (8, 8) and img.mode == "L"
    assert read_manifest(path)["train_images"] == 1077 and read_manifest(path)["test_images"] == 360


def test_charlm_corpus_is_stdlib_source_in_equal_shards(home):
    path = charlm_prepare.ensure()
    manifest = read_manifest(path)
    shards = sorted(path.glob("train-*.bin"))
    assert len(shards) == manifest["train_shards"] >= 8 and manifest["val_shards"] >= 1
    assert len(list(path.glob("test-*.bin"))) == manifest["test_shards"] >= 1
    # Every file is in exactly one split, by a stable hash: about a tenth each in validation and test.
    rels = [f"a/m{i}.py" for i in range(2000)]
    shares = {s: sum(charlm_prepare.split_of(r) == s for r in rels) / len(rels) for s in ("val", "test")}
    assert 0.07 < shares["val"] < 0.13 and 0.07 < shares["test"] < 0.13
    assert {p.stat().st_size for p in shards} == {charlm_prepare.SHARD_BYTES}
    assert b"def " in shards[0].read_bytes() and b"# file: " in shards[0].read_bytes()


def test_prepare_is_idempotent(home):
    first = digits_prepare.ensure()
    stamp = (first / "MANIFEST.json").stat().st_mtime_ns
    assert digits_prepare.ensure() == first
    assert (first / "MANIFEST.json").stat().st_mtime_ns == stamp  # not rebuilt


def test_half_built_volume_is_rebuilt(home, tmp_path):
    target = tmp_path / "vol"
    target.mkdir()
    (target / "junk").write_text("a crash left this, and no manifest")

    def writer(text):
        def build(out):
            (out / "data").write_text(text)
            return {}
        return build

    prepare_once("x", 1, writer("ok"), target)
    assert (target / "data").read_text() == "ok" and not (target / "junk").exists()
    prepare_once("x", 2, writer("v2"), target)  # a version bump rebuilds
    assert (target / "data").read_text() == "v2" and read_manifest(target)["version"] == 2


RACER = """
import sys, time
from pathlib import Path
from experiments.common import prepare_once
log = Path(sys.argv[2])
with log.open("a") as fh:
    fh.write("arrived\\n")
def build(out):
    with log.open("a") as fh:
        fh.write("build\\n")
    deadline = time.time() + 30
    while log.read_text().count("arrived") < 2 and time.time() < deadline:
        time.sleep(0.02)  # the other process is on its way into prepare_once: it arrives mid-build
    (out / "data").write_text("ok")
    return {}
print(prepare_once("race", 1, build, Path(sys.argv[1])))
"""


def test_two_processes_racing_build_once(tmp_path):
    target, log = tmp_path / "vol", tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(target), str(log)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(target)] * 2
    assert log.read_text().count("build") == 1
    assert (target / "data").read_text() == "ok"


@pytest.mark.parametrize("module", ["experiments.digits.prepare", "experiments.charlm.prepare",
                                    "experiments.tabular.prepare"])
def test_real_prepare_concurrent_processes(tmp_path, module):
    out = tmp_path / "vol"
    procs = [subprocess.Popen([sys.executable, "-m", module, "--out", str(out)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert all(r[0].strip() == str(out) for r in results)
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["version"] >= 1
    assert not [p for p in tmp_path.iterdir() if ".building-" in p.name]  # no temp dirs left behind
