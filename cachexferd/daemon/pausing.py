"""PAUSE and RESUME: the quiet point an RL weight update needs.

While paused, every command that copies KV (swaps, store, load) is refused with PAUSED
rather than queued: a copy queued before a weight update would otherwise run after it,
mixing KV of two weight versions; refusing hands the decision back to the engine, which
knows whether to recompute. CLEAR_HOST, LOOKUP and DELETE are still served (clearing the
host tier is part of an update). PAUSE replies once every command accepted before it has
its outcome; past its drain timeout the rest are cancelled (their outcome is PAUSED).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from ..protocol import ErrorCode, ProtocolError
from .ordering import BlockOrdering

log = logging.getLogger(__name__)


class Pausing:
    def __init__(self, ordering: BlockOrdering[Any]) -> None:
        self.ordering = ordering
        self.paused = False

    def require_running(self) -> None:
        if self.paused:
            raise ProtocolError(ErrorCode.PAUSED, "the daemon is paused (weight update); RESUME it first")

    def pause(self, drain_timeout_s: float) -> Awaitable[dict[str, Any]]:
        """Takes effect now (later copies are refused); the result waits for the quiet."""
        self.paused = True
        log.info("paused: refusing copies until RESUME")
        return self._quiet(self.ordering.active(), drain_timeout_s)

    async def _quiet(self, entries: list[Any], drain_timeout_s: float) -> dict[str, Any]:
        finished = {entry: entry.when_finished() for entry in entries}
        pending: set[asyncio.Future[None]] = set(finished.values())
        if pending:
            _, pending = await asyncio.wait(pending, timeout=drain_timeout_s)
        for entry, future in finished.items():
            if future in pending:
                entry.cancel.cancel(ErrorCode.PAUSED, "cancelled by PAUSE after its drain timeout")
        if pending:
            await asyncio.wait(pending)  # cancelled copies stop at their next checkpoint
        cancelled = sum(e.weight for e in entries if e.code == ErrorCode.PAUSED)
        # ``paused`` describes this PAUSE, which took effect when it was read (arrival order is
        # the order of effect): a RESUME read before this reply does not change it.
        return {"paused": True, "drained": sum(e.weight for e in entries) - cancelled, "cancelled": cancelled}

    def resume(self) -> dict[str, Any]:
        was, self.paused = self.paused, False
        if was:
            log.info("resumed")
        return {"paused": False, "was_paused": was}
