"""The cpu backend: the runner's KV cache lives in POSIX shared memory.

Attach handles (``device`` map of the attach command; exactly these keys)::

    {"kind": "shm", "name": "<name in /dev/shm>", "offsets": [byte offset of each tensor]}

Each tensor is ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous at its offset.
When the attached runner dies, the daemon removes its segment (see ``remove_segment``).

Copies are torch ``copy_`` calls on strided uint8 views, which release the GIL:
- tensors evenly spaced in the segment form one *group*, viewed as ``[num_blocks, g, chunk]``,
  so one copy moves a block (or a run of consecutive blocks) of every tensor in the group;
- consecutive ids are coalesced into runs (one copy per run and group);
- single blocks are batched into ``torch._foreach_copy_`` to avoid per-call Python cost,
  across all the commands of a batch (``swap_many``: one hand-off per batch, not per command);
- the runs are cut into shards that run on ``copy_threads`` workers per direction, and
  device->host and host->device have separate workers, so both directions run at once.
torch's own intra-op threads are set to 1 in the daemon: the workers are the parallelism.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import itertools
import logging
import os
import re
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ..host_cache import HostGeometry, HostPool
from ..protocol import ErrorCode, KVLayout, ProtocolError
from ..security import Requester, SegmentPolicy
from .base import AttachError, Backend, CancelToken, DeviceCache, Direction, SwapRequest
from .plan import Run, coalesce, even_groups, shard_tagged

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
KIND = "shm"
DEVICE_KEYS = frozenset({"kind", "name", "offsets"})
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_FOREACH_BATCH = 512  # single-block copies per _foreach_copy_ call (bounds cancel latency)
_MIN_SHARD_BYTES = 2 << 20  # below this, handing work to another thread costs more than it saves
_INLINE_BYTES = 1 << 20  # a batch this small is copied on the loop thread (tens of microseconds)


@dataclass(frozen=True)
class TensorGroup:
    """Tensors ``first .. first+count-1`` seen as one strided view of the segment."""

    first: int
    count: int
    device: torch.Tensor  # [num_blocks, count, chunk] uint8 view into the shared segment
    host: torch.Tensor  # [host_blocks, count, chunk] uint8 view into the host pool


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


def decode_device(device: Any) -> tuple[str, Any]:
    """(segment name, offsets as sent): the map must be exactly the documented one."""
    if type(device) is not dict or device.get("kind") != KIND:
        raise AttachError(f"cpu backend needs device.kind = {KIND!r}", ErrorCode.BAD_FIELD)
    unknown = set(device) - DEVICE_KEYS
    if unknown:
        raise AttachError(f"device has unknown fields {sorted(map(str, unknown))}", ErrorCode.BAD_FIELD)
    name = device.get("name")
    if type(name) is not str or not _SHM_NAME.match(name) or name in (".", ".."):
        raise AttachError("device.name must be 1-200 chars of [A-Za-z0-9._-]", ErrorCode.BAD_FIELD)
    return name, device.get("offsets")


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


def open_segment(name: str, policy: SegmentPolicy) -> tuple[torch.UntypedStorage, int, SegmentIdentity]:
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
    finally:
        os.close(fd)
    return storage, st.st_size, SegmentIdentity.of(st)


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


class CpuDeviceCache(DeviceCache):
    inline_bytes = _INLINE_BYTES

    def __init__(
        self, backend: CpuBackend, layout: KVLayout, device: dict[str, Any], host: torch.Tensor, requester: Requester
    ) -> None:
        name, wire_offsets = decode_device(device)
        storage, size, self.identity = open_segment(name, requester.segments)
        self.layout = layout
        self.segment = name
        offsets = validate_offsets(wire_offsets, layout, size)
        self._backend = backend
        self._storage: torch.UntypedStorage | None = storage
        self.groups = self._make_groups(storage, offsets, host)

    def _make_groups(self, storage: torch.UntypedStorage, offsets: list[int], host: torch.Tensor) -> list[TensorGroup]:
        base = torch.empty(0, dtype=torch.uint8).set_(storage)
        nb, chunk = self.layout.num_blocks, self.layout.chunk_bytes
        groups = []
        for first, count, stride in even_groups(offsets):
            device = torch.as_strided(base, (nb, count, chunk), (chunk, stride or 1, 1), offsets[first])
            groups.append(TensorGroup(first, count, device, host[:, first : first + count]))
        return groups

    @property
    def mappings(self) -> int:
        return 0 if self._storage is None else 1

    async def swap(
        self, direction: Direction, device_ids: Sequence[int], host_ids: Sequence[int], cancel: CancelToken
    ) -> int:
        (error,) = await self.swap_many(direction, [SwapRequest(device_ids, host_ids, cancel)])
        if error is not None:
            raise error
        return len(device_ids) * self.layout.host_block_bytes

    async def swap_many(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        pool = self._backend.pools[direction]
        blocks = sum(len(r.device_ids) for r in requests)
        parts = max(1, min(self._backend.copy_threads, blocks * self.layout.host_block_bytes // _MIN_SHARD_BYTES))
        jobs = [(i, coalesce(r.device_ids, r.host_ids)) for i, r in enumerate(requests)]
        cancels = [r.cancel for r in requests]
        shards = shard_tagged(jobs, parts)
        futures = [asyncio.wrap_future(pool.submit(self._copy_shard, direction, s, cancels)) for s in shards]
        results: list[BaseException | None] = [None] * len(requests)
        for outcome in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(outcome, BaseException):  # a bug in the worker: every command of the batch fails
                return [outcome] * len(requests)
            for index, error in outcome.items():
                results[index] = results[index] or error
        return results

    def swap_now(self, direction: Direction, requests: Sequence[SwapRequest]) -> list[BaseException | None]:
        items = [(i, coalesce(r.device_ids, r.host_ids)) for i, r in enumerate(requests)]
        failed = self._copy_shard(direction, items, [r.cancel for r in requests])
        return [failed.get(i) for i in range(len(requests))]

    def _copy_shard(
        self, direction: Direction, items: list[tuple[int, list[Run]]], cancels: list[CancelToken]
    ) -> dict[int, ProtocolError]:
        """Runs on a worker thread; torch releases the GIL inside each copy. Returns the
        commands that were cancelled, with fresh errors: a raised error's traceback would
        hold this frame, whose views keep the segment mapped after detach until the GC ran."""
        failed: dict[int, ProtocolError] = {}
        to_host = direction is Direction.D2H
        for group in self.groups:
            src_view, dst_view = (group.device, group.host) if to_host else (group.host, group.device)
            singles_src: list[torch.Tensor] = []
            singles_dst: list[torch.Tensor] = []
            for index, runs in items:
                cancel = cancels[index]
                if cancel.cancelled:
                    failed.setdefault(index, ProtocolError(cancel.code, cancel.detail))
                    continue
                for run in runs:
                    s, d = (run.device, run.host) if to_host else (run.host, run.device)
                    if run.length > 1:
                        dst_view[d : d + run.length].copy_(src_view[s : s + run.length])
                        continue
                    singles_src.append(src_view[s])
                    singles_dst.append(dst_view[d])
                    if len(singles_src) == _FOREACH_BATCH:
                        torch._foreach_copy_(singles_dst, singles_src)
                        singles_src, singles_dst = [], []
            if singles_src:
                torch._foreach_copy_(singles_dst, singles_src)
        return failed

    def close(self) -> None:
        # Dropping the last views unmaps the segment (torch owns the mapping); collect so
        # that no view left in a reference cycle keeps it mapped after the detach reply.
        self.groups = []
        self._storage = None
        gc.collect()

    def orphaned(self) -> None:
        # The runner unlinks its segment when it closes its cache; one killed with SIGKILL
        # never does, and the name would pin the memory until reboot. Both sides are gone
        # now (we closed our mapping), so the file can go.
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


def create(config: Config) -> CpuBackend:
    return CpuBackend(config.host_cache.copy_threads)
