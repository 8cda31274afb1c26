"""From received frames to handlers, in arrival order: decode, admit, dispatch.

Every command is judged against the state that the commands before it leave behind:
- SHUTDOWN and DETACH change the state the moment they are dispatched, so what follows
  them sees "draining" or "detaching";
- ATTACH and DETACH are barriers: until their reply is decided, later commands (except
  HELLO, PING and STATUS, which never depend on the device) wait in arrival order and are
  judged afterwards, against the state the barrier left.
A command whose req_id is already in flight for the same client is refused with
DUPLICATE_REQ_ID, always as a REPLY, so the in-flight command keeps its own single outcome.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..protocol import (
    Command,
    ErrorCode,
    MsgType,
    ProtocolError,
    batch_item,
    batch_items,
    command_from_body,
    decode_frames,
)

if TYPE_CHECKING:
    from .handlers import Handlers
    from .jobs import Jobs
    from .outcomes import Outcomes
    from .sessions import Sessions

log = logging.getLogger(__name__)

IMMEDIATE = frozenset({MsgType.HELLO, MsgType.PING, MsgType.STATUS})  # never held, never boot-checked
BARRIERS = frozenset({MsgType.ATTACH, MsgType.DETACH})
Spawn = Callable[[Coroutine[Any, Any, Any]], None]
Admit = Callable[[Command], None]  # raises SHUTTING_DOWN when the daemon no longer accepts work


class Dispatcher:
    def __init__(
        self, handlers: Handlers, jobs: Jobs, outcomes: Outcomes, sessions: Sessions, max_inflight: int,
        admit: Admit, spawn: Spawn,
    ) -> None:  # fmt: skip
        self.handlers, self.jobs, self.outcomes, self.sessions = handlers, jobs, outcomes, sessions
        self.max_inflight, self._admit, self._spawn = max_inflight, admit, spawn
        self._inflight: set[tuple[bytes, int]] = set()  # (client identity, req_id) without outcome
        self._held: deque[tuple[bytes, Command, float]] | None = None  # behind a running barrier

    # Frames ---------------------------------------------------------------------------

    def on_frames(self, identity: bytes, frames: list[bytes], received: float) -> None:
        """One message from the command socket: a command or a BATCH of them."""
        try:
            msg_type, body = decode_frames(frames)
            if msg_type != MsgType.BATCH:
                self.accept(identity, command_from_body(msg_type, body), received)
                return
            items = batch_items(body)
        except ProtocolError as exc:
            self._refuse(identity, exc, received)
            return
        for item in items:  # in order, exactly as if they had arrived one by one
            try:
                cmd = batch_item(item)
            except ProtocolError as exc:
                self._refuse(identity, exc, received)
                continue
            self.accept(identity, cmd, received)

    def _refuse(self, identity: bytes, exc: ProtocolError, received: float) -> None:
        self.outcomes.send(identity, exc.msg_type, exc.req_id, exc.code, exc.detail, {}, received)

    # Commands -------------------------------------------------------------------------

    def accept(self, identity: bytes, cmd: Command, received: float) -> None:
        if self._held is not None and cmd.TYPE not in IMMEDIATE:
            self._held.append((identity, cmd, received))
            return
        key = (identity, cmd.req_id)
        if key in self._inflight:
            detail = f"req_id {cmd.req_id} is already in flight; this refusal is not that command's outcome"
            self.outcomes.send(identity, cmd.TYPE, cmd.req_id, ErrorCode.DUPLICATE_REQ_ID, detail, {}, received,
                               as_reply=True)  # fmt: skip
            return
        try:
            if cmd.TYPE not in IMMEDIATE:
                self._admit(cmd)
            if cmd.ASYNC:
                self._start_job(identity, cmd, received)
            else:
                self._run_sync(identity, cmd, received)
        except ProtocolError as exc:
            self.outcomes.send(identity, cmd.TYPE, cmd.req_id, exc.code, exc.detail, {}, received)

    def _start_job(self, identity: bytes, cmd: Command, received: float) -> None:
        session = self.sessions.get(identity)
        if session is None or session.events is None:
            raise ProtocolError(
                ErrorCode.NO_EVENT_CHANNEL, "asynchronous commands need a hello that names an events endpoint"
            )
        if len(self.jobs.ordering) >= self.max_inflight:
            raise ProtocolError(ErrorCode.BUSY, f"{self.max_inflight} commands in flight; retry later")
        job = self.handlers.jobs[cmd.TYPE](cmd)
        self._inflight.add((identity, cmd.req_id))
        session.inflight += 1
        self.jobs.submit(identity, cmd, job, received)

    def job_done(self, identity: bytes, cmd: Command, code: int, detail: str, result: dict[str, Any],
                 received: float) -> None:  # fmt: skip
        """The completion callback of Jobs: forget the req_id, send the outcome."""
        self._inflight.discard((identity, cmd.req_id))
        session = self.sessions.get(identity)
        if session is not None and session.inflight:
            session.inflight -= 1
        self.outcomes.send(identity, cmd.TYPE, cmd.req_id, code, detail, result, received)

    def _run_sync(self, identity: bytes, cmd: Command, received: float) -> None:
        if cmd.TYPE == MsgType.HELLO:
            self.outcomes.flush()  # events batched for the channel this hello may replace go out first
        result = self.handlers.sync[cmd.TYPE](identity, cmd)
        if isinstance(result, dict):
            self.outcomes.send(identity, cmd.TYPE, cmd.req_id, ErrorCode.OK, "", result, received)
            return
        key = (identity, cmd.req_id)
        self._inflight.add(key)
        if cmd.TYPE in BARRIERS:
            self._held = deque()
        self._spawn(self._finish_sync(key, cmd, result, received))

    async def _finish_sync(self, key: tuple[bytes, int], cmd: Command, pending: Awaitable[dict[str, Any]],
                           received: float) -> None:  # fmt: skip
        code, detail, result = ErrorCode.OK, "", {}
        try:
            result = await pending
        except ProtocolError as exc:
            code, detail = exc.code, exc.detail
        except Exception as exc:
            log.exception("%s failed", cmd.TYPE.name)
            code, detail = ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        self._inflight.discard(key)
        self.outcomes.send(key[0], cmd.TYPE, cmd.req_id, code, detail, result, received)
        if cmd.TYPE in BARRIERS:
            self._release_held()

    def _release_held(self) -> None:
        """Judges what waited behind a barrier, in order; a later barrier holds the rest again."""
        held, self._held = self._held, None
        while held:
            identity, cmd, received = held.popleft()
            self.accept(identity, cmd, received)
            behind = self._barrier_queue()
            if behind is not None:  # that one was a barrier: the rest waits for it
                behind.extend(held)
                return

    def _barrier_queue(self) -> deque[tuple[bytes, Command, float]] | None:
        return self._held

    @property
    def held(self) -> int:
        return len(self._held) if self._held is not None else 0
