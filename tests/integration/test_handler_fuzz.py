"""Property test of every command handler through a real in-process daemon: random,
well-formed-ish commands of every type (and BATCH envelopes of them) never stop the daemon,
and every command gets exactly one outcome: one per readable req_id, one with req_id 0 per
command whose req_id is unreadable."""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cachexferd.client.runner import ShmKVCache
from cachexferd.protocol import MsgType, decode_outcomes, encode_batch, encode_body

from ..helpers import SMALL, InProcessDaemon, config_for

WAIT_S = 30.0
STALE_BOOT = "0" * 32


@dataclass
class Rig:
    """One daemon for all examples, a runner cache it may attach, and a raw client."""

    daemon: InProcessDaemon
    cache: ShmKVCache
    events: str
    ctx: zmq.Context[Any]
    dealer: zmq.Socket[Any]
    pull: zmq.Socket[Any]
    next_id: int = 1000
    boot_id: str = ""

    def req_id(self) -> int:
        self.next_id += 1
        return self.next_id


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with tempfile.TemporaryDirectory(prefix="cx-") as tmp:
        root = Path(tmp)
        daemon = InProcessDaemon(config_for(root / "rt", **{"storage.file.path": str(root / "pool")})).start()
        ctx: zmq.Context[Any] = zmq.Context()
        dealer, pull = ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)
        for sock in (dealer, pull):
            sock.setsockopt(zmq.LINGER, 0)
        events = f"ipc://{root / 'ev.sock'}"
        pull.bind(events)
        dealer.connect(daemon.endpoint)
        cache = ShmKVCache(SMALL)
        try:
            yield Rig(daemon, cache, events, ctx, dealer, pull)
        finally:
            ctx.destroy(0)
            daemon.stop()
            cache.close()


# Field values: valid ones, then sometimes one field made wrong in type, range or size ---------

BAD_VALUES = [
    "drop", None, -1, 0, "x", 1.5, True, {}, [], [-1], [1.5], [SMALL.num_blocks], [2**31], ["k0"], "x" * 5000,
    [0, 0], ["has space"], ["k0", "k0"], ["x" * 300], list(range(70_000)),
]  # fmt: skip


@st.composite
def pairs(draw: st.DrawFn, count: int | None = None) -> tuple[list[int], list[int]]:
    """Unique device ids and unique host ids of one length."""
    n = draw(st.integers(0, 6)) if count is None else count
    device = draw(st.lists(st.integers(0, SMALL.num_blocks - 1), min_size=n, max_size=n, unique=True))
    host = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True))
    return device, host


@st.composite
def storage_fields(draw: st.DrawFn, with_host: bool) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(["k0", "k1", "k2", "k3", "k4", "k5"]), max_size=5, unique=True))
    if not with_host:
        return {"keys": keys}
    device, host = draw(pairs(len(keys)))
    return {"keys": keys, "host_ids": host, **({"device_ids": device} if draw(st.booleans()) else {})}


def valid_fields(msg_type: MsgType, rig: Rig) -> st.SearchStrategy[dict[str, Any]]:
    """The type-specific fields of a command the daemon could carry out."""
    if msg_type == MsgType.HELLO:
        return st.fixed_dictionaries({"protocol": st.sampled_from([[1, 0], [1, 1]]), "events": st.just(rig.events),
                                      "batch_events": st.booleans()})  # fmt: skip
    if msg_type == MsgType.ATTACH:
        pid = st.sampled_from([os.getpid(), None])
        return st.fixed_dictionaries({"layout": st.just(SMALL.to_wire()), "device": st.just(rig.cache.device_handle()),
                                      "pid": pid})  # fmt: skip
    if msg_type == MsgType.DETACH:
        return st.fixed_dictionaries({"drain_timeout_s": st.sampled_from([None, 0.0, 1.0])})
    if msg_type in (MsgType.SWAP_OUT, MsgType.SWAP_IN):
        return pairs().map(lambda p: {"device_ids": p[0], "host_ids": p[1]})
    if msg_type in (MsgType.STORE, MsgType.LOAD):
        return storage_fields(with_host=True)
    if msg_type in (MsgType.LOOKUP, MsgType.DELETE):
        return storage_fields(with_host=False)
    return st.just({})  # PING, STATUS, SHUTDOWN, CLEAR_HOST


@st.composite
def fields_for(draw: st.DrawFn, msg_type: MsgType, rig: Rig) -> dict[str, Any]:
    fields = dict(draw(valid_fields(msg_type, rig)))
    if fields and draw(st.integers(0, 3)) == 0:  # a quarter of the commands get one field spoiled
        name = draw(st.sampled_from(sorted(fields)))
        bad = draw(st.sampled_from(BAD_VALUES))
        if msg_type == MsgType.HELLO and name == "events" and bad not in (None, "drop"):
            bad = draw(st.sampled_from(["udp://x", "ipc://@cx-fuzz", 5, "tcp://8.8.8.8:9"]))  # refused, never used
        if msg_type == MsgType.ATTACH and name == "device" and draw(st.booleans()):
            handle = rig.cache.device_handle()
            bad = draw(st.sampled_from([{**handle, "name": "cx-fuzz-missing"}, {**handle, "name": ".."},
                                        {**handle, "offsets": [0]}, {**handle, "kind": "cuda_ipc"}]))  # fmt: skip
        if bad == "drop":
            del fields[name]
        else:
            fields[name] = bad
    return fields


req_ids = st.sampled_from(["fresh"] * 30 + [0, -1, -(2**63), "7", True, None, 1.5, "missing"])
boot_ids = st.sampled_from(["missing"] * 10 + [None, "real", "real", STALE_BOOT, 5, "x" * 65])


COMMAND_TYPES = [t for t in MsgType if t < MsgType.REPLY and t != MsgType.BATCH]


@st.composite
def commands(draw: st.DrawFn, rig: Rig) -> tuple[MsgType, dict[str, Any], int | None]:
    """(type, body, req_id or None when the daemon cannot read it)."""
    msg_type = draw(st.sampled_from(COMMAND_TYPES))
    body = draw(fields_for(msg_type, rig))
    req = draw(req_ids)
    readable = rig.req_id() if req == "fresh" else None
    if req != "missing":
        body["req_id"] = readable if readable is not None else req
    boot = draw(boot_ids)
    if msg_type == MsgType.SHUTDOWN and boot in ("missing", None, "real"):
        boot = STALE_BOOT  # a SHUTDOWN that could succeed would end the test's daemon
    if boot != "missing":
        body["boot_id"] = rig.boot_id if boot == "real" else boot
    return msg_type, body, readable


def send(rig: Rig, batch: list[tuple[MsgType, dict[str, Any], int | None]], envelope: bool) -> None:
    if envelope:
        rig.dealer.send_multipart(encode_batch([(t, body) for t, body, _ in batch]))
        return
    for msg_type, body, _ in batch:
        rig.dealer.send_multipart(encode_body(msg_type, body))


def drain(rig: Rig) -> None:
    """Forgets outcomes left over from an example that failed half-way."""
    for sock in (rig.dealer, rig.pull):
        while sock.poll(20):
            sock.recv_multipart()


def collect(rig: Rig, expected: Counter[int]) -> Counter[int]:
    """Outcomes (replies and events) by req_id until ``expected`` is met, then 150 ms more."""
    got: Counter[int] = Counter()
    poller = zmq.Poller()
    poller.register(rig.dealer, zmq.POLLIN)
    poller.register(rig.pull, zmq.POLLIN)
    deadline = time.monotonic() + WAIT_S
    quiet_until: float | None = None
    while time.monotonic() < (quiet_until or deadline):
        for sock, _ in poller.poll(50):
            for outcome in decode_outcomes(sock.recv_multipart()):
                got[outcome.req_id] += 1
                rig.boot_id = outcome.boot_id
                event(f"{MsgType(outcome.op).name if outcome.op else '?'} -> {outcome.error}")
        if quiet_until is None and all(got[r] >= n for r, n in expected.items()):
            quiet_until = time.monotonic() + 0.15
    return got


@settings(
    max_examples=60, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
@given(data=st.data())
def test_every_command_gets_exactly_one_outcome(rig: Rig, data: st.DataObject) -> None:
    hello = (MsgType.HELLO, {"req_id": rig.req_id(), "protocol": [1, 1], "events": rig.events}, None)
    batch = [hello, *data.draw(st.lists(commands(rig), min_size=1, max_size=24))]
    envelope = data.draw(st.booleans())
    drain(rig)
    send(rig, batch, envelope)
    expected = Counter(req for _, body, req in batch if req is not None)
    expected[hello[1]["req_id"]] = 1
    expected[0] = sum(1 for _, _, req in batch[1:] if req is None)
    got = collect(rig, expected)
    assert +got == +expected, f"outcomes by req_id differ: missing {expected - got}, extra {got - expected}"
    assert rig.daemon.thread.is_alive()
