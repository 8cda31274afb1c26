"""The daemon's view of the shared store, from its journal, and the STORAGE_EVENTS pages.

A thread follows the journal (storage/journal.py) every ``POLL_S`` (and an I/O thread catches
up before a STORE reserves room): it keeps what is in the store now (object id -> the record
that stored it) and the latest ``RING`` changes, each numbered as the daemon read it.
STORAGE_EVENTS is answered from memory, on the event loop, under a short lock: the changes
after a client's cursor, or, for a new client (cursor 0), one too far behind, one of an
earlier view (a restarted daemon, records lost), the current state first (``reset``), page
by page from a copy taken for that client.

Cursors are opaque to clients. Inside: ``view << 42 | number`` (the number of the last change
the client has; ``view`` is random per view, so a cursor of another daemon or an earlier
view is never taken for ours), or ``_SNAPSHOT | snapshot number << 32 | index`` for a page of
a state copy.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..storage.journal import ID_OF, OP_NAMES, OP_OF, REMOVED, STORED, Journal, Row
from ..storage.objects import parse_object_name

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the journal is read
RING = 200_000  # latest changes kept for clients that follow (about 40 MB)
_READ = 16_384  # records read per journal call
_SNAPSHOT = 1 << 62
_INDEX_BITS = 32
_NUMBER_BITS = 42
_NUMBER_MASK = (1 << _NUMBER_BITS) - 1


Event = list[Any]  # [number, op, version, key, tag] on the wire


class StorageFeed:
    def __init__(
        self, journal: Journal, namespace: str, on_read: Callable[[list[Row]], None] | None = None,
        poll_s: float = POLL_S, ring: int = RING,
    ) -> None:  # fmt: skip
        """``on_read``: given the records read that this daemon's own journal object did not
        append as stores (the backend's ``learn``: its own stores are indexed already)."""
        self.journal, self.namespace, self.poll_s, self.on_read = journal, namespace, poll_s, on_read
        self._lock = threading.Lock()  # the view (short holds; the event loop reads it)
        self._reading = threading.Lock()  # one journal read at a time (the follower, I/O threads)
        self._objects: dict[bytes, Row] = {}  # object id -> its stored record
        # The latest changes, numbered floor + 1 .. number in order: a stored record as read,
        # or, for a removal, the record that had stored the object with its op made REMOVED.
        self._ring: deque[Row] = deque(maxlen=ring)
        self._number = 0  # of the last change
        self._floor = 0  # cursors numbered below this are too old for the ring: such clients start over
        self._view = random.getrandbits(19) + 1  # never 0: a cursor of 0 is a new client
        self._position = 0  # where the next journal read starts
        self._snapshots = itertools.count(1)
        self._snapshot: tuple[int, list[Row], int] = (0, [], 0)  # (number, objects, change number)
        self.records = 0  # records read from the journal
        self.read_cpu_s = 0.0  # CPU time of reading them (decoding, the view, the backend's index)
        self.gaps = 0  # times records were lost before this daemon read them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="storage-journal", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    # Following ------------------------------------------------------------------------------

    def _follow(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                more = self.catch_up()
                if failing:
                    log.info("reading the storage journal works again")
                failing = False
            except Exception as exc:  # never let the follower die: the view would freeze
                if not failing:  # once per outage, not every poll
                    log.warning("reading the storage journal failed (retrying every %.1fs): %s", self.poll_s, exc)
                failing, more = True, False
            if not more:
                started = time.thread_time()
                self._stop.wait(self.poll_s)
                with self._reading:  # waking up is part of what following costs
                    self.read_cpu_s += time.thread_time() - started

    def catch_up(self) -> bool:
        """Reads the next records; True when there may be more right away."""
        with self._reading:
            started = time.thread_time()
            try:
                read = self.journal.read(self._position, _READ)
                with self._lock:
                    if read.gap:
                        self._lose_view()
                    self._apply(read.records)
                    self._position = read.position
                    self.records += len(read.records)
                if self.on_read is not None and read.news:
                    self.on_read(read.news)
            finally:
                self.read_cpu_s += time.thread_time() - started
            return len(read.records) >= _READ

    def _lose_view(self) -> None:
        """Records were deleted before we read them: what we hold may be wrong; start over
        from what is left (clients get a reset)."""
        self.gaps += 1
        log.warning("storage journal: records were lost before this daemon read them; its view restarts")
        self._objects.clear()
        self._ring.clear()
        self._view = self._view % (1 << 19) + 1
        self._floor = self._number

    def _apply(self, records: list[Row]) -> None:
        """Records kept as read (the name is parsed, and another namespace's skipped, only
        when a client asks): every daemon on the store reads every record, so this is the
        journal's cost per object; a batch of stores alone (the usual) is applied in C."""
        objects, ring = self._objects, self._ring
        if set(map(OP_OF, records)) == {STORED}:
            objects.update(zip(map(ID_OF, records), records))
            ring.extend(records)
            self._number += len(records)
        else:
            for record in records:
                if record[0] == STORED:
                    objects[record[1]] = record
                    ring.append(record)
                else:
                    gone = objects.pop(record[1], None)
                    if gone is None:
                        continue
                    ring.append((REMOVED, *gone[1:]))
                self._number += 1
        # The changes older than the ring's first are gone: clients still before them start over.
        self._floor = max(self._floor, self._number - len(ring))

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
            self._snapshot = (next(self._snapshots), list(self._objects.values()), self._number)
            return self._snapshot_page(0, limit, reset=True)

    def _cursor(self, number: int) -> int:
        return self._view << _NUMBER_BITS | number

    def _snapshot_page(self, index: int, limit: int, reset: bool) -> dict[str, Any]:
        number, objects, change = self._snapshot
        part = objects[index : index + limit]
        end = index + len(part)
        done = end >= len(objects)
        events = self._events(itertools.repeat(change), part)
        nxt = self._cursor(change) if done else _SNAPSHOT | number << _INDEX_BITS | end
        # The changes since the copy are served after it, unless the ring has moved past them.
        more = not done or self._number > change
        return {"journal": True, "events": events, "next": nxt, "reset": reset, "more": more}

    def _ring_page(self, after: int, limit: int) -> dict[str, Any]:
        first = len(self._ring) - (self._number - after)  # the ring holds changes floor+1 .. number, in order
        tail = list(itertools.islice(self._ring, first, first + limit))
        events = self._events(itertools.count(after + 1), tail)
        last = after + len(tail)
        return {"journal": True, "events": events, "next": self._cursor(last), "reset": False,
                "more": last < self._number}  # fmt: skip

    def _events(self, numbers: Iterable[int], changes: Iterable[Row]) -> list[Event]:
        """The wire form of changes to objects of this daemon's namespace."""
        events = []
        for number, (op, _, name, tag, _) in zip(numbers, changes):
            parsed = parse_object_name(name, self.namespace)
            if parsed is not None:
                events.append([number, OP_NAMES[op], parsed[0], parsed[1], tag])
        return events

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"objects": len(self._objects), "records": self.records, "gaps": self.gaps,
                    "read_cpu_s": round(self.read_cpu_s, 6), **self.journal.counts(),
                    **self.journal.describe()}  # fmt: skip
