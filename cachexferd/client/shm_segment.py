"""A shared-memory file that never has a name in /dev/shm outside an ATTACH.

The cpu backend maps the runner's KV cache by name (``/dev/shm/<name>``). A name outlives
the process that made it: a runner killed with SIGKILL (or torn down by an engine that
kills its workers at shutdown) leaves a file as large as its KV cache behind. This segment
is created without a name (``O_TMPFILE`` in /dev/shm; tmpfs supports it) and held by a file
descriptor. A protocol 1.2 daemon maps it through that descriptor (the attach's ``fd``,
opened as /proc/<runner pid>/fd/<fd>); for a daemon that cannot (an older one, or one of
another user), the first attach links a fresh name for its duration only::

    segment = ShmSegment(size)
    memory = segment.storage()               # map it (torch), use it as the KV cache
    with segment.exposed() as name:          # /dev/shm/<name> exists only inside (first time)
        runner.attach(...)                   # device map: {"kind": "shm", "fd": ..., "name": ...}

The memory stays as long as some process maps it or holds the descriptor, and is freed by
the kernel when the last one is gone, however they end. (A file that was linked once cannot
be linked again, so later attaches, after a daemon restart, go by descriptor only.)

The size is reserved up front (``posix_fallocate``): a /dev/shm too small for the cache
fails here with a clear error, not later with SIGBUS in the middle of a write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from ..security import group_id

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"


class ShmSpaceError(OSError):
    """/dev/shm cannot hold the segment."""


class ShmSegment:
    def __init__(self, size: int, *, prefix: str = "cachexferd-kv", group: str | int | None = None) -> None:
        """``group``: a daemon running as another user maps the segment through this group
        (mode 0660 and group-owned then; 0600 otherwise)."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        self.size = size
        self.prefix = prefix
        self.name: str | None = None  # set while exposed
        self._linked_once = False
        self.fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            if group is not None:  # widened only after the group is set: never readable by others
                os.fchown(self.fd, -1, group if isinstance(group, int) else group_id(group))
                os.fchmod(self.fd, 0o660)
            _reserve(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def storage(self) -> torch.UntypedStorage:
        """A shared mapping of the whole segment (zeros until written)."""
        import torch

        path = f"/proc/self/fd/{self.fd}"
        return cast(torch.UntypedStorage, torch.UntypedStorage.from_file(path, shared=True, nbytes=self.size))

    @contextlib.contextmanager
    def exposed(self) -> Iterator[str | None]:
        """Links the segment under a fresh name in /dev/shm for the block and unlinks it after;
        yields None (no name) once the segment has been linked before."""
        if self._linked_once:
            yield None
            return
        name = f"{self.prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        directory = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # linkat(AT_SYMLINK_FOLLOW) on the descriptor's /proc link: the documented way to
            # give an O_TMPFILE file a name without privileges (dst_dir_fd makes Python use linkat).
            os.link(f"/proc/self/fd/{self.fd}", name, dst_dir_fd=directory, follow_symlinks=True)
            self._linked_once = True
            self.name = name
            try:
                yield name
            finally:
                self.name = None
                with contextlib.suppress(FileNotFoundError):  # the daemon may have removed it
                    os.unlink(name, dir_fd=directory)
        finally:
            os.close(directory)

    def device_map(self, offsets: list[int]) -> dict[str, Any]:
        """The cpu backend's attach handles (docs/protocol.md §8.3): the descriptor, and the
        name while one is linked."""
        handle: dict[str, Any] = {"kind": "shm", "fd": self.fd, "offsets": list(offsets)}
        if self.name is not None:
            handle["name"] = self.name
        return handle

    def close(self) -> None:
        """Drops the descriptor; the memory goes once no process maps it any more."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        raise ShmSpaceError(
            errno.ENOSPC,
            f"{SHM_DIR} has {free / 2**30:.2f} GiB free, the KV cache needs {size / 2**30:.2f} GiB: "
            f"enlarge {SHM_DIR} (e.g. mount -o remount,size=... {SHM_DIR}) or shrink the KV cache",
        ) from None
