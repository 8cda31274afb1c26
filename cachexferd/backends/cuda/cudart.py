"""The real driver behind the seam (driver.Driver): ctypes on the libcudart torch loaded and
on the driver library, no new dependency, no build step.

- Copies: ``cudaMemcpyAsync``; 2D copies through the DMA binding (memcpy.py); batched copies
  through ``cuMemcpyBatchAsync`` (resolved with ``cuGetProcAddress`` at the CUDA 12.8 ABI,
  which CUDA 13 drivers keep serving), else one ``cudaMemcpyAsync`` per descriptor.
- Doorbells: ``cuStreamWriteValue64`` (the stream writes the word after its earlier work,
  with a system-wide fence first), else an 8-byte ``cudaMemcpyAsync`` from a pinned ring of
  values, which the copy engine performs in stream order.
- Events: blocking-sync events, made at attach; the watcher thread waits on them.
- The kernel: kernel.KernelRunners (the compiled Triton kernel, launched without Triton's
  Python dispatch where its self-check passes).

Each optional call is checked once, when the driver is made, on scratch memory; what fails
falls back and ``describe()`` says which path is in use. A ctypes call releases the GIL.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import numpy as np

from .driver import Copy2D, DeviceBuffer, DriverError, HostBuffer, KernelLaunch
from .memcpy import Memcpy, loaded_cudart

log = logging.getLogger(__name__)

_H2D, _D2H, _DEFAULT = 1, 2, 4  # cudaMemcpyKind
_STREAM_NON_BLOCKING = 1
_EVENT_BLOCKING_SYNC, _EVENT_NO_TIMING = 1, 2
_ACCESS_ORDER_STREAM = 1
_DOORBELL_VALUES = 256  # pinned source words of the doorbell fallback (far more than units in flight)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes (CUDA 12.8)
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]  # fmt: skip


def _bind(lib: Any, name: str, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


class CudaDriver:
    name = "cuda"

    def __init__(self, device_index: int, memcpy: Memcpy | None, kernels: Any | None) -> None:
        """``kernels``: a kernel.KernelRunners, or None (no Triton)."""
        path = loaded_cudart()
        if path is None:
            raise RuntimeError("the cuda backend needs the libcudart torch loaded (none found in this process)")
        self.device_index, self.memcpy, self.kernels = device_index, memcpy, kernels
        self.dma, self.kernel = memcpy is not None, kernels is not None
        self._bound: set[int] = set()
        self._rt = ctypes.CDLL(path)
        self._bind_runtime()
        self.bind_thread()
        self._driver = ctypes.CDLL("libcuda.so.1")
        self._write_value = self._resolve("cuStreamWriteValue64", 12000)
        self._batch = self._resolve("cuMemcpyBatchAsync", 12080)
        self._values = self.host_buffer(_DOORBELL_VALUES * 8)
        self._check_fast_calls()

    def _bind_runtime(self) -> None:
        rt, vp, sz, i = self._rt, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        pv = ctypes.POINTER(vp)
        self._memcpy_async = _bind(rt, "cudaMemcpyAsync", [vp, vp, sz, i, vp])
        self._memcpy = _bind(rt, "cudaMemcpy", [vp, vp, sz, i])
        self._set_device = _bind(rt, "cudaSetDevice", [i])
        self._stream_create = _bind(rt, "cudaStreamCreateWithFlags", [pv, ctypes.c_uint])
        self._stream_destroy = _bind(rt, "cudaStreamDestroy", [vp])
        self._stream_sync = _bind(rt, "cudaStreamSynchronize", [vp])
        self._event_create = _bind(rt, "cudaEventCreateWithFlags", [pv, ctypes.c_uint])
        self._event_record = _bind(rt, "cudaEventRecord", [vp, vp])
        self._event_sync = _bind(rt, "cudaEventSynchronize", [vp])
        self._event_destroy = _bind(rt, "cudaEventDestroy", [vp])
        self._host_device_pointer = _bind(rt, "cudaHostGetDevicePointer", [pv, vp, ctypes.c_uint])
        self._error_string = rt.cudaGetErrorString
        self._error_string.argtypes, self._error_string.restype = [i], ctypes.c_char_p

    def _resolve(self, symbol: str, version: int) -> Any | None:
        """A driver entry point at a fixed ABI version (None where this driver lacks it)."""
        lookup = getattr(self._driver, "cuGetProcAddress_v2", None)
        pfn, status = ctypes.c_void_p(), ctypes.c_int(0)
        if lookup is None:
            return None
        lookup.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                           ctypes.POINTER(ctypes.c_int)]  # fmt: skip
        if lookup(symbol.encode(), ctypes.byref(pfn), version, 0, ctypes.byref(status)) != 0 or not pfn.value:
            return None
        if symbol == "cuStreamWriteValue64":
            proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
        else:
            p64, psz = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
            proto = ctypes.CFUNCTYPE(ctypes.c_int, p64, p64, psz, ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes),
                                     psz, ctypes.c_size_t, psz, ctypes.c_void_p)  # fmt: skip
        return proto(pfn.value)

    def _check(self, err: int, what: str) -> None:
        if err:
            text = self._error_string(err)
            raise DriverError(f"{what} failed: {text.decode() if text else err}")

    def _check_fast_calls(self) -> None:
        """Runs the doorbell write and the batched copy once on scratch memory; whichever
        misbehaves is not used."""
        stream = self.new_stream()
        try:
            if self._write_value is not None and not self._doorbell_works(stream):
                log.warning("cuStreamWriteValue64 does not work here: doorbells are written by memcpy")
                self._write_value = None
            if self._batch is not None and not self._batch_works(stream):
                log.warning("cuMemcpyBatchAsync does not work here: one memcpy per host run")
                self._batch = None
        finally:
            self.close_stream(stream)

    def _doorbell_works(self, stream: int) -> bool:
        word = self.host_buffer(8)
        try:
            self.write_doorbell(stream, word.device_address, 0x5EED)
            self.synchronize(stream)
        except DriverError:
            return False
        return int(word.words[0]) == 0x5EED

    def _batch_works(self, stream: int) -> bool:
        src, dst = self.host_buffer(4096), self.device_buffer(4096)
        back = self.host_buffer(4096)
        src.words[:] = np.arange(512, dtype=np.uint64)
        try:
            for to, frm in ((dst.address, src.address), (back.address, dst.address)):
                dsts = np.array([to, to + 2048], dtype=np.uint64)
                srcs = np.array([frm, frm + 2048], dtype=np.uint64)
                self.memcpy_batch_async(dsts, srcs, np.array([2048, 2048], dtype=np.uint64), 2, stream)
            self.synchronize(stream)
        except DriverError:
            return False
        return bool(np.array_equal(back.words, src.words))

    # Attach time ------------------------------------------------------------------------

    def bind_thread(self) -> None:
        ident = threading.get_ident()
        if ident not in self._bound:
            self._check(self._set_device(self.device_index), "cudaSetDevice")
            if self.memcpy is not None:
                self.memcpy.bind_device(self.device_index)
            self._bound.add(ident)

    def new_stream(self) -> int:
        handle = ctypes.c_void_p()
        self._check(self._stream_create(ctypes.byref(handle), _STREAM_NON_BLOCKING), "cudaStreamCreateWithFlags")
        return int(handle.value or 0)

    def host_buffer(self, nbytes: int) -> HostBuffer:
        """Pinned (torch's host allocator: a detach gives it back for the next attach), with
        the address the GPU uses for it (the same one under unified addressing)."""
        import torch

        size = -(-nbytes // 8) * 8
        tensor = torch.zeros(size // 8, dtype=torch.int64, pin_memory=True)
        dptr = ctypes.c_void_p()
        self._check(self._host_device_pointer(ctypes.byref(dptr), tensor.data_ptr(), 0), "cudaHostGetDevicePointer")
        return HostBuffer(tensor.numpy().view(np.uint64), tensor.data_ptr(), int(dptr.value or 0), tensor)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        """From torch's caching allocator, so a detach gives the memory back to it."""
        import torch

        tensor = torch.empty(max(1, nbytes), dtype=torch.uint8, device=torch.device("cuda", self.device_index))
        return DeviceBuffer(tensor.data_ptr(), nbytes, tensor)

    def new_event(self) -> int:
        handle = ctypes.c_void_p()
        self._check(self._event_create(ctypes.byref(handle), _EVENT_BLOCKING_SYNC | _EVENT_NO_TIMING),
                    "cudaEventCreateWithFlags")  # fmt: skip
        return int(handle.value or 0)

    def upload(self, dst: int, data: np.ndarray[Any, Any]) -> None:
        source = np.ascontiguousarray(data)
        self._check(self._memcpy(dst, source.ctypes.data, source.nbytes, _H2D), "cudaMemcpy (upload)")

    def prepare_kernel(self, launch: KernelLaunch) -> None:
        if self.kernels is None:
            raise DriverError("no copy kernel (Triton is not usable)")
        self.kernels.prepare(launch)

    # Hot path ---------------------------------------------------------------------------

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._memcpy_async(dst, src, nbytes, _DEFAULT, stream)
        if err:
            self._check(err, f"cudaMemcpyAsync of {nbytes} bytes")

    def memcpy2d_async(self, copy: Copy2D, stream: int) -> None:
        assert self.memcpy is not None
        try:
            self.memcpy.copy(copy, stream)
        except RuntimeError as exc:
            raise DriverError(str(exc)) from None

    def memcpy_batch_async(
        self, dsts: np.ndarray[Any, Any], srcs: np.ndarray[Any, Any], sizes: np.ndarray[Any, Any], count: int,
        stream: int,
    ) -> None:  # fmt: skip
        if self._batch is None:
            for dst, src, size in zip(dsts[:count].tolist(), srcs[:count].tolist(), sizes[:count].tolist()):
                self.memcpy_async(dst, src, size, stream)
            return
        attrs = _MemcpyAttributes(_ACCESS_ORDER_STREAM)  # sources may be written by this stream's previous work
        index, failed = ctypes.c_size_t(0), ctypes.c_size_t(0)
        p64, psz = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
        err = self._batch(dsts.ctypes.data_as(p64), srcs.ctypes.data_as(p64), sizes.ctypes.data_as(psz), count,
                          ctypes.byref(attrs), ctypes.byref(index), 1, ctypes.byref(failed), stream)  # fmt: skip
        if err:
            self._check(err, f"cuMemcpyBatchAsync of {count} copies (copy {failed.value})")

    def launch(self, launch: KernelLaunch, ids: int, pairs: int, programs: int, stream: int) -> None:
        assert self.kernels is not None
        self.kernels.launch(launch, ids, pairs, programs, stream)

    def write_doorbell(self, stream: int, address: int, value: int) -> None:
        if self._write_value is not None:
            err = self._write_value(stream, address, value, 0)
            if err:
                raise DriverError(f"cuStreamWriteValue64 failed: error {err}")
            return
        slot = value % _DOORBELL_VALUES
        self._values.words[slot] = value
        self.memcpy_async(address, self._values.device_address + 8 * slot, 8, stream)

    def record_event(self, event: int, stream: int) -> None:
        self._check(self._event_record(event, stream), "cudaEventRecord")

    # Watcher thread and close ------------------------------------------------------------

    def wait_event(self, event: int) -> None:
        self._check(self._event_sync(event), "cudaEventSynchronize")

    def synchronize(self, stream: int) -> None:
        self._check(self._stream_sync(stream), "cudaStreamSynchronize")

    def close_stream(self, stream: int) -> None:
        self._check(self._stream_destroy(stream), "cudaStreamDestroy")

    def close_event(self, event: int) -> None:
        self._check(self._event_destroy(event), "cudaEventDestroy")

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "doorbell": "cuStreamWriteValue64" if self._write_value is not None else "memcpy",
            "batched_copy": "cuMemcpyBatchAsync" if self._batch is not None else "memcpy per run",
            "dma": self.memcpy.name if self.memcpy is not None else None,
            "kernel": self.kernels.describe() if self.kernels is not None else None,
        }
