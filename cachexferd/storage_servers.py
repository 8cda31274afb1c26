"""Local storage servers for tests, ``cachexferd demo`` and ``cachexferd bench storage``:
Redis/Valkey, and a Mooncake master plus one storage node.

Each server runs as a subprocess on free loopback ports with its own log file, and is
stopped by its PID (SIGTERM, then SIGKILL). Binaries are looked up in this order: an
environment override, PATH, the directory of the running Python (a virtualenv's bin/), and
the installed ``mooncake`` package::

    CXTEST_REDIS_SERVER     redis-server or valkey-server (Debian: apt install redis-server)
    CXTEST_MOONCAKE_MASTER  mooncake_master  (pip install 'cachexferd[mooncake]')
    CXTEST_MOONCAKE_CLIENT  mooncake_client  (the storage node, same wheel)

(Not ``CACHEXFERD_*``: every variable with that prefix is a daemon setting.)

A missing binary raises ServerUnavailable with what to install.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from .launch import ManagedProcess as ServerProcess

LOOPBACK = "127.0.0.1"
MOONCAKE_HINT = "pip install 'cachexferd[mooncake]' (mooncake-transfer-engine-non-cuda; apt install libibverbs1)"


class ServerUnavailable(RuntimeError):
    """A server binary or library is not installed here."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = LOOPBACK) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


def find_binary(names: Sequence[str], env_var: str) -> str | None:
    override = os.environ.get(env_var)
    if override:
        return override if os.access(override, os.X_OK) else None
    dirs = [Path(sys.executable).parent]
    with contextlib.suppress(ImportError):
        import mooncake

        dirs.append(Path(mooncake.__file__).parent)
    for name in names:
        found = shutil.which(name) or next((str(d / name) for d in dirs if os.access(d / name, os.X_OK)), None)
        if found:
            return found
    return None


def require_binary(names: Sequence[str], env_var: str, hint: str) -> str:
    path = find_binary(names, env_var)
    if path is None:
        raise ServerUnavailable(f"{' or '.join(names)} not found (set {env_var}, or {hint})")
    return path


def redis_binary() -> str:
    """The Redis/Valkey server binary (ServerUnavailable with what to install)."""
    return require_binary(("redis-server", "valkey-server"), "CXTEST_REDIS_SERVER", "apt install redis-server")


def mooncake_binaries() -> tuple[str, str]:
    """mooncake_master and mooncake_client, once the store binding imports (else ServerUnavailable)."""
    try:
        import mooncake.store  # noqa: F401 - the daemon side needs the binding too
    except ImportError as exc:
        raise ServerUnavailable(f"mooncake store binding not importable ({exc}); {MOONCAKE_HINT}") from None
    return (
        require_binary(("mooncake_master",), "CXTEST_MOONCAKE_MASTER", MOONCAKE_HINT),
        require_binary(("mooncake_client",), "CXTEST_MOONCAKE_CLIENT", MOONCAKE_HINT),
    )


class RedisServer:
    """redis-server or valkey-server on a free loopback port: no persistence, LRU eviction."""

    def __init__(self, workdir: Path, maxmemory: str = "1gb", settings: Sequence[str] = ()) -> None:
        """``settings``: more ``--name value`` arguments for the server."""
        self.binary = redis_binary()
        self.workdir, self.port = workdir, free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.binary, "--port", str(self.port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
            "--dir", str(workdir), "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru",
            "--protected-mode", "yes", "--daemonize", "no", *settings,
        ]  # fmt: skip
        self.server = ServerProcess("redis-server", argv, workdir / "redis.log", lambda: port_open(self.port))

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self) -> RedisServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


class MooncakeCluster:
    """mooncake_master plus one storage node (``mooncake_client``) contributing ``segment``.

    ``lease_ms`` is the master's read lease (objects just read cannot be evicted for that
    long); ``client_ttl_s`` how soon the master forgets a dead storage node.
    """

    def __init__(self, workdir: Path, segment: str = "256MB", lease_ms: int = 2000, client_ttl_s: int = 4) -> None:
        master_bin, node_bin = mooncake_binaries()
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.master_port, self.node_port = free_port(), free_port()
        env = {"MC_TCP_BIND_ADDRESS": LOOPBACK}
        master_argv = [
            master_bin, f"--rpc_port={self.master_port}", f"--rpc_address={LOOPBACK}",
            f"--metrics_port={free_port()}", f"--metrics_host={LOOPBACK}", f"--default_kv_lease_ttl={lease_ms}",
            f"--client_ttl={client_ttl_s}", "--logtostderr",
        ]  # fmt: skip
        node_argv = [
            node_bin, f"--master_server_address={self.master}", "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp", f"--host={LOOPBACK}", f"--port={self.node_port}",
            f"--global_segment_size={segment}", "--logtostderr",
        ]  # fmt: skip
        self.master_proc = ServerProcess(
            "mooncake_master", master_argv, workdir / "master.log", lambda: port_open(self.master_port), env
        )
        self.node = ServerProcess(
            "mooncake_client", node_argv, workdir / "node.log", lambda: port_open(self.node_port), env
        )

    @property
    def master(self) -> str:
        return f"{LOOPBACK}:{self.master_port}"

    def start(self) -> MooncakeCluster:
        self.master_proc.start()
        try:
            self.node.start()
        except BaseException:
            self.master_proc.stop()  # never leave a master behind
            raise
        return self

    def stop(self) -> None:
        self.node.stop()
        self.master_proc.stop()
