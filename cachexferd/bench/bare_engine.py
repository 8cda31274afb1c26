"""The floors of ``cachexferd bench completion``: a bare client, and bare servers.

``bare``: the same commands to the same daemons as the ``client`` engine, with nothing but
pyzmq and the msgpack codec: a DEALER per rank sends each command's frames, a PULL takes
the events, and a command is complete once every rank reported it. No pending table,
deadlines, heartbeats, connection watch or outcome objects. What the scheduler thread
spends here per command is what the sends and receives themselves cost on this host; the
client engines' time is read against it.

``floor``: that bare client against bare loops (``bare_loop``: one pyzmq process per rank
that answers each command with an event at once) instead of daemons: the delivery latency
any ZeroMQ client and server pair of processes gets on this host, at this rate, with this
scheduler. The daemons' latency is read against it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ..protocol import PROTOCOL_MAJOR, PROTOCOL_MINOR, Hello, MsgType, encode_body, encode_command
from .bare_loop import start_bare_loop
from .completion_engines import ClientTime, OriginEngine, swap_command

_decode = msgspec.msgpack.Decoder().decode


class BareZmqEngine(OriginEngine):
    """``endpoints``: daemons (said hello to), or None with ``ranks`` bare loops started here."""

    def __init__(self, endpoints: list[str] | None, daemon_pids: list[int], ranks: int = 0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._dir = tempfile.TemporaryDirectory(prefix="cx-bare-")
        self.pull = self.ctx.socket(zmq.PULL)
        events = f"ipc://{Path(self._dir.name) / 'events.sock'}"
        self.pull.bind(events)
        self.loops: list[subprocess.Popen[bytes]] = []
        if endpoints is None:
            endpoints = [f"ipc://{Path(self._dir.name) / f'loop{rank}.sock'}" for rank in range(ranks)]
            self.loops = [start_bare_loop(endpoint, events) for endpoint in endpoints]
            daemon_pids = [loop.pid for loop in self.loops]
        super().__init__(daemon_pids)
        self.dealers = [self._dealer(endpoint) for endpoint in endpoints]
        if self.loops:
            self.boot_ids = ["bare"] * len(endpoints)
        else:
            self.boot_ids = [self._hello(sock, events, i) for i, sock in enumerate(self.dealers)]
        self.reports: dict[int, int] = {}  # req_id -> ranks that reported it
        self._req_id = 0

    def _dealer(self, endpoint: str) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def _hello(self, sock: zmq.Socket[Any], events: str, index: int) -> str:
        hello = Hello(req_id=1 << 40 | index, protocol=[PROTOCOL_MAJOR, PROTOCOL_MINOR], client="bench-bare",
                      role="engine", events=events, pid=os.getpid(), batch_events=True)  # fmt: skip
        sock.send_multipart(encode_command(hello))
        if not sock.poll(30_000):
            raise RuntimeError("a daemon did not answer the bare engine's hello in 30 s")
        reply = _decode(sock.recv_multipart()[1])
        if reply.get("code") != 0:
            raise RuntimeError(f"hello refused: {reply}")
        return str(reply["boot_id"])

    def warm_up(self, count: int, timeout_s: float = 30.0) -> None:
        self.submit(count)
        deadline = time.monotonic() + timeout_s
        while self.origins:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(self.origins)} warm-up commands got no outcome in {timeout_s:g} s")
            self.pull.poll(100)
            self.collect()
        self.sent, self.client_time = 0, ClientTime()

    def submit(self, count: int) -> None:
        started = self.client_time.start()
        for _ in range(count):
            op, fields = swap_command(self.sent)
            self._req_id += 1
            req_id = self._req_id
            self.origins[req_id] = time.monotonic()
            for sock, boot_id in zip(self.dealers, self.boot_ids):
                sock.send_multipart(encode_body(op, {**fields, "req_id": req_id, "boot_id": boot_id}))
            self.sent += 1
        self.client_time.stop("submit", started)

    def collect(self) -> list[tuple[float, bool]]:
        started = self.client_time.start()
        seen: list[tuple[float, bool]] = []
        ranks, reports, recv = len(self.dealers), self.reports, self.pull.recv_multipart
        while True:
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            body = _decode(frames[1])
            if frames[0][3] == MsgType.EVENT:  # a bare loop's
                events = [(body["req_id"], body["code"])]
            else:
                events = [(entry[0], entry[2]) for entry in body["events"]]
            for req_id, code in events:
                count = reports.get(req_id, 0) + 1
                if count < ranks:
                    reports[req_id] = count
                    continue
                reports.pop(req_id, None)
                origin = self.origins.pop(req_id, None)
                if origin is not None:
                    seen.append((origin, code == 0))
        self.client_time.stop("poll", started)
        return seen

    def close(self) -> None:
        for sock in (*self.dealers, self.pull):
            sock.close(0)
        self.ctx.term()
        for loop in self.loops:
            assert loop.stdin is not None
            loop.stdin.close()  # a bare loop exits when its stdin closes
            try:
                loop.wait(10)
            except subprocess.TimeoutExpired:
                loop.kill()
                loop.wait(10)
        self._dir.cleanup()
