"""Transport-free logic shared by the sync and asyncio engine clients.

It numbers commands, fans them out (one Command per rank), files every outcome (event or
reply) into the PendingTable, and watches boot ids: an outcome whose boot id differs from
the one a rank said hello with means that daemon restarted, so that rank's in-flight
commands fail at once with DAEMON_RESTARTED and a new hello is queued.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

from ..protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Command,
    ErrorCode,
    Hello,
    MsgType,
    Outcome,
    Ping,
)
from .commands import Fields
from .pending import Completion, PendingTable

log = logging.getLogger(__name__)

_MAX_CONTROL = 4096  # unanswered pings/hellos remembered
_CONTROL_WAIT_S = 0.5


class EngineCore:
    def __init__(
        self, n_links: int, name: str, events: str, timeout_s: float, heartbeat_s: float, events_key: str | None = None
    ) -> None:
        self.name, self.events = name, events
        self.events_key = events_key  # the CURVE public key of a tcp event socket (protocol 1.2)
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s
        self.boot_ids: list[str | None] = [None] * n_links
        self.rank_of: list[int] = list(range(n_links))  # link index -> daemon rank, from hello
        self.pending = PendingTable(list(range(n_links)))
        self._ids = itertools.count(1)
        self._control: set[int] = set()  # req_ids of our own pings and hellos
        self._last_control = 0.0  # when the last of them was made
        self._last_beat = time.monotonic()

    def next_req_id(self) -> int:
        return next(self._ids)

    def hello(self) -> Hello:
        return Hello(
            req_id=self._control_id(), protocol=[PROTOCOL_MAJOR, PROTOCOL_MINOR],
            client=self.name, role="engine", events=self.events, pid=os.getpid(), batch_events=True,
            events_key=self.events_key,
        )  # fmt: skip

    def awaiting_control(self, now: float) -> bool:
        """Whether a ping or hello made lately still awaits its reply (one to a dead daemon
        never gets one: after _CONTROL_WAIT_S it no longer counts)."""
        return bool(self._control) and now - self._last_control < _CONTROL_WAIT_S

    def _control_id(self) -> int:
        req_id = self.next_req_id()
        self._last_control = time.monotonic()
        self._control.add(req_id)
        if len(self._control) > _MAX_CONTROL:  # pings to a dead daemon are never answered
            self._control = set(sorted(self._control)[-_MAX_CONTROL // 4 :])
        return req_id

    def accept_hellos(self, outcomes: list[Outcome]) -> None:
        ranks = [o.rank for o in outcomes]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"daemons report duplicate ranks {ranks}; give each one a distinct daemon.rank")
        self.rank_of = ranks
        self.boot_ids = [o.boot_id for o in outcomes]
        self.pending = PendingTable(ranks)

    def build(self, op: MsgType, fields: Fields, timeout_s: float | None) -> tuple[int, list[dict[str, Any]]]:
        """The wire body of ``op`` for each link, registered as pending. Bodies are built
        directly (no message object): this is the engine's per-command cost; the daemon
        validates every field anyway."""
        req_id = self.next_req_id()
        bodies = []
        for index, rank in enumerate(self.rank_of):
            body = {**(fields(rank) if callable(fields) else fields), "req_id": req_id}
            boot_id = self.boot_ids[index]
            if boot_id is not None:
                body["boot_id"] = boot_id
            bodies.append(body)
        self.pending.add(req_id, op, self.timeout_s if timeout_s is None else timeout_s)
        return req_id, bodies

    def send_failed(self, index: int, req_id: int, detail: str) -> list[Completion]:
        out = Outcome(req_id, "", self.rank_of[index], int(ErrorCode.SEND_FAILED), detail, {}, 0)
        done = self.pending.record(out)
        return [done] if done else []

    def on_outcome(
        self, outcome: Outcome, index: int | None = None
    ) -> tuple[list[Completion], list[tuple[int, Command]]]:
        """Files an event (index None) or a reply from link ``index``.

        Returns finished completions and control commands to send (re-hellos)."""
        if index is None:
            if outcome.rank not in self.rank_of:
                log.warning("event from unknown rank %d dropped", outcome.rank)
                return [], []
            index = self.rank_of.index(outcome.rank)
        done: list[Completion] = []
        resend: list[tuple[int, Command]] = []
        if outcome.code == ErrorCode.DUPLICATE_REQ_ID:  # about a refused copy, never the command itself
            log.warning("rank %d refused a duplicate of req_id %d", outcome.rank, outcome.req_id)
            return done, resend
        if outcome.req_id in self._control:
            self._control.discard(outcome.req_id)
            if outcome.op == MsgType.HELLO and outcome.ok:
                self.boot_ids[index] = outcome.boot_id
                return done, resend
        known = self.boot_ids[index]
        if known is not None and outcome.boot_id and outcome.boot_id != known:
            log.warning("rank %d restarted (boot %s -> %s)", self.rank_of[index], known, outcome.boot_id)
            self.boot_ids[index] = None  # until the new hello's reply
            done += self.pending.fail_rank(
                self.rank_of[index], ErrorCode.DAEMON_RESTARTED, "daemon restarted; command lost", outcome.boot_id
            )
            resend.append((index, self.hello()))
            return done, resend
        if outcome.req_id in self.pending:
            finished = self.pending.record(outcome)
            if finished is not None:
                done.append(finished)
        return done, resend

    def link_lost(self, index: int) -> list[Completion]:
        """The connection to a daemon dropped: what was in flight there will get no outcome
        (or one nobody can trust), so it fails now; the next hello finds out who answers."""
        rank = self.rank_of[index]
        if self.boot_ids[index] is not None:
            log.warning("lost the connection to rank %d", rank)
        self.boot_ids[index] = None
        return self.pending.fail_rank(rank, ErrorCode.DAEMON_LOST, "connection to the daemon lost; outcome unknown")

    def heartbeat(self, now: float | None = None) -> list[tuple[int, Command]]:
        """Pings every link each heartbeat_s; replies reveal restarts through their boot id."""
        now = time.monotonic() if now is None else now
        if now - self._last_beat < self.heartbeat_s:
            return []
        self._last_beat = now
        out: list[tuple[int, Command]] = []
        for index, boot in enumerate(self.boot_ids):
            out.append((index, self.hello() if boot is None else Ping(req_id=self._control_id())))
        return out

    def expire(self) -> list[Completion]:
        return self.pending.expire()
