"""What wakes a daemon that follows the storage journal when another daemon appends, so that
it reads then instead of every 0.1 s: an idle daemon wakes once every few seconds, and a
record after a quiet spell is read at once.

- A file journal: its directory's changes (Linux inotify, ``watch_directory``). inotify sees
  the writes of this machine only: on a network file system another host's appends are found
  by polling (``poll_s``). Where inotify is missing or out of instances, there is no watch
  and the reader polls as before.
- A Redis stream: a blocking read of the entries after those read (XREAD BLOCK,
  ``StreamWatch``) on a connection of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import select
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

log = logging.getLogger(__name__)


class JournalWatch(Protocol):
    """Waits, on the one thread that follows a journal, until records may have been appended."""

    poll_s: float  # the longest wait: a safety net where changes are seen, the poll where not
    gone: bool  # this watch sees nothing more: make a new one

    def wait(self, timeout_s: float | None = None) -> bool:
        """True when something may have been appended; False after ``timeout_s`` (``poll_s``
        unless given) or a ``wake``."""
        ...

    def wake(self) -> None:
        """Ends a wait soon (from any thread)."""
        ...

    def close(self) -> None: ...


_IN_MODIFY, _IN_MOVED_TO, _IN_CREATE = 0x2, 0x80, 0x100
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_IGNORED = 0x400, 0x800, 0x8000
_MASK = _IN_MODIFY | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE_SELF | _IN_MOVE_SELF
_GONE = _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_IGNORED  # the directory itself went away
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows
# File systems whose every write is made on this machine (inotify sees all of them).
LOCAL_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs",
                                "bcachefs", "overlay", "jfs", "reiserfs"})  # fmt: skip
_ESCAPE = re.compile(r"\\([0-7]{3})")
LOCAL_POLL_S = 2.0  # a safety net where inotify sees every write


class DirectoryWatch:
    """Wakes ``wait`` when a file in ``directory`` is written, created or moved in (or
    ``wake`` is called, or ``poll_s`` passes). One thread waits; ``wake`` from any."""

    def __init__(self, fd: int, directory: str, poll_s: float, once: bool = False) -> None:
        self.directory, self.poll_s, self.once = directory, poll_s, once
        self._fd = fd
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.gone = False  # the directory was removed or moved (or ``once`` saw a change): watch again
        self.wakeups = 0  # waits that ended on a change

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits until something changed (True), or ``timeout_s`` (``poll_s`` unless given)
        passed or ``wake`` was called (False)."""
        ready, _, _ = select.select([self._fd, self._wake_r], [], [], self.poll_s if timeout_s is None else timeout_s)
        if self._wake_r in ready:
            _drain(self._wake_r)
        if self._fd not in ready:
            return False
        mask = 0
        for data in _reads(self._fd):
            mask |= _masks(data)
        self.gone = self.gone or self.once or bool(mask & _GONE)
        self.wakeups += 1
        return True

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake is pending already
            os.write(self._wake_w, b"w")

    def close(self) -> None:
        for fd in (self._fd, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def watch_directory(directory: str, poll_s: float, once: bool = False) -> DirectoryWatch | None:
    """A watch on ``directory`` (which must exist), polling every ``poll_s`` on a network
    file system and every ``LOCAL_POLL_S`` on a local one; None where inotify is unavailable.
    ``once``: the first change ends it (a directory watched until another appears in it)."""
    init, add_watch = _inotify()
    if init is None or add_watch is None:
        return None
    fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        _say_once(f"storage journal: no inotify instance ({os.strerror(ctypes.get_errno())}); polling")
        return None
    if add_watch(fd, os.fsencode(directory), _MASK) < 0:
        _say_once(f"storage journal: cannot watch {directory} ({os.strerror(ctypes.get_errno())}); polling")
        os.close(fd)
        return None
    local = file_system_of(directory) in LOCAL_FILE_SYSTEMS
    return DirectoryWatch(fd, directory, max(poll_s, LOCAL_POLL_S) if local else poll_s, once)


def _say_once(message: str) -> None:
    """Logged once per process: a reader that cannot watch asks again at every poll."""
    if message not in _SAID:
        _SAID.add(message)
        log.info("%s", message)


_SAID: set[str] = set()


def file_system_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the file system ``path`` is on ("" when not known)."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            return mount_type(os.path.realpath(path), f.read())
    except OSError:
        return ""


def mount_type(path: str, mountinfo: str) -> str:
    """The type of the mount in ``mountinfo`` (/proc/self/mountinfo's text) that holds
    ``path``: the last one mounted on the longest mount point above it."""
    best, found = -1, ""
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = _unescape(parts[4])
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= best:
            best, found = len(point), rest.split()[0]
    return found


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are written as octal escapes."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


@functools.cache
class StreamWatch:
    """Waits for entries after the last one read of a Redis stream (XREAD BLOCK), on a
    connection of its own: a blocked read holds its connection, and the storage I/O threads'
    pool must not lose one to it. A wake takes effect within ``block_s``."""

    def __init__(self, client: Any, key: str, read_to: Callable[[], str], poll_s: float, block_s: float) -> None:
        pool = client.connection_pool
        self._redis = type(client)(connection_pool=type(pool)(
            connection_class=pool.connection_class, max_connections=1, **pool.connection_kwargs))  # fmt: skip
        self.key, self.read_to, self.block_s = key, read_to, block_s
        self.poll_s = max(poll_s, block_s)
        self.gone = False
        self.wakeups = 0
        self._woken = threading.Event()

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._woken.is_set():
            self._woken.clear()
            return False
        block_s = min(self.block_s, self.poll_s if timeout_s is None else timeout_s)
        try:
            got = self._redis.xread({self.key: self.read_to()}, count=1, block=max(1, int(block_s * 1000)))
        except Exception as exc:  # the server is gone: the reader's own read reports it; do not spin
            log.debug("storage journal: waiting on the stream failed: %s", exc)
            self._woken.wait(self.block_s)
            return False
        self.wakeups += bool(got)
        return bool(got)

    def wake(self) -> None:
        self._woken.set()

    def close(self) -> None:
        self._redis.close()


def _inotify() -> tuple[Any, Any]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library already loaded (find_library would run ldconfig)
        return libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):  # not Linux, or a libc without inotify
        return None, None


def _reads(fd: int) -> Iterator[bytes]:
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:
            return
        yield data


def _masks(data: bytes) -> int:
    mask, at = 0, 0
    while at + _EVENT.size <= len(data):
        _, event_mask, _, length = _EVENT.unpack_from(data, at)
        mask |= event_mask
        at += _EVENT.size + length
    return mask


def _drain(fd: int) -> None:
    for _ in _reads(fd):
        pass
