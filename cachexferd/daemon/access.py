"""The daemon's side of access control (docs/operations.md, "Access control"):

- the runtime directory and the ipc socket get modes that admit only the daemon's user and
  ``access.group`` (0700/0600, or 0750/0660 group-owned), set at every start; a directory that
  is world-writable or belongs to another user is refused, as it cannot be private;
- a tcp command socket uses CURVE when keys are configured: a ZAP handler on the daemon's
  context admits the public keys found in ``access.curve_clients`` (re-read when it changes);
- the kernel's credentials of each ipc client (SO_PEERCRED, which libzmq reports as the
  ``Peer-Address`` of its messages) are kept per ROUTER identity, so an ATTACH can only map a
  shared-memory segment that belongs to the process asking for it.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from ..protocol import Attach, MsgType
from ..security import (
    AccessError,
    Peer,
    Requester,
    SegmentPolicy,
    curve_enabled,
    exposure_warnings,
    group_id,
    load_server_keys,
    needs_ipv6,
    parse_endpoint,
)

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)

ZAP_DOMAIN = b"cachexferd"
_MAX_PEERS = 4096  # identities remembered; an evicted one is read again from its next message
_REFRESH_TYPES = frozenset({MsgType.HELLO, MsgType.ATTACH, MsgType.BATCH})  # re-read the peer on these
_REFUSAL_LOG_S = 60.0  # a refused CURVE key is logged at most this often (clients retry every second)
AttachHandler = Callable[[bytes, Attach], Any]
AttachWithRequester = Callable[[bytes, Attach, Requester], Any]


class AccessControl:
    def __init__(self, config: Config, ctx: zmq.Context[Any]) -> None:
        self.config = config
        self.ctx = ctx
        self.gid = group_id(config.access.group) if config.access.group else None
        self.endpoint = parse_endpoint(config.endpoint)
        self.peers = PeerTable(enabled=self.endpoint.scheme == "ipc")
        self._auth: Any = None  # zmq.auth.thread.ThreadAuthenticator while CURVE serves

    # Files ------------------------------------------------------------------------------

    def prepare_runtime_dir(self, runtime: Path) -> None:
        """Creates the runtime directory, or checks an existing one, and sets its mode."""
        mode = 0o750 if self.gid is not None else 0o700
        runtime.mkdir(parents=True, exist_ok=True, mode=mode)
        st = runtime.stat()
        if st.st_mode & stat.S_IWOTH:
            raise AccessError(f"runtime dir {runtime} is writable by all users; give the daemon a directory of its own")
        if st.st_uid not in (os.geteuid(), 0):
            raise AccessError(f"runtime dir {runtime} belongs to uid {st.st_uid}, not to this daemon's user")
        self._set_mode(runtime, mode)

    def secure_socket(self) -> None:
        """After the bind: the ipc socket file admits the daemon's user (and its group)."""
        if self.endpoint.scheme == "ipc" and not self.endpoint.abstract:
            self._set_mode(Path(self.endpoint.address), 0o660 if self.gid is not None else 0o600)

    def _set_mode(self, path: Path, mode: int) -> None:
        try:
            if self.gid is not None:
                os.chown(path, -1, self.gid)
            os.chmod(path, mode)
        except OSError as exc:
            group = f" to group {self.config.access.group}" if self.gid is not None else ""
            raise AccessError(f"cannot give {path} mode {mode:o}{group}: {exc.strerror}") from None

    # Sockets ----------------------------------------------------------------------------

    def configure_router(self, router: zmq.Socket[Any]) -> None:
        """Before the bind: IPv6 for IPv6 literals, CURVE (with its ZAP handler) for tcp."""
        if needs_ipv6(self.config.endpoint):
            router.setsockopt(zmq.IPV6, 1)
        if self.endpoint.scheme != "tcp" or not curve_enabled(self.config.access):
            return
        public, secret = load_server_keys(self.config.access.curve_secret_key)
        self._start_authenticator()
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit
        router.curve_server = True
        router.curve_publickey = public
        router.curve_secretkey = secret

    def _start_authenticator(self) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        keys = ClientKeys(Path(self.config.access.curve_clients))
        if not keys.count():
            log.warning("no client keys in %s: every CURVE client will be refused", keys.directory)
        self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), keys)

    def log_warnings(self) -> None:
        for warning in exposure_warnings(self.config):
            log.warning("%s", warning)

    def close(self) -> None:
        """Stops the ZAP handler; before the context is terminated (it holds a socket)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # Attach -----------------------------------------------------------------------------

    def requester(self, identity: bytes) -> Requester:
        """The daemon's view of the client behind ``identity``: its kernel credentials (ipc)
        and the segments it may have the daemon map."""
        peer = self.peers.get(identity)
        return Requester(peer, SegmentPolicy(peer, os.geteuid(), self.gid))

    def guard_attach(self, handler: AttachWithRequester) -> AttachHandler:
        """The ATTACH handler, given the asking peer as an argument beside the command: the
        command itself (its ``device`` map above all) reaches the backend as the client sent it."""

        def attach(identity: bytes, cmd: Attach) -> Any:
            return handler(identity, cmd, self.requester(identity))

        return attach


class PeerTable:
    """Kernel credentials per ROUTER identity. Read from the first frame of a message (its
    metadata), for identities not seen yet and on HELLO, ATTACH and BATCH messages, so a
    reconnect under the same identity is seen before it can attach."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # only ipc connections carry credentials
        self._peers: OrderedDict[bytes, Peer | None] = OrderedDict()

    def note(self, first: zmq.Frame, header: bytes) -> bytes:
        """The identity of a message whose first frame is ``first``; records its peer."""
        identity = first.bytes
        if self.enabled and (
            identity not in self._peers or (len(header) == 4 and header[3] in _REFRESH_TYPES)
        ):  # fmt: skip
            self._peers[identity] = _peer_of(first)
            self._peers.move_to_end(identity)
            if len(self._peers) > _MAX_PEERS:
                self._peers.popitem(last=False)
        return identity

    def get(self, identity: bytes) -> Peer | None:
        return self._peers.get(identity)


def _peer_of(frame: zmq.Frame) -> Peer | None:
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    return Peer.from_address(address) if isinstance(address, str) else None


class ClientKeys:
    """The CURVE public keys allowed to connect: ``*.key`` files in one directory (the format
    ``cachexferd keys generate`` writes), re-read whenever the directory changes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stamp: tuple[int, int] | None = None
        self._keys: set[bytes] = set()
        self._logged: dict[bytes, float] = {}

    def count(self) -> int:
        self._reload()
        return len(self._keys)

    def _reload(self) -> None:
        import zmq.auth

        try:
            st = self.directory.stat()
            stamp = (st.st_mtime_ns, st.st_ino)
            if stamp != self._stamp:
                self._keys = set(zmq.auth.load_certificates(self.directory))
                self._stamp = stamp
        except (OSError, ValueError) as exc:
            log.warning("cannot read CURVE client keys in %s: %s", self.directory, exc)
            self._keys, self._stamp = set(), None

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question: may the client with this z85 public key connect?"""
        self._reload()
        if key in self._keys:
            return True
        now = time.monotonic()
        if now - self._logged.get(key, -_REFUSAL_LOG_S) >= _REFUSAL_LOG_S:
            if len(self._logged) >= _MAX_PEERS:  # a client cycling keys must not grow this
                self._logged.clear()
            self._logged[key] = now
            log.warning("refused a CURVE client: key %s is not in %s", key.decode(errors="replace"), self.directory)
        return False
