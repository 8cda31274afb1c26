"""The storage journal on the wire (docs/protocol.md §12.8, docs/storage.md §4.1): daemons that
share one storage directory each report, through STORAGE_EVENTS, what every one of them
stored (with its tag) and lost: a DELETE, an eviction for room, an object found missing."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import CacheFactory, ClientFactory
from .daemons import DaemonProc
from .helpers import object_file
from .spec import E, T
from .wire import Client

pytestmark = pytest.mark.conformance
WAIT_S = 10.0
BLOCK_BYTES = 1024  # the conformance cache's host block (16 MiB / 16384)


class View:
    """A client's view of the store from one daemon's STORAGE_EVENTS, followed as §12.8 says."""

    def __init__(self, client: Client) -> None:
        self.client, self.cursor = client, 0
        self.held: dict[str, bytes] = {}  # key -> tag
        self.removed: list[str] = []
        self.resets = 0

    def poll(self, page: int = 4096) -> None:
        while True:
            reply = self.client.call(T.STORAGE_EVENTS, after=self.cursor, max=page)
            assert reply.ok, reply
            result = reply.result
            assert result["journal"] is True
            if result["reset"]:
                self.resets += 1
                self.held.clear()
            for _pos, op, version, key, tag in result["events"]:
                assert version == 0 and op in ("stored", "removed")
                if op == "stored":
                    self.held[key] = tag
                else:
                    self.held.pop(key, None)
                    self.removed.append(key)
            self.cursor = result["next"]
            if not result["more"]:
                return

    def until(self, check: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            self.poll()
            if check():
                return
            assert time.monotonic() < deadline, f"not seen within {WAIT_S}s: {what}; held {sorted(self.held)}"
            time.sleep(0.05)


@pytest.fixture
def store(scratch: Path, request: pytest.FixtureRequest) -> Path:
    return scratch / f"journal-{request.node.name[:40]}"


def start(scratch: Path, name: str, store: Path, *more: str) -> DaemonProc:
    args = ["--storage", "file", "--storage-path", str(store), "--set", "storage.timeout_s=5", *more]
    return DaemonProc(f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**6}", scratch, args)


@pytest.fixture
def pair(scratch: Path, store: Path) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    a = start(scratch, "ja", store)
    b = start(scratch, "jb", store, "--set", "storage.file.capacity=12KiB")  # room for ~11 objects
    yield a.wait_ready(), b.wait_ready()
    for proc in (a, b):
        proc.stop()


def attach(connect: ClientFactory, shm: CacheFactory, daemon: DaemonProc, seed: int) -> tuple[Client, Any]:
    client = connect(daemon)
    cache = shm(seed=seed)
    assert client.call(T.ATTACH, **cache.attach_fields()).ok
    return client, cache


def keys(prefix: str, count: int) -> list[str]:
    return [f"jr:{prefix}:{i:04d}" for i in range(count)]


def test_a_daemon_reports_what_another_stored_and_deleted(
    pair: tuple[DaemonProc, DaemonProc], connect: ClientFactory, shm: CacheFactory
) -> None:
    ca, _ = attach(connect, shm, pair[0], 1)
    cb, _ = attach(connect, shm, pair[1], 2)
    view_b = View(cb)
    view_b.poll()
    assert view_b.resets == 1 and view_b.held == {}
    chain, tags = keys("a", 3), [b"tag-0", b"tag-1", bytes(64)]
    stored = ca.call(T.STORE, keys=chain, host_ids=[10, 11, 12], device_ids=[1, 2, 3], tags=tags)
    assert stored.ok and stored.result["stored"] == 3, stored
    view_b.until(lambda: view_b.held == dict(zip(chain, tags)), "A's three objects with their tags at B")

    view_a = View(ca)
    view_a.until(lambda: view_a.held == dict(zip(chain, tags)), "the current state, for a new client of A")
    assert view_a.resets == 1
    assert cb.call(T.DELETE, keys=chain[1:2]).result["deleted"] == 1
    view_a.until(lambda: chain[1] not in view_a.held, "B's delete, at A")
    assert chain[1] in view_a.removed and set(view_a.held) == {chain[0], chain[2]}
    view_b.until(lambda: chain[1] in view_b.removed, "B's own delete, at B")
    assert view_b.resets == 1, "a client that keeps up is never reset"


def test_evictions_by_one_daemon_are_reported_by_the_other_and_claims_stay_loadable(
    pair: tuple[DaemonProc, DaemonProc], connect: ClientFactory, shm: CacheFactory
) -> None:
    ca, _ = attach(connect, shm, pair[0], 3)
    cb, _ = attach(connect, shm, pair[1], 4)
    first = keys("first", 8)
    assert ca.call(T.STORE, keys=first, host_ids=list(range(20, 28)), device_ids=list(range(8))).result["stored"] == 8
    view_a = View(ca)
    view_a.until(lambda: set(first) <= set(view_a.held), "A's objects")
    # B's capacity (12 KiB) cannot hold A's eight and B's eight: B evicts A's, least recently used first.
    second = keys("second", 8)
    assert cb.call(T.STORE, keys=second, host_ids=list(range(30, 38)), device_ids=list(range(8))).result["stored"] == 8
    view_a.until(lambda: set(second) <= set(view_a.held) and view_a.removed, "B's objects and its evictions, at A")
    evicted = set(first) - set(view_a.held)
    assert evicted and evicted <= set(view_a.removed)
    for key in view_a.held:  # every object the view claims is in the store
        assert ca.call(T.LOOKUP, keys=[key]).result["prefix"] == 1, key
    for key in evicted:
        assert ca.call(T.LOOKUP, keys=[key]).result["prefix"] == 0, key


def test_an_object_found_missing_is_reported_removed(
    pair: tuple[DaemonProc, DaemonProc], connect: ClientFactory, shm: CacheFactory, store: Path
) -> None:
    ca, _ = attach(connect, shm, pair[0], 5)
    cb, _ = attach(connect, shm, pair[1], 6)
    chain = keys("gone", 2)
    assert ca.call(T.STORE, keys=chain, host_ids=[40, 41], device_ids=[4, 5]).result["stored"] == 2
    view_b = View(cb)
    view_b.until(lambda: set(chain) <= set(view_b.held), "the objects")
    view_a = View(ca)
    view_a.until(lambda: set(chain) <= set(view_a.held), "the objects, in A's view")
    object_file(store, chain[1]).unlink()  # removed by hand: no daemon saw it
    assert ca.call(T.LOAD, keys=chain, host_ids=[50, 51]).result["loaded"] == 1
    view_b.until(lambda: chain[1] not in view_b.held, "the object A's LOAD found missing, at B")
    assert chain[0] in view_b.held


def test_a_restarted_daemon_rebuilds_its_view_from_the_journal(
    scratch: Path, store: Path, connect: ClientFactory, shm: CacheFactory
) -> None:
    first = start(scratch, "jr1", store).wait_ready()
    try:
        client, _ = attach(connect, shm, first, 7)
        chain = keys("kept", 3)
        assert client.call(T.STORE, keys=chain, host_ids=[1, 2, 3], device_ids=[1, 2, 3], tags=[b"x"] * 3).ok
        assert client.call(T.DELETE, keys=chain[2:]).ok
        View(client).until(lambda: True, "a first read")
    finally:
        first.stop()
    second = start(scratch, "jr2", store).wait_ready()
    try:
        view = View(connect(second))
        view.until(lambda: view.held == {chain[0]: b"x", chain[1]: b"x"}, "the state before the restart")
    finally:
        second.stop()


def test_bad_input_and_stores_without_a_journal(
    pair: tuple[DaemonProc, DaemonProc], connect: ClientFactory, shm: CacheFactory, nostorage: DaemonProc,
    scratch: Path,
) -> None:  # fmt: skip
    client, _ = attach(connect, shm, pair[0], 8)
    two = keys("bad", 2)
    assert client.call(T.STORE, keys=two, host_ids=[1, 2], tags=[b"one"]).code == E.LENGTH_MISMATCH
    assert client.call(T.STORE, keys=two, host_ids=[1, 2], tags=[b"x", bytes(65)]).code == E.BAD_FIELD
    assert client.call(T.STORE, keys=two, host_ids=[1, 2], tags=["text", "text"]).code == E.BAD_FIELD
    assert client.call(T.STORAGE_EVENTS, after=-1).code == E.BAD_FIELD
    assert client.call(T.STORAGE_EVENTS, max=0).code == E.BAD_FIELD
    assert client.call(T.STORAGE_EVENTS, max=16385).code == E.BAD_FIELD
    assert client.call(T.STORAGE_EVENTS, after="x").code == E.BAD_FIELD
    assert client.call(T.PING).ok, "the daemon keeps serving"
    assert connect(nostorage).call(T.STORAGE_EVENTS).code == E.NO_STORAGE
    off = start(scratch, "joff", scratch / "journal-off", "--set", "storage.journal=false").wait_ready()
    try:
        reply = connect(off).call(T.STORAGE_EVENTS, after=5)
        assert reply.ok and reply.result == {"journal": False, "events": [], "next": 5, "reset": False, "more": False}
    finally:
        off.stop()
