"""CUDA IPC attach, daemon side: the ``device`` map (wire format in
cachexferd/protocol/cuda_ipc.py) is imported into this process with torch's own IPC calls.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ...cuda_tensors import device_uuid
from ...protocol import KVLayout, ProtocolError
from ...protocol.cuda_ipc import (
    EVENT_HANDLE_BYTES,
    SharedStorage,
    TensorRef,
    decode_storages,
    decode_tensors,
    normalize_uuid,
)
from ..base import AttachError

if TYPE_CHECKING:
    import torch


def refusal(exc: ProtocolError) -> AttachError:
    """A wire-format refusal as the backends report it (same code, same detail)."""
    return AttachError(exc.detail, exc.code)


def decode_handles(device: Any) -> tuple[str, list[SharedStorage]]:
    """The device's UUID and storages, or AttachError (BAD_FIELD): pure, no GPU needed, and
    nothing to release when it refuses."""
    try:
        return decode_storages(device)
    except ProtocolError as exc:
        raise refusal(exc) from None


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
    device: Any, layout: KVLayout, served_uuid: str, device_index: int, ops: StorageOps
) -> tuple[list[SharedStorage], list[TensorRef], list[Any]]:
    """Validates and opens an attach's handles: (storages, tensor refs, opened storage per
    entry). Whatever is refused after the counters are known, every counter not owned by
    an opened storage is released before the error propagates."""
    uuid, storages = decode_handles(device)
    pending = PendingCounters(storages)
    try:
        if uuid != served_uuid:
            raise AttachError(f"the runner's cache is on {uuid}; this daemon serves {served_uuid}")
        try:
            refs = decode_tensors(device, storages, layout)
        except ProtocolError as exc:
            raise refusal(exc) from None
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


# Device identity ------------------------------------------------------------------------


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
    except ProtocolError as exc:
        raise ValueError(f"cuda.device {spec!r}: {exc.detail}") from None
    if wanted not in uuids:
        raise ValueError(f"cuda.device {spec!r} is not among the visible devices {list(uuids)}")
    return list(uuids).index(wanted)


# Device tensors ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceTensor:
    """One device KV tensor: ``offset`` bytes into an (imported or local) storage, which
    this keeps alive (and with it the IPC mapping) until the cache closes."""

    storage: torch.UntypedStorage
    offset: int

    @property
    def address(self) -> int:
        return int(self.storage.data_ptr()) + self.offset


def from_tensors(tensors: Sequence[torch.Tensor]) -> list[DeviceTensor]:
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        out.append(DeviceTensor(storage, t.data_ptr() - storage.data_ptr()))
    return out
