"""The 2D-memcpy bindings of the DMA method, and the libcudart that torch loaded.

torch has no 2D memcpy, and its own ``copy_`` between a strided host view and a device
tensor goes through a pageable temporary. So DMA calls go through one of two bindings:
- ``cuda-python`` (``cuda.bindings.runtime``, or the older ``cuda.cudart``) when installed;
- ``ctypes`` on the libcudart that torch itself loaded (found in /proc/self/maps): every
  argument of cudaMemcpy2DAsync is a scalar, so no struct layout is involved.
Both use the device's primary context, which torch and the bindings share. With neither
(``memcpy_api = "torch"``) the DMA method is off and the kernel methods copy everything.

Nothing CUDA-only is imported at module import time.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, Protocol

from .driver import Copy2D

log = logging.getLogger(__name__)

MEMCPY_APIS = ("auto", "cuda-python", "ctypes", "torch")
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (UVA) pointers
_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch
_ATTR_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


class Memcpy(Protocol):
    name: str

    def bind_device(self, index: int) -> None: ...

    def copy(self, c: Copy2D, stream: int) -> None: ...

    def max_pitch(self, index: int) -> int: ...

    def host_pointer_usable(self, index: int) -> bool: ...

    def pci_bus_id(self, index: int) -> str: ...


class CudaPythonMemcpy:
    name = "cuda-python"

    def __init__(self) -> None:
        try:
            from cuda.bindings import runtime  # type: ignore[import-not-found, import-untyped, unused-ignore]
        except ImportError:
            from cuda import cudart as runtime  # type: ignore[import-not-found, import-untyped, no-redef, unused-ignore]
        self.rt: Any = runtime
        self.kind = runtime.cudaMemcpyKind.cudaMemcpyDefault
        self.ok = runtime.cudaError_t.cudaSuccess

    def _check(self, err: Any, what: str) -> None:
        if err != self.ok:
            _, text = self.rt.cudaGetErrorString(err)
            raise RuntimeError(f"{what} failed: {text.decode() if isinstance(text, bytes) else text}")

    def bind_device(self, index: int) -> None:
        self._check(self.rt.cudaSetDevice(index)[0], "cudaSetDevice")

    def copy(self, c: Copy2D, stream: int) -> None:
        if c.height == 1:
            err = self.rt.cudaMemcpyAsync(c.dst, c.src, c.width, self.kind, stream)[0]
        else:
            err = self.rt.cudaMemcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, self.kind, stream)[0]
        if err != self.ok:
            self._check(err, f"memcpy of {c.height}x{c.width} bytes")

    def max_pitch(self, index: int) -> int:
        err, value = self.rt.cudaDeviceGetAttribute(self.rt.cudaDeviceAttr.cudaDevAttrMaxPitch, index)
        self._check(err, "cudaDeviceGetAttribute(MaxPitch)")
        return int(value)

    def host_pointer_usable(self, index: int) -> bool:
        attr = self.rt.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem
        err, value = self.rt.cudaDeviceGetAttribute(attr, index)
        self._check(err, "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)")
        return bool(value)

    def pci_bus_id(self, index: int) -> str:
        err, text = self.rt.cudaDeviceGetPCIBusId(32, index)
        self._check(err, "cudaDeviceGetPCIBusId")
        raw = bytes(text) if not isinstance(text, str) else text.encode()
        return raw.split(b"\0")[0].decode()


def loaded_cudart() -> str | None:
    """Path of the libcudart this process has mapped (torch's), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "/libcudart.so" in path:
            return path.strip()
    return None


class CtypesMemcpy:
    name = "ctypes"

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)  # CDLL releases the GIL around each call
        sz, vp, i = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
        self._2d = lib.cudaMemcpy2DAsync
        self._2d.argtypes, self._2d.restype = [vp, sz, vp, sz, sz, sz, i, vp], i
        self._1d = lib.cudaMemcpyAsync
        self._1d.argtypes, self._1d.restype = [vp, vp, sz, i, vp], i
        self._attr = lib.cudaDeviceGetAttribute
        self._attr.argtypes, self._attr.restype = [ctypes.POINTER(i), i, i], i
        self._bus = lib.cudaDeviceGetPCIBusId
        self._bus.argtypes, self._bus.restype = [ctypes.c_char_p, i, i], i
        self._set = lib.cudaSetDevice
        self._set.argtypes, self._set.restype = [i], i
        self._err = lib.cudaGetErrorString
        self._err.argtypes, self._err.restype = [i], ctypes.c_char_p
        self.path = path

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            text = self._err(err)
            raise RuntimeError(f"{what} failed: {text.decode() if text else err}")

    def bind_device(self, index: int) -> None:
        self._check(self._set(index), "cudaSetDevice")

    def copy(self, c: Copy2D, stream: int) -> None:
        if c.height == 1:
            err = self._1d(c.dst, c.src, c.width, _MEMCPY_DEFAULT, stream)
        else:
            err = self._2d(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, _MEMCPY_DEFAULT, stream)
        if err:
            self._check(err, f"memcpy of {c.height}x{c.width} bytes")

    def max_pitch(self, index: int) -> int:
        value = ctypes.c_int(0)
        self._check(self._attr(ctypes.byref(value), _ATTR_MAX_PITCH, index), "cudaDeviceGetAttribute(MaxPitch)")
        return value.value

    def host_pointer_usable(self, index: int) -> bool:
        value = ctypes.c_int(0)
        what = "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)"
        self._check(self._attr(ctypes.byref(value), _ATTR_HOST_POINTER, index), what)
        return bool(value.value)

    def pci_bus_id(self, index: int) -> str:
        buf = ctypes.create_string_buffer(32)
        self._check(self._bus(buf, 32, index), "cudaDeviceGetPCIBusId")
        return buf.value.decode()


def load_memcpy(api: str) -> Memcpy | None:
    """The binding for ``cuda.memcpy_api``; ``auto`` prefers cuda-python, then ctypes, and
    returns None (stage everything) when neither loads. Call after torch initialised CUDA."""
    if api not in MEMCPY_APIS:
        raise ValueError(f"cuda.memcpy_api {api!r} is not one of {list(MEMCPY_APIS)}")
    if api in ("auto", "cuda-python"):
        try:
            return CudaPythonMemcpy()
        except ImportError as exc:
            if api == "cuda-python":
                raise RuntimeError(f"cuda.memcpy_api = 'cuda-python' but it does not import: {exc}") from None
    if api in ("auto", "ctypes"):
        path = loaded_cudart()
        if path is not None:
            return CtypesMemcpy(path)
        if api == "ctypes":
            raise RuntimeError("cuda.memcpy_api = 'ctypes' but no libcudart is loaded in this process")
    log.warning("no 2D memcpy binding (cuda.memcpy_api=%s): the DMA method is off", api)
    return None
