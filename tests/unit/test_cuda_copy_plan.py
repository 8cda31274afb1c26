"""The cuda backend's copy plans, executed on CPU memory: every DMA call of a plan is run
with memmove row by row. Exact bytes and untouched blocks, as on the GPU. The method rule
and the host runs of a staged unit."""

from __future__ import annotations

import ctypes
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from cachexferd.backends.cuda.copy_plan import (
    DmaGeometry,
    Engines,
    MethodRule,
    SwapShape,
    available,
    choose_method,
    dma_calls,
    dma_rows,
    element_size,
    host_runs,
    plan_dma,
    run_lengths,
    split_runs,
)
from cachexferd.backends.cuda.driver import Copy2D
from cachexferd.backends.plan import Run, coalesce, even_groups
from cachexferd.protocol import KVLayout

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


KIB = 1 << 10
ALL = Engines(dma=True, kernel=True, staging=True)
RULE = MethodRule(dma_min_bytes=256 * KIB)


def shape(total: int, calls: int, rows: int) -> SwapShape:
    return SwapShape(total_bytes=total, dma_calls=calls, dma_rows=rows)


def test_auto_takes_dma_for_long_rows_and_the_kernel_for_small_pieces() -> None:
    big_rows = shape(64 << 20, 64, 64)  # 1 MiB rows: a vLLM packed block, or long contiguous runs
    small_rows = shape(128 * 256 * KIB, 128, 128 * 64)  # 4 KiB pieces, 128 scattered blocks
    assert choose_method("auto", big_rows, ALL, RULE, other_busy=False) == "dma"
    assert choose_method("auto", small_rows, ALL, RULE, other_busy=False) == "kernel"
    # The threshold is on the average row, whatever the number of calls.
    assert choose_method("auto", shape(256 * KIB * 10, 1, 10), ALL, RULE, other_busy=False) == "dma"
    assert choose_method("auto", shape(256 * KIB * 10 - 1, 1, 10), ALL, RULE, other_busy=False) == "kernel"


def test_auto_goes_through_the_copy_engines_while_the_other_direction_runs() -> None:
    small_rows = shape(128 * 256 * KIB, 128, 128 * 64)
    assert choose_method("auto", small_rows, ALL, RULE, other_busy=True) == "staging"
    assert choose_method("auto", shape(64 << 20, 64, 64), ALL, RULE, other_busy=True) == "dma"  # long rows: DMA
    kernel_only = Engines(dma=True, kernel=True, staging=False)  # blocks larger than a staging slot
    assert choose_method("auto", small_rows, kernel_only, RULE, other_busy=True) == "kernel"
    as_before = MethodRule(dma_min_bytes=256 * KIB, duplex="kernel")
    assert choose_method("auto", small_rows, ALL, as_before, other_busy=True) == "kernel"


def test_auto_without_triton_copies_with_dma() -> None:
    no_kernel = Engines(dma=True, kernel=False, staging=False)
    assert choose_method("auto", shape(1000 * 16 * KIB, 1000, 1000), no_kernel, RULE, other_busy=False) == "dma"
    assert choose_method("auto", shape(1000 * 16 * KIB, 1000, 1000), no_kernel, RULE, other_busy=True) == "dma"
    with pytest.raises(ValueError, match="no copy method"):
        available("dma", Engines(dma=False, kernel=False, staging=False))


@pytest.mark.parametrize(
    ("setting", "engines", "expected"),
    [
        ("dma", ALL, "dma"),
        ("staging", ALL, "staging"),
        ("kernel", ALL, "kernel"),
        ("kernel", Engines(dma=True, kernel=False, staging=False), "dma"),  # no Triton
        ("staging", Engines(dma=True, kernel=True, staging=False), "kernel"),  # blocks too large to stage
        ("dma", Engines(dma=False, kernel=True, staging=True), "kernel"),  # no 2D memcpy binding
    ],
)
def test_fixed_methods_and_their_fallbacks(setting: str, engines: Engines, expected: str) -> None:
    assert choose_method(setting, shape(1 << 20, 4, 4), engines, RULE, other_busy=False) == expected
    assert choose_method(setting, shape(1 << 20, 4, 4), engines, RULE, other_busy=True) == expected
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


def test_host_runs_of_a_staged_unit_are_cut_at_pinning_chunks() -> None:
    host = np.array([10, 11, 12, 3, 30, 31, 32, 33], dtype=np.int64)
    starts, lengths = host_runs(host, host_block_bytes=8, boundary=0)
    assert starts.tolist() == [0, 3, 4] and lengths.tolist() == [3, 1, 4]
    starts, lengths = host_runs(host, host_block_bytes=8, boundary=8 * 32)  # a chunk ends after block 31
    assert starts.tolist() == [0, 3, 4, 6] and lengths.tolist() == [3, 1, 2, 2]
    one = host_runs(np.array([7], dtype=np.int64), 8, 0)
    assert one[0].tolist() == [0] and one[1].tolist() == [1]


def test_element_size() -> None:
    assert element_size([64, 4096, 128]) == 8
    assert element_size([12, 4096]) == 4
    assert element_size([6, 4096]) == 2
    assert element_size([3, 4096]) == 1


@pytest.mark.parametrize("seed", range(20))
def test_run_lengths_are_the_lengths_of_coalesced_runs(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice([0, 1, 2, rng.randrange(3, 256), rng.randrange(256, 2000)])  # both ways of counting
    device = [rng.choice([i, i, rng.randrange(10_000)]) for i in range(n)]  # runs and jumps, repeats too
    host = [rng.choice([i, i, rng.randrange(10_000)]) for i in range(n)]
    assert run_lengths(device, host) == Counter(r.length for r in coalesce(device, host))
