"""Aggregation of per-rank outcomes into one Completion per command (pure logic).

A command fanned out to every tensor-parallel rank is done when every rank has reported;
it succeeded when all of them report ok. A rank that misses the deadline, or whose daemon
restarted (new boot id), is recorded as a client-side error for that rank.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any

from ..protocol import ErrorCode, MsgType, Outcome


@dataclass(slots=True)
class Completion:
    req_id: int
    op: MsgType
    outcomes: dict[int, Outcome] = field(default_factory=dict)  # by rank
    submitted: float = 0.0
    finished: float = 0.0

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes.values())

    @property
    def errors(self) -> dict[int, tuple[str, str]]:
        """rank -> (error name, detail) for every rank that failed."""
        return {rank: (o.error, o.detail) for rank, o in self.outcomes.items() if not o.ok}

    @property
    def latency_s(self) -> float:
        return self.finished - self.submitted

    def result(self, rank: int | None = None) -> dict[str, Any]:
        """The result map of ``rank`` (default: the lowest rank)."""
        return self.outcomes[min(self.outcomes) if rank is None else rank].result

    def min_result(self, key: str) -> int:
        """Smallest value of an integer result across ranks (e.g. a load's delivered prefix)."""
        return min(int(o.result.get(key, 0)) for o in self.outcomes.values())

    def describe(self) -> str:
        if self.ok:
            return f"{self.op.name.lower()} #{self.req_id} ok"
        parts = ", ".join(f"rank {r}: {name} ({detail})" for r, (name, detail) in sorted(self.errors.items()))
        return f"{self.op.name.lower()} #{self.req_id} failed: {parts}"


class _Pending:
    __slots__ = ("completion", "deadline", "waiting")

    def __init__(self, completion: Completion, deadline: float, waiting: set[int]) -> None:
        self.completion = completion
        self.deadline = deadline
        self.waiting = waiting  # ranks that have not reported


class PendingTable:
    """Deadlines sit in a heap, so ``expire`` (called at every step) costs nothing until the
    earliest one has passed, however many commands are pending."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline, req_id); finished ones are skipped

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._pending

    def add(self, req_id: int, op: MsgType, timeout_s: float, ranks: list[int] | None = None) -> None:
        now = time.monotonic()
        deadline = now + timeout_s
        completion = Completion(req_id, op, {}, now)
        self._pending[req_id] = _Pending(completion, deadline, set(self.ranks if ranks is None else ranks))
        heapq.heappush(self._deadlines, (deadline, req_id))

    def record(self, outcome: Outcome) -> Completion | None:
        """Files one rank's outcome; returns the Completion when it was the last one."""
        entry = self._pending.get(outcome.req_id)
        if entry is None or outcome.rank not in entry.waiting:
            return None  # late (after a timeout) or duplicate
        entry.waiting.discard(outcome.rank)
        entry.completion.outcomes[outcome.rank] = outcome
        return self._finish_if_done(outcome.req_id, entry)

    def fail_rank(self, rank: int, code: ErrorCode, detail: str, boot_id: str = "") -> list[Completion]:
        done = []
        for req_id, entry in list(self._pending.items()):
            if rank in entry.waiting:
                self._fail(entry, rank, code, detail, boot_id)
                finished = self._finish_if_done(req_id, entry)
                if finished is not None:
                    done.append(finished)
        return done

    def expire(self, now: float | None = None) -> list[Completion]:
        now = time.monotonic() if now is None else now
        done = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, req_id = heapq.heappop(self._deadlines)
            entry = self._pending.get(req_id)
            if entry is None or entry.deadline > now:
                continue  # finished already
            for rank in list(entry.waiting):
                self._fail(entry, rank, ErrorCode.CLIENT_TIMEOUT, "no outcome before the client's deadline")
            finished = self._finish_if_done(req_id, entry)
            if finished is not None:
                done.append(finished)
        return done

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._pending:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    @staticmethod
    def _fail(entry: _Pending, rank: int, code: ErrorCode, detail: str, boot_id: str = "") -> None:
        entry.waiting.discard(rank)
        c = entry.completion
        c.outcomes[rank] = Outcome(c.req_id, boot_id, rank, int(code), detail, {}, int(c.op))

    def _finish_if_done(self, req_id: int, entry: _Pending) -> Completion | None:
        if entry.waiting:
            return None
        del self._pending[req_id]
        entry.completion.finished = time.monotonic()
        return entry.completion
