"""The file backend as durable, bounded state: LRU eviction past storage.file.capacity, an order
that survives restarts and is shared by daemons on one directory, a full disk, defaults."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from cachexferd.config import load_config
from cachexferd.storage.base import GetItem, GetStatus, PutItem
from cachexferd.storage.file import FileBackend, object_path
from cachexferd.storage.objects import HEADER_BYTES, ObjectCodec

BLOCK = 4096
OBJECT = HEADER_BYTES + BLOCK
NO_STOP = threading.Event()
CODEC = ObjectCodec("0123456789abcdef", BLOCK)


def put(fb: FileBackend, *names: str) -> None:
    data = memoryview(bytearray(os.urandom(BLOCK)))
    assert fb.put([PutItem(n, data, 0, CODEC.header) for n in names], NO_STOP) == [None] * len(names)


def get(fb: FileBackend, name: str) -> GetStatus:
    return fb.get([GetItem(name, memoryview(bytearray(BLOCK)), 0)], NO_STOP)[0].status


def stored(root: Path, names: list[str]) -> list[str]:
    return [n for n in names if os.path.isfile(object_path(str(root), n))]


def backend(root: Path, objects: int) -> FileBackend:
    """A backend with room for ``objects`` objects, indexed (as its start would do)."""
    fb = FileBackend(root, capacity=objects * OBJECT)
    fb.rescan()
    return fb


def test_put_past_the_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    fb = backend(tmp_path, objects=10)
    names = [f"k{i}" for i in range(10)]
    put(fb, *names)
    assert get(fb, "k0") is GetStatus.OK  # k0 is now the most recent
    put(fb, "k10")  # 11 objects > 10: evict down to 90% (9 objects): k1 and k2 go
    assert stored(tmp_path, [*names, "k10"]) == ["k0", *names[3:], "k10"]
    assert get(fb, "k1") is GetStatus.MISSING  # an evicted object is a normal miss
    d = fb.describe()
    assert d["objects"] == 9 and d["used_bytes"] == 9 * OBJECT and d["evicted"] == 2


def test_order_survives_a_restart(tmp_path: Path) -> None:
    fb = backend(tmp_path, objects=10)
    put(fb, *[f"k{i}" for i in range(8)])
    for name in ("k0", "k1"):  # reads set the mtime: the order is on disk
        _tick()
        assert get(fb, name) is GetStatus.OK
    fb.close()
    again = backend(tmp_path, objects=8)  # a restart with a smaller limit: 8 objects fit
    assert again.describe()["objects"] == 8
    _tick()
    put(again, "new")  # 9 > 8: down to 7 (90% of 8 rounds down): the two oldest go
    assert stored(tmp_path, ["k2", "k3"]) == []
    assert stored(tmp_path, ["k0", "k1", "k4", "new"]) == ["k0", "k1", "k4", "new"]


def test_two_daemons_on_one_directory_see_each_other_after_a_rescan(tmp_path: Path) -> None:
    a, b = backend(tmp_path, objects=10), backend(tmp_path, objects=10)
    put(a, *[f"a{i}" for i in range(6)])
    _tick()
    put(b, *[f"b{i}" for i in range(4)])
    assert get(b, "a5") is GetStatus.OK  # written by one, read by the other
    b.rescan()  # what the index thread does every few minutes
    assert b.describe()["objects"] == 10
    _tick()
    put(b, "b4")  # b now evicts a's oldest objects too
    assert stored(tmp_path, ["a0", "a1"]) == []
    assert len(stored(tmp_path, [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(5)])) == 9


def test_an_existing_directory_over_the_limit_is_trimmed_at_start(tmp_path: Path) -> None:
    put(backend(tmp_path, objects=100), *[f"k{i}" for i in range(20)])
    fb = FileBackend(tmp_path, capacity=10 * OBJECT)
    fb.start()  # indexes in the background, then evicts
    names = [f"k{i}" for i in range(20)]
    deadline = time.monotonic() + 20
    # The index drops its victims before their files are unlinked: wait for both.
    while time.monotonic() < deadline and not (
        fb.index.scanned and fb.describe()["objects"] <= 9 and len(stored(tmp_path, names)) <= 9
    ):
        time.sleep(0.05)
    fb.close()
    assert fb.describe()["objects"] == 9
    assert len(stored(tmp_path, names)) == 9


def test_a_full_disk_evicts_and_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fb = backend(tmp_path, objects=1000)  # far from the limit: the disk fills first
    put(fb, *[f"k{i}" for i in range(10)])
    real_write, calls = fb._write, []

    def write(item: PutItem, final: str) -> None:
        calls.append(item.name)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(item, final)

    monkeypatch.setattr(fb, "_write", write)
    put(fb, "new")
    assert calls == ["new", "new"]
    assert stored(tmp_path, ["k0", "new"]) == ["new"]  # the oldest made room


def test_no_limit_keeps_everything(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path, capacity=0)
    fb.rescan()
    put(fb, *[f"k{i}" for i in range(30)])
    assert fb.describe()["objects"] == 30 and fb.describe()["evicted"] == 0


def test_default_directory_is_durable_and_shared_by_ranks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "lib"))  # systemd's StateDirectory=
    ranks = [load_config(overrides={"daemon.rank": r}, environ={}) for r in (0, 1)]
    assert {c.storage_path for c in ranks} == {tmp_path / "lib" / "storage"}
    monkeypatch.delenv("STATE_DIRECTORY")
    home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state")
    expected = "/var/lib/cachexferd/storage" if os.geteuid() == 0 else str(home / "cachexferd/storage")
    assert str(load_config(environ={}).storage_path) == expected


def test_nothing_is_created_until_first_use(tmp_path: Path) -> None:
    fb = FileBackend(tmp_path / "store", capacity=OBJECT * 4)
    fb.start()
    assert not (tmp_path / "store").exists() and fb.describe()["state"] == "not created yet"
    put(fb, "k")
    assert fb.describe()["state"] == "ready"
    fb.close()


def _tick() -> None:
    """File mtimes must differ for the order to be visible on disk (coarse clocks)."""
    time.sleep(0.02)
