"""The cuda backend's loop-side machinery on CPU, through the fake driver: device threads run
each stream's work after a simulated link delay while the loop issues and settles, so
rings, doorbells, grouping, chunking, cancel, duplex switching, errors and close with work
in flight meet real concurrency. Every copy is checked byte for byte, untouched blocks too.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from cachexferd.backends.base import CancelToken, Direction, SwapRequest
from cachexferd.backends.cuda.device_cache import CopySettings, CudaDeviceCache
from cachexferd.backends.cuda.driver import DriverError
from cachexferd.backends.cuda.fake import FakeDriver
from cachexferd.host_cache import HostPool
from cachexferd.protocol import ErrorCode, KVLayout, ProtocolError

LAYOUT = KVLayout(num_layers=2, num_blocks=96, block_size=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
HB = LAYOUT.host_block_bytes  # 1 KiB: 4 pieces of 256 bytes
HOST_BLOCKS = 96


class Rig:
    """CPU tensors standing in for a runner's cache, a host pool, a fake driver, a cache."""

    def __init__(self, driver: FakeDriver, **settings: Any) -> None:
        gen = torch.Generator().manual_seed(5)
        n, tb = LAYOUT.num_tensors, LAYOUT.tensor_bytes
        self.flat = torch.randint(0, 256, (n * tb,), dtype=torch.uint8, generator=gen)
        self.tensors = [self.flat[t * tb : (t + 1) * tb].view(LAYOUT.num_blocks, -1) for t in range(n)]
        self.pool = HostPool(HOST_BLOCKS * HB)
        self.pool.tensor.copy_(torch.randint(0, 256, (HOST_BLOCKS * HB,), dtype=torch.uint8, generator=gen))
        self.blocks = self.pool.blocks(self.pool.geometry(HB), n)
        self.driver = driver
        base = {"batch_bytes": 4 * HB, "staging_bytes": 4 * HB, "spin_us": 200}
        self.cache = CudaDeviceCache(driver, LAYOUT, [t.data_ptr() for t in self.tensors], self.pool,
                                     self.pool.geometry(HB), CopySettings(**{**base, **settings}))  # fmt: skip
        self.before = self.snapshot()

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flat.clone(), self.blocks.clone()

    def device_block(self, t: int, b: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        tb, c = LAYOUT.tensor_bytes, LAYOUT.chunk_bytes
        return (self.flat if flat is None else flat)[t * tb + b * c : t * tb + (b + 1) * c]

    def check_out(self, dev: list[int], host: list[int], before: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Swap-out moved exactly these pairs; every other host block is as it was."""
        for t in range(LAYOUT.num_tensors):
            for d, h in zip(dev, host):
                assert torch.equal(self.blocks[h, t], self.device_block(t, d, before[0])), f"host {h} tensor {t}"
        keep = sorted(set(range(HOST_BLOCKS)) - set(host))
        assert torch.equal(self.blocks[keep], before[1][keep]), "swap-out wrote outside its host blocks"

    def check_in(self, dev: list[int], host: list[int], before: tuple[torch.Tensor, torch.Tensor]) -> None:
        for t in range(LAYOUT.num_tensors):
            for d, h in zip(dev, host):
                assert torch.equal(self.device_block(t, d), before[1][h, t]), f"device {d} tensor {t}"
            for b in sorted(set(range(LAYOUT.num_blocks)) - set(dev)):
                assert torch.equal(self.device_block(t, b), self.device_block(t, b, before[0])), f"touched {b}"

    def close(self) -> None:
        self.cache.close()
        self.driver.stop()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


def make(rigs: list[Rig], driver: FakeDriver | None = None, **settings: Any) -> Rig:
    rig = Rig(driver or FakeDriver(rate_gbps=0.05), **settings)
    rigs.append(rig)
    return rig


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 30) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


def requests(pairs: list[tuple[list[int], list[int]]]) -> list[SwapRequest]:
    return [SwapRequest(d, h, CancelToken()) for d, h in pairs]


def test_a_batch_of_commands_is_one_unit_with_one_result_each(rigs: list[Rig]) -> None:
    rig = make(rigs, batch_bytes=64 * HB, staging_bytes=64 * HB)
    batch = [([3 * i, 3 * i + 1], [40 + i, 60 + i]) for i in range(6)]
    results = run(rig.cache.swap_many(Direction.D2H, requests(batch)))
    assert results == [None] * 6
    assert (rig.driver.calls["launch"], rig.driver.calls["write_doorbell"], rig.driver.calls["memcpy_async"]) == (
        1, 1, 1
    ), "one launch, one ids upload, one doorbell for the whole batch"  # fmt: skip
    rig.check_out([d for ds, _ in batch for d in ds], [h for _, hs in batch for h in hs], rig.before)


def test_a_large_swap_is_chunked_and_stops_between_chunks_when_cancelled(rigs: list[Rig]) -> None:
    rig = make(rigs)  # 4 blocks a unit, 2 units of a batch in flight
    rig.driver.pause()
    dev, host = list(range(20)), random.Random(1).sample(range(HOST_BLOCKS), 20)
    token = CancelToken()

    async def scenario() -> list[BaseException | None]:
        pending = asyncio.ensure_future(rig.cache.swap_many(Direction.D2H, [SwapRequest(dev, host, token)]))
        await asyncio.sleep(0.05)
        assert rig.driver.calls["launch"] == 2, "lookahead: two chunks in flight, not the whole swap"
        token.cancel(ErrorCode.DETACHED, "detaching")
        rig.driver.resume()
        result: list[BaseException | None] = await pending
        return result

    (error,) = run(scenario())
    assert isinstance(error, ProtocolError) and error.code == ErrorCode.DETACHED
    assert rig.driver.calls["launch"] == 2, "no chunk issued after the cancel"
    rig.check_out(dev[:8], host[:8], rig.before)  # the issued chunks finished; nothing else moved
    keep = sorted(set(range(HOST_BLOCKS)) - set(host[:8]))
    assert torch.equal(rig.blocks[keep], rig.before[1][keep])


def test_a_command_cancelled_before_it_starts_never_reaches_the_device(rigs: list[Rig]) -> None:
    rig = make(rigs)
    first, second = requests([([1, 2], [3, 4]), ([5], [6])])
    first.cancel.cancel(ErrorCode.PAUSED, "paused")
    results = run(rig.cache.swap_many(Direction.H2D, [first, second]))
    assert isinstance(results[0], ProtocolError) and results[0].code == ErrorCode.PAUSED and results[1] is None
    rig.check_in([5], [6], rig.before)
    assert rig.driver.calls["launch"] == 1


def test_ring_slots_are_reused_only_after_their_doorbell(rigs: list[Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    """Far more swaps in flight than ring slots, on two streams: each slot's ids are read by
    the "kernel" when it runs, so a slot reused early would move the wrong blocks."""
    rig = make(rigs, ring_slots=3)
    lane = rig.cache.lanes[Direction.D2H]
    most = 0
    issue = lane._issue

    def counting(unit: Any, nbytes: int) -> None:
        nonlocal most
        issue(unit, nbytes)
        most = max(most, lane.in_flight)

    monkeypatch.setattr(lane, "_issue", counting)
    rng = random.Random(3)
    dev, host = rng.sample(range(LAYOUT.num_blocks), 40), rng.sample(range(HOST_BLOCKS), 40)

    async def many() -> list[Any]:
        return await asyncio.gather(
            *(rig.cache.swap(Direction.D2H, [d], [h], CancelToken()) for d, h in zip(dev, host))
        )

    assert run(many()) == [HB] * 40
    rig.check_out(dev, host, rig.before)
    assert most == 3, f"units in flight went to {most} with 3 slots"
    assert {s.seq for s in lane.streams} == {20}, "units alternate between the lane's two streams"
    assert lane.free_slots and sorted(lane.free_slots) == [0, 1, 2]


def test_both_directions_at_once_switch_to_staging_mid_swap(rigs: list[Rig]) -> None:
    rig = make(rigs, FakeDriver(rate_gbps=0.0003))  # a unit of 4 blocks takes ~14 ms
    rng = random.Random(4)
    out_dev, out_host = rng.sample(range(48), 40), rng.sample(range(48), 40)
    in_dev, in_host = [48 + d for d in rng.sample(range(48), 12)], [48 + h for h in rng.sample(range(48), 12)]

    async def both() -> None:
        out = asyncio.ensure_future(rig.cache.swap(Direction.D2H, out_dev, out_host, CancelToken()))
        await asyncio.sleep(0.02)  # a few swap-out units ran alone: zero-copy
        await rig.cache.swap(Direction.H2D, in_dev, in_host, CancelToken())
        await out

    run(both())
    d2h, h2d = (rig.cache.lanes[d].by_method for d in (Direction.D2H, Direction.H2D))
    assert d2h["kernel"] >= 1 and d2h["staging"] >= 1, f"swap-out should have switched methods: {d2h}"
    assert h2d["staging"] >= 1, f"swap-in ran beside swap-out: {h2d}"
    rig.check_out(out_dev, out_host, rig.before)
    rig.check_in(in_dev, in_host, rig.before)


def test_long_units_are_settled_by_the_watcher_short_ones_by_polling(rigs: list[Rig]) -> None:
    slow = make(rigs, FakeDriver(rate_gbps=0.0005))  # 1 KiB blocks: a 4-block unit takes ~8 ms
    run(slow.cache.swap(Direction.D2H, list(range(12)), list(range(12)), CancelToken()))
    lane = slow.cache.lanes[Direction.D2H]
    assert lane.counts["watched"] >= 1 and lane.counts["wakes"] == lane.counts["watched"]
    assert lane.counts["polls"] < 200, "a long unit must not be polled for all its duration"
    slow.check_out(list(range(12)), list(range(12)), slow.before)
    fast = make(rigs, FakeDriver(rate_gbps=0.0, inline=True))
    run(fast.cache.swap(Direction.D2H, [1, 2], [3, 4], CancelToken()))
    assert fast.cache.lanes[Direction.D2H].counts["watched"] == 0


def test_a_driver_error_fails_the_commands_of_that_unit_only(rigs: list[Rig]) -> None:
    rig = make(rigs, batch_bytes=2 * HB)
    rig.driver.fail_next("launch", "invalid argument")
    results = run(rig.cache.swap_many(Direction.D2H, requests([([1, 2], [10, 11]), ([3, 4], [12, 13])])))
    assert isinstance(results[0], DriverError) and "invalid argument" in str(results[0]) and results[1] is None
    rig.check_out([3, 4], [12, 13], rig.before)
    assert run(rig.cache.swap(Direction.D2H, [5], [14], CancelToken())) == HB, "the lane still works"


def test_a_device_fault_fails_everything_in_flight_and_later(rigs: list[Rig]) -> None:
    rig = make(rigs, FakeDriver(rate_gbps=0.0005))

    async def scenario() -> tuple[list[BaseException | None], list[BaseException | None]]:
        pending = asyncio.ensure_future(
            rig.cache.swap_many(Direction.D2H, requests([(list(range(12)), list(range(12)))]))
        )
        await asyncio.sleep(0.005)
        rig.driver.break_device("an illegal memory access was encountered")
        first = await pending
        later = await rig.cache.swap_many(Direction.D2H, requests([([20], [20])]))
        return first, later

    first, later = run(scenario())
    assert isinstance(first[0], DriverError) and "illegal memory access" in str(first[0])
    assert isinstance(later[0], DriverError), "a failed lane refuses later work"
    assert "illegal memory access" in str(rig.cache.describe()["lanes"]["d2h"]["broken"])


def test_a_stalled_device_fails_the_lane_after_the_grace_period(rigs: list[Rig]) -> None:
    rig = make(rigs, stall_s=0.3)
    rig.driver.pause()  # the doorbell never moves
    (error,) = run(rig.cache.swap_many(Direction.H2D, requests([([1], [2])])), timeout_s=10)
    assert isinstance(error, DriverError) and "has not finished" in str(error)
    rig.check_in([], [], rig.before)  # nothing moved


def test_close_with_units_in_flight_waits_for_them(rigs: list[Rig]) -> None:
    """Detach with drain 0: the commands are cancelled, the issued units still finish,
    then close() returns with nothing in flight."""
    rig = make(rigs)
    rig.driver.pause()
    tokens = [CancelToken() for _ in range(3)]

    async def scenario() -> list[Any]:
        batch = [
            SwapRequest(list(range(16 * i, 16 * i + 16)), list(range(16 * i, 16 * i + 16)), t)
            for i, t in enumerate(tokens)
        ]  # 4 units each, 2 in flight at once
        pending = [asyncio.ensure_future(rig.cache.swap_many(Direction.D2H, [r])) for r in batch]
        await asyncio.sleep(0.02)
        for token in tokens:
            token.cancel(ErrorCode.DETACHED, "detached")
        assert rig.cache.lanes[Direction.D2H].in_flight > 0
        threading.Timer(0.2, rig.driver.resume).start()
        rig.cache.close()  # blocks until the issued units are done
        assert rig.cache.lanes[Direction.D2H].wait_idle(0), "close returned before the GPU was done"
        return await asyncio.gather(*pending)

    results = run(scenario())
    assert rig.cache.lanes[Direction.D2H].in_flight == 0
    assert all(isinstance(r[0], ProtocolError) and r[0].code == ErrorCode.DETACHED for r in results)
    rigs.remove(rig)
    rig.driver.stop()


def test_the_hot_path_allocates_no_tensor_and_never_blocks(rigs: list[Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make(rigs, FakeDriver(rate_gbps=0.01))

    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("a torch allocation on the copy path")

    for name in ("tensor", "empty", "zeros", "ones", "full", "frombuffer", "as_tensor", "from_numpy"):
        monkeypatch.setattr(torch, name, forbidden)
    monkeypatch.setattr(torch.Tensor, "pin_memory", forbidden)
    monkeypatch.setattr(torch.Tensor, "to", forbidden)
    monkeypatch.setattr(torch.Tensor, "clone", forbidden)
    rng = random.Random(6)
    loop_thread = 0
    rig.driver.blocking_calls.clear()  # the attach's own uploads block, off the loop in a daemon

    async def traffic() -> None:
        nonlocal loop_thread
        loop_thread = threading.get_ident()
        for direction in (Direction.D2H, Direction.H2D, Direction.D2H):
            pairs = [(rng.sample(range(48), 5), rng.sample(range(48), 5)) for _ in range(4)]
            assert await rig.cache.swap_many(direction, requests(pairs)) == [None] * 4
        both = [rig.cache.swap(d, [60 + i], [60 + i], CancelToken()) for i, d in enumerate(Direction)]
        await asyncio.gather(*both)

    run(traffic())
    monkeypatch.undo()
    blocking_on_loop = [name for name, thread in rig.driver.blocking_calls if thread == loop_thread]
    assert blocking_on_loop == [], f"blocking driver calls on the event loop: {blocking_on_loop}"
    assert rig.cache.lanes[Direction.D2H].counts["units"] >= 3


def test_stage_times_are_recorded_in_order(rigs: list[Rig]) -> None:
    rig = make(rigs)
    run(rig.cache.swap(Direction.D2H, list(range(10)), list(range(10)), CancelToken()))
    lane = rig.cache.lanes[Direction.D2H]
    rows = lane.stages[lane.stages[:, 1] > 0]
    assert len(rows) == 3 and bool(np.all(np.diff(rows, axis=1) >= 0)), rows
    stages = lane.describe()["stages"]
    assert set(stages) == {"queued_to_issued_us", "issued_to_done_us", "done_to_settled_us"}
