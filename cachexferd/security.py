"""Access rules shared by the configuration, the daemon and the clients: which endpoints a
daemon may serve on, CURVE key files, the access group, and whose shared-memory segments the
daemon may map. Imports neither torch nor the daemon.

The model (docs/operations.md, "Access control"): whoever can send commands to a daemon
controls what it copies, so the command socket is reachable only by the daemon's user and
the members of ``access.group``: an ipc socket in a private runtime directory, or tcp with
CURVE keys (plaintext tcp only on loopback, or off it with an explicit ``insecure_tcp``).
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

if TYPE_CHECKING:
    from .config import AccessConfig, Config

_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]+):(\d+)$")


class AccessError(ValueError):
    """A setting, key file or endpoint that the access rules refuse; the message says why."""


# Endpoints -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    scheme: str  # "ipc" or "tcp"
    address: str  # ipc: the path (or "@name" for the abstract namespace); tcp: the host, unbracketed
    port: int = 0

    @property
    def abstract(self) -> bool:
        return self.scheme == "ipc" and self.address.startswith("@")

    @property
    def wildcard(self) -> bool:
        """A tcp bind-all address (``*``, ``0.0.0.0``, ``::``): a socket binds there, nothing connects to it."""
        return self._tcp_host_is("*", "is_unspecified")

    @property
    def loopback(self) -> bool:
        return self._tcp_host_is("localhost", "is_loopback")

    def _tcp_host_is(self, name: str, ip_property: str) -> bool:
        """A tcp endpoint whose host is ``name``, or an IP address with ``ip_property`` true."""
        if self.scheme != "tcp":
            return False
        if self.address == name:
            return True
        try:
            return bool(getattr(ipaddress.ip_address(self.address), ip_property))
        except ValueError:  # a host name
            return False


def parse_endpoint(endpoint: str) -> Endpoint:
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return Endpoint("ipc", endpoint[len("ipc://") :])
    match = _TCP.match(endpoint)
    if match:
        return Endpoint("tcp", match.group(1).strip("[]"), int(match.group(2)))
    raise AccessError(f"{endpoint!r} must be ipc://PATH or tcp://HOST:PORT")


def needs_ipv6(endpoint: str) -> bool:
    """ZeroMQ resolves tcp hosts as IPv4 unless ZMQ_IPV6 is set: an IPv6 literal needs it.
    (Only literals: with it set, 'localhost' may resolve to ::1 on one side and 127.0.0.1 on
    the other.)"""
    return endpoint.startswith("tcp://[")


def check_command_endpoint(config: Config) -> Endpoint:
    """The rules for ``daemon.endpoint``: an ipc socket directly in the runtime directory (a
    path, not the abstract namespace, unless allowed); tcp on loopback, or elsewhere only with
    CURVE keys or ``access.insecure_tcp``."""
    endpoint, access = config.endpoint, config.access
    try:
        parsed = parse_endpoint(endpoint)
    except AccessError as exc:
        raise AccessError(f"daemon.endpoint {exc}") from None
    if parsed.abstract and not access.abstract_ipc:
        raise AccessError(
            f"daemon.endpoint {endpoint!r} is an abstract-namespace socket: it has no file permissions, so every "
            "local user could connect; use a path in daemon.runtime_dir, or set access.abstract_ipc = true"
        )
    if parsed.scheme == "ipc" and not parsed.abstract:
        path = Path(os.path.normpath(parsed.address))
        if not path.is_absolute() or path.parent != Path(os.path.normpath(config.runtime_dir)):
            raise AccessError(
                f"daemon.endpoint {endpoint!r}: ipc sockets must be directly in daemon.runtime_dir "
                f"({config.runtime_dir}), the directory the daemon creates with private modes"
            )
    if parsed.scheme == "tcp" and not parsed.loopback and not curve_enabled(access) and not access.insecure_tcp:
        raise AccessError(
            f"daemon.endpoint {endpoint!r} is reachable from other machines: set access.curve_secret_key and "
            "access.curve_clients (keys from `cachexferd keys generate`), or access.insecure_tcp = true for "
            "plaintext; without either, tcp is only accepted on loopback"
        )
    return parsed


def check_access(config: Config) -> None:
    """Everything in the [access] table and the command endpoint; raises AccessError."""
    access = config.access
    if access.group:
        group_id(access.group)
    if bool(access.curve_secret_key) != bool(access.curve_clients):
        raise AccessError("access.curve_secret_key and access.curve_clients must be set together")
    if curve_enabled(access):
        if not zmq.has("curve"):
            raise AccessError("CURVE is configured but this libzmq was built without it")
        load_server_keys(access.curve_secret_key)
        if not Path(access.curve_clients).is_dir():
            raise AccessError(f"access.curve_clients {access.curve_clients!r} is not a directory")
    check_command_endpoint(config)


def curve_enabled(access: AccessConfig) -> bool:
    return bool(access.curve_secret_key and access.curve_clients)


def exposure_warnings(config: Config) -> list[str]:
    """What an operator should hear at every start: ways in that bypass the access rules."""
    warnings = []
    endpoint = parse_endpoint(config.endpoint)
    if endpoint.scheme == "tcp" and not curve_enabled(config.access):
        reach = "every local user" if endpoint.loopback else "anyone who can reach the port"
        warnings.append(f"plaintext tcp on {config.endpoint}: {reach} can command this daemon (use ipc or CURVE)")
    if endpoint.abstract:
        warnings.append(f"abstract ipc socket {config.endpoint}: every local user can command this daemon")
    if config.metrics.enabled and not is_loopback_host(config.metrics.host):
        warnings.append(f"metrics.host {config.metrics.host!r} is not loopback: metrics are served to other machines")
    return warnings


def is_loopback_host(host: str) -> bool:
    return Endpoint("tcp", host.strip("[]")).loopback


# Groups and users ----------------------------------------------------------------------


def group_id(group: str) -> int:
    """The gid of a group name or number; AccessError when the name is unknown here."""
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise AccessError(f"access.group {group!r} is not a group on this machine") from None


def uid_in_group(uid: int, gid: int) -> bool:
    """Whether user ``uid`` belongs to group ``gid`` (primary or supplementary)."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    if user.pw_gid == gid:
        return True
    try:
        return user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


# Shared-memory segments ----------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """A client process as the kernel reports it (SO_PEERCRED of its ipc connection)."""

    uid: int
    gid: int
    pid: int

    @classmethod
    def from_address(cls, address: str) -> Peer | None:
        """libzmq's ``Peer-Address`` of an ipc connection ends in ``:uid:gid:pid``."""
        parts = address.rsplit(":", 3)
        if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
            return None
        return cls(int(parts[1]), int(parts[2]), int(parts[3]))


@dataclass(frozen=True)
class SegmentPolicy:
    """Whose segment the daemon may map for an attach: the daemon opens it with its own
    rights, so it must not map what the asking process could not (a root-only file, another
    tenant's cache). With a known peer (ipc) the segment's owner must be that peer's user (root
    peers may name any); otherwise the daemon's user or a member of ``access.group``."""

    peer: Peer | None = None
    daemon_uid: int = field(default_factory=os.geteuid)
    group: int | None = None

    def refusal(self, st: os.stat_result) -> str | None:
        """Why the segment with this fstat may not be mapped, or None."""
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        owner = st.st_uid
        if self.peer is not None:
            if owner == self.peer.uid or self.peer.uid == 0:
                return None
            return f"is owned by uid {owner}, not by the attaching process (uid {self.peer.uid}, pid {self.peer.pid})"
        if owner == self.daemon_uid or (self.group is not None and uid_in_group(owner, self.group)):
            return None
        return f"is owned by uid {owner}, neither this daemon's user nor a member of access.group"


@dataclass(frozen=True)
class Requester:
    """The daemon's view of the process that asks for an attach: the kernel's credentials
    of its connection (None over tcp, or where the daemon could not read them) and the
    segments it may name. It travels beside the request, from the access guard to the
    backend, and never inside the client's ``device`` map: a backend decodes that map as the
    client sent it. The default is the strictest view (an unknown peer)."""

    peer: Peer | None = None
    segments: SegmentPolicy = field(default_factory=SegmentPolicy)


# CURVE keys ----------------------------------------------------------------------------


def _read_keys(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AccessError(f"cannot read CURVE key file {path}: {exc}") from None
    return public, secret


def load_server_keys(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a daemon's secret key file; refuses a world-readable one."""
    public, secret = _read_keys(path)
    if secret is None:
        raise AccessError(f"CURVE key file {path} holds no secret key (name the .key_secret file)")
    if os.stat(path).st_mode & 0o007:
        raise AccessError(f"CURVE secret key file {path} is accessible to all users: chmod 600 (or 640) it")
    return public, secret


@dataclass(frozen=True)
class CurveClientKeys:
    """What a client needs to talk to a CURVE daemon: the daemon's public key and its own pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def load_client_keys(server_key: str | os.PathLike[str], client_key: str | os.PathLike[str]) -> CurveClientKeys:
    """From the daemon's public key file and the client's secret key file (both made by
    ``cachexferd keys generate``)."""
    server_public, _ = _read_keys(server_key)
    public, secret = _read_keys(client_key)
    if secret is None:
        raise AccessError(f"client key file {client_key} holds no secret key (name the .key_secret file)")
    return CurveClientKeys(server_public, public, secret)


KeyFile = str | os.PathLike[str]


def client_keys_or_none(server_key: KeyFile | None, client_key: KeyFile | None) -> CurveClientKeys | None:
    """For the clients' optional key-file parameters: both or neither."""
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        raise AccessError("CURVE needs both server_key (the daemon's public key file) and client_key")
    return load_client_keys(server_key, client_key)
