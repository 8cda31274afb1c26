"""The file backend on a real directory: layout, atomic writes, reads into buffers, misses."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from cachexferd.storage.base import GetItem, GetStatus, PutItem, StorageUnavailable
from cachexferd.storage.file import FileBackend, object_path
from cachexferd.storage.objects import HEADER_BYTES, ObjectCodec

FP = "0123456789abcdef"
BLOCK = 4096
NO_STOP = threading.Event()


def items(n: int, seed: int = 0) -> tuple[list[PutItem], bytearray]:
    data = bytearray(os.urandom(n * BLOCK))
    codec = ObjectCodec(FP, BLOCK)
    views = [memoryview(data)[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]
    return [PutItem(f"key/{seed}/../{i}", v, 0, codec.header) for i, v in enumerate(views)], data


def get_items(names: list[str]) -> tuple[list[GetItem], bytearray]:
    target = bytearray(len(names) * BLOCK)
    return [GetItem(n, memoryview(target)[i * BLOCK : (i + 1) * BLOCK], 0) for i, n in enumerate(names)], target


def test_put_get_roundtrip_into_buffers(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path / "store")
    fb.start()
    puts, data = items(5)
    assert fb.put(puts, NO_STOP) == [None] * 5
    gets, target = get_items([p.name for p in puts])
    results = fb.get(gets, NO_STOP)
    assert [r.status for r in results] == [GetStatus.OK] * 5
    assert all(r.received == HEADER_BYTES + BLOCK for r in results)
    assert target == data
    codec = ObjectCodec(FP, BLOCK)
    assert all(codec.check(g.name, r.header, g.payload, r.received)[0] == "ok" for g, r in zip(gets, results))


def test_layout_is_hashed_fanout_and_leaves_no_temp_files(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path)
    fb.start()
    puts, _ = items(3)
    fb.put(puts, NO_STOP)
    for p in puts:  # '/' and '..' in keys never reach the file system as path parts
        path = Path(object_path(str(tmp_path), p.name))
        assert path.is_file() and path.parent.parent.parent == tmp_path
        assert path.stat().st_size == HEADER_BYTES + BLOCK
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_misses_exists_prefix_and_delete(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path)
    fb.start()
    puts, _ = items(3)
    fb.put(puts, NO_STOP)
    names = [p.name for p in puts]
    assert fb.exists(names) == [True, True, True]
    assert fb.exists([names[0], "absent", names[2]]) == [True, False, False]  # stops at the first miss
    gets, _ = get_items(["absent", names[1]])
    assert [r.status for r in fb.get(gets, NO_STOP)] == [GetStatus.MISSING, GetStatus.OK]
    assert fb.delete([names[0], "absent", names[1]]) == 2
    assert fb.exists(names) == [False, False, False]


def test_longer_and_shorter_files_report_what_was_read(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path)
    fb.start()
    puts, _ = items(2)
    fb.put(puts, NO_STOP)
    with open(object_path(str(tmp_path), puts[0].name), "ab") as f:
        f.write(b"x")
    os.truncate(object_path(str(tmp_path), puts[1].name), 100)
    gets, _ = get_items([p.name for p in puts])
    long, short = fb.get(gets, NO_STOP)
    assert long.received == HEADER_BYTES + BLOCK + 1
    assert short.received == 100


def test_stop_flag_leaves_buffers_alone(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path)
    fb.start()
    puts, _ = items(2)
    stop = threading.Event()
    stop.set()
    assert fb.put(puts, stop) == ["stopped", "stopped"]
    fb.put(puts, NO_STOP)
    gets, target = get_items([p.name for p in puts])
    assert all(r.status is GetStatus.FAILED for r in fb.get(gets, stop))
    assert target == bytearray(len(target))


def test_unusable_directory_is_unavailable_until_fixed(tmp_path: Path) -> None:
    blocker = tmp_path / "store"
    blocker.write_text("a file where the directory should be")
    fb = FileBackend(blocker)
    fb.start()  # logs, never raises: the daemon keeps serving
    puts, _ = items(1)
    with pytest.raises(StorageUnavailable):
        fb.put(puts, NO_STOP)
    blocker.unlink()
    assert fb.put(puts, NO_STOP) == [None]


def test_directory_removed_while_running(tmp_path: Path) -> None:
    import shutil

    fb = FileBackend(tmp_path / "store")
    fb.start()
    puts, _ = items(2)
    fb.put(puts, NO_STOP)
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(StorageUnavailable):
        fb.put(puts, NO_STOP)
    assert fb.put(puts, NO_STOP) == [None, None]  # recreated on the next call


def test_stale_temp_files_are_cleaned_at_start(tmp_path: Path) -> None:
    tmp = tmp_path / ".tmp"
    tmp.mkdir()
    old, fresh = tmp / "old", tmp / "fresh"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    FileBackend(tmp_path).start()
    assert not old.exists() and fresh.exists()  # a live writer elsewhere may own the fresh one


def test_a_read_that_was_stuck_past_its_stop_leaves_the_buffer_alone(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path)
    fb.start()
    name = "stuck"
    path = object_path(str(tmp_path), name)
    os.makedirs(os.path.dirname(path))
    os.mkfifo(path)  # open() for reading blocks until a writer comes: a hung file system
    gets, target = get_items([name])
    stop = threading.Event()
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.extend(fb.get(gets, stop)))
    reader.start()
    time.sleep(0.1)
    stop.set()  # the daemon gave up on the call (timeout) while open() hung
    fd = os.open(path, os.O_WRONLY)  # now the open returns
    os.write(fd, b"\xee" * 100)
    os.close(fd)
    reader.join(5)
    assert not reader.is_alive()
    (got,) = result
    assert got.status is GetStatus.FAILED and got.detail == "stopped"  # type: ignore[attr-defined]
    assert target == bytearray(len(target))


def test_objects_and_directories_are_not_readable_by_all(tmp_path: Path) -> None:
    import stat

    fb = FileBackend(tmp_path / "store")
    fb.start()
    puts, _ = items(1)
    old = os.umask(0o022)  # the usual umask: the modes come from the backend, not from it
    try:
        assert fb.put(puts, NO_STOP) == [None]
    finally:
        os.umask(old)
    path = Path(object_path(str(tmp_path / "store"), puts[0].name))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750


def test_a_scan_counts_and_evicts_objects_only(tmp_path: Path) -> None:
    """Files in the fan-out directories that are not objects (a name that is no object id,
    or an id under another id's directories) are never counted or evicted."""
    size = HEADER_BYTES + BLOCK
    fb = FileBackend(tmp_path, capacity=2 * size)
    puts, _ = items(3)
    fb.put(puts[:2], NO_STOP)
    first = Path(object_path(str(tmp_path), puts[0].name))
    strays = [first.parent / "notes.txt", first.parent / ("0" * 32)]  # "00…" lives under 00/00/
    for stray in strays:
        stray.write_bytes(bytes(10 * size))
    fb.rescan()
    assert fb.describe()["objects"] == 2 and fb.index.total == 2 * size
    fb.put(puts[2:], NO_STOP)  # over the capacity: an object makes room, never a stray file
    assert all(stray.stat().st_size == 10 * size for stray in strays)
    assert fb.describe()["objects"] == 1 and not first.exists()  # down to 90% of the capacity
    assert Path(object_path(str(tmp_path), puts[2].name)).is_file()
