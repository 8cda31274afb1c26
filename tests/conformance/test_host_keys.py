"""Protocol 1.3 on the wire: host blocks carry identity keys, HOST_KEYS lists them, and a
read that names keys gets only the KV they name (docs/protocol.md §7.16)."""

from __future__ import annotations

import pytest

from .conftest import Attached, CacheFactory, ClientFactory
from .daemons import DaemonProc
from .spec import E, T
from .wire import Outcome, header, pack

pytestmark = pytest.mark.conformance


def listed(client: object, page: int = 16_384) -> dict[int, str]:
    """Every keyed host block, read page by page as §7.16 says."""
    found: dict[int, str] = {}
    start: int | None = 0
    while start is not None:
        reply = client.call(T.HOST_KEYS, start=start, count=page)  # type: ignore[attr-defined]
        assert reply.ok, reply
        result = reply.result
        assert len(result["host_ids"]) == len(result["keys"]) and result["host_ids"] == sorted(result["host_ids"])
        assert all(start <= h < start + page for h in result["host_ids"])
        found.update(zip(result["host_ids"], result["keys"]))
        start = result["next"]
    return found


def batch_call(client: object, commands: list[tuple[int, dict[str, object]]]) -> list[Outcome]:
    """One BATCH envelope (§14) of ``commands``; their outcomes, in order."""
    req_ids = [9_000_000 + i for i in range(len(commands))]
    items = [[int(op), {"req_id": r, **fields}] for r, (op, fields) in zip(req_ids, commands)]
    client.send_frames([header(T.BATCH), pack({"items": items})])  # type: ignore[attr-defined]
    return [client.wait(r) for r in req_ids]  # type: ignore[attr-defined]


def test_written_keys_are_listed_and_another_client_reads_by_them(attached: Attached, connect: ClientFactory) -> None:
    client, cache = attached.client, attached.cache
    keys = ["ck:a:f:0100", "ck:a:f:0101"]
    assert client.call(T.SWAP_OUT, device_ids=[1, 2], host_ids=[100, 101], owner="engine-a", keys=keys).ok
    assert {h: k for h, k in listed(client).items() if h in (100, 101)} == {100: keys[0], 101: keys[1]}

    # Another client (a restarted engine, say) that did not write them reads them by key.
    other = connect(attached.daemon)
    want, untouched = cache.block(1), cache.block(9)
    assert listed(other)[101] == keys[1]
    assert other.call(T.SWAP_IN, device_ids=[7, 8], host_ids=[100, 101], keys=keys).ok
    assert cache.block(7) == want and cache.block(8) == cache.block(2) and cache.block(9) == untouched

    # A key the block does not carry: refused, nothing copied; so is a wrong owner beside a right key.
    wrong = other.call(T.SWAP_IN, device_ids=[9], host_ids=[100], keys=["ck:a:f:0999"])
    assert wrong.code == E.HOST_BLOCK_CHANGED and "ck:a:f:0999" in wrong.body["detail"]
    both = other.call(T.SWAP_IN, device_ids=[9], host_ids=[100], keys=keys[:1], owner="engine-b")
    assert both.code == E.HOST_BLOCK_CHANGED
    assert cache.block(9) == untouched, "a refused read must not copy"


def test_a_rewrite_takes_the_key_away(attached: Attached, connect: ClientFactory) -> None:
    client, cache = attached.client, attached.cache
    other = connect(attached.daemon)
    assert client.call(T.SWAP_OUT, device_ids=[3, 4], host_ids=[110, 111], keys=["ck:b:110", "ck:b:111"]).ok
    # Rewritten by another writer naming no keys (a 1.2 client), and with another key.
    assert other.call(T.SWAP_OUT, device_ids=[5], host_ids=[110]).ok
    assert other.call(T.SWAP_OUT, device_ids=[6], host_ids=[111], keys=["ck:b:other"]).ok
    now = listed(client)
    assert 110 not in now and now[111] == "ck:b:other"
    untouched = cache.block(12)
    for host, key in ((110, "ck:b:110"), (111, "ck:b:111")):
        refused = client.call(T.SWAP_IN, device_ids=[12], host_ids=[host], keys=[key])
        assert refused.code == E.HOST_BLOCK_CHANGED
    assert cache.block(12) == untouched
    assert client.call(T.SWAP_IN, device_ids=[12], host_ids=[111], keys=["ck:b:other"]).ok
    assert cache.block(12) == cache.block(6)


def test_batched_swaps_stamp_and_check_keys_alike(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    outs = [(T.SWAP_OUT, {"device_ids": [10 + i], "host_ids": [120 + i], "keys": [f"ck:c:{i}"]}) for i in range(3)]
    for outcome in batch_call(client, outs):
        assert outcome.ok, outcome
    assert all(listed(client)[120 + i] == f"ck:c:{i}" for i in range(3))
    untouched = cache.block(20)
    ins = [(T.SWAP_IN, {"device_ids": [20], "host_ids": [120], "keys": ["ck:c:1"]}),
           (T.SWAP_IN, {"device_ids": [21], "host_ids": [121], "keys": ["ck:c:1"]})]  # fmt: skip
    refused, served = batch_call(client, ins)
    assert refused.code == E.HOST_BLOCK_CHANGED and cache.block(20) == untouched
    assert served.ok and cache.block(21) == cache.block(11)


def test_storage_commands_stamp_the_blocks_they_write(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    assert client.call(T.STORE, keys=["ck:d:130"], host_ids=[130], device_ids=[13]).result["stored"] == 1
    assert listed(client)[130] == "ck:d:130"
    assert client.call(T.SWAP_OUT, device_ids=[14], host_ids=[131], keys=["ck:d:131"]).ok
    # A LOAD delivering its prefix stamps it; the block it could not fill loses its key.
    loaded = client.call(T.LOAD, keys=["ck:d:130", "ck:d:missing"], host_ids=[132, 131])
    assert loaded.ok and loaded.result["loaded"] == 1, loaded
    now = listed(client)
    assert now[132] == "ck:d:130" and 131 not in now
    assert client.call(T.SWAP_IN, device_ids=[15], host_ids=[132], keys=["ck:d:130"]).ok
    assert cache.block(15) == cache.block(13)


def test_clear_host_and_new_weights_take_every_key_away(
    fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    client, cache = connect(fresh_daemon), shm(seed=5)
    assert client.call(T.HOST_KEYS).result == {
        "host_ids": [], "keys": [], "next": None, "host_blocks": 0, "host_generation": 0, "weights_version": 0,
    }  # fmt: skip
    assert client.call(T.ATTACH, **cache.attach_fields()).ok
    write = {"device_ids": [1, 2], "host_ids": [1, 2], "keys": ["ck:e:1", "ck:e:2"]}
    assert client.call(T.SWAP_OUT, **write).ok and listed(client) == {1: "ck:e:1", 2: "ck:e:2"}
    assert client.call(T.CLEAR_HOST).ok and listed(client) == {}
    assert client.call(T.SWAP_OUT, **write).ok and len(listed(client)) == 2
    assert client.call(T.SET_WEIGHTS, version=0).ok and len(listed(client)) == 2, "the same version keeps them"
    assert client.call(T.SET_WEIGHTS, version=1).ok and listed(client) == {}
    refused = client.call(T.SWAP_IN, device_ids=[3], host_ids=[1], keys=["ck:e:1"])
    assert refused.code in (E.HOST_BLOCK_CHANGED, E.STALE_WEIGHTS)
    page = client.call(T.HOST_KEYS, start=0, count=4).result
    assert page["weights_version"] == 1 and page["host_generation"] == 1 and page["next"] == 4


@pytest.mark.parametrize(
    ("op", "fields", "code"),
    [
        (T.SWAP_OUT, {"device_ids": [1, 2], "host_ids": [1, 2], "keys": ["one"]}, E.LENGTH_MISMATCH),
        (T.SWAP_IN, {"device_ids": [1], "host_ids": [1], "keys": ["a", "b"]}, E.LENGTH_MISMATCH),
        (T.SWAP_OUT, {"device_ids": [1], "host_ids": [1], "keys": [b"bytes"]}, E.BAD_FIELD),
        (T.SWAP_OUT, {"device_ids": [1], "host_ids": [1], "keys": ["a space"]}, E.BAD_FIELD),
        (T.SWAP_OUT, {"device_ids": [1], "host_ids": [1], "keys": ["k" * 257]}, E.BAD_FIELD),
        (T.SWAP_IN, {"device_ids": [1], "host_ids": [1], "keys": "ck"}, E.BAD_FIELD),
        (T.SWAP_OUT, {"device_ids": [1], "host_ids": [1], "keys": ["k"] * 65_537}, E.TOO_LARGE),
        (T.HOST_KEYS, {"count": 0}, E.BAD_FIELD),
        (T.HOST_KEYS, {"count": 16_385}, E.BAD_FIELD),
        (T.HOST_KEYS, {"start": -1}, E.BAD_FIELD),
    ],
)
def test_bad_keys_get_an_error_outcome(attached: Attached, op: int, fields: dict[str, object], code: int) -> None:
    client, cache = attached.client, attached.cache
    before = cache.block(1)
    assert client.call(op, **fields).code == code
    assert cache.block(1) == before
    assert client.call(T.PING).ok
