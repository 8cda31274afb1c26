"""Sends the one outcome of every command, counts it, and batches events per wake-up; and
owns what is in flight: which (client, req_id) pairs have no outcome yet.

A command the dispatcher accepts for later (an asynchronous job, a synchronous command that
awaits, like ATTACH) is ``track``ed; its end, wherever it is decided (a copy, a storage
task, a barrier's reply), comes here through ``finish`` (or ``finish_many`` for a batch of
copies), which forgets it, updates its client's count and sends the outcome: one place
knows both, so a req_id is free for reuse exactly when its outcome leaves.

Routing: the outcome of an asynchronous command from a client with an event channel goes
out as an EVENT on that channel; everything else (synchronous commands, commands that could
not be decoded or admitted before a session existed, and every DUPLICATE_REQ_ID refusal) is
a REPLY on the command socket. Clients that asked for batched events in their hello get the
events of one turn (``turn.Turn``) in one EVENT_BATCH message per event endpoint.

Accounting is per flush as well: each outcome only counts itself under its op, code and
arrival time (the commands of one message share one); the flush (once per turn with
outcomes) adds them to the command counter and the latency histogram in one call per
(op, code).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..protocol import ASYNC_TYPES, ErrorCode, Limits, MsgType, encode_event_batch, encode_outcome_fields
from .groups import SwapGroup
from .request import Decided, Request
from .turn import Turn

if TYPE_CHECKING:
    from ..metrics import DaemonMetrics
    from .sessions import EventSinks, Session, Sessions

log = logging.getLogger(__name__)

Reply = Callable[[bytes, list[bytes]], None]


def op_name(op: int) -> str:
    return MsgType(op).name.lower() if op in MsgType._value2member_map_ else "unknown"


def code_name(code: int) -> str:
    return "ok" if code == 0 else ErrorCode(code).name.lower()


class Outcomes:
    def __init__(
        self, boot_id: str, rank: int, metrics: DaemonMetrics, sessions: Sessions, sinks: EventSinks, reply: Reply,
        turn: Turn | None = None,
    ) -> None:  # fmt: skip
        self.boot_id, self.rank = boot_id, rank
        self.turn = turn or Turn()
        self.metrics, self.sessions, self.sinks, self._reply = metrics, sessions, sinks, reply
        self._pending: dict[str, list[list[Any]]] = {}  # event endpoint -> compact outcomes to batch
        self._scheduled = False
        # (op, code) -> {arrival time: commands}, until the flush (a message's commands share one)
        self._decided: dict[tuple[int, int], dict[float, int]] = {}
        self._inflight: set[tuple[bytes, int]] = set()  # (client identity, req_id) without outcome

    # In flight ----------------------------------------------------------------------------

    def in_flight(self, identity: bytes, req_id: int) -> bool:
        return (identity, req_id) in self._inflight

    def any_in_flight(self, identity: bytes, req_ids: Iterable[int]) -> bool:
        return not self._inflight.isdisjoint([(identity, r) for r in req_ids])

    def track(self, req: Request, session: Session | None) -> None:
        """``req`` (a command, or a group of ``req.weight``) has no outcome yet: its req_ids
        are taken until ``finish``, and its client has that many more in flight."""
        if isinstance(req, SwapGroup):
            self._inflight.update(req.keys)
        else:
            self._inflight.add((req.identity, req.req_id))
        if session is not None:
            session.inflight += req.weight

    def finish(self, req: Request, code: int, detail: str, result: dict[str, Any]) -> None:
        """The end of a tracked command: forgets it and sends its outcome."""
        session = self.sessions.get(req.identity)
        if session is not None:
            session.inflight = max(0, session.inflight - req.weight)
        if isinstance(req, SwapGroup):
            self._inflight.difference_update(req.keys)
            self.send_group(session, req, code, detail, result)
            return
        self._inflight.discard((req.identity, req.req_id))
        self.send_to(session, req, code, detail, result)

    def finish_many(self, decided: list[Decided]) -> None:
        """``finish`` for the outcomes of a batch of copies, in order."""
        finish = self.finish
        for req, code, detail, result in decided:
            finish(req, code, detail, result)

    # Sending ------------------------------------------------------------------------------

    def send(self, req: Request, code: int, detail: str, result: dict[str, Any], *, as_reply: bool = False) -> None:
        """Sends one command's outcome (exactly once per command: the caller's duty)."""
        self.send_to(self.sessions.get(req.identity), req, code, detail, result, as_reply)

    def send_to(
        self, session: Session | None, req: Request, code: int, detail: str, result: dict[str, Any],
        as_reply: bool = False,
    ) -> None:  # fmt: skip
        """``send``, for a caller that has just looked up the sender's session."""
        op, req_id = req.op, req.req_id
        self._note(op, code, req.received, 1)
        if code and log.isEnabledFor(logging.DEBUG):  # the names cost more than the check
            log.debug("%s req_id=%d -> %s: %s", op_name(op), req_id, code_name(code), detail)
        if as_reply or op not in ASYNC_TYPES or not req_id or session is None or session.events is None:
            self._reply(req.identity, self._encode(MsgType.REPLY, req_id, op, code, detail, result))
        elif session.batch_events:
            self._queue(session.events, [[req_id, op, code, detail, result]])
        elif not self.sinks.send(session.events, self._encode(MsgType.EVENT, req_id, op, code, detail, result)):
            self.metrics.events_dropped.inc()

    def send_group(
        self, session: Session | None, group: SwapGroup, code: int, detail: str, result: dict[str, Any]
    ) -> None:
        """The outcome of every command of a group (same code and detail; each its own result)."""
        results = group.results(code, result)
        if session is None or session.events is None or not session.batch_events:  # its client changed its hello
            for cmd, own in zip(group.cmds, results):
                self.send_to(session, Request(group.identity, cmd, group.received), code, detail, own)
            return
        op = group.op
        self._note(op, code, group.received, len(group.cmds))
        if code and log.isEnabledFor(logging.DEBUG):
            log.debug("%r -> %s: %s", group, code_name(code), detail)
        self._queue(session.events, [[cmd.req_id, op, code, detail, own] for cmd, own in zip(group.cmds, results)])

    def _note(self, op: int, code: int, received: float, count: int) -> None:
        """Counts ``count`` outcomes of one arrival time for the next flush's accounting."""
        arrivals = self._decided.get((op, code))
        if arrivals is None:
            self._decided[(op, code)] = {received: count}
            self._schedule()
        else:
            arrivals[received] = arrivals.get(received, 0) + count

    def _encode(
        self, kind: MsgType, req_id: int, op: int, code: int, detail: str, result: dict[str, Any]
    ) -> list[bytes]:
        return encode_outcome_fields(kind, req_id, self.boot_id, self.rank, op, int(code), detail, result)

    def _queue(self, endpoint: str, entries: list[list[Any]]) -> None:
        pending = self._pending.get(endpoint)
        if pending is None:
            self._pending[endpoint] = entries
            self._schedule()
        else:
            pending += entries

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.turn.defer(self.flush)

    def flush(self) -> None:
        """Sends the batched events (one EVENT_BATCH per endpoint, split at MAX_BATCH) and
        accounts for the outcomes decided since the last flush."""
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for endpoint, entries in pending.items():
            for start in range(0, len(entries), Limits.MAX_BATCH):
                chunk = entries[start : start + Limits.MAX_BATCH]
                if not self.sinks.send(endpoint, encode_event_batch(self.boot_id, self.rank, chunk)):
                    self.metrics.events_dropped.inc(len(chunk))
        self.sinks.close_retired()
        self._account()

    def _account(self) -> None:
        decided, self._decided = self._decided, {}
        now = time.monotonic()
        for (op, code), arrivals in decided.items():
            latencies = [(now - t, n) for t, n in arrivals.items()]
            self.metrics.commands.record_counted(op_name(op), code_name(code), latencies)
