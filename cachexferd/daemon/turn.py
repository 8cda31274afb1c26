"""Batch work deferred to the end of the event loop callback that caused it.

A command passes through stages that each batch what arrives together: the read of the
command socket, the start of the ready copies (``Jobs``), the flush of the outcomes
(``Outcomes``). Deferring each stage with ``call_soon`` costs a loop iteration per stage
(an ``epoll_wait`` and the loop's own bookkeeping), three per command when commands come
one at a time, and the outcome leaves only in the last. Inside ``Turn.run`` (the command
socket's read callback) the deferred stages run before the callback returns instead, in
the order they were deferred. Outside a turn (a copy finished in a task, a storage call
returned) the first deferral schedules one ``call_soon`` that runs the lot.

A turn runs at most ``MAX_ROUNDS`` rounds of deferred calls (work deferred by deferred
work); anything left goes to the next loop iteration, so a long chain of dependent copies
that release one another never keeps the loop from other sockets and timers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_ROUNDS = 4


class Turn:
    __slots__ = ("_calls", "_open", "_scheduled")

    def __init__(self) -> None:
        self._calls: list[Callable[[], None]] = []
        self._open = False  # inside run(): deferred calls run before it returns
        self._scheduled = False  # a call_soon of _run_scheduled is pending

    def defer(self, call: Callable[[], None]) -> None:
        """Runs ``call`` at the end of the current turn (or in the next loop iteration)."""
        self._calls.append(call)
        if not self._open:
            self._schedule()

    def run(self, first: Callable[[], None]) -> None:
        """Calls ``first``, then what it deferred (and what that deferred), in order."""
        if self._open:  # nested: the outer turn runs what this one defers
            first()
            return
        self._open = True
        try:
            first()
        finally:
            try:
                self._drain()
            finally:
                self._open = False

    def _drain(self) -> None:
        for _ in range(MAX_ROUNDS):
            if not self._calls:
                return
            calls, self._calls = self._calls, []
            for call in calls:
                try:
                    call()
                except Exception:  # as a loop callback's would be: logged, the others still run
                    log.exception("deferred call %r failed", call)
        if self._calls:
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run_scheduled)

    def _run_scheduled(self) -> None:
        self._scheduled = False
        self.run(_nothing)


def _nothing() -> None:
    pass
