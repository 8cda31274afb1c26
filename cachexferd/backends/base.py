"""The small interface every copy backend implements, and the cancel token they honour.

A backend creates the host pool and imports a runner's device cache; the imported
DeviceCache moves blocks in either direction. ``swap`` is a coroutine so the daemon's event
loop can await it; implementations do the byte moving off the loop (threads, CUDA streams).
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, NamedTuple

from ..host_cache import HostGeometry, HostPool
from ..protocol import ErrorCode, KVLayout, ProtocolError
from ..security import Requester


class Direction(StrEnum):
    D2H = "d2h"  # swap out: device -> host
    H2D = "h2d"  # swap in: host -> device


class CancelToken:
    """Set from the loop thread, polled by copy workers between runs.

    One is made per command, so it is three plain attributes, not a threading.Event:
    workers only ever read ``cancelled``, and ``cancel`` writes the code and detail before
    the flag, so a worker that sees the flag (an atomic attribute read) sees both.

    ``not_after`` (wall clock, protocol 1.5): a swap must not start after it (its client may
    have given up and reused the device blocks); the daemon and backends check it when the
    copy starts (``refusal``)."""

    __slots__ = ("cancelled", "code", "detail", "not_after")

    def __init__(self) -> None:
        self.cancelled = False
        self.code = ErrorCode.OK
        self.detail = ""
        self.not_after = math.inf

    def cancel(self, code: ErrorCode, detail: str) -> None:
        if not self.cancelled:
            self.code, self.detail = code, detail
            self.cancelled = True

    def check(self) -> None:
        if self.cancelled:
            raise ProtocolError(self.code, self.detail)

    def refusal(self, now: float) -> ProtocolError | None:
        """The error of a copy starting at ``now`` (wall clock): cancelled, or past its not_after."""
        if self.cancelled:
            return ProtocolError(self.code, self.detail)
        if now > self.not_after:
            return late(now, self.not_after)
        return None


def late(now: float, not_after: float) -> ProtocolError:
    return ProtocolError(ErrorCode.EXPIRED, f"copy not started by its not_after time ({now - not_after:.3f}s late)")


class InlineBusy(Exception):
    """``swap_now`` cannot run without waiting (the device fence is held): hand the batch to
    ``swap_many`` instead."""


class AttachError(Exception):
    """Device handles that cannot be imported; becomes ATTACH_FAILED or BAD_FIELD."""

    def __init__(self, detail: str, code: ErrorCode = ErrorCode.ATTACH_FAILED) -> None:
        super().__init__(detail)
        self.code = code


class SwapRequest(NamedTuple):
    """One command's block pairs, for ``DeviceCache.swap_many``."""

    device_ids: Sequence[int]
    host_ids: Sequence[int]
    cancel: CancelToken


class DeviceCache(ABC):
    """A runner's KV cache as imported into the daemon."""

    layout: KVLayout
    # Batches of at most this many bytes may be copied on the caller's thread with
    # ``swap_now``: handing a few small blocks to a worker thread costs more CPU (a wake-up,
    # a future, a GIL hand-off: tens of microseconds) than copying them. 0: never.
    inline_bytes: int = 0
    # How a client can tell that no copy into its device blocks is running (protocol 1.5,
    # ATTACH result ``device_fence``): "flock" (device writes hold a shared flock on the
    # device segment), or None; and (1.6, ``device_fence_reads``) whether copies out of its
    # device blocks hold it too.
    fence: str | None = None
    fence_reads: bool = False

    @abstractmethod
    async def swap(
        self, direction: Direction, device_ids: Sequence[int], host_ids: Sequence[int], cancel: CancelToken
    ) -> int:
        """Copies block pairs in ``direction``; returns bytes moved. Ids are validated already."""

    async def swap_many(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        """Runs several commands' swaps at once: one result each (None, or the error that
        failed that command alone). The requests are independent (the daemon's ordering only
        hands over commands that touch no block another unfinished one writes). A backend
        overrides this to move a whole batch with one hand-off; this default swaps each."""
        results = await asyncio.gather(
            *(self.swap(direction, r.device_ids, r.host_ids, r.cancel) for r in requests), return_exceptions=True
        )
        return [r if isinstance(r, BaseException) else None for r in results]

    def swap_now(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        """``swap_many`` on the calling thread, for batches within ``inline_bytes``."""
        raise NotImplementedError(f"{type(self).__name__} copies only off the calling thread")

    @property
    @abstractmethod
    def mappings(self) -> int:
        """Imported memory mappings currently open (0 after close)."""

    @abstractmethod
    def close(self) -> None:
        """Releases every import. Called only when no swap is running."""

    def orphaned(self) -> None:
        """Called after ``close`` when the runner that owned the memory died: remove what
        only it would have removed (a shared-memory name). Default: nothing to remove."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"layout": self.layout.to_wire(), "mappings": self.mappings}


class BatchedDeviceCache(DeviceCache):
    """A DeviceCache whose backend moves batches (it implements ``swap_many``); ``swap`` is a
    batch of one."""

    async def swap(
        self, direction: Direction, device_ids: Sequence[int], host_ids: Sequence[int], cancel: CancelToken
    ) -> int:
        (error,) = await self.swap_many(direction, [SwapRequest(device_ids, host_ids, cancel)])
        if error is not None:
            raise error
        return len(device_ids) * self.layout.host_block_bytes

    @abstractmethod
    async def swap_many(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        """As DeviceCache.swap_many, implemented by the backend."""


class Backend(ABC):
    name: str

    @abstractmethod
    def create_host_pool(self, capacity: int) -> HostPool: ...

    @abstractmethod
    def import_device_cache(
        self, layout: KVLayout, device: dict[str, Any], pool: HostPool, geometry: HostGeometry, requester: Requester
    ) -> DeviceCache:
        """Blocking (the daemon runs it in an executor). Raises AttachError.

        ``device`` is the client's map exactly as it sent it: decode it strictly (a key
        outside the backend's documented ones is BAD_FIELD). What the daemon knows about the
        asking process comes separately, as ``requester``."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    @abstractmethod
    def close(self) -> None:
        """Releases backend resources (worker threads, streams)."""
