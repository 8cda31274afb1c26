"""The ``file`` backend: one file per object in a directory, local or on a shared filesystem.

Layout under ``storage.path``::

    ab/cd/abcd...32 hex    object whose name hashes (blake2b-128) to abcd...
    .tmp/                  objects being written (same filesystem, so rename is atomic)
    .journal/              what every daemon on the directory stored and evicted (journal.py)

Names are hashed rather than escaped: keys may hold '/' or '..' and may be longer than a
file name may be; the object header carries the name digest, so a (practically impossible)
collision reads as a corrupt object, never as another key's data. Two levels of 256-way
fan-out keep directories small for millions of objects.

Writes go to a temp file (``writev`` of header + the host block, optional ``fsync``) and
are renamed into place, so readers on any machine see a whole object or none. Reads use
``preadv`` straight into the host block. Concurrent writers of the same name are harmless:
the last rename wins and both wrote the same content-addressed bytes.

The directory is durable (by default under systemd's StateDirectory, shared by every rank
on the host) and bounded by ``storage.capacity`` and by its file system's free space: an
in-memory index (eviction.py), built by scanning the directory in the background at start
and every few minutes (which also picks up what other daemons sharing it wrote), makes room
before a store writes by evicting chain tails, least recently used first, down to 90% of
the capacity, and never an object of a store still running. A read sets the object's mtime,
so the order survives restarts and is the same for every daemon that scans the directory.
The directory is created on first use.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import (
    MISSING,
    NO_ROOM,
    GetItem,
    GetResult,
    GetStatus,
    PutItem,
    StorageBackend,
    StorageFailure,
    StorageUnavailable,
)
from .eviction import EvictionIndex
from .journal import REMOVED, STORED, Batch, FileJournal, JournalRecord, object_id
from .objects import HEADER_BYTES

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)
_TMP_DIR = ".tmp"
_JOURNAL_DIR = ".journal"  # the storage journal's files (storage/journal.py)
_STALE_TMP_S = 3600.0  # temp files older than this were left by a crashed writer
# Objects hold KV-cache bytes (derived from users' prompts): readable by the daemons' user
# and group only (a pool shared by daemons of one service group), never by every user.
_OBJECT_MODE = 0o640
_DIR_MODE = 0o750
_RESCAN_S = 600.0  # how often the index re-reads the directory (other writers, drift)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def object_path(root: str, name: str) -> str:
    """Where ``name`` lives under ``root`` (plain strings: pathlib costs microseconds per object)."""
    return id_path(root, object_id(name))


def id_path(root: str, oid: bytes) -> str:
    """Where the object whose id (its name's digest) is ``oid`` lives under ``root``."""
    digest = oid.hex()
    return f"{root}/{digest[:2]}/{digest[2:4]}/{digest}"


class FileBackend(StorageBackend):
    name = "file"
    reserves_room = True

    def __init__(self, root: Path, fsync: bool = False, capacity: int = 0, journal: bool = False) -> None:
        self.root = root
        self.journal = FileJournal(str(root / _JOURNAL_DIR)) if journal else None
        self.fsync = fsync
        self.index: EvictionIndex[bytes] = EvictionIndex(capacity)  # objects by id
        self._root = str(root)
        self._tmp = str(root / _TMP_DIR)
        self._made: set[str] = set()  # fan-out dirs known to exist (set ops are atomic under the GIL)
        self._ready = False
        self._error = ""
        self._lock = threading.Lock()
        self._serial = itertools.count()  # temp names: pid + counter, unique without uuid's cost
        self._closed = threading.Event()
        self._scanner: threading.Thread | None = None

    def start(self) -> None:
        """Cleans up and indexes an existing directory in the background; a missing one is
        created by the first storage command (a daemon that never stores creates nothing)."""
        if os.path.isdir(self._root):
            self._remove_stale_temps()
        elif not _creatable(self.root):
            self._error = "cannot be created by this user"  # what status shows until it can be
            log.warning("storage directory %s cannot be created by this user; storage commands fail until it can",
                        self.root)  # fmt: skip
        self._scanner = threading.Thread(target=self._scan_loop, name="storage-file-index", daemon=True)
        self._scanner.start()

    def _ensure_root(self) -> None:
        if self._ready:
            return
        with self._lock:
            try:
                # makedirs gives only the last directory its mode: the storage directory
                # itself (and any parent it creates) must not be left to the umask.
                _make_private_dirs(self.root)
                os.makedirs(self._tmp, mode=_DIR_MODE, exist_ok=True)
            except OSError as exc:
                self._error = exc.strerror or str(exc)
                raise StorageUnavailable(f"storage directory {self.root}: {exc.strerror}") from None
            self._ready, self._error = True, ""

    # Index and eviction ---------------------------------------------------------------------

    def _scan_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.rescan()
            except Exception:  # never let the index thread die: eviction would stop
                log.exception("indexing %s failed", self.root)
            self._closed.wait(_RESCAN_S)

    def rescan(self) -> None:
        """Reads every object's size and mtime, merges them into the index, evicts if over."""
        started = time.time_ns()
        scanned = list(_scan_objects(self._root))
        self.index.merge(scanned, started)
        self._evict(self.index.victims())

    def _evict(self, ids: list[bytes]) -> None:
        for oid in ids:
            _unlink_quietly(id_path(self._root, oid))
        if ids:
            log.debug("evicted %d objects from %s", len(ids), self.root)
            self._record_removed(ids)

    def learn(self, batches: Sequence[Batch]) -> None:
        """Indexes the objects other daemons on the directory store as soon as the journal
        says so (not at the next scan), so capacity and eviction count them; forgets removed
        ones. Stores of known sizes (the usual) enter the index together: a few C calls."""
        now, index = time.time_ns(), self.index
        ids: list[bytes] = []
        sizes: list[int] = []
        for batch in batches:
            if batch.op == STORED and batch.size:
                ids += batch.ids
                sizes += [batch.size] * len(batch)
                continue
            if ids:  # in the journal's order
                index.arrived(ids, sizes, now)
                ids, sizes = [], []
            self._learn_one_by_one(batch, now)
        if ids:
            index.arrived(ids, sizes, now)

    def _learn_one_by_one(self, batch: Batch, now: int) -> None:
        """Removals, and stores whose size the record does not say."""
        if batch.op == REMOVED:
            for oid in batch.ids:
                self.index.discard(oid)
            return
        new: list[tuple[bytes, int, int]] = []
        for oid in batch.ids:
            if oid not in self.index:
                with contextlib.suppress(OSError):  # gone again already
                    st = os.stat(id_path(self._root, oid))
                    new.append((oid, st.st_size, st.st_mtime_ns))
        if new:
            self.index.known_many(new)

    def _record_removed(self, ids: list[bytes]) -> None:
        """Tells every daemon on the store (the journal) that these objects are gone."""
        if self.journal is not None and ids:
            # Queued, not waited for (the index lock may be held). Should the write fail (it
            # is logged), followers learn that the objects are gone when they miss them.
            self.journal.submit([JournalRecord(REMOVED, i) for i in ids])

    def _make_room(self, need: int, parent: str | None) -> bool:
        """After a full disk: evicts at least ``need`` bytes for an object after ``parent``
        (cut-off objects only, when it is cut off itself); False when there was nothing to evict."""
        cut = parent is not None and not self.index.whole(object_id(parent))
        victims = self.index.victims(need, cut_only=cut)
        self._evict(victims)
        return bool(victims)

    def _remove_stale_temps(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        try:
            for entry in os.scandir(self._tmp):
                if entry.is_file() and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
        except OSError as exc:
            log.info("could not clean %s: %s", self._tmp, exc)

    # Writing ------------------------------------------------------------------------------

    def begin_store(self, names: list[str], object_bytes: int, parent: str | None = None) -> int:
        """Pins the store's objects and the one they extend, evicts other chain tails to make
        room for them (capacity and free space), and returns how many leading objects fit."""
        self._ensure_root()
        ids = list(map(object_id, names))
        parent_id = self._indexed_parent(parent)
        free, block = self._disk_space()
        room, victims = self.index.reserve(ids, object_bytes, free, block, parent_id)
        self._evict(victims)
        return room

    def end_store(self, names: list[str], parent: str | None = None) -> None:
        self.index.release(list(map(object_id, names)), None if parent is None else object_id(parent))

    def _indexed_parent(self, parent: str | None) -> bytes | None:
        """The parent's id, indexed when it is on disk but not yet known to the index
        (another daemon wrote it since the last scan): a store must know what it extends."""
        if parent is None:
            return None
        oid = object_id(parent)
        if self.index.whole(oid):
            return oid
        with contextlib.suppress(OSError):
            st = os.stat(id_path(self._root, oid))
            self.index.known(oid, st.st_size, st.st_mtime_ns)
        return oid

    def _disk_space(self) -> tuple[int | None, int]:
        """(bytes free for this user, block size) of the file system; None when it cannot say."""
        try:
            st = os.statvfs(self._root)
        except OSError:
            return None, 1
        if not st.f_blocks or not st.f_frsize:  # some virtual file systems report nothing
            return None, 1
        return st.f_bavail * st.f_frsize, st.f_frsize

    def put(self, items: list[PutItem], stop: threading.Event) -> list[str | None]:
        """Writes the items in order; a call outside begin_store/end_store makes its own room."""
        self._ensure_root()
        if not items:
            return []
        paths = [object_path(self._root, item.name) for item in items]
        own = not self.index.pinned(object_id(items[0].name))
        names, parent = [i.name for i in items], items[0].parent
        room = self.begin_store(names, HEADER_BYTES + len(items[0].payload), parent) if own else len(items)
        try:
            return self._put_all(items, paths, room, stop)
        finally:
            if own:
                self.end_store(names, parent)

    def _put_all(self, items: list[PutItem], paths: list[str], room: int, stop: threading.Event) -> list[str | None]:
        reasons: list[str | None] = []
        full = False
        for i, (item, path) in enumerate(zip(items, paths)):
            if stop.is_set():
                reasons.append("stopped")
            elif i >= room or full:
                reasons.append(NO_ROOM)
            else:
                reason, full = self._put_one(item, path)
                reasons.append(reason)
        return reasons

    def _put_one(self, item: PutItem, final: str) -> tuple[str | None, bool]:
        """(None or why not written, whether the file system is full with nothing left to evict)."""
        size = HEADER_BYTES + len(item.payload)
        try:
            self._write(item, final)
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                return self._put_failed(exc), False
            if not self._make_room(8 * size, item.parent):
                return self._put_failed(exc), True
            try:  # the disk filled before the capacity did: room was made, once more
                self._write(item, final)
            except OSError as again:
                return self._put_failed(again), again.errno in _NO_SPACE
        parent = object_id(item.parent) if item.parent is not None else None
        self.index.used(object_id(item.name), size, item.stamp, parent)
        return None, False

    def _write(self, item: PutItem, final: str) -> None:
        tmp = f"{self._tmp}/{final[-32:]}.{os.getpid()}.{next(self._serial)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _OBJECT_MODE)
            try:
                _write_all(fd, [item.header(), item.payload])
                if item.stamp:  # the eviction order on disk: a chain's head is its newest object
                    os.utime(fd, ns=(item.stamp, item.stamp))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._rename_into_place(tmp, final)
        except OSError:
            _unlink_quietly(tmp)
            raise

    def _put_failed(self, exc: OSError) -> str:
        if not os.path.isdir(self._tmp):  # the directory itself went away (unmounted, removed)
            self._ready = False
            self._made.clear()
            raise StorageUnavailable(f"storage directory {self.root} is gone: {exc.strerror}") from None
        return f"{exc.strerror or exc}"

    def _rename_into_place(self, tmp: str, final: str) -> None:
        parent = os.path.dirname(final)
        if parent not in self._made:
            os.makedirs(parent, mode=_DIR_MODE, exist_ok=True)
            self._made.add(parent)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # fan-out dir removed behind our back: make it again, once
            self._made.discard(parent)
            os.makedirs(parent, mode=_DIR_MODE, exist_ok=True)
            os.rename(tmp, final)
        if self.fsync:
            _fsync_dir(parent)

    # Reading ------------------------------------------------------------------------------

    def get(self, items: list[GetItem], stop: threading.Event) -> list[GetResult]:
        self._ensure_root()
        results: list[GetResult] = []
        for item in items:
            if stop.is_set():
                results.append(GetResult(GetStatus.FAILED, detail="stopped"))
                continue
            results.append(item.landed(self._get_one(item, stop)))
        return results

    def _get_one(self, item: GetItem, stop: threading.Event) -> GetResult:
        try:
            fd = os.open(object_path(self._root, item.name), os.O_RDONLY)
        except FileNotFoundError:
            return MISSING
        except OSError as exc:
            return GetResult(GetStatus.FAILED, detail=exc.strerror or str(exc))
        if stop.is_set():  # the open hung past the deadline: the host block is no longer ours
            os.close(fd)
            return GetResult(GetStatus.FAILED, detail="stopped")
        header = bytearray(HEADER_BYTES)
        try:
            received = _read_object(fd, header, item.payload)
            _mark_used(fd, item.stamp)
        except OSError as exc:
            return GetResult(GetStatus.FAILED, detail=exc.strerror or str(exc))
        finally:
            os.close(fd)
        parent = object_id(item.parent) if item.parent is not None else None
        self.index.used(object_id(item.name), received, item.stamp, parent)
        return GetResult(GetStatus.OK, bytes(header), received)

    def exists(self, names: list[str]) -> list[bool]:
        self._ensure_root()
        found: list[bool] = []
        for name in names:
            found.append(os.path.isfile(object_path(self._root, name)))
            if not found[-1]:  # a prefix query needs nothing past the first miss
                found += [False] * (len(names) - len(found))
                break
        return found

    def delete(self, names: list[str]) -> int:
        self._ensure_root()
        removed, failed = 0, []
        for name in names:
            path = object_path(self._root, name)
            self.index.discard(object_id(name))
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # read-only file system, permissions: the command's error
                failed.append(exc.strerror or str(exc))
        if failed:
            raise StorageFailure(f"{len(failed)} of {len(names)} objects not deleted ({removed} were): {failed[0]}")
        return removed

    def describe(self) -> dict[str, Any]:
        if self._ready or os.path.isdir(self._root):
            state = "ready"
        else:
            state = f"unavailable: {self._error}" if self._error else "not created yet"
        return {
            "backend": self.name, "path": str(self.root), "state": state, "objects": len(self.index),
            "used_bytes": self.index.total, "capacity_bytes": self.index.capacity, "evicted": self.index.evicted,
        }  # fmt: skip

    def close(self) -> None:
        self._closed.set()
        if self.journal is not None:
            self.journal.close()


def _after(views: list[memoryview], done: int) -> list[memoryview]:
    """The buffers still to fill once ``done`` bytes went into ``views``."""
    rest = []
    for view in views:
        if done >= len(view):
            done -= len(view)
            continue
        rest.append(view[done:])
        done = 0
    return rest


def _write_all(fd: int, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    total, written = sum(len(v) for v in views), 0
    while written < total:  # one writev in the common case; loops only on a short write
        written += os.writev(fd, _after(views, written) if written else views)


def _read_object(fd: int, header: bytearray, payload: memoryview) -> int:
    """Reads header + payload, plus one byte past them to notice a longer object; returns
    the bytes read. One preadv in the common case (a regular file reads fully up to EOF)."""
    views = [memoryview(header), payload, memoryview(bytearray(1))]
    expected, total = len(header) + len(payload), 0
    while total < expected:
        got = os.preadv(fd, _after(views, total) if total else views, total)
        if got == 0:
            break
        total += got
    return total


def _scan_objects(root: str) -> list[tuple[bytes, int, int]]:
    """(id, bytes, mtime in ns) of every object under ``root``'s two fan-out levels. Files
    whose name is not an object's (32 hex digits, in its fan-out directories) are not ours:
    left alone, never counted or evicted."""
    found: list[tuple[bytes, int, int]] = []
    for first in _subdirs(root):
        for second in _subdirs(first):
            with contextlib.suppress(OSError), os.scandir(second) as entries:
                for entry in entries:
                    oid = _object_id_of(entry.path)
                    with contextlib.suppress(OSError):  # removed while we looked
                        if oid is not None and entry.is_file(follow_symlinks=False):
                            st = entry.stat(follow_symlinks=False)
                            found.append((oid, st.st_size, st.st_mtime_ns))
    return found


def _object_id_of(path: str) -> bytes | None:
    """The id of the object stored at ``path``; None for a file that is not an object's."""
    second, name = os.path.split(path)
    try:
        oid = bytes.fromhex(name)
    except ValueError:
        return None
    root = os.path.dirname(os.path.dirname(second))
    return oid if len(oid) == 16 and id_path(root, oid) == path else None


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _mark_used(fd: int, stamp: int) -> None:
    """Sets the object's mtime to ``stamp`` (ns; 0: now): the least-recently-used order on
    disk. Objects owned by another user (a shared directory) may refuse; the in-memory order
    still counts the use."""
    with contextlib.suppress(OSError):
        if stamp:
            os.utime(fd, ns=(stamp, stamp))
        else:
            os.utime(fd)


def _make_private_dirs(path: Path) -> None:
    """Creates ``path`` and its missing parents with _DIR_MODE (whatever the umask)."""
    missing = []
    while not path.is_dir() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another daemon on the directory was first
            directory.mkdir(mode=_DIR_MODE)
            os.chmod(directory, _DIR_MODE)


def _creatable(path: Path) -> bool:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def create(config: Config, pool: object = None) -> FileBackend:
    settings = config.storage.file
    return FileBackend(config.storage_path, settings.fsync, settings.capacity, journal=config.storage.journal)
