"""The copy methods behind one interface, and the rule that picks one per unit of work.

A *unit* is what one lane issues at once on one stream: up to ``unit_blocks`` block pairs,
from one command or from many (a loop turn's ready swaps of one direction), ending in one
doorbell write. ``CopyMethod.issue`` enqueues a unit's copies on a stream and returns at
once. It runs on the event loop's thread, so it allocates nothing the GPU sees: the ids go
into a slot of the lane's pinned id ring (numpy writes), one async copy takes them to the
device ring, and the kernel reads them there.

- ``ZeroCopy`` ("kernel"): ids upload + one piece-kernel launch between the device blocks
  and the pinned pool.
- ``Staged`` ("staging"): ids upload + a gather launch into a device staging slot + one
  batched DMA call with one descriptor per contiguous host run (swap-in: the DMA first,
  then a scatter launch). Needs a staging slot besides the id slot.
- ``Dma`` ("dma"): one 2D memcpy per (run, tensor group) (copy_plan.iter_dma); no ids on
  the device.

The ring slots stay the unit's until the lane saw its doorbell: the GPU reads them when the
work runs, not when it is issued.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..plan import coalesce
from .copy_plan import (
    DmaGeometry,
    Engines,
    MethodRule,
    SwapShape,
    available,
    calls_for_lengths,
    choose_method,
    host_runs,
    iter_dma,
    rows_for_lengths,
    run_lengths,
    split_runs,
)
from .driver import WORD_BYTES, DeviceBuffer, Driver, HostBuffer, KernelLaunch
from .pieces import grid_size


@dataclass(frozen=True)
class RingShape:
    slots: int  # id slots per lane: units in flight at most
    pairs: int  # block pairs per slot
    staging_slots: int
    staging_bytes: int  # bytes per staging slot

    @property
    def slot_words(self) -> int:
        """[base, device ids, linear ids, host ids], rounded to 16 bytes (the kernel's ids
        pointer was specialised on that alignment)."""
        words = 1 + 3 * self.pairs
        return words + words % 2


class LaneMemory:
    """A lane's rings, allocated at attach: the pinned id ring and its device twin, the
    staging slots, the descriptor arrays of staged units."""

    def __init__(self, driver: Driver, shape: RingShape, staging: bool) -> None:
        self.shape = shape
        words = shape.slot_words
        self.host: HostBuffer = driver.host_buffer(shape.slots * words * WORD_BYTES)
        self.device: DeviceBuffer = driver.device_buffer(shape.slots * words * WORD_BYTES)
        ids = self.host.ids[: shape.slots * words].reshape(shape.slots, words)
        self.rows = [ids[s] for s in range(shape.slots)]  # made once: a numpy view per slot
        self.ring = self.host.words.data.cast("B")  # struct packs ids straight into it
        self.offsets = [s * words * WORD_BYTES for s in range(shape.slots)]
        self._packers: dict[int, Callable[..., None]] = {}
        self.host_slots = [self.host.address + s * words * WORD_BYTES for s in range(shape.slots)]
        self.device_slots = [self.device.address + s * words * WORD_BYTES for s in range(shape.slots)]
        count = shape.staging_slots if staging else 0
        self.staging: list[DeviceBuffer] = [driver.device_buffer(shape.staging_bytes) for _ in range(count)]
        self.descriptors = np.zeros((count, 3, max(1, shape.pairs)), dtype=np.uint64)

    def packer(self, words: int) -> Callable[..., None]:
        """``pack(ring, offset, *ints)``: writes ``words`` int64 into the ring in one C call
        (a numpy slice assignment from a list costs several times more)."""
        pack = self._packers.get(words)
        if pack is None:
            pack = self._packers[words] = struct.Struct(f"<{words}q").pack_into
        return pack


class CopyMethod(Protocol):
    name: str
    needs_staging: bool

    def issue(self, slot: int, staging: int, dev: Sequence[int], host: Sequence[int], stream: int) -> None: ...


class ZeroCopy:
    name = "kernel"
    needs_staging = False

    def __init__(self, driver: Driver, memory: LaneMemory, launch: KernelLaunch, pool: int, programs: int) -> None:
        self.driver, self.memory, self.launch, self.pool = driver, memory, launch, pool
        self.programs = grid_size(1 << 62, programs)  # a launch of fewer pieces gets one program each

    def issue(self, slot: int, staging: int, dev: Sequence[int], host: Sequence[int], stream: int) -> None:
        n, memory = len(dev), self.memory
        memory.packer(1 + 2 * n)(memory.ring, memory.offsets[slot], self.pool, *dev, *host)
        ids, pieces = memory.device_slots[slot], n * self.launch.tensors
        self.driver.memcpy_async(ids, memory.host_slots[slot], (1 + 2 * n) * WORD_BYTES, stream)
        self.driver.launch(self.launch, ids, n, self.programs if pieces >= self.programs else pieces, stream)


class Staged:
    name = "staging"
    needs_staging = True

    def __init__(
        self, driver: Driver, memory: LaneMemory, launch: KernelLaunch, pool: int, programs: int,
        host_block_bytes: int, boundary: int,
    ) -> None:  # fmt: skip
        self.driver, self.memory, self.launch, self.pool, self.programs = driver, memory, launch, pool, programs
        self.host_block_bytes, self.boundary = host_block_bytes, boundary

    def issue(self, slot: int, staging: int, dev: Sequence[int], host: Sequence[int], stream: int) -> None:
        n, memory, hb = len(dev), self.memory, self.host_block_bytes
        base = memory.staging[staging].address
        # [staging base, device ids, staging rows 0..n-1, host ids (read here only)]
        memory.packer(1 + 3 * n)(memory.ring, memory.offsets[slot], base, *dev, *range(n), *host)
        host_ids = memory.rows[slot][1 + 2 * n : 1 + 3 * n]
        starts, lengths = host_runs(host_ids, hb, self.boundary)
        count = len(starts)
        pool_side, staging_side, sizes = memory.descriptors[staging]
        pool_side[:count] = self.pool + host_ids[starts] * hb
        staging_side[:count] = base + starts * hb
        sizes[:count] = lengths * hb
        ids = memory.device_slots[slot]
        driver, grid = self.driver, grid_size(n * self.launch.tensors, self.programs)
        driver.memcpy_async(ids, memory.host_slots[slot], (1 + 2 * n) * WORD_BYTES, stream)
        if self.launch.to_linear:  # gather, then the copy engines take the rows to the host
            driver.launch(self.launch, ids, n, grid, stream)
            driver.memcpy_batch_async(pool_side, staging_side, sizes, count, stream)
        else:
            driver.memcpy_batch_async(staging_side, pool_side, sizes, count, stream)
            driver.launch(self.launch, ids, n, grid, stream)


class Dma:
    name = "dma"
    needs_staging = False

    def __init__(self, driver: Driver, geo: DmaGeometry, to_host: bool, boundary: int) -> None:
        self.driver, self.geo, self.to_host, self.boundary = driver, geo, to_host, boundary

    def issue(self, slot: int, staging: int, dev: Sequence[int], host: Sequence[int], stream: int) -> None:
        runs = split_runs(coalesce(dev, host), self.geo.host_block_bytes, self.boundary)
        copy = self.driver.memcpy2d_async
        for c in iter_dma(self.to_host, runs, self.geo):
            copy(c, stream)


class MethodChooser:
    """Picks a unit's method (copy_plan.choose_method). The shape ``auto`` looks at depends
    on the ids only where DMA rows can grow with runs of consecutive blocks (a cache of one
    tensor); everywhere else the answer is fixed per attach and worked out here once."""

    def __init__(self, setting: str, engines: Engines, rule: MethodRule, geo: DmaGeometry) -> None:
        self.setting, self.engines, self.rule, self.geo = setting, engines, rule, geo
        scattered = self._dma_wins(run_lengths([0], [0]), 1)
        long_run = self._dma_wins({4096: 1}, 4096)
        self._static: bool | None = scattered if scattered == long_run else None

    def _dma_wins(self, lengths: dict[int, int], blocks: int) -> bool:
        shape = SwapShape(blocks * self.geo.host_block_bytes, calls_for_lengths(lengths, self.geo),
                          rows_for_lengths(lengths, self.geo))  # fmt: skip
        return choose_method("auto", shape, self.engines, self.rule, False) == "dma"

    def early(self, other_busy: bool) -> str | None:
        """The method, when the ids cannot change it (else None: ask ``late``)."""
        if self.setting != "auto":
            return available(self.setting, self.engines)
        if self._static is None:
            return None
        if self._static:
            return "dma"
        return available(self.rule.duplex if other_busy else "kernel", self.engines)

    def late(self, dev: Sequence[int], host: Sequence[int], other_busy: bool) -> str:
        lengths = run_lengths(dev, host)
        shape = SwapShape(len(dev) * self.geo.host_block_bytes, calls_for_lengths(lengths, self.geo),
                          rows_for_lengths(lengths, self.geo))  # fmt: skip
        return choose_method(self.setting, shape, self.engines, self.rule, other_busy)
