"""The ``device`` map of an ATTACH for the cuda backend: CUDA IPC handles on the wire.

Shared by the runner side (client/cuda_runner.py builds it) and the daemon side
(backends/cuda_ipc.py decodes and imports it); docs/protocol.md and docs/cuda.md give the
normative text::

    {"kind": "cuda_ipc",
     "device_uuid": "GPU-8-4-4-4-12 hex",
     "storages": [{"handle": bin, "offset": int, "size": int,
                   "ref_counter": bin, "ref_counter_offset": int,
                   "event": bin, "event_sync": bool}, ...],
     "tensors": [[storage index, byte offset], ...]}    # exactly layout.num_tensors

A storage entry is what torch's ``UntypedStorage._share_cuda_()`` returns for one storage
(the allocation's IPC handle, where the storage sits in it, torch's IPC ref counter and the
producer's event); a tensor entry says where one device tensor starts in a storage.
Everything is msgpack primitives: nothing is ever unpickled. Decoding is strict: a map with
a key outside those listed is refused (BAD_FIELD), so a field can only ever come from the
client that sent it.

Imports neither torch nor the daemon.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .constants import ErrorCode, Limits
from .errors import ProtocolError
from .layout import KVLayout

KIND = "cuda_ipc"
MAX_HANDLE_BYTES = 1 << 20  # expandable-segment handles list one entry per mapped chunk
MAX_REF_COUNTER_BYTES = 255
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 slots per counter file
EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
MAX_STORAGE_BYTES = 1 << 48
_UUID = re.compile(r"^(?:(GPU|MIG)-)?([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$", re.IGNORECASE)
_REF_COUNTER = re.compile(rb"^/[A-Za-z0-9._-]{1,254}$")  # a POSIX shm name, as torch makes them
STORAGE_KEYS = frozenset({"handle", "offset", "size", "ref_counter", "ref_counter_offset", "event", "event_sync"})
DEVICE_KEYS = frozenset({"kind", "device_uuid", "storages", "tensors"})


def _bad(detail: str, code: ErrorCode = ErrorCode.BAD_FIELD) -> ProtocolError:
    return ProtocolError(code, detail)


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


def encode_device(device_uuid: str, storages: Sequence[SharedStorage], tensors: Sequence[TensorRef]) -> dict[str, Any]:
    """The attach ``device`` map (what a runner sends)."""
    return {
        "kind": KIND,
        "device_uuid": normalize_uuid(device_uuid),
        "storages": [s.to_wire() for s in storages],
        "tensors": [[t.storage, t.offset] for t in tensors],
    }


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
    if type(entry) is not dict or set(entry) != STORAGE_KEYS:
        raise _bad(f"{name} must be a map with exactly the keys {sorted(STORAGE_KEYS)}")
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
    unknown = set(device) - DEVICE_KEYS
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
