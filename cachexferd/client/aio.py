"""asyncio engine client: ``await client.swap_out(...)`` returns the aggregated Completion.

It offers every command method of the sync client (they are written once, in
commands.py). One pump task reads the event socket and every DEALER, resolves futures by
req_id, sends heartbeats and expires deadlines. No task or thread per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio

from ..protocol import Command, ErrorCode, MsgType, Outcome, Shutdown, Status, encode_body, encode_command
from ..security import CurveClientKeys, KeyFile
from ..zmqio import send_frames
from .commands import CommandMethods, Fields
from .core import EngineCore
from .engine import default_events_endpoint, secure_events_socket
from .events import EventSocket, check_curve_events, curve_per_endpoint
from .link import _HANDSHAKE_FAILURES, ClientError, check_ok, handshake_failure_text, make_dealer, read_outcomes
from .pending import Completion

_PUMP_TICK_S = 0.05


class AsyncEngineClient(CommandMethods[asyncio.Future[Completion]]):
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        events: str | None = None,
        name: str = "engine",
        timeout_s: float = 30.0,
        heartbeat_s: float = 1.0,
        events_group: str | None = None,
        server_key: KeyFile | Sequence[KeyFile] | None = None,
        client_key: KeyFile | None = None,
    ) -> None:
        """The same options as EngineClient: ``events_group`` for daemons that run as another
        user; ``server_key`` / ``client_key`` (CURVE key files) for daemons on tcp, and then
        ``events`` may be a tcp address the daemons reach (docs/operations.md, "Access control")."""
        if not endpoints:
            raise ValueError("AsyncEngineClient needs at least one daemon endpoint")
        curve = curve_per_endpoint(endpoints, server_key, client_key)
        self._tmpdir: Path | None = None
        if events is None:
            events, self._tmpdir = default_events_endpoint(events_group)
        self.ctx = zmq.asyncio.Context()
        self.events = EventSocket(self.ctx, events, curve)
        self.pull = self.events.pull
        secure_events_socket(events, events_group)
        self.dealers = [self._dealer(endpoint, keys) for endpoint, keys in zip(endpoints, curve)]
        self.endpoints = list(endpoints)
        # Synchronous twins of the asyncio sockets for non-blocking reads/sends in the pump.
        self._sync: dict[int, zmq.Socket[bytes]] = {
            id(s): zmq.Socket.shadow(s.underlying) for s in (self.pull, *self.dealers)
        }
        # Connection events: a daemon that dies fails its in-flight commands at once; a
        # refused CURVE handshake (which looks like silence) is explained at the timeout.
        watched = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILURES
        self.monitors = [s.get_monitor_socket(watched) for s in self.dealers]
        self._monitor_reads: list[zmq.Socket[bytes]] = [zmq.Socket.shadow(m.underlying) for m in self.monitors]
        self._handshake_failed: list[int] = [0 for _ in self.dealers]  # the last failure event per link
        self._held: list[list[tuple[MsgType, dict[str, Any]]]] = [[] for _ in self.dealers]  # until a re-hello
        self.core = EngineCore(len(endpoints), name, self.events.endpoint, timeout_s, heartbeat_s, self.events.key)
        self._futures: dict[int, asyncio.Future[Completion]] = {}
        self._calls: dict[int, asyncio.Future[Outcome]] = {}
        self._pump: asyncio.Task[None] | None = None

    def _dealer(self, endpoint: str, curve: CurveClientKeys | None) -> zmq.asyncio.Socket:
        # The asyncio context makes asyncio sockets; the options are the synchronous client's.
        return cast(zmq.asyncio.Socket, make_dealer(self.ctx, endpoint, curve))

    async def connect(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        outcomes = [await self._call(i, self.core.hello(), timeout_s) for i in range(len(self.dealers))]
        for outcome in outcomes:
            check_ok(outcome)
        self.core.accept_hellos(outcomes)
        if self.events.key is not None:
            check_curve_events([o.result for o in outcomes], self.endpoints)
        return [o.result for o in outcomes]

    # Commands (the methods are in CommandMethods) ----------------------------------------

    def submit(self, op: MsgType, fields: Fields, timeout_s: float | None = None) -> asyncio.Future[Completion]:
        req_id, bodies = self.core.build(op, fields, timeout_s)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._futures[req_id] = future
        for index, body in enumerate(bodies):
            if self.core.boot_ids[index] is None:
                self._held[index].append((op, body))  # that daemon is being said hello to again
            else:
                self._send(index, op, body)
        return future

    def _send(self, index: int, op: MsgType, body: dict[str, Any]) -> None:
        try:
            send_frames(self._sync[id(self.dealers[index])], encode_body(op, body))
        except zmq.ZMQError as exc:
            self._resolve(self.core.send_failed(index, body["req_id"], str(exc)))

    def _release_held(self) -> None:
        """Sends what waited for a new hello, stamped with the new boot id."""
        for index, held in enumerate(self._held):
            boot_id = self.core.boot_ids[index]
            if boot_id is None or not held:
                continue
            self._held[index] = []
            for op, body in held:
                if body["req_id"] in self.core.pending:
                    self._send(index, op, {**body, "boot_id": boot_id})

    def _watch_connections(self) -> None:
        for index, monitor in enumerate(self._monitor_reads):
            while True:
                try:
                    event = int.from_bytes(monitor.recv_multipart(zmq.NOBLOCK)[0][:2], "little")
                except zmq.Again:
                    break
                if event & _HANDSHAKE_FAILURES:
                    self._handshake_failed[index] = event
                elif event == zmq.EVENT_DISCONNECTED:
                    self._resolve(self.core.link_lost(index))
                elif self.core.boot_ids[index] is None:
                    self._send_control(index, self.core.hello())

    async def status(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        return [
            check_ok(await self._call(i, Status(req_id=self.core.next_req_id()), timeout_s))
            for i in range(len(self.dealers))
        ]

    async def shutdown_daemons(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        return [
            check_ok(await self._call(i, Shutdown(req_id=self.core.next_req_id()), timeout_s))
            for i in range(len(self.dealers))
        ]

    async def _call(self, index: int, cmd: Command, timeout_s: float) -> Outcome:
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._calls[cmd.req_id] = future
        try:
            await self.dealers[index].send_multipart(encode_command(cmd))
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            why = handshake_failure_text(self._handshake_failed[index])
            raise ClientError(
                ErrorCode.CLIENT_TIMEOUT,
                f"no reply to {cmd.TYPE.name} from {self.endpoints[index]} in {timeout_s}s{why}",
            ) from None
        finally:
            self._calls.pop(cmd.req_id, None)

    # The pump ------------------------------------------------------------------------

    async def _run_pump(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.pull, zmq.POLLIN)
        if self.events.zap is not None:  # daemons' handshakes with a CURVE event socket
            poller.register(self.events.zap.sock, zmq.POLLIN)
        for sock in (*self.dealers, *self.monitors):
            poller.register(sock, zmq.POLLIN)
        while True:
            await poller.poll(int(_PUMP_TICK_S * 1000))
            self.events.serve_handshakes()
            self._watch_connections()
            self._drain_socket(self.pull, None)
            for index, sock in enumerate(self.dealers):
                self._drain_socket(sock, index)
            self._release_held()
            for index, cmd in self.core.heartbeat(time.monotonic()):
                self._send_control(index, cmd)
            self._resolve(self.core.expire())

    def _drain_socket(self, sock: zmq.Socket[Any], index: int | None) -> None:
        for outcome in read_outcomes(self._sync[id(sock)]):  # the pump owns reads
            call = self._calls.get(outcome.req_id)
            if call is not None and index is not None and not call.done():
                call.set_result(outcome)
                if outcome.op != MsgType.HELLO:
                    continue
            done, resend = self.core.on_outcome(outcome, index)
            self._resolve(done)
            for i, cmd in resend:
                self._send_control(i, cmd)

    def _send_control(self, index: int, cmd: Command) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sync[id(self.dealers[index])].send_multipart(encode_command(cmd), flags=zmq.NOBLOCK)

    def _resolve(self, completions: list[Completion]) -> None:
        for completion in completions:
            future = self._futures.pop(completion.req_id, None)
            if future is not None and not future.done():
                future.set_result(completion)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        for dealer, monitor in zip(self.dealers, self.monitors):
            dealer.disable_monitor()
            monitor.close(0)
        for sock in self.dealers:
            sock.close(0)
        self.events.close()
        self.ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
