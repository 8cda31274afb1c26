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
from cachexferd.storage_servers import MooncakeCluster
from tests.helpers import assert_moved, assert_untouched
from tests.servers import mooncake_cluster, start_mooncake  # noqa: F401 - fixture
from tests.storage_rig import Node, key_space, prompt, store_and_load_back

pytestmark = pytest.mark.mooncake


def mooncake_node(runtime: Path, cluster: MooncakeCluster, seed: int, **extra: object) -> Node:
    settings: dict[str, object] = {"storage__timeout_s": 3.0, "storage__mooncake__master": cluster.master, **extra}
    return Node.in_process(runtime, seed=seed, storage__backend="mooncake", **settings)


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
    store_and_load_back(node, keys)
    assert node.ok("delete", keys[1:])["deleted"] == 3
    assert node.ok("lookup", keys)["prefix"] == 1
    assert node.ok("load", ["never-stored", *keys], host_ids=[10, 11, 12, 13, 14])["loaded"] == 0
    assert node.status()["storage"]["state"] == "ready"


BIG = KVLayout(num_layers=2, num_blocks=16, block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")  # 128 KiB


def _fill_past_capacity(node: Node, names: list[str], deadline_s: float = 30.0) -> list[str]:
    """Stores every name (16 per command, host block i holding device block i % 16). A full
    pool refuses puts until its eviction catches up, so refused ones are retried until the
    deadline; returns the names whose store was reported done."""
    stored: list[str] = []
    deadline = time.monotonic() + deadline_s
    for start in range(0, len(names), 16):
        host = list(range(start, start + 16))
        node.ok("swap_out", list(range(16)), host)
        batch = names[start : start + 16]
        while batch and time.monotonic() < deadline:
            done = node.run("store", batch, host_ids=host[len(host) - len(batch) :])
            if done.ok:
                stored += batch[: done.result()["stored"]]
                batch = batch[done.result()["stored"] :]
                if not batch:
                    break
            else:  # a store that wrote nothing at all is a STORAGE_ERROR saying why
                assert done.errors[0][0] == "STORAGE_ERROR" and "no space" in done.errors[0][1], done.describe()
            time.sleep(0.1)
    return stored


def test_keys_evicted_from_a_full_segment_are_misses(short_tmp: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="cx-mc-small-") as d:
        cluster = start_mooncake(Path(d), segment="16MB", lease_ms=100)  # the smallest segment Mooncake takes
        node = mooncake_node(short_tmp / "e", cluster, seed=9, layout=BIG, host_cache__capacity="64MiB")
        try:
            count = 192  # 24 MiB of objects into 16 MiB: Mooncake must evict to take them all
            names = [f"evict:{i}" for i in range(count)]
            stored = _fill_past_capacity(node, names)
            present = {k for k in names if node.ok("lookup", [k])["prefix"] == 1}
            evicted = [k for k in stored if k not in present]
            assert evicted, "Mooncake kept every stored object in a segment too small for them"
            # An evicted key is a normal miss: nothing delivered, no error outcome, no error metric.
            assert node.ok("load", [evicted[0]], host_ids=[300])["loaded"] == 0
            assert node.metric("cachexferd_storage_errors_total", kind="corrupt") == 0
            kept = [k for k in stored if k in present][-4:]
            assert kept, "nothing left in the pool"
            src = [names.index(k) % 16 for k in kept]  # host block h held device block h % 16
            dst = list(range(8, 8 + len(kept)))
            assert node.ok("load", kept, host_ids=[400, 401, 402, 403][: len(kept)], device_ids=dst)["loaded"] == len(
                kept
            )
            assert_moved(node.cache, dst, node.before, src)
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
    from cachexferd.storage_servers import free_port

    node = Node.in_process(
        short_tmp / "d", seed=10, storage__backend="mooncake", storage__mooncake__master=f"127.0.0.1:{free_port()}",
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
