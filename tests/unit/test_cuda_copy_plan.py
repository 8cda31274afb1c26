"""The cuda backend's copy plans, executed on CPU memory: every DMA call of a plan is run
with memmove row by row, and the staging path runs its torch ops on CPU tensors. Exact
bytes and untouched blocks, as on the GPU."""

from __future__ import annotations

import asyncio
import ctypes
import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from cachexferd.backends.cuda_copy import (
    Copy2D,
    DmaGeometry,
    Engines,
    MethodRule,
    SwapShape,
    available,
    batches,
    choose_method,
    dma_calls,
    dma_rows,
    element_size,
    plan_dma,
    plan_staging,
    run_lengths,
    split_runs,
)
from cachexferd.backends.cuda_runtime import EventWaiter, settle_threadsafe
from cachexferd.backends.cuda_stage import DeviceTensor, Stager, storage_groups
from cachexferd.backends.plan import Run, coalesce, even_groups
from cachexferd.protocol import DTYPE_BYTES, KVLayout

LAYOUT = KVLayout(num_layers=3, num_blocks=24, block_size=2, num_kv_heads=2, head_dim=8, dtype="float16")
HOST_BLOCKS = 40


class Fixture:
    """Fake device tensors (CPU memory) in one of three placements, plus a host pool."""

    def __init__(self, layout: KVLayout, placement: str, seed: int) -> None:
        self.layout = layout
        tb, n = layout.tensor_bytes, layout.num_tensors
        gen = torch.Generator().manual_seed(seed)
        if placement == "one_buffer":  # one group: what CudaKVCache allocates
            flat = torch.randint(0, 256, (n * tb,), dtype=torch.uint8, generator=gen)
            self.tensors = [flat[t * tb : (t + 1) * tb] for t in range(n)]
        elif placement == "separate":  # own allocations (grouped only where the allocator spaced them evenly)
            self.tensors = [torch.randint(0, 256, (tb,), dtype=torch.uint8, generator=gen) for _ in range(n)]
        elif placement == "descending":  # decreasing addresses: every tensor is a group of its own
            flat = torch.randint(0, 256, (n * tb,), dtype=torch.uint8, generator=gen)
            self.tensors = [flat[(n - 1 - t) * tb : (n - t) * tb] for t in range(n)]
        else:  # "padded": K/V pairs evenly spaced inside per-layer buffers with a gap
            self.tensors = []
            for _ in range(layout.num_layers):
                layer = torch.randint(0, 256, (layout.kv_tensors * (tb + 64),), dtype=torch.uint8, generator=gen)
                self.tensors += [layer[k * (tb + 64) : k * (tb + 64) + tb] for k in range(layout.kv_tensors)]
        self.host = torch.randint(0, 256, (HOST_BLOCKS * layout.host_block_bytes,), dtype=torch.uint8, generator=gen)

    def device_block(self, t: int, b: int) -> torch.Tensor:
        c = self.layout.chunk_bytes
        return self.tensors[t][b * c : (b + 1) * c]

    def host_chunk(self, t: int, h: int) -> torch.Tensor:
        off = self.layout.host_chunk_offset(h, t)
        return self.host[off : off + self.layout.chunk_bytes]

    def geometry(self, max_pitch: int = 1 << 31) -> DmaGeometry:
        return DmaGeometry(
            tuple(t.data_ptr() for t in self.tensors),
            self.layout.chunk_bytes,
            self.host.data_ptr(),
            self.layout.host_block_bytes,
            max_pitch,
        )

    def snapshot(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t.clone() for t in self.tensors], self.host.clone()


def run_on_cpu(copies: Sequence[Copy2D]) -> None:
    """What cudaMemcpy2DAsync does, on host memory."""
    for c in copies:
        assert (c.width <= c.dpitch and c.width <= c.spitch) or c.height == 1
        for row in range(c.height):
            ctypes.memmove(c.dst + row * c.dpitch, c.src + row * c.spitch, c.width)


def check_swap(fx: Fixture, to_host: bool, device_ids: list[int], host_ids: list[int], before: tuple) -> None:
    tensors, host = before
    n, c = fx.layout.num_tensors, fx.layout.chunk_bytes
    for t in range(n):
        for d, h in zip(device_ids, host_ids):
            src = tensors[t][d * c : (d + 1) * c]
            off = fx.layout.host_chunk_offset(h, t)
            want, got = (src, fx.host_chunk(t, h)) if to_host else (host[off : off + c], fx.device_block(t, d))
            assert torch.equal(got, want), f"tensor {t}: block {d} <-> host {h} differs"
    if to_host:
        keep = sorted(set(range(HOST_BLOCKS)) - set(host_ids))
        view, old = fx.host.view(HOST_BLOCKS, -1), host.view(HOST_BLOCKS, -1)
        assert torch.equal(view[keep], old[keep]), "a host block outside the swap changed"
        assert all(torch.equal(a, b) for a, b in zip(fx.tensors, tensors)), "swap-out wrote to the device"
    else:
        keep = sorted(set(range(fx.layout.num_blocks)) - set(device_ids))
        for t in range(n):
            assert torch.equal(fx.tensors[t].view(-1, c)[keep], tensors[t].view(-1, c)[keep]), f"tensor {t} changed"
        assert torch.equal(fx.host, host), "swap-in wrote to the host"


def id_pattern(name: str, count: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    if name == "contiguous":
        return list(range(3, 3 + count)), list(range(10, 10 + count))
    if name == "reversed":
        return list(range(count - 1, -1, -1)), list(range(30, 30 - count, -1))
    if name == "mixed":  # runs of different lengths
        return [0, 1, 2, 9, 10, 15, 4], [5, 6, 7, 20, 21, 1, 39]
    return rng.sample(range(LAYOUT.num_blocks), count), rng.sample(range(HOST_BLOCKS), count)


@pytest.mark.parametrize("placement", ["one_buffer", "separate", "descending", "padded"])
@pytest.mark.parametrize("pattern", ["contiguous", "scattered", "reversed", "mixed"])
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_dma_plan_moves_exact_bytes(placement: str, pattern: str, to_host: bool) -> None:
    fx = Fixture(LAYOUT, placement, seed=hash((placement, pattern)) & 0xFFFF)
    device_ids, host_ids = id_pattern(pattern, 12, seed=len(pattern))
    before = fx.snapshot()
    runs = split_runs(coalesce(device_ids, host_ids), LAYOUT.host_block_bytes, 0)
    copies = plan_dma(to_host, runs, fx.geometry())
    assert len(copies) == dma_calls(runs, fx.geometry())
    run_on_cpu(copies)
    check_swap(fx, to_host, device_ids, host_ids, before)


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_pitch_limit_falls_back_to_rows(to_host: bool) -> None:
    """A device whose max pitch is below the host block forces row-by-row copies."""
    fx = Fixture(LAYOUT, "one_buffer", seed=5)
    device_ids, host_ids = list(range(0, 8)), list(range(16, 24))
    before = fx.snapshot()
    copies = plan_dma(to_host, coalesce(device_ids, host_ids), fx.geometry(max_pitch=LAYOUT.chunk_bytes))
    assert all(c.height == 1 for c in copies)
    run_on_cpu(copies)
    check_swap(fx, to_host, device_ids, host_ids, before)


def test_one_buffer_moves_a_scattered_block_in_one_call_and_a_run_per_tensor() -> None:
    fx = Fixture(LAYOUT, "one_buffer", seed=1)
    geo = fx.geometry()
    single = plan_dma(True, [Run(4, 9, 1)], geo)
    assert len(single) == 1 and single[0].height == LAYOUT.num_tensors  # a block of every tensor
    long_run = plan_dma(True, [Run(0, 0, 20)], geo)
    assert len(long_run) == LAYOUT.num_tensors and all(c.height == 20 for c in long_run)
    descending = Fixture(LAYOUT, "descending", seed=1).geometry()
    assert dma_calls([Run(4, 9, 1)], descending) == LAYOUT.num_tensors


def test_single_tensor_layout_collapses_to_one_contiguous_copy() -> None:
    mla = KVLayout(
        num_layers=1, num_blocks=24, block_size=2, num_kv_heads=1, head_dim=8, dtype="bfloat16", kv_tensors=1
    )
    fx = Fixture(mla, "one_buffer", seed=2)
    copies = plan_dma(True, [Run(2, 5, 10)], fx.geometry())
    assert copies == [Copy2D(fx.host.data_ptr() + 5 * mla.host_block_bytes, 10 * mla.chunk_bytes,
                             fx.tensors[0].data_ptr() + 2 * mla.chunk_bytes, 10 * mla.chunk_bytes,
                             10 * mla.chunk_bytes, 1)]  # fmt: skip


def test_even_groups() -> None:
    assert even_groups([0, 10, 20, 30]) == [(0, 4, 10)]
    assert even_groups([0, 10, 25, 40, 100]) == [(0, 2, 10), (2, 2, 15), (4, 1, 0)]
    assert even_groups([50, 0]) == [(0, 1, 0), (1, 1, 0)]


def test_split_runs_keeps_runs_inside_pinning_chunks() -> None:
    hb, boundary = 100, 350  # blocks 3 (300..400) straddles 350
    runs = split_runs([Run(0, 0, 10), Run(50, 7, 1)], hb, boundary)
    covered = [(r.device + i, r.host + i) for r in runs for i in range(r.length)]
    assert covered == [(i, i) for i in range(10)] + [(50, 7)]
    for r in runs:
        first, last = r.host * hb, (r.host + r.length) * hb - 1
        assert first // boundary == last // boundary or r.length == 1, f"{r} crosses a boundary"
    assert split_runs([Run(0, 0, 10)], hb, 0) == [Run(0, 0, 10)]


def test_batches_bound_bytes_and_keep_order() -> None:
    copies = [Copy2D(i, 1, i, 1, 10, 1) for i in range(25)]
    out = list(batches(iter(copies), 30))
    assert [len(b) for b in out] == [3] * 8 + [1]
    assert [c for b in out for c in b] == copies
    assert list(batches(iter([]), 30)) == []


KIB = 1 << 10
BOTH = Engines(dma=True, kernel=True)
RULE = MethodRule(dma_min_bytes=256 * KIB, staging_below=64 * KIB)


def shape(total: int, calls: int, rows: int) -> SwapShape:
    return SwapShape(total_bytes=total, dma_calls=calls, dma_rows=rows)


def test_auto_takes_dma_for_long_rows_and_the_kernel_for_small_pieces() -> None:
    big_rows = shape(64 << 20, 64, 64)  # 1 MiB rows: a vLLM packed block, or long contiguous runs
    small_rows = shape(128 * 256 * KIB, 128, 128 * 64)  # 4 KiB pieces, 128 scattered blocks
    assert choose_method("auto", big_rows, BOTH, RULE) == "dma"
    assert choose_method("auto", small_rows, BOTH, RULE) == "kernel"
    # The threshold is on the average row, whatever the number of calls.
    assert choose_method("auto", shape(256 * KIB * 10, 1, 10), BOTH, RULE) == "dma"
    assert choose_method("auto", shape(256 * KIB * 10 - 1, 1, 10), BOTH, RULE) == "kernel"


def test_auto_without_triton_keeps_the_dma_and_staging_rule() -> None:
    no_kernel = Engines(dma=True, kernel=False)
    assert choose_method("auto", shape(10 * 256 * KIB, 10, 10 * 64), no_kernel, RULE) == "dma"  # 256 KiB a call
    assert choose_method("auto", shape(1000 * 16 * KIB, 1000, 1000), no_kernel, RULE) == "staging"
    assert choose_method("auto", shape(1 << 30, 1, 1), Engines(dma=False, kernel=False), RULE) == "staging"


@pytest.mark.parametrize(
    ("setting", "engines", "expected"),
    [
        ("dma", BOTH, "dma"),
        ("staging", BOTH, "staging"),
        ("kernel", BOTH, "kernel"),
        ("kernel", Engines(dma=True, kernel=False), "staging"),  # no Triton: staging with torch index ops
        ("dma", Engines(dma=False, kernel=True), "staging"),  # no 2D memcpy binding
    ],
)
def test_fixed_methods_and_their_fallbacks(setting: str, engines: Engines, expected: str) -> None:
    assert choose_method(setting, shape(1 << 20, 4, 4), engines, RULE) == expected
    assert available(setting, engines) == expected


@pytest.mark.parametrize("placement", ["one_buffer", "separate", "descending", "padded"])
@pytest.mark.parametrize("pattern", ["contiguous", "scattered", "mixed"])
def test_dma_rows_count_the_contiguous_rows_the_plan_moves(placement: str, pattern: str) -> None:
    fx = Fixture(LAYOUT, placement, seed=3)
    device_ids, host_ids = id_pattern(pattern, 12, seed=1)
    runs = split_runs(coalesce(device_ids, host_ids), LAYOUT.host_block_bytes, 0)
    copies = plan_dma(True, runs, fx.geometry())
    rows = sum(1 if c.height == 1 or (c.dpitch == c.width and c.spitch == c.width) else c.height for c in copies)
    assert dma_rows(runs, fx.geometry()) == rows


def test_a_packed_single_tensor_cache_moves_whole_blocks_per_row() -> None:
    """vLLM's block-outermost layouts hand one tensor whose block is every layer's page."""
    packed = KVLayout(num_layers=1, num_blocks=24, block_size=1, num_kv_heads=1, head_dim=4096, dtype="uint8",
                      kv_tensors=1)  # fmt: skip
    geo = Fixture(packed, "one_buffer", seed=1).geometry()
    assert dma_rows([Run(0, 0, 5), Run(9, 7, 1)], geo) == 2


def test_plan_staging_batches_and_host_runs() -> None:
    out = plan_staging([5, 6, 7, 1, 2], [10, 11, 12, 3, 30], max_blocks=3, host_block_bytes=8, boundary=0)
    assert [b.device_ids for b in out] == [[5, 6, 7], [1, 2]]
    assert out[0].host_runs == [Run(0, 10, 3)] and out[1].host_runs == [Run(0, 3, 1), Run(1, 30, 1)]


def test_element_size() -> None:
    assert element_size([64, 4096, 128]) == 8
    assert element_size([12, 4096]) == 4
    assert element_size([6, 4096]) == 2
    assert element_size([3, 4096]) == 1


# The staging path on CPU tensors ----------------------------------------------------------


def _stager(fx: Fixture) -> Stager:
    tensors = [DeviceTensor(t.untyped_storage(), t.data_ptr() - t.untyped_storage().data_ptr()) for t in fx.tensors]
    host = fx.host.view(HOST_BLOCKS, fx.layout.num_tensors, fx.layout.chunk_bytes)
    return Stager(fx.layout, tensors, host, torch.device("cpu"))


def test_storage_groups_split_at_storages() -> None:
    fx = Fixture(LAYOUT, "padded", seed=3)
    tensors = [DeviceTensor(t.untyped_storage(), t.data_ptr() - t.untyped_storage().data_ptr()) for t in fx.tensors]
    assert [(f, c) for f, c, _ in storage_groups(tensors)] == [(0, 2), (2, 2), (4, 2)]


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
@pytest.mark.parametrize("placement", ["one_buffer", "separate", "descending", "padded"])
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_staging_moves_exact_bytes(dtype: str, placement: str, to_host: bool) -> None:
    layout = KVLayout(num_layers=2, num_blocks=24, block_size=3, num_kv_heads=1, head_dim=10 // DTYPE_BYTES[dtype] or 1,
                      dtype=dtype)  # fmt: skip
    fx = Fixture(layout, placement, seed=DTYPE_BYTES[dtype])
    device_ids, host_ids = id_pattern("scattered", 14, seed=9)
    before = fx.snapshot()
    stager = _stager(fx)
    move = stager.to_host if to_host else stager.to_device
    for batch in plan_staging(device_ids, host_ids, 4, layout.host_block_bytes, 3 * layout.host_block_bytes):
        move(batch)
    check_swap(fx, to_host, device_ids, host_ids, before)


def test_staging_uses_wide_words_when_sizes_allow() -> None:
    assert _stager(Fixture(LAYOUT, "one_buffer", seed=1)).elem == 8  # 32-byte chunks
    odd = KVLayout(num_layers=1, num_blocks=8, block_size=3, num_kv_heads=1, head_dim=3, dtype="uint8")
    assert _stager(Fixture(odd, "separate", seed=1)).elem == 1


# The completion waiter --------------------------------------------------------------------


class FakeEvent:
    def __init__(self, error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.error = error

    def synchronize(self) -> None:
        assert self.release.wait(10), "event never completed"
        if self.error is not None:
            raise self.error


def _future_for(waiter: EventWaiter, event: FakeEvent, on_done: Callable[[], None] | None = None) -> Any:
    """What a swap does: the waiter thread runs the in-flight accounting, then settles the
    loop's future."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def finish(error: BaseException | None) -> None:
        if on_done is not None:
            on_done()
        settle_threadsafe(loop, future, error)

    waiter.submit(event, finish)
    return future


def test_event_waiter_resolves_in_order_off_the_loop() -> None:
    waiter = EventWaiter("test-wait")
    done: list[int] = []

    async def scenario() -> None:
        first, second, broken = FakeEvent(), FakeEvent(), FakeEvent(RuntimeError("illegal address"))
        f1 = _future_for(waiter, first, lambda: done.append(1))
        f2 = _future_for(waiter, second, lambda: done.append(2))
        f3 = _future_for(waiter, broken)
        await asyncio.sleep(0.02)
        assert not f1.done() and not f2.done(), "resolved before the event completed"
        second.release.set()
        first.release.set()
        broken.release.set()
        await asyncio.wait_for(asyncio.gather(f1, f2), 5)
        with pytest.raises(RuntimeError, match="illegal address"):
            await asyncio.wait_for(f3, 5)

    try:
        asyncio.run(scenario())
    finally:
        waiter.close()
    assert done == [1, 2]


def test_event_waiter_runs_on_done_even_if_the_caller_gave_up() -> None:
    waiter = EventWaiter("test-wait")
    finished = threading.Event()
    event = FakeEvent()

    async def scenario() -> None:
        future = _future_for(waiter, event, finished.set)
        future.cancel()

    try:
        asyncio.run(scenario())
        event.release.set()
        assert finished.wait(5), "in-flight accounting must not depend on the awaiting task"
    finally:
        waiter.close()


@pytest.mark.parametrize("seed", range(20))
def test_run_lengths_are_the_lengths_of_coalesced_runs(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([0, 1, 2, rng.randrange(3, 256), rng.randrange(256, 2000)])  # both ways of counting
    device = [rng.choice([i, i, rng.randrange(10_000)]) for i in range(n)]  # runs and jumps, repeats too
    host = [rng.choice([i, i, rng.randrange(10_000)]) for i in range(n)]
    assert run_lengths(device, host) == Counter(r.length for r in coalesce(device, host))
