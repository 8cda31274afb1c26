"""The cuda attach handle: wire encoding, validation, and ref-counter bookkeeping (no GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cachexferd.backends.base import AttachError
from cachexferd.backends.cuda.ipc import ImportWatch, decode_handles, import_handles, resolve_device
from cachexferd.cuda_tensors import check_runner_tensors
from cachexferd.protocol import Attach, ErrorCode, KVLayout, Limits, ProtocolError, decode_command, encode_command
from cachexferd.protocol.cuda_ipc import (
    EVENT_HANDLE_BYTES,
    KIND,
    SharedStorage,
    TensorRef,
    decode_storages,
    decode_tensors,
    encode_device,
    normalize_uuid,
)

UUID = "GPU-0123abcd-4567-89ab-cdef-0123456789ab"
OTHER_UUID = "GPU-ffffffff-4567-89ab-cdef-0123456789ab"
LAYOUT = KVLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype="float16")


def storage(n: int, size: int = 1 << 20, handle: bytes | None = None, offset: int = 0) -> SharedStorage:
    return SharedStorage(
        handle=handle if handle is not None else bytes([n]) * 64,
        offset=offset,
        size=size,
        ref_counter=f"/torch_100_{n}_0".encode(),
        ref_counter_offset=n,
        event=bytes(range(EVENT_HANDLE_BYTES)),
        event_sync=True,
    )


def device_map(storages: list[SharedStorage], tensors: list[list[int]], uuid: str = UUID) -> dict[str, Any]:
    return {"kind": KIND, "device_uuid": uuid, "storages": [s.to_wire() for s in storages], "tensors": tensors}


def test_encode_device_is_the_documented_map() -> None:
    refs = [TensorRef(0, 0), TensorRef(0, 4096)]
    expected = device_map([storage(1)], [[0, 0], [0, 4096]])
    assert encode_device(UUID.upper().removeprefix("GPU-"), [storage(1)], refs) == expected


def one_buffer_map() -> dict[str, Any]:
    """One storage holding every tensor back to back (what CudaKVCache exports)."""
    step = LAYOUT.tensor_bytes
    return device_map([storage(1, size=LAYOUT.num_tensors * step)], [[0, t * step] for t in range(LAYOUT.num_tensors)])


def _primitives_only(value: Any) -> bool:
    if isinstance(value, dict):
        return all(type(k) is str and _primitives_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_primitives_only(v) for v in value)
    return type(value) in (bytes, int, str, bool)


class FakeOps:
    """Stands in for torch's IPC import: records opens and counter releases."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.opened: list[tuple[int, SharedStorage]] = []
        self.released: list[tuple[bytes, int]] = []
        self.fail_on = fail_on

    def open(self, device_index: int, s: SharedStorage) -> Any:
        if self.fail_on is not None and len(self.opened) == self.fail_on:
            raise RuntimeError("cudaIpcOpenMemHandle failed")
        self.opened.append((device_index, s))
        return object()

    def release(self, s: SharedStorage) -> None:
        self.released.append(s.counter)


# Encoding ---------------------------------------------------------------------------------


def test_handle_survives_the_attach_codec_and_holds_only_primitives() -> None:
    device = one_buffer_map()
    assert _primitives_only(device)
    frames = encode_command(Attach(req_id=7, layout=LAYOUT.to_wire(), device=device, pid=1234))
    decoded = decode_command(frames)
    assert isinstance(decoded, Attach)
    assert decoded.device == device
    uuid, storages = decode_storages(decoded.device)
    assert uuid == UUID and storages == [storage(1, size=LAYOUT.num_tensors * LAYOUT.tensor_bytes)]
    refs = decode_tensors(decoded.device, storages, LAYOUT)
    assert [(r.storage, r.offset) for r in refs] == [(0, t * LAYOUT.tensor_bytes) for t in range(LAYOUT.num_tensors)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0123abcd-4567-89ab-cdef-0123456789ab", UUID),  # torch's str(props.uuid)
        ("GPU-0123ABCD-4567-89AB-CDEF-0123456789AB", UUID),
        ("gpu-0123abcd-4567-89ab-cdef-0123456789ab", UUID),
        ("MIG-0123abcd-4567-89ab-cdef-0123456789ab", "MIG-0123abcd-4567-89ab-cdef-0123456789ab"),
    ],
)
def test_uuid_normalisation(text: str, expected: str) -> None:
    assert normalize_uuid(text) == expected


@pytest.mark.parametrize("bad", ["", "GPU-xyz", "0123abcd4567", 5, None, "GPU-0123abcd-4567-89ab-cdef-0123456789ab0"])
def test_uuid_rejects_garbage(bad: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        normalize_uuid(bad)
    assert info.value.code == ErrorCode.BAD_FIELD


def _mutate_storage(key: str, value: Any) -> dict[str, Any]:
    device = one_buffer_map()
    device["storages"][0][key] = value
    return device


@pytest.mark.parametrize(
    "device",
    [
        {**one_buffer_map(), "kind": "shm"},
        {**one_buffer_map(), "extra": 1},
        {**one_buffer_map(), "storages": []},
        {**one_buffer_map(), "storages": "nope"},
        {**one_buffer_map(), "device_uuid": "cuda:0"},
        {**one_buffer_map(), "storages": [storage(1).to_wire()] * (Limits.MAX_TENSORS + 1)},
        _mutate_storage("handle", "text, not bin"),
        _mutate_storage("handle", b""),
        _mutate_storage("offset", -1),
        _mutate_storage("offset", True),
        _mutate_storage("size", 0),
        _mutate_storage("ref_counter", b"/torch/../../etc"),
        _mutate_storage("ref_counter", b"torch_no_slash"),
        _mutate_storage("ref_counter", b"/torch\x00x"),
        _mutate_storage("ref_counter_offset", 10000),
        _mutate_storage("event", b"short"),
        _mutate_storage("event_sync", 1),
        {**one_buffer_map(), "storages": [{k: v for k, v in storage(1).to_wire().items() if k != "size"}]},
    ],
)
def test_malformed_storages_are_refused(device: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_storages(device)
    assert info.value.code == ErrorCode.BAD_FIELD
    with pytest.raises(AttachError) as refused:  # as the backend reports it
        decode_handles(device)
    assert refused.value.code == ErrorCode.BAD_FIELD and str(refused.value) == info.value.detail


def test_event_may_be_empty_without_sync() -> None:
    device = _mutate_storage("event", b"")
    device["storages"][0]["event_sync"] = False
    _, storages = decode_storages(device)
    assert storages[0].event == b"" and not storages[0].event_sync
    device["storages"][0]["event_sync"] = True
    with pytest.raises(ProtocolError):
        decode_storages(device)


def test_repeated_ref_counter_is_refused() -> None:
    twice = storage(1)
    with pytest.raises(ProtocolError, match="repeats a ref counter"):
        decode_storages(device_map([twice, twice], [[0, 0]] * LAYOUT.num_tensors))


def test_not_a_map_is_refused() -> None:
    with pytest.raises(ProtocolError):
        decode_storages(["cuda_ipc"])


# Tensor placement -------------------------------------------------------------------------


def _tensors_error(storages: list[SharedStorage], tensors: Any) -> ProtocolError:
    device = device_map(storages, tensors)
    _, decoded = decode_storages(device)
    with pytest.raises(ProtocolError) as info:
        decode_tensors(device, decoded, LAYOUT)
    return info.value


def test_tensor_count_must_match_layout() -> None:
    err = _tensors_error([storage(1)], [[0, 0]])
    assert err.code == ErrorCode.BAD_FIELD and f"{LAYOUT.num_tensors}" in str(err)


@pytest.mark.parametrize("entry", [[1, 0], [0, -1], [0], "x", [0, 0, 0], [True, 0]])
def test_bad_tensor_entries(entry: Any) -> None:
    step = LAYOUT.tensor_bytes
    tensors: list[Any] = [[0, t * step] for t in range(LAYOUT.num_tensors)]
    tensors[2] = entry
    assert _tensors_error([storage(1, size=16 * step)], tensors).code == ErrorCode.BAD_FIELD


def test_tensor_beyond_its_storage_is_a_layout_mismatch() -> None:
    step = LAYOUT.tensor_bytes
    tensors = [[0, t * step] for t in range(LAYOUT.num_tensors)]
    err = _tensors_error([storage(1, size=LAYOUT.num_tensors * step - 1)], tensors)
    assert err.code == ErrorCode.LAYOUT_MISMATCH


def test_overlapping_tensors_are_refused_within_and_across_storages() -> None:
    step = LAYOUT.tensor_bytes
    within = [[0, t * step] for t in range(LAYOUT.num_tensors)]
    within[3] = [0, 2 * step + 1]
    assert "overlap" in str(_tensors_error([storage(1, size=16 * step)], within))
    # Two storages of one allocation (same handle) whose tensors share bytes.
    shared = bytes([9]) * 64
    a, b = storage(1, size=8 * step, handle=shared, offset=0), storage(2, size=8 * step, handle=shared, offset=step)
    across = [[0, 0], [0, 2 * step], [1, 2 * step], [1, 4 * step]]  # [1, 2*step] sits at 3*step: no clash
    decode_tensors(device_map([a, b], across), [a, b], LAYOUT)
    across[2] = [1, step]  # now at allocation offset 2*step, where tensor 1 is
    assert "overlap" in str(_tensors_error([a, b], across))


def test_same_offsets_in_different_allocations_do_not_overlap() -> None:
    step = LAYOUT.tensor_bytes
    storages = [storage(n, size=step) for n in range(LAYOUT.num_tensors)]
    refs = decode_tensors(device_map(storages, [[n, 0] for n in range(4)]), storages, LAYOUT)
    assert [r.storage for r in refs] == [0, 1, 2, 3]


# Import bookkeeping -----------------------------------------------------------------------


def test_each_storage_opened_once_and_every_counter_consumed_once() -> None:
    step = LAYOUT.tensor_bytes
    first, again = storage(1, size=4 * step), storage(2, size=4 * step, handle=bytes([1]) * 64)  # same key
    device = device_map([first, again], [[0, 0], [1, step], [0, 2 * step], [1, 3 * step]])
    ops = FakeOps()
    storages, refs, opened = import_handles(device, LAYOUT, UUID, 3, ops)
    assert [(i, s.counter) for i, s in ops.opened] == [(3, first.counter)]
    assert ops.released == [again.counter]  # the duplicate's counter is released at once
    assert opened[0] is opened[1]
    assert len(refs) == 4 and storages == [first, again]


def test_refused_attach_releases_every_counter() -> None:
    storages = [storage(n, size=LAYOUT.tensor_bytes) for n in range(4)]
    wrong_device = device_map(storages, [[n, 0] for n in range(4)], uuid=OTHER_UUID)
    ops = FakeOps()
    with pytest.raises(AttachError, match="this daemon serves"):
        import_handles(wrong_device, LAYOUT, UUID, 0, ops)
    assert sorted(ops.released) == sorted(s.counter for s in storages) and not ops.opened
    bad_tensors = device_map(storages, [[n, 1] for n in range(4)])  # each runs 1 byte past its storage
    ops = FakeOps()
    with pytest.raises(AttachError):
        import_handles(bad_tensors, LAYOUT, UUID, 0, ops)
    assert sorted(ops.released) == sorted(s.counter for s in storages)


def test_failed_open_releases_only_unopened_counters() -> None:
    storages = [storage(n, size=LAYOUT.tensor_bytes) for n in range(4)]
    ops = FakeOps(fail_on=2)
    with pytest.raises(RuntimeError):
        import_handles(device_map(storages, [[n, 0] for n in range(4)]), LAYOUT, UUID, 0, ops)
    opened = {s.counter for _, s in ops.opened}
    assert opened == {storages[0].counter, storages[1].counter}
    # Opened storages release their own counters when they die; the rest are released now.
    assert sorted(ops.released) == sorted([storages[2].counter, storages[3].counter])


def test_malformed_handles_release_nothing() -> None:
    ops = FakeOps()
    with pytest.raises(AttachError):
        import_handles(_mutate_storage("size", -5), LAYOUT, UUID, 0, ops)
    assert ops.released == [] and ops.opened == []


def test_import_watch_counts_distinct_live_handles() -> None:
    class Ref:
        def __init__(self) -> None:
            self.dead = False

        def expired(self) -> bool:
            return self.dead

    a, b = storage(1, handle=b"A" * 64), storage(2, handle=b"A" * 64, offset=4096)
    c = storage(3, handle=b"C" * 64)
    refs: dict[int, Ref] = {}

    def weak(obj: Any) -> Ref:
        return refs.setdefault(id(obj), Ref())

    opened = [object(), object(), object()]
    watch = ImportWatch([a, b, c], opened, weak)
    assert watch.open_handles() == 2  # a and b share one allocation: one cudaIpcOpenMemHandle
    refs[id(opened[0])].dead = True
    assert watch.open_handles() == 2
    refs[id(opened[1])].dead = True
    refs[id(opened[2])].dead = True
    assert watch.open_handles() == 0


# Device identity and runner-side checks ---------------------------------------------------


def test_resolve_device_by_rank_index_and_uuid() -> None:
    uuids = [OTHER_UUID, UUID]
    assert resolve_device("", 1, uuids) == 1
    assert resolve_device("0", 1, uuids) == 0
    assert resolve_device("0123abcd-4567-89ab-cdef-0123456789ab", 0, uuids) == 1
    assert resolve_device(UUID.lower(), 0, uuids) == 1


@pytest.mark.parametrize(("spec", "rank", "message"), [("", 2, "daemon.rank 2"), ("5", 0, "cuda.device 5"),
                                                       ("GPU-00000000-0000-0000-0000-000000000000", 0, "not among"),
                                                       ("junk", 0, "GPU-")])  # fmt: skip
def test_resolve_device_errors_name_the_setting(spec: str, rank: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_device(spec, rank, [UUID, OTHER_UUID])
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device(spec, rank, [])


def test_runner_tensors_are_checked_before_export() -> None:
    shape = (LAYOUT.num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    cpu = [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYOUT.num_tensors)]
    with pytest.raises(ValueError, match="CUDA device"):
        check_runner_tensors(LAYOUT, cpu)
    with pytest.raises(ValueError, match="needs 4 tensors"):
        check_runner_tensors(LAYOUT, cpu[:3])


def test_the_wire_format_lives_with_the_protocol() -> None:
    """The runner side and the handle format import neither torch, the daemon nor a backend."""
    import subprocess
    import sys

    code = (
        "import sys, cachexferd.protocol.cuda_ipc, cachexferd.client.cuda_runner; "
        "heavy = [m for m in sys.modules if m in ('torch', 'cachexferd.daemon') "
        "or m.startswith('cachexferd.backends')]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
