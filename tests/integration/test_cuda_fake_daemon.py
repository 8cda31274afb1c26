"""The cuda backend's copy path inside a real daemon, without a GPU: its device cache runs
over the CPU stand-in driver (whose device threads take a simulated link time per unit),
attached to a runner's shared-memory cache. Everything above the driver is what a daemon on
a GPU host runs: a BATCH of swaps becomes one unit per direction with one outcome per
command, conflicting pipelined swaps keep their order, and a detach with copies in flight
answers every command and lets go of the memory."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachexferd.backends import cpu
from cachexferd.backends.base import Backend, DeviceCache
from cachexferd.backends.cuda.device_cache import CopySettings, CudaDeviceCache
from cachexferd.backends.cuda.fake import FakeDriver
from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.host_cache import HostGeometry, HostPool
from cachexferd.protocol import ErrorCode, KVLayout
from cachexferd.security import Requester

from ..helpers import (
    SMALL,
    InProcessDaemon,
    assert_matches_model,
    assert_moved,
    assert_untouched,
    config_for,
    fill_random,
    snapshot,
    submit_random_pipeline,
)


class FakeCudaBackend(Backend):
    """The cuda device cache over the stand-in driver, attached as the cpu backend attaches."""

    name = "cuda"

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver

    def create_host_pool(self, capacity: int) -> HostPool:
        return HostPool(capacity)

    def import_device_cache(
        self, layout: KVLayout, device: dict[str, Any], pool: HostPool, geometry: HostGeometry, requester: Requester
    ) -> DeviceCache:
        name, fd, wire_offsets = cpu.decode_device(device)
        storage, size, _, segment_fd = cpu.open_device_segment(name, fd, requester)
        os.close(segment_fd)  # mapped: this fake has no device fence
        offsets = cpu.validate_offsets(wire_offsets, layout, size)
        held = [storage]  # the mapping lives until close
        addrs = [storage.data_ptr() + o for o in offsets]
        hb = layout.host_block_bytes
        settings = CopySettings(batch_bytes=8 * hb, staging_bytes=8 * hb, spin_us=100)
        return CudaDeviceCache(self.driver, layout, addrs, pool, geometry, settings, lambda: len(held), held.clear)

    def close(self) -> None:
        self.driver.stop()


@pytest.fixture
def fake_gpu(short_tmp: Path) -> Iterator[tuple[InProcessDaemon, FakeDriver, EngineClient]]:
    driver = FakeDriver(rate_gbps=0.02)
    daemon = InProcessDaemon(config_for(short_tmp / "rt"), lambda: FakeCudaBackend(driver)).start()
    engine = EngineClient([daemon.endpoint], timeout_s=20)
    engine.connect()
    yield daemon, driver, engine
    engine.close()
    daemon.stop()


def _ok(engine: EngineClient, req_ids: list[int]) -> list[dict[str, Any]]:
    done = engine.wait(req_ids, timeout_s=30)
    results = []
    for req_id in req_ids:
        (outcome,) = done[req_id].outcomes.values()
        assert outcome.ok, outcome.describe()
        results.append(outcome.result)
    return results


def test_a_batch_of_swaps_is_one_unit_per_direction(fake_gpu: Any) -> None:
    daemon, driver, engine = fake_gpu
    rng = random.Random(3)
    with ShmKVCache(SMALL) as kv, RunnerClient(daemon.endpoint) as runner, runner.attached(kv):
        fill_random(kv, seed=3)
        before = snapshot(kv)
        _ok(engine, [engine.swap_out([30, 31, 32], [200, 201, 202])])
        launches = driver.calls["launch"]
        src, host = rng.sample(range(20), 6), rng.sample(range(100), 6)
        with engine.batch():
            outs = [engine.swap_out([s], [h]) for s, h in zip(src, host)]
            ins = [engine.swap_in([40, 41], [200, 201]), engine.swap_in([42], [202])]
        results = _ok(engine, outs + ins)
        assert driver.calls["launch"] - launches == 2, "one unit per direction for the whole BATCH"
        assert [r["blocks"] for r in results] == [1] * 6 + [2, 1]
        back = [43, 44, 45, 46, 47, 36]
        _ok(engine, [engine.swap_in(back, host)])
        status = runner.status()
    assert_moved(kv, [40, 41, 42], before, [30, 31, 32])
    assert_moved(kv, back, before, src)
    assert_untouched(kv, before, [40, 41, 42, *back])
    lanes = status["device"]["lanes"]
    assert lanes["d2h"]["units"] >= 2 and lanes["h2d"]["units"] >= 2
    assert set(lanes["d2h"]["stages"]) == {"queued_to_issued_us", "issued_to_done_us", "done_to_settled_us"}


def test_pipelined_conflicting_swaps_end_as_if_run_one_by_one(fake_gpu: Any) -> None:
    daemon, _, engine = fake_gpu
    with ShmKVCache(SMALL) as kv, RunnerClient(daemon.endpoint) as runner, runner.attached(kv):
        fill_random(kv, seed=11)
        original = snapshot(kv)
        req_ids, expected = submit_random_pipeline(engine, random.Random(11), SMALL.num_blocks, 24, commands=150)
        _ok(engine, req_ids)
        assert_matches_model(kv, original, expected)


def test_detach_with_copies_in_flight_answers_every_command(fake_gpu: Any) -> None:
    daemon, driver, engine = fake_gpu
    layout = SMALL
    with ShmKVCache(layout) as kv, RunnerClient(daemon.endpoint) as runner:
        runner.attach(kv)
        ids = list(range(40))
        driver.pause()  # the device holds the first units: later ones wait, then get cancelled
        req_ids = [engine.swap_out(ids, ids) if i % 2 else engine.swap_in(ids, ids) for i in range(8)]
        # The engine's socket is not the runner's: let the daemon accept all eight before the
        # DETACH, or a late one is (rightly) refused NOT_ATTACHED instead of cancelled.
        deadline = time.monotonic() + 30
        while sum(runner.status()["commands"].values()) < len(req_ids):
            assert time.monotonic() < deadline, "the daemon never held the eight swaps"
            time.sleep(0.01)
        driver.resume()
        reply = runner.detach(drain_timeout_s=0.0)
        assert reply["state"] == "detached" and runner.status()["device"]["state"] == "detached"
        done = engine.wait(req_ids, timeout_s=30)
        codes = {ErrorCode(o.code) for c in done.values() for o in c.outcomes.values()}
        assert len(done) == len(req_ids) and codes <= {ErrorCode.OK, ErrorCode.DETACHED}, codes
        assert ErrorCode.DETACHED in codes, "detach with drain 0 should have cancelled waiting swaps"
        fill_random(kv, seed=5)
        before = snapshot(kv)
        with runner.attached(kv):  # attaches again and copies as before
            _ok(engine, [engine.swap_out([0, 1], [0, 1]), engine.swap_in([5, 6], [0, 1])])
        assert_moved(kv, [5, 6], before, [0, 1])
