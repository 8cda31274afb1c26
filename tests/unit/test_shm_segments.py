"""Removing a dead runner's shared-memory segment: only the file the daemon mapped (same
device, inode and owner), never another file that took its name; emptied where the daemon
may not unlink it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachexferd.backends.base import AttachError
from cachexferd.backends.cpu import SegmentIdentity, decode_device, remove_segment
from cachexferd.protocol import ErrorCode

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another user)")


@pytest.fixture
def segment() -> Iterator[Path]:
    path = Path(f"/dev/shm/cx-test-{uuid.uuid4().hex[:12]}")
    path.write_bytes(b"\x11" * 8192)
    yield path
    path.unlink(missing_ok=True)


def identity(path: Path) -> SegmentIdentity:
    return SegmentIdentity.of(os.stat(path))


def test_removes_the_file_it_mapped(segment: Path) -> None:
    assert remove_segment(segment.name, identity(segment)) == "removed"
    assert not segment.exists()
    assert remove_segment(segment.name, SegmentIdentity(0, 0, 0)) == "gone"


@as_root
def test_leaves_another_users_file_that_took_the_name(segment: Path) -> None:
    mapped = identity(segment)
    segment.unlink()  # the runner's user cleaned up; someone else took the name
    segment.write_bytes(b"theirs")
    os.chown(segment, NOBODY, NOBODY)
    assert remove_segment(segment.name, mapped) == "replaced"
    assert segment.read_bytes() == b"theirs"


@as_root
def test_leaves_the_same_file_once_it_changed_owner(segment: Path) -> None:
    mapped = identity(segment)
    os.chown(segment, NOBODY, NOBODY)
    assert remove_segment(segment.name, mapped) == "replaced"
    assert segment.stat().st_size == 8192


def test_empties_what_it_may_not_unlink(tmp_path: Path) -> None:
    """A directory where unlinking is refused stands in for the sticky /dev/shm (the real case,
    with real users, is tests/system/test_group_runner_crash.py)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    path = shm / "seg"
    path.write_bytes(b"\x22" * 4096)
    mapped = identity(path)
    shm.chmod(0o555)  # no unlink in here (root ignores modes: then it removes instead)
    try:
        result = remove_segment("seg", mapped, shm_dir=str(shm))
    finally:
        shm.chmod(0o755)
    if os.geteuid() == 0:
        assert result == "removed" and not path.exists()
    else:
        assert result == "emptied" and path.exists() and path.stat().st_size == 0


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ({"kind": "shm", "name": "x", "offsets": [0], "_segment_policy": {}}, "unknown fields ['_segment_policy']"),
        ({"kind": "cuda_ipc", "name": "x", "offsets": [0]}, "device.kind = 'shm'"),
        ({"kind": "shm", "name": "../etc/passwd", "offsets": [0]}, "device.name"),
        (["shm"], "device.kind"),
    ],
)
def test_the_shm_device_map_is_decoded_strictly(device: object, message: str) -> None:
    with pytest.raises(AttachError) as info:
        decode_device(device)
    assert info.value.code == ErrorCode.BAD_FIELD and message in str(info.value)
