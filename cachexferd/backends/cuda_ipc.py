"""CUDA IPC handles for attach: the wire form, its validation, import and export.

Wire form (the ``device`` map of an attach command for the cuda backend; docs/cuda.md
and docs/protocol.md give the normative text)::

    {"kind": "cuda_ipc",
     "device_uuid": "GPU-8-4-4-4-12 hex",
     "storages": [{"handle": bin, "offset": int, "size": int,
                   "ref_counter": bin, "ref_counter_offset": int,
                   "event": bin, "event_sync": bool}, ...],
     "tensors": [[storage index, byte offset], ...]}    # exactly layout.num_tensors

A storage entry is what torch's ``UntypedStorage._share_cuda_()`` returns for one storage
(the allocation's IPC handle, where the storage sits in it, torch's IPC ref counter and
the producer's event); a tensor entry says where one device tensor starts in a storage.
Everything is msgpack primitives: nothing is ever unpickled.

Ref counters: every export (``_share_cuda_`` call) bumps a counter in the runner's shared
memory, and the runner's caching allocator will not reuse that memory until the counter
is back to zero. The daemon therefore consumes every counter it is handed exactly once:
the storage it opens releases its counter when that storage dies (at detach), and every
other counter (duplicates, or all of them when the attach is refused after decoding) is
released at once. A handle set is single-use: export afresh for every attach.

Nothing here imports torch at module import time; the CPU tests drive the validation and
the import bookkeeping with fakes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..protocol import ErrorCode, KVLayout, Limits
from .base import AttachError

if TYPE_CHECKING:
    import torch

KIND = "cuda_ipc"
MAX_HANDLE_BYTES = 1 << 20  # expandable-segment handles list one entry per mapped chunk
MAX_REF_COUNTER_BYTES = 255
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 slots per counter file
EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
MAX_STORAGE_BYTES = 1 << 48
_UUID = re.compile(r"^(?:(GPU|MIG)-)?([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$", re.IGNORECASE)
_REF_COUNTER = re.compile(rb"^/[A-Za-z0-9._-]{1,254}$")  # a POSIX shm name, as torch makes them
_STORAGE_KEYS = frozenset({"handle", "offset", "size", "ref_counter", "ref_counter_offset", "event", "event_sync"})
_DEVICE_KEYS = frozenset({"kind", "device_uuid", "storages", "tensors"})


def _bad(detail: str, code: ErrorCode = ErrorCode.BAD_FIELD) -> AttachError:
    return AttachError(detail, code)


def normalize_uuid(text: Any) -> str:
    """'GPU-<8-4-4-4-12 hex>' in lower case; accepts the bare hex form torch prints."""
    match = _UUID.match(text) if isinstance(text, str) else None
    if match is None:
        raise _bad(f"device_uuid must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, got {text!r}")
    prefix = (match.group(1) or "GPU").upper()
    return f"{prefix}-{match.group(2).lower()}"


@dataclass(frozen=True)
class SharedStorage:
    """One exported torch storage (one ``_share_cuda_`` result)."""

    handle: bytes  # IPC handle of the allocation holding the storage (torch's format, opaque)
    offset: int  # bytes from the allocation's base to the storage
    size: int  # bytes of the storage
    ref_counter: bytes  # shm name of torch's ref-counter file in the runner
    ref_counter_offset: int  # int64 slot in that file
    event: bytes  # cudaIpcEventHandle_t of the producer's last use, or b""
    event_sync: bool  # wait on ``event`` before the first use

    @property
    def key(self) -> tuple[bytes, int]:
        """Identifies the storage: torch opens one storage per key."""
        return self.handle, self.offset

    @property
    def counter(self) -> tuple[bytes, int]:
        return self.ref_counter, self.ref_counter_offset

    def to_wire(self) -> dict[str, Any]:
        return {
            "handle": self.handle,
            "offset": self.offset,
            "size": self.size,
            "ref_counter": self.ref_counter,
            "ref_counter_offset": self.ref_counter_offset,
            "event": self.event,
            "event_sync": self.event_sync,
        }


@dataclass(frozen=True)
class TensorRef:
    storage: int  # index into the storages list
    offset: int  # byte offset of the tensor's first element in that storage


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _bin(name: str, value: Any, lo: int, hi: int) -> bytes:
    if type(value) is not bytes or not lo <= len(value) <= hi:
        size = len(value) if isinstance(value, bytes) else type(value).__name__
        raise _bad(f"{name} must be msgpack bin of {lo}..{hi} bytes, got {size}")
    return value


def decode_storage(index: int, entry: Any) -> SharedStorage:
    name = f"device.storages[{index}]"
    if type(entry) is not dict or set(entry) != _STORAGE_KEYS:
        raise _bad(f"{name} must be a map with exactly the keys {sorted(_STORAGE_KEYS)}")
    ref_counter = _bin(f"{name}.ref_counter", entry["ref_counter"], 2, MAX_REF_COUNTER_BYTES)
    if not _REF_COUNTER.match(ref_counter):
        raise _bad(f"{name}.ref_counter must be a shared-memory name such as b'/torch_123_456_0'")
    event_sync = entry["event_sync"]
    if type(event_sync) is not bool:
        raise _bad(f"{name}.event_sync must be a bool")
    event = _bin(f"{name}.event", entry["event"], EVENT_HANDLE_BYTES if event_sync else 0, EVENT_HANDLE_BYTES)
    if len(event) not in (0, EVENT_HANDLE_BYTES):
        raise _bad(f"{name}.event must be empty or {EVENT_HANDLE_BYTES} bytes")
    return SharedStorage(
        handle=_bin(f"{name}.handle", entry["handle"], 1, MAX_HANDLE_BYTES),
        offset=_int(f"{name}.offset", entry["offset"], 0, MAX_STORAGE_BYTES),
        size=_int(f"{name}.size", entry["size"], 1, MAX_STORAGE_BYTES),
        ref_counter=ref_counter,
        ref_counter_offset=_int(f"{name}.ref_counter_offset", entry["ref_counter_offset"], 0, REF_COUNTER_SLOTS - 1),
        event=event,
        event_sync=event_sync,
    )


def decode_storages(device: Any) -> tuple[str, list[SharedStorage]]:
    """(device_uuid, storages). Malformed input raises before any counter is known, so a
    refusal here leaves nothing to release."""
    if type(device) is not dict or device.get("kind") != KIND:
        raise _bad(f"cuda backend needs device.kind = {KIND!r}")
    unknown = set(device) - _DEVICE_KEYS
    if unknown:
        raise _bad(f"device has unknown fields {sorted(map(str, unknown))}")
    uuid = normalize_uuid(device.get("device_uuid"))
    entries = device.get("storages")
    if type(entries) is not list or not 1 <= len(entries) <= Limits.MAX_TENSORS:
        raise _bad(f"device.storages must list 1..{Limits.MAX_TENSORS} exported storages")
    storages = [decode_storage(i, entry) for i, entry in enumerate(entries)]
    counters = [s.counter for s in storages]
    if len(set(counters)) != len(counters):
        raise _bad("device.storages repeats a ref counter: export every storage with its own _share_cuda_() call")
    return uuid, storages


def decode_tensors(device: dict[str, Any], storages: Sequence[SharedStorage], layout: KVLayout) -> list[TensorRef]:
    """Tensor placements, checked against the layout and the storages' sizes."""
    entries = device.get("tensors")
    if type(entries) is not list or len(entries) != layout.num_tensors:
        raise _bad(f"device.tensors must list {layout.num_tensors} [storage index, byte offset] pairs")
    refs = []
    for i, entry in enumerate(entries):
        if type(entry) is not list or len(entry) != 2:
            raise _bad(f"device.tensors[{i}] must be [storage index, byte offset]")
        storage = _int(f"device.tensors[{i}][0]", entry[0], 0, len(storages) - 1)
        offset = _int(f"device.tensors[{i}][1]", entry[1], 0, MAX_STORAGE_BYTES)
        if offset + layout.tensor_bytes > storages[storage].size:
            raise _bad(
                f"device.tensors[{i}] needs {layout.tensor_bytes} bytes at offset {offset}; "
                f"storage {storage} has {storages[storage].size}",
                ErrorCode.LAYOUT_MISMATCH,
            )
        refs.append(TensorRef(storage, offset))
    check_overlaps(storages, refs, layout.tensor_bytes)
    return refs


def check_overlaps(storages: Sequence[SharedStorage], tensors: Sequence[TensorRef], tensor_bytes: int) -> None:
    """Tensors must not share bytes: a swap-in into one would overwrite another. Compared in
    allocation coordinates, since storages of one allocation may overlap each other."""
    spans = sorted(
        (storages[t.storage].handle, storages[t.storage].offset + t.offset, i) for i, t in enumerate(tensors)
    )
    for (h1, start1, i1), (h2, start2, i2) in itertools.pairwise(spans):
        if h1 == h2 and start2 < start1 + tensor_bytes:
            raise _bad(f"device.tensors[{i1}] and device.tensors[{i2}] overlap", ErrorCode.LAYOUT_MISMATCH)


# Importing (daemon side) ----------------------------------------------------------------


class StorageOps(Protocol):
    """How storages are opened and counters released; torch in production, fakes in tests."""

    def open(self, device_index: int, storage: SharedStorage) -> Any: ...

    def release(self, storage: SharedStorage) -> None: ...


class PendingCounters:
    """Counters handed to the daemon that nothing has consumed yet (thread-confined)."""

    def __init__(self, storages: Sequence[SharedStorage]) -> None:
        self._pending = {s.counter: s for s in storages}

    def consume(self, storage: SharedStorage) -> None:
        """Its counter is now owned by an opened storage (released when that dies)."""
        self._pending.pop(storage.counter, None)

    def release(self, storage: SharedStorage, ops: StorageOps) -> None:
        if self._pending.pop(storage.counter, None) is not None:
            ops.release(storage)

    def release_rest(self, ops: StorageOps) -> None:
        for storage in list(self._pending.values()):
            self.release(storage, ops)

    def __len__(self) -> int:
        return len(self._pending)


def open_storages(
    device_index: int, storages: Sequence[SharedStorage], ops: StorageOps, pending: PendingCounters
) -> list[Any]:
    """Opens each distinct storage once; a repeated (handle, offset) reuses the first and
    releases its own counter at once. Returns one opened object per wire entry."""
    opened: dict[tuple[bytes, int], Any] = {}
    result = []
    for storage in storages:
        if storage.key in opened:
            pending.release(storage, ops)
        else:
            opened[storage.key] = ops.open(device_index, storage)
            pending.consume(storage)
        result.append(opened[storage.key])
    return result


def import_handles(
    device: Any, layout: KVLayout, device_uuid: str, device_index: int, ops: StorageOps
) -> tuple[list[SharedStorage], list[TensorRef], list[Any]]:
    """Validates and opens an attach's handles: (storages, tensor refs, opened storage per
    entry). Whatever is refused after the counters are known, every counter not owned by
    an opened storage is released before the error propagates."""
    uuid, storages = decode_storages(device)
    pending = PendingCounters(storages)
    try:
        if uuid != device_uuid:
            raise AttachError(f"the runner's cache is on {uuid}; this daemon serves {device_uuid}")
        refs = decode_tensors(device, storages, layout)
        opened = open_storages(device_index, storages, ops, pending)
    except BaseException:
        pending.release_rest(ops)  # the runner's allocator keeps the memory until each is released
        raise
    return storages, refs, opened


class TorchStorageOps:
    """Opens storages with torch's own CUDA IPC import (the same calls its tensor reductions
    use, fed from msgpack fields instead of a pickle)."""

    def open(self, device_index: int, storage: SharedStorage) -> Any:
        import torch

        event = storage.event or bytes(EVENT_HANDLE_BYTES)
        return torch.UntypedStorage._new_shared_cuda(
            device_index,
            storage.handle,
            storage.size,
            storage.offset,
            storage.ref_counter,
            storage.ref_counter_offset,
            event,
            storage.event_sync,
        )

    def release(self, storage: SharedStorage) -> None:
        import torch

        torch.UntypedStorage._release_ipc_counter_cuda(storage.ref_counter, storage.ref_counter_offset)


class ImportWatch:
    """Weak references to opened storages, to count the imports still open."""

    def __init__(self, storages: Sequence[SharedStorage], opened: Sequence[Any], weak: Callable[[Any], Any]) -> None:
        self._refs = [(s.handle, weak(obj)) for s, obj in zip(storages, opened)]

    def open_handles(self) -> int:
        """Distinct IPC handles with a storage still alive (each is one cudaIpcOpenMemHandle)."""
        return len({handle for handle, ref in self._refs if not ref.expired()})


# Exporting (runner side) ----------------------------------------------------------------


def export_storage(storage: torch.UntypedStorage) -> SharedStorage:
    """One ``_share_cuda_`` call: bumps torch's ref counter, which the daemon releases."""
    (_, handle, size, offset, ref_counter, ref_counter_offset, event, event_sync) = storage._share_cuda_()
    return SharedStorage(
        handle=bytes(handle),
        offset=int(offset),
        size=int(size),
        ref_counter=bytes(ref_counter),
        ref_counter_offset=int(ref_counter_offset),
        event=bytes(event) if event_sync else b"",
        event_sync=bool(event_sync),
    )


def export_tensors(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The attach ``device`` map for tensors allocated in this process."""
    check_runner_tensors(layout, tensors)
    by_storage: dict[int, int] = {}
    storages: list[SharedStorage] = []
    refs: list[list[int]] = []
    for tensor in tensors:
        untyped = tensor.untyped_storage()
        base = untyped.data_ptr()
        if base not in by_storage:
            by_storage[base] = len(storages)
            storages.append(export_storage(untyped))
        refs.append([by_storage[base], tensor.data_ptr() - base])
    return {
        "kind": KIND,
        "device_uuid": device_uuid(tensors[0].device.index or 0),
        "storages": [s.to_wire() for s in storages],
        "tensors": refs,
    }


def check_runner_tensors(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> None:
    shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if len(tensors) != layout.num_tensors:
        raise ValueError(f"layout needs {layout.num_tensors} tensors, got {len(tensors)}")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device or t.device.type != "cuda":
            raise ValueError(f"tensor {i} is on {t.device}; every tensor must be on one CUDA device ({device})")
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"tensor {i} must be contiguous with shape {shape}, got {tuple(t.shape)}")
        if str(t.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"tensor {i} has dtype {t.dtype}, layout says {layout.dtype}")


# Device identity ------------------------------------------------------------------------


def device_uuid(index: int) -> str:
    import torch

    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


def visible_uuids() -> list[str]:
    """UUIDs of the devices this process sees, by index (CUDA_VISIBLE_DEVICES applied)."""
    import torch

    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def resolve_device(spec: str, rank: int, uuids: Sequence[str]) -> int:
    """Local device index from ``cuda.device``: empty -> the daemon's rank, digits -> an
    index among the visible devices, else a UUID (with or without its 'GPU-' prefix)."""
    if not uuids:
        raise ValueError("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)")
    if spec == "" or spec.isdigit():
        index = rank if spec == "" else int(spec)
        if index >= len(uuids):
            source = f"daemon.rank {rank}" if spec == "" else f"cuda.device {spec}"
            raise ValueError(f"{source} names device {index}, but only {len(uuids)} are visible")
        return index
    try:
        wanted = normalize_uuid(spec)
    except AttachError as exc:
        raise ValueError(f"cuda.device {spec!r}: {exc}") from None
    if wanted not in uuids:
        raise ValueError(f"cuda.device {spec!r} is not among the visible devices {list(uuids)}")
    return list(uuids).index(wanted)
