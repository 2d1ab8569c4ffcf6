"""packing: the small files of a volume, written into WebDataset-style tar shards of about `shard_size` bytes each,
with an index, so an epoch reads a few long files instead of opening every small one.

    index = pack(PackConfig("/mnt/vol/images", "/mnt/vol/images-shards", shard_size=1 << 30))

DEST afterwards:
    shard-000000.tar ...      plain tar files (`tar tf` lists them, `webdataset` reads them); with `split_by`,
                              `<split>-000000.tar ...` per split
    index.json                shards, samples, member offsets and sizes, a checksum per shard (runtime.data.shardindex);
                              written last and atomically: a DEST without it is a pack still running or killed
    .pack-journal.jsonl       one line per shard completed, so a killed pack resumes from them
    .pack.lock                held (flock) while a pack writes: a second pack into the same DEST is refused

A sample is the files sharing a key (the path up to the first dot of the file name, WebDataset's rule), kept
together in one shard; tar member names are the relative paths, so `tar xf` restores the tree. A shard is
written as `NAME.part`, synced, and renamed only when complete, so a kill leaves no shard that looks complete.

The plan (which sample goes to which shard) depends only on the listing (paths, sizes, versions) and the
options: samples sorted by (split, key) fill shards greedily; a sample bigger than `shard_size` gets a shard
of its own. A re-run therefore computes the same shards, keeps those the journal lists with the same content
and size on disk, and rewrites the rest; shards of an earlier pack that the plan no longer has are removed.

SRC is read by a pool of threads (many opens in flight: what a slow volume needs), in plan order, at most
`max_inflight_bytes` ahead of the single writer (runtime.data.packreads), which writes each shard sequentially.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.data.packreads import ReadAhead
from runtime.data.shardindex import FORMAT, INDEX, SHARD_NAME, VERSION, shard_name, split_key
from runtime.data.sources import FileInfo, open_source
from runtime.errors import PackError, PackInputError, VolumeError

__all__ = ["PackConfig", "pack", "JOURNAL"]

JOURNAL = ".pack-journal.jsonl"
LOCK = ".pack.lock"  # one pack at a time per DEST (flock)
_BLOCK = tarfile.BLOCKSIZE
_END = 2 * _BLOCK  # two zero blocks end an archive
_TAIL = _END + tarfile.RECORDSIZE  # the end, and at most this padding to a whole record
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_.-]*$")


def parse_size(text: str | int) -> int:
    """Bytes from `1GiB`, `512MiB`, `64MB`, `1e9` or a plain number; ValueError if it is not one."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", str(text), flags=re.I)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 1GiB, 512MiB, 64MB)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or not unit else 1000
    return int(number * base ** " KMGT".index(unit or " "))


@dataclass(frozen=True)
class PackConfig:
    """Options of `pack()`. `source` is a local/FUSE directory or an fsspec URL; `dest` a local/mounted directory.

    `split_by`: None (one set of shards), `"dir"` (one per top-level folder) or a regular expression searched in
    each relative path whose first group (or whole match) names the file's split (`^(train|val)-`).
    """

    source: str
    dest: str
    shard_size: int = 1 << 30
    split_by: str | None = None
    pattern: str = "*"  # fnmatch on the path relative to source, as VolumeDataset's
    threads: int = 64  # parallel reads of the source
    max_inflight_bytes: int = 256 << 20  # read ahead of the writer, at most
    retries: int = 5  # attempts per file on transient read errors

    def __post_init__(self) -> None:
        for name in ("source", "dest"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise PackInputError(f"{name} must be a non-empty path")
        if "://" in self.dest:
            raise PackInputError(f"dest must be a local or mounted directory, not a URL: {self.dest}")
        try:
            object.__setattr__(self, "shard_size", parse_size(self.shard_size))
        except ValueError as exc:
            raise PackInputError(str(exc)) from None
        if self.shard_size < tarfile.RECORDSIZE:
            raise PackInputError(f"shard size must be at least 10KiB (one tar record), got {self.shard_size} bytes")
        if self.split_by is not None:
            regex = r"^([^/]+)/" if self.split_by == "dir" else self.split_by
            try:
                re.compile(regex)
            except re.error as exc:
                raise PackInputError(f"--split-by is not a regular expression: {exc}") from None
        if self.threads < 1 or self.retries < 1 or self.max_inflight_bytes < 1:
            raise PackInputError("threads, retries and max_inflight_bytes must be positive")

    def splitter(self) -> Callable[[str], str | None] | None:
        """The split of a relative path (None when it matches nothing), or None without split_by."""
        if self.split_by is None:
            return None
        regex = re.compile(r"^([^/]+)/" if self.split_by == "dir" else self.split_by)

        def split(rel: str) -> str | None:
            m = regex.search(rel)
            if m is None:
                return None
            return m.group(1) if regex.groups else m.group(0)

        return split


def _header_bytes(rel: str) -> int:
    long = len(rel.encode()) > 100 or not rel.isascii()
    return _BLOCK * (4 if long else 1)  # a PAX header: its own header, the record, the file's header


@dataclass
class _Sample:
    split: str
    key: str
    files: list[tuple[str, FileInfo]]  # (member name, file)

    @property
    def tar_bytes(self) -> int:  # a header block per member, and a PAX header for a long or non-ASCII name
        return sum(_header_bytes(f.rel) + -(-f.size // _BLOCK) * _BLOCK for _, f in self.files)


@dataclass
class _Shard:
    name: str
    split: str
    samples: list[_Sample] = field(default_factory=list)

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{FORMAT}/{VERSION}\0{self.name}\0{self.split}".encode())
        for s in self.samples:
            for _, f in s.files:
                h.update(f"\0{f.rel}\0{f.size}\0{f.version}".encode())
        return h.hexdigest()


def _plan(files: list[FileInfo], cfg: PackConfig) -> list[_Shard]:
    split_of = cfg.splitter()
    samples: dict[tuple[str, str], _Sample] = {}
    for f in files:
        split = split_of(f.rel) if split_of is not None else ""
        if split is None:
            raise PackInputError(f"{f.rel} matches no split of --split-by {cfg.split_by!r} (leave it out with "
                                 "--pattern)")
        if not _SPLIT_NAME.match(split):
            raise PackInputError(f"split name {split!r} (from {f.rel}) is not usable in a file name")
        key, member = split_key(f.rel)
        sample = samples.setdefault((split, key), _Sample(split, key, []))
        if any(m == member for m, _ in sample.files):
            raise PackInputError(f"{f.rel} and {sample.files[0][1].rel} are the same member of sample {key!r}")
        sample.files.append((member, f))
    shards: list[_Shard] = []
    count: dict[str, int] = {}
    current: _Shard | None = None
    size = 0
    for (split, _), sample in sorted(samples.items()):
        need = sample.tar_bytes
        if current is None or current.split != split or (current.samples and size + need + _TAIL > cfg.shard_size):
            current = _Shard(shard_name(split, count.get(split, 0)), split)
            count[split] = count.get(split, 0) + 1
            shards.append(current)
            size = 0
        current.samples.append(sample)
        size += need
    return shards


class _Writer:
    """One tar file being written, sequentially, with its CRC-32 and the offsets of its members."""

    def __init__(self, path: str):
        self.path = path
        self._fh = open(path, "wb", buffering=8 << 20)
        self.offset = 0
        self.crc = 0

    def write(self, data: bytes | memoryview) -> None:
        self._fh.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.offset += len(data)

    def header(self, member: str, info: FileInfo) -> None:
        tar = tarfile.TarInfo(member)
        tar.size, tar.mode, tar.mtime = info.size, 0o644, _mtime(info.version)
        self.write(tar.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))

    def pad(self) -> None:
        if self.offset % _BLOCK:
            self.write(bytes(_BLOCK - self.offset % _BLOCK))

    def finish(self) -> None:
        self.write(bytes(_END))
        if self.offset % tarfile.RECORDSIZE:  # as tar and tarfile do: whole records
            self.write(bytes(tarfile.RECORDSIZE - self.offset % tarfile.RECORDSIZE))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def abort(self) -> None:
        self._fh.close()


def _mtime(version: str) -> int:
    # Local sources version files by st_mtime_ns; anything else (an etag) gives no time.
    return int(version) // 10**9 if version.isdigit() else 0


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_journal(dest: str) -> dict[str, dict]:
    entries: dict[str, dict] = {}
    try:
        with open(os.path.join(dest, JOURNAL), encoding="utf-8") as fh:
            for line in fh:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line torn by a kill: everything after it is unknown
                entries[entry["name"]] = entry
    except FileNotFoundError:
        pass
    return entries


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _check_dest(cfg: PackConfig) -> str:
    dest = os.path.abspath(os.path.expanduser(cfg.dest))
    if "://" not in cfg.source:
        src = os.path.realpath(os.path.expanduser(cfg.source))
        real = os.path.realpath(dest)
        if real == src or real.startswith(src + os.sep):
            raise PackInputError(f"dest {cfg.dest} is inside source {cfg.source}: it would pack its own shards")
    if os.path.exists(dest):
        if not os.path.isdir(dest):
            raise PackInputError(f"dest {cfg.dest} exists and is not a directory")
        names = os.listdir(dest)
        ours = {INDEX, JOURNAL, LOCK}
        foreign = [n for n in names if n not in ours and not SHARD_NAME.match(n) and not n.endswith(".tmp")]
        if foreign and not ours & set(names):
            raise PackInputError(f"dest {cfg.dest} is not empty and holds no pack (e.g. {sorted(foreign)[0]})")
    return dest


def pack(cfg: PackConfig, progress: Callable[[int, int, int, int], None] | None = None) -> dict[str, Any]:
    """Pack the files under `cfg.source` into shards in `cfg.dest` and return the index (also in DEST/index.json).

    `progress(files_done, files_total, bytes_done, bytes_total)` is called as files are written (shards kept
    from an earlier, killed run count as done at once). Raises PackInputError (a bad source, destination or
    option: nothing written) or PackError (the source failed mid-way: the shards completed so far are kept
    for the next run).
    """
    dest = _check_dest(cfg)
    source = open_source(cfg.source)
    try:
        files = source.list(cfg.pattern, threads=cfg.threads)
    except VolumeError as exc:
        raise PackInputError(str(exc)) from None
    if not files:
        raise PackInputError(f"no files match {cfg.pattern!r} under {cfg.source}")
    shards = _plan(files, cfg)
    os.makedirs(dest, exist_ok=True)
    lock = os.open(os.path.join(dest, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PackInputError(f"another pack is writing {cfg.dest} right now") from None
        return _pack_locked(cfg, dest, source, files, shards, progress)
    finally:
        os.close(lock)  # the kernel drops the lock with the descriptor, and with a killed process


def _pack_locked(cfg: PackConfig, dest: str, source: Any, files: list[FileInfo], shards: list[_Shard],
                 progress: Callable[[int, int, int, int], None] | None) -> dict[str, Any]:
    # From here DEST is not a complete pack until the new index lands: drop the old one first.
    try:
        os.unlink(os.path.join(dest, INDEX))
    except FileNotFoundError:
        pass
    journal = _read_journal(dest)
    done: dict[str, dict] = {}
    for shard in shards:
        entry = journal.get(shard.name)
        path = os.path.join(dest, shard.name)
        if entry and entry.get("fingerprint") == shard.fingerprint() and os.path.isfile(path) \
                and os.path.getsize(path) == entry["bytes"]:
            done[shard.name] = entry
    for name in os.listdir(dest):  # stale shards of another input, and parts of a killed run
        if (SHARD_NAME.match(name) and name not in done) or name.endswith(".tmp"):
            os.unlink(os.path.join(dest, name))
    _write_atomically(os.path.join(dest, JOURNAL), "".join(json.dumps(done[s.name]) + "\n" for s in shards
                                                          if s.name in done))
    total_files, total_bytes = len(files), sum(f.size for f in files)
    files_done = sum(len(s.files) for sh in shards if sh.name in done for s in sh.samples)
    bytes_done = sum(f.size for sh in shards if sh.name in done for s in sh.samples for _, f in s.files)
    if progress is not None:
        progress(files_done, total_files, bytes_done, total_bytes)
    todo = [sh for sh in shards if sh.name not in done]
    with ThreadPoolExecutor(cfg.threads, thread_name_prefix="pack-read") as pool, \
            open(os.path.join(dest, JOURNAL), "a", encoding="utf-8") as log:
        reads = ReadAhead(pool, source, todo, cfg)
        try:
            def written(size: int) -> None:
                nonlocal files_done, bytes_done
                files_done, bytes_done = files_done + 1, bytes_done + size
                if progress is not None:
                    progress(files_done, total_files, bytes_done, total_bytes)

            for shard in todo:
                entry = _write_shard(dest, shard, reads, written)
                log.write(json.dumps(entry) + "\n")
                log.flush()
                os.fsync(log.fileno())
                done[shard.name] = entry
        finally:
            reads.cancel()
    index = {"format": FORMAT, "version": VERSION, "source": cfg.source, "shard_size": cfg.shard_size,
             "split_by": cfg.split_by, "files": total_files, "bytes": total_bytes,
             "samples": sum(len(sh.samples) for sh in shards),
             "shards": [{k: v for k, v in done[sh.name].items() if k != "fingerprint"} for sh in shards]}
    _write_atomically(os.path.join(dest, INDEX), json.dumps(index, separators=(",", ":")))
    return index


def _write_shard(dest: str, shard: _Shard, reads: ReadAhead, written: Callable[[int], None]) -> dict[str, Any]:
    final = os.path.join(dest, shard.name)
    out = _Writer(final + ".part")
    samples = []
    try:
        for sample in shard.samples:
            members = {}
            for member, info in sample.files:
                out.header(info.rel, info)
                start, crc = out.offset, 0
                data = reads.next(info)
                if data is None:
                    def write(block: bytes) -> None:
                        nonlocal crc
                        crc = zlib.crc32(block, crc)
                        out.write(block)

                    reads.stream(info, write)
                else:
                    if len(data) != info.size:
                        raise PackError(f"{reads.source.uid(info.rel)} changed size while it was packed "
                                        f"({info.size} listed, {len(data)} read)")
                    out.write(data)
                    crc = zlib.crc32(data)
                members[member] = [start, info.size, crc]
                out.pad()
                written(info.size)
            samples.append({"key": sample.key, "members": members})
        out.finish()
    except BaseException:
        out.abort()
        os.unlink(out.path)
        raise
    os.replace(out.path, final)
    _fsync_dir(dest)
    return {"name": shard.name, "split": shard.split, "bytes": out.offset, "checksum": f"crc32:{out.crc:08x}",
            "fingerprint": shard.fingerprint(), "samples": samples}
