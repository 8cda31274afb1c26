"""Storage commands against a real directory, through in-process daemons and real sockets."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachexferd.client import RunnerClient
from cachexferd.protocol import KVLayout, Limits
from cachexferd.storage.file import object_path
from cachexferd.storage.objects import HEADER_BYTES
from tests.helpers import SMALL, InProcessDaemon, assert_moved, assert_untouched, config_for
from tests.storage_rig import Node, cancel_flips, key_space, prompt, swap_sectors

KEYS = key_space().token_keys(prompt(4 * 5 + 3))  # 5 full blocks + a partial block of 3 tokens


@pytest.fixture
def store_dir(short_tmp: Path) -> Path:
    return short_tmp / "pool"


@pytest.fixture
def node(short_tmp: Path, store_dir: Path) -> Iterator[Node]:
    n = Node.in_process(short_tmp / "a", seed=1, storage__file__path=str(store_dir))
    yield n
    n.close()


def stored(node: Node, keys: list[str], device: list[int], host: list[int]) -> None:
    assert node.ok("store", keys, host_ids=host, device_ids=device)["stored"] == len(keys)


def test_device_blocks_roundtrip_through_storage(short_tmp: Path, store_dir: Path, node: Node) -> None:
    other = Node.in_process(short_tmp / "b", seed=2, storage__file__path=str(store_dir))
    try:
        src, dst = [3, 4, 5, 10, 11, 40], [30, 31, 2, 7, 8, 9]
        stored(node, KEYS, src, [0, 1, 2, 3, 4, 5])
        assert other.ok("lookup", KEYS)["prefix"] == 6
        result = other.ok("load", KEYS, host_ids=[100, 101, 102, 103, 104, 105], device_ids=dst)
        assert result["loaded"] == 6 and result["bytes"] == 6 * SMALL.host_block_bytes
        assert_moved(other.cache, dst, node.before, src)
        assert_untouched(other.cache, other.before, dst)
        assert_untouched(node.cache, node.before, [])  # the store only read the source
    finally:
        other.close()


def test_host_blocks_store_and_load_then_swap_in(node: Node) -> None:
    node.ok("swap_out", [6, 7], [50, 51])
    assert node.ok("store", KEYS[:2], host_ids=[50, 51])["stored"] == 2
    assert node.ok("load", KEYS[:2], host_ids=[60, 61])["loaded"] == 2
    node.ok("swap_in", [20, 21], [60, 61])
    assert_moved(node.cache, [20, 21], node.before, [6, 7])
    assert_untouched(node.cache, node.before, [20, 21])


def test_misses_end_the_prefix_and_leave_later_device_blocks_alone(node: Node) -> None:
    stored(node, [KEYS[0], KEYS[1], KEYS[3]], [1, 2, 4], [0, 1, 3])  # KEYS[2] never stored
    assert node.ok("lookup", KEYS)["prefix"] == 2
    assert node.ok("load", KEYS[:4], host_ids=[10, 11, 12, 13], device_ids=[30, 31, 32, 33])["loaded"] == 2
    assert_moved(node.cache, [30, 31], node.before, [1, 2])
    assert_untouched(node.cache, node.before, [30, 31])
    assert node.ok("load", ["never-stored", *KEYS[:2]], host_ids=[10, 11, 12])["loaded"] == 0
    assert node.ok("lookup", [])["prefix"] == 0 and node.ok("load", [], host_ids=[])["loaded"] == 0


def _damage(path: str, how: str) -> None:
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "truncate":
        os.truncate(path, HEADER_BYTES + 10)
    elif how == "extend":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif how == "header":
        with open(path, "r+b") as f:
            f.write(b"XXXX")
    elif how in ("sector-swap", "cancelling-flips"):  # corruptions an order-blind sum misses
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES)
            payload = bytearray(f.read())
            f.seek(HEADER_BYTES)
            f.write(swap_sectors(payload) if how == "sector-swap" else cancel_flips(payload))


@pytest.mark.parametrize(
    "how", ["flip", "truncate", "extend", "header", "misplaced", "sector-swap", "cancelling-flips"]
)
def test_corrupt_objects_are_misses_plus_an_error_metric(node: Node, store_dir: Path, how: str) -> None:
    stored(node, KEYS[:3], [1, 2, 3], [0, 1, 2])
    target = object_path(str(store_dir), f"w0/{KEYS[1]}")
    if how == "misplaced":  # another key's valid object under this key's name
        os.replace(object_path(str(store_dir), f"w0/{KEYS[2]}"), target)
    else:
        _damage(target, how)
    before = node.metric("cachexferd_storage_errors_total", kind="corrupt")
    result = node.ok("load", KEYS[:3], host_ids=[10, 11, 12], device_ids=[20, 21, 22])
    assert result["loaded"] == 1
    assert node.metric("cachexferd_storage_errors_total", kind="corrupt") == before + 1
    assert_moved(node.cache, [20], node.before, [1])
    assert_untouched(node.cache, node.before, [20])
    assert node.ok("lookup", KEYS[:3])["prefix"] >= 1  # presence is not validity; the daemon still serves


def test_objects_of_another_layout_are_mismatches(short_tmp: Path, store_dir: Path, node: Node) -> None:
    # Same bytes per block, other dtype: a different layout fingerprint under the same key.
    other_layout = KVLayout(**{**SMALL.to_wire(), "dtype": "bfloat16"})
    other = Node.in_process(short_tmp / "b", seed=3, layout=other_layout, storage__file__path=str(store_dir))
    try:
        stored(other, KEYS[:2], [1, 2], [0, 1])
        assert node.ok("load", KEYS[:2], host_ids=[5, 6])["loaded"] == 0
        assert node.metric("cachexferd_storage_errors_total", kind="mismatch") == 2  # both objects counted
    finally:
        other.close()


def test_bad_commands_get_clear_errors_and_the_daemon_keeps_serving(node: Node) -> None:
    two = KEYS[:2]
    host_blocks = node.status()["host_cache"]["num_blocks"]
    cases = [
        (("store", two), {"host_ids": [0]}, "LENGTH_MISMATCH"),
        (("load", two), {"host_ids": [0, 1], "device_ids": [1]}, "LENGTH_MISMATCH"),
        (("store", two), {"host_ids": [0, host_blocks]}, "ID_OUT_OF_RANGE"),
        (("load", two), {"host_ids": [0, 1], "device_ids": [0, SMALL.num_blocks]}, "ID_OUT_OF_RANGE"),
        (("store", [KEYS[0], KEYS[0]]), {"host_ids": [0, 1]}, "DUPLICATE_ID"),
        (("load", two), {"host_ids": [3, 3]}, "DUPLICATE_ID"),
        (("load", two), {"host_ids": [3, 4], "device_ids": [9, 9]}, "DUPLICATE_ID"),
        (("store", two), {"host_ids": [3, 3], "device_ids": [1, 2]}, "DUPLICATE_ID"),  # staging writes host
        (("lookup", ["has space"]), {}, "BAD_FIELD"),
        (("delete", ["x" * (Limits.MAX_KEY_BYTES + 1)]), {}, "BAD_FIELD"),
        (("lookup", ["k"] * (Limits.MAX_KEYS + 1)), {}, "TOO_LARGE"),
    ]
    for (op, keys), kwargs, expected in cases:
        assert node.error(op, keys, **kwargs)[0] == expected, (op, kwargs)
    # Duplicate source host blocks are fine for a host-only store (it only reads them).
    assert node.ok("store", two, host_ids=[7, 7])["stored"] == 2
    assert node.ok("lookup", two)["prefix"] == 2


def test_not_attached_and_no_storage(short_tmp: Path) -> None:
    bare = InProcessDaemon(config_for(short_tmp / "bare")).start()
    none = Node.in_process(short_tmp / "none", storage__backend="none")
    try:
        from cachexferd.client import EngineClient

        with EngineClient([bare.endpoint], timeout_s=10) as engine:
            engine.connect()
            req = engine.store(["k"], host_ids=[0])
            assert engine.wait([req], 10)[req].errors[0][0] == "NOT_ATTACHED"
        for op, args in (("store", (["k"], [0])), ("load", (["k"], [0])), ("lookup", (["k"],)), ("delete", (["k"],))):
            assert none.error(op, *args)[0] == "NO_STORAGE"
        assert none.status()["storage"] == {"backend": "none"}
    finally:
        bare.stop()
        none.close()


def test_store_and_load_of_one_key_keep_submission_order(node: Node) -> None:
    """Pipelined without waiting: swap-out A into host 40, store K from 40, swap-out B over 40,
    load K into 41. The store must read A (before B overwrote 40), the load must find K."""
    reqs = [
        node.engine.swap_out([1], [40]),
        node.engine.store([KEYS[0]], host_ids=[40]),
        node.engine.swap_out([2], [40]),
        node.engine.load([KEYS[0]], host_ids=[41], device_ids=[44]),
        node.engine.delete([KEYS[0]]),
        node.engine.lookup([KEYS[0]]),
    ]
    done = node.engine.wait(reqs, 30)
    assert all(done[r].ok for r in reqs), [done[r].describe() for r in reqs]
    assert done[reqs[3]].result()["loaded"] == 1
    assert done[reqs[5]].result()["prefix"] == 0
    assert_moved(node.cache, [44], node.before, [1])
    assert_untouched(node.cache, node.before, [44])


def test_a_hung_read_times_out_and_the_daemon_keeps_serving(short_tmp: Path, store_dir: Path) -> None:
    node = Node.in_process(short_tmp / "t", seed=4, storage__file__path=str(store_dir), storage__timeout_s=0.5)
    try:
        stored(node, KEYS[:2], [1, 2], [0, 1])
        fifo = object_path(str(store_dir), f"w0/{KEYS[1]}")
        os.unlink(fifo)
        os.mkfifo(fifo)  # opening it for reading blocks until a writer comes: a hung file system
        start = time.monotonic()
        assert node.error("load", KEYS[:2], host_ids=[10, 11])[0] == "STORAGE_TIMEOUT"
        assert time.monotonic() - start < 3.0  # deadline + bounded grace for the stuck worker
        assert node.ok("load", KEYS[:1], host_ids=[12], device_ids=[30])["loaded"] == 1  # other threads serve
        assert node.metric("cachexferd_storage_errors_total", kind="timeout") == 1
        # The engine reuses host block 11 after the timeout: its swap-out waits while the
        # stuck read still holds that block, so the read can never land on top of it.
        reuse = node.engine.swap_out([5], [11])
        assert node.engine.poll(timeout_ms=300) == []
        _release_fifo(fifo, b"\xee" * 8192)
        done = node.engine.wait([reuse], timeout_s=10)[reuse]
        assert done.ok, done.describe()
        node.ok("swap_in", [31], [11])
        assert_moved(node.cache, [30, 31], node.before, [1, 5])
        assert_untouched(node.cache, node.before, [30, 31])
    finally:
        _release_fifo(fifo)
        node.close()


def _release_fifo(path: str, data: bytes = b"") -> None:
    """Lets a reader stuck in open() go; it then reads ``data`` and EOF."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        if data:
            os.write(fd, data)
    except OSError:
        pass
    finally:
        os.close(fd)


def test_unusable_directory_is_unavailable_then_recovers(short_tmp: Path) -> None:
    blocker = short_tmp / "blocked"
    blocker.write_text("not a directory")
    node = Node.in_process(short_tmp / "u", seed=5, storage__file__path=str(blocker))
    try:
        assert node.error("store", KEYS[:1], host_ids=[0], device_ids=[1])[0] == "STORAGE_UNAVAILABLE"
        node.ok("swap_out", [2], [3])  # copies still work
        blocker.unlink()
        assert node.ok("store", KEYS[:1], host_ids=[0], device_ids=[1])["stored"] == 1
        assert node.status()["storage"]["state"] == "ready"
    finally:
        node.close()


def test_detach_cancels_a_load_waiting_on_storage(short_tmp: Path, store_dir: Path) -> None:
    node = Node.in_process(short_tmp / "d", seed=6, storage__file__path=str(store_dir), storage__timeout_s=5)
    fifo = object_path(str(store_dir), f"w0/{KEYS[0]}")
    try:
        os.makedirs(os.path.dirname(fifo), exist_ok=True)
        os.mkfifo(fifo)
        req = node.engine.load(KEYS[:1], host_ids=[0], device_ids=[0])
        node.engine.status()  # same socket as the load: once answered, the daemon has read it
        runner = RunnerClient(node.endpoint)
        threading.Timer(0.5, _release_fifo, (fifo,)).start()  # the stuck worker lets go later
        runner.detach(drain_timeout_s=0.1)
        runner.close()
        done = node.engine.wait([req], 15)[req]
        assert done.errors[0][0] == "DETACHED"
    finally:
        _release_fifo(fifo)
        node.engine.close()
        node.runner.close()
        node.cache.close()
        node._stop()
