"""A CPU stand-in for the GPU behind the driver seam (driver.Driver), for tests and for the
CPU-cost benchmark (``cachexferd bench swap --backend cuda-fake``).

"Device" memory is process memory: the runner's tensors are CPU tensors, the host pool an
ordinary HostPool, and every address the copy path computes is a real address. Each stream
has a device thread that runs the stream's work in order, each operation after a simulated
link delay (bytes / ``rate_gbps``): it copies the bytes (memmove), runs the piece kernel
(its addressing spelled out in Python, or the real Triton kernel under its interpreter,
``interpreted_launcher``), writes doorbells and completes events. So the loop-side machinery
meets real concurrency: a doorbell moves while the loop reads it, ids are read from a ring
slot when the "kernel" runs, not when it was launched.

``inline=True`` runs every operation on the calling thread at once (no device threads, no
delay): what is left is the loop's own cost, which the CPU-cost benchmark measures.

Faults for tests: ``fail_next(name)`` makes the next call of that name raise DriverError;
``break_device(message)`` stops the device (doorbells stop moving) and makes event waits
raise, as a CUDA error does; ``pause()`` / ``resume()`` hold the device threads.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .driver import Copy2D, DeviceBuffer, DriverError, HostBuffer, KernelLaunch

Op = tuple[float, Callable[[], None]]  # (seconds of simulated link time, effect)
Launcher = Callable[[KernelLaunch, int, int, int], None]  # (launch, ids address, pairs, programs)


def _words(address: int, count: int) -> np.ndarray[Any, Any]:
    words: np.ndarray[Any, Any] = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(address))
    return words


def python_launcher(launch: KernelLaunch, ids: int, pairs: int, programs: int) -> None:
    """The piece kernel's addressing (cuda/pieces.py), one memmove per piece."""
    if pairs == 0:
        return
    table = _words(launch.table, launch.tensors).tolist()
    words = _words(ids, 1 + 2 * pairs).tolist()
    w, size = launch.word_bytes, launch.piece_bytes
    base, device_ids, linear_ids = words[0], words[1 : 1 + pairs], words[1 + pairs :]
    for d, lin in zip(device_ids, linear_ids):
        for t in range(launch.tensors):
            dev = table[t] + d * launch.block_stride_words * w
            linear = base + (lin * launch.linear_stride_words + t * launch.chunk_words) * w
            src, dst = (dev, linear) if launch.to_linear else (linear, dev)
            ctypes.memmove(dst, src, size)


def interpreted_launcher(kernel: Any) -> Launcher:
    """Runs the real Triton kernel under its interpreter (TRITON_INTERPRET=1 when it was
    built) on the fake's memory: the kernel's own bytes, checked without a GPU."""
    import torch
    import triton.language as tl

    dtypes = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}

    def launch_interpreted(launch: KernelLaunch, ids: int, pairs: int, programs: int) -> None:
        table = torch.frombuffer((ctypes.c_int64 * launch.tensors).from_address(launch.table), dtype=torch.int64)
        id_words = torch.frombuffer((ctypes.c_int64 * (1 + 2 * pairs)).from_address(ids), dtype=torch.int64)
        kernel[(programs,)](
            table, id_words, pairs, programs, launch.tensors, launch.chunk_words, launch.block_stride_words,
            launch.linear_stride_words, TO_LINEAR=launch.to_linear, WORD=dtypes[launch.word_bytes],
            BLOCK=launch.block, num_warps=launch.warps,
        )  # fmt: skip

    return launch_interpreted


class _Stream:
    """One stream's queue and, unless inline, the device thread that drains it."""

    def __init__(self, driver: FakeDriver, index: int) -> None:
        self.driver = driver
        self.ops: collections.deque[Op] = collections.deque()
        self.wake = threading.Condition()
        self.idle = True
        self.thread: threading.Thread | None = None
        if not driver.inline:
            self.thread = threading.Thread(target=self._run, name=f"fake-gpu-{index}", daemon=True)
            self.thread.start()

    def put(self, seconds: float, effect: Callable[[], None]) -> None:
        if self.thread is None:
            if not self.driver.broken:
                effect()
            return
        with self.wake:
            self.ops.append((seconds, effect))
            self.idle = False
            self.wake.notify()

    def _run(self) -> None:
        driver = self.driver
        while True:
            with self.wake:
                while not driver.stopped and (not self.ops or driver.paused or driver.broken):
                    self.idle = not self.ops
                    self.wake.wait(0.05)
                if driver.stopped:
                    return
                seconds, effect = self.ops.popleft()
            _pass(seconds)
            if not driver.broken:  # a faulted device runs nothing more
                effect()

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.thread is not None and self.ops and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self.ops


def _pass(seconds: float) -> None:
    """Simulated link time, without holding the GIL (sleep(0) yields it)."""
    if seconds <= 0:
        return
    if seconds > 1e-3:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(0)


class _Event:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()
        self.error: str | None = None


class FakeDriver:
    name = "fake"

    def __init__(
        self,
        rate_gbps: float = 0.0,
        launch_us: float = 0.0,
        inline: bool = False,
        move_bytes: bool = True,
        dma: bool = True,
        kernel: bool = True,
        launcher: Launcher = python_launcher,
    ) -> None:
        """``rate_gbps``: simulated link speed (0: no delay); ``launch_us``: extra time per
        operation; ``move_bytes=False``: operations only take their time (CPU-cost bench)."""
        self.rate = rate_gbps * 1e9
        self.launch_s = launch_us * 1e-6
        self.inline, self.move_bytes = inline, move_bytes
        self.dma, self.kernel = dma, kernel
        self.launcher = launcher
        self.paused = self.broken = self.stopped = False
        self.break_message = ""
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, _Event] = {}
        self._ids = itertools.count(1)
        self._fail: dict[str, str] = {}
        names = ("upload", "prepare_kernel", "memcpy_async", "memcpy2d_async", "memcpy_batch_async", "launch",
                 "write_doorbell", "record_event")  # fmt: skip
        self.calls: dict[str, int] = dict.fromkeys(names, 0)
        self.blocking_calls: list[tuple[str, int]] = []  # (call, thread ident): waits and syncs
        self.prepared: list[KernelLaunch] = []
        self._keep: list[Any] = []

    # Faults and control -----------------------------------------------------------------

    def fail_next(self, name: str, message: str = "injected fault") -> None:
        self._fail[name] = message

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if self._fail:
            message = self._fail.pop(name, None)
            if message is not None:
                raise DriverError(f"{name}: {message}")

    def break_device(self, message: str = "an illegal memory access was encountered") -> None:
        self.break_message = message
        self.broken = True
        for event in self._events.values():
            event.error = message
            event.done.set()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        for stream in self._streams.values():
            with stream.wake:
                stream.wake.notify()

    def _seconds(self, nbytes: int) -> float:
        return self.launch_s + (nbytes / self.rate if self.rate else 0.0)

    def _put(self, stream: int, nbytes: int, effect: Callable[[], None]) -> None:
        if self.move_bytes:
            self._streams[stream].put(self._seconds(nbytes), effect)
        elif not self.inline:  # only the time it takes
            self._streams[stream].put(self._seconds(nbytes), _nothing)

    # Attach time ------------------------------------------------------------------------

    def bind_thread(self) -> None:
        return None

    def new_stream(self) -> int:
        index = next(self._ids)
        self._streams[index] = _Stream(self, index)
        return index

    def host_buffer(self, nbytes: int) -> HostBuffer:
        words = np.zeros(-(-nbytes // 8), dtype=np.uint64)
        self._keep.append(words)  # freed with the driver: a device thread may still use it
        return HostBuffer(words, words.ctypes.data, words.ctypes.data, words)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        data = np.zeros(max(1, nbytes), dtype=np.uint8)
        self._keep.append(data)
        return DeviceBuffer(data.ctypes.data, nbytes, data)

    def new_event(self) -> int:
        index = next(self._ids)
        self._events[index] = _Event()
        return index

    def upload(self, dst: int, data: np.ndarray[Any, Any]) -> None:
        self._call("upload")
        self.blocking_calls.append(("upload", threading.get_ident()))
        source = np.ascontiguousarray(data)
        self._keep.append(source)
        ctypes.memmove(dst, source.ctypes.data, source.nbytes)

    def prepare_kernel(self, launch: KernelLaunch) -> None:
        self._call("prepare_kernel")
        self.prepared.append(launch)

    # Hot path ---------------------------------------------------------------------------

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("memcpy_async")

        def copy() -> None:
            ctypes.memmove(dst, src, nbytes)

        self._put(stream, nbytes, copy)

    def memcpy2d_async(self, copy: Copy2D, stream: int) -> None:
        self._call("memcpy2d_async")

        def rows() -> None:
            for row in range(copy.height):
                ctypes.memmove(copy.dst + row * copy.dpitch, copy.src + row * copy.spitch, copy.width)

        self._put(stream, copy.nbytes, rows)

    def memcpy_batch_async(
        self, dsts: np.ndarray[Any, Any], srcs: np.ndarray[Any, Any], sizes: np.ndarray[Any, Any], count: int,
        stream: int,
    ) -> None:  # fmt: skip
        self._call("memcpy_batch_async")
        copies = list(zip(dsts[:count].tolist(), srcs[:count].tolist(), sizes[:count].tolist()))  # read at the call

        def batch() -> None:
            for dst, src, size in copies:
                ctypes.memmove(dst, src, size)

        self._put(stream, sum(size for _, _, size in copies), batch)

    def launch(self, launch: KernelLaunch, ids: int, pairs: int, programs: int, stream: int) -> None:
        self._call("launch")
        nbytes = pairs * launch.tensors * launch.piece_bytes
        self._put(stream, nbytes, lambda: self.launcher(launch, ids, pairs, programs))

    def write_doorbell(self, stream: int, address: int, value: int) -> None:
        self._call("write_doorbell")
        word = ctypes.c_uint64.from_address(address)

        def ring() -> None:
            word.value = value

        self._streams[stream].put(0.0, ring)  # always runs: it is how work shows as done

    def record_event(self, event: int, stream: int) -> None:
        self._call("record_event")
        state = self._events[event]
        state.done.clear()
        self._streams[stream].put(0.0, state.done.set)

    # Watcher thread ---------------------------------------------------------------------

    def wait_event(self, event: int) -> None:
        self.blocking_calls.append(("wait_event", threading.get_ident()))
        state = self._events[event]
        while not state.done.wait(0.05):
            if self.stopped:
                raise DriverError("the fake device stopped")
        if self.broken:
            raise DriverError(self.break_message)

    # Close ------------------------------------------------------------------------------

    def synchronize(self, stream: int, timeout_s: float = 30.0) -> None:
        self.blocking_calls.append(("synchronize", threading.get_ident()))
        if self.broken:
            raise DriverError(self.break_message)
        if not self._streams[stream].drain(timeout_s):
            raise DriverError("the fake device did not finish in time")

    def close_stream(self, stream: int) -> None:
        self._streams.pop(stream, None)

    def close_event(self, event: int) -> None:
        self._events.pop(event, None)

    def stop(self) -> None:
        """Ends the device threads (tests call it when done with the driver)."""
        self.stopped = True
        for stream in self._streams.values():
            if stream.thread is not None:
                with stream.wake:
                    stream.wake.notify()
                stream.thread.join(5)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "rate_gbps": self.rate / 1e9, "inline": self.inline}


def _nothing() -> None:
    return None
