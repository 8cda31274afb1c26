"""Copy planning for the cuda backend: which method moves a unit of work
(``choose_method``), which DMA calls move it, and the host runs of a staged unit.

Pure Python and numpy on plain addresses (no torch, no CUDA), so the CPU tests can execute
a plan with memmove and check every byte.

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

Kernel ("kernel"): the piece kernel (cuda/pieces.py, cuda/kernel.py) moves pieces straight
between device blocks and the pinned host pool (zero-copy), one launch per unit.

Staging ("staging"): the piece kernel gathers the blocks into a block-major staging buffer
on the device, then one batched DMA call moves every contiguous host run (one descriptor
per run, a whole host block or more each); swap-in is the reverse. The copy engines carry
the PCIe transfer, so it shares the link well with the other direction's work.

Runs never cross a pinning-chunk boundary of the host pool: each chunk is its own
cudaHostRegister range, and a copy that spans two ranges may be treated as pageable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..plan import Run, even_groups
from .driver import Copy2D

METHODS = ("auto", "dma", "staging", "kernel")


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
    """What this attach can copy with."""

    dma: bool  # a 2D memcpy binding (cuda-python or ctypes)
    kernel: bool  # the piece kernel (Triton, and device access to the pinned pool)
    staging: bool  # the kernel, a staging ring on the device, and blocks that fit a staging slot


@dataclass(frozen=True)
class MethodRule:
    """The ``auto`` rule's threshold (setting cuda.dma_min_bytes) and its duplex choice."""

    dma_min_bytes: int = 256 << 10
    # While the other direction has work, small pieces go through the copy engines: two
    # zero-copy kernels at once reached 52-59 GB/s together on an H100 PCIe Gen5, a gather
    # kernel plus one DMA per direction 70-83 GB/s (docs/cuda.md, "Both directions").
    duplex: str = "staging"


_FALLBACKS = {"dma": ("dma", "kernel", "staging"), "kernel": ("kernel", "staging", "dma"),
              "staging": ("staging", "kernel", "dma")}  # fmt: skip


def available(method: str, engines: Engines) -> str:
    """``method`` where this attach has it, else the nearest one it has."""
    have = {"dma": engines.dma, "kernel": engines.kernel, "staging": engines.staging}
    for candidate in _FALLBACKS[method]:
        if have[candidate]:
            return candidate
    raise ValueError("no copy method is available (neither a DMA binding nor the copy kernel)")


def choose_method(setting: str, shape: SwapShape, engines: Engines, rule: MethodRule, other_busy: bool) -> str:
    """'dma', 'staging' or 'kernel' for one unit of work (docs/cuda.md, "Copy methods").

    ``auto``:
    1. DMA when its rows average at least ``dma_min_bytes`` (large contiguous runs: the
       copy engines reach the link's speed without using an SM);
    2. else, while the other direction has work, ``rule.duplex`` (staging: the copy engines
       carry this direction's PCIe traffic);
    3. else the zero-copy kernel (90-95% of the link one way from 16 blocks on).
    """
    if setting != "auto":
        return available(setting, engines)
    if engines.dma and shape.row_bytes >= rule.dma_min_bytes:
        return "dma"
    if other_busy:
        return available(rule.duplex, engines)
    return available("kernel", engines)


def host_runs(
    host_ids: np.ndarray[Any, Any], host_block_bytes: int, boundary: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(first index, length) of each run of consecutive host ids, cut where the run would
    cross a multiple of ``boundary`` bytes (a pinning chunk): a staged unit's descriptors."""
    steps = np.diff(host_ids) != 1
    if boundary > 0:
        steps |= np.diff((host_ids * host_block_bytes) // boundary) != 0
    starts = np.flatnonzero(np.concatenate(([True], steps)))
    return starts, np.diff(np.append(starts, len(host_ids)))


def element_size(values: Sequence[int]) -> int:
    """Widest of 8/4/2/1 bytes dividing every value: the kernel then moves 8-byte words instead
    of single bytes."""
    for size in (8, 4, 2):
        if all(v % size == 0 for v in values):
            return size
    return 1
