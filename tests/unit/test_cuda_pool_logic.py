"""The pinned pool's chunked background pinning, its waits and its NUMA helpers (no GPU:
the registrar is a fake that can be stepped chunk by chunk or made to fail)."""

from __future__ import annotations

import asyncio
import itertools
import mmap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cachexferd.backends.cpu import CpuBackend
from cachexferd.backends.cuda.pool import (
    PAGE,
    ChunkPinner,
    PinnedHostPool,
    chunk_spans,
    node_mask,
    normalize_bus_id,
    pci_numa_node,
    try_bind_memory,
)
from cachexferd.client import RunnerClient, ShmKVCache
from cachexferd.daemon.server import Daemon
from cachexferd.host_cache import HostPool

from ..helpers import SMALL, InProcessDaemon, config_for

MIB = 1 << 20


class SteppedRegistrar:
    """Registers only when the test releases a step; can fail at a given chunk."""

    def __init__(self, gated: bool = True, fail_at: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.steps = threading.Semaphore(0)
        self.abort = threading.Event()  # makes a gated registration give up (like a failing call)
        self.gated = gated
        self.fail_at = fail_at

    def register(self, address: int, size: int) -> None:
        deadline = time.monotonic() + 10
        while self.gated and not self.steps.acquire(timeout=0.005):
            if self.abort.is_set() or time.monotonic() > deadline:
                raise RuntimeError("registration abandoned")
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("cudaErrorMemoryAllocation")
        self.calls.append((address, size))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.steps.release()


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def test_chunk_spans_cover_the_pool_in_whole_pages() -> None:
    spans = chunk_spans(10 * PAGE + 123, 3 * PAGE)
    assert spans[0] == (0, 3 * PAGE) and spans[-1] == (9 * PAGE, PAGE + 123)
    assert sum(size for _, size in spans) == 10 * PAGE + 123
    assert all(a + sa == b for (a, sa), (b, _) in itertools.pairwise(spans))
    assert chunk_spans(4 * PAGE, PAGE + 1)[0] == (0, 2 * PAGE)  # rounded up to pages
    assert chunk_spans(PAGE, 1) == [(0, PAGE)]


def test_pinner_advances_in_order_and_reports_progress() -> None:
    reg = SteppedRegistrar()
    progress: list[tuple[int, int]] = []
    pinner = ChunkPinner(0x10000, 4 * MIB, MIB, reg, lambda ready, pinned: progress.append((ready, pinned)))
    pinner.start()
    assert pinner.ready_bytes == 0 and not pinner.done
    reg.step()
    assert pinner.wait_ready(MIB, timeout_s=5)
    assert not pinner.wait_ready(2 * MIB, timeout_s=0.05)  # not released yet: must not pass
    reg.step(3)
    assert pinner.wait_ready(4 * MIB, timeout_s=5)
    wait_until(lambda: pinner.done)
    assert reg.calls == [(0x10000 + i * MIB, MIB) for i in range(4)]
    assert progress == [(i * MIB, i * MIB) for i in range(1, 5)]
    info = pinner.describe()
    assert info["pinned_bytes"] == 4 * MIB and info["done"] and info["error"] is None and info["chunks"] == 4


def test_async_wait_resolves_only_once_its_range_is_pinned() -> None:
    reg = SteppedRegistrar()
    pinner = ChunkPinner(0, 4 * MIB, MIB, reg)
    pinner.start()

    async def scenario() -> None:
        waiter = asyncio.ensure_future(pinner.wait_ready_async(3 * MIB - 1))  # ends inside chunk 3
        early = asyncio.ensure_future(pinner.wait_ready_async(MIB))
        reg.step(2)
        await asyncio.wait_for(early, 5)
        await asyncio.sleep(0.05)
        assert not waiter.done(), "woke before its last byte was pinned"
        reg.step()
        await asyncio.wait_for(waiter, 5)
        await asyncio.wait_for(pinner.wait_ready_async(MIB), 1)  # already ready: immediate

    asyncio.run(scenario())
    reg.step()
    wait_until(lambda: pinner.done)


def test_failed_registration_serves_the_rest_unpinned() -> None:
    reg = SteppedRegistrar(gated=False, fail_at=2)
    pinner = ChunkPinner(0, 4 * MIB, MIB, reg)

    async def scenario() -> None:
        waiter = asyncio.ensure_future(pinner.wait_ready_async(4 * MIB))
        pinner.start()
        await asyncio.wait_for(waiter, 5)  # a failure must not leave swaps waiting forever

    asyncio.run(scenario())
    wait_until(lambda: pinner.done)
    assert pinner.pinned_bytes == 2 * MIB and pinner.ready_bytes == 4 * MIB
    assert pinner.error is not None and "cudaErrorMemoryAllocation" in pinner.error
    pinner.unpin()
    assert reg.unregistered == [MIB, 0]  # every registered chunk, newest first


def test_stop_fails_waiters_and_unpin_unregisters_everything() -> None:
    reg = SteppedRegistrar()
    pinner = ChunkPinner(0, 4 * MIB, MIB, reg)
    pinner.start()
    reg.step()
    assert pinner.wait_ready(MIB, 5)

    async def scenario() -> None:
        waiter = asyncio.ensure_future(pinner.wait_ready_async(4 * MIB))
        await asyncio.sleep(0.01)
        unpin = asyncio.get_running_loop().run_in_executor(None, pinner.unpin)
        while not pinner.stopping:
            await asyncio.sleep(0.001)
        reg.abort.set()  # the chunk in progress ends (failing) after the stop: no error recorded
        await asyncio.wait_for(unpin, 10)
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(waiter, 5)
        with pytest.raises(RuntimeError, match="closed"):
            await pinner.wait_ready_async(4 * MIB)

    asyncio.run(scenario())
    assert sorted(reg.unregistered) == [addr for addr, _ in reg.calls]
    assert pinner.pinned_bytes == 0 and len(reg.calls) == 1 and pinner.error is None


def test_pinned_pool_ready_bytes_pinned_flag_and_discard() -> None:
    reg = SteppedRegistrar()
    pool = PinnedHostPool(4 * MIB, reg, MIB)
    try:
        assert isinstance(pool, HostPool) and pool.ready_bytes == 0 and not pool.pinned
        pool.tensor.fill_(7)
        reg.step()
        assert pool.wait_ready(MIB, 5)
        wait_until(lambda: pool.ready_bytes == MIB)
        # Chunk 0 is registered and chunk 1 is being registered (the fake waits for a step):
        # only the pages after it may go back to the OS, and discard must not wait for it.
        started = time.monotonic()
        pool.discard()
        assert time.monotonic() - started < 1.0
        assert bool((pool.tensor[: 2 * MIB] == 7).all()), "a registered page was discarded"
        assert bool((pool.tensor[2 * MIB :] == 0).all())
        assert not pool.wait_all_pinned(timeout_s=0.05)
        reg.step(3)
        assert pool.wait_all_pinned(timeout_s=5)
        wait_until(lambda: pool.pinned)
        assert pool.ready_bytes == 4 * MIB and reg.calls[0][0] == pool.address
        pool.tensor.fill_(5)
        pool.discard()
        assert bool((pool.tensor == 5).all()), "discard must be a no-op once pinned"
        assert pool.describe_pinning()["done"]
    finally:
        pool.close()
    assert len(reg.unregistered) == 4 and not pool.pinned


# NUMA -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bus_id", "sysfs"),
    [("00000000:65:00.0", "0000:65:00.0"), ("0000:1B:00.0", "0000:1b:00.0"), ("65:00.0", "0000:65:00.0")],
)
def test_bus_id_normalisation(bus_id: str, sysfs: str) -> None:
    assert normalize_bus_id(bus_id) == sysfs


def test_numa_node_read_from_sysfs(tmp_path: Path) -> None:
    for name, value in (("0000:65:00.0", "1\n"), ("0000:66:00.0", "-1\n")):
        (tmp_path / "bus/pci/devices" / name).mkdir(parents=True)
        (tmp_path / "bus/pci/devices" / name / "numa_node").write_text(value)
    assert pci_numa_node("00000000:65:00.0", str(tmp_path)) == 1
    assert pci_numa_node("0000:66:00.0", str(tmp_path)) is None  # the system exposes no node
    assert pci_numa_node("0000:67:00.0", str(tmp_path)) is None
    assert pci_numa_node("garbage", str(tmp_path)) is None


def test_node_mask_sets_one_bit() -> None:
    mask, maxnode = node_mask(0)
    assert list(mask) == [1] and maxnode == 65
    mask, maxnode = node_mask(70)
    assert list(mask) == [0, 1 << 6] and maxnode == 129


def test_binding_never_raises() -> None:
    buf = mmap.mmap(-1, 4 * PAGE)
    address = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    result = try_bind_memory(address, 4 * PAGE, 0)  # containers may refuse mbind: then a reason
    assert result is None or isinstance(result, str)
    assert isinstance(try_bind_memory(address, 4 * PAGE, 1000), str)  # no such node: reported, not raised


# The daemon with a slowly pinning pool ----------------------------------------------------


class SlowPinBackend(CpuBackend):
    """The cpu backend's copies over a pool that pins slowly (gated by the test)."""

    def __init__(self, registrar: Any) -> None:
        super().__init__(copy_threads=1)
        self.registrar = registrar
        self.pinned_pools: list[PinnedHostPool] = []

    def create_host_pool(self, capacity: int) -> HostPool:
        pool = PinnedHostPool(capacity, self.registrar, capacity // 4)
        self.pinned_pools.append(pool)
        return pool

    def close(self) -> None:
        super().close()
        for pool in self.pinned_pools:
            pool.close()


def test_daemon_answers_at_once_and_reports_pinning_progress(short_tmp: Path) -> None:
    reg = SteppedRegistrar()
    config = config_for(short_tmp / "rt")
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        daemon = Daemon(config, backend=SlowPinBackend(reg))
        box["daemon"], box["loop"] = daemon, asyncio.get_running_loop()
        await daemon.start()
        ready.set()
        await daemon.wait_stop_requested()
        await daemon.shutdown()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(20)
        daemon: Daemon = box["daemon"]
        capacity = config.host_cache.capacity
        with RunnerClient(config.endpoint, timeout_s=5) as runner:
            started = time.monotonic()
            host = runner.status()["host_cache"]
            assert time.monotonic() - started < 1.0
            assert host["ready_bytes"] == 0 and host["pinned"] is False
            reg.step(2)
            wait_until(lambda: runner.status()["host_cache"]["ready_bytes"] == capacity // 2)
            assert daemon.metrics.registry.get_sample_value("cachexferd_host_cache_ready_bytes") == capacity // 2
            with ShmKVCache(SMALL) as cache:
                runner.attach(cache)  # attach does not wait for pinning
                runner.detach()
            reg.step(2)
            wait_until(lambda: runner.status()["host_cache"]["pinned"] is True)
            assert daemon.metrics.registry.get_sample_value("cachexferd_host_cache_ready_bytes") == capacity
    finally:
        if "loop" in box:
            box["loop"].call_soon_threadsafe(box["daemon"].request_stop, "test teardown")
        thread.join(30)
    assert not thread.is_alive()


def test_a_woken_waiter_sees_the_pools_new_figures() -> None:
    """A swap that waited for pinning may read the pool's figures at once (status, tests):
    they are updated before any waiter is woken, however slowly the update runs."""

    class SlowProgressPool(PinnedHostPool):
        def _on_progress(self, ready: int, pinned: int) -> None:
            time.sleep(0.05)  # the pinning thread is descheduled here
            super()._on_progress(ready, pinned)

    reg = SteppedRegistrar()
    pool = SlowProgressPool(2 * MIB, reg, MIB)
    try:

        async def wait_then_read() -> int:
            waiting = asyncio.ensure_future(pool.wait_ready_async(2 * MIB))
            await asyncio.sleep(0.01)
            reg.step(2)
            await asyncio.wait_for(waiting, 5)
            return pool.ready_bytes

        assert asyncio.run(wait_then_read()) == 2 * MIB
    finally:
        pool.close()


# Pinning by several workers -----------------------------------------------------------------


class ParallelRegistrar:
    """Registers after a short sleep (the GIL is free meanwhile, as in cudaHostRegister),
    recording how many registrations overlap; chunks listed in ``hold`` wait for a release."""

    def __init__(self, seconds: float = 0.02, hold: set[int] | None = None, fail_at: int | None = None) -> None:
        self.seconds, self.hold, self.fail_at = seconds, hold or set(), fail_at
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.active = self.most = 0
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def register(self, address: int, size: int) -> None:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            if address // MIB in self.hold:
                assert self.release.wait(10), "never released"
            time.sleep(self.seconds)
            if address // MIB == self.fail_at:
                raise RuntimeError("cudaErrorMemoryAllocation")
            with self.lock:
                self.registered.append(address)
        finally:
            with self.lock:
                self.active -= 1

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_workers_pin_chunks_in_parallel_and_the_ready_prefix_only_grows() -> None:
    reg = ParallelRegistrar()
    touched: list[int] = []
    progress: list[tuple[int, int]] = []

    def touch(address: int, size: int) -> None:
        assert address not in reg.registered, "a chunk is touched before it is registered"
        touched.append(address)

    pinner = ChunkPinner(0, 16 * MIB, MIB, reg, lambda ready, pinned: progress.append((ready, pinned)), 4, touch)
    pinner.start()
    assert pinner.wait_ready(16 * MIB, 10) and pinner.done
    assert sorted(reg.registered) == sorted(touched) == [i * MIB for i in range(16)]
    assert reg.most >= 2, "the workers never registered two chunks at once"
    pinned = [p for _, p in progress]
    assert pinned == sorted(pinned) and pinned[-1] == 16 * MIB and all(r == p for r, p in progress)
    assert pinner.describe()["workers"] == 4


def test_a_chunk_finishing_early_waits_for_those_below_it() -> None:
    reg = ParallelRegistrar(seconds=0.0, hold={0})
    pinner = ChunkPinner(0, 4 * MIB, MIB, reg, workers=2)
    pinner.start()
    wait_until(lambda: len(reg.registered) == 3)
    assert pinner.pinned_bytes == pinner.ready_bytes == 0, "chunk 0 is not registered yet"
    reg.release.set()
    assert pinner.wait_ready(4 * MIB, 10) and pinner.pinned_bytes == 4 * MIB


def test_a_failure_with_several_workers_serves_the_rest_unpinned_and_unpins_what_was_pinned() -> None:
    reg = ParallelRegistrar(seconds=0.005, fail_at=5)
    pinner = ChunkPinner(0, 12 * MIB, MIB, reg, workers=3)
    pinner.start()
    assert pinner.wait_ready(12 * MIB, 10)
    wait_until(lambda: pinner.done)
    assert pinner.error is not None and "cudaErrorMemoryAllocation" in pinner.error
    assert pinner.ready_bytes == 12 * MIB and pinner.pinned_bytes <= 5 * MIB
    assert 5 * MIB not in reg.registered
    pinner.unpin()
    assert sorted(reg.unregistered) == sorted(reg.registered), "a chunk pinned beside the failure stayed pinned"


def test_the_pool_first_touches_its_pages_before_registering_them() -> None:
    reg = ParallelRegistrar(seconds=0.0)
    pool = PinnedHostPool(8 * MIB, reg, 2 * MIB, workers=2)
    try:
        assert pool.wait_all_pinned(10)
        assert pool.pinner.touch is not None, "MADV_POPULATE_WRITE is missing on this kernel"
        assert bytes(pool.memory(0, 16)) == bytes(16), "touching changed the pool's bytes"
    finally:
        pool.close()


class ParallelPinBackend(SlowPinBackend):
    def create_host_pool(self, capacity: int) -> HostPool:
        pool = PinnedHostPool(capacity, self.registrar, capacity // 16, workers=4)
        self.pinned_pools.append(pool)
        return pool


def test_status_stays_live_while_several_workers_pin(short_tmp: Path) -> None:
    reg = ParallelRegistrar(seconds=0.1)  # 16 chunks: 1.6 s one by one, about 0.4 s with 4 workers
    config = config_for(short_tmp / "rt")
    daemon = InProcessDaemon(config, lambda: ParallelPinBackend(reg)).start()
    try:
        with RunnerClient(config.endpoint, timeout_s=5) as runner:
            waits, readies = [], []
            while True:
                asked = time.monotonic()
                host = runner.status()["host_cache"]
                waits.append(time.monotonic() - asked)
                readies.append(host["ready_bytes"])
                if host["pinned"]:
                    break
                assert len(waits) < 2000, "pinning never finished"
                time.sleep(0.01)
        assert readies == sorted(readies) and readies[-1] == config.host_cache.capacity
        assert len(set(readies)) >= 3, "status never saw pinning in progress"
        assert max(waits) < 1.0, f"status took {max(waits):.2f} s while the pool was pinning"
        assert reg.most >= 2
    finally:
        daemon.stop()
