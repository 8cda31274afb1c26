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
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import MISSING, GetItem, GetResult, GetStatus, PutItem, StorageBackend, StorageUnavailable
from .objects import HEADER_BYTES

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)
_TMP_DIR = ".tmp"
_STALE_TMP_S = 3600.0  # temp files older than this were left by a crashed writer


def object_path(root: Path, name: str) -> Path:
    digest = hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
    return root / digest[:2] / digest[2:4] / digest


class FileBackend(StorageBackend):
    name = "file"

    def __init__(self, root: Path, fsync: bool = False) -> None:
        self.root = root
        self.fsync = fsync
        self._tmp = root / _TMP_DIR
        self._made: set[Path] = set()  # fan-out dirs known to exist (set ops are atomic under the GIL)
        self._ready = False
        self._lock = threading.Lock()

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
                self._tmp.mkdir(parents=True, exist_ok=True)
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
        final = object_path(self.root, item.name)
        tmp = self._tmp / f"{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [item.header, item.payload])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._rename_into_place(tmp, final)
        except OSError as exc:
            _unlink_quietly(tmp)
            if not self._tmp.is_dir():  # the directory itself went away (unmounted, removed)
                self._ready = False
                self._made.clear()
                raise StorageUnavailable(f"storage directory {self.root} is gone: {exc.strerror}") from None
            return f"{exc.strerror or exc}"
        return None

    def _rename_into_place(self, tmp: Path, final: Path) -> None:
        if final.parent not in self._made:
            final.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(final.parent)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # fan-out dir removed behind our back: make it again, once
            self._made.discard(final.parent)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, final)
        if self.fsync:
            _fsync_dir(final.parent)

    # Reading ------------------------------------------------------------------------------

    def get(self, items: list[GetItem], stop: threading.Event) -> list[GetResult]:
        self._ensure_root()
        results: list[GetResult] = []
        for item in items:
            if stop.is_set():
                results.append(GetResult(GetStatus.FAILED, detail="stopped"))
                continue
            results.append(self._get_one(item))
        return results

    def _get_one(self, item: GetItem) -> GetResult:
        try:
            fd = os.open(object_path(self.root, item.name), os.O_RDONLY)
        except FileNotFoundError:
            return MISSING
        except OSError as exc:
            return GetResult(GetStatus.FAILED, detail=exc.strerror or str(exc))
        header = bytearray(HEADER_BYTES)
        extra = bytearray(1)  # a byte past the expected end means the object is too long
        try:
            received = _read_all(fd, [header, item.payload, extra])
        except OSError as exc:
            return GetResult(GetStatus.FAILED, detail=exc.strerror or str(exc))
        finally:
            os.close(fd)
        return GetResult(GetStatus.OK, bytes(header), received)

    def exists(self, names: list[str]) -> list[bool]:
        self._ensure_root()
        found: list[bool] = []
        for name in names:
            found.append(object_path(self.root, name).is_file())
            if not found[-1]:  # a prefix query needs nothing past the first miss
                found += [False] * (len(names) - len(found))
                break
        return found

    def delete(self, names: list[str]) -> int:
        self._ensure_root()
        removed = 0
        for name in names:
            try:
                os.unlink(object_path(self.root, name))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "path": str(self.root), "state": "ready" if self._ready else "unavailable"}


def _write_all(fd: int, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _read_all(fd: int, buffers: list[Any]) -> int:
    """Fills the buffers in order until EOF; returns the bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = offset = 0
    while views:
        got = os.preadv(fd, views, offset)
        if got == 0:
            break
        total += got
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
    return total


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def create(config: Config, pool: object = None) -> FileBackend:
    path = Path(config.storage.path) if config.storage.path else config.runtime_dir / "storage"
    return FileBackend(path, config.storage.fsync)
