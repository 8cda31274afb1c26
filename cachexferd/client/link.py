"""A DEALER connected to one daemon: sends commands, reads replies. No torch, no threads."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..protocol import (
    Command,
    ErrorCode,
    Limits,
    MsgType,
    Outcome,
    ProtocolError,
    decode_outcome,
    decode_outcomes,
    encode_batch,
    encode_body,
    encode_command,
)
from ..security import CurveClientKeys, needs_ipv6
from ..zmqio import readable, recv_frames, send_frames

log = logging.getLogger(__name__)

# Fast reconnects (LMCache's ~127 s stall came from default exponential backoff) and
# ZMTP heartbeats so a dead tcp peer is noticed.
SOCKET_OPTIONS = {
    zmq.LINGER: 0,
    zmq.RECONNECT_IVL: 100,
    zmq.RECONNECT_IVL_MAX: 1000,
    zmq.CONNECT_TIMEOUT: 2000,
    zmq.HEARTBEAT_IVL: 1000,
    zmq.HEARTBEAT_TIMEOUT: 3000,
    zmq.SNDHWM: 100_000,
    zmq.RCVHWM: 100_000,
}


class ClientError(RuntimeError):
    """A call that did not get an ok outcome; ``code`` is an ErrorCode value."""

    def __init__(self, code: int, detail: str, rank: int | None = None) -> None:
        where = f"rank {rank}: " if rank is not None else ""
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"code {code}"
        super().__init__(f"{where}{name}: {detail}")
        self.code, self.detail, self.rank = code, detail, rank


_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def make_dealer(ctx: zmq.Context[Any], endpoint: str, curve: CurveClientKeys | None = None) -> zmq.Socket[Any]:
    """A DEALER connected to ``endpoint``; ``curve`` (security.load_client_keys) for a daemon
    that serves tcp with CURVE."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    for option, value in SOCKET_OPTIONS.items():
        sock.setsockopt(option, value)
    if needs_ipv6(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        curve.apply(sock)
    sock.connect(endpoint)
    return sock


class Link:
    """Commands to one daemon over a DEALER; ``index`` is the position in the client's list."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, index: int = 0, curve: CurveClientKeys | None = None
    ) -> None:
        self.endpoint = endpoint
        self.index = index
        self.sock = make_dealer(ctx, endpoint, curve)
        self.boot_id: str | None = None
        self.rank: int | None = None
        self.info: dict[str, Any] = {}
        self.outbox: list[tuple[MsgType, dict[str, Any]]] = []  # queued for one BATCH envelope
        # When the DEALER was first used (a send) since its replies were last looked for:
        # a send may take in libzmq's news of a waiting reply without the fd showing it.
        self.unchecked_since: float | None = None
        # Connection events: a daemon that dies is noticed at once, not at a timeout; and with
        # CURVE, a refused key (which looks like silence) is explained.
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILURES
        self.monitor: zmq.Socket[Any] = self.sock.get_monitor_socket(events)
        self._handshake_failures: list[int] = []

    @property
    def batches(self) -> bool:
        """Whether the daemon said (in its hello reply) that it takes BATCH envelopes."""
        return bool(self.info.get("batch"))

    def send(self, cmd: Command) -> None:
        self._send(encode_command(cmd))

    def send_body(self, op: MsgType, body: dict[str, Any]) -> None:
        self._send(encode_body(op, body))

    def flush(self) -> list[tuple[MsgType, dict[str, Any]]]:
        """Sends the outbox: one BATCH per MAX_BATCH commands (plain messages to a daemon
        that takes no batches). Returns what could not be sent."""
        items, self.outbox = self.outbox, []
        if self.batches and len(items) > 1:
            step = Limits.MAX_BATCH
            messages = [(start, encode_batch(items[start : start + step])) for start in range(0, len(items), step)]
        else:
            messages = [(i, encode_body(op, body)) for i, (op, body) in enumerate(items)]
        for start, frames in messages:
            try:
                self._send(frames)
            except ClientError:
                return items[start:]
        return []

    def _send(self, frames: list[bytes]) -> None:
        if self.unchecked_since is None:
            self.unchecked_since = time.monotonic()
        try:
            send_frames(self.sock, frames)
        except zmq.ZMQError as exc:
            # A refused CURVE handshake ends the connection: sends fail then, say why.
            raise ClientError(
                ErrorCode.SEND_FAILED, f"send to {self.endpoint} failed: {exc}{self.handshake_failure()}"
            ) from None

    def recv_nowait(self) -> Outcome | None:
        """One decoded reply, or None when nothing is waiting. Garbage is logged and skipped."""
        while True:
            try:
                frames = recv_frames(self.sock)
            except zmq.Again:
                return None
            try:
                return decode_outcome(frames)[1]
            except ProtocolError as exc:
                log.warning("undecodable reply from %s: %s", self.endpoint, exc)

    def call(self, cmd: Command, timeout_s: float, on_other: Callable[[Outcome], None] | None = None) -> Outcome:
        """Sends and waits for the reply to ``cmd``; other replies go to ``on_other``."""
        self.unchecked_since = 0.0  # its polls take in libzmq's news: look for replies at the next poll()
        self.send(cmd)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise ClientError(
                    ErrorCode.CLIENT_TIMEOUT,
                    f"no reply to {cmd.TYPE.name} from {self.endpoint} in {timeout_s}s{self.handshake_failure()}",
                )
            outcome = self.recv_nowait()
            if outcome is None:
                continue
            if outcome.req_id == cmd.req_id and outcome.op in (cmd.TYPE, 0):
                return outcome
            if on_other is not None:
                on_other(outcome)

    def remember_hello(self, outcome: Outcome) -> None:
        self.boot_id, self.rank, self.info = outcome.boot_id, outcome.rank, outcome.result

    def connection_events(self) -> list[int]:
        """zmq.EVENT_CONNECTED / EVENT_DISCONNECTED seen since the last call, in order
        (handshake failures are kept aside for ``handshake_failure``)."""
        events: list[int] = []
        while readable(self.monitor):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = int.from_bytes(frames[0][:2], "little")
            if event & _HANDSHAKE_FAILURES:
                self._handshake_failures.append(event)
            else:
                events.append(event)
        return events

    def handshake_failure(self) -> str:
        """'' or why the daemon refused our CURVE handshake (e.g. our key is not allowed)."""
        if self.monitor.poll(100):  # the monitor's news may trail the failure by a moment
            self.connection_events()
        return handshake_failure_text(self._handshake_failures[-1] if self._handshake_failures else 0)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def handshake_failure_text(event: int) -> str:
    """'' or why the daemon refused our CURVE handshake, from a monitor event (0: none)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ": the daemon refused our CURVE key (not in its access.curve_clients)"
    if event:
        return ": the CURVE handshake failed (wrong daemon public key?)"
    return ""


def check_ok(outcome: Outcome) -> dict[str, Any]:
    if not outcome.ok:
        raise ClientError(outcome.code, outcome.detail, outcome.rank)
    return outcome.result


def op_name(op: int) -> str:
    return MsgType(op).name.lower() if op in MsgType._value2member_map_ else str(op)


def read_outcomes(sock: zmq.Socket[Any], limit: int = 1 << 16) -> list[Outcome]:
    """Everything waiting on ``sock`` (REPLY, EVENT or EVENT_BATCH), without blocking;
    undecodable messages are logged and skipped."""
    out: list[Outcome] = []
    for _ in range(limit):
        # Asking first is cheaper than the zmq.Again exception of a read from an empty socket.
        if not readable(sock):
            break
        try:
            frames = recv_frames(sock)
        except zmq.Again:
            break
        try:
            out += decode_outcomes(frames)
        except ProtocolError as exc:
            log.warning("undecodable message from a daemon: %s", exc)
    return out
