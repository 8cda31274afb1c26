"""The cuda backend's piece kernel without a GPU: its launch planning (pure Python), and the
kernel itself under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors standing in
for device memory and the pinned host pool, with exact bytes and untouched blocks for every
dtype, both placements of K and V, contiguous and scattered ids, in both directions, zero-copy
and through a staging buffer."""

from __future__ import annotations

import asyncio
import importlib.util
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cachexferd.backends.base import CancelToken, Direction
from cachexferd.backends.cuda.device_cache import CopySettings, CudaDeviceCache
from cachexferd.backends.cuda.fake import FakeDriver, interpreted_launcher
from cachexferd.backends.cuda.pieces import (
    MAX_PROGRAMS,
    PieceGeometry,
    grid_size,
    kernel_launch,
    piece_addresses,
    program_pieces,
    vector_shape,
)
from cachexferd.host_cache import HostPool
from cachexferd.protocol import KVLayout

HOST_BLOCKS = 24


# Planning ---------------------------------------------------------------------------------


def geometry(tensors: int = 6, chunk: int = 256, base: int = 1 << 40) -> PieceGeometry:
    stride = 64 * chunk
    return PieceGeometry(tuple(base + t * stride for t in range(tensors)), chunk, chunk)


def test_kernel_launch_picks_the_widest_word() -> None:
    geo = geometry()
    launch = kernel_launch(geo, table=1 << 30, to_linear=True, linear_bases=[1 << 36], linear_stride=6 * 256)
    words = (launch.word_bytes, launch.chunk_words, launch.block_stride_words, launch.linear_stride_words)
    assert words == (8, 32, 32, 192)
    assert launch.to_linear and launch.tensors == 6 and launch.piece_bytes == 256
    odd = PieceGeometry((1 << 40, (1 << 40) + 999), 333, 333)
    assert kernel_launch(odd, 0, False, [0], 666).word_bytes == 1
    assert kernel_launch(geometry(chunk=6), 0, False, [2], 36).word_bytes == 2
    assert kernel_launch(geometry(), 0, True, [1 << 36, (1 << 36) + 4], 6 * 256).word_bytes == 4  # every base counts


def test_kernel_launch_refuses_a_linear_block_too_small() -> None:
    with pytest.raises(ValueError, match="every tensor's chunk"):
        kernel_launch(geometry(), 0, True, [0], 5 * 256)


def test_grid_is_the_setting_but_never_more_than_the_pieces() -> None:
    assert grid_size(pieces=64 * 128, programs=8) == 8
    assert grid_size(pieces=5, programs=32) == 5
    assert grid_size(pieces=10**9, programs=10**6) == MAX_PROGRAMS


@pytest.mark.parametrize(("chunk_words", "word", "expected"), [(1, 8, (1, 1)), (32, 8, (32, 1)), (512, 8, (512, 4)),
                                                               (100000, 8, (512, 4)), (4096, 1, (4096, 4)),
                                                               (3, 2, (4, 1))])  # fmt: skip
def test_vector_shape(chunk_words: int, word: int, expected: tuple[int, int]) -> None:
    assert vector_shape(chunk_words, word) == expected


def test_piece_addresses_follow_the_block_major_host_layout() -> None:
    layout = KVLayout(num_layers=3, num_blocks=64, block_size=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")
    geo = geometry(layout.num_tensors, layout.chunk_bytes)
    host_base = 1 << 36
    launch = kernel_launch(geo, 0, True, [host_base], layout.host_block_bytes)
    ids = [host_base, 7, 2, 40, 1, 11, 3]
    expected = [
        (geo.tensor_addrs[t] + d * layout.chunk_bytes, host_base + layout.host_chunk_offset(h, t))
        for d, h in zip([7, 2, 40], [1, 11, 3])
        for t in range(layout.num_tensors)
    ]
    assert piece_addresses(geo, launch, ids) == expected
    pieces = 3 * layout.num_tensors
    covered = sorted(p for g in range(4) for p in program_pieces(pieces, 4, g))
    assert covered == list(range(pieces)), "the persistent grid must move every piece exactly once"


# The kernel, interpreted ---------------------------------------------------------------------

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton, or the test extra)"
)


def interpreter_fault() -> str | None:
    """Why this Triton's interpreter cannot run a loop bounded by a kernel argument (Triton
    3.6's cannot: its arguments are 1-element arrays that refuse int()), or None. Compiled
    kernels are unaffected; on a GPU the cuda tests check the kernel's bytes instead."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def count_up(out, n):  # type: ignore[no-untyped-def]
        for i in range(0, n):
            tl.store(out + i, i)

    out = torch.zeros(3, dtype=torch.int64)
    try:
        count_up[(1,)](out, 3)
    except Exception as exc:
        return f"Triton {triton.__version__}'s interpreter: {type(exc).__name__}: {exc}"
    return None if out.tolist() == [0, 1, 2] else f"Triton {triton.__version__}'s interpreter: wrong result"


@pytest.fixture(scope="module")
def kernel() -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        from cachexferd.backends.cuda import kernel as cuda_kernel

        fault = interpreter_fault()
        if fault is not None:
            pytest.skip(f"cannot interpret the kernel here ({fault})")
        loaded = cuda_kernel.load()
        assert loaded is not None, cuda_kernel.unavailable_reason()
        yield loaded


# K and V as two tensors per layer, in one buffer or each its own allocation; or K and V
# together in one page per layer (vLLM's layouts: K|V within each page).
# (block_size, num_kv_heads, head_dim) per dtype, so the pieces move in words of every width:
# bf16 and fp8 e4m3 8 bytes (192- and 96-byte pieces), fp32 4 (12), fp16 2 (10), fp8 e5m2 1 (9).
WORD_SHAPES = {"bfloat16": (4, 2, 12), "float8_e4m3fn": (4, 2, 12), "float32": (1, 1, 3), "float16": (1, 1, 5),
               "float8_e5m2": (3, 1, 3)}  # fmt: skip
PLACEMENTS = {"kv_pairs-one_buffer": (2, True), "kv_pairs-per_tensor": (2, False), "kv_page-one_buffer": (1, True)}


class CpuCache:
    """Device tensors (CPU memory) in a placement, a host pool, and their byte snapshots."""

    def __init__(self, dtype: str, placement: str, seed: int) -> None:
        kv, one_buffer = PLACEMENTS[placement]
        block_size, heads, head_dim = WORD_SHAPES[dtype]
        self.layout = KVLayout(num_layers=3, num_blocks=20, block_size=block_size, num_kv_heads=heads,
                               head_dim=head_dim, dtype=dtype, kv_tensors=kv)  # fmt: skip
        n, tb, gen = self.layout.num_tensors, self.layout.tensor_bytes, torch.Generator().manual_seed(seed)
        if one_buffer:
            flat = torch.randint(0, 256, (n * tb,), dtype=torch.uint8, generator=gen)
            self.tensors = [flat[t * tb : (t + 1) * tb] for t in range(n)]
        else:
            self.tensors = [torch.randint(0, 256, (tb,), dtype=torch.uint8, generator=gen) for _ in range(n)]
        self.pool = HostPool(max(4096, HOST_BLOCKS * self.layout.host_block_bytes))
        self.host = self.pool.tensor[: HOST_BLOCKS * self.layout.host_block_bytes]
        self.host.copy_(torch.randint(0, 256, tuple(self.host.shape), dtype=torch.uint8, generator=gen))

    def device_cache(self, driver: FakeDriver, method: str) -> CudaDeviceCache:
        """Units of at most 3 blocks (so a swap of 7 spans several), small persistent grids."""
        hb = self.layout.host_block_bytes
        settings = CopySettings(copy_method=method, batch_bytes=3 * hb, staging_bytes=3 * hb, programs_d2h=3,
                                programs_h2d=5, pin_boundary=5 * hb)  # fmt: skip
        geometry = self.pool.geometry(hb)
        return CudaDeviceCache(driver, self.layout, [t.data_ptr() for t in self.tensors], self.pool, geometry, settings)

    def block(self, t: int, b: int, tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
        c = self.layout.chunk_bytes
        return (tensors or self.tensors)[t][b * c : (b + 1) * c]

    def chunk(self, t: int, h: int, host: torch.Tensor | None = None) -> torch.Tensor:
        off = self.layout.host_chunk_offset(h, t)
        return (self.host if host is None else host)[off : off + self.layout.chunk_bytes]

    def snapshot(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [t.clone() for t in self.tensors], self.host.clone()


def ids_for(pattern: str, layout: KVLayout) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(2, 9)), list(range(5, 12))
    rng = random.Random(7)
    return rng.sample(range(layout.num_blocks), 7), rng.sample(range(HOST_BLOCKS), 7)


def swap(cache: CudaDeviceCache, direction: Direction, dev: list[int], host: list[int]) -> None:
    async def run() -> None:
        await asyncio.wait_for(cache.swap(direction, dev, host, CancelToken()), 60)

    asyncio.run(run())


@needs_triton
@pytest.mark.parametrize("method", ["kernel", "staging"])
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
def test_kernel_moves_exact_bytes_and_nothing_else(kernel: Any, dtype: str, placement: str, pattern: str,
                                                   method: str) -> None:  # fmt: skip
    """The Triton kernel itself (interpreted), launched by the lanes through the fake driver:
    zero-copy, and staged (gather + batched copies of host runs, and the reverse)."""
    cache = CpuCache(dtype, placement, seed=len(dtype) + len(placement))
    driver = FakeDriver(inline=True, launcher=interpreted_launcher(kernel))
    device = cache.device_cache(driver, method)
    n = cache.layout.num_tensors
    dev, host = ids_for(pattern, cache.layout)
    tensors0, host0 = cache.snapshot()
    swap(device, Direction.D2H, dev, host)
    word = {"bfloat16": 8, "float8_e4m3fn": 8, "float32": 4, "float16": 2, "float8_e5m2": 1}[dtype]
    assert {launch.word_bytes for launch in device.launches.values()} == {word}
    for t in range(n):
        for d, h in zip(dev, host):
            assert torch.equal(cache.chunk(t, h), cache.block(t, d)), f"swap-out: tensor {t} block {d} -> host {h}"
    untouched_host = [h for h in range(HOST_BLOCKS) if h not in host]
    assert all(torch.equal(cache.chunk(t, h), cache.chunk(t, h, host0)) for h in untouched_host for t in range(n))
    assert all(torch.equal(a, b) for a, b in zip(cache.tensors, tensors0)), "swap-out wrote to the device"

    back = [b for b in range(cache.layout.num_blocks) if b not in dev][: len(dev)]
    tensors1, host1 = cache.snapshot()
    swap(device, Direction.H2D, back, host)
    for t in range(n):
        for b, d in zip(back, dev):
            assert torch.equal(cache.block(t, b), cache.block(t, d, tensors0)), f"swap-in: tensor {t} block {b}"
        for b in set(range(cache.layout.num_blocks)) - set(back):
            assert torch.equal(cache.block(t, b), cache.block(t, b, tensors1)), f"swap-in touched tensor {t} block {b}"
    assert torch.equal(cache.host, host1), "swap-in wrote to the host"
    assert device.methods[method] == 6, device.methods  # 7 blocks, 3 a unit: 3 units each way
    device.close()
