"""The small interface every storage backend implements.

A backend moves whole objects (header + one host block) between the daemon's host pool and
a store, by name. Every method is blocking and thread-safe: the daemon calls them from its
storage I/O threads, several at once, never from the event loop. Payload buffers are
memoryviews straight into the host pool (``address`` is the same memory as an integer
pointer, for backends that register the pool, like Mooncake).

Failure model:
- a whole call that cannot reach the store raises ``StorageUnavailable`` (the daemon keeps
  serving, answers STORAGE_UNAVAILABLE, and tries again on the next command);
- a call the store answered too slowly raises ``StorageTimeoutError`` (STORAGE_TIMEOUT);
- anything else the store refused as a whole raises ``StorageFailure`` (STORAGE_ERROR);
- per-object problems are results, not exceptions: ``put`` returns a reason per failed
  object, ``get`` a status per object (a missing object is a normal miss).

``stop`` is set when the daemon no longer wants a call's result (timeout, cancel): a backend
checks it between objects and must not write into host memory once it is set.

Chains. The objects of one STORE or LOAD are one chain of KV blocks, head first: each item
names the object before it (``parent``) and carries a last-use ``stamp`` (head newest).
Backends that evict on their own order (file) use both to evict chain tails before heads;
before a STORE's puts the daemon calls ``begin_store`` (room for how many leading objects)
and after them ``end_store``. Backends whose store evicts by its own policy while a STORE
writes (Redis ``maxmemory``, Mooncake) set ``drops_writes``: the daemon then checks which
written objects are still there before it reports them stored.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .journal import Batch, Journal

NO_ROOM = (
    "no room: the store (storage.capacity or its file system) is full of objects that may not make room for this "
    "one: objects of stores still running, the chain this store extends, or, for an object whose chain is cut "
    "off, objects that still load from their chain's head"
)
_STAMP_STEP_NS = 1000  # between neighbours of one command (1 µs: file systems keep µs at least)


def stamps(count: int, now_ns: int | None = None) -> list[int]:
    """Last-use times for a command's ``count`` objects, head first: the head is the most
    recent, so least-recently-used eviction without links still takes the tail first."""
    base = time.time_ns() if now_ns is None else now_ns
    return [base - i * _STAMP_STEP_NS for i in range(count)]


class StorageUnavailable(Exception):
    """The store cannot be reached (down, refused, still connecting)."""


class StorageTimeoutError(Exception):
    """The store did not answer in time."""


class StorageFailure(Exception):
    """The store answered a whole call with an error."""


class GetStatus(StrEnum):
    OK = "ok"  # header + payload delivered (and, after GetItem.landed, verified)
    MISSING = "missing"  # never stored, deleted or evicted: a normal miss
    MISMATCH = "mismatch"  # the stored object has another size, layout or format
    CORRUPT = "corrupt"  # the object failed verification (GetItem.landed)
    FAILED = "failed"  # the store failed for this object (detail says why)


@dataclass(slots=True)
class GetResult:
    status: GetStatus
    header: bytes = b""
    received: int = 0  # bytes the store delivered, header included
    detail: str = ""


MISSING = GetResult(GetStatus.MISSING)
HeaderFn = Callable[[str, memoryview], bytes]
VerifyFn = Callable[[str, GetResult, memoryview], GetResult]


@dataclass(slots=True)
class PutItem:
    """One object to write. Backends call ``header()`` right before sending the object, so
    the checksum pass reads a block that the write is about to read too (cache-hot)."""

    name: str
    payload: memoryview  # one host block, read-only use
    address: int  # pointer to payload
    make_header: HeaderFn
    parent: str | None = None  # the object before this one in its chain (None: a head, or not known)
    stamp: int = 0  # last use, ns since the epoch (0: now)

    def header(self) -> bytes:
        return self.make_header(self.name, self.payload)


@dataclass(slots=True)
class GetItem:
    """One object to read. Backends pass each result through ``landed()`` as soon as the
    object is in place, so verification reads a block that is still in the CPU cache."""

    name: str
    payload: memoryview  # one host block to fill
    address: int  # pointer to payload
    verify: VerifyFn | None = None
    parent: str | None = None  # the object before this one in the LOAD's chain
    stamp: int = 0  # last use, ns since the epoch (0: now)

    def landed(self, result: GetResult) -> GetResult:
        if self.verify is None or result.status is not GetStatus.OK:
            return result
        return self.verify(self.name, result, self.payload)


class StorageBackend(ABC):
    name: str
    # How many calls one command's objects may be split into (None: storage.io_threads).
    # Backends whose client parallelises a batch itself (Mooncake) want 1.
    max_shards: int | None = None
    # The store may evict objects by its own policy while a STORE writes (the daemon checks).
    drops_writes: bool = False
    # The backend makes room for a STORE in ``begin_store`` (and pins its objects until ``end_store``).
    reserves_room: bool = False
    # Where every daemon on the store records what it stored and lost (None: not kept).
    journal: Journal | None = None

    def start(self) -> None:  # noqa: B027 - optional hook
        """Begins connecting (in the background for remote stores); never blocks for long."""

    def begin_store(self, names: list[str], object_bytes: int, parent: str | None = None) -> int:
        """Before a STORE's puts (``reserves_room`` backends): makes room, never by evicting
        objects of stores still running or ``parent`` (the object the chain of ``names``
        extends), keeps them from eviction until ``end_store``, and returns how many leading
        objects fit (the daemon writes only those)."""
        return len(names)

    def end_store(self, names: list[str], parent: str | None = None) -> None:  # noqa: B027 - optional hook
        """After the STORE's puts have returned (or were abandoned)."""

    def learn(self, batches: Sequence[Batch]) -> None:  # noqa: B027 - optional hook
        """What the journal says every daemon on the store did (``journal`` backends; on the
        journal's reading thread): a backend that evicts by itself indexes others' objects."""

    @abstractmethod
    def put(self, items: list[PutItem], stop: threading.Event) -> list[str | None]:
        """Writes each object; returns None per stored object, else the reason it was not."""

    @abstractmethod
    def get(self, items: list[GetItem], stop: threading.Event) -> list[GetResult]:
        """Reads each object: header into the result, payload into ``item.payload``; every
        result goes through ``item.landed`` before it is returned."""

    @abstractmethod
    def exists(self, names: list[str]) -> list[bool]:
        """Presence of each object (may stop early: entries after the first False may be False)."""

    @abstractmethod
    def delete(self, names: list[str]) -> int:
        """Removes the objects; returns how many existed and were removed."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections and registrations; called once, after the last call returned."""
