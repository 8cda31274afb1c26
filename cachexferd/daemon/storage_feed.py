"""The daemon's view of the shared store, from its journal, and the STORAGE_EVENTS pages.

A thread follows the journal (storage/journal.py): as soon as it is appended to where its
directory can be watched (storage/journal_watch.py; at most every ``POLL_S`` while records keep
coming), else every ``POLL_S``; and an I/O thread catches up before a STORE reserves room.
It keeps what is in the store now (object id -> the batch of records, as read, that stored
it) and the latest ``RING`` changes, each numbered as the daemon read it. Records stay in
their batches: a row is made for a client's page, not for every record read (every daemon
reads every record). STORAGE_EVENTS is answered from memory, on the event loop, under a
short lock: the changes after a client's cursor, or, for a new client (cursor 0), one too
far behind, one of an earlier view (a restarted daemon, records lost), the current state
first (``reset``), page by page from a list of the objects' ids taken for that client.

Cursors are opaque to clients. Inside: ``view << 42 | number`` (the number of the last change
the client has; ``view`` is random per view, so a cursor of another daemon or an earlier
view is never taken for ours), or ``_SNAPSHOT | snapshot number << 32 | index`` for a page of
a state copy.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..storage.journal import OP_NAMES, REMOVED, STORED, Batch, Journal, Row
from ..storage.journal_watch import JournalWatch
from ..storage.objects import parse_object_name

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the journal is read
RING = 200_000  # latest changes kept for clients that follow (their batches, mostly held by the view anyway)
_READ = 16_384  # records read per journal call
_REHOME_MIN = 16  # records of a batch worth keeping as rows once most of them are gone
_SNAPSHOT = 1 << 62
_INDEX_BITS = 32
_NUMBER_BITS = 42
_NUMBER_MASK = (1 << _NUMBER_BITS) - 1


Event = list[Any]  # [number, op, version, key, tag] on the wire


class StorageFeed:
    def __init__(
        self, journal: Journal, namespace: str, on_read: Callable[[list[Batch]], None] | None = None,
        poll_s: float = POLL_S, ring: int = RING,
    ) -> None:  # fmt: skip
        """``on_read``: given the records read that this daemon's own journal object did not
        append as stores (the backend's ``learn``: its own stores are indexed already)."""
        self.journal, self.namespace, self.poll_s, self.on_read = journal, namespace, poll_s, on_read
        self._lock = threading.Lock()  # the view (short holds; the event loop reads it)
        self._reading = threading.Lock()  # one journal read at a time (the follower, I/O threads)
        # object id -> the batch of its stored record, or the record itself when it came alone
        self._objects: dict[bytes, Batch | Row] = {}
        self._ring = _Changes(ring)
        self._number = 0  # of the last change
        self._floor = 0  # cursors numbered below this are too old for the ring: such clients start over
        self._view = random.getrandbits(19) + 1  # never 0: a cursor of 0 is a new client
        self._position = 0  # where the next journal read starts
        self._snapshots = itertools.count(1)
        self._snapshot: tuple[int, list[bytes], int] = (0, [], 0)  # (number, object ids, change number)
        self.records = 0  # records read from the journal
        self.read_cpu_s = 0.0  # CPU time of reading them (decoding, the view, the backend's index)
        self.gaps = 0  # times records were lost before this daemon read them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: JournalWatch | None = None  # wakes the follower on appends
        self._watch_failed = False  # making or waiting on a watch raised (said once)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="storage-journal", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        for timeout_s in (0.5, 2.0):  # woken again should the follower have just made a new watch
            if self._watch is not None:
                self._watch.wake()
            if self._thread is not None:
                self._thread.join(timeout=timeout_s)
        if self._watch is not None and (self._thread is None or not self._thread.is_alive()):
            self._watch.close()

    # Following ------------------------------------------------------------------------------

    def _follow(self) -> None:
        failing = False
        while not self._stop.is_set():
            records = self.records
            try:
                more = self.catch_up()
                if failing:
                    log.info("reading the storage journal works again")
                failing = False
            except Exception as exc:  # never let the follower die: the view would freeze
                if not failing:  # once per outage, not every poll
                    log.warning("reading the storage journal failed (retrying): %s", exc)
                failing, more = True, False
            if not more:
                started = time.thread_time()
                try:
                    self._wait(found=self.records != records and not failing)
                except Exception as exc:  # a watch that fails (no file descriptors left...): poll instead
                    if not self._watch_failed:  # once, not at every poll
                        log.warning("storage journal: waiting for appends failed (polling instead): %s", exc)
                    self._watch_failed = True
                    self._drop_watch()
                    self._stop.wait(self.poll_s)
                with self._reading:  # waking up is part of what following costs
                    self.read_cpu_s += time.thread_time() - started

    def _drop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def _wait(self, found: bool) -> None:
        """Until the journal may have grown. Where the journal's directory can be watched,
        a quiet journal costs a wake-up every few seconds, not every ``poll_s``, and a record
        is read as soon as it is appended; while records come, reads stay ``poll_s`` apart.
        Elsewhere: ``poll_s``."""
        watch = self._watch
        if watch is None or watch.gone:
            self._drop_watch()
            watch = self._watch = self.journal.watch(self.poll_s)
            if watch is not None:
                return  # it reports changes from now on: read once more first
        if watch is None:
            self._stop.wait(self.poll_s)
            return
        read_at = time.monotonic()
        watch.wait()
        # After a read that found records, the next read waits for the rest of ``poll_s``
        # (so a busy journal costs no more reads than polling), but only once there is
        # something to read: a lone append costs one wake-up, not two.
        rest = read_at + self.poll_s - time.monotonic() if found else 0.0
        if rest > 0:
            self._stop.wait(rest)

    def catch_up(self) -> bool:
        """Reads the next records; True when there may be more right away."""
        with self._reading:
            started = time.thread_time()
            try:
                read = self.journal.read(self._position, _READ)
                with self._lock:
                    if read.gap:
                        self._lose_view()
                    self._apply(read.batches)
                    self._position = read.position
                    self.records += (count := read.count)
                if self.on_read is not None and read.news:
                    self.on_read(read.news)
            finally:
                self.read_cpu_s += time.thread_time() - started
            return count >= _READ

    def _lose_view(self) -> None:
        """Records were deleted before we read them: what we hold may be wrong; start over
        from what is left (clients get a reset)."""
        self.gaps += 1
        log.warning("storage journal: records were lost before this daemon read them; its view restarts")
        self._objects.clear()
        self._ring.clear()
        self._view = self._view % (1 << 19) + 1
        self._floor = self._number

    def _apply(self, batches: list[Batch]) -> None:
        """Records kept as read (the name is parsed, and another namespace's skipped, only
        when a client asks): every daemon on the store reads every record, so this is the
        journal's cost per object. A batch of stores (the usual) is applied in C: each
        object maps to its batch, and the batch is one entry of the changes. A lone record is
        kept as a row: a plain tuple the garbage collector stops tracking, where a batch
        object per object (sparse one-object STOREs) would be tracked for as long as it is kept."""
        objects, ring = self._objects, self._ring
        for batch in batches:
            count = len(batch)
            if batch.op == STORED and count == 1:
                row = batch.row(0)
                objects[row[1]] = row
                ring.add(self._number + 1, row, 1)
                self._number += 1
            elif batch.op == STORED and count:
                objects.update(zip(batch.ids, itertools.repeat(batch)))
                ring.add(self._number + 1, batch, count)
                self._number += count
            elif batch.op == REMOVED:
                for object_id in batch.ids:
                    gone = objects.pop(object_id, None)
                    if gone is None:
                        continue
                    self._number += 1  # the record that had stored it, its op made REMOVED
                    ring.add(self._number, (REMOVED, *_record(gone, object_id)[1:]), 1)
                    if isinstance(gone, Batch):
                        self._removed_from(gone)
        # The changes older than the ring's first are gone: clients still before them start over.
        self._floor = max(self._floor, ring.first - 1 if ring.first else self._number)

    def _removed_from(self, batch: Batch) -> None:
        """A batch keeps every record it came with for as long as the view holds one of them:
        once fewer than a quarter are held (the tails of its chains evicted, its heads in
        use), those are kept as rows and the batch can go. So what the view keeps stays
        within a few times what the store holds. (An object stored again counts as held
        here until the batch goes: that only delays this.)"""
        batch.live -= 1
        if 4 * batch.live >= len(batch) or len(batch) < _REHOME_MIN:
            return
        objects = self._objects
        for i, object_id in enumerate(batch.ids):
            if objects.get(object_id) is batch:
                objects[object_id] = batch.row(i)
        batch.live = 0

    def holds(self, object_id: bytes) -> bool:
        return object_id in self._objects

    # Pages ----------------------------------------------------------------------------------

    def page(self, after: int, limit: int) -> dict[str, Any]:
        with self._lock:
            if after & _SNAPSHOT:
                number, index = (after ^ _SNAPSHOT) >> _INDEX_BITS, after & ((1 << _INDEX_BITS) - 1)
                if number == self._snapshot[0]:
                    return self._snapshot_page(index, limit, reset=False)
            elif after >> _NUMBER_BITS == self._view and self._floor <= after & _NUMBER_MASK <= self._number:
                return self._ring_page(after & _NUMBER_MASK, limit)
            self._snapshot = (next(self._snapshots), list(self._objects), self._number)
            return self._snapshot_page(0, limit, reset=True)

    def _cursor(self, number: int) -> int:
        return self._view << _NUMBER_BITS | number

    def _snapshot_page(self, index: int, limit: int, reset: bool) -> dict[str, Any]:
        number, ids, change = self._snapshot
        part = ids[index : index + limit]
        end = index + len(part)
        done = end >= len(ids)
        events = self._events(zip(itertools.repeat(change), self._stored(part)))
        nxt = self._cursor(change) if done else _SNAPSHOT | number << _INDEX_BITS | end
        # The changes since the copy are served after it, unless the ring has moved past them.
        more = not done or self._number > change
        return {"journal": True, "events": events, "next": nxt, "reset": reset, "more": more}

    def _stored(self, ids: list[bytes]) -> Iterator[Row]:
        """The records that stored these objects, as the view holds them now: an object
        removed since the copy was taken is left out (its removal follows the copy), one
        stored again comes with its latest record (and again after the copy)."""
        objects = self._objects
        for object_id in ids:
            held = objects.get(object_id)
            if held is not None:
                yield _record(held, object_id)

    def _ring_page(self, after: int, limit: int) -> dict[str, Any]:
        changes = self._ring.since(after, limit)
        last = changes[-1][0] if changes else after
        return {"journal": True, "events": self._events(changes), "next": self._cursor(last), "reset": False,
                "more": last < self._number}  # fmt: skip

    def _events(self, changes: Iterable[tuple[int, Row]]) -> list[Event]:
        """The wire form of (number, change) for objects of this daemon's namespace."""
        events = []
        for number, (op, _, name, tag, _) in changes:
            parsed = parse_object_name(name, self.namespace)
            if parsed is not None:
                events.append([number, OP_NAMES[op], parsed[0], parsed[1], tag])
        return events

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"objects": len(self._objects), "records": self.records, "gaps": self.gaps,
                    "read_cpu_s": round(self.read_cpu_s, 6), "watched": self._watch is not None,
                    **self.journal.counts(), **self.journal.describe()}  # fmt: skip


class _Changes:
    """The latest ``keep`` changes, numbered in order. An entry is a batch of stores (its
    records numbered one after another, as read) or one removal (the record that had stored
    the object, its op made REMOVED): a batch of stores costs one entry, not one per record."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.clear()

    def clear(self) -> None:
        self.first = 0  # the number of the oldest change kept (0: none)
        self._firsts: list[int] = []  # each entry's first number, increasing
        self._entries: list[Batch | Row] = []
        self._head = 0  # entries before this one are dropped
        self._skip = 0  # changes of the head entry dropped
        self._held = 0  # changes kept

    def add(self, first: int, entry: Batch | Row, count: int) -> None:
        self._firsts.append(first)
        self._entries.append(entry)
        self._held += count
        excess = self._held - self.keep
        while excess > 0:  # the oldest go: whole entries, then part of the next
            left = _count(self._entries[self._head]) - self._skip
            if left > excess:
                self._skip += excess
                break
            self._head, self._skip, excess = self._head + 1, 0, excess - left
        self._held = min(self._held, self.keep)
        if self._head > 1024 and 2 * self._head > len(self._entries):  # drop the dropped entries' places
            del self._firsts[: self._head], self._entries[: self._head]
            self._head = 0
        self.first = self._firsts[self._head] + self._skip

    def since(self, after: int, limit: int) -> list[tuple[int, Row]]:
        """(number, change) of at most ``limit`` changes after ``after`` (first - 1 <= after)."""
        out: list[tuple[int, Row]] = []
        i, start = max(bisect.bisect_right(self._firsts, after + 1, self._head) - 1, self._head), after + 1
        while i < len(self._entries) and len(out) < limit:
            entry, first = self._entries[i], self._firsts[i]
            if isinstance(entry, Batch):
                stop = min(len(entry), start - first + limit - len(out))
                out += [(first + j, entry.row(j)) for j in range(start - first, stop)]
            elif first >= start:  # one change, not one the client has
                out.append((first, entry))
            i += 1
            start = self._firsts[i] if i < len(self._firsts) else start
        return out


def _count(entry: Batch | Row) -> int:
    return len(entry) if isinstance(entry, Batch) else 1


def _record(held: Batch | Row, object_id: bytes) -> Row:
    """The record of ``object_id`` in what the view holds for it: a batch, or the record."""
    return held.row_of(object_id) if isinstance(held, Batch) else held
