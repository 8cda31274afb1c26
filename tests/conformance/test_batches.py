"""Protocol 1.1 on the wire: BATCH envelopes, EVENT_BATCH delivery (§14), and PAUSE, RESUME
and SET_WEIGHTS (§7.10 to §7.12)."""

from __future__ import annotations

import msgpack
import pytest

from .conftest import CacheFactory, ClientFactory
from .daemons import DaemonProc
from .helpers import burst, held_in_flight
from .spec import MAX_BATCH, E, T
from .wire import header, pack

pytestmark = pytest.mark.conformance


def _batch(items: list[list[object]]) -> list[bytes]:
    return [header(T.BATCH), pack({"items": items})]


def test_batch_items_get_their_own_outcomes_in_order(
    fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    client = connect(fresh_daemon)
    assert client.call(T.ATTACH, **shm(seed=5).attach_fields()).ok
    client.send_frames(
        _batch(
            [
                [int(T.SWAP_OUT), {"req_id": 101, "device_ids": [1], "host_ids": [7]}],
                [int(T.SWAP_IN), {"req_id": 102, "device_ids": [2], "host_ids": [7]}],  # reads what 101 wrote
                [int(T.PING), {"req_id": 103}],
                ["not an item"],
                [int(T.BATCH), {"req_id": 104, "items": []}],
                [int(T.SWAP_OUT), {"req_id": 105, "device_ids": [1, 2], "host_ids": [3]}],
            ]
        )
    )
    got = {o.req_id: o for o in client.collect(2.0)}
    assert got[101].ok and got[101].channel == "event" and got[102].ok
    assert got[102].result["started_at"] >= got[101].result["finished_at"]
    assert got[103].ok and got[103].channel == "reply"
    assert got[0].code == E.BAD_FIELD and got[0].channel == "reply"
    assert got[104].code == E.BAD_FIELD and got[104].channel == "reply"
    assert got[105].code == E.LENGTH_MISMATCH
    assert client.call(T.DETACH).ok


def test_malformed_envelopes_run_nothing(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    client.send_frames([header(T.BATCH), pack({"items": "x"})])
    client.send_frames(_batch([[int(T.PING), {"req_id": 7}]] * (MAX_BATCH + 1)))
    got = client.collect(1.0)
    assert [(o.code, o.req_id, o.body["op"]) for o in got] == [(E.BAD_FIELD, 0, T.BATCH), (E.TOO_LARGE, 0, T.BATCH)]


def test_event_batch_when_asked_for(fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    client = connect(fresh_daemon, hello=False)
    client.hello(batch_events=True)
    assert client.call(T.ATTACH, **shm(seed=6).attach_fields()).ok
    items = [[int(T.SWAP_OUT), {"req_id": 200 + i, "device_ids": [i], "host_ids": [i]}] for i in range(20)]
    client.send_frames(_batch(items))
    assert client.pull is not None and client.pull.poll(10_000)
    head, body = client.pull.recv_multipart()
    assert head == header(T.EVENT_BATCH)
    events = msgpack.unpackb(body, raw=False)["events"]
    assert all(len(e) == 5 and e[2] == 0 and e[1] == T.SWAP_OUT for e in events)
    rest = client.collect(1.0)
    assert sorted([e[0] for e in events] + [o.req_id for o in rest]) == [200 + i for i in range(20)]
    assert client.call(T.DETACH).ok


def test_pause_resume_and_weights_versions(fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    client = connect(fresh_daemon)
    assert client.call(T.ATTACH, **shm(seed=7).attach_fields()).ok
    paused = client.call(T.PAUSE, drain_timeout_s=1.0)
    assert paused.channel == "reply" and set(paused.result) == {"paused", "drained", "cancelled"}
    assert client.call(T.STATUS).result["paused"] is True
    assert client.call(T.CLEAR_HOST).ok  # clearing the host tier is allowed while paused
    assert client.call(T.RESUME).result == {"paused": False, "was_paused": True}
    weights = client.call(T.SET_WEIGHTS, version=9)
    assert weights.result == {"previous": 0, "version": 9}
    assert client.call(T.STATUS).result["host_cache"]["weights_version"] == 9
    assert client.call(T.SET_WEIGHTS, version=-1).code == E.BAD_FIELD
    assert client.call(T.DETACH).ok


def test_malformed_items_echo_the_req_id_of_their_map(main: DaemonProc, connect: ClientFactory) -> None:
    """§14.1: an item that is not [int, map] is refused with BAD_FIELD, carrying the req_id of
    the item's map (the item itself, or the first map in it) when it has one."""
    client = connect(main)
    items: list[object] = [
        ["x", {"req_id": 301}],  # type not an int
        [int(T.PING), {"req_id": 302}, "extra"],  # three elements
        [{"req_id": 303}],  # a map alone in an array
        {"req_id": 304},  # a map instead of an array
        [int(T.PING), "not a map", {"req_id": 305}],  # the first map in it
        ["x", {"req_id": "305"}],  # a req_id that is not an int: 0
        [int(T.PING), {"req_id": 306}],  # well formed: a normal outcome
    ]
    client.send_frames(_batch(items))  # type: ignore[arg-type]
    got = client.collect(1.5)
    assert sorted((o.req_id, o.code, o.channel, o.body["op"]) for o in got) == [
        (0, E.BAD_FIELD, "reply", T.BATCH),
        *((r, E.BAD_FIELD, "reply", T.BATCH) for r in range(301, 306)),
        (306, E.OK, "reply", T.PING),
    ]


def test_a_pause_reports_paused_even_when_a_resume_overtakes_its_reply(
    fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory
) -> None:
    """§7.10: PAUSE takes effect when read and its result describes it; a RESUME read while the
    PAUSE waits for the commands before it is answered first, and the PAUSE still says paused."""
    client = connect(fresh_daemon)
    assert client.call(T.ATTACH, **shm(seed=8).attach_fields()).ok
    store = fresh_daemon.runtime_dir.parent / f"{fresh_daemon.name}-store"
    with held_in_flight(client, store, 900):  # a LOAD whose read hangs until the block ends
        pause, resume = burst(client, [(T.PAUSE, {"drain_timeout_s": 30.0}), (T.RESUME, {})])
        assert client.wait(resume).result == {"paused": False, "was_paused": True}
        assert client.call(T.STATUS).result["paused"] is False
    paused = client.wait(pause)
    assert paused.result == {"paused": True, "drained": 1, "cancelled": 0}, paused
    assert client.wait(900).ok
    assert client.call(T.DETACH).ok
