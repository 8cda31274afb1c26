"""The cpu backend: the runner's KV cache lives in POSIX shared memory.

Attach handles (``device`` map of the attach command; exactly these keys)::

    {"kind": "shm", "name": "<name in /dev/shm>", "offsets": [byte offset of each tensor]}

Each tensor is ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous at its offset.
When the attached runner dies, the daemon removes its segment (see ``remove_segment``).

Copies are torch ``copy_`` calls on strided uint8 views, which release the GIL:
- tensors evenly spaced in the segment form one *group*, viewed as ``[num_blocks, g, chunk]``,
  so one copy moves a block (or a run of consecutive blocks) of every tensor in the group;
- consecutive ids are coalesced into runs (one copy per run and group);
- single blocks are gathered across all the commands of a batch (``swap_many``: one hand-off
  per batch, not per command) and moved per group in one step: for small blocks (up to
  ``_GATHER_MAX_BYTES`` per group) one indexed numpy copy, which gathers the source rows and
  scatters them in a single call; for larger ones one ``torch._foreach_copy_`` over per-block
  views, which moves each byte once;
- the runs are cut into shards that run on ``copy_threads`` workers per direction, and
  device->host and host->device have separate workers, so both directions run at once.
torch's own intra-op threads are set to 1 in the daemon: the workers are the parallelism.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import itertools
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from ..host_cache import HostGeometry, HostPool
from ..protocol import ErrorCode, KVLayout, ProtocolError
from ..security import Requester, SegmentPolicy
from .base import (
    AttachError,
    Backend,
    BatchedDeviceCache,
    CancelToken,
    DeviceCache,
    Direction,
    InlineBusy,
    SwapRequest,
)
from .plan import Run, coalesce, even_groups, shard_tagged

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
KIND = "shm"
DEVICE_KEYS = frozenset({"kind", "name", "offsets", "fd"})
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_FOREACH_BATCH = 512  # single-block copies per gathered copy (bounds cancel latency)
_MIN_SHARD_BYTES = 2 << 20  # below this, handing work to another thread costs more than it saves
_INLINE_BYTES = 1 << 20  # a batch this small is copied on the loop thread (tens of microseconds)
# Up to this many bytes per block and group, an indexed numpy copy (gather, then scatter:
# each byte moves twice) beats per-block torch views (a few microseconds of set-up each).
_GATHER_MAX_BYTES = 32 << 10
_GATHER_MIN_BLOCKS = 16  # below this, one row assignment per block (an indexed copy costs ~10 us to set up)


@dataclass(frozen=True)
class TensorGroup:
    """Tensors ``first .. first+count-1`` seen as one strided view of the segment."""

    first: int
    count: int
    device: torch.Tensor  # [num_blocks, count, chunk] uint8 view into the shared segment
    host: torch.Tensor  # [host_blocks, count, chunk] uint8 view into the host pool
    # The same memory as numpy arrays, for indexed copies of single blocks (None: blocks
    # too large for the gathered copy, see _GATHER_MAX_BYTES).
    device_rows: np.ndarray[Any, Any] | None = None
    host_rows: np.ndarray[Any, Any] | None = None


# One command's share of a copy: its index in the batch, its single blocks (device ids,
# host ids) and its runs of two or more consecutive blocks.
CopyItem = tuple[int, list[int], list[int], list[Run]]


def plan_item(index: int, device_ids: Sequence[int], host_ids: Sequence[int]) -> CopyItem:
    """Coalesces a command's ids; a single-block command (the common case) makes no Run."""
    if len(device_ids) == 1:
        return index, [device_ids[0]], [host_ids[0]], []
    return split_runs(index, coalesce(device_ids, host_ids))


def split_runs(index: int, runs: Sequence[Run]) -> CopyItem:
    single_device: list[int] = []
    single_host: list[int] = []
    longer: list[Run] = []
    for run in runs:
        if run.length == 1:
            single_device.append(run.device)
            single_host.append(run.host)
        else:
            longer.append(run)
    return index, single_device, single_host, longer


@dataclass(frozen=True)
class SegmentIdentity:
    """The file an attach mapped: a dead runner's segment is removed only if the name still
    leads to this file (a name can be taken by another file meanwhile)."""

    device: int
    inode: int
    owner: int

    @classmethod
    def of(cls, st: os.stat_result) -> SegmentIdentity:
        return cls(st.st_dev, st.st_ino, st.st_uid)


def decode_device(device: Any) -> tuple[str | None, int | None, Any]:
    """(segment name, runner's descriptor, offsets as sent): the map must be exactly the
    documented one, with a name, a descriptor (1.2) or both."""
    if type(device) is not dict or device.get("kind") != KIND:
        raise AttachError(f"cpu backend needs device.kind = {KIND!r}", ErrorCode.BAD_FIELD)
    unknown = set(device) - DEVICE_KEYS
    if unknown:
        raise AttachError(f"device has unknown fields {sorted(map(str, unknown))}", ErrorCode.BAD_FIELD)
    name, fd = device.get("name"), device.get("fd")
    if fd is not None and (type(fd) is not int or not 0 <= fd < 1 << 31):
        raise AttachError("device.fd must be a non-negative int", ErrorCode.BAD_FIELD)
    if (name is not None or fd is None) and (type(name) is not str or not _SHM_NAME.match(name) or name in (".", "..")):
        raise AttachError("device.name must be 1-200 chars of [A-Za-z0-9._-]", ErrorCode.BAD_FIELD)
    return name, fd, device.get("offsets")


def validate_offsets(offsets: Any, layout: KVLayout, segment_bytes: int) -> list[int]:
    if type(offsets) is not list or len(offsets) != layout.num_tensors:
        raise AttachError(f"device.offsets must list {layout.num_tensors} byte offsets", ErrorCode.BAD_FIELD)
    if not all(type(o) is int and o >= 0 for o in offsets):
        raise AttachError("device.offsets must be non-negative ints", ErrorCode.BAD_FIELD)
    ordered = sorted(offsets)
    for a, b in itertools.pairwise(ordered):
        if b - a < layout.tensor_bytes:
            raise AttachError(f"device tensors at offsets {a} and {b} overlap", ErrorCode.LAYOUT_MISMATCH)
    if ordered[-1] + layout.tensor_bytes > segment_bytes:
        raise AttachError(
            f"tensor at offset {ordered[-1]} needs {layout.tensor_bytes} bytes; segment has {segment_bytes}",
            ErrorCode.LAYOUT_MISMATCH,
        )
    return offsets


class Segment(NamedTuple):
    """A mapped device segment, and the descriptor it stays open by: the daemon's own open
    file description of it, which the device fence (``CopyFence``) locks."""

    storage: torch.UntypedStorage
    size: int
    identity: SegmentIdentity | None  # None: mapped by descriptor, no name to remove
    fd: int


def open_segment(name: str, policy: SegmentPolicy) -> Segment:
    """Maps /dev/shm/<name> shared; refuses to create or grow it, and (see _open_checked) to
    map anything but a regular file there that ``policy`` allows."""
    fd, st = _open_checked(name, policy)
    try:
        if st.st_size == 0:
            raise AttachError(f"shared memory {name!r} is empty")
        # Map through our fd so a name swapped after the open cannot redirect the mapping.
        storage = cast(
            torch.UntypedStorage,
            torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True, nbytes=st.st_size),
        )
    except BaseException:
        os.close(fd)
        raise
    return Segment(storage, st.st_size, SegmentIdentity.of(st), fd)


def open_device_segment(name: str | None, fd: int | None, requester: Requester) -> Segment:
    """The segment of an attach: the runner's open descriptor ``fd`` when the map names one
    (protocol 1.2) and the daemon may open it, else /dev/shm/<name>. No identity for a
    segment mapped by descriptor: it has no name to remove when its runner dies."""
    if fd is not None:
        try:
            return _open_runner_fd(fd, requester)
        except AttachError:
            if name is None:
                raise
    assert name is not None
    return open_segment(name, requester.segments)  # e.g. a daemon of another user


def _open_runner_fd(fd: int, requester: Requester) -> Segment:
    """Maps the file the attaching process holds open as ``fd`` (/proc/<pid>/fd/<fd>, pid
    from the connection's kernel credentials): a file with no name, which no kill can leave
    behind. The kernel lets only a process of the same user (or root) open it."""
    if requester.peer is None:
        raise AttachError("device.fd needs an ipc connection (the attaching process must be known)")
    try:
        opened = os.open(f"/proc/{requester.peer.pid}/fd/{fd}", os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise AttachError(f"cannot open the attaching process's fd {fd}: {exc.strerror}") from None
    try:
        st = os.fstat(opened)
        refusal = requester.segments.refusal(st)
        if refusal is not None:
            raise AttachError(f"the attaching process's fd {fd} {refusal}")
        if st.st_size == 0:
            raise AttachError(f"the attaching process's fd {fd} is empty")
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{opened}", shared=True, nbytes=st.st_size)
    except BaseException:
        os.close(opened)
        raise
    # /proc/<pid>/fd/<fd> opens the file anew: our own open file description, apart from the
    # runner's (a flock on one conflicts with a flock on the other).
    return Segment(cast(torch.UntypedStorage, storage), st.st_size, None, opened)


def _open_checked(name: str, policy: SegmentPolicy) -> tuple[int, os.stat_result]:
    """(fd, fstat) of /dev/shm/<name>. The daemon opens it with its own rights, so it checks
    what the asking process could not have opened itself: a symbolic link (to a root-only
    file, say) is never followed, special files are never opened (a FIFO could block), and
    the opened file's owner must satisfy ``policy`` (fstat of the fd: no swap in between)."""
    path = os.path.join(SHM_DIR, name)
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link after the lstat
            mode = stat.S_IFLNK
        else:
            raise AttachError(f"cannot open shared memory {name!r}: {exc.strerror}") from None
    if stat.S_ISLNK(mode):
        raise AttachError(f"shared memory {name!r} is a symbolic link; segments must be regular files")
    if not stat.S_ISREG(mode):
        raise AttachError(f"shared memory {name!r} is not a regular file")
    st = os.fstat(fd)
    refusal = policy.refusal(st)
    if refusal is not None:
        os.close(fd)
        raise AttachError(f"shared memory {name!r} {refusal}")
    return fd, st


def remove_segment(name: str, identity: SegmentIdentity, shm_dir: str = SHM_DIR) -> str:
    """Removes a dead runner's segment, if ``name`` still leads to the file that was mapped
    (same device, inode and owner: a name another file took meanwhile is left alone).

    Where the daemon may not unlink it (``/dev/shm`` is sticky: only the file's owner or
    root may, so a daemon that maps a group's segments cannot), it empties the file instead
    (truncates it to 0 bytes, which frees its memory; the runner, its only user, is gone)
    and leaves the empty name for its owner. Returns what happened: "removed", "emptied",
    "gone" (nothing there), "replaced" (another file has the name) or "kept" (an error,
    logged)."""
    dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if SegmentIdentity.of(st) != identity:
            log.warning(
                "not removing %s/%s: the name now leads to another file (owner uid %d)", shm_dir, name, st.st_uid
            )
            return "replaced"
        # Between the stat and the unlink only the file's owner or root could swap the name.
        os.unlink(name, dir_fd=dir_fd)
        log.info("removed the dead runner's segment %s/%s", shm_dir, name)
        return "removed"
    except FileNotFoundError:
        return "gone"
    except PermissionError:
        return _empty_segment(name, identity, dir_fd, shm_dir)
    except OSError as exc:
        log.warning("could not remove the dead runner's segment %s/%s: %s", shm_dir, name, exc)
        return "kept"
    finally:
        os.close(dir_fd)


def _empty_segment(name: str, identity: SegmentIdentity, dir_fd: int, shm_dir: str) -> str:
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        log.warning("could not remove or empty the dead runner's segment %s/%s: %s", shm_dir, name, exc)
        return "kept"
    try:
        if SegmentIdentity.of(os.fstat(fd)) != identity:  # checked on the opened file: no race
            log.warning("not emptying %s/%s: the name now leads to another file", shm_dir, name)
            return "replaced"
        os.ftruncate(fd, 0)
    except OSError as exc:
        log.warning("could not empty the dead runner's segment %s/%s: %s", shm_dir, name, exc)
        return "kept"
    finally:
        os.close(fd)
    log.warning(
        "emptied the dead runner's segment %s/%s (its memory is freed); only its owner, uid %d, may remove the "
        "empty name", shm_dir, name, identity.owner,
    )  # fmt: skip
    return "emptied"


class CopyFence:
    """Copies into or out of the runner's device blocks whose commands carry a ``not_after``
    hold a shared flock on the daemon's open file description of the device segment
    (protocol 1.5 and 1.6, docs/protocol.md §7.14), and check their ``not_after`` once they
    hold it. A client that gives up on a copy after its ``not_after`` takes an exclusive flock
    without waiting on its own open file description: if it gets it, no copy of its blocks
    is running and none can start (it would be too late), so it may reuse the blocks. A
    client may also keep that lock until the ``not_after`` of the copies it gave up has
    passed: copy threads wait for it meanwhile (never the event loop). The kernel drops the
    lock of a process that dies.

    The copy threads share one lock: the first to enter takes it, the last to leave drops it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._mutex = threading.Lock()
        self._holders = 0

    def enter(self, wait: bool = True) -> bool:
        """Holds the fence; False (without waiting) when ``wait`` is off and a client holds it."""
        if not self._mutex.acquire(blocking=wait):
            return False
        try:
            if self._holders == 0:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
                except BlockingIOError:
                    return False
            self._holders += 1
            return True
        finally:
            self._mutex.release()

    def leave(self) -> None:
        with self._mutex:
            self._holders -= 1
            if self._holders == 0:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._mutex:
            if self.fd >= 0:
                os.close(self.fd)  # drops the lock too
                self.fd = -1


class CpuDeviceCache(BatchedDeviceCache):
    inline_bytes = _INLINE_BYTES
    fence = "flock"
    fence_reads = True

    def __init__(
        self, backend: CpuBackend, layout: KVLayout, device: dict[str, Any], host: torch.Tensor, requester: Requester
    ) -> None:
        name, fd, wire_offsets = decode_device(device)
        segment = open_device_segment(name, fd, requester)
        self.identity = segment.identity
        self.fence_lock = CopyFence(segment.fd)
        try:
            self.layout = layout
            self.segment = name if name is not None and self.identity is not None else ""
            offsets = validate_offsets(wire_offsets, layout, segment.size)
            self._backend = backend
            self._storage: torch.UntypedStorage | None = segment.storage
            self.groups = self._make_groups(segment.storage, offsets, host)
        except BaseException:
            self.fence_lock.close()
            raise

    def _make_groups(self, storage: torch.UntypedStorage, offsets: list[int], host: torch.Tensor) -> list[TensorGroup]:
        base = torch.empty(0, dtype=torch.uint8).set_(storage)
        nb, chunk = self.layout.num_blocks, self.layout.chunk_bytes
        groups = []
        for first, count, stride in even_groups(offsets):
            device = torch.as_strided(base, (nb, count, chunk), (chunk, stride or 1, 1), offsets[first])
            group_host = host[:, first : first + count]
            if count * chunk <= _GATHER_MAX_BYTES:
                groups.append(TensorGroup(first, count, device, group_host, device.numpy(), group_host.numpy()))
            else:
                groups.append(TensorGroup(first, count, device, group_host))
        return groups

    @property
    def mappings(self) -> int:
        return 0 if self._storage is None else 1

    async def swap_many(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        pool = self._backend.pools[direction]
        blocks = sum(len(r.device_ids) for r in requests)
        parts = max(1, min(self._backend.copy_threads, blocks * self.layout.host_block_bytes // _MIN_SHARD_BYTES))
        jobs = [(i, coalesce(r.device_ids, r.host_ids)) for i, r in enumerate(requests)]
        cancels = [r.cancel for r in requests]
        shards = [[split_runs(i, runs) for i, runs in shard] for shard in shard_tagged(jobs, parts)]
        futures = [asyncio.wrap_future(pool.submit(self._copy_shard, direction, s, cancels)) for s in shards]
        results: list[BaseException | None] = [None] * len(requests)
        for outcome in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(outcome, BaseException):  # a bug in the worker: every command of the batch fails
                return [outcome] * len(requests)
            for index, error in outcome.items():
                results[index] = results[index] or error
        return results

    def swap_now(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        fenced = _fenced([r.cancel for r in requests])
        if fenced and not self.fence_lock.enter(wait=False):  # never wait on the loop thread
            raise InlineBusy("a client holds the device fence")
        try:
            to_host = direction is Direction.D2H
            pairs = _block_pairs(requests, to_host)
            if pairs is not None:  # the common batch: straight to one copy per group
                for group in self.groups:
                    _copy_pairs(group, to_host, *pairs)
                return [None] * len(requests)
            items = [plan_item(i, r.device_ids, r.host_ids) for i, r in enumerate(requests)]
            failed = self._copy_items(direction, items, [r.cancel for r in requests])
        finally:
            if fenced:
                self.fence_lock.leave()
        if not failed:
            return [None] * len(requests)
        return [failed.get(i) for i in range(len(requests))]

    def _copy_shard(
        self, direction: Direction, items: list[CopyItem], cancels: list[CancelToken]
    ) -> dict[int, ProtocolError]:
        """Runs on a worker thread; copies of device blocks go inside the device fence."""
        if not _fenced(cancels):
            return self._copy_items(direction, items, cancels)
        self.fence_lock.enter()
        try:
            return self._copy_items(direction, items, cancels)
        finally:
            self.fence_lock.leave()

    def _copy_items(
        self, direction: Direction, items: list[CopyItem], cancels: list[CancelToken]
    ) -> dict[int, ProtocolError]:
        """Torch and numpy release the GIL inside each copy. Returns the commands that were
        cancelled (or too late to start), with fresh errors: a raised error's traceback would
        hold this frame, whose views keep the segment mapped after detach until the GC ran."""
        failed: dict[int, ProtocolError] = {}
        to_host = direction is Direction.D2H
        now = time.time()  # after entering the fence: a client that gave up before sees it refused
        for group in self.groups:
            src_view, dst_view = (group.device, group.host) if to_host else (group.host, group.device)
            singles_src: list[int] = []
            singles_dst: list[int] = []
            for index, single_device, single_host, runs in items:
                cancel = cancels[index]
                if cancel.cancelled or now > cancel.not_after:
                    refusal = cancel.refusal(now)
                    assert refusal is not None
                    failed.setdefault(index, refusal)
                    continue
                for run in runs:
                    s, d = (run.device, run.host) if to_host else (run.host, run.device)
                    dst_view[d : d + run.length].copy_(src_view[s : s + run.length])
                if to_host:
                    singles_src += single_device
                    singles_dst += single_host
                else:
                    singles_src += single_host
                    singles_dst += single_device
                if len(singles_src) >= _FOREACH_BATCH:
                    _copy_pairs(group, to_host, singles_src, singles_dst)
                    singles_src, singles_dst = [], []
            if singles_src:
                _copy_pairs(group, to_host, singles_src, singles_dst)
        return failed

    def close(self) -> None:
        # Dropping the last views unmaps the segment (torch owns the mapping); collect so
        # that no view left in a reference cycle keeps it mapped after the detach reply.
        self.groups = []
        self._storage = None
        gc.collect()
        self.fence_lock.close()

    def orphaned(self) -> None:
        # The runner unlinks its segment when it closes its cache; one killed with SIGKILL
        # never does, and the name would pin the memory until reboot. Both sides are gone
        # now (we closed our mapping), so the file can go.
        if self.identity is not None:  # a segment mapped by descriptor has no name to remove
            remove_segment(self.segment, self.identity)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "segment": self.segment, "groups": len(self.groups)}


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, copy_threads: int = 2) -> None:
        # The workers are the parallelism; torch's own pool would fork per small copy.
        torch.set_num_threads(1)
        self.copy_threads = copy_threads
        self.pools = {
            direction: ThreadPoolExecutor(copy_threads, thread_name_prefix=f"cx-{direction.value}")
            for direction in Direction
        }

    def create_host_pool(self, capacity: int) -> HostPool:
        return HostPool(capacity)

    def import_device_cache(
        self, layout: KVLayout, device: dict[str, Any], pool: HostPool, geometry: HostGeometry, requester: Requester
    ) -> DeviceCache:
        return CpuDeviceCache(self, layout, device, pool.blocks(geometry, layout.num_tensors), requester)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "copy_threads": self.copy_threads}

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=True)


def _fenced(cancels: Sequence[CancelToken]) -> bool:
    """Whether copies go inside the device fence: for a client that may give up on them (it
    sent a ``not_after``), in both directions (1.6: a copy out of device blocks the client
    has reused since would put other KV in the host blocks). Others skip its system calls."""
    return any(c.not_after < math.inf for c in cancels)


def _block_pairs(requests: Sequence[SwapRequest], to_host: bool) -> tuple[list[int], list[int]] | None:
    """(source ids, destination ids) of every block pair of the requests when none is
    cancelled and they are few enough for one gathered copy, else None. Only for the loop
    thread, where no cancel can come in between. A batch small enough to be copied there
    gains nothing from finding runs of consecutive blocks: one indexed copy takes them all."""
    device: list[int] = []
    host: list[int] = []
    now = time.time()
    for device_ids, host_ids, cancel in requests:
        if cancel.cancelled or now > cancel.not_after:
            return None
        device += device_ids
        host += host_ids
    if len(device) > _FOREACH_BATCH:
        return None
    return (device, host) if to_host else (host, device)


def _copy_pairs(group: TensorGroup, to_host: bool, src_ids: list[int], dst_ids: list[int]) -> None:
    """Copies block ``src_ids[i]`` to block ``dst_ids[i]`` of every tensor in the group, in
    one call. Destinations never repeat within a batch (a command's destination ids are
    unique, and two commands writing one block are never ready together)."""
    count = len(src_ids)
    if count == 0:  # empty swaps: torch's list copy refuses an empty list
        return
    if count > 1 and _one_run(src_ids, dst_ids):  # one slice copy: each byte moves once
        src, dst = src_ids[0], dst_ids[0]
        src_view, dst_view = (group.device, group.host) if to_host else (group.host, group.device)
        dst_view[dst : dst + count].copy_(src_view[src : src + count])
        return
    if group.device_rows is not None and group.host_rows is not None:
        src_rows, dst_rows = (group.device_rows, group.host_rows) if to_host else (group.host_rows, group.device_rows)
        if len(src_ids) < _GATHER_MIN_BLOCKS:
            for s, d in zip(src_ids, dst_ids):
                dst_rows[d] = src_rows[s]
        else:
            dst_rows[dst_ids] = src_rows[src_ids]
        return
    src_view, dst_view = (group.device, group.host) if to_host else (group.host, group.device)
    torch._foreach_copy_([dst_view[d] for d in dst_ids], [src_view[s] for s in src_ids])


def _one_run(src_ids: list[int], dst_ids: list[int]) -> bool:
    """Whether both lists count up by one from their first id (consecutive blocks on both
    sides, as an engine's freshly allocated blocks often are). The ends are compared first:
    scattered ids almost never pass that."""
    last = len(src_ids) - 1
    first_src, first_dst = src_ids[0], dst_ids[0]
    return (
        src_ids[last] - first_src == last and dst_ids[last] - first_dst == last
        and src_ids == list(range(first_src, first_src + last + 1))
        and dst_ids == list(range(first_dst, first_dst + last + 1))
    )  # fmt: skip


def create(config: Config) -> CpuBackend:
    return CpuBackend(config.host_cache.copy_threads)
