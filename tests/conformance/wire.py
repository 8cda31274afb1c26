"""A minimal client written from docs/protocol.md alone: raw pyzmq sockets and msgpack maps.

Every frame is built by hand (header b"CX" + major + type, body a msgpack map) and every
outcome is checked against the outcome table (§5.2) before a test looks at it.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from .spec import CLIENT_ONLY, MAGIC, MAJOR, MINOR, E, T

DEFAULT_TIMEOUT_S = 15.0  # a loaded 2-core machine can be slow; no wait is unbounded
_BOOT_ID = re.compile(r"^[0-9a-f]{32}$")
_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
_event_serial = itertools.count()


def context() -> zmq.Context[zmq.Socket[bytes]]:
    global _ctx
    if _ctx is None:
        _ctx = zmq.Context()
    return _ctx


def header(msg_type: int, major: int = MAJOR) -> bytes:
    return MAGIC + bytes((major, msg_type))


def pack(body: Any) -> bytes:
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


@dataclass
class Outcome:
    """One REPLY or EVENT, already checked against §5.2."""

    channel: str  # "reply" (command socket) or "event" (event socket)
    frames: list[bytes]
    body: dict[str, Any]
    received_at: float = field(default_factory=time.monotonic)

    @property
    def req_id(self) -> int:
        return int(self.body["req_id"])

    @property
    def code(self) -> int:
        return int(self.body["code"])

    @property
    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = self.body["result"]
        return result

    @property
    def ok(self) -> bool:
        return self.code == E.OK

    def __repr__(self) -> str:
        b = self.body
        try:
            name = E(b["code"]).name
        except ValueError:
            name = f"code {b['code']}"
        return f"<{self.channel} req_id={b['req_id']} op={b['op']} {name} {b['detail']!r} {b['result']!r}>"


def check_outcome(channel: str, frames: list[bytes]) -> Outcome:
    """Decodes an outcome and asserts that it has the shape of §2 and §5.2."""
    assert len(frames) == 2, f"{channel}: {len(frames)} frames, not 2"
    head, raw = frames
    want = T.REPLY if channel == "reply" else T.EVENT
    assert head == header(want), f"{channel}: header {head.hex()} is not {header(want).hex()}"
    body = msgpack.unpackb(raw, raw=False)
    assert type(body) is dict, f"{channel}: body is {type(body).__name__}, not a map"
    types = {
        "req_id": int,
        "boot_id": str,
        "rank": int,
        "op": int,
        "code": int,
        "error": str,
        "detail": str,
        "result": dict,
    }
    for key, kind in types.items():
        assert key in body, f"{channel} lacks {key!r}: {body}"
        assert type(body[key]) is kind, f"{channel}: {key} is {type(body[key]).__name__}, not {kind.__name__}"
    assert all(type(k) is str for k in body), body
    assert 0 <= body["req_id"] <= 2**64 - 1
    assert _BOOT_ID.match(body["boot_id"]), f"boot_id {body['boot_id']!r} is not 32 hex chars"
    assert body["code"] in {int(e) for e in E} - CLIENT_ONLY, body
    assert body["error"] == E(body["code"]).name, body
    if body["code"] == E.OK:
        assert body["detail"] == "", body
    else:
        assert body["detail"], f"an error outcome needs a detail: {body}"
        assert body["result"] == {}, f"an error outcome has an empty result: {body}"
    return Outcome(channel, list(frames), body)


def check_event_batch(frames: list[bytes]) -> list[Outcome]:
    """An EVENT_BATCH (§14.2) as the EVENT outcomes it stands for, each checked like one."""
    assert len(frames) == 2 and frames[0] == header(T.EVENT_BATCH), frames[0]
    body = msgpack.unpackb(frames[1], raw=False)
    assert set(body) == {"boot_id", "rank", "events"} and type(body["events"]) is list, body
    out = []
    for entry in body["events"]:
        assert type(entry) is list and len(entry) == 5, entry
        req_id, op, code, detail, result = entry
        one = {"req_id": req_id, "boot_id": body["boot_id"], "rank": body["rank"], "op": op, "code": code,
               "error": E(code).name, "detail": detail, "result": result}  # fmt: skip
        out.append(check_outcome("event", [header(T.EVENT), pack(one)]))
    return out


class Client:
    """One DEALER on the command socket and (optionally) one bound PULL for events."""

    def __init__(self, endpoint: str, scratch: Path, events: bool = True) -> None:
        self.endpoint = endpoint
        ctx = context()
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.RECONNECT_IVL, 50)
        self.dealer.connect(endpoint)
        self.pull: zmq.Socket[bytes] | None = None
        self.events_endpoint: str | None = None
        if events:
            self.pull = ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.LINGER, 0)
            self.events_endpoint = f"ipc://{scratch}/ev{os.getpid()}-{next(_event_serial)}.sock"
            self.pull.bind(self.events_endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.dealer, zmq.POLLIN)
        if self.pull is not None:
            self.poller.register(self.pull, zmq.POLLIN)
        self.inbox: list[Outcome] = []
        self.boot_id: str | None = None
        self.event_channel = False  # whether our last hello named an event endpoint
        self.sent_attach = False  # for cleanup: a test that attached should end detached
        self._ids = itertools.count(1)

    # Sending ------------------------------------------------------------------------------

    def next_id(self) -> int:
        return next(self._ids)

    def send_frames(self, frames: Iterable[bytes]) -> None:
        self.dealer.send_multipart(list(frames))

    def send(self, msg_type: int, body: dict[str, Any], major: int = MAJOR) -> None:
        self.send_frames([header(msg_type, major), pack(body)])

    def command(self, msg_type: int, **fields: Any) -> int:
        """Sends one command; returns its req_id (given as a field or the next free one)."""
        req_id = fields.pop("req_id", None)
        req_id = self.next_id() if req_id is None else req_id
        self.sent_attach = self.sent_attach or msg_type == T.ATTACH
        self.send(msg_type, {"req_id": req_id, **fields})
        return int(req_id)

    # Receiving ----------------------------------------------------------------------------

    def _pump(self, timeout_s: float) -> bool:
        """Moves whatever arrives within ``timeout_s`` into the inbox; True if anything came."""
        got = False
        for sock, _ in self.poller.poll(max(0, int(timeout_s * 1000))):
            channel = "reply" if sock is self.dealer else "event"
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if channel == "event" and frames[0] == header(T.EVENT_BATCH):
                    self.inbox += check_event_batch(frames)
                else:
                    self.inbox.append(check_outcome(channel, frames))
                got = True
        return got

    def wait(self, req_id: int, timeout_s: float = DEFAULT_TIMEOUT_S, channel: str | None = None) -> Outcome:
        """The next outcome carrying ``req_id`` (on ``channel`` if given)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, outcome in enumerate(self.inbox):
                if outcome.req_id == req_id:
                    del self.inbox[i]
                    if channel is not None:
                        assert outcome.channel == channel, f"{outcome} came as a {outcome.channel}, not a {channel}"
                    return outcome
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no outcome for req_id {req_id} within {timeout_s}s (inbox {self.inbox})")
            self._pump(min(left, 0.2))

    def next_outcome(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> Outcome:
        """Whatever outcome arrives first (for tests that check which req_id it carries)."""
        deadline = time.monotonic() + timeout_s
        while not self.inbox:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no outcome at all within {timeout_s}s")
            self._pump(min(left, 0.2))
        return self.inbox.pop(0)

    def wait_all(self, req_ids: Iterable[int], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Outcome]:
        deadline = time.monotonic() + timeout_s
        return [self.wait(r, max(0.0, deadline - time.monotonic())) for r in req_ids]

    def collect(self, seconds: float) -> list[Outcome]:
        """Everything that arrives within ``seconds`` (plus what was already waiting)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._pump(left)
        out, self.inbox = self.inbox, []
        return out

    def assert_no_outcome(self, req_id: int, seconds: float) -> None:
        extra = [o for o in self.collect(seconds) if o.req_id == req_id]
        assert not extra, f"more than one outcome for req_id {req_id}: {extra}"

    # Commands ---------------------------------------------------------------------------

    def call(self, msg_type: int, timeout_s: float = DEFAULT_TIMEOUT_S, **fields: Any) -> Outcome:
        """Sends a command and returns its one outcome, on the channel §5.3 names."""
        req_id = self.command(msg_type, **fields)
        return self.wait(req_id, timeout_s, channel=self.channel_for(msg_type, req_id))

    def channel_for(self, msg_type: int, req_id: int) -> str:
        """§5.3: asynchronous commands with a readable req_id from a client with an event
        endpoint get an EVENT; everything else a REPLY."""
        asynchronous = msg_type in (T.SWAP_OUT, T.SWAP_IN, T.CLEAR_HOST, T.STORE, T.LOAD, T.LOOKUP, T.DELETE)
        return "event" if asynchronous and req_id and self.event_channel else "reply"

    def hello(self, **fields: Any) -> Outcome:
        body: dict[str, Any] = {"protocol": [MAJOR, MINOR], "client": "conformance", "role": "engine"}
        if self.events_endpoint is not None:
            body["events"] = self.events_endpoint
        body.update(fields)
        outcome = self.call(T.HELLO, **body)
        assert outcome.ok, outcome
        self.boot_id = outcome.body["boot_id"]
        self.event_channel = body.get("events") is not None
        return outcome

    def close(self) -> None:
        self.dealer.close(0)
        if self.pull is not None:
            self.pull.close(0)
