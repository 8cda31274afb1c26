"""Copy planning for the cuda backend: which method moves a swap (``choose_method``), which
DMA calls move it, or how it is staged.

Pure Python on plain addresses (no torch, no CUDA), so the CPU tests can execute a plan
with memmove and check every byte.

Direct DMA ("dma"): device tensors with evenly spaced addresses form a *group*. For one
coalesced run of ``length`` blocks and one group of ``count`` tensors, the host side is
block-major (tensor chunks adjacent inside a block, blocks ``host_block_bytes`` apart) and
each device tensor is block-contiguous, so one cudaMemcpy2DAsync moves either
- one tensor's run: ``length`` rows of ``chunk`` bytes (device pitch chunk, host pitch
  host_block_bytes), ``count`` calls per run; or
- one block of every tensor in the group: ``count`` rows of ``chunk`` bytes (device pitch
  the group's tensor stride, host pitch chunk), ``length`` calls per run;
whichever needs fewer calls. A runner that allocates its cache as one buffer (CudaKVCache
does) is one group, so a scattered single block costs one call.

Staging ("staging"): gather the blocks on the device into a block-major staging buffer
(one launch of the piece kernel over all layers, or without Triton one index kernel per
group), then move whole host runs with plain copies; swap-in is the reverse. The copy
engines carry the PCIe transfer, so it runs at full speed beside the other direction.

Kernel ("kernel"): the piece kernel (cuda_pieces.py, cuda_kernel.py) moves pieces straight
between device blocks and the pinned host pool (zero-copy), one launch per swap.

Runs never cross a pinning-chunk boundary of the host pool: each chunk is its own
cudaHostRegister range, and a copy that spans two ranges may be treated as pageable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .plan import Run, even_groups

METHODS = ("auto", "dma", "staging", "kernel")


@dataclass(frozen=True)
class Copy2D:
    """``height`` rows of ``width`` bytes; rows ``dpitch`` / ``spitch`` bytes apart."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int

    @property
    def nbytes(self) -> int:
        return self.width * self.height


@dataclass(frozen=True)
class DmaGeometry:
    tensor_addrs: tuple[int, ...]  # device address of block 0 of each tensor
    chunk: int  # bytes of one block of one tensor
    host_base: int  # address of host block 0
    host_block_bytes: int
    max_pitch: int  # the device's cudaDevAttrMaxPitch
    # even_groups(tensor_addrs), worked out once: every plan walks them for every run.
    groups: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(even_groups(self.tensor_addrs)))


def split_runs(runs: Sequence[Run], host_block_bytes: int, boundary: int) -> list[Run]:
    """Cuts runs so that no run's host bytes cross a multiple of ``boundary`` (block
    granularity: a block that itself straddles a boundary stays whole)."""
    if boundary <= 0:
        return list(runs)
    out: list[Run] = []
    for run in runs:
        d, h, left = run.device, run.host, run.length
        while left:
            next_edge = (h * host_block_bytes // boundary + 1) * boundary
            fits = max(1, (next_edge - h * host_block_bytes) // host_block_bytes)
            take = min(left, fits)
            out.append(Run(d, h, take))
            d, h, left = d + take, h + take, left - take
    return out


def _rows(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, max_pitch: int) -> Iterator[Copy2D]:
    if height == 1 or (dpitch == width and spitch == width):
        yield Copy2D(dst, width * height, src, width * height, width * height, 1)
    elif max(dpitch, spitch) <= max_pitch:
        yield Copy2D(dst, dpitch, src, spitch, width, height)
    else:  # a pitch the DMA engine cannot take: row by row
        for row in range(height):
            yield Copy2D(dst + row * dpitch, width, src + row * spitch, width, width, 1)


def iter_dma(to_host: bool, runs: Sequence[Run], geo: DmaGeometry) -> Iterator[Copy2D]:
    """The DMA calls that move ``runs`` (device -> host when ``to_host``), lazily: a big
    scattered swap can need millions and they are issued batch by batch."""
    chunk, hb = geo.chunk, geo.host_block_bytes
    for run in runs:
        for first, count, stride in geo.groups:
            dev0 = geo.tensor_addrs[first] + run.device * chunk
            host0 = geo.host_base + run.host * hb + first * chunk
            if count <= run.length or stride > geo.max_pitch:
                shapes = [(dev0 + k * stride, chunk, host0 + k * chunk, hb, run.length) for k in range(count)]
            else:
                shapes = [(dev0 + b * chunk, stride, host0 + b * hb, chunk, count) for b in range(run.length)]
            for dev, dev_pitch, host, host_pitch, height in shapes:
                if to_host:
                    yield from _rows(host, host_pitch, dev, dev_pitch, chunk, height, geo.max_pitch)
                else:
                    yield from _rows(dev, dev_pitch, host, host_pitch, chunk, height, geo.max_pitch)


def plan_dma(to_host: bool, runs: Sequence[Run], geo: DmaGeometry) -> list[Copy2D]:
    return list(iter_dma(to_host, runs, geo))


def dma_rows(runs: Sequence[Run], geo: DmaGeometry) -> int:
    """How many contiguous rows the DMA engines move for iter_dma's calls (a 2D call of
    height h whose rows are not adjacent on both sides is h rows): the bytes per row decide
    how close to the link's speed DMA gets."""
    return rows_for_lengths(Counter(r.length for r in runs), geo)


def dma_calls(runs: Sequence[Run], geo: DmaGeometry) -> int:
    """How many calls iter_dma issues, without building them (pitch splits not counted)."""
    return calls_for_lengths(Counter(r.length for r in runs), geo)


def rows_for_lengths(lengths: Mapping[int, int], geo: DmaGeometry) -> int:
    """dma_rows for runs given as {length: number of runs of that length}."""
    total = 0
    for length, runs in lengths.items():
        for _, count, stride in geo.groups:
            if count <= length or stride > geo.max_pitch:  # one call per tensor of the group
                rows = count * (1 if length == 1 or geo.host_block_bytes == geo.chunk else length)
            else:  # one call per block
                rows = length * (1 if count == 1 or stride == geo.chunk else count)
            total += rows * runs
    return total


def calls_for_lengths(lengths: Mapping[int, int], geo: DmaGeometry) -> int:
    """dma_calls for runs given as {length: number of runs of that length}."""
    total = 0
    for length, runs in lengths.items():
        for _, count, stride in geo.groups:
            total += runs * (count if count <= length or stride > geo.max_pitch else length)
    return total


_NUMPY_FROM = 256  # ids per swap from which numpy finds the runs faster than a loop


def run_lengths(device_ids: Sequence[int], host_ids: Sequence[int]) -> dict[int, int]:
    """{length: number of runs} of coalesce()'s runs, without building them: the auto rule
    needs no more, and a swap of a thousand scattered blocks must plan in far less time
    than it moves."""
    n = len(device_ids)
    if n < _NUMPY_FROM:
        counts: Counter[int] = Counter()
        length = 1
        for i in range(1, n):
            if device_ids[i] == device_ids[i - 1] + 1 and host_ids[i] == host_ids[i - 1] + 1:
                length += 1
            else:
                counts[length] += 1
                length = 1
        if n:
            counts[length] += 1
        return dict(counts)
    d, h = np.asarray(device_ids, np.int64), np.asarray(host_ids, np.int64)
    breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(h) != 1)) + 1
    values, runs = np.unique(np.diff(np.concatenate(([0], breaks, [n]))), return_counts=True)
    return dict(zip(values.tolist(), runs.tolist()))


def batches(copies: Iterable[Copy2D], batch_bytes: int) -> Iterator[list[Copy2D]]:
    """Consecutive slices of about ``batch_bytes`` each: the unit of cancellation and of the
    issuer's look-ahead."""
    batch: list[Copy2D] = []
    size = 0
    for copy in copies:
        batch.append(copy)
        size += copy.nbytes
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


@dataclass(frozen=True)
class StagingBatch:
    """Blocks moved through the staging buffer in one go: row ``i`` of the buffer holds
    ``device_ids[i]``; ``host_runs`` are Runs of (staging row, host block, length)."""

    device_ids: list[int]
    host_runs: list[Run]


def plan_staging(
    device_ids: Sequence[int], host_ids: Sequence[int], max_blocks: int, host_block_bytes: int, boundary: int
) -> list[StagingBatch]:
    out = []
    step = max(1, max_blocks)
    for start in range(0, len(device_ids), step):
        hosts = host_ids[start : start + step]
        runs: list[Run] = []
        for row, h in enumerate(hosts):
            last = runs[-1] if runs else None
            if last is not None and last.host + last.length == h:
                runs[-1] = Run(last.device, last.host, last.length + 1)
            else:
                runs.append(Run(row, h, 1))
        out.append(StagingBatch(list(device_ids[start : start + step]), split_runs(runs, host_block_bytes, boundary)))
    return out


@dataclass(frozen=True)
class SwapShape:
    """What the ``auto`` rule looks at, for one swap in one direction."""

    total_bytes: int
    dma_calls: int  # calls the dma method would issue
    dma_rows: int  # contiguous rows those calls move

    @property
    def row_bytes(self) -> int:
        """Average contiguous bytes per DMA row."""
        return self.total_bytes // max(1, self.dma_rows)


@dataclass(frozen=True)
class Engines:
    """What this backend can copy with."""

    dma: bool  # a 2D memcpy binding (cuda-python or ctypes)
    kernel: bool  # the piece kernel (Triton, and device access to the pinned pool)


@dataclass(frozen=True)
class MethodRule:
    """The ``auto`` rule's thresholds (settings cuda.dma_min_bytes and cuda.staging_below)."""

    dma_min_bytes: int = 256 << 10
    staging_below: int = 64 << 10


def available(method: str, engines: Engines) -> str:
    """``method`` where this backend has it, else what stands in for it: staging (which
    needs neither Triton nor a 2D binding: it falls back to torch's index ops)."""
    if method == "kernel" and not engines.kernel:
        return "staging"
    if method == "dma" and not engines.dma:
        return "staging"
    return method


def choose_method(setting: str, shape: SwapShape, engines: Engines, rule: MethodRule) -> str:
    """'dma', 'staging' or 'kernel' for one swap (docs/cuda.md, "Copy methods").

    ``auto``:
    1. DMA when its rows average at least ``dma_min_bytes`` (large contiguous runs: the
       copy engines reach the link's speed without using an SM);
    2. else the zero-copy kernel, also while the other direction runs (two kernels share
       the link less well than two DMA streams would, but measured on an H100 they still
       beat staging, whose one DMA per scattered host block costs more than it saves);
    3. else (no Triton): staging (torch index ops) when DMA would average fewer than
       ``staging_below`` bytes per call, else DMA.
    """
    if setting != "auto":
        return available(setting, engines)
    if engines.dma and shape.row_bytes >= rule.dma_min_bytes:
        return "dma"
    if engines.kernel:
        return "kernel"
    if not engines.dma or shape.total_bytes < rule.staging_below * max(1, shape.dma_calls):
        return "staging"
    return "dma"


def element_size(values: Sequence[int]) -> int:
    """Widest of 8/4/2/1 bytes dividing every value: staging kernels then move 8-byte words
    instead of single bytes."""
    for size in (8, 4, 2):
        if all(v % size == 0 for v in values):
            return size
    return 1
