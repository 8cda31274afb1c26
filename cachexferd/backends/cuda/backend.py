"""The cuda backend: pinned host pool, CUDA IPC attach, copies issued from the event loop.

Imported only when the backend is selected (``cuda``, or ``auto`` with a GPU visible); the
cpu path never imports this package. docs/cuda.md describes the design; in short:

- Host pool: pool.PinnedHostPool (mmap, first touched and registered in chunks by several
  threads, NUMA-bound).
- Attach: ipc.py (msgpack handles -> torch's IPC import on the daemon's device, found by
  UUID). Detach: close() drops every imported storage; torch closes the IPC mappings and
  releases the runner's ref counters as they die.
- Copies: device_cache.CudaDeviceCache over the driver seam (cudart.CudaDriver here): per
  direction a lane that issues a loop turn's swaps as units from the event loop's thread and
  settles them from doorbell words the streams write (lanes.py); methods.py holds the copy
  methods (zero-copy kernel, staged kernel + batched DMA, 2D DMA).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...cuda_tensors import check_runner_tensors
from ...host_cache import HostGeometry, HostPool
from ...protocol import KVLayout
from ...security import Requester
from ..base import AttachError, Backend, DeviceCache
from . import kernel
from .cudart import CudaDriver
from .device_cache import CopySettings, CudaDeviceCache
from .ipc import (
    DeviceTensor,
    ImportWatch,
    TorchStorageOps,
    decode_handles,
    from_tensors,
    import_handles,
    resolve_device,
    visible_uuids,
)
from .memcpy import Memcpy, load_memcpy
from .pool import CudartRegistrar, PinnedHostPool, pci_numa_node

if TYPE_CHECKING:
    from ...config import Config, CudaConfig

log = logging.getLogger(__name__)


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, config: CudaConfig, rank: int) -> None:
        self.config = config
        self.pools: list[PinnedHostPool] = []
        self._driver: CudaDriver | None = None
        self._driver_lock = threading.Lock()
        self._open_device(rank)
        log.info(
            "cuda backend on device %d (%s, %s), memcpy via %s",
            self.device_index, self.device_name, self.device_uuid, self.memcpy.name if self.memcpy else "none",
        )  # fmt: skip

    def _open_device(self, rank: int) -> None:
        """The device probe: which GPU this daemon serves, and the binding it copies with."""
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
    def driver(self) -> CudaDriver:
        """Made on first use (at the first attach, off the event loop): the CUDA context and
        Triton's import take seconds, kept off the daemon's start-up path."""
        with self._driver_lock:
            if self._driver is None:
                runners = None
                if self.config.copy_method != "dma" and self.zero_copy:
                    loaded = kernel.load()
                    runners = kernel.KernelRunners(loaded, self.device_index) if loaded is not None else None
                self._driver = CudaDriver(self.device_index, self.memcpy, runners)
            return self._driver

    def settings(self, pool: HostPool) -> CopySettings:
        c = self.config
        boundary = pool.pinner.spans[0][1] if isinstance(pool, PinnedHostPool) else 0
        return CopySettings(copy_method=c.copy_method, dma_min_bytes=c.dma_min_bytes, batch_bytes=c.batch_bytes,
                            programs_d2h=c.kernel_programs_d2h, programs_h2d=c.kernel_programs_h2d,
                            max_pitch=self.max_pitch or 1 << 40, pin_boundary=boundary)  # fmt: skip

    def create_host_pool(self, capacity: int) -> HostPool:
        node = self._numa_node()
        workers = min(8, os.cpu_count() or 1)
        pool = PinnedHostPool(
            capacity, CudartRegistrar(self.device_index), self.config.pin_chunk, node, workers=workers
        )
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
        return self._device_cache(layout, tensors, pool, geometry, watch)

    def local_device_cache(
        self, layout: KVLayout, tensors: Sequence[torch.Tensor], pool: HostPool, geometry: HostGeometry
    ) -> CudaDeviceCache:
        """A DeviceCache over tensors of this process (benchmarks, tests): no IPC."""
        check_runner_tensors(layout, tensors)
        if tensors[0].device != self.device:
            raise ValueError(f"tensors are on {tensors[0].device}; this backend serves {self.device}")
        return self._device_cache(layout, from_tensors(tensors), pool, geometry, None)

    def _device_cache(
        self, layout: KVLayout, tensors: list[DeviceTensor], pool: HostPool, geometry: HostGeometry,
        watch: ImportWatch | None,
    ) -> CudaDeviceCache:  # fmt: skip
        held = list(tensors)  # keeps the imported storages (and their IPC mappings) until close

        def release() -> None:
            held.clear()
            torch.cuda.ipc_collect()
            if watch is not None and watch.open_handles():
                gc.collect()  # a reference cycle may still hold a storage
            if watch is not None and watch.open_handles():
                log.error("device cache closed but %d IPC imports are still referenced", watch.open_handles())

        with torch.cuda.device(self.device_index):
            return CudaDeviceCache(
                self.driver, layout, [t.address for t in tensors], pool, geometry, self.settings(pool),
                mappings=watch.open_handles if watch is not None else lambda: 0, on_close=release,
            )  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.device_index,
            "device_uuid": self.device_uuid,
            "device_name": self.device_name,
            "memcpy_api": self.memcpy.name if self.memcpy is not None else "none",
            "copy_method": self.config.copy_method,
            "kernel": self._kernel_state(),
            "driver": self._driver.describe() if self._driver is not None else "not made yet (first attach)",
            "pinning": [pool.describe_pinning() for pool in self.pools],
        }

    def _kernel_state(self) -> str:
        if self._driver is None:
            return "not loaded yet (first attach)"
        if self._driver.kernels is None:
            if self.config.copy_method == "dma":
                return "off"
            if not self.zero_copy:
                return "off: no device access to registered host memory"
            return f"unavailable: {kernel.unavailable_reason()}"
        return "triton"

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


def create(config: Config) -> CudaBackend:
    return CudaBackend(config.cuda, config.daemon.rank)
