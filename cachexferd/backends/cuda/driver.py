"""The driver seam: every GPU operation of the cuda backend's copy path goes through one
small object, so the loop-side machinery (rings, settlement, chunking, grouping, cancel,
duplex switching, errors) runs unchanged on the real GPU (cudart.CudaDriver) and on CPU
(fake.FakeDriver, whose "device" threads run the work after a simulated link delay).

Addresses are plain ints. "Device" memory is whatever the driver hands out: real device
memory on a GPU, ordinary process memory in the fake. Host buffers are pinned and have a
numpy view the loop writes into (id rings, doorbell words).

Calls fall in three groups:
- attach time (may block, may allocate): streams, buffers, events, ``upload``;
- the hot path, on the event loop's thread (never block, never allocate): the ``*_async``
  copies, ``launch``, ``write_doorbell``, ``record_event``;
- the watcher thread: ``wait_event`` (blocks until the event passed).
Errors of any call raise DriverError.

Nothing here imports torch or a CUDA binding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

WORD_BYTES = 8  # ids, doorbells and descriptors are 64-bit words


class DriverError(RuntimeError):
    """A failed driver call (a CUDA error, or a fault the fake was told to inject)."""


@dataclass(frozen=True)
class HostBuffer:
    """Pinned host memory: ``words`` is its uint64 view (ids are written as int64 through
    ``ids``), ``address`` its host address, ``device_address`` the address the GPU uses."""

    words: np.ndarray[Any, np.dtype[np.uint64]]
    address: int
    device_address: int
    owner: Any = None  # what keeps the memory alive (a pinned tensor, a numpy array)

    @property
    def ids(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        return self.words.view(np.int64)


@dataclass(frozen=True)
class DeviceBuffer:
    address: int
    nbytes: int
    owner: Any = None


@dataclass(frozen=True)
class KernelLaunch:
    """What one attach's piece-kernel launches have in common (cuda/pieces.py explains the
    kernel): fixed per (attach, direction, linear side); a launch adds the ids, the number
    of pairs and the grid."""

    table: int  # device address of the tensors' base-address table (int64[tensors])
    tensors: int
    chunk_words: int
    block_stride_words: int
    linear_stride_words: int
    to_linear: bool  # device -> linear side (swap-out, or a gather into staging)
    word_bytes: int
    block: int  # words per vector step
    warps: int

    @property
    def piece_bytes(self) -> int:
        return self.chunk_words * self.word_bytes


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


class Driver(Protocol):
    name: str
    dma: bool  # memcpy2d_async is available (a 2D memcpy binding)
    kernel: bool  # launch is available (the piece kernel, with device access to the pool)

    # Attach time.
    def bind_thread(self) -> None:
        """Makes the device current on the calling thread (cheap after the first call)."""

    def new_stream(self) -> int: ...

    def host_buffer(self, nbytes: int) -> HostBuffer: ...

    def device_buffer(self, nbytes: int) -> DeviceBuffer: ...

    def new_event(self) -> int:
        """An event whose wait sleeps rather than spins (blocking sync)."""

    def upload(self, dst: int, data: np.ndarray[Any, Any]) -> None:
        """Copies ``data`` to device address ``dst`` and waits for it."""

    def prepare_kernel(self, launch: KernelLaunch) -> None:
        """Compiles (and checks) the kernel variant ``launch`` needs; raises DriverError."""

    # Hot path: event loop thread.
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...

    def memcpy2d_async(self, copy: Copy2D, stream: int) -> None: ...

    def memcpy_batch_async(
        self, dsts: np.ndarray[Any, Any], srcs: np.ndarray[Any, Any], sizes: np.ndarray[Any, Any], count: int,
        stream: int,
    ) -> None:  # fmt: skip
        """``count`` copies ``sizes[i]`` bytes ``srcs[i]`` -> ``dsts[i]``, in any order among
        themselves, after the stream's earlier work."""

    def launch(self, launch: KernelLaunch, ids: int, pairs: int, programs: int, stream: int) -> None:
        """The piece kernel over ``pairs`` pairs whose ids are at device address ``ids``."""

    def write_doorbell(self, stream: int, address: int, value: int) -> None:
        """The stream writes ``value`` to the 64-bit host word at device address ``address``
        once its earlier work has finished (and is visible to the host)."""

    def record_event(self, event: int, stream: int) -> None: ...

    # Watcher thread.
    def wait_event(self, event: int) -> None: ...

    # Close.
    def synchronize(self, stream: int) -> None: ...

    def close_stream(self, stream: int) -> None: ...

    def close_event(self, event: int) -> None: ...

    def describe(self) -> dict[str, Any]: ...
