"""Rules that span commands: arrival order is the order of effect, DUPLICATE_REQ_ID,
which commands check boot_id, shared-memory tensors that overlap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import Attached, CacheFactory, ClientFactory
from .daemons import DaemonProc
from .helpers import burst, ensure_detached, held_in_flight
from .shm import LAYOUT
from .spec import E, T
from .wire import Client, Outcome

pytestmark = pytest.mark.conformance

STALE = "0123456789abcdef" * 2


def other_boot(client: Client) -> str:
    return STALE if client.boot_id != STALE else "f" * 32


# Arrival order is the order of effect ------------------------------------------------------


def test_commands_pipelined_behind_detach_get_not_attached(attached: Attached) -> None:
    client = attached.client
    ids = burst(
        client,
        [
            (T.DETACH, {}),
            (T.SWAP_OUT, {"device_ids": [1], "host_ids": [1]}),
            (T.SWAP_IN, {"device_ids": [1], "host_ids": [1]}),
            (T.STORE, {"keys": ["behind-detach"], "host_ids": [1], "device_ids": [1]}),
            (T.LOAD, {"keys": ["behind-detach"], "host_ids": [2], "device_ids": [2]}),
            (T.LOOKUP, {"keys": ["behind-detach"]}),  # touches no device block: served
        ],
    )
    detach, *device_commands, lookup = client.wait_all(ids)
    assert detach.ok and detach.result["state"] == "detached", detach
    assert [o.code for o in device_commands] == [E.NOT_ATTACHED] * 4, device_commands
    assert lookup.ok, lookup


def test_swap_pipelined_behind_attach_runs(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    client = connect(main)
    cache = shm(seed=7)
    want = cache.block(3)
    ids = burst(
        client,
        [
            (T.ATTACH, cache.attach_fields()),
            (T.SWAP_OUT, {"device_ids": [3], "host_ids": [800]}),
            (T.SWAP_IN, {"device_ids": [9], "host_ids": [800]}),
            (T.DETACH, {}),
        ],
    )
    try:
        attach, out, into, detach = client.wait_all(ids)
        assert attach.ok, attach
        assert out.ok and into.ok, (out, into)
        assert detach.ok and detach.result["cancelled"] == 0, detach
        assert cache.block(9) == want
    finally:
        ensure_detached(client)


def test_commands_pipelined_behind_shutdown(fresh_daemon: DaemonProc, connect: ClientFactory) -> None:
    client = connect(fresh_daemon)
    stale = client.call(T.SHUTDOWN, boot_id=other_boot(client))
    assert stale.code == E.STALE_BOOT, stale
    assert client.call(T.PING).ok, "a refused SHUTDOWN leaves the daemon running"
    ids = burst(
        client,
        [
            (T.SHUTDOWN, {}),
            (T.CLEAR_HOST, {}),
            (T.SWAP_OUT, {"device_ids": [0], "host_ids": [0]}),
            (T.LOOKUP, {"keys": ["k"]}),
            (T.ATTACH, {"layout": LAYOUT, "device": {"kind": "shm", "name": "nothing", "offsets": [0, 1, 2, 3]}}),
            (T.DETACH, {}),
            (T.PING, {}),
            (T.STATUS, {}),
            (T.HELLO, {"protocol": [1, 0], "events": client.events_endpoint}),
        ],
    )
    shutdown, *refused, ping, status, hello = client.wait_all(ids)
    assert shutdown.ok and shutdown.result == {"state": "draining"}, shutdown
    assert [o.code for o in refused] == [E.SHUTTING_DOWN] * len(refused), refused
    assert ping.ok and hello.ok
    assert status.ok and status.result["state"] == "draining", status
    assert fresh_daemon.wait_exit(20) == 0
    assert not fresh_daemon.socket_path.exists(), "the ipc socket file is removed at exit"


# DUPLICATE_REQ_ID ---------------------------------------------------------------------------

DUPLICATES: dict[str, dict[str, Any]] = {
    "HELLO": {"protocol": [1, 0]},
    "PING": {},
    "STATUS": {},
    "ATTACH": {"layout": LAYOUT, "device": {"kind": "shm", "name": "nothing", "offsets": [0, 1, 2, 3]}},
    "DETACH": {},
    "SWAP_OUT": {"device_ids": [1], "host_ids": [1]},
    "SWAP_IN": {"device_ids": [1], "host_ids": [1]},
    "CLEAR_HOST": {},
    "STORE": {"keys": ["dup"], "host_ids": [1]},
    "LOAD": {"keys": ["dup"], "host_ids": [1]},
    "LOOKUP": {"keys": ["dup"]},
    "DELETE": {"keys": ["dup"]},
}  # SHUTDOWN is left out: a daemon that wrongly ran it would stop the shared test daemon


def split_duplicate(first: Outcome, second: Outcome) -> tuple[Outcome, Outcome]:
    refused = [o for o in (first, second) if o.code == E.DUPLICATE_REQ_ID]
    kept = [o for o in (first, second) if o.code != E.DUPLICATE_REQ_ID]
    assert len(refused) == 1 and len(kept) == 1, f"expected one refusal and one real outcome: {first}, {second}"
    return refused[0], kept[0]


@pytest.mark.parametrize("name", list(DUPLICATES))
def test_duplicate_req_id_of_an_in_flight_command(attached: Attached, scratch: Path, name: str) -> None:
    client = attached.client
    with held_in_flight(client, scratch / "main-store", 5000):
        client.command(T[name], req_id=5000, **DUPLICATES[name])
        refused = client.next_outcome()  # the held LOAD cannot finish before the read is released
    assert (refused.code, refused.req_id) == (E.DUPLICATE_REQ_ID, 5000), refused
    assert refused.channel == "reply" and refused.body["op"] == T[name], refused
    held = client.wait(5000)
    assert held.channel == "event" and held.body["op"] == T.LOAD, held
    assert held.code in (E.OK, E.STORAGE_TIMEOUT), held  # its own outcome, whatever the read gave
    client.assert_no_outcome(5000, 0.2)
    assert client.call(T.STATUS).result["device"]["state"] == "attached", "the refused command had no effect"


def test_duplicate_req_id_of_an_in_flight_attach(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    """A PING pipelined behind an ATTACH with the same req_id is refused while the ATTACH is in
    flight. An ATTACH may also finish before the PING is read (then both are answered, the
    ATTACH first), so the burst is repeated until a refusal is seen."""
    client = connect(main)
    refusals = 0
    for attempt in range(20):
        cache = shm(seed=8 + attempt)
        burst(client, [(T.ATTACH, {"req_id": 77, **cache.attach_fields()}), (T.PING, {"req_id": 77})])
        try:
            first, second = client.wait(77), client.wait(77)
            assert first.body["op"] == T.ATTACH or first.code == E.DUPLICATE_REQ_ID, (first, second)
            if E.DUPLICATE_REQ_ID in (first.code, second.code):
                refused, kept = split_duplicate(first, second)
                assert refused.channel == "reply" and refused.body["op"] == T.PING, refused
                assert kept.ok and kept.body["op"] == T.ATTACH, kept
                refusals += 1
                break
            assert first.ok and second.ok and second.body["op"] == T.PING, (first, second)
        finally:
            ensure_detached(client)
    assert refusals == 1, "no PING was refused while its ATTACH was in flight in 20 bursts"


def test_req_id_may_be_reused_after_its_outcome(attached: Attached) -> None:
    client = attached.client
    for _ in range(3):
        assert client.call(T.SWAP_OUT, req_id=42, device_ids=[0], host_ids=[0]).ok
        assert client.call(T.PING, req_id=42).ok


def test_req_ids_are_per_client(attached: Attached, main: DaemonProc, connect: ClientFactory, scratch: Path) -> None:
    other = connect(main)
    with held_in_flight(attached.client, scratch / "main-store", 6000):
        assert other.call(T.LOOKUP, req_id=6000, keys=["per-client"]).ok
    assert attached.client.wait(6000).body["op"] == T.LOAD


# boot_id ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["HELLO", "PING", "STATUS"])
def test_hello_ping_status_ignore_boot_id(main: DaemonProc, connect: ClientFactory, name: str) -> None:
    client = connect(main)
    fields: dict[str, Any] = {"protocol": [1, 0], "events": client.events_endpoint} if name == "HELLO" else {}
    outcome = client.call(T[name], boot_id=other_boot(client), **fields)
    assert outcome.ok, outcome
    assert outcome.body["boot_id"] == client.boot_id


@pytest.mark.parametrize("name", [n for n in DUPLICATES if n not in ("HELLO", "PING", "STATUS")])
def test_other_commands_check_boot_id(attached: Attached, name: str) -> None:
    client = attached.client
    outcome = client.call(T[name], boot_id=other_boot(client), **DUPLICATES[name])
    assert outcome.code == E.STALE_BOOT, outcome
    assert client.call(T.STATUS).result["device"]["state"] == "attached"


def test_the_right_boot_id_is_accepted(attached: Attached) -> None:
    client = attached.client
    assert client.call(T.SWAP_OUT, boot_id=client.boot_id, device_ids=[0], host_ids=[0]).ok
    assert client.call(T.LOOKUP, boot_id=client.boot_id, keys=["k"]).ok


# Shared-memory tensors ------------------------------------------------------------------------


def test_overlapping_shm_tensors_are_a_layout_mismatch(
    main: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    client = connect(main)
    cache = shm()
    overlapping = list(cache.offsets)
    overlapping[2] = overlapping[1] + cache.chunk  # tensor 2 starts inside tensor 1
    reply = client.call(T.ATTACH, layout=LAYOUT, device={**cache.device_map(), "offsets": overlapping})
    if reply.ok:
        ensure_detached(client)
    assert reply.code == E.LAYOUT_MISMATCH, reply


def test_tensor_past_the_segment_end_is_a_layout_mismatch(
    main: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    client = connect(main)
    cache = shm()
    past = list(cache.offsets)
    past[-1] += 1
    reply = client.call(T.ATTACH, layout=LAYOUT, device={**cache.device_map(), "offsets": past})
    if reply.ok:
        ensure_detached(client)
    assert reply.code == E.LAYOUT_MISMATCH, reply


def test_tensors_in_any_order_and_with_gaps(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    """§8.3 only asks for disjoint tensors inside the segment."""
    client = connect(main)
    tensor = 64 * 256
    offsets = [3 * tensor + 512, 0, 6 * tensor, tensor + 4096]
    cache = shm(offsets=offsets, size=7 * tensor)
    want = cache.block(5)
    try:
        assert client.call(T.ATTACH, **cache.attach_fields()).ok
        assert client.call(T.SWAP_OUT, device_ids=[5], host_ids=[900]).ok
        assert client.call(T.SWAP_IN, device_ids=[6], host_ids=[900]).ok
        assert cache.block(6) == want
    finally:
        ensure_detached(client)
