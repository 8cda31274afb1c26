"""Storage commands against a real Mooncake Store: mooncake_master + a mooncake_client storage
node on loopback ports, metadata P2PHANDSHAKE, protocol tcp."""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachexferd.protocol import KVLayout
from cachexferd.storage.servers import MooncakeCluster
from tests.helpers import assert_moved, assert_untouched
from tests.servers import mooncake_cluster, start_mooncake  # noqa: F401 - fixture
from tests.storage_rig import Node, key_space, prompt

pytestmark = pytest.mark.mooncake


def mooncake_node(runtime: Path, cluster: MooncakeCluster, seed: int, **extra: object) -> Node:
    settings: dict[str, object] = {"storage__timeout_s": 3.0, **extra}
    return Node.in_process(runtime, seed=seed, storage__backend="mooncake", storage__master=cluster.master, **settings)


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> list[str]:
    """Fresh keys per test (the server lives for the module): 3 full blocks + a partial."""
    return key_space(weights=request.node.name).token_keys(prompt(4 * 3 + 2))


@pytest.fixture
def node(short_tmp: Path, mooncake_cluster: MooncakeCluster) -> Iterator[Node]:  # noqa: F811
    n = mooncake_node(short_tmp / "m", mooncake_cluster, seed=8)
    yield n
    n.close()


def test_roundtrip_misses_and_delete(node: Node, keys: list[str]) -> None:
    src, dst = [1, 2, 3, 4], [40, 41, 42, 43]
    assert node.ok("store", keys, host_ids=[0, 1, 2, 3], device_ids=src)["stored"] == 4
    assert node.ok("lookup", keys)["prefix"] == 4
    assert node.ok("load", keys, host_ids=[10, 11, 12, 13], device_ids=dst)["loaded"] == 4
    assert_moved(node.cache, dst, node.before, src)
    assert_untouched(node.cache, node.before, dst)
    assert node.ok("delete", keys[1:])["deleted"] == 3
    assert node.ok("lookup", keys)["prefix"] == 1
    assert node.ok("load", ["never-stored", *keys], host_ids=[10, 11, 12, 13, 14])["loaded"] == 0
    assert node.status()["storage"]["state"] == "ready"


BIG = KVLayout(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")  # 128 KiB


def test_keys_evicted_from_a_full_segment_are_misses(short_tmp: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="cx-mc-small-") as d:
        cluster = start_mooncake(Path(d), segment="16MB", lease_ms=100)  # the smallest segment Mooncake takes
        node = mooncake_node(short_tmp / "e", cluster, seed=9, layout=BIG, host_cache__capacity="64MiB")
        try:
            count = 192  # 24 MiB of objects into 16 MiB: Mooncake evicts old objects as puts need room
            names = [f"evict:{i}" for i in range(count)]
            last: list[str] = []
            for start in range(0, count, 16):
                node.ok("swap_out", list(range(16)), list(range(start, start + 16)))
                done = node.run("store", names[start : start + 16], host_ids=list(range(start, start + 16)))
                # A full pool refuses puts until eviction catches up: `stored` says how many made it,
                # and a store that wrote nothing at all is a STORAGE_ERROR saying why.
                if not done.ok:
                    assert done.errors[0][0] == "STORAGE_ERROR" and "no space" in done.errors[0][1]
                    continue
                last = names[start : start + done.result()["stored"]] or last
            assert node.ok("lookup", names)["prefix"] == 0, "the oldest object must have been evicted"
            assert node.ok("load", names, host_ids=list(range(200, 200 + count)))["loaded"] == 0
            assert node.metric("cachexferd_storage_errors_total", kind="corrupt") == 0  # a miss is not an error
            n = min(4, len(last))
            assert n and node.ok("lookup", last[:n])["prefix"] == n
            dst = list(range(8, 8 + n))
            assert node.ok("load", last[:n], host_ids=[400, 401, 402, 403][:n], device_ids=dst)["loaded"] == n
            assert_moved(node.cache, dst, node.before, list(range(n)))
            assert_untouched(node.cache, node.before, dst)
        finally:
            node.close()
            cluster.stop()


def test_master_killed_and_restarted(node: Node, mooncake_cluster: MooncakeCluster, keys: list[str]) -> None:  # noqa: F811
    assert node.ok("store", keys[:2], host_ids=[0, 1], device_ids=[1, 2])["stored"] == 2
    mooncake_cluster.master_proc.kill()
    try:
        start = time.monotonic()
        assert node.error("lookup", keys)[0] == "STORAGE_UNAVAILABLE"
        assert node.error("store", keys[:1], host_ids=[0])[0] == "STORAGE_UNAVAILABLE"
        assert node.error("load", keys[:1], host_ids=[5])[0] == "STORAGE_UNAVAILABLE"
        assert time.monotonic() - start < 15.0
        node.ok("swap_out", [3], [30])  # copies are unaffected
    finally:
        mooncake_cluster.master_proc.start()
    # The new master knows no objects; the storage node re-mounts its segment by itself.
    deadline = time.monotonic() + 20
    while True:
        done = node.run("store", keys[:2], host_ids=[0, 1], device_ids=[4, 5])
        if done.ok or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done.ok and done.result()["stored"] == 2, done.describe()
    assert node.ok("load", keys[:2], host_ids=[7, 8], device_ids=[9, 10])["loaded"] == 2
    assert_moved(node.cache, [9, 10], node.before, [4, 5])


def test_paused_master_times_out_then_recovers(
    short_tmp: Path,
    mooncake_cluster: MooncakeCluster,  # noqa: F811
    keys: list[str],
) -> None:
    node = mooncake_node(short_tmp / "p", mooncake_cluster, seed=11, storage__timeout_s=1.0)
    try:
        _paused_master(node, mooncake_cluster, keys)
    finally:
        node.close()


def _paused_master(node: Node, cluster: MooncakeCluster, keys: list[str]) -> None:
    assert node.ok("store", keys[:1], host_ids=[0], device_ids=[1])["stored"] == 1
    cluster.master_proc.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        code, _ = node.error("lookup", keys[:1])
        assert code in ("STORAGE_TIMEOUT", "STORAGE_UNAVAILABLE")  # the client's own RPC deadline may win
        assert time.monotonic() - start < 10.0
    finally:
        cluster.master_proc.signal(signal.SIGCONT)
    # Recovery. A master paused longer than its client TTL may have dropped the storage node
    # and its objects (Mooncake is a cache), so recovery means: stores and loads work again.
    deadline = time.monotonic() + 20
    while not node.run("store", keys[1:2], host_ids=[0], device_ids=[2]).ok and time.monotonic() < deadline:
        time.sleep(0.3)
    assert node.ok("load", keys[1:2], host_ids=[3], device_ids=[6])["loaded"] == 1
    assert_moved(node.cache, [6], node.before, [2])
    assert_untouched(node.cache, node.before, [6])


def test_master_down_at_start_does_not_stop_the_daemon(short_tmp: Path, keys: list[str]) -> None:
    from cachexferd.storage.servers import free_port

    node = Node.in_process(
        short_tmp / "d", seed=10, storage__backend="mooncake", storage__master=f"127.0.0.1:{free_port()}",
        storage__timeout_s=2.0,
    )  # fmt: skip
    try:
        start = time.monotonic()
        code, detail = node.error("store", keys[:1], host_ids=[0], device_ids=[1])
        assert code == "STORAGE_UNAVAILABLE" and "unreachable" in detail
        assert time.monotonic() - start < 5.0
        node.ok("swap_out", [1], [2])
        assert node.status()["storage"]["state"] == "unavailable"
    finally:
        node.close()
