"""The daemon: sockets, the receive loop, and the lifecycle.

The loop stays small: the command socket is read in bounded batches whenever it turns
readable (a reader callback, no task or future per message); each message goes to the
Dispatcher (decode, admit, dispatch table); outcomes leave through Outcomes. Copies and
storage I/O never run on the loop. Between two batches the loop runs everything else
(signals, finished copies, replies), so a backlog of thousands of queued commands never
delays a PING, a signal or a state change by more than one batch.

Lifecycle: starting -> running -> draining -> stopped. Signals only request the change;
a second SIGINT while draining forces an exit.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Coroutine
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

import zmq

from .. import __version__
from ..backends import load_backend
from ..backends.base import Backend
from ..config import Config
from ..metrics import DaemonMetrics
from ..protocol import PROTOCOL_MAJOR, PROTOCOL_MINOR, Command, ErrorCode, Limits, MsgType, ProtocolError
from ..security import AccessError, curve_enabled, load_server_keys
from ..zmqio import readable, send_frames
from .access import AccessControl
from .device import DeviceSlot
from .dispatch import Dispatcher
from .groups import SwapGroups
from .handlers import Handlers
from .health import Health
from .host import HostCache
from .jobs import Jobs
from .notify import sd_notify
from .ordering import BlockOrdering
from .outcomes import Outcomes
from .pausing import Pausing
from .request import Request
from .sessions import EventSinks, Sessions
from .storage_tier import open_storage
from .turn import Turn

log = logging.getLogger(__name__)

_ROUTER_HWM = 100_000
_RECEIVE_BATCH = 256  # messages read per wake-up before the loop runs everything else
_QUIESCE_QUIET_S = 0.1  # shutdown: stop reading after the socket is this quiet...
_QUIESCE_MAX_S = 2.0  # ...or after this long at most
_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)  # plain ints: see zmqio
_GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (default 700)


def tune_gc() -> None:
    """Every command allocates a few short-lived objects; with the default thresholds the
    collector's full passes over everything the daemon holds (torch's modules, thousands of
    commands in flight) cost more than the commands. Objects alive at start-up are frozen
    out of collection, and the young generation is collected less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, 20, 100)


class DaemonState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class DaemonError(RuntimeError):
    """The daemon cannot start (bad runtime dir, endpoint in use, ...)."""


def first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (what a start creates)."""
    missing = None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


def _take_lock(path: Path) -> IO[str]:
    """Opens and locks ``path`` (BlockingIOError: another process holds it). A daemon that
    stops removes the file while holding the lock; one that waited on that file then holds
    a lock on a name nobody sees, so it tries again on the file that is there now."""
    while True:
        lock = open(path, "a+")  # noqa: SIM115 (held for the process lifetime)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(lock.fileno()).st_ino == os.stat(path).st_ino:
                return lock
        except FileNotFoundError:
            pass  # removed between our open and our check: try again
        except BaseException:
            lock.close()
            raise
        lock.close()


class Daemon:
    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self.config = config
        self.rank = config.daemon.rank
        self.boot_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.state = DaemonState.STARTING
        self.started = asyncio.Event()  # set once the sockets are bound and commands are served
        self.backend = backend or load_backend(config.daemon.backend, config)
        self.metrics = DaemonMetrics(self.rank, self.backend.name)
        self.host = HostCache(self.backend.create_host_pool(config.host_cache.capacity), config.host_cache.block_bytes)
        try:  # storage tier: connects in start(), never blocks; None when storage.backend = "none"
            self.storage = open_storage(config, self.host.pool, self.metrics)
        except ValueError as exc:
            raise DaemonError(str(exc)) from None
        self.ordering: BlockOrdering[Request] = BlockOrdering()
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.access = AccessControl(config, self.ctx)
        # With CURVE keys the daemon can also deliver events to CURVE event sockets (protocol 1.2).
        event_keys = load_server_keys(config.access.curve_secret_key) if curve_enabled(config.access) else None
        self.sinks = EventSinks(self.ctx, allow_abstract=config.access.abstract_ipc, curve=event_keys)
        self.sessions = Sessions(self.sinks)
        self.turn = Turn()  # read, start of the ready copies and outcomes' flush in one loop callback
        self.outcomes = Outcomes(self.boot_id, self.rank, self.metrics, self.sessions, self.sinks, self._reply,
                                 self.turn)  # fmt: skip
        self.device = DeviceSlot(self.backend, self.host, self.ordering, self.metrics, config.daemon, self.spawn)
        self.pausing = Pausing(self.ordering)
        daemon_config = config.daemon
        self.health = Health(daemon_config.loop_stall_s, daemon_config.expect_runner, lambda: self.state.value,
                             lambda: self.device.state.value)  # fmt: skip
        handlers = Handlers(
            config, self.device, self.host, self.storage, self.sessions, self.metrics, self.status, self.request_stop,
            self.pausing,
        )  # fmt: skip
        handlers.sync[MsgType.ATTACH] = self.access.guard_attach(handlers.handle_attach)
        self.jobs = Jobs(self.ordering, self.metrics, self.outcomes, self.turn)
        groups = SwapGroups(self.device, self.host, self.pausing, self._admit)
        self.dispatcher = Dispatcher(
            handlers, self.jobs, self.outcomes, self.sessions, config.daemon.max_inflight, self._admit, self.spawn,
            groups, self.metrics.batches,
        )  # fmt: skip
        self.router: zmq.Socket[Any] | None = None
        self._stop_requested = asyncio.Event()
        self._lock_file: IO[str] | None = None
        self._spawned: set[asyncio.Task[Any]] = set()
        self._reading = False  # a read of the command socket is scheduled
        self._last_receive = time.monotonic()
        self._publish_host()

    # Lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Binds and starts serving. A start that fails (or is interrupted) undoes itself:
        this method is the one owner of that clean-up (docs/operations.md, "Failures")."""
        created = first_missing(self.config.runtime_dir)
        try:
            self._prepare_runtime_dir()
            # Metrics before the router: a taken port must fail before clients can connect.
            self.health.start()
            if self.config.metrics.enabled:
                probes = {"/healthz": self.health.live, "/readyz": self.health.ready}
                port = self.metrics.serve(self.config.metrics.host, self.config.metrics_port, probes)
                log.info("metrics on http://%s:%d/metrics (probes /healthz, /readyz)", self.config.metrics.host, port)
            self.router = self._bind_router()
            self.access.log_warnings()
            if self.storage is not None:
                self.storage.start()
            tune_gc()
            loop = asyncio.get_running_loop()
            loop.add_reader(self.router.fileno(), self._read_turn)
        except BaseException:
            self._undo_start(created)
            raise
        self._schedule_read()  # messages may have queued before the reader was added
        self.state = DaemonState.RUNNING
        self.started.set()
        log.info(
            "rank %d serving on %s (boot %s, backend %s, protocol %d.%d)",
            self.rank, self.config.endpoint, self.boot_id, self.backend.name, PROTOCOL_MAJOR, PROTOCOL_MINOR,
        )  # fmt: skip
        sd_notify(f"READY=1\nSTATUS=serving on {self.config.endpoint}\nMAINPID={os.getpid()}")

    async def run(self) -> None:
        """start(), then serve until a stop is requested, then shut down cleanly."""
        await self.start()
        await self.wait_stop_requested()
        await self.shutdown()

    async def wait_stop_requested(self) -> None:
        await self._stop_requested.wait()

    def request_stop(self, reason: str) -> None:
        if self.state in (DaemonState.DRAINING, DaemonState.STOPPED):
            return
        log.info("stop requested (%s): draining", reason)
        self.state = DaemonState.DRAINING
        self._stop_requested.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)

    def _on_sigint(self) -> None:
        if self.state is DaemonState.DRAINING:
            log.warning("second SIGINT: exiting without draining")
            self._release_runtime_files()
            os._exit(130)
        self.request_stop("SIGINT")

    async def shutdown(self) -> None:
        sd_notify("STOPPING=1")
        drain = self.config.daemon.drain_timeout_s
        if not await self.jobs.wait_all(drain):
            log.warning("drain timeout (%.1fs): failing %d commands", drain, self.jobs.unfinished)
            self.jobs.cancel_all(ErrorCode.SHUTTING_DOWN, "daemon shut down before this command finished")
            await self.jobs.wait_all(None)
        await self._quiesce()
        if self._spawned:
            await asyncio.wait(set(self._spawned), timeout=drain)
        await self.device.detach("daemon shutting down", 0.0)
        self.sessions.close()
        await self._close_sockets()
        self.metrics.stop()
        self.health.stop()
        self.backend.close()
        if self.storage is not None:
            self.storage.close()
        self._release_runtime_files()
        self.state = DaemonState.STOPPED
        log.info("stopped")

    async def _quiesce(self) -> None:
        """Keeps answering SHUTTING_DOWN until the socket has been quiet for a moment, so
        commands already on their way when the stop came still get an outcome."""
        deadline = time.monotonic() + _QUIESCE_MAX_S
        while time.monotonic() < deadline and time.monotonic() - self._last_receive < _QUIESCE_QUIET_S:
            await asyncio.sleep(_QUIESCE_QUIET_S / 4)
        self._read_batch()  # whatever is still queued gets its outcome
        self.outcomes.flush()

    async def _close_sockets(self) -> None:
        if self.router is not None:
            if not self.router.closed:
                asyncio.get_running_loop().remove_reader(self.router.fileno())
            self.router.close(linger=100)
        self.sinks.close()
        self.access.close()
        # term() waits for the lingering event sockets to flush: keep it off the loop.
        await asyncio.get_running_loop().run_in_executor(None, self.ctx.term)

    def _prepare_runtime_dir(self) -> None:
        runtime = self.config.runtime_dir
        try:
            self.access.prepare_runtime_dir(runtime)
            self._lock_file = _take_lock(runtime / "daemon.lock")
        except BlockingIOError:
            raise DaemonError(f"another cachexferd is running with runtime dir {runtime}") from None
        except OSError as exc:
            raise DaemonError(f"runtime dir {runtime}: {exc.strerror}") from None
        except AccessError as exc:
            raise DaemonError(str(exc)) from None
        self._lock_file.truncate(0)
        self._lock_file.write(f"{os.getpid()}\n")
        self._lock_file.flush()
        self._remove_ipc_file()  # stale socket of a daemon that died: we hold the lock now

    def _release_runtime_files(self) -> None:
        """Removes the socket file and the lock file, while the lock is still held (so a
        daemon starting meanwhile waits, then finds the file gone and takes a new one)."""
        if self._lock_file is None:
            return  # not ours: another daemon's files are never touched
        self._remove_ipc_file()
        (self.config.runtime_dir / "daemon.lock").unlink(missing_ok=True)
        self._lock_file.close()
        self._lock_file = None

    def _undo_start(self, created: Path | None) -> None:
        """A failed start leaves nothing behind: no metrics server, socket file, lock file, or
        runtime directory it created. Only files of this process: the lock is ours if held."""
        self.metrics.stop()
        self.health.stop()
        if self.router is not None:
            self.router.close(0)
            self.router = None
        self.access.close()  # the ZAP handler, if CURVE started one
        if self.storage is not None:
            self.storage.close()
        self._release_runtime_files()
        if created is not None:
            for directory in (self.config.runtime_dir, *self.config.runtime_dir.parents):
                try:
                    directory.rmdir()  # empty ones only
                except OSError:
                    break
                if directory == created:
                    break

    def _bind_router(self) -> zmq.Socket[Any]:
        router: zmq.Socket[Any] = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, Limits.MAX_SOCKET_MSG_BYTES)
        router.setsockopt(zmq.RCVHWM, _ROUTER_HWM)
        router.setsockopt(zmq.SNDHWM, _ROUTER_HWM)
        router.setsockopt(zmq.LINGER, 0)
        try:
            self.access.configure_router(router)
            router.bind(self.config.endpoint)
            self.access.secure_socket()
        except (zmq.ZMQError, AccessError) as exc:
            router.close(0)
            self.access.close()  # the ZAP handler, if CURVE started one
            raise DaemonError(f"cannot bind {self.config.endpoint}: {exc}") from None
        return router

    def _ipc_path(self) -> Path | None:
        endpoint = self.config.endpoint
        if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):  # abstract sockets have no file
            return None
        return Path(endpoint[len("ipc://") :])

    def _remove_ipc_file(self) -> None:
        path = self._ipc_path()
        if path is not None:
            path.unlink(missing_ok=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    # Receiving --------------------------------------------------------------------------

    def _schedule_read(self) -> None:
        if not self._reading:
            self._reading = True
            asyncio.get_running_loop().call_soon(self._read_turn)

    def _read_turn(self) -> None:
        """A read of the command socket, and the work it causes, in one loop callback."""
        self.turn.run(self._read_batch)

    def _read_batch(self) -> None:
        """Reads at most _RECEIVE_BATCH messages, then lets the loop run everything else.

        ZeroMQ's descriptor is edge-triggered. A read that fails with zmq.Again has taken in
        every notice libzmq had for the socket, so the next message turns the descriptor
        readable again: no zmq.EVENTS check is needed then (each costs a system call). Only
        a batch cut short schedules another read."""
        self._reading = False
        router = self.router
        if router is None or router.closed:
            return
        recv, more, note, on_frames = router.recv, router.getsockopt, self.access.peers.note, self.dispatcher.on_frames
        for _ in range(_RECEIVE_BATCH):
            try:  # the first frame (the identity) as a Frame: its metadata names the peer
                first = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames: list[bytes] = []
            if first.more:  # the parts of a message arrive together: none of these reads waits
                frames.append(recv(_NOBLOCK))
                while more(_RCVMORE):
                    frames.append(recv(_NOBLOCK))
            identity = note(first, frames[0] if frames else b"")
            self._last_receive = now = time.monotonic()
            try:
                on_frames(identity, frames, now)
            except Exception:  # never let one message stop the daemon
                log.exception("unhandled error dispatching a message")
        self._schedule_read()  # more may be queued: the loop runs everything else first

    def _check_readable(self) -> None:
        router = self.router
        if router is not None and not router.closed and readable(router):
            self._schedule_read()

    def _admit(self, cmd: Command) -> None:
        """Daemon-level admission of every command but HELLO, PING and STATUS."""
        if cmd.boot_id is not None and cmd.boot_id != self.boot_id:
            raise ProtocolError(ErrorCode.STALE_BOOT, f"addressed to boot {cmd.boot_id}, this daemon is {self.boot_id}")
        if self.state is not DaemonState.RUNNING:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, f"daemon is {self.state.value}")

    def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        router = self.router
        if router is None or router.closed:
            return
        try:  # the ROUTER never blocks: the send completes (or fails) at once
            send_frames(router, [identity, *frames])
        except zmq.ZMQError as exc:
            self.metrics.events_dropped.inc()
            log.info("reply dropped: %s", exc)
        self._check_readable()

    # Introspection --------------------------------------------------------------------

    def _publish_host(self) -> None:
        host = self.host.describe()
        self.metrics.host_capacity.set(host["capacity_bytes"])
        # Read at scrape time: a pinning host pool advances ready_bytes on its own thread.
        pool = self.host.pool
        self.metrics.host_ready.set_function(lambda: pool.ready_bytes)
        self.metrics.host_blocks.set(host["num_blocks"])

    def status(self) -> dict[str, Any]:
        self._publish_host()
        queued, running = self.ordering.counts()
        port = self.metrics.port
        return {
            "boot_id": self.boot_id,
            "rank": self.rank,
            "version": __version__,
            "protocol": [PROTOCOL_MAJOR, PROTOCOL_MINOR],
            "pid": os.getpid(),
            "state": self.state.value,
            "paused": self.pausing.paused,
            "uptime_s": round(time.time() - self.started_at, 3),
            "endpoint": self.config.endpoint,
            "metrics_url": f"http://{self.config.metrics.host}:{port}/metrics" if port else "",
            "backend": self.backend.describe(),
            "host_cache": self.host.describe(),
            "device": self.device.describe(),
            "commands": {"queued": queued, "running": running, "held": self.dispatcher.held},
            "clients": len(self.sessions),
            "clients_reclaimed": self.sessions.reclaimed,
            "storage": self.storage.describe() if self.storage is not None else {"backend": "none"},
        }

    def effective_config(self) -> str:
        return json.dumps(self.config.to_dict(), sort_keys=True)
