"""What the file backend evicts, and when: objects cut off from their chain's head first,
then chain tails, least recently used first; never an object of a store still running, nor
the object a running store extends.

KV objects form chains: the object of block i is only useful after the objects of blocks
0..i-1 (a LOAD delivers a prefix). Evicting a chain's head makes its whole tail useless, so,
like the engine's prefix index, the index evicts **leaves** only: an object that another
object names as its parent is not evicted until that child is. The daemon learns the links
from the commands: the keys of one STORE or LOAD are one chain, in order, and a STORE that
extends an earlier chain names that chain's last key as ``parent``.

An object whose parent is gone (evicted, deleted, removed by hand, or never stored) is
**cut off**, and so is everything after it: a LOAD from the chain's head stops before it.
Cut-off leaves are evicted before any object that still loads from its head. A STORE that
names its ``parent`` pins it: room for the new objects is never made by evicting the end of
the chain they extend, which would cut them off. A STORE whose new objects are cut off from
the start (its parent is missing) may only evict other cut-off objects: it never shortens a
loadable chain for objects a LOAD from the head cannot reach. So, under pressure, a chain
shrinks from its end, and a chain that grows past the room left stops growing.

Links live in memory. The order survives a restart through the objects' mtimes: each use
stamps a command's objects head first, a microsecond apart (base.stamps), so after a rescan
that knows no links, least recently used is still tails first within each command.

Objects other daemons stored arrive from the store's journal in batches (``arrived``): every
daemon on a store learns every object, so they are kept as plain tuples made in C, queued
for eviction in the order they came, and get a full entry only when this daemon uses, links
or pins one. They are chain heads to this daemon (it does not know their links).

``reserve`` runs before a STORE writes: it pins the STORE's objects and its parent (nothing
evicts them until ``release``), evicts other leaves to make room under ``storage.capacity``
and on the file system, and says how many leading objects fit. So a STORE never evicts what
it has just written, and what it reports stored is there when it reports it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

LOW_WATER = 0.9  # eviction for the capacity frees down to this fraction of it
_MAX_WALK = 1 << 20  # links followed when checking that a new link makes no cycle
_CUT, _WHOLE = 0, 1  # eviction rank: cut-off objects go before those that load from their head

# An object's key: the file backend uses its 16-byte id; anything hashable and ordered works.
Key = TypeVar("Key", str, bytes)
_COMPACT_SLACK = 4096  # stale candidates tolerated beyond twice the live ones


@dataclass(slots=True)
class _Entry(Generic[Key]):
    size: int
    used: int  # last use, ns since the epoch (as the file's mtime)
    parent: Key | None = None
    cut: bool = False  # an object on the way to its chain's head is gone

    @property
    def rank(self) -> int:
        return _CUT if self.cut else _WHOLE


class EvictionIndex(Generic[Key]):
    """Sizes, last uses and chain links of the objects in a directory; thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.total = 0  # bytes of the objects indexed
        self.evicted = 0
        self.scanned = False  # the first scan has finished: eviction knows the whole directory
        self._entries: dict[Key, _Entry[Key]] = {}
        self._children: dict[Key, set[Key]] = {}  # path -> present objects naming it as parent (it may be gone)
        self._pins: Counter[Key] = Counter()  # path -> running stores that will write it or extend it
        self._reserved: dict[Key, tuple[int, int, bool]] = {}  # path -> (bytes, disk bytes, cut) not yet written
        self._reserved_bytes = 0
        self._reserved_disk = 0
        self._heap: list[tuple[int, int, Key]] = []  # (rank, used, path): candidates, checked when popped
        # Objects other daemons stored, not used here yet: path -> (bytes, arrival ns), and
        # the same paths queued by arrival, oldest first (candidates, checked when taken).
        self._arrived: dict[Key, tuple[int, int]] = {}
        self._arrivals: deque[tuple[int, set[Key]]] = deque()
        self._queued = 0  # paths in _arrivals, stale ones included
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries) + len(self._arrived)

    # Uses -------------------------------------------------------------------------------------

    def used(self, path: Key, size: int, stamp: int = 0, parent: Key | None = None) -> None:
        """``path`` (``size`` bytes) was written or read at ``stamp`` (ns; 0: now); ``parent``:
        the object before it in its chain, when the command said."""
        stamp = stamp or time.time_ns()
        with self._lock:
            entry = self._entries.get(path) or self._promote(path)
            if entry is None:
                entry = self._add(path, size, stamp)
            else:
                self.total += size - entry.size
                entry.size, entry.used = size, max(entry.used, stamp)
            bytes_, disk, _ = self._reserved.pop(path, (0, 0, False))
            self._reserved_bytes -= bytes_
            self._reserved_disk -= disk
            if parent is not None:
                self._link(path, entry, parent)
            heapq.heappush(self._heap, (entry.rank, entry.used, path))

    def _add(self, path: Key, size: int, stamp: int) -> _Entry[Key]:
        """A new object: a chain's head until a link says otherwise. Objects that named it as
        their parent while it was gone load from the head again if it does."""
        entry = self._entries[path] = _Entry(size, stamp)
        self.total += size
        self._reattach(path)
        return entry

    def _reattach(self, path: Key) -> None:
        for child in self._children.get(path, ()):
            self._set_cut(child, False)

    def _promote(self, path: Key) -> _Entry[Key] | None:
        """An arrived object this daemon uses, links to or pins: a full entry from now on
        (its place in the arrival queue goes stale). None when ``path`` had not arrived."""
        got = self._arrived.get(path)
        if got is None:
            return None
        entry = self._entries[path] = _Entry(*got)
        del self._arrived[path]  # after the entry is in: a lock-free ``in`` always finds one
        heapq.heappush(self._heap, (_WHOLE, entry.used, path))
        return entry

    def _link(self, path: Key, entry: _Entry[Key], parent: Key) -> None:
        self._promote(parent)  # a parent is not a leaf: only full entries track their children
        if parent != entry.parent and parent != path:
            if self._children.get(path) and self._descends(parent, path):
                return  # a link that would close a cycle (odd keys): keep the old one
            if entry.parent is not None:
                self._unchild(entry.parent, path)
            entry.parent = parent
            self._children.setdefault(parent, set()).add(path)
        self._set_cut(path, self._cut_below(parent))

    def _cut_below(self, parent: Key) -> bool:
        """Whether an object after ``parent`` is cut off from its chain's head: the parent is
        neither indexed nor about to be written by a running store, or is cut off itself."""
        entry = self._entries.get(parent)
        if entry is not None:
            return entry.cut
        if parent in self._arrived:
            return False
        reserved = self._reserved.get(parent)
        return True if reserved is None else reserved[2]

    def _set_cut(self, path: Key, cut: bool) -> None:
        """Marks ``path`` and every object after it cut off (or not), as far as that changes."""
        todo = [path]
        while todo:
            current = todo.pop()
            entry = self._entries.get(current)
            if entry is None or entry.cut is cut:
                continue
            entry.cut = cut
            heapq.heappush(self._heap, (entry.rank, entry.used, current))
            todo.extend(self._children.get(current, ()))

    def _descends(self, path: Key, ancestor: Key) -> bool:
        """Whether ``ancestor`` is on ``path``'s chain towards its head (or the walk is too long)."""
        for _ in range(_MAX_WALK):
            entry = self._entries.get(path)
            if entry is None or entry.parent is None:
                return False
            if entry.parent == ancestor:
                return True
            path = entry.parent
        return True

    def _unchild(self, parent: Key, child: Key) -> None:
        children = self._children.get(parent)
        if children is None:
            return
        children.discard(child)
        if not children:
            del self._children[parent]
            entry = self._entries.get(parent)
            if entry is not None:  # a leaf again: a candidate
                heapq.heappush(self._heap, (entry.rank, entry.used, parent))

    def __contains__(self, path: Key) -> bool:
        return path in self._entries or path in self._arrived  # dict lookups: no lock needed

    def arrived(self, paths: Sequence[Key], sizes: Sequence[int], stamp: int) -> None:
        """Objects another daemon stored (``sizes`` bytes each), learned at ``stamp`` (ns),
        unless indexed already. Every daemon on a store learns every object: one batch costs
        a few C calls, not a Python loop over its objects."""
        with self._lock:
            arrived = self._arrived
            new = set(paths).difference(self._entries).difference(arrived)  # one arg each: O(batch)
            if not new:
                return
            size = sizes[0] if sizes else 0
            if sizes.count(size) == len(sizes):  # the usual: one model's objects, one size
                arrived.update(zip(new, itertools.repeat((size, stamp))))  # one tuple shared
                self.total += size * len(new)
            else:
                size_of = dict(zip(paths, sizes))
                new_sizes = list(map(size_of.__getitem__, new))
                arrived.update(zip(new, zip(new_sizes, itertools.repeat(stamp))))
                self.total += sum(new_sizes)
            self._arrivals.append((stamp, new))
            self._queued += len(new)
            for path in self._children.keys() & new:  # objects named it as their parent while it was gone
                self._promote(path)
                self._reattach(path)
            if self._queued > 2 * len(arrived) + _COMPACT_SLACK:
                self._compact_arrivals()

    def known(self, path: Key, size: int, mtime: int) -> None:
        """``path`` is on disk (written by another daemon since the last scan): indexed as a
        chain's head, last used at ``mtime``, unless already indexed."""
        self.known_many([(path, size, mtime)])

    def known_many(self, objects: Iterable[tuple[Key, int, int]]) -> None:
        """``known`` for each (path, bytes, mtime), under one hold of the lock."""
        with self._lock:  # the journal brings every object other daemons store: kept short
            entries, heap, children, push, added = self._entries, self._heap, self._children, heapq.heappush, 0
            for path, size, mtime in objects:
                if path in entries or path in self._arrived:
                    continue
                entries[path] = _Entry(size, mtime)
                added += size
                if path in children:  # objects named it as their parent while it was gone
                    self._reattach(path)
                push(heap, (_WHOLE, mtime, path))
            self.total += added

    def discard(self, path: Key) -> None:
        """``path`` is gone (deleted, or missing at a scan)."""
        with self._lock:
            self._remove(path)

    def _remove(self, path: Key) -> _Entry[Key] | None:
        got = self._arrived.pop(path, None)
        if got is not None:  # no links: arrived objects that gain one become full entries
            self.total -= got[0]
            return _Entry(*got)
        entry = self._entries.pop(path, None)
        if entry is not None:
            self.total -= entry.size
            if entry.parent is not None:
                self._unchild(entry.parent, path)
            for child in self._children.get(path, ()):  # what followed it no longer loads from the head
                self._set_cut(child, True)
        return entry

    def whole(self, path: Key) -> bool:
        """Whether an object after ``path`` would load from its chain's head."""
        with self._lock:
            return not self._cut_below(path)

    # Eviction ---------------------------------------------------------------------------------

    def victims(self, need: int = 0, cut_only: bool = False) -> list[Key]:
        """Removes and returns the paths to evict: down to the low-water mark when over the
        capacity, and at least ``need`` bytes (a full disk); ``cut_only``: cut-off objects only."""
        with self._lock:
            over = 0
            if self.capacity and self.total > self.capacity and self.scanned:
                over = self.total - int(self.capacity * LOW_WATER)
            return self._evict(max(over, need), 0, 1, cut_only)[0]

    def _evict(self, need: int, need_disk: int, block: int, cut_only: bool = False) -> tuple[list[Key], int, int]:
        """Leaves, cut-off ones first, least recently used first, until ``need`` bytes and
        ``need_disk`` bytes of ``block``-sized file-system blocks are freed. Returns (paths,
        bytes, disk bytes)."""
        out: list[Key] = []
        freed = freed_disk = 0
        while freed < need or freed_disk < need_disk:
            path = self._next_victim(cut_only)
            if path is None:
                break
            entry = self._remove(path)
            assert entry is not None  # _next_victim checked
            freed += entry.size
            freed_disk += _on_disk(entry.size, block)
            out.append(path)
        self.evicted += len(out)
        self._compact()
        return out, freed, freed_disk

    def _next_victim(self, cut_only: bool) -> Key | None:
        """The next leaf to evict: cut-off ones first, then the least recently used of the
        full entries (heap) and the arrived objects (queue, oldest first)."""
        heap, arrivals = self._heap, self._arrivals
        while heap or arrivals:
            if heap and (heap[0][0] == _CUT or not arrivals or heap[0][1] <= arrivals[0][0]):
                if cut_only and heap[0][0] != _CUT:
                    return None
                rank, used, path = heapq.heappop(heap)
                entry = self._entries.get(path)
                if entry is None or entry.used != used or entry.rank != rank:
                    continue  # stale: the entry was used, cut or removed since
                if path in self._children or self._pins[path]:
                    continue  # not a candidate now (pushed again when it becomes one)
                return path
            if cut_only:  # arrived objects are chain heads
                return None
            stamp, batch = arrivals[0]
            path = batch.pop()
            self._queued -= 1
            if not batch:
                arrivals.popleft()
            got = self._arrived.get(path)
            if got is not None and got[1] == stamp:  # else: promoted, removed or arrived again
                return path
        return None

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._entries) + _COMPACT_SLACK:
            self._heap = [(e.rank, e.used, p) for p, e in self._entries.items()]
            heapq.heapify(self._heap)
        if self._queued > 2 * len(self._arrived) + _COMPACT_SLACK:
            self._compact_arrivals()

    def _compact_arrivals(self) -> None:
        """Queues the arrived objects again, without the stale places."""
        by_stamp: dict[int, set[Key]] = {}
        for path, (_, stamp) in self._arrived.items():
            by_stamp.setdefault(stamp, set()).add(path)
        self._arrivals = deque(sorted(by_stamp.items()))
        self._queued = len(self._arrived)

    # Stores -----------------------------------------------------------------------------------

    def reserve(
        self, paths: Sequence[Key], size: int, disk_free: int | None = None, block: int = 1, parent: Key | None = None
    ) -> tuple[int, list[Key]]:
        """Before a store writes ``paths`` (``size`` bytes each) after ``parent`` (the chain's
        object before them, if any): pins them and the parent, picks what to evict so that they
        fit under the capacity and in ``disk_free`` bytes of the file system (None: unknown),
        and reserves room for the leading ones that fit. Returns (how many leading paths fit,
        the paths to evict). Objects cut off from the start only make room among cut-off ones."""
        with self._lock:
            for path in _with_parent(paths, parent):
                self._pins[path] += 1
                self._promote(path)  # pinned: a full entry, so that a release makes it a candidate again
            cut = parent is not None and self._cut_below(parent)
            adds = [0 if p in self._entries or p in self._reserved else size for p in paths]
            cap_left = self._capacity_left()
            disk_left = None if disk_free is None else disk_free - self._reserved_disk
            need = sum(adds)
            short = need - cap_left if cap_left is not None else 0
            short_disk = sum(_on_disk(a, block) for a in adds) - disk_left if disk_left is not None else 0
            evicted: list[Key] = []
            if short > 0 or short_disk > 0:
                if short > 0:  # evicting anyway: free down to the low-water mark
                    short = max(short, self.total + self._reserved_bytes + need - int(self.capacity * LOW_WATER))
                evicted, freed, freed_disk = self._evict(max(short, 0), max(short_disk, 0), block, cut)
                cap_left = None if cap_left is None else cap_left + freed
                disk_left = None if disk_left is None else disk_left + freed_disk
            return self._reserve_leading(paths, adds, cap_left, disk_left, block, cut), evicted

    def _reserve_leading(
        self, paths: Sequence[Key], adds: list[int], cap_left: int | None, disk_left: int | None, block: int, cut: bool
    ) -> int:
        room = 0
        for path, add in zip(paths, adds):
            disk = _on_disk(add, block)
            if (cap_left is not None and add > cap_left) or (disk_left is not None and disk > disk_left):
                break
            if add:
                self._reserved[path] = (add, disk, cut)
                self._reserved_bytes += add
                self._reserved_disk += disk
                cap_left = None if cap_left is None else cap_left - add
                disk_left = None if disk_left is None else disk_left - disk
            room += 1
        return room

    def _capacity_left(self) -> int | None:
        if not self.capacity or not self.scanned:  # no limit, or not knowing the directory yet
            return None
        return self.capacity - self.total - self._reserved_bytes

    def release(self, paths: Sequence[Key], parent: Key | None = None) -> None:
        """The store of ``paths`` (after ``parent``) has ended: unpins them and drops what it
        reserved but did not write."""
        with self._lock:
            for path in _with_parent(paths, parent):
                self._pins[path] -= 1
                if self._pins[path] > 0:
                    continue
                del self._pins[path]
                bytes_, disk, _ = self._reserved.pop(path, (0, 0, False))
                self._reserved_bytes -= bytes_
                self._reserved_disk -= disk
                entry = self._entries.get(path)
                if entry is not None:
                    heapq.heappush(self._heap, (entry.rank, entry.used, path))

    def pinned(self, path: Key) -> bool:
        with self._lock:
            return self._pins[path] > 0

    # Scans ------------------------------------------------------------------------------------

    def merge(self, scanned: list[tuple[Key, int, int]], started: int) -> None:
        """Merges a directory scan begun at ``started`` (ns, wall clock): (path, bytes, mtime
        ns) of every object. Keeps the links of objects still there, and the objects this
        process used since the scan began (it may have missed them); drops the rest."""
        with self._lock:
            for path in list(self._arrived):  # a scan is rare: every object gets a full entry
                self._promote(path)
            self._arrivals.clear()
            self._queued = 0
            present = set()
            for path, size, mtime in scanned:
                present.add(path)
                entry = self._entries.get(path)
                if entry is None:
                    self._add(path, size, mtime)
                else:
                    entry.size, entry.used = size, max(entry.used, mtime)
            for path in [p for p, e in self._entries.items() if p not in present and e.used < started]:
                if not self._pins[path]:
                    self._remove(path)
            self.total = sum(e.size for e in self._entries.values())
            self._heap = [(e.rank, e.used, p) for p, e in self._entries.items()]
            heapq.heapify(self._heap)
            self.scanned = True


def _with_parent(paths: Sequence[Key], parent: Key | None) -> list[Key]:
    out = list(paths)
    if parent is not None:
        out.append(parent)
    return out


def _on_disk(size: int, block: int) -> int:
    """Bytes a file of ``size`` bytes takes in whole file-system blocks."""
    return -(-size // block) * block if block > 1 else size
