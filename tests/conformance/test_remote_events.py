"""§1 and §7.1: event endpoints, local in plaintext or (1.2) on any tcp address with CURVE.

A daemon that serves tcp with CURVE keys takes a hello whose ``events`` is a tcp endpoint
and whose ``events_key`` is the Z85 public key of the client's event socket (a CURVE server):
its PUSH connects as a CURVE client with the daemon's own key pair. The client's ZAP handler
sees that key and may refuse every other one. Without ``events_key`` the 1.1 rules stand.
Written from docs/protocol.md with raw pyzmq; keys made with ``zmq.auth``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from .conftest import ClientFactory
from .daemons import DaemonProc
from .spec import MAJOR, E, T
from .wire import check_event_batch, check_outcome, header, pack

pytestmark = pytest.mark.conformance
ZAP = "inproc://zeromq.zap.01"  # RFC 27


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Keys:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        (directory / "clients").mkdir(parents=True)
        for name in ("daemon", "client"):
            _, secret = zmq.auth.create_certificates(directory, name)
            os.chmod(secret, 0o600)
        os.rename(directory / "client.key", directory / "clients" / "client.key")
        self.daemon_public, _ = zmq.auth.load_certificate(directory / "daemon.key_secret")
        self.public, self.secret = zmq.auth.load_certificate(directory / "client.key_secret")


@pytest.fixture(scope="module")
def curve_daemon(scratch: Path) -> Iterator[tuple[DaemonProc, Keys]]:
    keys = Keys(scratch / "curve-keys")
    port = free_port()
    args = ["--endpoint", f"tcp://127.0.0.1:{port}", "--storage", "none",
            "--set", f"access.curve_secret_key={keys.directory / 'daemon.key_secret'}",
            "--set", f"access.curve_clients={keys.directory / 'clients'}"]  # fmt: skip
    proc = DaemonProc("curve", scratch, args)
    proc.endpoint = f"tcp://127.0.0.1:{port}"
    try:
        yield proc, keys
    finally:
        proc.stop()


class CurveClient:
    """A DEALER with CURVE keys, a PULL bound as a CURVE server, and a ZAP handler that
    records which public key connects to the PULL (and admits only ``allow``)."""

    def __init__(self, daemon: DaemonProc, keys: Keys, events_host: str = "127.0.0.2") -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.zap = self.ctx.socket(zmq.REP)
        self.zap.bind(ZAP)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.curve_serverkey = keys.daemon_public
        self.dealer.curve_publickey, self.dealer.curve_secretkey = keys.public, keys.secret
        self.dealer.connect(daemon.endpoint)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.curve_server = True
        self.pull.curve_publickey, self.pull.curve_secretkey = keys.public, keys.secret
        self.pull.zap_domain = b"conformance-events"
        self.pull.bind(f"tcp://{events_host}:0")
        self.events = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.events_key = keys.public.decode()
        self.allow = {keys.daemon_public}
        self.seen_keys: list[bytes] = []
        for sock in (self.dealer, self.pull, self.zap):
            sock.setsockopt(zmq.LINGER, 0)

    def call(self, msg_type: int, timeout_s: float = 60.0, **body: Any) -> Any:
        """A synchronous command's REPLY (retried until the daemon has started)."""
        self.dealer.send_multipart([header(msg_type, MAJOR), pack(body)])
        if not self.dealer.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply to {T(msg_type).name} within {timeout_s}s")
        return check_outcome("reply", self.dealer.recv_multipart())

    def events_for(self, req_id: int, timeout_s: float = 15.0) -> list[Any]:
        """Serves ZAP requests while waiting for the outcome of ``req_id`` on the PULL."""
        poller = zmq.Poller()
        poller.register(self.zap, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                if sock is self.zap:
                    self._answer_zap()
                    continue
                frames = self.pull.recv_multipart()
                outcomes = check_event_batch(frames) if frames[0] == header(T.EVENT_BATCH) else [
                    check_outcome("event", frames)]  # fmt: skip
                if any(o.req_id == req_id for o in outcomes):
                    return outcomes
        return []

    def _answer_zap(self) -> None:
        version, request_id, domain, _address, _identity, mechanism, *credentials = self.zap.recv_multipart()
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" else b""
        self.seen_keys.append(key)
        ok = version == b"1.0" and domain == b"conformance-events" and key in self.allow
        self.zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400", b"", b"", b""])

    def close(self) -> None:
        self.ctx.destroy(0)


def started(daemon: DaemonProc, keys: Keys) -> CurveClient:
    """A client of the CURVE daemon, once the daemon answers (it imports torch first)."""
    client = CurveClient(daemon, keys)
    try:
        assert client.call(T.PING, timeout_s=90, req_id=1).ok  # queued until the daemon listens
    except AssertionError:
        client.close()
        raise AssertionError(f"the CURVE daemon did not answer:\n{daemon.log()}") from None
    return client


def test_events_to_a_curve_event_socket(curve_daemon: tuple[DaemonProc, Keys]) -> None:
    daemon, keys = curve_daemon
    client = started(daemon, keys)
    try:
        hello = client.call(T.HELLO, req_id=2, protocol=[1, 2], events=client.events, events_key=client.events_key)
        assert hello.ok and hello.result["protocol"][:2] >= [1, 2], hello
        client.dealer.send_multipart([header(T.CLEAR_HOST), pack({"req_id": 3})])
        outcomes = client.events_for(3)
        assert [o.req_id for o in outcomes] == [3], outcomes  # NOT_ATTACHED or OK: an EVENT either way
        assert client.seen_keys and set(client.seen_keys) == {keys.daemon_public}  # the daemon's own key
    finally:
        client.close()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"events": "tcp://192.0.2.1:5555"}, "events_key"),  # off loopback without a key: as in 1.1
        ({"events": "ipc:///tmp/x.sock", "events_key": "x" * 40}, "tcp"),  # CURVE events need tcp
        ({"events": "tcp://127.0.0.2:5555", "events_key": "short"}, "Z85"),
        ({"events": "tcp://127.0.0.2:5555", "events_key": "~" * 40}, "Z85"),
    ],
    ids=["no-key-off-loopback", "key-with-ipc", "key-too-short", "key-not-z85"],
)
def test_bad_event_endpoints_and_keys(
    curve_daemon: tuple[DaemonProc, Keys], fields: dict[str, Any], needle: str
) -> None:
    daemon, keys = curve_daemon
    client = started(daemon, keys)
    try:
        reply = client.call(T.HELLO, req_id=5, protocol=[1, 2], **fields)
        assert reply.code == E.BAD_FIELD and needle in reply.body["detail"], reply
    finally:
        client.close()


def test_events_key_to_a_daemon_without_curve_keys(main: DaemonProc, connect: ClientFactory) -> None:
    """A daemon without CURVE keys cannot connect to a CURVE event socket: BAD_FIELD."""
    client = connect(main, hello=False, events=False)
    key = zmq.curve_keypair()[0].decode()
    reply = client.call(T.HELLO, protocol=[1, 2], events="tcp://127.0.0.2:5555", events_key=key)
    assert reply.code == E.BAD_FIELD and "CURVE" in reply.body["detail"], reply


@pytest.mark.parametrize(
    "events", ["tcp://0.0.0.0:5555", "tcp://[::]:5555", "tcp://*:5555", "tcp://192.0.2.1:0"],
    ids=["ipv4-wildcard", "ipv6-wildcard", "star", "port-0"],
)  # fmt: skip
def test_event_endpoints_the_daemon_cannot_connect_to_are_refused(
    curve_daemon: tuple[DaemonProc, Keys], events: str
) -> None:
    """§1, §1.1: the daemon connects to the events endpoint, so it must name the event socket's
    host and bound port; a wildcard address or port 0 is BAD_FIELD, with a key too, and the
    hello changes nothing (a later CURVE hello still works)."""
    daemon, keys = curve_daemon
    client = started(daemon, keys)
    try:
        reply = client.call(T.HELLO, req_id=5, protocol=[1, 2], events=events, events_key=client.events_key)
        assert reply.code == E.BAD_FIELD and "connect to" in reply.body["detail"], reply
        hello = client.call(T.HELLO, req_id=6, protocol=[1, 2], events=client.events, events_key=client.events_key)
        assert hello.ok, hello
    finally:
        client.close()
