"""Packs of tar shards, written and read for real: `pack` (bit-exact, standard tools read the shards, a kill -9
mid-pack resumes, a changed input replaces stale shards) and ShardDataset (epochs, ranks x workers, resume,
corrupt and torn shards, the cache limit, the cold path over a slow FUSE volume)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from runtime.data.loader import DataLoader, epoch_order, rank_order
from runtime.data.packing import JOURNAL, PackConfig, pack
from runtime.data.shardindex import INDEX, split_key
from runtime.data.shards import ShardDataset
from runtime.errors import PackInputError, ShardError, VolumeError
from tests.orchestrator.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
SHARD = 256 << 10


def write_tree(root: Path, count: int, seed: int = 0, big: int = 600 << 10) -> dict[str, bytes]:
    """Files of random sizes in nested folders, some samples of two members, and one file bigger than a shard."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(count):
        folder = ["", "a/", "a/b/", "c/d/e/"][i % 4]
        files[f"{folder}s{i:04d}.bin"] = rng.randbytes(rng.choice([0, 1, 511, 512, 513, rng.randint(0, 90_000)]))
        if i % 5 == 0:
            files[f"{folder}s{i:04d}.meta.json"] = json.dumps({"i": i}).encode()
    files["huge/one.dat"] = rng.randbytes(big)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def expected_samples(files: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    for rel, data in files.items():
        key, member = split_key(rel)
        samples.setdefault(key, {})[member] = data
    return samples


def as_dict(sample: dict) -> tuple[str, dict[str, bytes]]:
    return sample["__key__"], {k: v for k, v in sample.items() if not k.startswith("__")}


def key_of(sample: dict) -> str:
    """A picklable transform for worker processes."""
    return sample["__key__"]


def test_pack_reads_back_bit_exact_through_tar_webdataset_and_shard_dataset(tmp_path):
    files = write_tree(tmp_path / "src", 60)
    index = pack(PackConfig(tmp_path / "src", tmp_path / "dst", shard_size=SHARD))
    want = expected_samples(files)
    assert index["files"] == len(files) and index["samples"] == len(want)
    shards = sorted((tmp_path / "dst").glob("*.tar"))
    assert [s.name for s in shards] == [s["name"] for s in index["shards"]] and len(shards) > 3
    big = [s for s in index["shards"] if any(x["key"] == "huge/one" for x in s["samples"])]
    assert len(big) == 1 and len(big[0]["samples"]) == 1, "a file bigger than a shard gets a shard of its own"
    assert all(s.stat().st_size <= SHARD for s in shards if s.name != big[0]["name"])

    listed = [line for s in shards for line in subprocess.run(["tar", "tf", str(s)], capture_output=True, text=True,
                                                                check=True).stdout.split()]
    assert sorted(listed) == sorted(files), "tar lists every file under its own path"
    with tarfile.open(shards[0]) as tar:
        member = tar.getmembers()[0]
        assert tar.extractfile(member).read() == files[member.name]

    import webdataset as wds

    read = dict(as_dict(s) for s in wds.WebDataset([str(s) for s in shards], shardshuffle=False, empty_check=False))
    assert read == want, "webdataset reads the same samples"

    ds = ShardDataset(tmp_path / "dst", cache_dir=tmp_path / "cache", shuffle=False)
    ours = [as_dict(s) for s in ds]
    assert dict(ours) == want and len(ours) == len(want)
    epoch0, epoch1 = [key_of(s) for s in ShardDataset(tmp_path / "dst", cache_dir=tmp_path / "cache", seed=3)], None
    shuffled = ShardDataset(tmp_path / "dst", cache_dir=tmp_path / "cache", seed=3)
    shuffled.set_epoch(1)
    epoch1 = [key_of(s) for s in shuffled]
    assert sorted(epoch0) == sorted(epoch1) == sorted(want) and epoch0 != epoch1, "each epoch reshuffled"


def test_split_by_writes_shards_per_split_and_the_reader_takes_one(tmp_path):
    for split in ("train", "val"):
        for i in range(6):
            (tmp_path / "src").mkdir(exist_ok=True)
            (tmp_path / "src" / f"{split}-{i:03d}.bin").write_bytes(f"{split}{i}".encode() * 1000)
    index = pack(PackConfig(tmp_path / "src", tmp_path / "dst", shard_size=64 << 10, split_by="^(train|val)-"))
    assert {s["name"].split("-")[0] for s in index["shards"]} == {"train", "val"}
    val = ShardDataset(tmp_path / "dst", split="val", cache_dir=tmp_path / "cache", shuffle=False)
    assert [s["__key__"] for s in val] == [f"val-{i:03d}" for i in range(6)]
    with pytest.raises(VolumeError, match="no split 'test'; it has: train, val"):
        ShardDataset(tmp_path / "dst", split="test", cache_dir=tmp_path / "cache")


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("keep me")
    cases = [({"source": tmp_path / "nowhere"}, "data volume not found"),
             ({"dest": tmp_path / "other"}, "is not empty and holds no pack"),
             ({"dest": tmp_path / "src" / "in"}, "is inside source"),
             ({"shard_size": "12 parsecs"}, "not a size"),
             ({"split_by": "^(train|val)-"}, "matches no split")]
    for change, message in cases:
        opts = {"source": tmp_path / "src", "dest": tmp_path / "dst", **change}
        with pytest.raises(PackInputError, match=message):
            pack(PackConfig(**opts))
    assert not (tmp_path / "dst").exists() and (tmp_path / "other" / "mine.txt").read_text() == "keep me"
    with pytest.raises(VolumeError, match="has no index.json"):
        ShardDataset(tmp_path / "other", cache_dir=tmp_path / "cache")


def test_a_pack_killed_with_kill_9_leaves_no_complete_looking_shard_and_a_rerun_resumes(tmp_path, slow_volume):
    files = write_tree(tmp_path / "src", 80, seed=1)
    vol = slow_volume(tmp_path / "src", open_latency=0.04)
    dest = tmp_path / "dst"
    code = ("import sys; from runtime.data.packing import PackConfig, pack; "
            "pack(PackConfig(sys.argv[1], sys.argv[2], shard_size=128 << 10, threads=2))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(vol.mountpoint), str(dest)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    journal = dest / JOURNAL
    wait_for(lambda: journal.exists() and journal.read_text().count("\n") >= 2, timeout=60,
             what="two shards completed")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    assert not (dest / INDEX).exists(), "no index: the pack does not look complete"
    done = {e["name"]: e for e in map(json.loads, journal.read_text().splitlines())}
    complete = sorted(p.name for p in dest.glob("*.tar"))
    assert complete and set(complete) <= set(done), "every .tar is a shard the journal lists as complete"
    assert all((dest / name).stat().st_size == done[name]["bytes"] for name in complete)
    with pytest.raises(VolumeError, match="has no index.json"):
        ShardDataset(dest, cache_dir=tmp_path / "cache")

    kept = {name: (dest / name).stat().st_ino for name in complete}
    opens_before = vol.stats()["opens_by_path"]
    index = pack(PackConfig(vol.mountpoint, dest, shard_size=128 << 10, threads=2))
    assert {name: (dest / name).stat().st_ino for name in complete} == kept, "complete shards are kept as they are"
    reopened = {p for p, n in vol.stats()["opens_by_path"].items() if n > opens_before.get(p, 0)}
    kept_files = {"/" + rel for s in index["shards"] if s["name"] in kept for x in s["samples"]
                  for rel in (f"{x['key']}.{m}" if m else x["key"] for m in x["members"])}
    assert not reopened & kept_files, "files of complete shards are not read again"
    assert not list(dest.glob("*.part"))
    ds = ShardDataset(dest, cache_dir=tmp_path / "cache", shuffle=False)
    assert dict(as_dict(s) for s in ds) == expected_samples(files)


def test_a_repack_of_changed_input_replaces_stale_shards_and_keeps_the_rest(tmp_path):
    files = write_tree(tmp_path / "src", 80, seed=2)
    first = pack(PackConfig(tmp_path / "src", tmp_path / "dst", shard_size=64 << 10))
    before = {p.name: p.stat().st_ino for p in (tmp_path / "dst").glob("*.tar")}
    for rel in [r for r in files if "/" not in r or r.startswith("huge/")]:  # the samples planned last go away
        (tmp_path / "src" / rel).unlink()
        del files[rel]
    changed = sorted(r for r in files if r.startswith("c/"))[-1]  # and one file of the last folder left changes
    files[changed] = b"new content"
    (tmp_path / "src" / changed).write_bytes(files[changed])
    index = pack(PackConfig(tmp_path / "src", tmp_path / "dst", shard_size=64 << 10))
    after = {p.name: p.stat().st_ino for p in (tmp_path / "dst").glob("*.tar")}
    assert set(after) == {s["name"] for s in index["shards"]} and len(after) < len(before), "stale shards removed"
    untouched = [s["name"] for s in first["shards"] if all(x["key"].startswith("a/") for x in s["samples"])]
    assert untouched and all(after[name] == before[name] for name in untouched), "unchanged shards kept"
    ds = ShardDataset(tmp_path / "dst", cache_dir=tmp_path / "cache", shuffle=False)
    assert dict(as_dict(s) for s in ds) == expected_samples(files)


@pytest.fixture
def packed(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(31):  # 31 samples over 8 shards: uneven shards, and one padded sample across 3 ranks
        (src / f"k{i:03d}.bin").write_bytes(random.Random(i).randbytes(20_000))
    pack(PackConfig(src, tmp_path / "dst", shard_size=90_000))
    return tmp_path / "dst"


@pytest.mark.parametrize("total", [30, 31])
def test_three_ranks_of_two_workers_cover_an_epoch_exactly(packed, tmp_path, monkeypatch, total):
    if total == 30:  # a multiple of the world size: no padding at all
        index = json.loads((packed / INDEX).read_text())
        (packed / index["shards"][-1]["name"]).unlink()
        last = index["shards"].pop()
        assert len(last["samples"]) == 1
        index["samples"] -= 1
        (packed / INDEX).write_text(json.dumps(index))
    monkeypatch.setenv("WORLD_SIZE", "3")
    ranks = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        ds = ShardDataset(packed, cache_dir=tmp_path / "cache", seed=7, shuffle_window=2, transform=key_of)
        ranks.append([k for batch in DataLoader(ds, batch_size=2, num_workers=2) for k in batch])
        assert len(ranks[-1]) == len(ds) == -(-total // 3), "the same count on every rank"
    seen = Counter(k for r in ranks for k in r)
    assert len(seen) == total, "every sample is seen"
    assert sum(seen.values()) - total == (-total) % 3, "repeats are only the padding, as VolumeDataset's"
    order = ShardDataset(packed, cache_dir=tmp_path / "cache", seed=7, shuffle_window=2).epoch_order(0)
    ds = ShardDataset(packed, cache_dir=tmp_path / "cache")
    assert ranks == [[ds.key(i) for i in rank_order(order, 0, r, 3)] for r in range(3)]


@pytest.mark.parametrize("before,after", [(2, 2), (2, 0), (0, 2)])
def test_resume_mid_epoch_yields_exactly_the_unseen_rest(packed, tmp_path, before, after):
    def loader(workers):
        ds = ShardDataset(packed, cache_dir=tmp_path / "cache", seed=1, transform=key_of)
        return DataLoader(ds, batch_size=3, num_workers=workers)

    reference = [k for b in loader(0) for k in b]
    first = loader(before)
    head = []
    for i, batch in enumerate(first):
        head += batch
        if i == 3:
            break
    state = json.loads(json.dumps(first.state_dict()))
    assert state["samples_consumed"] == 12
    resumed = loader(after)
    resumed.load_state_dict(state)
    assert head + [k for b in resumed for k in b] == reference
    assert resumed.state_dict()["epoch"] == 1


def test_global_shuffle_is_volume_datasets_order(packed, tmp_path):
    ds = ShardDataset(packed, cache_dir=tmp_path / "cache", seed=4, shuffle="global", transform=key_of)
    names = sorted(p.stem for p in (packed.parent / "src").iterdir())
    assert list(ds) == [names[i] for i in epoch_order(len(names), 4, 0)]


def corrupt(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_or_torn_shard_is_one_error_naming_shard_and_sample(packed, tmp_path, damage):
    index = json.loads((packed / INDEX).read_text())
    shard = index["shards"][2]
    victim = shard["samples"][1]
    offset, size, _ = victim["members"]["bin"]
    if damage == "flip":
        corrupt(packed / shard["name"], offset + size // 2)
    else:
        os.truncate(packed / shard["name"], offset + 100)
    for workers in (0, 2):
        ds = ShardDataset(packed, cache_dir=tmp_path / "cache", shuffle=False, transform=key_of)
        with pytest.raises(ShardError) as err:
            list(DataLoader(ds, batch_size=2, num_workers=workers))
        line = str(err.value).splitlines()[-1] if workers else str(err.value)
        assert shard["name"] in line and repr(victim["key"]) in line, line
        assert ("corrupt" if damage == "flip" else "torn") in line
    ds = ShardDataset(packed, cache_dir=tmp_path / "cache")
    assert ds.cache.stats().partial_files == 0
    cached = [ds.cache.lookup(ds.source.uid(s["name"]), s["bytes"], s["checksum"], ".tar") for s in ds.shards[:3]]
    assert [pin is not None for pin in cached] == [True, True, False], "good shards cached, the damaged one not"


def test_the_cache_keeps_under_its_byte_limit_evicting_least_recently_used(packed, tmp_path):
    sizes = [s["bytes"] for s in json.loads((packed / INDEX).read_text())["shards"]]
    limit = 3 * max(sizes)
    ds = ShardDataset(packed, cache_dir=tmp_path / "cache", cache_limit_bytes=limit, shuffle=False,
                      lookahead=1, transform=key_of)
    peak = 0
    for _ in ds:
        peak = max(peak, ds.cache.stats().bytes)
    assert peak <= limit + max(sizes), "at most the limit, plus the shard being inserted"
    assert ds.cache.stats().bytes <= limit and ds.cache.misses == len(sizes)
    survivors = {p.stat().st_size for p in (tmp_path / "cache" / "objects").rglob("*.tar")}
    assert sizes[-1] in survivors, "the most recently used shard stays"


def test_a_cold_epoch_over_a_slow_volume_opens_each_shard_once_and_a_warm_one_none(packed, tmp_path, slow_volume):
    vol = slow_volume(packed, open_latency=0.05)
    ds = ShardDataset(vol.mountpoint, cache_dir=tmp_path / "cache", transform=key_of)
    shards = len(ds.shards)
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    first = [k for b in loader for k in b]
    assert sorted(first) == sorted(f"k{i:03d}" for i in range(31))
    opened = vol.stats()["opens_by_path"]
    assert sum(v for p, v in opened.items() if p.endswith(".tar")) == shards, "each shard is read once"
    second = [k for b in loader for k in b]
    assert sorted(second) == sorted(first) and second != first
    assert vol.stats()["opens_by_path"] == opened, "a warm epoch never touches the volume"


def test_each_copy_stream_opens_a_shard_once_whatever_its_ranges(tmp_path, slow_volume):
    src = tmp_path / "src"
    src.mkdir()
    files = {f"s{i}.bin": random.Random(i).randbytes(300_001 + i) for i in range(6)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    pack(PackConfig(src, tmp_path / "dst", shard_size=1 << 20))  # two shards of about 900 KiB
    vol = slow_volume(tmp_path / "dst", open_latency=0.001)
    ds = ShardDataset(vol.mountpoint, cache_dir=tmp_path / "cache", shuffle=False, copy_threads=2,
                      part_bytes=128 << 10)  # 7 ranges a shard, 4 and 3 for its 2 streams
    assert {k: v["bin"] for k, v in map(as_dict, ds)} == {n.split(".")[0]: d for n, d in files.items()}
    opens = sum(v for p, v in vol.stats()["opens_by_path"].items() if p.endswith(".tar"))
    assert opens == 2 * len(ds.shards), "an open is a round trip on network storage: one per stream, not per range"


def test_any_fsspec_url_to_a_pack_reads_the_same(packed, tmp_path):
    local = [as_dict(s) for s in ShardDataset(packed, cache_dir=tmp_path / "a", shuffle=False, part_bytes=7000)]
    url = [as_dict(s) for s in ShardDataset(f"file://{packed}", cache_dir=tmp_path / "b", shuffle=False,
                                            part_bytes=7000)]
    assert url == local and len(local) == 31, "ranged reads through fsspec give the same bytes"


def test_ranged_crcs_combine_into_the_crc_of_the_whole():
    import zlib

    from runtime.data.crc import crc32_combine

    rng = random.Random(5)
    for size in (0, 1, 511, 8 << 10, 100_003):
        a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(size)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
