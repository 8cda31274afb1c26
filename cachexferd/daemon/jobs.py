"""Runs asynchronous commands: order them, execute them off the loop, emit one event each.

A Job is what a handler returns after validating a command: the blocks it touches and a
coroutine function that does the work. ``Jobs.start`` registers the job with the block
ordering *synchronously* (so arrival order is the order), then a task waits for the jobs
it conflicts with, runs the work, and always emits exactly one outcome, whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends.base import CancelToken
from ..protocol import Command, ErrorCode, ProtocolError
from .ordering import Access, Entry

if TYPE_CHECKING:
    from .server import Daemon
    from .sessions import Session

log = logging.getLogger(__name__)

Work = Callable[[CancelToken], Awaitable[dict[str, Any]]]


class HoldBlocks(ProtocolError):
    """An error outcome for work that could not be stopped in time (a storage call stuck
    past its deadline). The outcome goes out at once, but the command's blocks stay
    reserved, so later commands touching them wait, until ``running`` resolves: a late
    read can never land in a host block the engine has reused meanwhile."""

    def __init__(self, code: ErrorCode, detail: str, running: Awaitable[Any]) -> None:
        super().__init__(code, detail)
        self.running = running


@dataclass(frozen=True)
class Job:
    access: Access
    work: Work


class Jobs:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.tasks: set[asyncio.Task[None]] = set()
        self._held: set[asyncio.Task[None]] = set()  # not awaited at shutdown: may never end

    def start(self, session: Session, cmd: Command, job: Job, received: float) -> None:
        entry, waits = self.daemon.ordering.register(job.access)
        session.inflight.add(cmd.req_id)
        task = asyncio.get_running_loop().create_task(self._run(session, cmd, job, entry, waits, received))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self._publish()

    async def _run(
        self, session: Session, cmd: Command, job: Job, entry: Entry, waits: list[asyncio.Future[None]], received: float
    ) -> None:
        code, detail, result = ErrorCode.OK, "", {}
        hold: Awaitable[Any] | None = None
        try:
            if waits:
                await asyncio.wait(waits)
            entry.cancel.check()
            entry.started = True
            self._publish()
            started = time.monotonic()
            result = await job.work(entry.cancel)
            # Daemon-clock timestamps: how long the command waited for earlier ones, and
            # whether two commands overlapped.
            result["started_at"], result["finished_at"] = started, time.monotonic()
        except HoldBlocks as exc:
            code, detail, hold = exc.code, exc.detail, exc.running
        except ProtocolError as exc:
            code, detail = exc.code, exc.detail
        except Exception as exc:  # a bug must still produce an outcome
            log.exception("%s req_id=%d failed", cmd.TYPE.name, cmd.req_id)
            code, detail = ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        finally:
            self.daemon.ordering.finish(entry, code)
            if hold is None:
                self.daemon.ordering.release(entry)
            else:
                self._release_later(entry, hold)
            session.inflight.discard(cmd.req_id)
            self._publish()
        self.daemon.finish(session.identity, cmd.TYPE, cmd.req_id, code, detail, result, received)

    def _release_later(self, entry: Entry, running: Awaitable[Any]) -> None:
        async def release() -> None:
            try:
                await running
            finally:
                self.daemon.ordering.release(entry)
                self._publish()

        task = asyncio.get_running_loop().create_task(release())
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    def cancel_all(self, code: ErrorCode, detail: str) -> None:
        for entry in self.daemon.ordering.active():
            entry.cancel.cancel(code, detail)

    async def wait_all(self, timeout: float | None) -> bool:
        """True when every job finished within ``timeout``."""
        if not self.tasks:
            return True
        _, pending = await asyncio.wait(set(self.tasks), timeout=timeout)
        return not pending

    def _publish(self) -> None:
        queued, running = self.daemon.ordering.counts()
        self.daemon.metrics.queued.set(queued)
        self.daemon.metrics.running.set(running)
