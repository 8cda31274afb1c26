"""The ``mooncake`` backend: Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

The daemon is a Mooncake client that (by default) contributes no memory of its own; the
pool lives in storage nodes (``mooncake_client``) registered with ``mooncake_master``.
Zero copy both ways: the host pool is registered once (``register_buffer``), and each object
moves as two ranges, the 64-byte header from a small registered arena and the host block in
place (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``).

Mooncake is a cache: an evicted or never-written key is OBJECT_NOT_FOUND, a normal miss. Its
eviction may take objects a STORE has just put: the daemon asks which are still there before
it reports them stored (``drops_writes``).
Connecting never blocks the daemon: ``setup`` (which retries for a long time when the
master is down) runs on a background thread after a quick TCP probe of the master; storage
calls made meanwhile fail with StorageUnavailable. After a transport failure the next call
probes the master first, so a dead master costs a refused connect, not the client's own
multi-second RPC retry; the client reconnects by itself when the master returns.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .base import (
    MISSING,
    GetItem,
    GetResult,
    GetStatus,
    PutItem,
    StorageBackend,
    StorageFailure,
    StorageUnavailable,
)
from .objects import HEADER_BYTES

if TYPE_CHECKING:
    from ..config import Config
    from ..host_cache import HostPool

log = logging.getLogger(__name__)

# Mooncake store error codes (mooncake-store/include/types.h) this backend tells apart.
NOT_FOUND = {-704, -703, -710, -712}  # not found, replica not ready / not found / gone
OBJECT_ALREADY_EXISTS = -705
NO_SPACE = -200  # NO_AVAILABLE_HANDLE
BUFFER_SIZE = -600  # INVALID_PARAMS: our buffer does not match the object's size
TRANSPORT = {-1, -101, -800, -900, -1010}  # internal, segment gone, transfer, RPC, unavailable
_CALL_KEYS = 512  # objects per Mooncake call (and header slots per arena group)
_LOCAL_BUFFER = 16 << 20
_PROBE_S = 1.0
_RETRY_S = 2.0  # least time between two connect attempts


# daemon.log_level -> MC_LOG_LEVEL (Mooncake knows TRACE, INFO, WARNING, ERROR)
_MC_LOG_LEVELS = {"debug": "INFO", "info": "WARNING", "warning": "WARNING", "error": "ERROR"}


def quiet_logs(level: str = "info") -> None:
    """Mooncake logs each connection step at INFO on stderr (a dozen lines per client):
    keep it to warnings and errors unless ``level`` is debug or MC_LOG_LEVEL is set. Must
    run before the client is created."""
    os.environ.setdefault("MC_LOG_LEVEL", _MC_LOG_LEVELS.get(level, "WARNING"))


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"mooncake master address {address!r} must be host:port")
    return host.strip("[]"), int(port)


class HeaderArena:
    """Registered memory for object headers: one group of slots per concurrent call."""

    def __init__(self, groups: int) -> None:
        self.map = mmap.mmap(-1, groups * _CALL_KEYS * HEADER_BYTES)
        self.view = memoryview(self.map)
        self.address = _address_of(self.map)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for g in range(groups):
            self._free.put(g)

    def acquire(self, timeout_s: float) -> int:
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise StorageUnavailable("mooncake: every header slot group is busy") from None

    def release(self, group: int) -> None:
        self._free.put(group)

    def slot(self, group: int, index: int) -> int:
        return (group * _CALL_KEYS + index) * HEADER_BYTES


def _address_of(buffer: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class MooncakeBackend(StorageBackend):
    name = "mooncake"
    max_shards = 1  # the transfer engine spreads a batch over its own workers
    drops_writes = True  # its eviction may take objects a STORE has just put

    def __init__(self, config: Config, pool: HostPool) -> None:
        s, own = config.storage, config.storage.mooncake
        self.master = own.master or "127.0.0.1:50051"
        self.master_host, self.master_port = split_address(self.master)
        self.setup_args = {
            "local_hostname": own.local_hostname,
            "metadata_server": own.metadata_server,
            "global_segment_size": own.segment_size,
            "local_buffer_size": _LOCAL_BUFFER,
            "protocol": own.protocol,
            "rdma_devices": own.device_name,
            "master_server_addr": self.master,
        }
        self.pool = pool
        self.wait_s = s.timeout_s
        self.arena = HeaderArena(s.io_threads + 2)
        self.store: Any = None
        self.state = "connecting"
        self.last_error = ""
        self._suspect = False  # a transport failure happened: probe the master before the next call
        self._connected = threading.Event()
        self._lock = threading.Lock()
        self._connector: threading.Thread | None = None
        self._last_attempt = 0.0
        # The client retries setup 20 times (~90 s) against a dead master; we probe first
        # and retry on our own schedule, so a couple of tries is enough. Operators may override.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        quiet_logs(config.daemon.log_level)
        if own.protocol == "tcp":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", own.local_hostname)

    # Connecting ---------------------------------------------------------------------------

    def start(self) -> None:
        self._kick()

    def _kick(self) -> None:
        with self._lock:
            if self._connected.is_set() or (self._connector is not None and self._connector.is_alive()):
                return
            if time.monotonic() - self._last_attempt < _RETRY_S:
                return
            self._last_attempt = time.monotonic()
            self._connector = threading.Thread(target=self._connect, name="mooncake-connect", daemon=True)
            self._connector.start()

    def _probe(self) -> None:
        try:
            socket.create_connection((self.master_host, self.master_port), timeout=_PROBE_S).close()
        except OSError as exc:
            raise StorageUnavailable(f"mooncake master {self.master} unreachable: {exc}") from None

    def _connect(self) -> None:
        try:
            self._probe()
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            a = self.setup_args
            rc = store.setup(
                a["local_hostname"], a["metadata_server"], a["global_segment_size"], a["local_buffer_size"],
                a["protocol"], a["rdma_devices"], a["master_server_addr"],
            )  # fmt: skip
            if rc != 0:
                raise StorageUnavailable(f"mooncake setup against {self.master} failed ({rc})")
            for address, size in ((self.pool.address, self.pool.capacity), (self.arena.address, len(self.arena.map))):
                if store.register_buffer(address, size) != 0:
                    store.close()
                    raise StorageUnavailable(f"mooncake register_buffer of {size} bytes failed")
        except Exception as exc:  # ImportError, StorageUnavailable, whatever the binding raises
            self.state, self.last_error = "unavailable", str(exc)
            log.warning("mooncake: %s", exc)
            return
        self.store, self.state, self.last_error = store, "ready", ""
        self._connected.set()
        log.info("mooncake: connected to master %s (%s)", self.master, a["protocol"])

    def _ready(self) -> Any:
        """The store, once connected; waits a bounded time for a connect in progress."""
        if not self._connected.is_set():
            self._kick()
            connector = self._connector
            if connector is not None:  # returns as soon as the attempt ends, failed or not
                connector.join(min(self.wait_s, 5.0))
            if not self._connected.is_set():
                raise StorageUnavailable(self.last_error or f"mooncake: still connecting to master {self.master}")
        if self._suspect:
            self._probe()
            self._suspect = False
        return self.store

    def _check_transport(self, codes: list[int], what: str) -> None:
        if codes and all(c in TRANSPORT for c in codes):
            self._suspect, self.state = True, "unavailable"
            self.last_error = f"mooncake {what} failed with {codes[0]} for every object"
            raise StorageUnavailable(self.last_error)
        self.state, self.last_error = "ready", ""

    # Calls --------------------------------------------------------------------------------

    def _groups(self, items: list[Any]) -> Iterator[tuple[int, list[Any]]]:
        for start in range(0, len(items), _CALL_KEYS):
            group = self.arena.acquire(self.wait_s)
            try:
                yield group, items[start : start + _CALL_KEYS]
            finally:
                self.arena.release(group)

    def put(self, items: list[PutItem], stop: threading.Event) -> list[str | None]:
        store = self._ready()
        reasons: list[str | None] = []
        for group, chunk in self._groups(items):
            if stop.is_set():
                reasons += ["stopped"] * len(chunk)
                continue
            ptrs, sizes = [], []
            for i, item in enumerate(chunk):
                slot = self.arena.slot(group, i)
                self.arena.view[slot : slot + HEADER_BYTES] = item.header()
                ptrs.append([self.arena.address + slot, item.address])
                sizes.append([HEADER_BYTES, len(item.payload)])
            codes = store.batch_put_from_multi_buffers([i.name for i in chunk], ptrs, sizes)
            self._check_transport(codes, "put")
            reasons += [_put_reason(code) for code in codes]
        return reasons

    def get(self, items: list[GetItem], stop: threading.Event) -> list[GetResult]:
        store = self._ready()
        results: list[GetResult] = []
        for group, chunk in self._groups(items):
            if stop.is_set():
                results += [GetResult(GetStatus.FAILED, detail="stopped")] * len(chunk)
                continue
            slots = [self.arena.slot(group, i) for i in range(len(chunk))]
            ptrs = [[self.arena.address + s, item.address] for s, item in zip(slots, chunk)]
            sizes = [[HEADER_BYTES, len(item.payload)] for item in chunk]
            codes = store.batch_get_into_multi_buffers([i.name for i in chunk], ptrs, sizes)
            if any(c not in NOT_FOUND for c in codes):
                self._check_transport(codes, "get")
            results += [
                item.landed(self._get_result(store, item, code, s)) for item, code, s in zip(chunk, codes, slots)
            ]
        return results

    def _get_result(self, store: Any, item: GetItem, code: int, slot: int) -> GetResult:
        if code >= 0:
            return GetResult(GetStatus.OK, bytes(self.arena.view[slot : slot + HEADER_BYTES]), code)
        if code in NOT_FOUND:
            return MISSING
        if code == BUFFER_SIZE or (code == -800 and store.get_size(item.name) != HEADER_BYTES + len(item.payload)):
            return GetResult(GetStatus.MISMATCH, detail=f"object size differs (mooncake {code})")
        return GetResult(GetStatus.FAILED, detail=f"mooncake error {code}")

    def exists(self, names: list[str]) -> list[bool]:
        store = self._ready()
        found: list[bool] = []
        for start in range(0, len(names), _CALL_KEYS):
            codes = store.batch_is_exist(names[start : start + _CALL_KEYS])
            if codes and all(c < 0 for c in codes):
                self._check_transport([-900] * len(codes), "exists")
            found += [c == 1 for c in codes]
            if not all(found):
                break
        return found + [False] * (len(names) - len(found))

    def delete(self, names: list[str]) -> int:
        store = self._ready()
        removed = 0
        for start in range(0, len(names), _CALL_KEYS):
            # force: a reader's lease must not keep a deleted key alive; a reader that races
            # the removal gets a transfer error or a checksum mismatch, never wrong bytes.
            codes = store.batch_remove(names[start : start + _CALL_KEYS], True)
            if codes and all(c in TRANSPORT for c in codes):
                self._check_transport(codes, "delete")
            removed += sum(1 for c in codes if c == 0)
        return removed

    def describe(self) -> dict[str, Any]:
        info = {"backend": self.name, "master": self.master, "protocol": self.setup_args["protocol"]}
        info["state"] = self.state
        if self.last_error:
            info["last_error"] = self.last_error
        return info

    def close(self) -> None:
        store, self.store = self.store, None
        self._connected.clear()
        if store is None:
            return
        try:
            store.unregister_buffer(self.pool.address)
            store.unregister_buffer(self.arena.address)
            store.close()
        except Exception as exc:
            raise StorageFailure(f"mooncake close: {exc}") from None


def _put_reason(code: int) -> str | None:
    if code in (0, OBJECT_ALREADY_EXISTS):  # keys are content addressed: same key, same bytes
        return None
    if code == NO_SPACE:
        return "mooncake: no space (no segment mounted, or all full and nothing evictable)"
    return f"mooncake error {code}"


def create(config: Config, pool: HostPool) -> MooncakeBackend:
    return MooncakeBackend(config, pool)
