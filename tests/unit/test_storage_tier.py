"""Storage tier logic with a scripted backend: sharding, prefixes, deadlines, stop, error codes,
and the ordering ids storage commands declare. (Real backends: tests/integration.)"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cachexferd.backends.base import CancelToken
from cachexferd.config import load_config
from cachexferd.daemon import storage_tier
from cachexferd.daemon.jobs import HoldBlocks
from cachexferd.daemon.ordering import Access
from cachexferd.daemon.storage_tier import SHARD_MIN_BYTES, IOPool, StorageTier, shards
from cachexferd.host_cache import HostPool
from cachexferd.metrics import DaemonMetrics
from cachexferd.protocol import ErrorCode, ProtocolError
from cachexferd.storage import journal as journal_module
from cachexferd.storage.base import (
    MISSING,
    GetItem,
    GetResult,
    GetStatus,
    PutItem,
    StorageBackend,
    StorageFailure,
    StorageUnavailable,
)
from cachexferd.storage.file import FileBackend
from cachexferd.storage.journal import FileJournal, object_id
from cachexferd.storage.objects import HEADER_BYTES

FP = "0123456789abcdef"
BLOCK = 4096


class Scripted(StorageBackend):
    """Keeps objects in a dict; ``hold`` makes calls wait; ``fail`` raises from every call."""

    name = "scripted"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.hold = threading.Event()
        self.hold.set()
        self.fail: Exception | None = None
        self.refuse: set[str] = set()
        self.saw_stop = threading.Event()
        self.finished = threading.Event()

    def _enter(self, stop: threading.Event) -> None:
        if self.fail is not None:
            raise self.fail
        while not self.hold.wait(0.01):
            pass
        if stop.is_set():
            self.saw_stop.set()

    def put(self, items: list[PutItem], stop: threading.Event) -> list[str | None]:
        self._enter(stop)
        out: list[str | None] = []
        for item in items:
            if item.name in self.refuse:
                out.append("refused")
                continue
            self.objects[item.name] = item.header() + bytes(item.payload)
            out.append(None)
        return out

    def get(self, items: list[GetItem], stop: threading.Event) -> list[GetResult]:
        self._enter(stop)
        out = []
        for item in items:
            raw = self.objects.get(item.name)
            if raw is None or stop.is_set():
                out.append(MISSING)
                continue
            item.payload[:] = raw[64:]
            out.append(item.landed(GetResult(GetStatus.OK, raw[:64], len(raw))))
        self.finished.set()
        return out

    def exists(self, names: list[str]) -> list[bool]:
        self._enter(threading.Event())
        return [n in self.objects for n in names]

    def delete(self, names: list[str]) -> int:
        self._enter(threading.Event())
        return sum(1 for n in names if self.objects.pop(n, None) is not None)


@pytest.fixture
def tier() -> Iterator[StorageTier]:
    config = load_config(overrides={"storage.timeout_s": 0.3, "storage.io_threads": 2}, environ={})
    pool = HostPool(64 * BLOCK)
    pool.tensor.random_(0, 256)
    t = StorageTier(Scripted(), config.storage, pool, DaemonMetrics(0, "cpu"))
    yield t
    t.backend.hold.set()  # type: ignore[attr-defined]
    t.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def errors(t: StorageTier, kind: str) -> float:
    value = t.metrics.registry.get_sample_value("cachexferd_storage_errors_total", {"kind": kind})
    return value or 0.0


def test_shards_are_contiguous_bounded_and_not_tiny() -> None:
    assert shards(0, BLOCK, 4) == []
    assert shards(10, BLOCK, 4) == [slice(0, 10)]  # 40 KiB: one call
    parts = shards(64, 1 << 20, 4)
    assert len(parts) == 4 and parts[0].start == 0 and parts[-1].stop == 64
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    assert len(shards(3, 1 << 30, 8)) == 3


def test_io_pool_runs_calls_and_returns_exceptions() -> None:
    pool = IOPool(2)
    try:
        assert pool.submit(lambda: 41 + 1).result(5) == 42
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(5)
    finally:
        pool.close()


def test_store_then_load_reports_the_contiguous_prefix(tier: StorageTier) -> None:
    keys = [f"k{i}" for i in range(6)]
    result = run(tier.store(keys, list(range(6)), BLOCK, FP, 0, CancelToken()))
    assert result == {"stored": 6, "failed": 0, "bytes": 6 * BLOCK}
    assert run(tier.load(keys, list(range(10, 16)), BLOCK, FP, 0, CancelToken())) == 6
    assert bytes(tier.pool.memory(10 * BLOCK, 6 * BLOCK)) == bytes(tier.pool.memory(0, 6 * BLOCK))
    del tier.backend.objects["w0/k3"]  # type: ignore[attr-defined]
    assert run(tier.load(keys, list(range(10, 16)), BLOCK, FP, 0, CancelToken())) == 3
    assert run(tier.lookup(keys, 0, CancelToken())) == 3
    assert run(tier.delete(keys[:2], 0, CancelToken())) == 2
    assert run(tier.lookup(keys, 0, CancelToken())) == 0


def test_corrupt_and_mismatched_objects_end_the_prefix_and_count(tier: StorageTier) -> None:
    keys = ["a", "b", "c"]
    run(tier.store(keys, [0, 1, 2], BLOCK, FP, 0, CancelToken()))
    objects = tier.backend.objects  # type: ignore[attr-defined]
    raw = bytearray(objects["w0/b"])
    raw[100] ^= 1
    objects["w0/b"] = bytes(raw)
    assert run(tier.load(keys, [20, 21, 22], BLOCK, FP, 0, CancelToken())) == 1
    assert errors(tier, "corrupt") == 1
    run(tier.store(["b"], [1], BLOCK, "fedcba9876543210", 0, CancelToken()))  # same key, other layout
    assert run(tier.load(keys, [20, 21, 22], BLOCK, FP, 0, CancelToken())) == 1
    assert errors(tier, "mismatch") == 1


def test_partial_and_total_store_failures(tier: StorageTier) -> None:
    tier.backend.refuse = {"w0/k2"}  # type: ignore[attr-defined]
    result = run(tier.store(["k0", "k1", "k2", "k3"], [0, 1, 2, 3], BLOCK, FP, 0, CancelToken()))
    assert result["stored"] == 2 and result["failed"] == 1
    tier.backend.refuse = {"w0/x"}  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError) as exc:
        run(tier.store(["x"], [0], BLOCK, FP, 0, CancelToken()))
    assert exc.value.code == ErrorCode.STORAGE_ERROR


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (StorageUnavailable("down"), ErrorCode.STORAGE_UNAVAILABLE),
        (StorageFailure("said no"), ErrorCode.STORAGE_ERROR),
        (RuntimeError("binding bug"), ErrorCode.STORAGE_ERROR),
    ],
)
def test_backend_exceptions_become_storage_codes(tier: StorageTier, failure: Exception, code: ErrorCode) -> None:
    tier.backend.fail = failure  # type: ignore[attr-defined]
    for call in (
        tier.load(["k"], [0], BLOCK, FP, 0, CancelToken()),
        tier.store(["k"], [0], BLOCK, FP, 0, CancelToken()),
        tier.lookup(["k"], 0, CancelToken()),
        tier.delete(["k"], 0, CancelToken()),
    ):
        with pytest.raises(ProtocolError) as exc:
            run(call)
        assert exc.value.code == code
    tier.backend.fail = None  # type: ignore[attr-defined]
    assert run(tier.lookup(["k"], 0, CancelToken())) == 0  # recovered


def test_timeout_stops_the_worker_before_the_outcome(tier: StorageTier) -> None:
    run(tier.store(["k"], [0], BLOCK, FP, 0, CancelToken()))
    backend: Scripted = tier.backend  # type: ignore[assignment]
    backend.hold.clear()
    threading.Timer(0.45, backend.hold.set).start()  # stuck past the 0.3 s deadline, then returns
    start = time.monotonic()
    with pytest.raises(ProtocolError) as exc:
        run(tier.load(["k"], [5], BLOCK, FP, 0, CancelToken()))
    assert exc.value.code == ErrorCode.STORAGE_TIMEOUT
    assert 0.3 <= time.monotonic() - start < 2.0
    assert backend.saw_stop.is_set() and backend.finished.is_set()  # it had let go of host memory
    assert bytes(tier.pool.memory(5 * BLOCK, BLOCK)) != bytes(tier.pool.memory(0, BLOCK))
    assert errors(tier, "timeout") == 1


def test_cancel_token_ends_the_wait_with_its_code(tier: StorageTier) -> None:
    tier.backend.hold.clear()  # type: ignore[attr-defined]
    cancel = CancelToken()
    threading.Timer(0.05, cancel.cancel, (ErrorCode.DETACHED, "detached")).start()
    threading.Timer(0.1, tier.backend.hold.set).start()  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError) as exc:
        run(tier.lookup(["k"], 0, cancel))
    assert exc.value.code == ErrorCode.DETACHED


def test_keys_order_same_key_commands_only() -> None:
    store_k = Access(host_read=frozenset({1}), keys_write=frozenset({"K"}))
    load_k = Access(keys_read=frozenset({"K"}), host_write=frozenset({2}))
    load_k_again = Access(keys_read=frozenset({"K"}), host_write=frozenset({3}))
    load_j = Access(keys_read=frozenset({"J"}), host_write=frozenset({4}))
    delete_k = Access(keys_write=frozenset({"K"}))
    assert load_k.conflicts_with(store_k) and delete_k.conflicts_with(load_k)
    assert not load_k_again.conflicts_with(load_k)  # shared prefixes load concurrently
    assert not load_j.conflicts_with(store_k)
    assert not Access(all_host_write=True).conflicts_with(delete_k)  # clear-host leaves keys alone


def test_call_stuck_past_the_grace_keeps_its_blocks_reserved(tier: StorageTier) -> None:
    run(tier.store(["k"], [0], BLOCK, FP, 0, CancelToken()))
    backend: Scripted = tier.backend  # type: ignore[assignment]
    backend.hold.clear()  # stuck past the 0.3 s deadline and the 0.3 s grace

    async def scenario() -> None:
        with pytest.raises(HoldBlocks) as exc:
            await tier.load(["k"], [5], BLOCK, FP, 0, CancelToken())
        assert exc.value.code == ErrorCode.STORAGE_TIMEOUT
        running = asyncio.ensure_future(exc.value.running)
        await asyncio.sleep(0.05)
        assert not running.done()  # the blocks stay reserved while the call is stuck
        backend.hold.set()
        await asyncio.wait_for(running, 5)

    run(scenario())


def test_configured_checksum_kind_is_written() -> None:
    config = load_config(overrides={"storage.checksum": "crc32"}, environ={})
    pool = HostPool(16 * BLOCK)
    t = StorageTier(Scripted(), config.storage, pool, DaemonMetrics(0, "cpu"))
    try:
        run(t.store(["k"], [0], BLOCK, FP, 0, CancelToken()))
        header = t.backend.objects["w0/k"][:64]  # type: ignore[attr-defined]
        assert int.from_bytes(header[8:10], "little") == 1  # crc32
        assert run(t.load(["k"], [1], BLOCK, FP, 0, CancelToken())) == 1
    finally:
        t.close()


def journaled_tier(directory: Path) -> StorageTier:
    """A tier whose backend keeps a file journal (the scripted backend's objects, real files)."""
    config = load_config(overrides={"storage.io_threads": 2}, environ={})
    backend = Scripted()
    backend.journal = FileJournal(str(directory))
    return StorageTier(backend, config.storage, HostPool(64 * BLOCK), DaemonMetrics(0, "cpu"))


def test_a_stores_records_are_in_the_journal_before_its_outcome(tmp_path: Path) -> None:
    """STOREs that finish together share journal writes, and each outcome comes only once its
    records are written (docs/protocol.md §12.8)."""
    directory = tmp_path / "journal"
    t = journaled_tier(directory)

    async def store_and_read(i: int) -> list[tuple[str, bytes]]:
        keys = [f"s{i}-{j}" for j in range(3)]
        tags = [f"t{i}-{j}".encode() for j in range(3)]
        assert (await t.store(keys, [3 * i + j for j in range(3)], BLOCK, FP, 0, CancelToken(), tags=tags))[
            "stored"
        ] == 3
        seen = {(r[2], r[3]) for r in FileJournal(str(directory)).read(0, 1000).records}
        return [(f"w0/{k}", tag) for k, tag in zip(keys, tags) if (f"w0/{k}", tag) not in seen]

    async def main() -> list[list[tuple[str, bytes]]]:
        return await asyncio.gather(*(store_and_read(i) for i in range(8)))

    try:
        assert run(main()) == [[]] * 8, "records not in the journal when their STORE's outcome came"
        journal = t.backend.journal
        assert journal is not None and journal.submits == 8 and 1 <= journal.writes <= 8
        shown = t.describe()["journal"]  # STATUS storage.journal
        assert shown["written"] == 24 and shown["writes"] == journal.writes and shown["not_written"] == 0
        assert shown["write_cpu_s"] > 0 and shown["skipped"] == 0
        assert t.feed is not None and t.feed.catch_up() is False
        assert t.describe()["journal"]["read_cpu_s"] > 0 and t.describe()["journal"]["records"] == 24
    finally:
        t.close()


def test_a_journal_that_fails_costs_the_journal_not_the_store(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    t = journaled_tier(blocker / "journal")  # no journal write can succeed
    try:
        result = run(t.store(["k0", "k1"], [0, 1], BLOCK, FP, 0, CancelToken()))
        assert result["stored"] == 2 and errors(t, "journal") == 1
        assert t.describe()["journal"]["not_written"] == 2 and t.describe()["journal"]["written"] == 0
        assert run(t.load(["k0", "k1"], [10, 11], BLOCK, FP, 0, CancelToken())) == 2
    finally:
        t.close()


@pytest.mark.parametrize("shard_bytes", [SHARD_MIN_BYTES, 2 * (BLOCK + HEADER_BYTES)], ids=["one call", "shards"])
def test_a_store_past_the_room_writes_its_leading_objects_and_their_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_bytes: int
) -> None:
    """One I/O call (room, writes, room released, records) or several shards: the same objects
    and records; a lone STORE's records are written by its I/O thread, no thread woken."""
    monkeypatch.setattr(storage_tier, "SHARD_MIN_BYTES", shard_bytes)
    config = load_config(overrides={"storage.io_threads": 2}, environ={})
    backend = FileBackend(tmp_path / "store", capacity=6 * (BLOCK + HEADER_BYTES), journal=True)
    pool = HostPool(64 * BLOCK)
    pool.tensor.random_(0, 256)
    t = StorageTier(backend, config.storage, pool, DaemonMetrics(0, "cpu"))
    t.start()
    keys = [f"k{i}" for i in range(8)]
    try:
        deadline = time.monotonic() + 10
        while not backend.index.scanned:  # capacity counts once the directory is known
            assert time.monotonic() < deadline, "the file backend's first scan did not end"
            time.sleep(0.01)
        result = run(t.store(keys, list(range(8)), BLOCK, FP, 0, CancelToken(), tags=[b"t%d" % i for i in range(8)]))
        assert (result["stored"], result["failed"]) == (6, 2), "six fit the capacity, the last two had no room"
        assert backend.journal is not None
        assert (backend.journal._writer is None) == (shard_bytes == SHARD_MIN_BYTES), "a lone STORE woke a thread"
        records = FileJournal(str(tmp_path / "store" / ".journal")).read(0, 100).records
        assert [(r[2], r[3]) for r in records] == [(f"w0/k{i}", b"t%d" % i) for i in range(6)]
        before = pool.tensor.clone()
        assert run(t.load(keys, list(range(20, 28)), BLOCK, FP, 0, CancelToken())) == 6
        view = pool.tensor.view(64, BLOCK)
        assert torch.equal(view[20:26], before.view(64, BLOCK)[0:6]), "loaded bytes are the stored blocks'"
        assert torch.equal(view[26:], before.view(64, BLOCK)[26:]), "blocks past the delivered prefix untouched"
        assert torch.equal(view[:20], before.view(64, BLOCK)[:20])
    finally:
        t.close()


def test_one_store_at_a_time_waits_for_no_other_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A STORE's records wait (up to LINGER_S) for other STOREs' only while others run."""
    monkeypatch.setattr(journal_module, "LINGER_S", 10.0)
    t = journaled_tier(tmp_path / "journal")

    async def one_at_a_time() -> None:
        for i in range(3):
            result = await asyncio.wait_for(t.store([f"q{i}"], [i], BLOCK, FP, 0, CancelToken()), 5)
            assert result["stored"] == 1

    try:
        run(one_at_a_time())
        assert t.backend.journal is not None and t.backend.journal.writes == 3
    finally:
        t.close()


def file_tier(root: Path, timeout_s: float = 10.0) -> tuple[StorageTier, FileBackend]:
    """A tier on a real file backend with its journal, its first scan done."""
    config = load_config(overrides={"storage.io_threads": 2, "storage.timeout_s": timeout_s}, environ={})
    backend = FileBackend(root, capacity=1 << 30, journal=True)
    pool = HostPool(64 * BLOCK)
    pool.tensor.random_(0, 256)
    t = StorageTier(backend, config.storage, pool, DaemonMetrics(0, "cpu"))
    t.start()
    deadline = time.monotonic() + 10
    while not backend.index.scanned:
        assert time.monotonic() < deadline, "the file backend's first scan did not end"
        time.sleep(0.01)
    return t, backend


@pytest.mark.parametrize("count", [1, 4], ids=["one call", "shards"])
def test_a_store_that_could_not_make_room_releases_no_other_stores_pins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    monkeypatch.setattr(storage_tier, "SHARD_MIN_BYTES", BLOCK)  # 4 objects: 2 shards (2 I/O threads)
    t, backend = file_tier(tmp_path / "store")
    parent = object_id("w0/p")
    # Another STORE extending the same chain is running: it pins the parent.
    backend.index.reserve([object_id("w0/other")], BLOCK + HEADER_BYTES, None, 1, parent)

    def no_room(names: list[str], object_bytes: int, parent: str | None = None) -> int:
        raise StorageUnavailable("the store went away")

    monkeypatch.setattr(backend, "begin_store", no_room)
    try:
        with pytest.raises(ProtocolError) as err:
            run(t.store([f"k{i}" for i in range(count)], list(range(count)), BLOCK, FP, 0, CancelToken(), parent="p"))
        assert err.value.code is ErrorCode.STORAGE_UNAVAILABLE
    finally:
        t.close()  # runs what was queued on the I/O threads (a release) first
    assert backend.index.pinned(parent), "a STORE that reserved nothing released the other STORE's pin"


def test_a_journal_that_cannot_be_read_costs_the_journal_not_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t, _ = file_tier(tmp_path / "store")

    def unreadable() -> bool:
        raise OSError("the journal cannot be read")

    assert t.feed is not None
    monkeypatch.setattr(t.feed, "catch_up", unreadable)
    try:
        assert run(t.store(["k0", "k1"], [0, 1], BLOCK, FP, 0, CancelToken()))["stored"] == 2
        assert run(t.load(["k0", "k1"], [10, 11], BLOCK, FP, 0, CancelToken())) == 2
    finally:
        t.close()


@pytest.mark.parametrize("count", [1, 4], ids=["one call", "shards"])
def test_room_made_after_the_store_gave_up_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    monkeypatch.setattr(storage_tier, "SHARD_MIN_BYTES", BLOCK)  # 4 objects: 2 shards (2 I/O threads)
    t, backend = file_tier(tmp_path / "store", timeout_s=0.3)
    slow, made = threading.Event(), backend.begin_store

    def slow_room(names: list[str], object_bytes: int, parent: str | None = None) -> int:
        assert slow.wait(10), "the test never let the room be made"
        return made(names, object_bytes, parent)

    monkeypatch.setattr(backend, "begin_store", slow_room)
    keys = [f"k{i}" for i in range(count)]

    async def scenario() -> None:
        with pytest.raises(HoldBlocks) as exc:  # past the 0.3 s deadline and the 0.3 s grace
            await t.store(keys, list(range(count)), BLOCK, FP, 0, CancelToken(), parent="p")
        assert exc.value.code == ErrorCode.STORAGE_TIMEOUT
        slow.set()  # the room is made now, after the STORE's outcome
        await asyncio.wait_for(asyncio.ensure_future(exc.value.running), 5)

    try:
        run(scenario())
    finally:
        t.close()
    held = [object_id(f"w0/{k}") for k in ["p", *keys]]
    assert not any(backend.index.pinned(oid) for oid in held), "the late room was never released"
    assert backend.index._reserved_bytes == 0
