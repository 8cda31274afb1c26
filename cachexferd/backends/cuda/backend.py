"""The cuda backend: pinned host pool, CUDA IPC attach, one stream per direction.

Imported only when the backend is selected (``cuda``, or ``auto`` with a GPU visible); the
cpu path never imports this module. docs/cuda.md describes the design; in short:

- Host pool: cuda_pool.PinnedHostPool (mmap, registered in chunks on a thread, NUMA-bound).
- Attach: cuda_ipc (msgpack handles -> torch's IPC import on the daemon's device, found by
  UUID). Detach: close() drops every imported storage; torch closes the IPC mappings and
  releases the runner's ref counters as they die.
- Copies: each direction is a Lane (its own stream, an issuer thread that enqueues the
  copies, a waiter thread that waits for the completion event). The event loop only awaits
  futures; it never synchronises. Method per swap (cuda_copy.choose_method): direct 2D DMA,
  device staging (the piece kernel or torch index ops, plus DMA), or the zero-copy piece
  kernel (cuda_kernel.py, Triton, loaded at the first attach).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..client.cuda_runner import check_runner_tensors
from ..host_cache import HostGeometry, HostPool
from ..protocol import KVLayout
from ..security import Requester
from . import cuda_kernel
from .base import AttachError, Backend, CancelToken, DeviceCache, Direction
from .cuda_copy import (
    Copy2D,
    DmaGeometry,
    Engines,
    MethodRule,
    StagingBatch,
    SwapShape,
    available,
    batches,
    calls_for_lengths,
    choose_method,
    iter_dma,
    plan_staging,
    rows_for_lengths,
    run_lengths,
    split_runs,
)
from .cuda_ipc import ImportWatch, TorchStorageOps, decode_handles, import_handles, resolve_device, visible_uuids
from .cuda_kernel import Grid, PieceMover
from .cuda_pieces import PieceGeometry, split_pairs
from .cuda_pool import CudartRegistrar, PinnedHostPool, pci_numa_node
from .cuda_runtime import EventWaiter, Memcpy, load_memcpy, settle_threadsafe
from .cuda_stage import DeviceTensor, Stager, from_tensors
from .plan import coalesce

if TYPE_CHECKING:
    from ..config import Config, CudaConfig

log = logging.getLogger(__name__)

_LOOKAHEAD = 2  # batches enqueued beyond the oldest unfinished one (bounds cancel latency)


@dataclass
class Issued:
    event: torch.cuda.Event | None  # completes after everything this swap enqueued
    error: BaseException | None  # why issuing stopped early (cancel, CUDA error)


class Lane:
    """One direction: its stream, the thread that enqueues copies on it, and the thread
    that waits for their completion. Both directions run at once on separate lanes."""

    def __init__(self, direction: Direction, device_index: int, memcpy: Memcpy | None) -> None:
        self.direction = direction
        self.device_index = device_index
        self.memcpy = memcpy
        self.stream = torch.cuda.Stream(device=device_index)
        self.handle = int(self.stream.cuda_stream)
        self.issuer = ThreadPoolExecutor(1, thread_name_prefix=f"cx-{direction.value}-issue", initializer=self._bind)
        self.waiter = EventWaiter(f"cx-{direction.value}-wait")

    def _bind(self) -> None:
        torch.cuda.set_device(self.device_index)
        if self.memcpy is not None:
            self.memcpy.bind_device(self.device_index)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(blocking=True)  # waits sleep instead of spinning a core
        event.record(self.stream)
        return event

    def close(self) -> None:
        self.issuer.shutdown(wait=True)
        self.waiter.close()


def _enqueue_copies(memcpy: Memcpy, copies: list[Copy2D], stream: int) -> None:
    for copy in copies:
        memcpy.copy(copy, stream)


class CudaDeviceCache(DeviceCache):
    def __init__(
        self,
        backend: CudaBackend,
        layout: KVLayout,
        tensors: list[DeviceTensor],
        pool: HostPool,
        geometry: HostGeometry,
        watch: ImportWatch | None,
    ) -> None:
        if geometry.block_bytes != layout.host_block_bytes:
            raise AttachError(f"host blocks are {geometry.block_bytes} bytes, layout needs {layout.host_block_bytes}")
        self.layout = layout
        self.backend = backend
        self.pool = pool
        self.tensors = tensors
        self._watch = watch
        self.geometry = DmaGeometry(
            tuple(t.address for t in tensors), layout.chunk_bytes, pool.address, layout.host_block_bytes,
            backend.max_pitch,
        )  # fmt: skip
        self.stager: Stager | None = Stager(layout, tensors, pool.blocks(geometry, layout.num_tensors), backend.device)
        self.mover = self._mover(backend, layout, pool)
        self.engines = Engines(dma=backend.memcpy is not None, kernel=self.mover is not None and backend.zero_copy)
        self.pin_boundary = pool.pinner.spans[0][1] if isinstance(pool, PinnedHostPool) else 0
        self.methods: dict[str, int] = {"dma": 0, "staging": 0, "kernel": 0}  # swaps by method, for describe()
        self.lanes = backend.lanes  # created here, off the event loop (attach runs in an executor)
        self._inflight = {d: 0 for d in Direction}  # swaps per direction (close() waits for them)
        self._inflight_lock = threading.Lock()

    def _mover(self, backend: CudaBackend, layout: KVLayout, pool: HostPool) -> PieceMover | None:
        kernel = backend.kernel
        if kernel is None or backend.config.copy_method == "dma":
            return None
        geo = PieceGeometry(tuple(t.address for t in self.tensors), layout.chunk_bytes, layout.chunk_bytes)
        mover = PieceMover(kernel, geo, pool.tensor, layout.host_block_bytes, backend.device, backend.grid)
        try:
            with torch.cuda.device(backend.device_index):
                mover.warm_up()
        except Exception as exc:
            log.warning("the copy kernel does not run here (%s: %s): copying without it", type(exc).__name__, exc)
            return None
        return mover

    @property
    def _busy(self) -> int:
        return sum(self._inflight.values())

    @property
    def mappings(self) -> int:
        return self._watch.open_handles() if self._watch is not None else 0

    async def swap(
        self, direction: Direction, device_ids: Sequence[int], host_ids: Sequence[int], cancel: CancelToken
    ) -> int:
        if not device_ids:
            return 0
        end = (max(host_ids) + 1) * self.layout.host_block_bytes
        if self.pool.ready_bytes < end and isinstance(self.pool, PinnedHostPool):
            await self.pool.wait_ready_async(end)  # documented choice: wait for pinning
        cancel.check()
        lane = self.lanes[direction]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._track(direction, +1)
        try:
            lane.issuer.submit(self._issue_then_wait, lane, direction, device_ids, host_ids, cancel, loop, done)
        except BaseException:  # the lane was closed
            self._track(direction, -1)
            raise
        await done
        return len(device_ids) * self.layout.host_block_bytes

    def _issue_then_wait(
        self,
        lane: Lane,
        direction: Direction,
        device_ids: Sequence[int],
        host_ids: Sequence[int],
        cancel: CancelToken,
        loop: asyncio.AbstractEventLoop,
        done: asyncio.Future[None],
    ) -> None:
        """On the issuer thread: enqueue the swap, then hand its event straight to the
        lane's waiter (no trip through the event loop in between: a small swap's latency is
        mostly such hand-offs). ``done`` is settled once the GPU finished, with the error
        that stopped the swap, if any, and the swap leaves the in-flight count first."""
        try:
            issued = self._issue(lane, direction is Direction.D2H, device_ids, host_ids, cancel)
        except BaseException as exc:  # _issue catches what issuing raises; this is a bug
            issued = Issued(None, exc)

        def finish(error: BaseException | None) -> None:
            self._track(direction, -1)
            settle_threadsafe(loop, done, issued.error or error)

        if issued.event is None:
            finish(None)
        else:
            lane.waiter.submit(issued.event, finish)

    def _track(self, direction: Direction, delta: int) -> None:
        with self._inflight_lock:
            self._inflight[direction] += delta

    def _issue(
        self, lane: Lane, to_host: bool, device_ids: Sequence[int], host_ids: Sequence[int], cancel: CancelToken
    ) -> Issued:
        """Runs on the lane's issuer thread: enqueue batch after batch, never more than
        _LOOKAHEAD ahead of the GPU, checking the cancel token between batches."""
        pending: deque[torch.cuda.Event] = deque()
        error: BaseException | None = None
        try:
            with torch.cuda.stream(lane.stream):
                for step in self._steps(lane, to_host, device_ids, host_ids):
                    cancel.check()
                    step()
                    pending.append(lane.record())
                    if len(pending) > _LOOKAHEAD:
                        pending.popleft().synchronize()
        except Exception as exc:
            error = exc
        if not pending:
            return Issued(None, error)
        if error is None:  # the last step's event already follows everything enqueued
            return Issued(pending[-1], None)
        try:
            return Issued(lane.record(), error)
        except Exception as exc:  # the context is broken; wait here so nothing stays in flight
            lane.stream.synchronize()
            return Issued(None, error or exc)

    def _steps(
        self, lane: Lane, to_host: bool, device_ids: Sequence[int], host_ids: Sequence[int]
    ) -> Iterator[Callable[[], None]]:
        hb, cfg = self.layout.host_block_bytes, self.backend.config
        method = self.method_for(device_ids, host_ids)
        self.methods[method] += 1
        if method == "dma" and lane.memcpy is not None:
            runs = split_runs(coalesce(device_ids, host_ids), hb, self.pin_boundary)
            for batch in batches(iter_dma(to_host, runs, self.geometry), cfg.batch_bytes):
                yield partial(_enqueue_copies, lane.memcpy, batch, lane.handle)
            return
        mover = self.mover
        if method == "kernel" and mover is not None:
            for part in split_pairs(len(device_ids), hb, cfg.batch_bytes):
                yield partial(
                    mover.direct, to_host, device_ids[part.start : part.stop], host_ids[part.start : part.stop]
                )
            return
        move = self._staged_move(to_host)
        for staged in plan_staging(device_ids, host_ids, max(1, cfg.batch_bytes // hb), hb, self.pin_boundary):
            yield partial(move, staged)

    def method_for(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> str:
        """The copy method for one swap (cuda_copy.choose_method with this cache's shape).
        The shape is worked out only for ``auto``, from the runs' lengths (numpy): planning a
        swap of a thousand scattered blocks must cost far less than moving it."""
        cfg = self.backend.config
        if cfg.copy_method != "auto":
            return available(cfg.copy_method, self.engines)
        dma = self.engines.dma
        lengths = run_lengths(device_ids, host_ids) if dma else None
        shape = SwapShape(
            total_bytes=len(device_ids) * self.layout.host_block_bytes,
            dma_calls=calls_for_lengths(lengths, self.geometry) if lengths is not None else 0,
            dma_rows=rows_for_lengths(lengths, self.geometry) if lengths is not None else 0,
        )
        return choose_method(cfg.copy_method, shape, self.engines, self.backend.rule)

    def _staged_move(self, to_host: bool) -> Callable[[StagingBatch], None]:
        """Staging through the piece kernel where there is one, else torch's index ops."""
        if self.mover is not None:
            return self.mover.gather if to_host else self.mover.scatter
        stager = self.stager
        assert stager is not None, "swap after close"
        return stager.to_host if to_host else stager.to_device

    def close(self) -> None:
        if self._busy:
            # The daemon drains swaps before close(); if one is still running, its copies
            # must finish before the memory goes back, even at the price of a wait here.
            log.error("closing the device cache with %d swaps in flight: waiting for their copies", self._busy)
            for lane in self.lanes.values():
                lane.stream.synchronize()
        self.stager = None
        self.mover = None
        self.tensors = []
        torch.cuda.ipc_collect()
        if self.mappings:
            gc.collect()  # a reference cycle may still hold a storage
        if self.mappings:
            log.error("device cache closed but %d IPC imports are still referenced", self.mappings)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tensors": len(self.tensors), "swaps_by_method": dict(self.methods)}


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, config: CudaConfig, rank: int) -> None:
        self.config = config
        self.pools: list[PinnedHostPool] = []
        self._lanes: dict[Direction, Lane] | None = None
        self._lanes_lock = threading.Lock()
        self._kernel: Callable[..., Any] | bool | None = False  # False: not loaded yet
        self.grid = Grid(config.kernel_programs_d2h, config.kernel_programs_h2d)
        self.rule = MethodRule(config.dma_min_bytes, config.staging_below)
        self._open_device(rank)
        log.info(
            "cuda backend on device %d (%s, %s), memcpy via %s",
            self.device_index, self.device_name, self.device_uuid, self.memcpy.name if self.memcpy else "torch",
        )  # fmt: skip

    def _open_device(self, rank: int) -> None:
        """The device probe: which GPU this daemon serves, and the bindings it copies with."""
        if not torch.cuda.is_available():
            raise RuntimeError("cuda backend: torch sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)")
        self.uuids = visible_uuids()
        self.device_index = resolve_device(self.config.device, rank, self.uuids)
        self.device_uuid = self.uuids[self.device_index]
        self.device = torch.device("cuda", self.device_index)
        self.device_name = torch.cuda.get_device_name(self.device_index)
        self.memcpy: Memcpy | None = load_memcpy(self.config.memcpy_api)
        self.max_pitch = self.memcpy.max_pitch(self.device_index) if self.memcpy is not None else 0
        # Zero-copy kernels address the pinned pool by its host pointer: the device must allow
        # that for registered memory (every GPU since Pascal on 64-bit Linux does; asked where
        # a binding can ask, assumed otherwise).
        self.zero_copy = self.memcpy.host_pointer_usable(self.device_index) if self.memcpy is not None else True

    @property
    def kernel(self) -> Callable[..., Any] | None:
        """The piece kernel, loaded (Triton imported) on first use: at the first attach, off
        the event loop. None where Triton is missing or ``copy_method = "dma"``."""
        with self._lanes_lock:
            if self._kernel is False:
                self._kernel = None if self.config.copy_method == "dma" else cuda_kernel.load()
            return self._kernel if callable(self._kernel) else None

    @property
    def lanes(self) -> dict[Direction, Lane]:
        """Created on first use: streams need the CUDA context, whose creation (a second or
        more) is kept off the daemon's start-up path."""
        with self._lanes_lock:
            if self._lanes is None:
                self._lanes = {d: Lane(d, self.device_index, self.memcpy) for d in Direction}
            return self._lanes

    def create_host_pool(self, capacity: int) -> HostPool:
        node = self._numa_node()
        pool = PinnedHostPool(capacity, CudartRegistrar(self.device_index), self.config.pin_chunk, node)
        self.pools.append(pool)
        return pool

    def _numa_node(self) -> int | None:
        if self.config.numa_node >= 0:
            return self.config.numa_node
        if not Path("/sys/devices/system/node/node1").exists():
            return None  # one node: nothing to choose
        bus_id = self._pci_bus_id()
        return pci_numa_node(bus_id) if bus_id else None

    def _pci_bus_id(self) -> str | None:
        props = torch.cuda.get_device_properties(self.device_index)
        ids = [getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
        if all(type(i) is int for i in ids):  # torch builds that expose them
            return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
        try:
            return self.memcpy.pci_bus_id(self.device_index) if self.memcpy is not None else None
        except RuntimeError as exc:
            log.warning("cannot read the GPU's PCI bus id (%s): no NUMA binding", exc)
            return None

    def import_device_cache(
        self, layout: KVLayout, device: dict[str, Any], pool: HostPool, geometry: HostGeometry, requester: Requester
    ) -> DeviceCache:
        # CUDA IPC handles are produced by the process that owns the memory (no file to
        # check against the requester). Decoding needs no GPU: a malformed map is refused
        # (BAD_FIELD) before any device work.
        decode_handles(device)
        try:
            with torch.cuda.device(self.device_index):
                storages, refs, opened = import_handles(
                    device, layout, self.device_uuid, self.device_index, TorchStorageOps()
                )
                # The import queued a wait for the producer's last write on this thread's
                # current stream; the cache is usable once that has passed.
                torch.cuda.current_stream(self.device_index).synchronize()
        except RuntimeError as exc:  # torch's import failed (dead runner, foreign handle)
            raise AttachError(f"cannot import the CUDA IPC handles: {exc}") from None
        tensors = [DeviceTensor(opened[r.storage], r.offset) for r in refs]
        watch = ImportWatch(storages, opened, StorageWeakRef)
        return CudaDeviceCache(self, layout, tensors, pool, geometry, watch)

    def local_device_cache(
        self, layout: KVLayout, tensors: Sequence[torch.Tensor], pool: HostPool, geometry: HostGeometry
    ) -> CudaDeviceCache:
        """A DeviceCache over tensors of this process (benchmarks, tests): no IPC."""
        check_runner_tensors(layout, tensors)
        if tensors[0].device != self.device:
            raise ValueError(f"tensors are on {tensors[0].device}; this backend serves {self.device}")
        return CudaDeviceCache(self, layout, from_tensors(tensors), pool, geometry, None)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device_index,
            "device_uuid": self.device_uuid,
            "device_name": self.device_name,
            "memcpy_api": self.memcpy.name if self.memcpy is not None else "torch",
            "copy_method": self.config.copy_method,
            "kernel": self._kernel_state(),
            "pinning": [pool.describe_pinning() for pool in self.pools],
        }

    def _kernel_state(self) -> str:
        if self._kernel is False:
            return "not loaded yet (first attach)"
        if self._kernel is None:
            return "off" if self.config.copy_method == "dma" else f"unavailable: {cuda_kernel.unavailable_reason()}"
        return "triton" + ("" if self.zero_copy else " (staging only: no device access to registered host memory)")

    def close(self) -> None:
        if self._lanes is not None:
            for lane in self._lanes.values():
                lane.close()
        for pool in self.pools:
            pool.close()


def create(config: Config) -> CudaBackend:
    return CudaBackend(config.cuda, config.daemon.rank)
