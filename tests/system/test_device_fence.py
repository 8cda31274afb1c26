"""The device fence (protocol 1.5 and 1.6, docs/protocol.md §7.14): a swap never starts after
its ``not_after``, a copy into or out of device blocks runs inside a shared flock of the
device segment (so a client that gives up on it can tell when no such copy can run any
more, or hold the fence until none may start), and a SWAP_OUT that ends after its
``not_after`` sets no identity keys.

A real daemon process, a runner's shared-memory cache and real sockets; a test that holds
the fence does what a client does while it checks it (exclusively), for much longer."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.client.fence import DeviceFence
from cachexferd.protocol import ErrorCode, KVLayout, MsgType

from ..helpers import SMALL, assert_moved, assert_untouched, fill_random, snapshot

pytestmark = pytest.mark.timeout(120)
# Blocks of 4 MiB: a swap of all 32 takes tens of milliseconds, long enough to be seen.
BIG = KVLayout(num_layers=2, num_blocks=32, block_size=64, num_kv_heads=8, head_dim=1024, dtype="float16")


@contextmanager
def attached(
    spawn_daemon: Any, layout: KVLayout, seed: int
) -> Iterator[tuple[ShmKVCache, EngineClient, dict[str, Any]]]:
    """A daemon with a runner's random cache attached: (cache, engine client, ATTACH result)."""
    daemon = spawn_daemon(settings={"host_cache.capacity": "160MiB"})
    with (
        ShmKVCache(layout) as cache,
        RunnerClient(daemon.endpoint) as runner,
        EngineClient([daemon.endpoint]) as engine,
    ):
        fill_random(cache, seed=seed)
        result = runner.attach(cache)
        engine.connect(timeout_s=10)
        yield cache, engine, result


def codes(engine: EngineClient, req_ids: list[int], timeout_s: float = 20) -> list[int]:
    done = engine.wait(req_ids, timeout_s=timeout_s)
    return [int(next(iter(done[r].outcomes.values())).code) for r in req_ids]


def test_a_swap_in_waits_for_the_fence_and_never_starts_after_its_not_after(spawn_daemon: Any) -> None:
    with attached(spawn_daemon, SMALL, seed=1) as (cache, engine, result):
        assert result["device_fence"] == "flock"
        stored = snapshot(cache)
        assert codes(engine, [engine.submit(MsgType.SWAP_OUT, {"device_ids": [0, 1], "host_ids": [0, 1]})]) == [0]
        fill_random(cache, seed=2)  # the device blocks now differ from the host blocks
        before = snapshot(cache)
        checking = os.open(cache.path, os.O_RDONLY)
        fcntl.flock(checking, fcntl.LOCK_EX)
        try:
            now = time.time()
            late = engine.submit(MsgType.SWAP_IN, {"device_ids": [5], "host_ids": [0], "not_after": now + 0.3})
            in_time = engine.submit(MsgType.SWAP_IN, {"device_ids": [6], "host_ids": [1], "not_after": now + 60})
            time.sleep(0.6)
            assert engine.status()[0]["device"]["state"] == "attached", "the daemon must keep serving meanwhile"
            assert not engine.poll(), "a copy finished while the fence was held"
            assert_untouched(cache, before, [])
        finally:
            fcntl.flock(checking, fcntl.LOCK_UN)
            os.close(checking)
        assert codes(engine, [late, in_time]) == [ErrorCode.EXPIRED, ErrorCode.OK]
        assert_moved(cache, [6], stored, [1])
        assert_untouched(cache, before, [6])  # block 5 too: the late copy never landed


def test_a_swap_out_waits_for_a_fence_its_client_holds_and_never_starts_after_its_not_after(
    spawn_daemon: Any,
) -> None:
    """1.6: copies out of device blocks go inside the fence too. A client that gave up on a
    SWAP_OUT and reused its blocks holds the fence until the command's ``not_after``: the
    copy waits, is then too late, and its host block keeps neither the new bytes nor keys."""
    with attached(spawn_daemon, SMALL, seed=5) as (cache, engine, result):
        assert result["device_fence_reads"] is True
        assert codes(engine, [engine.submit(MsgType.SWAP_OUT, {"device_ids": [0], "host_ids": [0]})]) == [0]
        stored = snapshot(cache)
        fence = DeviceFence(cache.path)
        try:
            now = time.time()
            assert fence.hold_until(now + 0.3)
            late = engine.submit(MsgType.SWAP_OUT, {"device_ids": [3], "host_ids": [0], "keys": ["k3"],
                                                    "not_after": now + 0.3})  # fmt: skip
            in_time = engine.submit(MsgType.SWAP_OUT, {"device_ids": [4], "host_ids": [1], "not_after": now + 60})
            time.sleep(0.6)
            assert not engine.poll(), "a copy out of device blocks ran while the fence was held"
            fence.release_if_due()
            assert not fence.held
        finally:
            fence.close()
        assert codes(engine, [late, in_time]) == [ErrorCode.EXPIRED, ErrorCode.OK]
        fill_random(cache, seed=6)
        before = snapshot(cache)
        back = engine.submit(MsgType.SWAP_IN, {"device_ids": [8, 9], "host_ids": [0, 1]})
        assert codes(engine, [back]) == [ErrorCode.OK]
        assert_moved(cache, [8], stored, [0])  # host block 0 kept what the first SWAP_OUT wrote
        assert_moved(cache, [9], stored, [4])
        assert_untouched(cache, before, [8, 9])
        keyed = engine.submit(MsgType.SWAP_IN, {"device_ids": [10], "host_ids": [0], "keys": ["k3"]})
        assert codes(engine, [keyed]) == [ErrorCode.HOST_BLOCK_CHANGED], "the late SWAP_OUT's key was set"


def test_a_client_sees_the_fence_held_while_a_copy_runs_and_free_after(spawn_daemon: Any) -> None:
    with attached(spawn_daemon, BIG, seed=3) as (cache, engine, _):
        ids = list(range(BIG.num_blocks))
        assert codes(engine, [engine.submit(MsgType.SWAP_OUT, {"device_ids": ids, "host_ids": ids})]) == [0]
        fence = DeviceFence(cache.path)
        try:
            assert fence.quiet(), "nothing copies: the fence is free"
            seen_held = False
            for _ in range(5):  # each swap-in holds it for tens of milliseconds
                fields = {"device_ids": ids, "host_ids": ids[::-1], "not_after": time.time() + 60}
                engine.submit(MsgType.SWAP_IN, fields)
                deadline = time.monotonic() + 20
                while not engine.poll() and time.monotonic() < deadline:
                    seen_held = seen_held or not fence.quiet()
                if seen_held:
                    break
            assert seen_held, "the fence never looked held while a swap-in copied"
            assert codes(engine, [engine.submit(MsgType.PING, {})]) == [0]  # every swap is over
            assert fence.quiet(), "the fence must be free once the copies are done"
        finally:
            fence.close()


def test_a_swap_out_that_ends_after_its_not_after_sets_no_identity_keys(spawn_daemon: Any) -> None:
    """Its client may have reused the device blocks while they were read: the host blocks
    may hold a mix, so they must never be read back under the keys it named."""
    with attached(spawn_daemon, BIG, seed=4) as (_, engine, _):
        ids = list(range(BIG.num_blocks))
        keys = [f"block-{i}" for i in ids]
        detail = ""
        for _ in range(5):  # until one is read in time and ends late (a 128 MiB copy takes longer than 5 ms)
            fields = {"device_ids": ids, "host_ids": ids, "keys": keys, "not_after": time.time() + 0.005}
            req = engine.submit(MsgType.SWAP_OUT, fields)
            (outcome,) = engine.wait([req], timeout_s=20)[req].outcomes.values()
            assert outcome.code == ErrorCode.EXPIRED, outcome
            detail = outcome.detail
            if "ended" in detail:
                break
        assert "ended" in detail, detail
        read = engine.submit(MsgType.SWAP_IN, {"device_ids": [0], "host_ids": [0], "keys": keys[:1]})
        assert codes(engine, [read]) == [ErrorCode.HOST_BLOCK_CHANGED], "a host block was read back under its keys"
