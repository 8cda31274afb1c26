"""The file store under pressure, over real daemons: eviction keeps chains loadable (tails go
before heads), a STORE never evicts what it has just written and reports only what a LOAD
can deliver, both under ``storage.file.capacity`` and on a real file system that fills up (a
1 MiB tmpfs, mounted when the tests run as root)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachexferd.launch import DaemonProcess
from cachexferd.protocol import KVLayout
from cachexferd.storage.file import object_path
from cachexferd.storage.objects import HEADER_BYTES

from ..helpers import assert_moved, assert_untouched
from ..storage_rig import Node

Spawn = Callable[..., DaemonProcess]
LAYOUT = KVLayout(num_layers=1, num_blocks=512, block_size=16, num_kv_heads=1, head_dim=64, dtype="float16")
OBJECT = HEADER_BYTES + LAYOUT.host_block_bytes  # 4 KiB + 64 B: two pages on tmpfs


def _node(spawn: Spawn, store: Path, **settings: object) -> Node:
    daemon = spawn(settings={"storage.backend": "file", "storage.file.path": str(store), **settings})
    return Node.subprocess(daemon, seed=3, layout=LAYOUT)


def _keys(name: str, count: int, start: int = 0) -> list[str]:
    return [f"{name}-{i}" for i in range(start, start + count)]


def _on_disk(store: Path, keys: list[str]) -> list[bool]:
    return [os.path.isfile(object_path(str(store), f"w0/{k}")) for k in keys]


def _store(node: Node, keys: list[str], first_block: int, parent: str | None = None) -> dict[str, int]:
    blocks = list(range(first_block, first_block + len(keys)))
    extra = {} if parent is None else {"parent": parent}
    return node.ok("store", keys, host_ids=blocks, device_ids=blocks, **extra)


def _load_back(node: Node, keys: list[str], src_first: int) -> int:
    """Loads the chain into device blocks 300.. and checks the delivered prefix byte for byte
    against the blocks it was stored from, and every other block unchanged."""
    dst = list(range(300, 300 + len(keys)))
    loaded = node.ok("load", keys, host_ids=[1000 + i for i in range(len(keys))], device_ids=dst)["loaded"]
    assert_moved(node.cache, dst[:loaded], node.before, list(range(src_first, src_first + loaded)))
    assert_untouched(node.cache, node.before, dst[:loaded])
    return int(loaded)


def _check_store_result(result: dict[str, int], store: Path, keys: list[str]) -> int:
    """The STORE's ``stored`` leading objects are on disk; nothing it counts as stored is gone."""
    stored = result["stored"]
    assert all(_on_disk(store, keys[:stored])), "a STORE reported objects stored that are not there"
    assert result["failed"] == len(keys) - stored
    return stored


def _under(pressure: str, objects: int, short_tmp: Path, request: pytest.FixtureRequest) -> tuple[Path, dict[str, int]]:
    """(store directory, settings): room for ``objects`` under storage.file.capacity, or a
    small tmpfs that fills up."""
    if pressure == "capacity":
        return short_tmp / "store", {"storage.file.capacity": objects * OBJECT}
    return request.getfixturevalue("small_fs") / "store", {}


@pytest.mark.parametrize("pressure", ["capacity", "full-file-system"])
def test_a_chain_larger_than_the_store_keeps_the_prefix_that_fits(
    spawn_daemon: Spawn, short_tmp: Path, pressure: str, request: pytest.FixtureRequest
) -> None:
    store, settings = _under(pressure, 100, short_tmp, request)
    node = _node(spawn_daemon, store, **settings)
    try:
        keys = _keys("chain", 200)
        stored = _check_store_result(_store(node, keys, 0), store, keys)
        fits = sum(_on_disk(store, keys))
        assert fits == stored, "objects of the chain past the reported prefix"
        assert stored >= 80, f"only {stored} of 200 objects stored in room for about 100 or more"
        assert _load_back(node, keys, 0) == stored
    finally:
        node.close()


@pytest.mark.parametrize("pressure", ["capacity", "full-file-system"])
def test_eviction_takes_chain_tails_before_heads(
    spawn_daemon: Spawn, short_tmp: Path, pressure: str, request: pytest.FixtureRequest
) -> None:
    store, settings = _under(pressure, 100, short_tmp, request)
    chain = 60 if pressure == "capacity" else 80
    node = _node(spawn_daemon, store, **settings)
    try:
        first, second = _keys("a", chain), _keys("b", chain)
        assert _check_store_result(_store(node, first, 0), store, first) == chain
        assert _check_store_result(_store(node, second, chain), store, second) == chain  # evicts from `first`
        present = _on_disk(store, first)
        assert 0 < sum(present) < chain
        assert present == sorted(present, reverse=True), "a head was evicted before its tail"
        assert _load_back(node, first, 0) == sum(present) >= chain // 4
        assert _load_back(node, second, chain) == chain
    finally:
        node.close()


def test_a_store_that_names_its_parent_extends_the_chain(spawn_daemon: Spawn, short_tmp: Path) -> None:
    """A chain stored in two STOREs, the second naming the first's last key: the first part
    is kept while the second is, so eviction shortens the chain from its end."""
    store = short_tmp / "store"
    node = _node(spawn_daemon, store, **{"storage.file.capacity": 100 * OBJECT})
    try:
        chain = _keys("a", 80)
        _store(node, chain[:40], 0)
        _store(node, chain[40:], 40, parent=chain[39])
        _store(node, _keys("b", 60), 100)  # 140 objects for room of 100: 50 evicted
        present = _on_disk(store, chain)
        assert present == sorted(present, reverse=True) and sum(present) == 30, present
        assert _load_back(node, chain, 0) == 30
    finally:
        node.close()


@pytest.mark.parametrize("pressure", ["capacity", "full-file-system"])
def test_a_chain_stored_piece_by_piece_keeps_its_head_when_the_store_fills(
    spawn_daemon: Spawn, short_tmp: Path, pressure: str, request: pytest.FixtureRequest
) -> None:
    """200 keys stored as 20 STOREs of 10, each naming the key before it as ``parent``, into
    a store that holds fewer: a STORE never evicts its own chain's tail to make room for its
    new objects (which would cut them off from the head), so the chain keeps the prefix that
    fits and a LOAD of the whole chain delivers it (docs/storage.md §4.1)."""
    store, settings = _under(pressure, 90, short_tmp, request)
    node = _node(spawn_daemon, store, **settings)
    try:
        whole = _keys("whole", 200)  # what the store holds: one STORE of the whole chain
        holds = _store(node, whole, 0)["stored"]
        assert node.ok("delete", whole)["deleted"] == holds
        keys, prefixes = _keys("chain", 200), []
        for first in range(0, 200, 10):
            blocks, extra = list(range(first, first + 10)), {"parent": keys[first - 1]} if first else {}
            result = node.run("store", keys[first : first + 10], host_ids=blocks, device_ids=blocks, **extra)
            assert result.ok or result.errors[0][0] == "STORAGE_ERROR", result.describe()  # full: nothing written
            prefixes.append(node.ok("lookup", keys)["prefix"])
        assert prefixes == sorted(prefixes), f"the loadable prefix shrank: {prefixes}"
        present = _on_disk(store, keys)
        assert present == sorted(present, reverse=True), "objects past the loadable prefix were kept"
        loaded = _load_back(node, keys, 0)
        assert loaded >= 0.8 * holds, f"loaded {loaded} of the {holds} objects the store holds ({prefixes})"
    finally:
        node.close()


@pytest.fixture
def small_fs(short_tmp: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real file system that fills up (ENOSPC)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = short_tmp / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)
