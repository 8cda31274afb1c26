"""Storage commands (docs/protocol.md §12, docs/storage.md §1 to §4) against the file backend,
with keys taken from the published test vectors (docs/vectors.json)."""

from __future__ import annotations

import hashlib
import itertools
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import Attached, CacheFactory, ClientFactory
from .daemons import DaemonProc
from .helpers import chain, fingerprint, object_file, object_name
from .shm import LAYOUT
from .spec import MAX_KEYS, E, T
from .wire import Client

pytestmark = pytest.mark.conformance

HOST_BLOCKS = (16 << 20) // 1024


@pytest.fixture
def store(scratch: Path) -> Path:
    return scratch / "main-store"


def sum64(payload: bytes) -> int:
    """docs/storage.md §3, from the prose."""
    data = payload + bytes(-len(payload) % 8)
    words: tuple[int, ...] = struct.unpack(f"<{len(data) // 8}Q", data)
    mask = (1 << 64) - 1
    pages = [sum(words[i : i + 512]) & mask for i in range(0, len(words), 512)]
    a = sum(pages) & mask
    b = sum((p + 1) * s for p, s in enumerate(pages)) & mask
    return a ^ (((b << 32) | (b >> 32)) & mask)


def header_fields(data: bytes) -> dict[str, Any]:
    magic, version, length, kind, reserved, payload_len, layout, name, checksum, crc = struct.unpack(
        "<4sHHHHQ8s8sQI", data[:48]
    )
    return dict(
        magic=magic,
        version=version,
        length=length,
        kind=kind,
        reserved=reserved,
        payload_len=payload_len,
        layout=layout,
        name=name,
        checksum=checksum,
        crc=crc,
        tail=data[48:64],
    )


def reseal(data: bytearray) -> None:
    """Recomputes the header crc after a test edited header bytes."""
    data[44:48] = struct.pack("<I", zlib.crc32(bytes(data[:44])))


def test_round_trip_with_published_keys(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    vector = chain("tp2")
    rank0, rank1 = vector["keys"]["0"], vector["keys"]["1"]
    assert len(rank0) == 3 and ":p2:" in rank0[-1]  # two full blocks and a partial one
    wipe(client, rank0 + rank1)
    want = [cache.block(b) for b in (20, 21, 22)]
    stored = client.call(T.STORE, keys=rank0, host_ids=[1100, 1101, 1102], device_ids=[20, 21, 22])
    assert stored.ok and stored.body["op"] == T.STORE, stored
    assert {k: stored.result[k] for k in ("stored", "failed", "bytes")} == {"stored": 3, "failed": 0, "bytes": 3072}
    assert stored.result["started_at"] <= stored.result["finished_at"]
    assert client.call(T.LOOKUP, keys=rank0).result["prefix"] == 3
    assert client.call(T.LOOKUP, keys=rank1).result["prefix"] == 0  # the rank is in the key
    loaded = client.call(T.LOAD, keys=rank0, host_ids=[1200, 1201, 1202], device_ids=[30, 31, 32])
    assert loaded.ok and loaded.result["loaded"] == 3 and loaded.result["bytes"] == 3072, loaded
    assert [cache.block(b) for b in (30, 31, 32)] == want
    assert client.call(T.SWAP_IN, device_ids=[33], host_ids=[1100]).ok  # staged host block
    assert cache.block(33) == want[0]
    deleted = client.call(T.DELETE, keys=rank0)
    assert deleted.ok and deleted.result["deleted"] == 3, deleted
    assert client.call(T.LOOKUP, keys=rank0).result["prefix"] == 0
    before = cache.block(40)
    again = client.call(T.LOAD, keys=rank0, host_ids=[1200, 1201, 1202], device_ids=[40, 41, 42])
    assert again.ok and again.result["loaded"] == 0 and again.result["bytes"] == 0, again
    assert cache.block(40) == before


def wipe(client: Client, keys: list[str]) -> None:
    assert client.call(T.DELETE, keys=keys).ok


def test_object_format_on_disk(attached: Attached, store: Path) -> None:
    """docs/storage.md §3 and §4.1: the object file of a key, byte for byte."""
    client, cache = attached.client, attached.cache
    key = chain("full-blocks")["keys"]["0"][0]
    assert client.call(T.STORE, keys=[key], host_ids=[7], device_ids=[9]).ok
    data = object_file(store, key).read_bytes()
    payload = data[64:]
    assert len(data) == 64 + cache.block_bytes and payload == cache.block(9)
    h = header_fields(data)
    assert (h["magic"], h["version"], h["length"], h["reserved"]) == (b"CXKV", 1, 64, 0)
    assert h["payload_len"] == cache.block_bytes
    assert h["layout"] == bytes.fromhex(fingerprint(LAYOUT))
    assert h["name"] == hashlib.blake2b(object_name(key).encode(), digest_size=8).digest()
    assert h["kind"] in (1, 2)
    assert h["checksum"] == (sum64(payload) if h["kind"] == 2 else zlib.crc32(payload))
    assert h["crc"] == zlib.crc32(data[:44])
    assert h["tail"] == bytes(16)
    assert client.call(T.DELETE, keys=[key]).result["deleted"] == 1


@pytest.mark.parametrize("damage", ["payload-bit", "truncated", "longer", "other-name", "other-layout", "magic"])
def test_bad_objects_end_the_prefix(attached: Attached, store: Path, damage: str) -> None:
    client, cache = attached.client, attached.cache
    keys = [f"damage-{damage}-{i}" for i in range(3)]
    assert client.call(T.STORE, keys=keys, host_ids=[10, 11, 12], device_ids=[10, 11, 12]).result["stored"] == 3
    path = object_file(store, keys[1])
    data = bytearray(path.read_bytes())
    if damage == "payload-bit":
        data[64 + 100] ^= 0x01
    elif damage == "truncated":
        del data[-1]
    elif damage == "longer":
        data += b"\0"
    elif damage == "other-name":
        data = bytearray(object_file(store, keys[0]).read_bytes())
    elif damage == "other-layout":
        data[20:28] = bytes.fromhex(fingerprint({**LAYOUT, "dtype": "float16"}))
        reseal(data)
    else:
        data[0:4] = b"XXXX"
    path.write_bytes(bytes(data))
    before = [cache.block(b) for b in (50, 51, 52)]
    loaded = client.call(T.LOAD, keys=keys, host_ids=[20, 21, 22], device_ids=[50, 51, 52])
    assert loaded.ok and loaded.result["loaded"] == 1, loaded
    assert cache.block(50) == cache.block(10)
    assert [cache.block(51), cache.block(52)] == before[1:], "blocks past the prefix are unchanged"
    assert client.call(T.LOOKUP, keys=keys).result["prefix"] == 3, "LOOKUP reports presence only"
    assert client.call(T.DELETE, keys=keys).result["deleted"] == 3


def test_load_stops_at_the_first_missing_key(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    keys = ["gap-a", "gap-b", "gap-c"]
    wipe(client, keys)
    assert client.call(T.STORE, keys=["gap-a", "gap-c"], host_ids=[1, 2], device_ids=[1, 2]).ok
    before = cache.block(61)
    loaded = client.call(T.LOAD, keys=keys, host_ids=[5, 6, 7], device_ids=[60, 61, 62])
    assert loaded.ok and loaded.result["loaded"] == 1 and loaded.result["bytes"] == cache.block_bytes
    assert cache.block(60) == cache.block(1) and cache.block(61) == before
    assert client.call(T.LOOKUP, keys=keys).result["prefix"] == 1
    assert client.call(T.DELETE, keys=keys).result["deleted"] == 2


def test_store_host_blocks_only(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    assert client.call(T.SWAP_OUT, device_ids=[3], host_ids=[300]).ok
    stored = client.call(T.STORE, keys=["host-only-a", "host-only-b"], host_ids=[300, 300])
    assert stored.ok and stored.result["stored"] == 2, "host_ids may repeat without device_ids"
    again = client.call(T.STORE, keys=["host-only-a"], host_ids=[300])
    assert again.ok and again.result["stored"] == 1, "storing an existing key is not an error"
    assert client.call(T.LOAD, keys=["host-only-b"], host_ids=[301]).result["loaded"] == 1
    assert client.call(T.SWAP_IN, device_ids=[4], host_ids=[301]).ok
    assert cache.block(4) == cache.block(3)
    assert client.call(T.DELETE, keys=["host-only-a", "host-only-b", "never-stored"]).result["deleted"] == 2


def test_empty_lists_succeed(attached: Attached) -> None:
    client = attached.client
    assert client.call(T.STORE, keys=[], host_ids=[]).result["stored"] == 0
    assert client.call(T.STORE, keys=[], host_ids=[], device_ids=[]).result["bytes"] == 0
    assert client.call(T.LOAD, keys=[], host_ids=[]).result["loaded"] == 0
    assert client.call(T.LOOKUP, keys=[]).result["prefix"] == 0
    assert client.call(T.DELETE, keys=[]).result["deleted"] == 0


def test_results_carry_daemon_clock_timestamps(attached: Attached) -> None:
    client = attached.client
    outcomes = [
        client.call(T.STORE, keys=["ts"], host_ids=[0]),
        client.call(T.LOAD, keys=["ts"], host_ids=[1]),
        client.call(T.LOOKUP, keys=["ts"]),
        client.call(T.DELETE, keys=["ts"]),
    ]
    for outcome in outcomes:
        assert outcome.ok, outcome
        started, finished = outcome.result["started_at"], outcome.result["finished_at"]
        assert isinstance(started, float) and isinstance(finished, float) and started <= finished
    assert all(a.result["finished_at"] <= b.result["started_at"] for a, b in itertools.pairwise(outcomes))


# docs/storage.md §1.6: the order in which a storage command's errors are found -------------


@dataclass(frozen=True)
class OrderCase:
    name: str
    daemon: str  # conftest fixture
    attached: bool
    msg_type: T
    fields: dict[str, Any]
    expect: E
    hello: bool = True


ORDER_CASES = [
    # 1 and 2: decoding the body and its fields comes first, field by field.
    OrderCase(
        "bad-key-before-no-storage", "nostorage", False, T.STORE, {"keys": ["a b"], "host_ids": [0, 1]}, E.BAD_FIELD
    ),
    OrderCase(
        "bad-key-before-length", "main", True, T.STORE, {"keys": ["ok", "a\tb"], "host_ids": [HOST_BLOCKS]}, E.BAD_FIELD
    ),
    OrderCase("missing-keys", "main", False, T.STORE, {"host_ids": [0]}, E.BAD_FIELD),
    OrderCase(
        "keys-before-host-ids", "main", True, T.LOAD, {"keys": ["k"] * (MAX_KEYS + 1), "host_ids": "x"}, E.TOO_LARGE
    ),
    OrderCase(
        "host-ids-before-device-ids",
        "main",
        True,
        T.LOAD,
        {"keys": ["k"], "host_ids": "x", "device_ids": [0] * 65537},
        E.BAD_FIELD,
    ),
    OrderCase(
        "id-range-is-a-field-check",
        "main",
        True,
        T.STORE,
        {"keys": ["k", "k"], "host_ids": [0, 1], "device_ids": [2**31, 0]},
        E.BAD_FIELD,
    ),
    OrderCase(  # (1.2) parent: after device_ids, one key checked like those of `keys`
        "device-ids-before-parent",
        "main",
        True,
        T.STORE,
        {"keys": ["k"], "host_ids": [0], "device_ids": "x", "parent": ["not a key"]},
        E.BAD_FIELD,
    ),
    *(
        OrderCase(f"parent-{name}", "main", True, T.STORE, {"keys": ["k"], "host_ids": [0], "parent": bad}, E.BAD_FIELD)
        for name, bad in (("with-a-space", "a b"), ("not-a-str", 7), ("too-long", "p" * 257), ("empty", ""))
    ),
    # 3: admission.
    OrderCase(
        "stale-boot-before-no-storage", "nostorage", False, T.LOOKUP, {"keys": ["k"], "boot_id": "0" * 32}, E.STALE_BOOT
    ),
    OrderCase(
        "no-event-channel-before-no-storage",
        "nostorage",
        False,
        T.LOOKUP,
        {"keys": ["k"]},
        E.NO_EVENT_CHANNEL,
        hello=False,
    ),
    # 4 and 5: the command's own checks.
    OrderCase(
        "no-storage-before-not-attached", "nostorage", False, T.STORE, {"keys": ["k"], "host_ids": [0, 1]}, E.NO_STORAGE
    ),
    OrderCase(
        "unknown-host-layout-before-length",
        "pristine",
        False,
        T.STORE,
        {"keys": ["k"], "host_ids": [0, 1]},
        E.NOT_ATTACHED,
    ),
    OrderCase(
        "host-only-store-needs-no-device",
        "main",
        False,
        T.STORE,
        {"keys": ["k"], "host_ids": [0, 1]},
        E.LENGTH_MISMATCH,
    ),
    OrderCase(
        "host-length-before-device-cache",
        "main",
        False,
        T.LOAD,
        {"keys": ["k"], "host_ids": [0, 1], "device_ids": [0]},
        E.LENGTH_MISMATCH,
    ),
    OrderCase(
        "host-range-before-device-cache",
        "main",
        False,
        T.LOAD,
        {"keys": ["k"], "host_ids": [HOST_BLOCKS], "device_ids": [0]},
        E.ID_OUT_OF_RANGE,
    ),
    OrderCase(
        "device-cache-before-duplicates",
        "main",
        False,
        T.LOAD,
        {"keys": ["k", "k"], "host_ids": [0, 0], "device_ids": [0, 1]},
        E.NOT_ATTACHED,
    ),
    OrderCase(
        "device-length",
        "main",
        True,
        T.STORE,
        {"keys": ["k"], "host_ids": [0], "device_ids": [0, 1]},
        E.LENGTH_MISMATCH,
    ),
    OrderCase(
        "host-range-before-device-length",
        "main",
        True,
        T.STORE,
        {"keys": ["k", "j"], "host_ids": [0, HOST_BLOCKS], "device_ids": [0]},
        E.ID_OUT_OF_RANGE,
    ),
    OrderCase(
        "device-range-before-duplicates",
        "main",
        True,
        T.STORE,
        {"keys": ["k", "k"], "host_ids": [0, 1], "device_ids": [0, 64]},
        E.ID_OUT_OF_RANGE,
    ),
    OrderCase(
        "load-duplicate-devices",
        "main",
        True,
        T.LOAD,
        {"keys": ["k", "j"], "host_ids": [0, 1], "device_ids": [1, 1]},
        E.DUPLICATE_ID,
    ),
    OrderCase("load-duplicate-hosts", "main", True, T.LOAD, {"keys": ["k", "j"], "host_ids": [0, 0]}, E.DUPLICATE_ID),
    OrderCase(
        "store-staging-duplicate-hosts",
        "main",
        True,
        T.STORE,
        {"keys": ["k", "j"], "host_ids": [2, 2], "device_ids": [1, 2]},
        E.DUPLICATE_ID,
    ),
    OrderCase("store-duplicate-keys", "main", True, T.STORE, {"keys": ["k", "k"], "host_ids": [2, 3]}, E.DUPLICATE_ID),
    # What is allowed.
    OrderCase(
        "store-may-repeat-host-ids", "main", True, T.STORE, {"keys": ["order-k", "order-j"], "host_ids": [3, 3]}, E.OK
    ),
    OrderCase(
        "store-may-repeat-device-ids",
        "main",
        True,
        T.STORE,
        {"keys": ["order-k", "order-j"], "host_ids": [3, 4], "device_ids": [5, 5]},
        E.OK,
    ),
    OrderCase("load-may-repeat-keys", "main", True, T.LOAD, {"keys": ["order-k", "order-k"], "host_ids": [3, 4]}, E.OK),
    OrderCase(  # (1.2) an extension of a chain names the key before its first; nil: none
        "store-with-parent", "main", True, T.STORE, {"keys": ["order-j"], "host_ids": [3], "parent": "order-k"}, E.OK
    ),
    OrderCase("store-parent-nil", "main", True, T.STORE, {"keys": ["order-j"], "host_ids": [3], "parent": None}, E.OK),
]


@pytest.mark.parametrize("case", ORDER_CASES, ids=[c.name for c in ORDER_CASES])
def test_validation_order(
    case: OrderCase, request: pytest.FixtureRequest, connect: ClientFactory, shm: CacheFactory
) -> None:
    daemon: DaemonProc = request.getfixturevalue(case.daemon)
    if case.daemon == "main":  # the host cache's layout is known once `main` has had an attach
        binder = connect(daemon)
        assert binder.call(T.ATTACH, **shm().attach_fields()).ok
        if not case.attached:
            assert binder.call(T.DETACH).ok
    client = connect(daemon, hello=case.hello)
    outcome = client.call(case.msg_type, **case.fields)
    assert outcome.code == case.expect, outcome
