"""Prefill -> decode handoff through each storage backend, with real subprocess daemons.

A "prefill" daemon + runner stores a request's blocks (with a partial last block); a
"decode" daemon + runner with its own runtime dir and different block ids looks them up and
loads them. Bytes must be identical and every other block unchanged. Redis and Mooncake run
as real servers on loopback ports (tests/servers.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.demo_pd import run_pd_handoff
from cachexferd.launch import DaemonProcess
from tests.helpers import SMALL, assert_moved, assert_untouched, fill_random, snapshot
from tests.servers import mooncake_cluster, redis_server  # noqa: F401 - fixtures
from tests.storage_rig import Node, key_space, prompt


def storage_settings(backend: str, request: pytest.FixtureRequest, pool_dir: Path) -> dict[str, Any]:
    if backend == "redis":
        return {"storage.backend": "redis", "storage.redis.url": request.getfixturevalue("redis_server").url}
    if backend == "mooncake":
        master = request.getfixturevalue("mooncake_cluster").master
        return {"storage.backend": "mooncake", "storage.mooncake.master": master}
    return {"storage.backend": "file", "storage.file.path": str(pool_dir)}


@pytest.mark.parametrize("backend", ["file", "redis", "mooncake"])
def test_prefill_to_decode_handoff(
    backend: str, request: pytest.FixtureRequest, spawn_daemon: Any, short_tmp: Path
) -> None:
    settings = {**storage_settings(backend, request, short_tmp / "pool"), "storage.timeout_s": 10}
    prefill = Node.subprocess(spawn_daemon(0, settings), seed=21)
    decode = Node.subprocess(spawn_daemon(0, settings), seed=22)
    assert prefill.status()["endpoint"] != decode.status()["endpoint"]
    try:
        keys = key_space(weights=f"pd-{backend}").token_keys(prompt(4 * 6 + 3))  # 6 full blocks + 3 tokens
        assert keys[-1].split(":")[3] == "p3"
        src = [5, 9, 2, 17, 30, 31, 12]  # the prefill request's block table
        dst = [40, 3, 7, 8, 20, 21, 0]  # decode's, for the same request
        assert prefill.ok("store", keys, host_ids=list(range(7)), device_ids=src)["stored"] == 7
        assert decode.ok("lookup", keys)["prefix"] == 7
        assert decode.ok("load", keys, host_ids=list(range(100, 107)), device_ids=dst)["loaded"] == 7
        assert_moved(decode.cache, dst, prefill.before, src)
        assert_untouched(decode.cache, decode.before, dst)
        assert_untouched(prefill.cache, prefill.before, [])
        # A longer prompt on decode: the stored prefix loads, the rest is a miss.
        longer = key_space(weights=f"pd-{backend}").token_keys(prompt(4 * 9))
        assert longer[:6] == keys[:6]
        assert decode.ok("load", longer, host_ids=list(range(110, 119)))["loaded"] == 6
    finally:
        prefill.close()
        decode.close()


def test_tensor_parallel_handoff_uses_per_rank_keys(spawn_daemon: Any, short_tmp: Path) -> None:
    """TP=2 on both sides: one engine client per side fans out to both ranks; each rank stores
    and loads its own objects (rank-scoped keys from one hash chain)."""
    settings = {"storage.backend": "file", "storage.file.path": str(short_tmp / "pool")}
    sides = []
    for _side in ("prefill", "decode"):
        daemons: list[DaemonProcess] = [spawn_daemon(rank, settings) for rank in (0, 1)]
        caches = [ShmKVCache(SMALL) for _ in daemons]
        runners = [RunnerClient(d.endpoint) for d in daemons]
        for i, (cache, runner) in enumerate(zip(caches, runners)):
            fill_random(cache, 30 + len(sides) * 2 + i)
            runner.attach(cache)
        engine = EngineClient([d.endpoint for d in daemons], timeout_s=30)
        engine.connect()
        sides.append((engine, caches, runners, [snapshot(c) for c in caches]))
    (p_engine, _, _, p_before), (d_engine, d_caches, _, d_before) = sides
    try:
        space = key_space(weights="pd-tp2", tp_size=2)
        blocks = space.block_hashes(prompt(4 * 4 + 1))
        src, dst = [1, 2, 3, 4, 5], [10, 11, 12, 13, 14]
        req = p_engine.store(space.keys_by_rank(blocks), host_ids=list(range(5)), device_ids=src)
        done = p_engine.wait([req], 30)[req]
        assert done.ok and done.min_result("stored") == 5, done.describe()
        req = d_engine.load(space.keys_by_rank(blocks), host_ids=list(range(20, 25)), device_ids=dst)
        done = d_engine.wait([req], 30)[req]
        assert done.ok and done.min_result("loaded") == 5, done.describe()
        for rank in (0, 1):  # each decode rank got its own prefill rank's blocks
            assert_moved(d_caches[rank], dst, p_before[rank], src)
            assert_untouched(d_caches[rank], d_before[rank], dst)
    finally:
        for engine, caches, runners, _ in sides:
            engine.close()
            for runner, cache in zip(runners, caches):
                runner.detach()
                runner.close()
                cache.close()


def test_demo_handoff_summary(short_tmp: Path) -> None:
    summary = run_pd_handoff(short_tmp / "demo", backend="file")
    assert summary["ok"], summary
    assert summary["blocks"] == 63 and summary["partial_tokens"] == 8
