"""The storage journal: what a shared store gained and lost, in one order every daemon reads.

Daemons that share a store (one directory mounted by several hosts, or every rank's daemon on
one host) each see only their own commands: a daemon cannot tell that another one evicted an
object. So every daemon appends to one journal kept in the store itself: ``stored`` when a
STORE's object is in the store (with the tag its client gave it: the engine's own name for
the block), ``removed`` when it evicts or deletes one, or finds one missing or unusable. Every
daemon follows the whole journal (daemon/storage_feed.py) and so knows every object any of
them wrote or lost; engines read it with STORAGE_EVENTS (docs/protocol.md §12.8).

A record names its object by ``object_id``: the 16-byte BLAKE2b digest of the object's name
(the file backend's file name, §4.1 of docs/storage.md), so an eviction found by path is
recorded without the name; ``stored`` records carry the name and tag as well.

Positions are opaque increasing integers: a reader passes back the position it reached.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import itertools
import logging
import operator
import os
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from .journal_watch import JournalWatch, StreamWatch, watch_directory
from .objects import crc32

log = logging.getLogger(__name__)

STORED, REMOVED = 0, 1  # a record's op, as written
OP_NAMES = ("stored", "removed")  # STORAGE_EVENTS' names of the ops
SEGMENT_BYTES = 16 << 20  # a journal file is closed for appends beyond this size
KEEP_SEGMENTS = 8  # files kept (~128 MiB, about 700,000 records); older ones are deleted
_SEGMENT_SHIFT = 40  # position = segment number << 40 | offset in the segment
FRAME_RECORDS = 1024  # records per frame (at most ~400 KB)
FORMAT = 2  # a frame's first field: frames of other formats are skipped
_MAX_FRAME = 1 << 20  # a length beyond this is not a frame (a damaged file)
# A frame in a file: this magic, the body's length and its CRC-32, then the body. With them a
# reader finds the next whole frame after bytes that are not one (a write torn by a full disk
# or a writer killed mid-write, a damaged file) and reads on from there, instead of losing
# every record after them or reading a damaged record as another one. (As a length, the magic
# is far beyond _MAX_FRAME: a reader of an earlier release skips such a file.)
_FILE_MAGIC = b"cxJ2"
_FILE_HEAD = struct.Struct("<4sII")
TORN_AFTER_S = 10.0  # a file that ends in an unfinished frame and has not changed for this long: torn
REDIS_KEY = "cachexferd:journal"  # cannot be an object's name: those start with "w<version>/" or "<namespace>/"
REDIS_MAX_ENTRIES = 10_000  # stream entries kept (trimming counts entries, not records)
STREAM_BLOCK_S = 1.0  # the longest blocking read of a Redis journal's reader
REDIS_FRAME_RECORDS = 20  # records per entry at most: the stream keeps at most ~200,000 records (~40 MB)
_SEQ_BITS = 20  # position = milliseconds << 20 | sequence number within the millisecond
_MINE = 4096  # own appends remembered until read back
_RECENT_NAMES = 1 << 16  # object digests kept (a few MB)
LINGER_S = 0.002  # journal writes start at most this often: records that come sooner go together
LINGER_RECORDS = 4 * FRAME_RECORDS  # records queued beyond this are written without waiting


@functools.lru_cache(maxsize=_RECENT_NAMES)
def object_id(name: str) -> bytes:
    """The 16-byte BLAKE2b digest of an object's name: its file's name in the file backend,
    its name in the journal. Kept for recent names: one STORE asks for each object's several
    times (room, write, chain link, journal), and hashing costs about a microsecond."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


class JournalRecord(NamedTuple):  # a tuple: hundreds of thousands are made per second
    op: int  # STORED or REMOVED
    object_id: bytes
    name: str = ""  # the object's name (stored records)
    tag: bytes = b""  # the STORE's tag for the object (stored records)
    size: int = 0  # the object's bytes (stored records; 0: not known)


# A record as a plain tuple in JournalRecord's order (made only where one record is needed:
# records travel and are kept as batches, below).
Row = tuple[int, bytes, str, bytes, int]
# A Row's fields, read in C
_ID_OF, _NAME_OF, _TAG_OF, _OP_AND_SIZE = (operator.itemgetter(1), operator.itemgetter(2), operator.itemgetter(3),
                                           operator.itemgetter(0, 4))  # fmt: skip


class Batch:
    """Records of one op and object size, as columns: a STORE's, a frame read back, one of
    this daemon's own appends. Every daemon on a store reads every record and a STORE's
    records cross several threads, so they stay columns (the object ids split out, in C)
    and a record is made into a row only when asked for: a page for a client, a removal of
    one of its objects. Following the journal costs a dictionary entry per object, not an
    object per record."""

    __slots__ = ("_at", "ids", "live", "names", "op", "size", "tags")

    def __init__(self, op: int, ids: Sequence[bytes], size: int = 0, names: Sequence[str] | None = None,
                 tags: Sequence[bytes] | None = None) -> None:  # fmt: skip
        self.op, self.ids, self.size = op, ids, size  # size: each object's bytes (0: not known)
        self.names = ("",) * len(ids) if names is None else names  # removals carry none
        self.tags = (b"",) * len(ids) if tags is None else tags
        self._at: dict[bytes, int] | None = None  # object id -> its last index, made when first needed
        self.live = len(ids)  # records a view still holds from this batch (the view counts them down)

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, i: int) -> Row:
        return (self.op, self.ids[i], self.names[i], self.tags[i], self.size)

    def rows(self) -> list[Row]:
        count = len(self.ids)
        return list(zip(itertools.repeat(self.op, count), self.ids, self.names, self.tags,
                        itertools.repeat(self.size, count)))  # fmt: skip

    def row_of(self, object_id: bytes) -> Row:
        """The record of ``object_id`` (the last, should it be here twice). The first call
        indexes the batch (a removal, usually: the rest of its objects go the same way)."""
        if self._at is None:
            self._at = dict(zip(self.ids, range(len(self.ids))))
        return self.row(self._at[object_id])


def stored_batch(names: Sequence[str], tags: Sequence[bytes], size: int) -> Batch:
    """The records of a STORE's objects (``size`` bytes each), with their tags (one per name:
    those beyond are left out)."""
    return Batch(
        STORED, tuple(map(object_id, names)), size, names, tags if len(tags) == len(names) else tags[: len(names)]
    )


def batches_of(records: Sequence[Row] | Batch) -> list[Batch]:
    """Records as batches: one per run of records of the same op and size."""
    if isinstance(records, Batch):  # what a STORE hands over
        return [records] if records.ids else []
    out = []
    for (op, size), run in itertools.groupby(records, key=_OP_AND_SIZE):
        part = list(run)
        out.append(Batch(op, list(map(_ID_OF, part)), size, list(map(_NAME_OF, part)), list(map(_TAG_OF, part))))
    return out


def rows_of(batches: Sequence[Batch]) -> list[Row]:
    return [row for batch in batches for row in batch.rows()]


@dataclass(frozen=True, slots=True)
class JournalRead:
    batches: list[Batch]  # in the journal's order
    position: int  # where the next read starts
    gap: bool = False  # records between the position asked and the first one returned are lost
    # The batches not appended by this Journal object as stores only (what this daemon's
    # backend knows already need not be indexed again); None: all of them.
    others: list[Batch] | None = None

    @property
    def news(self) -> list[Batch]:
        return self.batches if self.others is None else self.others

    @property
    def count(self) -> int:
        """Records read."""
        return records_in(self.batches)

    @property
    def records(self) -> list[Row]:
        """The records read, as rows (each made here)."""
        return rows_of(self.batches)


class Journal(ABC):
    """Appends from any daemon, reads in one order; thread-safe. ``submit`` never blocks on I/O
    unless asked to write ``here`` (the event loop calls it); reads block (I/O threads only).

    Records are written in groups by a thread of the journal's own, at most one write every
    ``LINGER_S``: a record that comes after a quiet spell (or ``now``: none other is expected)
    is written at once, one that comes sooner waits for the rest of ``LINGER_S`` and goes
    with every record that came meanwhile. So the records of STOREs that finish together
    (several requests' stores in one engine step) cost one write, not one each, and a lone
    STORE waits for none: its I/O thread writes its records itself, no thread is woken for
    them. Every daemon reads
    the journal every ``POLL_S`` (0.1 s), so the wait delays no reader noticeably. A daemon that is
    killed loses at most its last ``LINGER_S`` of records, none of a STORE it reported (its
    outcome waits for them): other daemons learn of those removals when they find the objects
    missing, and of those stores when the objects are stored again."""

    def __init__(self) -> None:
        self._group: list[Batch] = []  # records queued for the next write, in order
        self._grouped = 0  # records in it
        self._group_written: Future[None] = Future()  # completes when that group is written
        # The group's last batch when it holds stores in lists of the journal's own (its
        # names and tags): later STOREs of the same object size join it (see ``store``).
        self._tail: tuple[Batch, list[str], list[bytes]] | None = None
        self._last_group: Future[None] = NOTHING_TO_WRITE  # the last group taken for writing
        self._last_write = -LINGER_S  # when it was taken (monotonic)
        self._lock = threading.Lock()  # entered directly: a Condition's own enter is a Python call
        self._queue = threading.Condition(self._lock)
        self._now = False  # a caller waits for the group: write it without lingering
        self._closing = False
        self._stopped = False  # the writer thread is gone (closed)
        self._writer: threading.Thread | None = None
        self._writing = threading.Lock()  # one write at a time (the writer thread, or callers after close)
        self.submits = 0  # calls that queued records
        self.writes = 0  # writes made (submits / writes: how many shared one)
        self.written = 0  # records written
        self.failed = 0  # records whose write failed
        self.skipped = 0  # stretches read that were not a whole frame (torn, damaged), frames of another format
        self.write_cpu_s = 0.0  # CPU time of the writes (making the frames included)
        self.on_failure: Callable[[int], None] | None = None  # given the records of each failed write

    def submit(self, records: Sequence[Row] | Batch, now: bool = False, here: bool = False) -> Future[None]:
        """Queues the records (rows, or a batch; a STORE's go through ``store``) after every
        record queued before them; the future completes once they are written (or with the
        error their write failed with, which is also logged). ``now``: no other records are
        expected soon (or the caller waits for these), so their write does not linger.
        ``here``: the caller may block (an I/O thread), so records that would be written at
        once (nothing queued or being written and, unless ``now``, no write for ``LINGER_S``)
        are written by it before this returns, without waking the journal's thread."""
        batches = batches_of(records)
        return self._submit(batches, now, here) if batches else NOTHING_TO_WRITE

    def store(self, names: Sequence[str], tags: Sequence[bytes], size: int, now: bool = False,
              here: bool = False) -> Future[None]:  # fmt: skip
        """A STORE's records (its objects, ``size`` bytes each, with their tags: one per
        name), as ``submit`` takes them but without a batch of their own: the records of
        STOREs that queue one behind the other are added to one batch's columns (a burst of
        one-object STOREs costs two list appends each, not an object each; the batch's
        object ids are made from its names when its write starts)."""
        count = len(names)
        if len(tags) != count:
            tags = tags[:count]
        with self._lock:
            tail = self._tail
            if tail is not None and tail[0].size == size and count:
                tail[1].extend(names)
                tail[2].extend(tags)
                self._grouped += count
                self.submits += 1
                if (now or self._grouped >= LINGER_RECORDS) and not self._now:
                    self._now = True
                    self._queue.notify()
                return self._group_written
        if not count:
            return NOTHING_TO_WRITE
        names_of, tags_of = list(names), list(tags)
        batch = Batch(STORED, tuple(map(object_id, names)), size, names_of, tags_of)
        return self._submit([batch], now, here, (batch, names_of, tags_of))

    def _submit(self, batches: list[Batch], now: bool, here: bool,
                tail: tuple[Batch, list[str], list[bytes]] | None = None) -> Future[None]:  # fmt: skip
        """``submit``'s work (``tail``: the last batch's columns, when they may grow)."""
        with self._lock:
            if self._stopped:  # closed: written here
                return self._write_now(batches)
            if here and self._idle(now) and self._writing.acquire(blocking=False):
                written: Future[None] = Future()
                self._last_group, self._last_write = written, time.monotonic()
                self.submits += 1
            else:
                future = self._queued(batches, now)
                _seal(self._tail)  # records after it go in a batch of their own
                self._tail = tail
                return future
        self._write_group(batches, written, held=True)  # later records queue behind it
        return written

    def _idle(self, now: bool) -> bool:
        """Nothing queued or being written and, unless ``now``, no write started within
        ``LINGER_S`` (so records that come close together share a write). Called under ``_lock``."""
        if self._group or not self._last_group.done():
            return False
        return now or time.monotonic() >= self._last_write + LINGER_S

    def _queued(self, batches: list[Batch], now: bool) -> Future[None]:
        """Queues the records for the journal's thread (called under ``_lock``)."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_groups, name="storage-journal-writer", daemon=True)
            self._writer.start()
        if (now or self._grouped >= LINGER_RECORDS) and not self._now:  # told once is enough
            self._now = True
            self._queue.notify()
        elif not self._group:
            self._queue.notify()  # the writer sleeps until records come
        self._group += batches
        self._grouped += records_in(batches)
        self.submits += 1
        return self._group_written

    def append(self, records: Sequence[Row]) -> None:
        """Writes the records (after every record queued before them) and returns once they
        are; raises what their write failed with."""
        self.submit(records, now=True).result()

    def flush(self, timeout_s: float | None = None) -> None:
        """Returns once every record queued until now is written (or its write failed)."""
        with self._lock:
            if self._group:
                self._now = True
                self._queue.notify()
                last = self._group_written
            else:
                last = self._last_group  # the group being written, if one is
        with contextlib.suppress(Exception):  # failed: counted and logged where it failed
            last.exception(timeout_s)

    def _write_groups(self) -> None:
        while True:
            with self._lock:
                while not self._group and not self._closing:
                    self._queue.wait()
                linger = self._last_write + LINGER_S - time.monotonic()
                if linger > 0 and not self._now and not self._closing:
                    self._queue.wait(linger)  # more records may join this write
                group, written, tail = self._group, self._group_written, self._tail
                if not group:
                    self._stopped = True  # closing, nothing left: later records are written by their callers
                    return
                self._group, self._group_written, self._now, self._grouped = [], Future(), False, 0
                self._tail = None  # written from now on: it grows no more
                self._last_group, self._last_write = written, time.monotonic()
            _seal(tail)
            self._write_group(group, written)

    def _write_now(self, batches: list[Batch]) -> Future[None]:
        written: Future[None] = Future()
        self._write_group(batches, written)
        return written

    def _write_group(self, batches: list[Batch], written: Future[None], held: bool = False) -> None:
        """Writes the batches (``held``: the caller holds ``_writing`` already) and completes ``written``."""
        count = records_in(batches)
        try:
            if not held:
                self._writing.acquire()
            try:
                started = time.thread_time()
                try:
                    self._write(batches)
                finally:
                    self.write_cpu_s += time.thread_time() - started
                self.writes += 1
                self.written += count
            finally:
                self._writing.release()
        except Exception as exc:  # the store's own error types, OSError, a server gone
            self.failed += count
            log.warning("storage journal: %d record(s) not written: %s", count, exc)
            if self.on_failure is not None:
                self.on_failure(count)
            written.set_exception(exc)
        else:
            written.set_result(None)

    def close(self) -> None:
        """Writes what is queued, stops the writer thread and releases what the journal holds."""
        with self._lock:
            self._closing = True
            self._stopped = self._writer is None
            self._queue.notify()
            writer = self._writer
        if writer is not None:
            writer.join(timeout=5.0)

    @abstractmethod
    def _write(self, batches: list[Batch]) -> None:
        """Writes the batches, in order, as one unit no other writer's records interleave."""

    @abstractmethod
    def read(self, position: int, limit: int) -> JournalRead:
        """About ``limit`` records (whole appends) after ``position`` (0: the oldest kept)."""

    def watch(self, poll_s: float) -> JournalWatch | None:
        """What wakes a reader when records may have been appended (None: poll every ``poll_s``)."""
        return None

    def _decode(self, body: bytes) -> Batch | None:
        batch = decode_frame(body)
        if batch is None:
            if not self.skipped:  # once: a daemon of another release writes on, frame after frame
                log.warning("storage journal: skipped a frame that is not of this release's format "
                            "(damage, or a daemon of another release on this store)")  # fmt: skip
            self.skipped += 1
        return batch

    def describe(self) -> dict[str, object]:
        return {}

    def counts(self) -> dict[str, float]:
        """What this daemon wrote (records written, the writes they took, records not written,
        the writes' CPU seconds) and the frames it read but could not use."""
        return {"written": self.written, "writes": self.writes, "not_written": self.failed, "skipped": self.skipped,
                "write_cpu_s": round(self.write_cpu_s, 6)}  # fmt: skip


# What a submit that has nothing to write returns: a future that is already done.
NOTHING_TO_WRITE: Future[None] = Future()
NOTHING_TO_WRITE.set_result(None)


def _seal(tail: tuple[Batch, list[str], list[bytes]] | None) -> None:
    """A batch that STOREs joined (``Journal.store``), once it takes no more: its object ids,
    for all of them (one call per batch; the STOREs placed their objects by these ids, so
    they come from ``object_id``'s cache)."""
    if tail is not None:
        batch = tail[0]
        batch.ids = tuple(map(object_id, batch.names))
        batch.live = len(batch.ids)


def merged(batches: Sequence[Batch]) -> list[Batch]:
    """The batches with each run of the same op and size joined into one (grouped in C): the
    STOREs of one write, the frames of one read (one entry in a reader's view and one
    object for the garbage collector, however small the STOREs were)."""
    if len(batches) <= 1:
        return list(batches)
    return [_joined(list(run)) for _, run in itertools.groupby(batches, key=_KIND)]


def _joined(run: list[Batch]) -> Batch:
    if len(run) == 1:
        return run[0]
    chain = itertools.chain.from_iterable
    ids, names, tags = chain(map(_IDS, run)), chain(map(_NAMES, run)), chain(map(_TAGS, run))
    return Batch(run[0].op, tuple(ids), run[0].size, tuple(names), tuple(tags))


def records_in(batches: Sequence[Batch]) -> int:
    return sum(map(len, map(_IDS, batches)))  # in C: thousands of small batches in a write


_KIND = operator.attrgetter("op", "size")
_IDS, _NAMES, _TAGS = operator.attrgetter("ids"), operator.attrgetter("names"), operator.attrgetter("tags")


def frames(batches: Sequence[Batch], per_frame: int = FRAME_RECORDS) -> list[bytes]:
    """The batches' records as frames of at most ``per_frame``, one per run of records of the
    same op and size (a write's are usually all stores of one size): a msgpack array
    ``[FORMAT, op, size, object ids (one byte string, 16 bytes each), [names], [tags]]``.
    Columns, not a row per record: every daemon on the store decodes every record, and a
    frame's columns are decoded and checked with a few C calls, not one Python object per field."""
    out = []
    for batch in merged(batches):
        op, size, ids, names, tags = batch.op, batch.size, batch.ids, batch.names, batch.tags
        for i in range(0, len(ids), per_frame):
            end = i + per_frame
            out.append(msgpack.packb([FORMAT, op, size, b"".join(ids[i:end]), names[i:end], tags[i:end]],
                                     use_bin_type=True))  # fmt: skip
    return out


def file_frames(bodies: Sequence[bytes]) -> bytes:
    """Frames as a file journal appends them: each after its magic, length and CRC-32."""
    parts: list[bytes] = []
    for body in bodies:
        parts += (_FILE_HEAD.pack(_FILE_MAGIC, len(body), crc32(body)), body)
    return b"".join(parts)


def _next_frame(data: bytes, start: int, whole: bool) -> int | None:
    """Where the first frame at or after ``start`` begins: a magic followed by a whole frame
    whose CRC-32 matches or (unless ``whole``) by one that runs past ``data`` and may still be
    being written. ``whole``: whole frames follow one another from there to the end of
    ``data``, so that a frame's bytes inside a write still under way (a tag may hold some)
    are not taken for a frame. None: there is none."""
    at = data.find(_FILE_MAGIC, start)
    while at >= 0:
        if whole:
            end = at
            while 0 <= end < len(data):
                end = _whole_frame_end(data, end)
            if end == len(data):
                return at
        elif at + _FILE_HEAD.size > len(data):
            return at
        else:
            size = _FILE_HEAD.unpack_from(data, at)[1]
            if size <= _MAX_FRAME and (at + _FILE_HEAD.size + size > len(data) or _whole_frame_end(data, at) > 0):
                return at
        at = data.find(_FILE_MAGIC, at + 1)
    return None


def _whole_frame_end(data: bytes, at: int) -> int:
    """Where the frame at ``at`` ends; -1 when no whole frame is there (no magic, a length
    beyond any frame's, bytes missing, a CRC-32 that does not match)."""
    if at + _FILE_HEAD.size > len(data):
        return -1
    magic, size, crc = _FILE_HEAD.unpack_from(data, at)
    end: int = at + _FILE_HEAD.size + size
    if magic != _FILE_MAGIC or size > _MAX_FRAME or end > len(data) or crc32(data[at + _FILE_HEAD.size : end]) != crc:
        return -1
    return end


def _resume(data: bytes, at: int, past: int) -> int:
    """Where to read on after bytes at ``at`` that are not a whole frame: the next frame, else
    past every byte read that cannot begin one (at least to ``past``)."""
    nxt = _next_frame(data, at + 1, whole=False)
    return max(past, len(data) - len(_FILE_MAGIC) + 1) if nxt is None else nxt


@functools.lru_cache(maxsize=64)
def _ids_format(count: int) -> struct.Struct:
    return struct.Struct("16s" * count)  # splits a frame's ids in one C call


def decode_frame(body: bytes) -> Batch | None:
    """A frame's records as a batch; None when the bytes are not a frame of this format (a
    writer of another release, damage). Every column's type and length is checked (in C): a
    record the daemon cannot use would otherwise stop its reading at that frame."""
    try:
        fmt, op, size, ids, names, tags = msgpack.unpackb(body, use_list=False)
    except (ValueError, TypeError, msgpack.UnpackException):  # not msgpack, not an array of 6
        return None
    count = len(names) if type(names) is tuple else -1
    if fmt != FORMAT or type(op) is not int or op not in (STORED, REMOVED) or type(size) is not int or size < 0:
        return None
    if type(ids) is not bytes or len(ids) != 16 * count or type(tags) is not tuple or len(tags) != count:
        return None
    if not set(map(type, names)) <= {str} or not set(map(type, tags)) <= {bytes}:
        return None
    return Batch(op, _ids_format(count).unpack(ids), size, names, tags)


class FileJournal(Journal):
    """Append-only files ``<dir>/<segment number, 12 digits>.log`` in the storage directory.

    Each write (a group of appends) is one ``write`` on a file opened with ``O_APPEND``: on a
    local file system the kernel places it whole at the end, so writers of every daemon on the machine never
    interleave (a network file system does not promise that: see docs/storage.md §4.1). A
    writer that finds the current file over ``SEGMENT_BYTES`` starts the next one (the first
    to create it wins) and deletes files beyond ``KEEP_SEGMENTS``; readers move on to the next
    file once the current one stopped growing and the next exists.
    """

    def __init__(self, directory: str, segment_bytes: int = SEGMENT_BYTES, keep: int = KEEP_SEGMENTS) -> None:
        super().__init__()
        self.directory = directory
        self.segment_bytes, self.keep = segment_bytes, keep
        self.appended = 0  # records this process appended
        # This object's own appends of stores, by (segment, offset), until read back: taken
        # from memory instead of decoded (a writer reads back everything it writes).
        self._mine: dict[tuple[int, int], tuple[int, list[Batch]]] = {}
        self._mine_lock = threading.Lock()  # appends add, reads take: on different threads
        self._appending = -1  # the file appends go to (-1: not known yet)
        self._paths: dict[int, str] = {}  # segment -> its file's path

    # Appending ------------------------------------------------------------------------------

    def _write(self, batches: list[Batch]) -> None:
        batches = merged(batches)  # read back as they are remembered: one batch per run
        data = file_frames(frames(batches))
        # Opened per write, never held: a file open for writing would keep the storage file
        # system from being remounted read-only or unmounted.
        segment, fd = self._open()
        try:
            done = os.write(fd, data)  # one write: whole, after every other writer's (O_APPEND)
            end = os.lseek(fd, 0, os.SEEK_CUR)  # where this write ended, whoever wrote since
        finally:
            os.close(fd)
        if done != len(data):  # the file system filled up (or a file size limit): readers skip the torn bytes
            raise OSError(errno.ENOSPC, f"storage journal: a write was cut short ({done} of {len(data)} bytes)")
        self.appended += records_in(batches)
        self._remember(segment, end - len(data), len(data), batches)
        if end >= self.segment_bytes:
            self._rotate(segment + 1)

    def _remember(self, segment: int, start: int, length: int, batches: list[Batch]) -> None:
        if any(b.op != STORED for b in batches):
            return  # removals are rare: decoded like another writer's
        with self._mine_lock:
            if len(self._mine) >= _MINE:  # not read back (reads failing): forget the oldest
                del self._mine[next(iter(self._mine))]
            self._mine[(segment, start)] = (length, batches)

    def _open(self) -> tuple[int, int]:
        """The newest file, open for appending. The file last appended to is taken unless the
        next one exists (another writer rotated) or it is gone: one ``stat`` per append, not
        a listing of the directory."""
        if self._appending >= 0 and not _exists(self._path(self._appending + 1)):
            with contextlib.suppress(FileNotFoundError):
                return self._appending, os.open(self._path(self._appending), os.O_WRONLY | os.O_APPEND)
        self._appending = max(self._newest(), 0)
        path = self._path(self._appending)
        try:
            return self._appending, os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        except FileNotFoundError:  # the first append: the directory is made here
            os.makedirs(self.directory, mode=0o750, exist_ok=True)
            return self._appending, os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def _rotate(self, nxt: int) -> None:
        with contextlib.suppress(FileExistsError):  # another writer started it first
            os.close(os.open(self._path(nxt), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640))
        for old in self._segments():
            if old <= nxt - self.keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(old))

    # Reading --------------------------------------------------------------------------------

    def read(self, position: int, limit: int) -> JournalRead:
        segment, offset = divmod(position, 1 << _SEGMENT_SHIFT)
        size = self._last_file_size(segment) if position else None
        if size is not None:  # reading on in the newest file: neither a listing nor a gap
            own = self._own_appends(segment, offset, size)
            return own if own is not None else self._read_files(segment, offset, limit, [])
        segments = self._segments()
        if not segments:
            return JournalRead([], position)
        gap = False
        if position == 0 or segment < segments[0]:
            gap = position != 0  # the records after ``position`` were deleted with their file
            segment, offset = segments[0], 0
        return self._read_files(segment, offset, limit, segments, gap)

    def _read_files(self, segment: int, offset: int, limit: int, segments: list[int], gap: bool = False) -> JournalRead:
        """About ``limit`` records from ``offset`` of ``segment``, then of the later files
        among ``segments`` once each earlier one is finished."""
        batches: list[Batch] = []
        others: list[Batch] = []
        count = 0
        while count < limit:
            read_to, size, got = self._read_segment(segment, offset, limit - count, batches, others)
            count += got
            progressed, offset = read_to != offset, read_to
            if progressed and read_to < size:
                continue  # more of this file than one read takes
            later = [s for s in segments if s > segment]
            if not later or not self._finished(segment, offset):
                break
            segment, offset = later[0], 0
        self._forget_mine_before((segment, offset))
        return JournalRead(merged(batches), (segment << _SEGMENT_SHIFT) | offset, gap, others)

    def _last_file_size(self, segment: int) -> int | None:
        """The size of ``segment``'s file when it is the newest one; None when it is gone (the
        reader fell behind: the full read says so) or a later one was started. Two ``stat``s:
        every daemon reads after every append, where a listing of the directory costs four
        system calls more."""
        try:
            size = os.stat(self._path(segment)).st_size
        except FileNotFoundError:
            return None
        return None if _exists(self._path(segment + 1)) else size

    def _own_appends(self, segment: int, offset: int, size: int) -> JournalRead | None:
        """What came after ``offset`` of the newest file when no byte of it need be read:
        nothing (it still ends there), or only this object's own appends, taken from memory
        (a writer reads back each of its writes). None: another writer's bytes are there."""
        batches: list[Batch] = []
        with self._mine_lock:
            starts, at = [], offset
            while at < size:
                mine = self._mine.get((segment, at))
                if mine is None:
                    return None
                starts.append(at)
                batches += mine[1]
                at += mine[0]
            if at != size:
                return None
            for start in starts:
                del self._mine[(segment, start)]
        self._forget_mine_before((segment, size))
        return JournalRead(merged(batches), (segment << _SEGMENT_SHIFT) | size, others=[])

    def _forget_mine_before(self, place: tuple[int, int]) -> None:
        """Drops own appends a read has passed (read from the file: it raced with the append)."""
        with self._mine_lock:
            while self._mine:
                first = next(iter(self._mine))  # appends are remembered in the order they landed
                if first >= place:
                    return
                del self._mine[first]

    def _read_segment(
        self, segment: int, offset: int, limit: int, out: list[Batch], others: list[Batch]
    ) -> tuple[int, int, int]:
        """Reads about ``limit`` records of ``segment`` from ``offset``; returns (where reading
        stopped, the file's size when read, the records read)."""
        try:
            fd = os.open(self._path(segment), os.O_RDONLY)
        except FileNotFoundError:
            return offset, offset, 0
        try:  # what was appended since, up to a bound (a whole frame always fits)
            file_size = os.fstat(fd).st_size
            data = (
                os.pread(fd, min(file_size - offset, max(2 * _MAX_FRAME, limit * 256)), offset)
                if file_size > offset
                else b""
            )
        finally:
            os.close(fd)
        at = count = 0
        whole_file = offset + len(data) >= file_size  # else frames may run past what was read
        while count < limit and at + _FILE_HEAD.size <= len(data):
            with self._mine_lock:
                mine = self._mine.pop((segment, offset + at), None)
            if mine is not None and at + mine[0] <= len(data):
                out += mine[1]
                count += records_in(mine[1])
                at += mine[0]
                continue
            magic, size, crc = _FILE_HEAD.unpack_from(data, at)
            end = at + _FILE_HEAD.size + size
            if magic != _FILE_MAGIC or size > _MAX_FRAME:
                at = self._skip(segment, offset, at, _resume(data, at, at + 1))
                continue
            if end > len(data):  # being written, or a torn write: torn if a whole frame follows
                nxt = _next_frame(data, at + 1, whole=True) if whole_file else None
                if nxt is None:
                    break
                at = self._skip(segment, offset, at, nxt)
                continue
            body = data[at + _FILE_HEAD.size : end]
            if crc32(body) != crc:
                at = self._skip(segment, offset, at, _resume(data, at, end))
                continue
            batch = self._decode(body)
            if batch is not None:
                out.append(batch)
                others.append(batch)
                count += len(batch)
            at = end
        return offset + at, file_size, count

    def _skip(self, segment: int, offset: int, at: int, to: int) -> int:
        """Bytes ``at``..``to`` of what was read from ``offset`` are not a whole frame: skipped."""
        self.skipped += 1
        log.warning("storage journal %s: %d bytes at byte %d are not a whole frame (a torn write or damage); "
                    "reading on after them", self._path(segment), to - at, offset + at)  # fmt: skip
        return to

    def _finished(self, segment: int, offset: int) -> bool:
        """Whether every record of ``segment`` was read: a writer may still append to a file
        for a moment after another started the next one, so the file must end at ``offset``,
        or what follows must have stopped changing ``TORN_AFTER_S`` ago: an unfinished frame
        whose writer died or whose disk filled up."""
        try:
            stat = os.stat(self._path(segment))
        except FileNotFoundError:
            return True
        if stat.st_size <= offset:
            return True
        if time.time() - stat.st_mtime < TORN_AFTER_S:
            return False
        self._skip(segment, offset, 0, stat.st_size - offset)
        return True

    # Files ----------------------------------------------------------------------------------

    def _path(self, segment: int) -> str:
        path = self._paths.get(segment)
        if path is None:  # every append and every poll asks for the same two
            if len(self._paths) >= 16:
                self._paths.clear()
            path = self._paths[segment] = f"{self.directory}/{segment:012d}.log"
        return path

    def watch(self, poll_s: float) -> JournalWatch | None:
        """The journal's directory watched for appends; before the first append made it, the
        storage directory, until something is made there. None where neither exists yet or
        inotify is unavailable."""
        if os.path.isdir(self.directory):
            return watch_directory(self.directory, poll_s)
        parent = os.path.dirname(self.directory)
        return watch_directory(parent, poll_s, once=True) if os.path.isdir(parent) else None

    def _segments(self) -> list[int]:
        try:
            names = os.listdir(self.directory)
        except OSError:  # not created yet, or the storage path is unusable (status says why)
            return []
        return sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit())

    def _newest(self) -> int:
        segments = self._segments()
        return segments[-1] if segments else -1

    def describe(self) -> dict[str, object]:
        segments = self._segments()
        return {"path": self.directory, "files": len(segments)}


class RedisJournal(Journal):
    """A Redis (or Valkey) stream ``key`` in the store's own server, trimmed to about
    ``max_records`` (XADD MAXLEN ~): the stream's entry ids order the records; a reader whose
    last record was trimmed away learns that it may have missed some (``gap``)."""

    def __init__(self, client: Any, key: str = REDIS_KEY, max_entries: int = REDIS_MAX_ENTRIES) -> None:
        super().__init__()
        self.client, self.key, self.max_entries = client, key, max_entries
        self._read_to = 0  # the position the last read reached

    def watch(self, poll_s: float) -> JournalWatch | None:
        """A blocking read of the entries after the last one read (one wait at most a second,
        and under the client's socket timeout)."""
        timeout_s = self.client.connection_pool.connection_kwargs.get("socket_timeout") or STREAM_BLOCK_S * 2
        return StreamWatch(self.client, self.key, self._after, poll_s, min(STREAM_BLOCK_S, timeout_s / 2))

    def _after(self) -> str:
        return _stream_id(self._read_to) if self._read_to else "0-0"

    def _write(self, batches: list[Batch]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for frame in frames(batches, REDIS_FRAME_RECORDS):  # one entry per frame
            pipe.xadd(self.key, {b"r": frame}, maxlen=self.max_entries, approximate=True)
        pipe.execute()

    def read(self, position: int, limit: int) -> JournalRead:
        after = "-" if position == 0 else f"({_stream_id(position)}"
        pipe = self.client.pipeline(transaction=False)  # one round trip: every daemon asks every POLL_S
        pipe.xrange(self.key, min=after, max="+", count=max(1, limit // 16))
        pipe.xrange(self.key, min="-", max="+", count=1)  # the oldest entry kept
        entries, first = pipe.execute()
        batches = [b for _, fields in entries if (b := self._decode(fields.get(b"r", b""))) is not None]
        end = _position(entries[-1][0]) if entries else position
        self._read_to = end
        return JournalRead(merged(batches), end, gap=position != 0 and _trimmed_after(first, position))

    def describe(self) -> dict[str, object]:
        return {"stream": self.key}


def _exists(path: str) -> bool:
    """``os.path.exists`` without the exception it makes of a missing file (a few µs, and the
    usual answer here: the next segment is not started yet)."""
    return os.access(path, os.F_OK)


def _trimmed_after(first: list[Any], position: int) -> bool:
    """Whether records after ``position`` may have been trimmed, given the stream's oldest
    entry: trimming takes the oldest first, so while the record at ``position`` is still
    there, none after it is gone. A stream that is gone (evicted, flushed) lost everything."""
    return not first or _position(first[0][0]) > position


def _position(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms) << _SEQ_BITS | int(seq or 0)


def _stream_id(position: int) -> str:
    return f"{position >> _SEQ_BITS}-{position & ((1 << _SEQ_BITS) - 1)}"
