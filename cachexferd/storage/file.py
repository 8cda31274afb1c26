"""The ``file`` backend: one file per object in a directory, local or on a shared filesystem.

Layout under ``storage.path``::

    ab/cd/abcd...32 hex    object whose name hashes (blake2b-128) to abcd...
    .tmp/                  objects being written (same filesystem, so rename is atomic)

Names are hashed rather than escaped: keys may hold '/' or '..' and may be longer than a
file name may be; the object header carries the name digest, so a (practically impossible)
collision reads as a corrupt object, never as another key's data. Two levels of 256-way
fan-out keep directories small for millions of objects.

Writes go to a temp file (``writev`` of header + the host block, optional ``fsync``) and
are renamed into place, so readers on any machine see a whole object or none. Reads use
``preadv`` straight into the host block. Concurrent writers of the same name are harmless:
the last rename wins and both wrote the same content-addressed bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import MISSING, GetItem, GetResult, GetStatus, PutItem, StorageBackend, StorageFailure, StorageUnavailable
from .objects import HEADER_BYTES

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)
_TMP_DIR = ".tmp"
_STALE_TMP_S = 3600.0  # temp files older than this were left by a crashed writer


def object_path(root: str, name: str) -> str:
    """Where ``name`` lives under ``root`` (plain strings: pathlib costs microseconds per object)."""
    digest = hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
    return f"{root}/{digest[:2]}/{digest[2:4]}/{digest}"


class FileBackend(StorageBackend):
    name = "file"

    def __init__(self, root: Path, fsync: bool = False) -> None:
        self.root = root
        self.fsync = fsync
        self._root = str(root)
        self._tmp = str(root / _TMP_DIR)
        self._made: set[str] = set()  # fan-out dirs known to exist (set ops are atomic under the GIL)
        self._ready = False
        self._lock = threading.Lock()
        self._serial = itertools.count()  # temp names: pid + counter, unique without uuid's cost

    def start(self) -> None:
        try:
            self._ensure_root()
        except StorageUnavailable as exc:
            log.warning("%s; storage commands fail until it is usable", exc)
            return
        self._remove_stale_temps()

    def _ensure_root(self) -> None:
        if self._ready:
            return
        with self._lock:
            try:
                os.makedirs(self._tmp, exist_ok=True)
            except OSError as exc:
                raise StorageUnavailable(f"storage directory {self.root}: {exc.strerror}") from None
            self._ready = True

    def _remove_stale_temps(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        try:
            for entry in os.scandir(self._tmp):
                if entry.is_file() and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
        except OSError as exc:
            log.info("could not clean %s: %s", self._tmp, exc)

    # Writing ------------------------------------------------------------------------------

    def put(self, items: list[PutItem], stop: threading.Event) -> list[str | None]:
        self._ensure_root()
        reasons: list[str | None] = []
        for item in items:
            if stop.is_set():
                reasons.append("stopped")
                continue
            reasons.append(self._put_one(item))
        return reasons

    def _put_one(self, item: PutItem) -> str | None:
        final = object_path(self._root, item.name)
        tmp = f"{self._tmp}/{final[-32:]}.{os.getpid()}.{next(self._serial)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [item.header(), item.payload])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._rename_into_place(tmp, final)
        except OSError as exc:
            _unlink_quietly(tmp)
            if not os.path.isdir(self._tmp):  # the directory itself went away (unmounted, removed)
                self._ready = False
                self._made.clear()
                raise StorageUnavailable(f"storage directory {self.root} is gone: {exc.strerror}") from None
            return f"{exc.strerror or exc}"
        return None

    def _rename_into_place(self, tmp: str, final: str) -> None:
        parent = os.path.dirname(final)
        if parent not in self._made:
            os.makedirs(parent, exist_ok=True)
            self._made.add(parent)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # fan-out dir removed behind our back: make it again, once
            self._made.discard(parent)
            os.makedirs(parent, exist_ok=True)
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
        except OSError as exc:
            return GetResult(GetStatus.FAILED, detail=exc.strerror or str(exc))
        finally:
            os.close(fd)
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
            try:
                os.unlink(object_path(self._root, name))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:  # read-only file system, permissions: the command's error
                failed.append(exc.strerror or str(exc))
        if failed:
            raise StorageFailure(f"{len(failed)} of {len(names)} objects not deleted ({removed} were): {failed[0]}")
        return removed

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "path": str(self.root), "state": "ready" if self._ready else "unavailable"}


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
    path = Path(config.storage.path) if config.storage.path else config.runtime_dir / "storage"
    return FileBackend(path, config.storage.fsync)
