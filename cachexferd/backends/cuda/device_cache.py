"""An attached device cache of the cuda backend: two lanes (one per direction) over one
driver, their rings and streams allocated here, at attach, off the event loop.

It depends only on the driver seam and on plain addresses, so the same class runs on a GPU
(cudart.CudaDriver, tensors imported over CUDA IPC) and on CPU (fake.FakeDriver, CPU
tensors), which is how the tests drive it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...host_cache import HostGeometry, HostPool
from ...protocol import KVLayout
from ..base import AttachError, BatchedDeviceCache, Direction, SwapRequest
from .copy_plan import DmaGeometry, Engines, MethodRule
from .driver import Driver, DriverError, KernelLaunch
from .lanes import STAGES, Lane, LaneSettings
from .methods import CopyMethod, Dma, LaneMemory, MethodChooser, RingShape, Staged, ZeroCopy
from .pieces import PieceGeometry, kernel_launch
from .threads import Watcher

log = logging.getLogger(__name__)

_MAX_SLOT_PAIRS = 4096  # block pairs one id slot holds (a unit of tiny blocks stops there)


@dataclass(frozen=True)
class CopySettings:
    """How an attach copies (from the cuda settings; docs/cuda.md)."""

    copy_method: str = "auto"
    dma_min_bytes: int = 256 << 10
    batch_bytes: int = 64 << 20  # bytes per unit at most (the cancel checkpoint)
    programs_d2h: int = 8
    programs_h2d: int = 32
    staging_bytes: int = 16 << 20  # per staging slot; two per direction
    staging_slots: int = 2
    ring_slots: int = 8  # units in flight per direction at most
    streams_per_lane: int = 2
    events_per_lane: int = 8
    spin_us: int = 300
    stall_s: float = 5.0
    max_pitch: int = 1 << 40  # the device's cudaDevAttrMaxPitch
    pin_boundary: int = 0  # bytes of a pinning chunk: copies never cross a multiple of it


class CudaDeviceCache(BatchedDeviceCache):
    def __init__(
        self, driver: Driver, layout: KVLayout, tensor_addrs: Sequence[int], pool: HostPool, geometry: HostGeometry,
        settings: CopySettings, mappings: Callable[[], int] = lambda: 0, on_close: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        if geometry.block_bytes != layout.host_block_bytes:
            raise AttachError(f"host blocks are {geometry.block_bytes} bytes, layout needs {layout.host_block_bytes}")
        self.layout, self.driver, self.pool, self.settings = layout, driver, pool, settings
        self._mappings, self._on_close = mappings, on_close
        self.tensor_addrs = tuple(tensor_addrs)
        hb = layout.host_block_bytes
        self.dma_geometry = DmaGeometry(self.tensor_addrs, layout.chunk_bytes, pool.address, hb, settings.max_pitch)
        staged = driver.kernel and hb <= settings.staging_bytes
        unit_bytes = min(settings.batch_bytes, settings.staging_bytes) if staged else settings.batch_bytes
        unit_blocks = max(1, min(_MAX_SLOT_PAIRS, unit_bytes // hb))
        shape = RingShape(settings.ring_slots, unit_blocks, settings.staging_slots, settings.staging_bytes)
        self.memory = {d: LaneMemory(driver, shape, staged) for d in Direction}
        self.table = driver.device_buffer(8 * len(self.tensor_addrs))
        driver.upload(self.table.address, np.array(self.tensor_addrs, dtype=np.int64))
        self.launches = self._prepare_kernel(staged)
        self.engines = Engines(
            dma=driver.dma, kernel=bool(self.launches), staging=bool(self.launches) and staged
        )  # fmt: skip
        if not (self.engines.dma or self.engines.kernel):
            raise AttachError("the cuda backend has no way to copy here (no DMA binding and no copy kernel)")
        self.watcher = Watcher(driver)
        lane_settings = LaneSettings(unit_blocks, spin_ns=settings.spin_us * 1000, stall_ns=int(settings.stall_s * 1e9))
        self.lanes = {d: self._lane(d, lane_settings) for d in Direction}
        self._d2h, self._h2d = self.lanes[Direction.D2H], self.lanes[Direction.H2D]  # no enum hashing per swap
        self._d2h.other, self._h2d.other = self._h2d, self._d2h

    def _prepare_kernel(self, staged: bool) -> dict[tuple[Direction, str], KernelLaunch]:
        """The kernel's launches for this attach (zero-copy and staged, each direction),
        compiled and checked now; none where the driver has no kernel or a check fails."""
        if not self.driver.kernel:
            return {}
        geo = PieceGeometry(self.tensor_addrs, self.layout.chunk_bytes, self.layout.chunk_bytes)
        hb, launches = self.layout.host_block_bytes, {}
        for direction in Direction:
            to_host = direction is Direction.D2H
            launches[direction, "kernel"] = kernel_launch(geo, self.table.address, to_host, [self.pool.address], hb)
            if staged:
                bases = [b.address for b in self.memory[direction].staging]
                launches[direction, "staging"] = kernel_launch(geo, self.table.address, to_host, bases, hb)
        try:
            for launch in dict.fromkeys(launches.values()):
                self.driver.prepare_kernel(launch)
        except DriverError as exc:
            log.warning("the copy kernel does not run here (%s): copying with DMA only", exc)
            return {}
        return launches

    def _lane(self, direction: Direction, lane_settings: LaneSettings) -> Lane:
        driver, s, memory = self.driver, self.settings, self.memory[direction]
        to_host = direction is Direction.D2H
        methods: dict[str, CopyMethod] = {}
        programs = s.programs_d2h if to_host else s.programs_h2d
        if self.engines.kernel:
            methods["kernel"] = ZeroCopy(
                driver, memory, self.launches[direction, "kernel"], self.pool.address, programs
            )
        if self.engines.staging:
            launch = self.launches[direction, "staging"]
            programs = max(s.programs_d2h, s.programs_h2d)  # device-to-device: the larger grid, still small
            methods["staging"] = Staged(driver, memory, launch, self.pool.address, programs,
                                        self.layout.host_block_bytes, s.pin_boundary)  # fmt: skip
        if self.engines.dma:
            methods["dma"] = Dma(driver, self.dma_geometry, to_host, s.pin_boundary)
        chooser = MethodChooser(s.copy_method, self.engines, MethodRule(s.dma_min_bytes), self.dma_geometry)
        streams = [driver.new_stream() for _ in range(s.streams_per_lane)]
        doorbells = driver.host_buffer(8 * 8 * len(streams))
        events = [driver.new_event() for _ in range(s.events_per_lane)]
        return Lane(direction, driver, memory, methods, chooser, streams, doorbells, events, self.watcher,
                    lane_settings, self.layout.host_block_bytes)  # fmt: skip

    @property
    def mappings(self) -> int:
        return self._mappings()

    @property
    def methods(self) -> dict[str, int]:
        """Units issued by method, both directions together (describe, tests)."""
        out: dict[str, int] = {}
        for lane in self.lanes.values():
            for name, count in lane.by_method.items():
                out[name] = out.get(name, 0) + count
        return out

    async def swap_many(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        pool = self.pool
        if pool.ready_bytes < pool.capacity:  # still pinning: wait until the blocks used are pinned
            end = max((max(r.host_ids) + 1 for r in requests if r.host_ids), default=0) * self.layout.host_block_bytes
            if end > pool.ready_bytes:
                await pool.wait_ready_async(end)  # type: ignore[attr-defined]
        return await (self._d2h if direction is Direction.D2H else self._h2d).submit(requests)

    def close(self) -> None:
        """Releases the attach. Runs off the loop in the daemon (after its drain), on the
        loop in tests: either way, units still in flight are waited for first."""
        for lane in self.lanes.values():
            lane.closed = True
            if lane.in_flight and not lane.wait_idle(self.settings.stall_s):
                log.error("closing the device cache with %s copies still running", lane.direction.value)
            self._settle_later(lane)
        self.watcher.close()
        for lane in self.lanes.values():
            for stream in lane.streams:
                self.driver.close_stream(stream.handle)
            for event in lane.events:
                self.driver.close_event(event)
        self.memory.clear()
        self.launches = {}
        if self._on_close is not None:
            self._on_close()

    @staticmethod
    def _settle_later(lane: Lane) -> None:
        loop = lane.loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.call_soon(lane.finish_closed)
        else:
            loop.call_soon_threadsafe(lane.finish_closed)

    def reset_stages(self) -> None:
        for lane in self.lanes.values():
            lane.stages[:] = 0

    def stage_summary(self) -> dict[str, float]:
        """Median µs from each stage of a unit to the next, both directions together."""
        rows = np.concatenate([lane.stages[lane.stages[:, 1] > 0] for lane in self.lanes.values()])
        if not len(rows):
            return {}
        spans = np.diff(rows, axis=1) / 1e3
        return {
            f"{STAGES[i]}_to_{STAGES[i + 1]}": round(float(np.median(spans[:, i])), 1) for i in range(len(STAGES) - 1)
        }

    def describe(self) -> dict[str, Any]:
        engines = [name for name in ("kernel", "staging", "dma") if getattr(self.engines, name)]
        return {**super().describe(), "tensors": len(self.tensor_addrs), "engines": engines,
                "units_by_method": self.methods,
                "lanes": {d.value: lane.describe() for d, lane in self.lanes.items()}}  # fmt: skip
