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
    decode_commands,
    decode_frames,
)
from .groups import SwapGroups
from .request import Request

if TYPE_CHECKING:
    from ..metrics import BatchStats
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
    """Accepted asynchronous commands are registered with the block ordering together, at
    the end of the message that carried them (a BATCH envelope's worth at once), or before
    any synchronous command runs, so what that command sees (PAUSE's drain, DETACH's, a
    STATUS) includes every command that arrived before it."""

    def __init__(
        self, handlers: Handlers, jobs: Jobs, outcomes: Outcomes, sessions: Sessions, max_inflight: int,
        admit: Admit, spawn: Spawn, groups: SwapGroups, batch_stats: BatchStats,
    ) -> None:  # fmt: skip
        self.handlers, self.jobs, self.outcomes, self.sessions = handlers, jobs, outcomes, sessions
        self.max_inflight, self._admit, self._spawn = max_inflight, admit, spawn
        self._held: deque[Request] | None = None  # behind a running barrier
        self._accepted: list[Request] = []  # asynchronous commands accepted, not yet registered
        self._accepted_commands = 0  # how many commands those hold (a group holds several)
        self.groups = groups
        self.batch_stats = batch_stats

    # Frames ---------------------------------------------------------------------------

    def on_frames(self, identity: bytes, frames: list[bytes], received: float) -> None:
        """One message from the command socket: a command or a BATCH of them."""
        cmds = decode_commands(frames)  # the typed fast path: well-formed traffic
        if cmds is None:
            self._on_checked_frames(identity, frames, received)
        else:
            if frames[0][3] == MsgType.BATCH:
                self._count_batch(len(cmds))
            if len(cmds) == 1 or not self._accept_groups(identity, cmds, received):
                for cmd in cmds:  # in order, exactly as if they had arrived one by one
                    self.accept(Request(identity, cmd, received))
        self._register_accepted()

    def _on_checked_frames(self, identity: bytes, frames: list[bytes], received: float) -> None:
        """Whatever the fast path did not take, decoded field by field: the error outcomes."""
        try:
            msg_type, body = decode_frames(frames)
            if msg_type != MsgType.BATCH:
                self.accept(Request(identity, command_from_body(msg_type, body), received))
                return
            items = batch_items(body)
        except ProtocolError as exc:
            self._refuse(identity, exc, received)
            return
        self._count_batch(len(items))
        for item in items:
            try:
                cmd = batch_item(item)
            except ProtocolError as exc:
                self._refuse(identity, exc, received)
                continue
            self.accept(Request(identity, cmd, received))

    def _count_batch(self, commands: int) -> None:
        stats = self.batch_stats
        stats.envelopes += 1
        stats.commands += commands

    def _refuse(self, identity: bytes, exc: ProtocolError, received: float) -> None:
        self.outcomes.send(Request.refused(identity, exc, received), exc.code, exc.detail, {})

    # Commands -------------------------------------------------------------------------

    def accept(self, req: Request) -> None:
        cmd = req.cmd
        assert cmd is not None
        if self._held is not None and cmd.TYPE not in IMMEDIATE:
            self._held.append(req)
            return
        if self.outcomes.in_flight(req.identity, req.req_id):
            detail = f"req_id {req.req_id} is already in flight; this refusal is not that command's outcome"
            self.outcomes.send(req, ErrorCode.DUPLICATE_REQ_ID, detail, {}, as_reply=True)
            return
        try:
            if cmd.TYPE not in IMMEDIATE:
                self._admit(cmd)
            if cmd.ASYNC:
                self._start_job(req, cmd)
            else:
                self._run_sync(req, cmd)
        except ProtocolError as exc:
            self.outcomes.send(req, exc.code, exc.detail, {})
        except Exception as exc:  # a bug in a handler: this command still gets its outcome
            log.exception("%s req_id=%d failed", cmd.TYPE.name, req.req_id)
            self.outcomes.send(req, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", {})

    def _accept_groups(self, identity: bytes, cmds: list[Command], received: float) -> bool:
        """A BATCH of swaps as groups (groups.py), when the per-command path would accept
        every command; False, with nothing changed, when it must judge them one by one."""
        if self._held is not None:
            return False
        session = self.sessions.get(identity)
        if session is None or session.events is None or not session.batch_events:
            return False
        if len(self.jobs.ordering) + self._accepted_commands + len(cmds) > self.max_inflight:
            return False
        req_ids = {cmd.req_id for cmd in cmds}
        if len(req_ids) < len(cmds) or 0 in req_ids or self.outcomes.any_in_flight(identity, req_ids):
            return False
        groups = self.groups.plan(identity, cmds, received)
        if groups is None:
            return False
        for group in groups:
            self.outcomes.track(group, session)
            self._accepted.append(group)
            self._accepted_commands += group.weight
        self.batch_stats.grouped_swaps += len(cmds)
        return True

    def _start_job(self, req: Request, cmd: Command) -> None:
        session = self.sessions.get(req.identity)
        if session is None or session.events is None:
            raise ProtocolError(
                ErrorCode.NO_EVENT_CHANNEL, "asynchronous commands need a hello that names an events endpoint"
            )
        if len(self.jobs.ordering) + self._accepted_commands >= self.max_inflight:
            raise ProtocolError(ErrorCode.BUSY, f"{self.max_inflight} commands in flight; retry later")
        req.job = self.handlers.jobs[cmd.TYPE](cmd)
        self.outcomes.track(req, session)
        self._accepted.append(req)
        self._accepted_commands += 1

    def _register_accepted(self) -> None:
        accepted, self._accepted = self._accepted, []
        if accepted:
            self._accepted_commands = 0
            self.jobs.submit(accepted)

    def _run_sync(self, req: Request, cmd: Command) -> None:
        self._register_accepted()  # what arrived before this command is in flight for it
        if cmd.TYPE == MsgType.HELLO:
            self.outcomes.flush()  # events batched for the channel this hello may replace go out first
        result = self.handlers.sync[cmd.TYPE](req.identity, cmd)
        if isinstance(result, dict):
            self.outcomes.send(req, ErrorCode.OK, "", result)
            return
        self.outcomes.track(req, self.sessions.get(req.identity))
        if cmd.TYPE in BARRIERS:
            self._held = deque()
        self._spawn(self._finish_sync(req, cmd, result))

    async def _finish_sync(self, req: Request, cmd: Command, pending: Awaitable[dict[str, Any]]) -> None:
        code, detail, result = ErrorCode.OK, "", {}
        try:
            result = await pending
        except ProtocolError as exc:
            code, detail = exc.code, exc.detail
        except Exception as exc:
            log.exception("%s failed", cmd.TYPE.name)
            code, detail = ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        self.outcomes.finish(req, code, detail, result)
        if cmd.TYPE in BARRIERS:
            self._release_held()

    def _release_held(self) -> None:
        """Judges what waited behind a barrier, in order; a later barrier holds the rest again."""
        held, self._held = self._held, None
        while held:
            self.accept(held.popleft())
            behind = self._barrier_queue()
            if behind is not None:  # that one was a barrier: the rest waits for it
                behind.extend(held)
                break
        self._register_accepted()

    def _barrier_queue(self) -> deque[Request] | None:
        return self._held

    @property
    def held(self) -> int:
        return len(self._held) if self._held is not None else 0
