"""The daemon: sockets, the receive loop, outcome routing and the lifecycle.

The loop stays small: receive a frame set, decode it, hand it to a handler from the
dispatch table, route the outcome. Copies and storage I/O never run on the loop.
Lifecycle: starting -> running -> draining -> stopped. Signals only request the change;
a second SIGINT while draining forces an exit.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import IO, Any, cast

import zmq
import zmq.asyncio

from .. import __version__
from ..backends import load_backend
from ..backends.base import Backend
from ..config import Config
from ..metrics import DaemonMetrics
from ..protocol import (
    ASYNC_TYPES,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Command,
    ErrorCode,
    Limits,
    MsgType,
    Outcome,
    ProtocolError,
    decode_command,
    encode_outcome,
)
from ..storage.tier import open_storage
from .device import DeviceSlot
from .handlers import Handlers
from .host import HostCache
from .jobs import Jobs
from .notify import sd_notify
from .ordering import BlockOrdering
from .sessions import EventSinks, Sessions

log = logging.getLogger(__name__)

_ALWAYS_ALLOWED = frozenset({MsgType.PING, MsgType.STATUS, MsgType.HELLO})  # also while draining
_ROUTER_HWM = 100_000
_QUIESCE_QUIET_S = 0.1  # shutdown: stop reading after the socket is this quiet...
_QUIESCE_MAX_S = 2.0  # ...or after this long at most


class DaemonError(RuntimeError):
    """The daemon cannot start (bad runtime dir, endpoint in use, ...)."""


def _op_name(op: int) -> str:
    return MsgType(op).name.lower() if op in MsgType._value2member_map_ else "unknown"


def _code_name(code: int) -> str:
    return "ok" if code == 0 else ErrorCode(code).name.lower()


class Daemon:
    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self.config = config
        self.rank = config.daemon.rank
        self.boot_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.state = "starting"
        self.backend = backend or load_backend(config.daemon.backend, config)
        self.metrics = DaemonMetrics(self.rank, self.backend.name)
        self.host = HostCache(self.backend.create_host_pool(config.host_cache.capacity), config.host_cache.block_bytes)
        try:  # storage tier: connects in start(), never blocks; None when storage.backend = "none"
            self.storage = open_storage(config, self.host.pool, self.metrics)
        except ValueError as exc:
            raise DaemonError(str(exc)) from None
        self.ordering = BlockOrdering()
        self.device = DeviceSlot(self)
        self.jobs = Jobs(self)
        self.handlers = Handlers(self)
        self.ctx = zmq.asyncio.Context()
        self.sinks = EventSinks(zmq.Context.shadow(self.ctx.underlying))
        self.sessions = Sessions(self.sinks)
        self.router: zmq.asyncio.Socket | None = None
        self._stop: asyncio.Event | None = None
        self._lock_file: IO[str] | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._spawned: set[asyncio.Task[Any]] = set()
        self._last_receive = time.monotonic()
        self._publish_host()

    # Lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._stop = asyncio.Event()
        self._prepare_runtime_dir()
        self.router = self._bind_router()
        if self.storage is not None:
            self.storage.start()
        if self.config.metrics.enabled:
            port = self.metrics.serve(self.config.metrics.host, self.config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.config.metrics.host, port)
        self._receiver = asyncio.get_running_loop().create_task(self._receive())
        self.state = "running"
        log.info(
            "rank %d serving on %s (boot %s, backend %s, protocol %d.%d)",
            self.rank, self.config.endpoint, self.boot_id, self.backend.name, PROTOCOL_MAJOR, PROTOCOL_MINOR,
        )  # fmt: skip
        sd_notify(f"READY=1\nSTATUS=serving on {self.config.endpoint}\nMAINPID={os.getpid()}")

    async def run(self) -> None:
        """start(), then serve until a stop is requested, then shut down cleanly."""
        await self.start()
        assert self._stop is not None
        await self._stop.wait()
        await self.shutdown()

    def request_stop(self, reason: str) -> None:
        if self.state in ("draining", "stopped"):
            return
        log.info("stop requested (%s): draining", reason)
        self.state = "draining"
        if self._stop is not None:
            self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)

    def _on_sigint(self) -> None:
        if self.state == "draining":
            log.warning("second SIGINT: exiting without draining")
            self._remove_ipc_file()
            os._exit(130)
        self.request_stop("SIGINT")

    async def shutdown(self) -> None:
        sd_notify("STOPPING=1")
        drain = self.config.daemon.drain_timeout_s
        if not await self.jobs.wait_all(drain):
            log.warning("drain timeout (%.1fs): failing %d commands", drain, len(self.jobs.tasks))
            self.jobs.cancel_all(ErrorCode.SHUTTING_DOWN, "daemon shut down before this command finished")
            await self.jobs.wait_all(None)
        await self._quiesce()
        if self._spawned:
            await asyncio.wait(set(self._spawned), timeout=drain)
        await self.device.detach("daemon shutting down", 0.0)
        await self._close_sockets()
        self.metrics.stop()
        self.backend.close()
        if self.storage is not None:
            self.storage.close()
        self._remove_ipc_file()
        if self._lock_file is not None:
            self._lock_file.close()
        self.state = "stopped"
        log.info("stopped")

    async def _quiesce(self) -> None:
        """Keeps answering SHUTTING_DOWN until the socket has been quiet for a moment, so
        commands already on their way when the stop came still get an outcome."""
        deadline = time.monotonic() + _QUIESCE_MAX_S
        while time.monotonic() < deadline and time.monotonic() - self._last_receive < _QUIESCE_QUIET_S:
            await asyncio.sleep(_QUIESCE_QUIET_S / 4)
        await asyncio.sleep(0)  # let the receiver finish the batch it holds

    async def _close_sockets(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        if self.router is not None:
            self.router.close(linger=100)
        self.sinks.close()
        # term() waits for the lingering event sockets to flush: keep it off the loop.
        await asyncio.get_running_loop().run_in_executor(None, self.ctx.term)

    def _prepare_runtime_dir(self) -> None:
        runtime = self.config.runtime_dir
        try:
            runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock_file = open(runtime / "daemon.lock", "a+")  # noqa: SIM115 (held for the process lifetime)
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DaemonError(f"another cachexferd is running with runtime dir {runtime}") from None
        except OSError as exc:
            raise DaemonError(f"runtime dir {runtime}: {exc.strerror}") from None
        if runtime.stat().st_mode & 0o007:
            log.warning("runtime dir %s is accessible to all users; sockets inside it are not private", runtime)
        self._lock_file.truncate(0)
        self._lock_file.write(f"{os.getpid()}\n")
        self._lock_file.flush()
        self._remove_ipc_file()  # stale socket of a daemon that died: we hold the lock now

    def _bind_router(self) -> zmq.asyncio.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, Limits.MAX_SOCKET_MSG_BYTES)
        router.setsockopt(zmq.RCVHWM, _ROUTER_HWM)
        router.setsockopt(zmq.SNDHWM, _ROUTER_HWM)
        router.setsockopt(zmq.LINGER, 0)
        try:
            router.bind(self.config.endpoint)
        except zmq.ZMQError as exc:
            router.close(0)
            raise DaemonError(f"cannot bind {self.config.endpoint}: {exc}") from None
        return router

    def _ipc_path(self) -> Path | None:
        endpoint = self.config.endpoint
        return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None

    def _remove_ipc_file(self) -> None:
        path = self._ipc_path()
        if path is not None:
            path.unlink(missing_ok=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    # Receiving and dispatching --------------------------------------------------------

    async def _receive(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            self._last_receive = time.monotonic()
            try:
                self._on_message(frames[0], frames[1:], self._last_receive)
            except Exception:  # never let one message stop the daemon
                log.exception("unhandled error dispatching a message")

    def _on_message(self, identity: bytes, frames: list[bytes], received: float) -> None:
        try:
            cmd = decode_command(frames)
        except ProtocolError as exc:
            self.finish(identity, exc.msg_type, exc.req_id, exc.code, exc.detail, {}, received)
            return
        try:
            self._admit(cmd)
            if cmd.TYPE in self.handlers.sync:
                self.spawn(self._run_sync(identity, cmd, received))
            else:
                self._start_job(identity, cmd, received)
        except ProtocolError as exc:
            self.finish(identity, cmd.TYPE, cmd.req_id, exc.code, exc.detail, {}, received)

    def _admit(self, cmd: Command) -> None:
        if cmd.boot_id is not None and cmd.boot_id != self.boot_id:
            raise ProtocolError(ErrorCode.STALE_BOOT, f"addressed to boot {cmd.boot_id}, this daemon is {self.boot_id}")
        if self.state != "running" and cmd.TYPE not in _ALWAYS_ALLOWED:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, f"daemon is {self.state}")

    async def _run_sync(self, identity: bytes, cmd: Command, received: float) -> None:
        code, detail, result = ErrorCode.OK, "", {}
        try:
            result = await self.handlers.sync[cmd.TYPE](identity, cmd)
        except ProtocolError as exc:
            code, detail = exc.code, exc.detail
        except Exception as exc:
            log.exception("%s failed", cmd.TYPE.name)
            code, detail = ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        self.finish(identity, cmd.TYPE, cmd.req_id, code, detail, result, received)

    def _start_job(self, identity: bytes, cmd: Command, received: float) -> None:
        session = self.sessions.get(identity)
        if session is None or session.events is None:
            raise ProtocolError(
                ErrorCode.NO_EVENT_CHANNEL, "asynchronous commands need a hello that names an events endpoint"
            )
        if cmd.req_id in session.inflight:
            raise ProtocolError(ErrorCode.DUPLICATE_REQ_ID, f"req_id {cmd.req_id} is already in flight")
        if sum(self.ordering.counts()) >= self.config.daemon.max_inflight:
            raise ProtocolError(ErrorCode.BUSY, f"{self.config.daemon.max_inflight} commands in flight; retry later")
        handler = self.handlers.jobs.get(cmd.TYPE)
        if handler is None:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{cmd.TYPE.name} is not served by this daemon")
        self.jobs.start(session, cmd, handler(session, cmd), received)

    # Outcomes -------------------------------------------------------------------------

    def finish(
        self, identity: bytes, op: int, req_id: int, code: int, detail: str, result: dict[str, Any], received: float
    ) -> None:
        """Sends the one outcome of a command: an event for asynchronous commands of a
        client with an event channel, else a reply on the command socket."""
        outcome = Outcome(req_id, self.boot_id, self.rank, code, detail, result, op)
        name = _op_name(op)
        self.metrics.commands.labels(name, _code_name(code)).inc()
        self.metrics.latency.labels(name).observe(time.monotonic() - received)
        if code != ErrorCode.OK:
            log.debug("%s req_id=%d -> %s: %s", name, req_id, _code_name(code), detail)
        session = self.sessions.get(identity)
        if op in ASYNC_TYPES and req_id and session is not None and session.events is not None:
            if not self.sinks.send(session.events, encode_outcome(outcome, MsgType.EVENT)):
                self.metrics.events_dropped.inc()
            return
        self._reply(identity, encode_outcome(outcome, MsgType.REPLY))

    def _reply(self, identity: bytes, frames: list[bytes]) -> None:
        if self.router is None or self.router.closed:
            return
        # The ROUTER never blocks: the send completes (or fails) at once.
        future = cast(asyncio.Future[Any], self.router.send_multipart([identity, *frames]))
        future.add_done_callback(self._reply_sent)

    def _reply_sent(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.metrics.events_dropped.inc()
            log.info("reply dropped: %s", future.exception())

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
            "state": self.state,
            "uptime_s": round(time.time() - self.started_at, 3),
            "endpoint": self.config.endpoint,
            "metrics_url": f"http://{self.config.metrics.host}:{port}/metrics" if port else "",
            "backend": self.backend.describe(),
            "host_cache": self.host.describe(),
            "device": self.device.describe(),
            "commands": {"queued": queued, "running": running},
            "clients": len(self.sessions),
            "storage": self.storage.describe() if self.storage is not None else {"backend": "none"},
        }

    def effective_config(self) -> str:
        return json.dumps(self.config.to_dict(), sort_keys=True)
