"""The engine's event socket: a PULL that every rank's daemon connects its PUSH to.

Local engines bind it on ipc (a private temporary directory by default) or loopback tcp, in
plaintext. An engine on another machine than its daemons (protocol 1.2) binds it on a tcp
address those daemons can reach, as a CURVE server with the engine's own key pair (the one it
uses for its commands); each daemon connects as a CURVE client with its own key pair. The
socket admits only the daemons the engine was given keys for: it answers ZeroMQ's ZAP
requests itself (``serve_handshakes``, called from the client's poll, no thread), so nobody
else can push forged outcomes into it.

Also the key plumbing shared by the sync and asyncio clients: one daemon public key for
every endpoint, or one per endpoint (multi-node deployments give each daemon its own pair).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils import z85

from ..security import AccessError, CurveClientKeys, KeyFile, load_client_keys, needs_ipv6, parse_endpoint
from ..zmqio import readable

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ (RFC 27)
ZAP_DOMAIN = b"cachexferd-events"
MIN_MINOR_FOR_CURVE_EVENTS = 2  # protocol 1.2 added HELLO's events_key


def curve_per_endpoint(
    endpoints: Sequence[str], server_key: KeyFile | Sequence[KeyFile] | None, client_key: KeyFile | None
) -> list[CurveClientKeys | None]:
    """The CURVE keys of each endpoint's link: ``server_key`` is one public key file for every
    daemon, or one per endpoint; ``client_key`` this client's secret key file."""
    if server_key is None and client_key is None:
        return [None] * len(endpoints)
    if server_key is None or client_key is None:
        raise AccessError("CURVE needs both server_key (the daemons' public key files) and client_key")
    if isinstance(server_key, (str, os.PathLike)):
        return [load_client_keys(server_key, client_key)] * len(endpoints)
    keys = list(server_key)
    if len(keys) != len(endpoints):
        raise ValueError(f"server_key names {len(keys)} key files for {len(endpoints)} endpoints")
    return [load_client_keys(key, client_key) for key in keys]


def events_on_tcp(events: str) -> bool:
    return events.startswith("tcp://")


class EventSocket:
    """The PULL socket (of ``ctx``, sync or asyncio) bound to ``events``; CURVE when
    ``curve`` is given and the endpoint is tcp. ``endpoint`` is what to name in the hello (a
    port 0 becomes the port chosen), ``key`` the events_key to send with it (or None)."""

    def __init__(self, ctx: zmq.Context[Any], events: str, curve: Sequence[CurveClientKeys | None]) -> None:
        own = next((c for c in curve if c is not None), None)
        self.key: str | None = None
        self.pull: zmq.Socket[Any] = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)  # never drop events on our side
        if needs_ipv6(events):
            self.pull.setsockopt(zmq.IPV6, 1)
        self.zap: Zap | None = None
        if own is not None and events_on_tcp(events):
            _refuse_wildcard(events)
            self.zap = Zap(ctx, {c.server_public for c in curve if c is not None})
            self.pull.zap_domain = ZAP_DOMAIN
            self.pull.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no answer from us: refuse, never admit
            self.pull.curve_server = True
            self.pull.curve_publickey, self.pull.curve_secretkey = own.public, own.secret
            self.key = own.public.decode("ascii")
        try:
            self.pull.bind(events)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = self._bound(events)

    def _bound(self, events: str) -> str:
        """tcp://HOST:0 binds a free port: name the one chosen (with the host as given)."""
        if not events_on_tcp(events) or not events.endswith(":0"):
            return events
        port = str(self.pull.getsockopt_string(zmq.LAST_ENDPOINT)).rpartition(":")[2]
        return f"{events[:-2]}:{port}"

    def serve_handshakes(self) -> None:
        if self.zap is not None:
            self.zap.serve()

    def close(self) -> None:
        self.pull.close(0)
        if self.zap is not None:
            self.zap.close()
            self.zap = None


class Zap:
    """A ZAP handler (RFC 27) on the client's context that admits CURVE clients whose public
    key is one of ``allowed``: the daemons this engine talks to. Served without a thread."""

    def __init__(self, ctx: zmq.Context[Any], allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        # The asyncio client's sockets return futures: reads and replies go through a plain
        # socket that shares the underlying one.
        self._plain: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        self._refused: set[bytes] = set()

    def serve(self) -> None:
        """Answers every waiting handshake request (each daemon connection asks once)."""
        while readable(self._plain):
            try:
                request = self._plain.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._plain.send_multipart(self._answer(request), zmq.NOBLOCK)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        version, request_id, domain, _address, _identity, mechanism, *credentials = request
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else b""
        if version == b"1.0" and domain == ZAP_DOMAIN and key in self.allowed:
            return [b"1.0", request_id, b"200", b"OK", key, b""]
        if key not in self._refused:  # once per key: a refused daemon retries every second
            self._refused.add(key)
            log.warning("event socket refused a CURVE peer with key %s: not one of the daemons' keys", key.decode())
        return [b"1.0", request_id, b"400", b"not a known daemon key", b"", b""]

    def close(self) -> None:
        self.sock.close(0)


def _refuse_wildcard(events: str) -> None:
    if parse_endpoint(events).wildcard:
        raise ValueError(
            f"events endpoint {events!r}: name the address the daemons reach this machine at, not a wildcard "
            "(they connect to it)"
        )


def check_curve_events(results: Sequence[dict[str, Any]], endpoints: Sequence[str]) -> None:
    """After the hellos: every daemon must speak 1.2 to honour events_key (a 1.1 daemon would
    ignore it and connect in plaintext, and no event would ever arrive)."""
    for endpoint, result in zip(endpoints, results):
        major, minor = result.get("protocol", [1, 0])[:2]
        if (major, minor) < (1, MIN_MINOR_FOR_CURVE_EVENTS):
            raise AccessError(
                f"the daemon at {endpoint} speaks protocol {major}.{minor}, which cannot send events to a CURVE "
                f"event socket (1.{MIN_MINOR_FOR_CURVE_EVENTS} can): upgrade it, or use a local events endpoint"
            )
