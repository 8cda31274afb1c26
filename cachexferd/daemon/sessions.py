"""Clients known to the daemon and the PUSH sockets that carry their events.

A session is keyed by the ROUTER identity of the client's DEALER. Sessions that name the
same event endpoint share one PUSH socket (an engine's one PULL socket can serve many
DEALERs). Sends never block the loop: a full queue drops the event and counts it.

Event endpoints are local (ipc, or tcp on loopback) in plaintext, or (protocol 1.2) any tcp
address with CURVE: the client names its event socket's public key (``events_key``) and the
daemon's PUSH connects as a CURVE client with the daemon's own key pair, so an engine on
another machine receives its events encrypted and knows they come from that daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from ..protocol import ErrorCode, ProtocolError
from ..security import AccessError, needs_ipv6, parse_endpoint
from ..zmqio import send_frames
from .pidwatch import PidWatch

log = logging.getLogger(__name__)

MAX_SESSIONS = 256
ENGINE_EVENTS_PREFIX = "cachexferd-engine-"  # the engine client's private event-socket directories
_EVENT_ENDPOINT = re.compile(r"^(ipc://.+|tcp://(127\.\d+\.\d+\.\d+|localhost|\[::1\]):\d+)$")
_Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85
_EVENT_HWM = 100_000
_EVENT_LINGER_MS = 2000  # flush window at shutdown


@dataclass(eq=False)
class Session:
    identity: bytes
    client: str = ""
    role: str = "engine"
    events: str | None = None
    pid: int | None = None
    batch_events: bool = False  # deliver events in EVENT_BATCH messages (protocol 1.1)
    inflight: int = 0  # commands accepted from this client and still without an outcome


class EventSinks:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        allow_abstract: bool = False,
        curve: tuple[bytes, bytes] | None = None,
    ) -> None:
        self._ctx = ctx
        self._allow_abstract = allow_abstract  # access.abstract_ipc
        self._curve = curve  # the daemon's (public, secret) Z85 keys: events to CURVE event sockets
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self._keys: dict[str, str | None] = {}  # endpoint -> the events_key its socket was made for
        # Endpoints no session names any more, kept until the next flush of outcomes: events
        # decided (or batched) before a client's new hello still go where it asked then.
        self._retiring: dict[str, zmq.Socket[bytes]] = {}

    def open(self, endpoint: str, key: str | None = None) -> None:
        """Makes sure a PUSH socket is connected to ``endpoint`` (ProtocolError BAD_FIELD when
        the endpoint or key is not acceptable); ``key``: the event socket's CURVE public key."""
        self._check(endpoint, key)
        if endpoint in self._sockets and self._keys.get(endpoint) == key:
            return
        if endpoint in self._retiring and self._keys.get(endpoint) == key:
            self._sockets[endpoint] = self._retiring.pop(endpoint)
            return
        old = self._sockets.pop(endpoint, None) or self._retiring.pop(endpoint, None)
        if old is not None:  # the same address, another key: a new engine there
            old.close(0)
        self._sockets[endpoint] = self._connect(endpoint, key)
        self._keys[endpoint] = key

    def _check(self, endpoint: str, key: str | None) -> None:
        if key is not None:
            self._check_curve(endpoint, key)
        elif not _EVENT_ENDPOINT.match(endpoint):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"events endpoint {endpoint!r} must be ipc://PATH or tcp://LOOPBACK:PORT; tcp on another address "
                "needs events_key (a CURVE event socket)",
            )
        if endpoint.startswith("ipc://@") and not self._allow_abstract:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"events endpoint {endpoint!r} is an abstract-namespace socket, which any local user could bind "
                "first; use a path (or the daemon must set access.abstract_ipc = true)",
            )

    def _check_curve(self, endpoint: str, key: str) -> None:
        if self._curve is None:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                "events_key: this daemon has no CURVE keys (access.curve_secret_key), so it cannot connect to a CURVE "
                "event socket",
            )
        try:
            parsed = parse_endpoint(endpoint)
        except AccessError:
            parsed = None
        if parsed is None or parsed.scheme != "tcp":
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"events_key needs a tcp://HOST:PORT events endpoint, not {endpoint!r}"
            )
        if parsed.wildcard or not parsed.port:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"events endpoint {endpoint!r} names no address the daemon can connect to (a wildcard address or "
                "port 0): name the address of the event socket's host as the daemon reaches it, and the port it bound",
            )
        if len(key) != _Z85_KEY_LEN or not _decodes_as_z85(key):
            raise ProtocolError(ErrorCode.BAD_FIELD, "events_key must be a CURVE public key in Z85 (40 characters)")

    def _connect(self, endpoint: str, key: str | None) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.PUSH)
        if needs_ipv6(endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SNDHWM, _EVENT_HWM)
        sock.setsockopt(zmq.LINGER, _EVENT_LINGER_MS)
        if key is not None and self._curve is not None:
            sock.curve_serverkey = key.encode()
            sock.curve_publickey, sock.curve_secretkey = self._curve
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ProtocolError(ErrorCode.BAD_FIELD, f"cannot connect events endpoint {endpoint!r}: {exc}") from None
        return sock

    def send(self, endpoint: str, frames: list[bytes]) -> bool:
        sock = self._sockets.get(endpoint) or self._retiring.get(endpoint)
        if sock is None:
            return False
        try:
            send_frames(sock, frames)
            return True
        except zmq.ZMQError as exc:
            log.warning("event to %s dropped: %s", endpoint, exc)
            return False

    def retain_only(self, endpoints: set[str]) -> None:
        """Retires the sockets of endpoints not in ``endpoints`` (closed by close_retired)."""
        for endpoint in list(self._sockets):
            if endpoint not in endpoints:
                self._retiring[endpoint] = self._sockets.pop(endpoint)

    def close_retired(self) -> None:
        """Closes retired sockets once the outcomes decided before are sent; the linger lets
        ZeroMQ deliver what is still queued in them."""
        for endpoint, sock in self._retiring.items():
            sock.close(_EVENT_LINGER_MS)
            if endpoint not in self._sockets:
                self._keys.pop(endpoint, None)
        self._retiring.clear()

    def close(self) -> None:
        self.close_retired()
        for sock in self._sockets.values():
            sock.close(_EVENT_LINGER_MS)
        self._sockets.clear()


class Sessions:
    """Engines that say hello with their pid are watched: when that process exits, its
    sessions are forgotten, its event socket closed, and the private directory the Python
    client made for its event socket removed (a killed engine never removes it)."""

    def __init__(self, sinks: EventSinks) -> None:
        self.sinks = sinks
        self._by_identity: OrderedDict[bytes, Session] = OrderedDict()
        self._watches: dict[int, PidWatch] = {}
        self.reclaimed = 0  # sessions of engines that exited

    def get(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def hello(
        self,
        identity: bytes,
        client: str,
        role: str,
        events: str | None,
        pid: int | None,
        batch_events: bool = False,
        events_key: str | None = None,
    ) -> Session:
        if events is not None:
            self.sinks.open(events, events_key)
        session = self._by_identity.pop(identity, None) or Session(identity)
        session.client, session.role, session.events, session.pid = client, role, events, pid
        session.batch_events = batch_events
        self._by_identity[identity] = session
        self._evict()
        # A pid names a process of this machine only when the engine is here: its events
        # come to a local socket. An engine elsewhere (tcp events off loopback) has a pid of
        # its own machine, which must not be watched here.
        local = events is None or _EVENT_ENDPOINT.match(events) is not None
        if pid is not None and role == "engine" and local and pid not in self._watches and pid != os.getpid():
            self._watches[pid] = PidWatch(pid, lambda: self._engine_exited(pid))
        return session

    def _engine_exited(self, pid: int) -> None:
        self._watches.pop(pid, None)
        gone = [s for s in self._by_identity.values() if s.pid == pid]
        for session in gone:
            del self._by_identity[session.identity]
        self.sinks.retain_only({s.events for s in self._by_identity.values() if s.events})
        for endpoint in {s.events for s in gone if s.events}:
            _remove_private_events_dir(endpoint)
        self.reclaimed += len(gone)
        log.info("engine pid %d exited: %d session(s) reclaimed", pid, len(gone))

    def close(self) -> None:
        for watch in self._watches.values():
            watch.stop()
        self._watches.clear()

    def _evict(self) -> None:
        """Forgets the oldest idle sessions beyond MAX_SESSIONS (clients that reconnected)."""
        while len(self._by_identity) > MAX_SESSIONS:
            idle = next((s for s in self._by_identity.values() if not s.inflight), None)
            if idle is None:
                break
            del self._by_identity[idle.identity]
        self.sinks.retain_only({s.events for s in self._by_identity.values() if s.events})

    def __len__(self) -> int:
        return len(self._by_identity)


def _decodes_as_z85(key: str) -> bool:
    try:
        return len(z85.decode(key.encode("ascii"))) == 32
    except (ValueError, KeyError, UnicodeEncodeError, struct.error):  # not in the alphabet, or out of range
        return False


def _remove_private_events_dir(endpoint: str) -> None:
    """Removes ``<tmp>/cachexferd-engine-*/events.sock`` and its directory, the layout the
    Python engine client uses for its default event socket; anything else is left alone."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://") :])
    if not path.parent.name.startswith(ENGINE_EVENTS_PREFIX) or path.name != "events.sock":
        return
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
        path.parent.rmdir()  # only if empty
