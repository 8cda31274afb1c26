"""Storage commands against a real redis-server (or valkey-server) on a loopback port."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachexferd.storage_servers import RedisServer
from tests.helpers import assert_moved, assert_untouched
from tests.servers import redis_server  # noqa: F401 - fixture
from tests.storage_rig import Node, key_space, prompt, store_and_load_back

pytestmark = pytest.mark.redis


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> list[str]:
    """Fresh keys per test (the server lives for the module): 3 full blocks + a partial."""
    return key_space(weights=request.node.name).token_keys(prompt(4 * 3 + 1))


@pytest.fixture
def node(short_tmp: Path, redis_server: RedisServer) -> Iterator[Node]:  # noqa: F811
    n = Node.in_process(
        short_tmp / "r", seed=7, storage__backend="redis", storage__redis__url=redis_server.url, storage__timeout_s=1.0
    )
    yield n
    n.close()


def raw_client(server: RedisServer) -> object:
    import redis

    return redis.Redis.from_url(server.url, socket_timeout=5)


def test_roundtrip_misses_and_delete(node: Node, keys: list[str]) -> None:
    store_and_load_back(node, keys)
    assert node.ok("delete", keys[2:])["deleted"] == 2
    assert node.ok("lookup", keys)["prefix"] == 2
    assert node.ok("load", keys, host_ids=[10, 11, 12, 13])["loaded"] == 2


def test_corrupt_and_wrong_size_values(node: Node, redis_server: RedisServer, keys: list[str]) -> None:  # noqa: F811
    assert node.ok("store", keys[:3], host_ids=[0, 1, 2], device_ids=[1, 2, 3])["stored"] == 3
    client = raw_client(redis_server)
    value = bytearray(client.get(f"w0/{keys[1]}"))  # type: ignore[attr-defined]
    value[200] ^= 0xFF
    client.set(f"w0/{keys[1]}", bytes(value))  # type: ignore[attr-defined]
    client.set(f"w0/{keys[2]}", b"short")  # type: ignore[attr-defined]
    assert node.ok("load", keys[:3], host_ids=[10, 11, 12], device_ids=[20, 21, 22])["loaded"] == 1
    assert node.metric("cachexferd_storage_errors_total", kind="corrupt") == 1
    assert node.metric("cachexferd_storage_errors_total", kind="mismatch") == 1
    assert_moved(node.cache, [20], node.before, [1])
    assert_untouched(node.cache, node.before, [20])


def test_server_killed_and_restarted(node: Node, redis_server: RedisServer, keys: list[str]) -> None:  # noqa: F811
    assert node.ok("store", keys[:1], host_ids=[0], device_ids=[1])["stored"] == 1
    redis_server.server.kill()
    try:
        assert node.error("store", keys[:2], host_ids=[0, 1])[0] == "STORAGE_UNAVAILABLE"
        assert node.error("load", keys[:1], host_ids=[5])[0] == "STORAGE_UNAVAILABLE"
        assert node.error("lookup", keys)[0] == "STORAGE_UNAVAILABLE"
        node.ok("swap_out", [3], [30])  # the daemon keeps serving everything else
        assert node.status()["storage"]["state"] == "unavailable"
    finally:
        redis_server.server.start()
    # A restarted cache is empty (no persistence): stores work again, old keys are misses.
    assert node.ok("lookup", keys[:1])["prefix"] == 0
    assert node.ok("store", keys[:2], host_ids=[0, 1], device_ids=[5, 6])["stored"] == 2
    assert node.ok("load", keys[:2], host_ids=[7, 8], device_ids=[9, 10])["loaded"] == 2
    assert_moved(node.cache, [9, 10], node.before, [5, 6])


def test_paused_server_times_out_then_recovers(node: Node, redis_server: RedisServer, keys: list[str]) -> None:  # noqa: F811
    assert node.ok("store", keys[:2], host_ids=[0, 1], device_ids=[1, 2])["stored"] == 2
    redis_server.server.signal(signal.SIGSTOP)  # alive, accepting nothing: a hung server
    try:
        start = time.monotonic()
        assert node.error("load", keys[:2], host_ids=[10, 11])[0] == "STORAGE_TIMEOUT"
        assert time.monotonic() - start < 4.0
    finally:
        redis_server.server.signal(signal.SIGCONT)
    assert node.ok("load", keys[:2], host_ids=[10, 11], device_ids=[20, 21])["loaded"] == 2
    assert_moved(node.cache, [20, 21], node.before, [1, 2])
    assert node.metric("cachexferd_storage_errors_total", kind="timeout") >= 1


def test_a_store_larger_than_maxmemory_reports_only_what_is_still_there(short_tmp: Path) -> None:
    """Redis evicts (allkeys-lru) the first keys of a pipeline that does not fit: the STORE
    counts as stored only the leading objects that are in the store when it reports."""
    from tests.servers import start_redis

    # Evictions without a time limit: all within the command that went over maxmemory, none
    # later in the background (which would take objects after the STORE counted them).
    server = start_redis(short_tmp / "small-redis", maxmemory="2mb", settings=["--maxmemory-eviction-tenacity", "100"])
    # Without the journal: its stream and its readers' replies take memory in the same tiny
    # server, and any write can make redis evict another key at any time.
    node = Node.in_process(
        short_tmp / "r", seed=8, storage__backend="redis", storage__redis__url=server.url, storage__journal=False
    )
    try:
        keys = [f"overflow-{i}" for i in range(1500)]  # 1500 x 3 KiB: more than 2 MB
        result = node.ok("store", keys, host_ids=list(range(1500)))
        client = raw_client(server)
        present = [bool(client.exists(f"w0/{k}")) for k in keys]  # type: ignore[attr-defined]
        assert not all(present), "redis kept everything: the test needs a smaller maxmemory"
        assert all(present[: result["stored"]]), f"stored={result['stored']} but an object of that prefix is gone"
        assert node.ok("load", keys, host_ids=list(range(2000, 3500)))["loaded"] >= result["stored"]
    finally:
        node.close()
        server.stop()
