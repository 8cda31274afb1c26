"""RL weight updates: pause/resume, weights versions on host blocks and storage names,
CLEAR_HOST giving memory back, and the runner's weight-update helper."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cachexferd.client import ClientError, EngineClient, RunnerClient, ShmKVCache
from cachexferd.protocol import ErrorCode

from ..helpers import SMALL, InProcessDaemon, assert_moved, fill_random, snapshot


def _codes(engine: EngineClient, *req_ids: int) -> list[str]:
    done = engine.wait(req_ids, timeout_s=20)
    return [done[r].outcomes[min(done[r].outcomes)].error for r in req_ids]


def test_pause_refuses_copies_until_resume(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache
) -> None:
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        running = engine.swap_out(list(range(40)), list(range(40)))
        engine.status()  # a reply on the same socket: the swap has been read before the pause
        paused = runner.pause()
        assert paused["paused"] is True and paused["drained"] + paused["cancelled"] >= 0
        refused = engine.swap_out([1], [1])
        allowed = engine.clear_host()
        assert _codes(engine, running, refused, allowed) == ["OK", "PAUSED", "OK"]
        assert runner.status()["paused"] is True
        assert runner.resume() == {"paused": False, "was_paused": True}
        assert _codes(engine, engine.swap_out([1], [1])) == ["OK"]


def test_blocks_of_old_weights_are_never_swapped_back(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache
) -> None:
    fill_random(shm_cache, seed=2)
    before = snapshot(shm_cache)
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        assert _codes(engine, engine.swap_out([1, 2], [10, 11])) == ["OK"]
        assert runner.set_weights(5) == {"previous": 0, "version": 5}
        assert _codes(engine, engine.swap_in([3], [10])) == ["STALE_WEIGHTS"]  # written under version 0
        assert _codes(engine, engine.swap_out([4], [10]), engine.swap_in([5], [10])) == ["OK", "OK"]
        assert runner.status()["host_cache"]["weights_version"] == 5
    assert_moved(shm_cache, [5], before, [4])


def test_clear_host_reports_what_it_freed(inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache) -> None:
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        done = engine.wait([engine.clear_host()], timeout_s=20)
    result = next(iter(done.values())).result()
    assert result["freed_bytes"] == result["capacity_bytes"] > 0


def test_weight_update_helper_reattaches_a_new_layout(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache
) -> None:
    bigger = SMALL.to_wire() | {"num_blocks": SMALL.num_blocks * 2}
    from cachexferd.protocol import KVLayout

    with RunnerClient(inproc.endpoint) as runner:
        runner.attach(shm_cache)
        assert _codes(engine, engine.swap_out([1], [3])) == ["OK"]
        engine.status()
        new_cache = ShmKVCache(KVLayout.from_wire(bigger))
        try:
            with runner.weight_update(shm_cache, version=2) as update:
                assert _codes(engine, engine.swap_out([1], [3])) == ["PAUSED"]
                update.cache = new_cache  # the runner reallocated with more blocks
            assert update.attached["device_blocks"] == SMALL.num_blocks * 2
            status = runner.status()
            assert status["paused"] is False and status["host_cache"]["weights_version"] == 2
            assert _codes(engine, engine.swap_in([60], [3])) == ["STALE_WEIGHTS"]
            assert _codes(engine, engine.swap_out([60], [4])) == ["OK"]
            runner.detach()
        finally:
            new_cache.close()


def test_weight_update_cannot_hang_when_the_daemon_dies(spawn_daemon: Any, short_tmp: Path) -> None:
    daemon = spawn_daemon()
    cache = ShmKVCache(SMALL)
    runner = RunnerClient(daemon.endpoint, timeout_s=2.0)
    try:
        runner.attach(cache)
        started = time.monotonic()
        with pytest.raises(ClientError) as info, runner.weight_update(cache, version=1):
            daemon.kill()  # dies in the middle of the update
        assert info.value.code in (ErrorCode.CLIENT_TIMEOUT, ErrorCode.SEND_FAILED)
        assert time.monotonic() - started < 10  # every step bounded by the client's timeout
    finally:
        runner.close()
        cache.close()
