"""The pinned host pool of the cuda backend: the block-major HostPool, registered with CUDA
chunk by chunk on a background thread.

Why chunks on a thread: registering (page-locking) hundreds of GiB takes minutes, and the
daemon must answer hello/status/ping from its first second. The pool's ``ready_bytes``
is the prefix registered so far; status and metrics report it.

The choice for swaps that touch the unpinned tail: they *wait* (asynchronously, on the
event loop, never blocking it) until the pinner has passed their last host byte. Copying
from pageable memory instead would make the DMA synchronous and slow, and would race the
registration of the very pages being copied. Pinning walks the pool from offset 0, and
engines hand out low host ids first, so waits are short in practice.

If registration fails (RLIMIT_MEMLOCK, no memory), the pool stops pinning, logs the error,
reports it in status, and serves the rest unpinned (correct, slower): ``ready_bytes``
jumps to the capacity while ``pinned`` stays false.

Pinned MAP_PRIVATE pages must not become copy-on-write in a forked child (the GPU would
keep the parent's old page), so the mapping is marked MADV_DONTFORK. The pages are bound
to the GPU's NUMA node (mbind, preferred policy) before the first touch, which is the
registration itself.

Nothing here imports torch at module import time; the scheduling logic is tested on CPU
with a fake registrar.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ...host_cache import HostPool
from .threads import start_threads

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every context, not only the caller's
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: kernels may address it (zero-copy copy kernel)
_MPOL_PREFERRED = 1
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


class Registrar(Protocol):
    """Page-locks host ranges for DMA; raises RuntimeError on failure."""

    def register(self, address: int, size: int) -> None: ...

    def unregister(self, address: int) -> None: ...


def chunk_spans(capacity: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, size) steps covering [0, capacity); sizes are whole pages except the last."""
    step = max(PAGE, -(-chunk // PAGE) * PAGE)
    return [(off, min(step, capacity - off)) for off in range(0, capacity, step)]


class _Waiter:
    __slots__ = ("end", "future", "loop")

    def __init__(self, end: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
        self.end, self.loop, self.future = end, loop, future


class ChunkPinner:
    """Registers [address, address + capacity) in chunks on ``workers`` threads.

    Each worker claims the next chunk, first touches it (``touch``: the kernel faults its
    pages in, which is most of the time registration takes, and which several threads do in
    parallel) and registers it. Chunks finish in any order; the usable prefix
    (``pinned_bytes``) grows as the lowest ones finish.

    Thread-safety: ``_state`` guards the progress fields and the waiter list; it is held
    only briefly (the event loop takes it), never across a touch or a cudaHostRegister
    call. A chunk is claimed under ``_state`` (``_claimed``: the end of the last chunk
    claimed), so discard_tail() can give back pages beyond every claimed chunk without a
    race.
    """

    def __init__(
        self,
        address: int,
        capacity: int,
        chunk: int,
        registrar: Registrar,
        on_progress: Callable[[int, int], None] | None = None,
        workers: int = 1,
        touch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.address, self.capacity = address, capacity
        self.spans = chunk_spans(capacity, chunk)
        self.registrar = registrar
        self.on_progress = on_progress
        self.workers = max(1, min(workers, len(self.spans)))
        self.touch = touch
        self._state = threading.Lock()
        self._changed = threading.Condition(self._state)
        self._registered: list[tuple[int, int]] = []
        self._waiters: list[_Waiter] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next = 0  # index of the next chunk to claim
        self._finished: set[int] = set()  # chunks registered beyond the prefix
        self._prefix = 0  # chunks 0.._prefix-1 are registered
        self._running = 0  # workers still working
        self._claimed = 0  # end of the last chunk claimed
        self.pinned_bytes = 0  # registered prefix
        self.ready_bytes = 0  # usable prefix: pinned_bytes, or capacity after a failure
        self.error: str | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._running = self.workers
        self._threads = start_threads(self.workers, self._work, "cx-pin")

    def _claim(self) -> int | None:
        with self._state:
            if self._stop.is_set() or self.error is not None or self._next >= len(self.spans):
                return None
            index, self._next = self._next, self._next + 1
            offset, size = self.spans[index]
            self._claimed = max(self._claimed, offset + size)
            return index

    def _work(self) -> None:
        while (index := self._claim()) is not None:
            offset, size = self.spans[index]
            try:
                if self.touch is not None:
                    self.touch(self.address + offset, size)
                self.registrar.register(self.address + offset, size)
            except Exception as exc:
                if not self._stop.is_set():
                    self._fail(offset, exc)
                break
            self._chunk_done(index)
        with self._state:
            self._running -= 1
            last = self._running == 0
            if last:  # from now on, only registered pages are off limits to discard_tail()
                self._claimed = max((offset + size for offset, size in self._registered), default=0)
        if last:
            self.finished_at = time.monotonic()
            log.info("host pool: %s", self.describe())

    def _chunk_done(self, index: int) -> None:
        with self._state:
            self._registered.append(self.spans[index])
            self._finished.add(index)
            while self._prefix in self._finished:
                self._finished.discard(self._prefix)
                self._prefix += 1
            end = self.spans[self._prefix - 1][0] + self.spans[self._prefix - 1][1] if self._prefix else 0
            grew = end > self.pinned_bytes and self.error is None
        if grew:
            self._advance(end, end)

    def _fail(self, offset: int, exc: Exception) -> None:
        with self._state:
            self.error = f"{type(exc).__name__}: {exc}"
        log.error(
            "host pool: pinning stopped at byte %d of %d (%s); serving the rest unpinned (slower copies)",
            offset, self.capacity, self.error,
        )  # fmt: skip
        self._advance(self.pinned_bytes, self.capacity)

    def _advance(self, pinned: int, ready: int) -> None:
        if self.on_progress is not None:  # first: a woken waiter must see the pool's new figures
            self.on_progress(ready, pinned)
        with self._state:
            self.pinned_bytes, self.ready_bytes = pinned, ready
            due = [w for w in self._waiters if w.end <= ready]
            self._waiters = [w for w in self._waiters if w.end > ready]
            self._changed.notify_all()
        for waiter in due:
            _call_soon(waiter, None)

    def wait_ready(self, end: int, timeout_s: float) -> bool:
        """Blocks until ``end`` bytes are usable; False on timeout or when pinning stopped short."""
        with self._changed:
            return self._changed.wait_for(lambda: self.ready_bytes >= end or self.done, timeout_s) and (
                self.ready_bytes >= end
            )

    async def wait_ready_async(self, end: int) -> None:
        """Returns once ``end`` bytes are usable; raises RuntimeError if the pool closes first."""
        if self.ready_bytes >= end:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._state:
            if self.ready_bytes >= end:
                return
            if self._stop.is_set():
                raise RuntimeError("host pool is closed")
            self._waiters.append(_Waiter(end, loop, future))
        await future

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stops after the chunks in progress; fails the waiters still queued."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        with self._state:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            _call_soon(waiter, RuntimeError("host pool closed before this range was pinned"))

    def unpin(self) -> None:
        """Stops pinning and unregisters every chunk (only when no copy uses the pool)."""
        self.stop()
        with self._state:
            registered, self._registered = self._registered, []
            self.pinned_bytes = 0
        for offset, _ in reversed(registered):
            try:
                self.registrar.unregister(self.address + offset)
            except Exception as exc:  # best effort at shutdown
                log.warning("host pool: unregister at offset %d failed: %s", offset, exc)

    def discard_tail(self, give_back: Callable[[int, int], None]) -> None:
        """Calls give_back(offset, length) for the pages no chunk has claimed yet; the thread
        cannot claim another chunk meanwhile."""
        with self._state:
            start = -(-self._claimed // PAGE) * PAGE
            if start < self.capacity:
                give_back(start, self.capacity - start)

    def describe(self) -> dict[str, Any]:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        elapsed = end - self.started_at if self.started_at is not None else 0.0
        return {
            "pinned_bytes": self.pinned_bytes,
            "capacity_bytes": self.capacity,
            "chunks": len(self.spans),
            "workers": self.workers,
            "done": self.done,
            "seconds": round(elapsed, 3),
            "gib_per_s": round(self.pinned_bytes / elapsed / (1 << 30), 3) if elapsed > 0 else 0.0,
            "error": self.error,
        }


def settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Completes an asyncio future from the loop thread (via call_soon_threadsafe)."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _call_soon(waiter: _Waiter, error: BaseException | None) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        waiter.loop.call_soon_threadsafe(settle, waiter.future, error)


class PinnedHostPool(HostPool):
    """HostPool whose ready prefix grows as a ChunkPinner registers it."""

    def __init__(
        self,
        capacity: int,
        registrar: Registrar,
        chunk: int,
        numa_node: int | None = None,
        start: bool = True,
        workers: int = 1,
        touch: Callable[[int, int], None] | None = None,
    ) -> None:
        """``workers`` threads pin in parallel; ``touch`` faults a chunk's pages in before it
        is registered (default: populate_pages where the kernel can)."""
        super().__init__(capacity)
        if hasattr(mmap, "MADV_DONTFORK"):
            self._map.madvise(mmap.MADV_DONTFORK)
        self.numa_node = numa_node
        self.numa_error: str | None = None
        if numa_node is not None:
            self.numa_error = try_bind_memory(self.address, capacity, numa_node)
        self.ready_bytes = 0
        touch = touch if touch is not None else populate_pages if can_populate() else None
        self.pinner = ChunkPinner(self.address, capacity, chunk, registrar, self._on_progress, workers, touch)
        if start:
            self.pinner.start()

    def _on_progress(self, ready: int, pinned: int) -> None:
        self.ready_bytes = ready
        self.pinned = pinned == self.capacity

    async def wait_ready_async(self, end: int) -> None:
        await self.pinner.wait_ready_async(end)

    def wait_ready(self, end: int, timeout_s: float) -> bool:
        return self.pinner.wait_ready(end, timeout_s)

    def wait_all_pinned(self, timeout_s: float = 600.0) -> bool:
        """Blocks until the whole pool is usable (benchmarks time pinned copies only)."""
        return self.pinner.wait_ready(self.capacity, timeout_s)

    def discard(self) -> int:
        """Gives back only pages not registered (nor being registered): dropping a pinned
        page would leave the GPU with the old page and the process with a new zero page.
        Returns the bytes given back."""
        freed = 0

        def give_back(start: int, length: int) -> None:
            nonlocal freed
            self._map.madvise(mmap.MADV_DONTNEED, start, length)
            freed += length

        self.pinner.discard_tail(give_back)
        return freed

    def close(self) -> None:
        self.pinner.unpin()
        self.pinned = False

    def describe_pinning(self) -> dict[str, Any]:
        return {**self.pinner.describe(), "numa_node": self.numa_node, "numa_error": self.numa_error}


# First touch ------------------------------------------------------------------------------

_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in, writable, without writing to them


def _madvise(address: int, length: int, advice: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, length, advice) != 0:
        return ctypes.get_errno()
    return 0


def can_populate() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (asked once, on one page of scratch)."""
    probe = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        ok = _madvise(address, PAGE, _MADV_POPULATE_WRITE) == 0
        del address
    finally:
        with contextlib.suppress(BufferError):
            probe.close()
    return ok


def populate_pages(address: int, length: int) -> None:
    """Faults in [address, address + length) without changing its bytes (the kernel does
    the work, with the GIL released): registering it afterwards finds every page present.
    Storage reads may already have written to the pool there, so nothing is overwritten."""
    err = _madvise(address, length, _MADV_POPULATE_WRITE)
    if err:
        raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")


# NUMA -----------------------------------------------------------------------------------


def normalize_bus_id(bus_id: str) -> str:
    """'00000000:65:00.0' (nvidia-smi), '0000:65:00.0' (CUDA) or '65:00.0' -> '0000:65:00.0' (sysfs)."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(parts[0], 16):04x}:{int(parts[1], 16):02x}:{parts[2]}"


def pci_numa_node(bus_id: str, sysfs: str = "/sys") -> int | None:
    """The NUMA node sysfs reports for a PCI device; None where it reports none (-1)."""
    try:
        text = (Path(sysfs) / "bus/pci/devices" / normalize_bus_id(bus_id) / "numa_node").read_text()
        node = int(text.strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_mask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """(mask words, maxnode) for mbind: one bit set for ``node``."""
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    return mask, words * bits + 1  # the kernel reads maxnode - 1 bits


def bind_memory(address: int, length: int, node: int) -> None:
    """mbind(MPOL_PREFERRED): pages faulted in later come from ``node`` while it has room."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise OSError(f"mbind syscall number unknown on {platform.machine()}")
    mask, maxnode = node_mask(node)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(
        ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(length),
        ctypes.c_int(_MPOL_PREFERRED), mask, ctypes.c_ulong(maxnode), ctypes.c_uint(0),
    )  # fmt: skip
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind to node {node}: {os.strerror(err)}")


def try_bind_memory(address: int, length: int, node: int) -> str | None:
    """Binds, or returns why not (containers often refuse mbind; the pool still works)."""
    try:
        bind_memory(address, length, node)
    except OSError as exc:
        log.warning("host pool: NUMA binding to node %d failed (%s); pages go where the kernel puts them", node, exc)
        return str(exc)
    log.info("host pool: bound to NUMA node %d", node)
    return None


class CudartRegistrar:
    """cudaHostRegister / cudaHostUnregister through torch.cuda.cudart() (no cuda-python)."""

    def __init__(self, device_index: int, flags: int = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED) -> None:
        self.device_index = device_index
        self.flags = flags

    def register(self, address: int, size: int) -> None:
        import torch

        # The calling thread needs this device current, or the runtime would create a
        # context on device 0 for it.
        with torch.cuda.device(self.device_index):
            cudart = torch.cuda.cudart()
            self._check(cudart, cudart.cudaHostRegister(address, size, self.flags), f"cudaHostRegister({size} bytes)")

    def unregister(self, address: int) -> None:
        import torch

        with torch.cuda.device(self.device_index):
            cudart = torch.cuda.cudart()
            self._check(cudart, cudart.cudaHostUnregister(address), "cudaHostUnregister")

    @staticmethod
    def _check(cudart: Any, err: Any, what: str) -> None:
        if int(err) != 0:
            raise RuntimeError(f"{what} failed: {cudart.cudaGetErrorString(err)}")
