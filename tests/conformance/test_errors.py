"""Every error code docs/protocol.md §6 lists as sent by a daemon, each triggered on the wire:
one table row and one test per code."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import CacheFactory, ClientFactory
from .daemons import DaemonProc
from .helpers import burst, held_in_flight, hung_object, object_file
from .shm import LAYOUT
from .spec import CLIENT_ONLY, MAX_IDS, E, T
from .wire import Client, Outcome, header, pack

pytestmark = pytest.mark.conformance


@dataclass
class Ctx:
    daemon: DaemonProc
    connect: ClientFactory
    shm: CacheFactory
    scratch: Path

    def client(self, hello: bool = True, events: bool = True) -> Client:
        return self.connect(self.daemon, hello=hello, events=events)

    def attached(self, pid: int | None = None) -> Client:
        client = self.client()
        reply = client.call(T.ATTACH, **self.shm(seed=3).attach_fields(pid))
        assert reply.ok, reply
        return client


def detach(client: Client) -> None:
    assert client.call(T.DETACH).ok


def bad_frame(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    outcomes = []
    for frames in (
        [header(T.PING)],  # one frame
        [header(T.PING), pack({"req_id": 1}), b""],  # three frames
        [b"XY\x01\x02", b"\xc1garbage"],  # bad magic
        [b"CX\x01", pack({"req_id": 1})],  # short header
        [header(T.PING), b"\xc1"],  # not msgpack
        [header(T.PING), pack([1, 2, 3])],  # not a map
    ):
        client.send_frames(frames)
        outcome = client.wait(0, channel="reply")
        assert outcome.body["op"] in (0, T.PING), outcome
        outcomes.append(outcome)
    return outcomes


def unknown_type(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    outcomes = []
    for msg_type in (99, T.REPLY, T.EVENT, 0):
        req_id = client.next_id()
        client.send(msg_type, {"req_id": req_id})
        outcome = client.wait(req_id, channel="reply")
        assert outcome.body["op"] == msg_type, outcome
        outcomes.append(outcome)
    return outcomes


def wrong_version(ctx: Ctx) -> list[Outcome]:
    client = ctx.client(hello=False)
    req_id = client.next_id()
    client.send(T.PING, {"req_id": req_id}, major=2)
    by_header = client.wait(req_id, channel="reply")
    by_hello = client.call(T.HELLO, protocol=[2, 0])
    return [by_header, by_hello]


def bad_field(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    outcomes = [client.call(T.PING, req_id=0)]  # req_id must be >= 1
    assert outcomes[0].req_id == 0
    for body in ({}, {"req_id": True}, {"req_id": -5}, {"req_id": "7"}, {"req_id": 1.0}):
        client.send(T.PING, body)
        outcomes.append(client.wait(0, channel="reply"))
    outcomes.append(client.call(T.SWAP_OUT, device_ids=[2**31], host_ids=[0]))
    outcomes.append(client.call(T.SWAP_OUT, device_ids=[-1], host_ids=[0]))
    outcomes.append(client.call(T.SWAP_OUT, device_ids="0", host_ids=[0]))
    outcomes.append(client.call(T.SWAP_OUT, host_ids=[0]))  # missing field
    outcomes.append(client.call(T.LOOKUP, keys=["has space"]))
    outcomes.append(client.call(T.HELLO, protocol=[1, 0], role="king"))
    return outcomes


def too_large(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    return [
        client.call(T.SWAP_OUT, device_ids=[0] * (MAX_IDS + 1), host_ids=[0] * (MAX_IDS + 1)),
        client.call(T.LOOKUP, keys=["k"] * (MAX_IDS + 1)),
        client.call(T.PING, boot_id="b" * 65),
    ]


def no_event_channel(ctx: Ctx) -> list[Outcome]:
    silent = ctx.client(hello=False, events=False)
    no_events = ctx.client(hello=False)
    no_events.hello(events=None)
    return [silent.call(T.CLEAR_HOST), no_events.call(T.LOOKUP, keys=["k"])]


def not_attached(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    return [
        client.call(T.SWAP_OUT, device_ids=[0], host_ids=[0]),
        client.call(T.SWAP_IN, device_ids=[0], host_ids=[0]),
        client.call(T.STORE, keys=["k"], host_ids=[0]),  # the host blocks' layout is still unknown
        client.call(T.LOAD, keys=["k"], host_ids=[0]),
    ]


def already_attached(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()
    try:
        return [client.call(T.ATTACH, **ctx.shm(seed=4).attach_fields())]
    finally:
        detach(client)


def layout_mismatch(ctx: Ctx) -> list[Outcome]:
    detach(ctx.attached())  # the host cache is now bound to LAYOUT
    client = ctx.client()
    bigger = ctx.shm(layout={**LAYOUT, "head_dim": 32})
    other_dtype = ctx.shm(layout={**LAYOUT, "dtype": "float16"})  # same bytes per block, other layout
    small = ctx.shm(size=4096)  # LAYOUT's tensors need 64 KiB
    return [
        client.call(T.ATTACH, **bigger.attach_fields()),
        client.call(T.ATTACH, **other_dtype.attach_fields()),
        client.call(T.ATTACH, **small.attach_fields()),
    ]


def id_out_of_range(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()
    try:
        host_blocks = (16 << 20) // 1024
        return [
            client.call(T.SWAP_OUT, device_ids=[LAYOUT["num_blocks"]], host_ids=[0]),
            client.call(T.SWAP_IN, device_ids=[0], host_ids=[host_blocks]),
            client.call(T.STORE, keys=["k"], host_ids=[host_blocks]),
        ]
    finally:
        detach(client)


def duplicate_id(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()
    try:
        return [
            client.call(T.SWAP_OUT, device_ids=[1, 2], host_ids=[5, 5]),
            client.call(T.SWAP_IN, device_ids=[1, 1], host_ids=[5, 6]),
            client.call(T.STORE, keys=["k", "k"], host_ids=[1, 2]),
            client.call(T.LOAD, keys=["k", "j"], host_ids=[1, 1]),
        ]
    finally:
        detach(client)


def length_mismatch(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()
    try:
        return [
            client.call(T.SWAP_OUT, device_ids=[1, 2], host_ids=[5]),
            client.call(T.STORE, keys=["k"], host_ids=[1, 2]),
            client.call(T.LOAD, keys=["k"], host_ids=[1], device_ids=[1, 2]),
        ]
    finally:
        detach(client)


def stale_boot(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    other = "0" * 32 if client.boot_id != "0" * 32 else "1" * 32
    return [
        client.call(T.SWAP_OUT, boot_id=other, device_ids=[0], host_ids=[0]),
        client.call(T.DETACH, boot_id=other),
        client.call(T.LOOKUP, boot_id="not-a-boot-id", keys=["k"]),
    ]


def shutting_down(ctx: Ctx) -> list[Outcome]:
    """SIGTERM while a command is held in flight (a hung storage read): the daemon drains,
    and commands that arrive meanwhile are refused, except HELLO, PING and STATUS."""
    client = ctx.attached()
    with hung_object(ctx.scratch / f"{ctx.daemon.name}-store", "hung"):
        held = client.command(T.LOAD, keys=["hung"], host_ids=[0])
        time.sleep(0.3)  # let the read reach the FIFO
        ctx.daemon.terminate()
        deadline = time.monotonic() + 10
        while client.call(T.STATUS).result["state"] != "draining":
            assert time.monotonic() < deadline, "the daemon never reported state 'draining' after SIGTERM"
            time.sleep(0.02)
        refused = [client.call(T.SWAP_OUT, device_ids=[0], host_ids=[0]), client.call(T.CLEAR_HOST)]
        assert client.call(T.PING).ok
        assert client.call(T.HELLO, protocol=[1, 0], events=client.events_endpoint).ok
    client.wait(held)  # the held command still gets its one outcome
    assert ctx.daemon.wait_exit(20) == 0
    assert not ctx.daemon.socket_path.exists(), "the ipc socket file is removed at exit"
    return refused


def detached(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()
    store = ctx.scratch / "main-store"
    with hung_object(store, "hung-detached"):
        held = client.command(T.LOAD, keys=["hung-detached"], host_ids=[3], device_ids=[3])
        time.sleep(0.3)
        done = client.call(T.DETACH, drain_timeout_s=0.0)
        assert done.ok and done.result["cancelled"] == 1, done
        return [client.wait(held)]


def attach_failed(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    cache = ctx.shm()
    return [
        client.call(
            T.ATTACH, layout=LAYOUT, device={"kind": "shm", "name": cache.name + "-gone", "offsets": cache.offsets}
        )
    ]


def busy(ctx: Ctx) -> list[Outcome]:
    """`main` runs with daemon.max_inflight = 64: a held LOAD, then 100 swaps into the same
    host block, which all wait for it."""
    client = ctx.attached()
    with held_in_flight(client, ctx.scratch / "main-store", 9999, host_block=16001):
        ids = burst(client, [(T.SWAP_OUT, {"device_ids": [0], "host_ids": [16001]})] * 100)
        refused = [client.wait(req_id) for req_id in ids[64:]]  # at least these cannot be admitted
    outcomes = client.wait_all([9999, *ids[:64]])
    assert not [o for o in client.collect(0.3) if o.req_id in ids], "a command got two outcomes"
    assert {o.code for o in outcomes[1:]} <= {E.OK, E.BUSY}
    assert any(o.ok for o in outcomes[1:])
    return refused


def duplicate_req_id(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()  # the held LOAD needs the host blocks' layout
    with held_in_flight(client, ctx.scratch / "main-store", 1000):
        client.command(T.LOOKUP, req_id=1000, keys=["k"])
        refused = client.next_outcome()
    held = client.wait(1000)
    assert held.body["op"] == T.LOAD and held.channel == "event", held
    assert refused.channel == "reply", f"DUPLICATE_REQ_ID comes as a REPLY on the command socket: {refused}"
    client.assert_no_outcome(1000, 0.2)
    return [refused]


def bad_state(ctx: Ctx) -> list[Outcome]:
    """An ATTACH while the daemon detaches on its own (the attached runner exited) and a
    device command still holds the detach up (a hung storage read)."""
    runner = subprocess.Popen(["sleep", "60"])
    try:
        client = ctx.attached(pid=runner.pid)
        store = ctx.scratch / "main-store"
        with hung_object(store, "hung-bad-state"):
            held = client.command(T.LOAD, keys=["hung-bad-state"], host_ids=[4], device_ids=[4])
            time.sleep(0.3)
            runner.kill()
            runner.wait(10)
            deadline = time.monotonic() + 5
            while client.call(T.STATUS).result["device"]["state"] != "detaching":
                assert time.monotonic() < deadline, "no automatic detach after the runner exited"
                time.sleep(0.02)
            outcome = client.call(T.ATTACH, **ctx.shm(seed=5).attach_fields())
            client.wait(held)
        deadline = time.monotonic() + 10
        while client.call(T.STATUS).result["device"]["state"] != "detached":
            assert time.monotonic() < deadline, "the automatic detach never finished"
            time.sleep(0.05)
        return [outcome]
    finally:
        runner.kill()
        runner.wait(10)


def stale_weights(ctx: Ctx) -> list[Outcome]:
    """A host block written under version 0 is refused once the weights version moves on."""
    client = ctx.attached()
    assert client.call(T.SWAP_OUT, device_ids=[1], host_ids=[9]).ok
    assert client.call(T.SET_WEIGHTS, version=3).result == {"previous": 0, "version": 3}
    return [
        client.call(T.SWAP_IN, device_ids=[2], host_ids=[9]),
        client.call(T.STORE, keys=["stale"], host_ids=[9]),
    ]


def host_block_changed(ctx: Ctx) -> list[Outcome]:
    """(1.2) A read naming an owner the host block no longer carries (§7.13)."""
    client = ctx.attached()
    assert client.call(T.SWAP_OUT, device_ids=[1], host_ids=[12], owner="a").ok
    outcomes = [
        client.call(T.SWAP_IN, device_ids=[2], host_ids=[12], owner="b"),
        client.call(T.STORE, keys=["owned"], host_ids=[12], owner="b"),
    ]
    assert client.call(T.CLEAR_HOST).ok
    outcomes.append(client.call(T.SWAP_IN, device_ids=[2], host_ids=[12], owner="a"))
    detach(client)
    return outcomes


def expired(ctx: Ctx) -> list[Outcome]:
    """(1.2) A copy read after its not_after time (§7.14)."""
    client = ctx.attached()
    past = time.time() - 5
    outcomes = [
        client.call(T.SWAP_OUT, device_ids=[1], host_ids=[1], not_after=past),
        client.call(T.SWAP_IN, device_ids=[1], host_ids=[1], not_after=past),
        client.call(T.STORE, keys=["late"], host_ids=[1], not_after=past),
        client.call(T.LOAD, keys=["late"], host_ids=[1], not_after=past),
    ]
    detach(client)
    return outcomes


def paused(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()
    assert client.call(T.PAUSE).result["paused"] is True
    refused = [
        client.call(T.SWAP_OUT, device_ids=[1], host_ids=[1]),
        client.call(T.SWAP_IN, device_ids=[1], host_ids=[1]),
        client.call(T.STORE, keys=["p"], host_ids=[1]),
        client.call(T.LOAD, keys=["p"], host_ids=[1]),
    ]
    assert client.call(T.RESUME).result == {"paused": False, "was_paused": True}
    assert client.call(T.SWAP_OUT, device_ids=[1], host_ids=[1]).ok
    return refused


def storage_unavailable(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    return [client.call(T.LOOKUP, keys=["k"]), client.call(T.DELETE, keys=["k"])]


def storage_timeout(ctx: Ctx) -> list[Outcome]:
    client = ctx.attached()
    try:
        with hung_object(ctx.scratch / "main-store", "hung-timeout"):
            started = time.monotonic()
            outcome = client.call(T.LOAD, keys=["hung-timeout"], host_ids=[2])
            # storage.timeout_s = 1: the outcome comes within about 2 x timeout_s
            assert time.monotonic() - started < 6, outcome
            return [outcome]
    finally:
        detach(client)


def storage_error(ctx: Ctx) -> list[Outcome]:
    """A STORE that writes no object at all: the object's fan-out directory is a file."""
    store = ctx.scratch / "main-store"
    key = next(k for k in (f"blocked-{i}" for i in range(1000)) if not object_file(store, k).parent.exists())
    blocker = object_file(store, key).parent
    client = ctx.attached()
    try:
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("not a directory")
        return [client.call(T.STORE, keys=[key], host_ids=[0])]
    finally:
        blocker.unlink(missing_ok=True)
        detach(client)


def no_storage(ctx: Ctx) -> list[Outcome]:
    client = ctx.client()
    return [
        client.call(T.LOOKUP, keys=["k"]),
        client.call(T.DELETE, keys=["k"]),
        client.call(T.STORE, keys=["k"], host_ids=[0]),
        client.call(T.LOAD, keys=["k"], host_ids=[0]),
    ]


@dataclass(frozen=True)
class Case:
    code: E
    daemon: str  # the conftest fixture that provides the daemon
    trigger: Callable[[Ctx], list[Outcome]]


CASES = [
    Case(E.BAD_FRAME, "main", bad_frame),
    Case(E.UNKNOWN_TYPE, "main", unknown_type),
    Case(E.WRONG_VERSION, "main", wrong_version),
    Case(E.BAD_FIELD, "main", bad_field),
    Case(E.TOO_LARGE, "main", too_large),
    Case(E.NO_EVENT_CHANNEL, "main", no_event_channel),
    Case(E.NOT_ATTACHED, "pristine", not_attached),
    Case(E.ALREADY_ATTACHED, "main", already_attached),
    Case(E.LAYOUT_MISMATCH, "main", layout_mismatch),
    Case(E.ID_OUT_OF_RANGE, "main", id_out_of_range),
    Case(E.DUPLICATE_ID, "main", duplicate_id),
    Case(E.LENGTH_MISMATCH, "main", length_mismatch),
    Case(E.STALE_BOOT, "main", stale_boot),
    Case(E.SHUTTING_DOWN, "fresh_daemon", shutting_down),
    Case(E.DETACHED, "main", detached),
    Case(E.ATTACH_FAILED, "main", attach_failed),
    Case(E.BUSY, "main", busy),
    Case(E.DUPLICATE_REQ_ID, "main", duplicate_req_id),
    Case(E.BAD_STATE, "main", bad_state),
    Case(E.STALE_WEIGHTS, "fresh_daemon", stale_weights),
    Case(E.PAUSED, "fresh_daemon", paused),
    Case(E.HOST_BLOCK_CHANGED, "main", host_block_changed),
    Case(E.EXPIRED, "main", expired),
    Case(E.STORAGE_UNAVAILABLE, "pristine", storage_unavailable),
    Case(E.STORAGE_TIMEOUT, "main", storage_timeout),
    Case(E.STORAGE_ERROR, "main", storage_error),
    Case(E.NO_STORAGE, "nostorage", no_storage),
]
# INTERNAL means "a bug in the daemon": no well-formed or malformed input may cause it on
# purpose, so no case can trigger it (every other case asserts that it did not occur).
UNTRIGGERABLE = {E.INTERNAL}


def test_the_table_covers_every_code_a_daemon_sends() -> None:
    covered = {case.code for case in CASES}
    assert len(covered) == len(CASES)
    assert covered | UNTRIGGERABLE == set(E) - CLIENT_ONLY - {E.OK}


@pytest.mark.parametrize("case", CASES, ids=[case.code.name for case in CASES])
def test_error_code(
    case: Case, request: pytest.FixtureRequest, connect: ClientFactory, shm: CacheFactory, scratch: Path
) -> None:
    daemon: DaemonProc = request.getfixturevalue(case.daemon)
    outcomes = case.trigger(Ctx(daemon, connect, shm, scratch))
    assert outcomes
    for outcome in outcomes:
        assert outcome.code == case.code, f"expected {case.code.name}, got {outcome}"
        assert outcome.body["error"] == case.code.name and outcome.result == {}
        assert outcome.body["boot_id"] and outcome.body["rank"] == 0
