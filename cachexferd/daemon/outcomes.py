"""Sends the one outcome of every command, counts it, and batches events per wake-up.

Routing: the outcome of an asynchronous command from a client with an event channel goes
out as an EVENT on that channel; everything else (synchronous commands, commands that could
not be decoded or admitted before a session existed, and every DUPLICATE_REQ_ID refusal) is
a REPLY on the command socket. Clients that asked for batched events in their hello get the
events of one loop iteration in one EVENT_BATCH message per event endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..protocol import ASYNC_TYPES, ErrorCode, Limits, MsgType, encode_event_batch, encode_outcome_fields

if TYPE_CHECKING:
    from ..metrics import DaemonMetrics
    from .sessions import EventSinks, Sessions

log = logging.getLogger(__name__)

Reply = Callable[[bytes, list[bytes]], None]


def op_name(op: int) -> str:
    return MsgType(op).name.lower() if op in MsgType._value2member_map_ else "unknown"


def code_name(code: int) -> str:
    return "ok" if code == 0 else ErrorCode(code).name.lower()


class Outcomes:
    def __init__(
        self, boot_id: str, rank: int, metrics: DaemonMetrics, sessions: Sessions, sinks: EventSinks, reply: Reply
    ) -> None:
        self.boot_id, self.rank = boot_id, rank
        self.metrics, self.sessions, self.sinks, self._reply = metrics, sessions, sinks, reply
        self._pending: dict[str, list[list[Any]]] = {}  # event endpoint -> compact outcomes to batch
        self._scheduled = False
        # prometheus_client's labels() costs a locked lookup: keep the children.
        self._counted: dict[tuple[int, int], Any] = {}
        self._tally: dict[tuple[int, int], int] = {}
        self._timed: dict[int, Any] = {}

    def send(
        self, identity: bytes, op: int, req_id: int, code: int, detail: str, result: dict[str, Any], received: float,
        *, as_reply: bool = False,
    ) -> None:  # fmt: skip
        """Sends one command's outcome (exactly once per command: the caller's duty)."""
        self._count(op, code, received)
        if code != ErrorCode.OK:
            log.debug("%s req_id=%d -> %s: %s", op_name(op), req_id, code_name(code), detail)
        session = self.sessions.get(identity)
        if as_reply or op not in ASYNC_TYPES or not req_id or session is None or session.events is None:
            self._reply(identity, self._encode(MsgType.REPLY, req_id, op, code, detail, result))
        elif session.batch_events:
            self._queue(session.events, [req_id, op, code, detail, result])
        elif not self.sinks.send(session.events, self._encode(MsgType.EVENT, req_id, op, code, detail, result)):
            self.metrics.events_dropped.inc()

    def _encode(
        self, kind: MsgType, req_id: int, op: int, code: int, detail: str, result: dict[str, Any]
    ) -> list[bytes]:
        return encode_outcome_fields(kind, req_id, self.boot_id, self.rank, op, int(code), detail, result)

    def _count(self, op: int, code: int, received: float) -> None:
        key = (op, code)
        self._tally[key] = self._tally.get(key, 0) + 1  # added to the counter at the next flush
        self._schedule()
        timer = self._timed.get(op)
        if timer is None:
            timer = self._timed[op] = self.metrics.latency.labels(op_name(op))
        timer.observe(time.monotonic() - received)

    def _queue(self, endpoint: str, entry: list[Any]) -> None:
        self._pending.setdefault(endpoint, []).append(entry)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Sends the batched events (one EVENT_BATCH per endpoint, split at MAX_BATCH) and
        adds the tallied outcomes to the commands counter."""
        self._scheduled = False
        tally, self._tally = self._tally, {}
        for (op, code), count in tally.items():
            counter = self._counted.get((op, code))
            if counter is None:
                counter = self._counted[(op, code)] = self.metrics.commands.labels(op_name(op), code_name(code))
            counter.inc(count)
        pending, self._pending = self._pending, {}
        for endpoint, entries in pending.items():
            for start in range(0, len(entries), Limits.MAX_BATCH):
                chunk = entries[start : start + Limits.MAX_BATCH]
                if not self.sinks.send(endpoint, encode_event_batch(self.boot_id, self.rank, chunk)):
                    self.metrics.events_dropped.inc(len(chunk))
        self.sinks.close_retired()
