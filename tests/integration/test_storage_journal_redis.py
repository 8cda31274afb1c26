"""The storage journal in a real redis-server (a stream beside the objects): two daemons on one
server each report what the other stored, deleted, or found gone, and a reader whose records
were trimmed away learns of the gap."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachexferd.daemon.storage_feed import StorageFeed
from cachexferd.protocol import StorageEvents
from cachexferd.storage.journal import STORED, JournalRead, JournalRecord, RedisJournal, object_id
from cachexferd.storage_servers import RedisServer
from tests.servers import redis_server  # noqa: F401 - fixture
from tests.storage_rig import Node, seen_within

pytestmark = pytest.mark.redis
WAIT_S = 10.0


class View:
    """What one daemon's STORAGE_EVENTS says is in the store (key -> tag)."""

    def __init__(self, node: Node) -> None:
        self.node, self.cursor, self.held, self.removed = node, 0, {}, []  # type: ignore[var-annotated]

    def poll(self) -> None:
        more = True
        while more:
            (page,) = self.node.engine.call_all(StorageEvents, after=self.cursor)
            assert page["journal"] is True
            if page["reset"]:
                self.held.clear()
            for _pos, op, _version, key, tag in page["events"]:
                if op == "stored":
                    self.held[key] = tag
                else:
                    self.held.pop(key, None)
                    self.removed.append(key)
            self.cursor, more = page["next"], page["more"]

    def until(self, check: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            self.poll()
            if check():
                return
            assert time.monotonic() < deadline, f"not seen within {WAIT_S}s: {what}; held {sorted(self.held)}"
            time.sleep(0.05)


@pytest.fixture
def pair(short_tmp: Path, redis_server: RedisServer) -> Iterator[tuple[Node, Node]]:  # noqa: F811
    settings = {"storage__backend": "redis", "storage__redis__url": redis_server.url, "storage__timeout_s": 2.0}
    a = Node.in_process(short_tmp / "ja", seed=1, **settings)
    b = Node.in_process(short_tmp / "jb", seed=2, **settings)
    yield a, b
    a.close()
    b.close()


def test_two_daemons_on_one_server_report_each_others_changes(
    pair: tuple[Node, Node],
    redis_server: RedisServer,  # noqa: F811
    request: pytest.FixtureRequest,
) -> None:
    a, b = pair
    keys = [f"jr:{request.node.name[:20]}:{i}" for i in range(3)]
    tags = [b"t0", b"t1", b"t2"]
    done = a.ok("store", keys, host_ids=[0, 1, 2], device_ids=[1, 2, 3], tags=tags)
    assert done["stored"] == 3
    view_b = View(b)
    view_b.until(lambda: all(view_b.held.get(k) == t for k, t in zip(keys, tags)), "A's objects and tags at B")

    view_a = View(a)
    view_a.poll()
    assert b.ok("delete", keys[2:])["deleted"] == 1
    view_a.until(lambda: keys[2] in view_a.removed, "B's delete, at A")

    import redis

    redis.Redis.from_url(redis_server.url).delete(f"w0/{keys[1]}")  # as if Redis evicted it
    assert a.ok("load", keys[:2], host_ids=[10, 11])["loaded"] == 1
    view_b.until(lambda: keys[1] not in view_b.held and keys[0] in view_b.held, "the miss A found, at B")


def test_a_reader_whose_records_were_trimmed_learns_of_the_gap(redis_server: RedisServer) -> None:  # noqa: F811
    import redis

    client = redis.Redis.from_url(redis_server.url)
    journal = RedisJournal(client, key=f"test-journal-{time.monotonic_ns()}", max_entries=10)
    journal.append([JournalRecord(STORED, object_id("w0/first"), "w0/first", b"x")])
    first = journal.read(0, 10)
    assert [r[2] for r in first.records] == ["w0/first"] and not first.gap
    for i in range(600):  # one entry per append; XADD MAXLEN ~ trims whole stream nodes (100 entries)
        journal.append([JournalRecord(STORED, object_id(f"w0/{i}"), f"w0/{i}", b"")])
    behind = journal.read(first.position, 1000)
    assert behind.gap and behind.records
    assert not journal.read(behind.position, 10).gap
    client.delete(journal.key)
    assert journal.read(behind.position, 10).gap, "a stream that is gone lost every record"


class CountedRedisJournal(RedisJournal):
    """A Redis journal that counts its reads."""

    reads = 0

    def read(self, position: int, limit: int) -> JournalRead:
        self.reads += 1
        return super().read(position, limit)


def test_a_follower_of_the_stream_reads_an_append_at_once_and_hardly_polls_while_it_is_quiet(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    import redis

    # One connection, as a busy daemon's I/O threads may leave: the follower's blocking read takes none of them.
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5.0, max_connections=1, protocol=2)
    key = f"test-journal-{time.monotonic_ns()}"
    writer = RedisJournal(redis.Redis.from_url(redis_server.url), key=key)
    writer.append([JournalRecord(STORED, object_id("w0/first"), "w0/first", b"")])
    journal = CountedRedisJournal(client, key=key)
    feed = StorageFeed(journal, "", poll_s=0.05)
    feed.start()
    try:
        seen_within(feed, object_id("w0/first"), WAIT_S)
        reads = journal.reads
        time.sleep(1.0)  # quiet: polling every 0.05 s would read about 20 times
        assert journal.reads - reads <= 3
        assert client.ping()  # while the follower blocks on the stream
        writer.append([JournalRecord(STORED, object_id("w0/next"), "w0/next", b"")])
        assert seen_within(feed, object_id("w0/next"), WAIT_S) < 0.5  # not the end of a 1 s blocking read
        assert feed.describe()["watched"] is True
    finally:
        started = time.monotonic()
        feed.close()
        assert time.monotonic() - started < 2.0


def test_a_follower_whose_server_went_away_neither_spins_nor_stops(tmp_path: Path) -> None:
    import redis

    from cachexferd.storage_servers import RedisServer as Server

    server = Server(tmp_path / "redis").start()
    try:
        feed = StorageFeed(RedisJournal(redis.Redis.from_url(server.url, socket_timeout=2.0, protocol=2)), "")
        feed.start()
        try:
            time.sleep(0.3)
            server.stop()
            started = time.process_time()
            time.sleep(2.0)
            assert time.process_time() - started < 0.4  # waiting, not retrying in a loop (a spin is ~2 s)
            server.start()
            writer = RedisJournal(redis.Redis.from_url(server.url, protocol=2))
            writer.append([JournalRecord(STORED, object_id("w0/back"), "w0/back", b"")])
            seen_within(feed, object_id("w0/back"), WAIT_S)
        finally:
            feed.close()
    finally:
        server.stop()
