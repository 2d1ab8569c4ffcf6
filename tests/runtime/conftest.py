"""Fixtures for the runtime data tests: real files on disk and a real slow FUSE volume over them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.requires import require  # noqa: E402
from tests.support.slowfs import SlowVolume, fuse_unavailable_reason  # noqa: E402


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """An empty directory to write a dataset into."""
    path = tmp_path / "volume-src"
    path.mkdir()
    return path


@pytest.fixture
def slow_volume(tmp_path):
    """Factory: mount a slow FUSE volume over a directory; every mount is unmounted after the test."""
    require("FUSE (for the slow volume)", fuse_unavailable_reason())  # skips, or fails under CI
    mounted: list[SlowVolume] = []

    def mount(source: Path, **settings) -> SlowVolume:
        vol = SlowVolume(source, tmp_path / f"mnt{len(mounted)}", **settings)
        mounted.append(vol)
        return vol

    yield mount
    for vol in mounted:
        vol.close()
    for vol in mounted:
        assert not os.path.ismount(vol.mountpoint), f"{vol.mountpoint} left mounted"
