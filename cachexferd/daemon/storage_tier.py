"""The daemon side of the storage tier: runs backend calls off the event loop, in parallel,
with a deadline, and turns their results into command results.

Every command's storage I/O is cut into at most ``storage.io_threads`` shards (contiguous
runs of keys, at least ~4 MiB each) that run on the tier's own I/O threads. The event loop
awaits them with ``storage.timeout_s`` as the limit; past it the command fails with
STORAGE_TIMEOUT. Before that outcome goes out, the tier tells the shards to stop and waits
(at most ``timeout_s`` more) until they let go of the host blocks, so a late read can never
overwrite a host block the engine has reused since. Workers check the stop flag before
every object, so a worker that has not yet reached an object never touches it.

The I/O threads are daemon threads: a store that hangs (a dead NFS server) can delay
outcomes by its timeout but cannot keep the daemon from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..protocol import ErrorCode, ProtocolError
from ..storage.base import (
    NO_ROOM,
    GetItem,
    GetResult,
    GetStatus,
    PutItem,
    StorageBackend,
    StorageFailure,
    StorageTimeoutError,
    StorageUnavailable,
    stamps,
)
from ..storage.journal import NOTHING_TO_WRITE, REMOVED, JournalRecord, Row, object_id
from ..storage.objects import Checksum, ObjectCodec, Verdict, object_name
from .jobs import HoldBlocks
from .storage_feed import StorageFeed

if TYPE_CHECKING:
    from ..backends.base import CancelToken
    from ..config import Config, StorageConfig
    from ..host_cache import HostPool
    from ..metrics import DaemonMetrics

log = logging.getLogger(__name__)
_UNUSABLE = ("missing", "corrupt", "mismatch")  # load statuses that mean the object is not loadable
T = TypeVar("T")
SHARD_MIN_BYTES = 4 << 20
_POLL_S = 0.05  # how often a waiting command looks at its cancel token
Call = Callable[[threading.Event], T]
_Task = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class IOPool:
    """A fixed set of daemon threads running blocking calls (futures in submission order)."""

    def __init__(self, threads: int, name: str = "storage-io") -> None:
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((future, fn))
        return future

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def close(self, timeout_s: float = 2.0) -> None:
        """Lets queued calls finish, then stops; a thread stuck in a call is left behind
        (daemon threads do not keep the process alive) after ``timeout_s`` in all."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


@dataclass
class _Store:
    """A STORE's objects: their names in chain order, host blocks, codec, the object the chain
    extends, and the tags its journal records carry."""

    names: list[str]
    host_ids: Sequence[int]
    codec: ObjectCodec
    parent: str | None
    tags: Sequence[bytes] | None

    def __post_init__(self) -> None:
        self.links = [self.parent, *self.names[:-1]]  # each object's chain link
        self.used = stamps(len(self.names))
        self.reserved = False  # holds room and pins (``reserves_room`` backends) until released


@dataclass
class LoadOutcome:
    statuses: list[str]  # per key: "ok", "missing", "corrupt", "mismatch", "failed"

    @property
    def prefix(self) -> int:
        for i, status in enumerate(self.statuses):
            if status != "ok":
                return i
        return len(self.statuses)


def shards(count: int, item_bytes: int, threads: int) -> list[slice]:
    """Contiguous slices of ``count`` items: at most ``threads``, each about SHARD_MIN_BYTES or more."""
    if count == 0:
        return []
    n = max(1, min(threads, count, (count * item_bytes) // SHARD_MIN_BYTES))
    bounds = [count * i // n for i in range(n + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(n)]


class StorageTier:
    def __init__(self, backend: StorageBackend, config: StorageConfig, pool: HostPool, metrics: DaemonMetrics) -> None:
        self.backend = backend
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.timeout_s = config.timeout_s
        self.checksum = Checksum[config.checksum.upper()]  # of new objects; loads verify either kind
        self.io = IOPool(config.io_threads)
        self.shard_limit = min(config.io_threads, backend.max_shards or config.io_threads)
        journal = backend.journal
        self.feed = StorageFeed(journal, config.namespace, backend.learn) if journal is not None else None
        if journal is not None:
            journal.on_failure = self._journal_failed
        self._journal_group: tuple[concurrent.futures.Future[None] | None, asyncio.Future[None] | None] = (None, None)
        # STOREs running (changed on the event loop). A STORE's journal records wait up to
        # LINGER_S for other STOREs' only while others run: one STORE at a time waits for none.
        self._storing = 0
        self._releasing = threading.Lock()  # a STORE's room is released by exactly one thread

    def start(self) -> None:
        self.io.submit(self.backend.start)
        if self.feed is not None:
            self.feed.start()

    def name_of(self, key: str, version: int) -> str:
        """The object name of ``key`` for a command read under weights ``version``
        (``[namespace/]w<version>/<key>``): KV of other weights never matches."""
        return object_name(key, version, self.config.namespace)

    # Commands ---------------------------------------------------------------------------

    async def store(
        self, keys: Sequence[str], host_ids: Sequence[int], block_bytes: int, fingerprint: str, version: int,
        cancel: CancelToken, parent: str | None = None, tags: Sequence[bytes] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Writes the keys' objects, one chain head first (``parent``: the key before
        ``keys[0]`` in its chain). ``stored`` counts the leading objects a LOAD can deliver
        when the result is built; they are in the journal (with ``tags``) before it is sent."""
        codec = ObjectCodec(fingerprint, block_bytes, self.checksum)
        names = [self.name_of(k, version) for k in keys]
        job = _Store(names, host_ids, codec, None if parent is None else self.name_of(parent, version), tags)
        self._storing += 1
        try:
            return await self._store(job, cancel)
        finally:
            self._storing -= 1

    async def _store(self, job: _Store, cancel: CancelToken) -> dict[str, Any]:
        names, block_bytes = job.names, job.codec.block_bytes
        parts = shards(len(names), block_bytes, self.shard_limit)
        if len(parts) > 1:
            reasons = await self._store_sharded(job, parts, cancel)
            written = None
        else:  # the usual: one I/O call does all, and one hand-off each way
            ((reasons, written),) = await self._run("store", [functools.partial(self._store_at_once, job)], cancel)
        stored = _leading_none(reasons)
        failed = [r for r in reasons if r is not None]
        if failed:
            self.metrics.storage_errors.labels("put_failed").inc(len(failed))
            log.warning("store: %d of %d objects not written (first: %s)", len(failed), len(names), failed[0])
        if failed and stored == 0 and len(failed) == len(names):
            raise ProtocolError(ErrorCode.STORAGE_ERROR, f"no object was written: {failed[0]}")
        if written is None:
            written = self._store_records(job, stored, now=self._storing <= 1)
        await self._written(written)
        if stored and self.backend.drops_writes:
            stored = await self._still_there(names[:stored], cancel)
        done = len(names) - len(failed)
        self.metrics.transfer_bytes.labels("store").inc(done * block_bytes)
        return {"stored": stored, "failed": len(failed), "bytes": done * block_bytes}

    async def _store_sharded(self, job: _Store, parts: list[slice], cancel: CancelToken) -> list[str | None]:
        """A STORE large enough to be written by several I/O threads at once: room first, then
        the shards' writes, then the room released."""
        try:
            (room,) = await self._run("store", [functools.partial(self._reserve, job)], cancel, False)
            parts = shards(room, job.codec.block_bytes, self.shard_limit)
            chunks = await self._run("store", [self._put_call(job, p) for p in parts], cancel)
        finally:  # quick (memory only), but it takes the index lock
            self.io.submit(functools.partial(self._release, job))
        return [r for chunk in chunks for r in chunk] + [NO_ROOM] * (len(job.names) - room)

    def _store_at_once(
        self, job: _Store, stop: threading.Event
    ) -> tuple[list[str | None], concurrent.futures.Future[None]]:
        """A STORE on one I/O thread: room, writes, room released and, when the journal is
        idle, its records written (a lone STORE wakes no other thread)."""
        room = self._reserve(job, stop)
        try:
            reasons = self._put_call(job, slice(0, room))(stop) if room else []
        finally:
            self._release(job)
        reasons += [NO_ROOM] * (len(job.names) - room)
        return reasons, self._store_records(job, _leading_none(reasons), here=True, now=self._storing <= 1)

    def _reserve(self, job: _Store, stop: threading.Event) -> int:
        """How many leading objects the store has room for (all, unless it ``reserves_room``,
        which then holds that room and pins the objects until ``_release``)."""
        if not self.backend.reserves_room or not job.names:
            return len(job.names)
        if self.feed is not None:  # count what other daemons wrote until now, not 0.1 s ago
            with contextlib.suppress(Exception):  # unreadable: the follower logs it; the STORE goes on
                self.feed.catch_up()
        room = self.backend.begin_store(job.names, job.codec.object_bytes, job.parent)
        job.reserved = True
        if stop.is_set():  # the STORE gave up while this ran: its end did not wait for this call
            self._release(job)
        return room

    def _release(self, job: _Store) -> None:
        """Ends the room and pins ``_reserve`` made, once; nothing when it made none (a release
        without its reservation would unpin another STORE's objects, such as a shared parent)."""
        with self._releasing:
            reserved, job.reserved = job.reserved, False
        if reserved:
            self.backend.end_store(job.names, job.parent)

    async def _still_there(self, names: list[str], cancel: CancelToken) -> int:
        """How many leading objects a store that evicts by itself still holds. Asked after the
        journal's append, which takes memory in the same store and may evict some; those found
        gone are recorded removed."""
        (present,) = await self._run("store", [lambda stop: self.backend.exists(names)], cancel, False)
        gone = [n for n, there in zip(names, present) if not there]
        await self._record([JournalRecord(REMOVED, object_id(n)) for n in gone])
        return next((i for i, there in enumerate(present) if not there), len(names))

    async def load(
        self, keys: Sequence[str], host_ids: Sequence[int], block_bytes: int, fingerprint: str, version: int,
        cancel: CancelToken,
    ) -> int:  # fmt: skip
        """Reads objects into host blocks; returns the length of the delivered prefix."""
        codec = ObjectCodec(fingerprint, block_bytes, self.checksum)
        names = [self.name_of(k, version) for k in keys]
        links, used = [None, *names[:-1]], stamps(len(names))

        def call(part: slice) -> Call[list[str]]:
            return lambda stop: self._get(names, host_ids, links, used, part, codec, stop)

        parts = shards(len(keys), block_bytes, self.shard_limit)
        outcome = LoadOutcome([s for chunk in await self._run("load", [call(p) for p in parts], cancel) for s in chunk])
        for kind in ("corrupt", "mismatch", "failed"):
            count = outcome.statuses.count(kind)
            if count:
                self.metrics.storage_errors.labels(kind).inc(count)
        delivered = outcome.prefix
        self.metrics.transfer_bytes.labels("load").inc(delivered * block_bytes)
        if delivered < len(names) and outcome.statuses[delivered] in _UNUSABLE:
            await self._record_missing(names[delivered])
        return delivered

    async def lookup(self, keys: Sequence[str], version: int, cancel: CancelToken) -> int:
        names = [self.name_of(k, version) for k in keys]
        if not names:
            return 0
        (found,) = await self._run("lookup", [lambda stop: self.backend.exists(names)], cancel)
        prefix = next((i for i, present in enumerate(found) if not present), len(found))
        if prefix < len(names):
            await self._record_missing(names[prefix])
        return prefix

    async def delete(self, keys: Sequence[str], version: int, cancel: CancelToken) -> int:
        names = [self.name_of(k, version) for k in keys]
        if not names:
            return 0
        (removed,) = await self._run("delete", [lambda stop: self.backend.delete(names)], cancel)
        await self._record([JournalRecord(REMOVED, object_id(n)) for n in names])
        return removed

    # The journal ------------------------------------------------------------------------

    async def _record_missing(self, name: str) -> None:
        """An object the journal holds as stored was missing or unusable: every daemon on the
        store learns it (a store that evicts by itself, a file deleted by hand)."""
        oid = object_id(name)
        # Checked in memory first: LOOKUPs of new prompts miss all the time, and must not
        # cost a journal read each (an object stored in the last POLL_S is caught next time).
        if self.feed is not None and self.feed.holds(oid):
            await self._record([JournalRecord(REMOVED, oid)])

    async def _record(self, records: Sequence[Row], wait: bool = False) -> None:
        """Queues the records for the journal (written within ``LINGER_S``, in order with every
        record this daemon queued before). ``wait``: returns once they are written (or their
        write failed: a journal that fails costs the journal, not the command)."""
        written = self._submit(records)
        if wait:
            await self._written(written)

    def _submit(self, records: Sequence[Row], here: bool = False, now: bool = False) -> concurrent.futures.Future[None]:
        """The records queued for the journal (``here``: on an I/O thread, which writes them
        itself when the journal is idle; ``now``: no other records are expected, do not
        linger); a done future when there is no journal."""
        journal = self.backend.journal
        if self.feed is None or journal is None or not records:
            return NOTHING_TO_WRITE
        return journal.submit(records, now=now, here=here)

    def _store_records(
        self, job: _Store, stored: int, here: bool = False, now: bool = False
    ) -> concurrent.futures.Future[None]:
        """The first ``stored`` objects' records queued for the journal, as ``_submit`` does
        (see ``Journal.store``)."""
        journal = self.backend.journal
        if self.feed is None or journal is None or not stored:
            return NOTHING_TO_WRITE
        names = job.names if stored == len(job.names) else job.names[:stored]
        return journal.store(names, job.tags or [b""] * stored, job.codec.object_bytes, now=now, here=here)

    async def _written(self, written: concurrent.futures.Future[None]) -> None:
        """Returns once ``written`` is done (its failure is counted and logged by the journal)."""
        if written.done():  # written on the I/O thread, or nothing to write
            return
        group, on_loop = self._journal_group
        if written is not group or on_loop is None:  # one loop future per write, not one per command
            on_loop = asyncio.wrap_future(written)
            self._journal_group = (written, on_loop)
        with contextlib.suppress(Exception):
            await asyncio.shield(on_loop)

    def _journal_failed(self, records: int) -> None:
        self.metrics.storage_errors.labels("journal").inc()

    # Work on the I/O threads ------------------------------------------------------------

    def _view(self, host_id: int, block_bytes: int) -> tuple[memoryview, int]:
        offset = host_id * block_bytes
        return self.pool.memory(offset, block_bytes), self.pool.address + offset

    def _put_call(self, job: _Store, part: slice) -> Call[list[str | None]]:
        """Writes ``part`` of the STORE's objects (the items are built on the I/O thread)."""
        return lambda stop: self.backend.put(self._put_items(job, part), stop)

    def _put_items(self, job: _Store, part: slice) -> list[PutItem]:
        # Backends check ``stop`` before each object and compute its header (the checksum
        # pass) only then: a block the engine may have reused since is never checksummed.
        codec, names, links, used = job.codec, job.names, job.links, job.used
        return [
            PutItem(names[i], *self._view(job.host_ids[i], codec.block_bytes), codec.header, links[i], used[i])
            for i in range(part.start, part.stop)
        ]

    def _get(
        self, names: list[str], host_ids: Sequence[int], links: list[str | None], used: list[int], part: slice,
        codec: ObjectCodec, stop: threading.Event,
    ) -> list[str]:  # fmt: skip
        verify = functools.partial(_verify, codec)
        items = [
            GetItem(names[i], *self._view(host_ids[i], codec.block_bytes), verify, links[i], used[i])
            for i in range(part.start, part.stop)
        ]
        statuses: list[str] = []
        problems: list[str] = []  # logged once per call: a bad batch must not flood the log
        for item, got in zip(items, self.backend.get(items, stop)):
            statuses.append(got.status.value)
            if got.status not in (GetStatus.OK, GetStatus.MISSING) and got.detail != "stopped":
                problems.append(f"{item.name}: {got.status.value}: {got.detail}")
        if problems:
            log.warning("load: %d of %d objects refused or failed (first %s)", len(problems), len(items), problems[0])
        return statuses

    # Waiting ----------------------------------------------------------------------------

    async def _run(self, op: str, calls: list[Call[T]], cancel: CancelToken, count: bool = True) -> list[T]:
        """Runs the calls on the I/O threads; maps every failure to a storage error code.
        ``count``: this is the command's main call (one ``storage_operations`` sample)."""
        stop = threading.Event()
        futures = [asyncio.wrap_future(self.io.submit(functools.partial(call, stop))) for call in calls]
        try:
            await self._wait(futures, cancel)
            results = [f.result() for f in futures]
        except BaseException as exc:
            stop.set()
            stuck: set[asyncio.Future[Any]] = set()
            if futures:  # the workers should let go of host memory before the outcome goes out
                _, stuck = await asyncio.wait(futures, timeout=self.timeout_s)
            for f in futures:  # retrieve, so asyncio does not log "exception never retrieved"
                if f.done() and not f.cancelled():
                    f.exception()
            if isinstance(exc, asyncio.CancelledError):
                raise
            error = self._protocol_error(op, exc)
            self.metrics.storage_ops.labels(op, error.code.name.lower()).inc()
            if stuck:
                # The outcome goes out now; the command's blocks stay reserved until the
                # stuck calls end, so they can never write into a reused host block.
                log.error("%s: %d storage calls still running after the grace period", op, len(stuck))
                raise HoldBlocks(error.code, error.detail, asyncio.gather(*stuck, return_exceptions=True)) from None
            raise error from None
        if count:
            self.metrics.storage_ops.labels(op, "ok").inc()
        return results

    async def _wait(self, futures: list[asyncio.Future[Any]], cancel: CancelToken) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pending = set(futures)
        while pending:
            left = deadline - loop.time()
            if left <= 0:
                raise StorageTimeoutError(f"no answer from the {self.backend.name} backend within {self.timeout_s}s")
            done, pending = await asyncio.wait(pending, timeout=min(left, _POLL_S), return_when=asyncio.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            cancel.check()

    def _protocol_error(self, op: str, exc: BaseException) -> ProtocolError:
        if isinstance(exc, ProtocolError):  # cancelled (detach, shutdown)
            return exc
        if isinstance(exc, StorageUnavailable):
            self.metrics.storage_errors.labels("unavailable").inc()
            return ProtocolError(ErrorCode.STORAGE_UNAVAILABLE, str(exc))
        if isinstance(exc, StorageTimeoutError):
            self.metrics.storage_errors.labels("timeout").inc()
            return ProtocolError(ErrorCode.STORAGE_TIMEOUT, str(exc))
        self.metrics.storage_errors.labels("backend").inc()
        if isinstance(exc, StorageFailure):
            return ProtocolError(ErrorCode.STORAGE_ERROR, str(exc))
        if isinstance(exc, OSError):  # the system refused (read-only, full, permissions): not a bug
            log.warning("%s: the %s backend failed: %s", op, self.backend.name, exc)
            return ProtocolError(ErrorCode.STORAGE_ERROR, f"{op} failed: {exc.strerror or exc}")
        log.exception("%s: unexpected error from the %s backend", op, self.backend.name, exc_info=exc)
        return ProtocolError(ErrorCode.STORAGE_ERROR, f"{type(exc).__name__}: {exc}")

    # Introspection and shutdown ---------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        info = self.backend.describe()
        info.update({"timeout_s": self.timeout_s, "io_threads": self.config.io_threads})
        if self.config.namespace:
            info["namespace"] = self.config.namespace
        if self.feed is not None:
            info["journal"] = self.feed.describe()
        return info

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the I/O threads and closes the backend, neither for longer than ``timeout_s``."""
        if self.feed is not None:
            self.feed.close()
        self.io.close(timeout_s / 2)
        closer = threading.Thread(target=self._close_backend, name="storage-close", daemon=True)
        closer.start()
        closer.join(timeout_s / 2)
        if closer.is_alive():
            log.warning("storage backend %s did not close within %.1fs", self.backend.name, timeout_s / 2)

    def _close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception as exc:
            log.warning("closing storage backend %s: %s", self.backend.name, exc)


def _leading_none(reasons: list[str | None]) -> int:
    """How many leading objects a STORE wrote (its reasons: None per object written)."""
    return next((i for i, r in enumerate(reasons) if r is not None), len(reasons))


def _verify(codec: ObjectCodec, name: str, got: GetResult, payload: memoryview) -> GetResult:
    verdict, why = codec.check(name, got.header, payload, got.received)
    if verdict is Verdict.OK:
        return got
    status = GetStatus.MISMATCH if verdict is Verdict.MISMATCH else GetStatus.CORRUPT
    return GetResult(status, got.header, got.received, why)


def open_storage(config: Config, pool: HostPool, metrics: DaemonMetrics) -> StorageTier | None:
    """The daemon's storage tier, or None for ``storage.backend = "none"``. Connecting is
    left to ``StorageTier.start``. A missing client library or a malformed address is a
    configuration error (ValueError): the operator chose a backend this install cannot run."""
    from ..storage import STORAGE_BACKENDS, load_storage

    try:
        backend = load_storage(config, pool)
    except ImportError as exc:
        spec = STORAGE_BACKENDS.get(config.storage.backend)
        raise ValueError(
            f"storage.backend = {config.storage.backend!r} needs a library that is not installed ({exc}); "
            f"pip install 'cachexferd[{spec.extra if spec else ''}]'"
        ) from None
    if backend is None:
        return None
    return StorageTier(backend, config.storage, pool, metrics)
