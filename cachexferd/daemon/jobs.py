"""Runs asynchronous commands: order them, execute them off the loop, emit one outcome each.

A Job is what a handler returns after validating a command: the blocks it touches and
either a copy (a swap) or a coroutine function (storage I/O, clear-host). ``Jobs.submit``
registers the accepted commands (Requests carrying their jobs) with the block ordering
synchronously, in arrival order, so arrival order is the order. A job with no unfinished
dependency is ready at once; the others become ready when the ordering releases what they
wait for. Nothing waits in a task of its own.

Ready jobs are started once per turn (``turn.Turn``: at the end of the loop callback that
made them ready): every ready copy of one direction goes to
the copy backend as one batch (one hand-off to the copy workers for the lot, not one per
command; a batch of a few small blocks is copied on the spot, see DeviceCache.inline_bytes),
a copy of no blocks ends at once, every other job runs as a task. Each job ends in
``_complete`` (a batch of copies in ``_copies_done``), which decides its outcome exactly
once, releases its blocks, hands the outcome to Outcomes (which owns what is in flight) and
starts whatever that made ready.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..backends.base import CancelToken, DeviceCache, Direction, InlineBusy, SwapRequest
from ..protocol import ErrorCode, ProtocolError
from .ordering import Access, BlockOrdering, Entry
from .request import Decided, Request
from .turn import Turn

if TYPE_CHECKING:
    from ..metrics import DaemonMetrics
    from .outcomes import Outcomes

log = logging.getLogger(__name__)

Work = Callable[[CancelToken], Awaitable[dict[str, Any]]]
Ordered = Entry[Request]  # a registered command: its payload is the Request, carrying its Job
MAX_COPY_BATCH = 256  # commands per hand-off: bounds how long the first of a burst waits for the last


class HoldBlocks(ProtocolError):
    """An error outcome for work that could not be stopped in time (a storage call stuck
    past its deadline). The outcome goes out at once, but the command's blocks stay
    reserved, so later commands touching them wait, until ``running`` resolves: a late
    read can never land in a host block the engine has reused meanwhile."""

    def __init__(self, code: ErrorCode, detail: str, running: Awaitable[Any]) -> None:
        super().__init__(code, detail)
        self.running = running


class Copy(NamedTuple):
    """A swap: block pairs between the attached device cache and the host cache."""

    cache: DeviceCache
    direction: Direction
    device_ids: Sequence[int]
    host_ids: Sequence[int]


class Job(NamedTuple):
    access: Access
    work: Work | None = None  # storage I/O, clear-host: a coroutine run as a task
    copy: Copy | None = None  # swaps: batched with the other ready copies
    # A copy's success, told before its outcome goes out (a SWAP_OUT's identity keys, 1.3).
    succeeded: Callable[[], None] | None = None
    # A swap: not started after this (wall clock, 1.5; math.inf: no limit); a SWAP_OUT that
    # ends after it sets no identity keys.
    not_after: float = math.inf


def _job(entry: Ordered) -> Job:
    job = entry.payload.job
    assert job is not None, "only accepted asynchronous commands are registered"
    return job


def _copy(entry: Ordered) -> Copy:
    copy = _job(entry).copy
    assert copy is not None, "only swaps reach the copy path"
    return copy


class Jobs:
    def __init__(
        self, ordering: BlockOrdering[Request], metrics: DaemonMetrics, outcomes: Outcomes, turn: Turn | None = None
    ) -> None:
        self.ordering = ordering
        self.turn = turn or Turn()
        self.metrics = metrics
        self.outcomes = outcomes  # every job's end goes there: the outcome, and what is in flight
        self._ready: list[Ordered] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._held: set[asyncio.Task[None]] = set()  # not awaited at shutdown: may never end
        self._moved = {d: metrics.transfer_bytes.labels(d.value) for d in Direction}

    def submit(self, requests: list[Request]) -> None:
        """Registers accepted commands (each with its job), in arrival order, and schedules
        the start of those that wait for nothing."""
        register = self.ordering.register
        ready = []
        for req in requests:
            job = req.job
            assert job is not None, "an accepted asynchronous command carries its job"
            entry = register(job.access, req, req.weight)
            entry.cancel.not_after = job.not_after
            if entry.unmet == 0:
                ready.append(entry)
        if ready:
            self._make_ready(ready)
        if len(ready) < len(requests):
            self._publish()

    def _make_ready(self, entries: list[Ordered]) -> None:
        self._ready.extend(entries)
        if not self._scheduled:
            self._scheduled = True
            self.turn.defer(self._start_ready)

    def _start_ready(self) -> None:
        self._scheduled = False
        ready, self._ready = self._ready, []
        batches: dict[tuple[int, Direction], list[Ordered]] = {}
        start = self.ordering.start
        for entry in ready:
            copy = _job(entry).copy
            cancel = entry.cancel
            # Cancelled while it waited, or a copy into device blocks whose client may have
            # given up on it meanwhile (not_after): it never starts. (Backends with a device
            # fence check not_after again inside it.)
            refusal = cancel.refusal(time.time()) if cancel.cancelled or cancel.not_after < math.inf else None
            if refusal is not None:
                self._complete(entry, refusal.code, refusal.detail, {})
                continue
            start(entry)
            if copy is None:
                self._spawn(self._run_work(entry))
                continue
            if not copy.device_ids:  # an empty swap: done, without troubling the backend
                self._copies_done([entry], [None], time.monotonic())
                continue
            key = (id(copy.cache), copy.direction)
            batch = batches.get(key)
            if batch is None:
                batches[key] = batch = []
            batch.append(entry)
            if len(batch) == MAX_COPY_BATCH:
                self._spawn(self._run_copies(batches.pop(key)))
        for batch in batches.values():
            self._start_copies(batch)
        self._publish()

    def _start_copies(self, entries: list[Ordered]) -> None:
        """Small batches are copied right here (cheaper than a hand-off); others off the loop."""
        first = _copy(entries[0])
        requests = _requests(entries)
        blocks = sum([len(r.device_ids) for r in requests])
        if blocks * first.cache.layout.host_block_bytes > first.cache.inline_bytes:
            self._spawn(self._run_copies(entries))
            return
        started = time.monotonic()
        try:
            errors = first.cache.swap_now(first.direction, requests)
        except InlineBusy:  # it would wait (a client checks the device fence): off the loop
            self._spawn(self._run_copies(entries))
            return
        except Exception as exc:  # a bug in the backend: every command of the batch fails
            errors = [exc] * len(entries)
        self._copies_done(entries, errors, started)

    async def _run_copies(self, entries: list[Ordered]) -> None:
        first = _copy(entries[0])
        started = time.monotonic()
        try:
            errors = await first.cache.swap_many(first.direction, _requests(entries))
        except Exception as exc:  # a bug in the backend: every command of the batch fails
            errors = [exc] * len(entries)
        self._copies_done(entries, errors, started)
        self._publish()

    def _copies_done(self, entries: list[Ordered], errors: list[BaseException | None], started: float) -> None:
        """The outcomes of a batch of copies, their blocks released together."""
        finished = time.monotonic()
        first = _copy(entries[0])
        block_bytes = first.cache.layout.host_block_bytes
        moved = 0
        ready: list[Ordered] = []
        decided: list[Decided] = []
        complete, ok = self.ordering.complete, ErrorCode.OK
        wall = time.time()
        for entry, error in zip(entries, errors):
            req = entry.payload
            if error is None and wall > entry.cancel.not_after and first.direction is Direction.D2H:
                # Its client may have given up and reused the device blocks while they were
                # read: the host blocks may hold a mix, so they get no identity keys (1.5).
                error = ProtocolError(ErrorCode.EXPIRED, f"copy ended {wall - entry.cancel.not_after:.3f}s after its "
                                      "not_after: its host blocks' identity keys are not set")  # fmt: skip
            if error is None:
                job = _job(entry)
                if job.succeeded is not None:
                    job.succeeded()
                blocks = len(_copy(entry).device_ids)
                size = blocks * block_bytes
                moved += size
                released = complete(entry, ok)
                if released:
                    ready += released
                decided.append((req, ok, "", {"blocks": blocks, "bytes": size, "started_at": started,
                                              "finished_at": finished}))  # fmt: skip
            else:
                code, detail = self._describe(entry, error)
                ready += complete(entry, code)
                decided.append((req, code, detail, {}))
        self.outcomes.finish_many(decided)  # after the releases: nothing reads them before the loop runs again
        if ready:
            self._make_ready(ready)
        self._moved[first.direction].inc(moved)

    async def _run_work(self, entry: Ordered) -> None:
        work = _job(entry).work
        assert work is not None, "a job is a copy or work"
        hold: Awaitable[Any] | None = None
        code, detail, result = ErrorCode.OK, "", {}
        try:
            started = time.monotonic()
            result = await work(entry.cancel)
            # Daemon-clock timestamps: how long the command waited for earlier ones, and
            # whether two commands overlapped.
            result["started_at"], result["finished_at"] = started, time.monotonic()
        except HoldBlocks as exc:
            code, detail, hold = exc.code, exc.detail, exc.running
        except Exception as exc:
            code, detail = self._describe(entry, exc)
        self._complete(entry, code, detail, result, hold)
        self._publish()

    def _describe(self, entry: Ordered, error: BaseException) -> tuple[ErrorCode, str]:
        if isinstance(error, ProtocolError):
            return error.code, error.detail
        req = entry.payload
        log.error("%s req_id=%d failed", req.cmd.TYPE.name if req.cmd else req.op, req.req_id, exc_info=error)
        return ErrorCode.INTERNAL, f"{type(error).__name__}: {error}"  # a bug must still produce an outcome

    def _complete(
        self, entry: Ordered, code: int, detail: str, result: dict[str, Any], hold: Awaitable[Any] | None = None
    ) -> None:
        if hold is None:
            ready = self.ordering.complete(entry, code)
            if ready:
                self._make_ready(ready)
        else:
            self.ordering.finish(entry, code)
            self._release_later(entry, hold)
        self.outcomes.finish(entry.payload, code, detail, result)

    def _release_later(self, entry: Ordered, running: Awaitable[Any]) -> None:
        async def release() -> None:
            try:
                await running
            finally:
                ready = self.ordering.release(entry)
                if ready:
                    self._make_ready(ready)
                self._publish()

        task = asyncio.get_running_loop().create_task(release())
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel_all(self, code: ErrorCode, detail: str) -> None:
        for entry in self.ordering.active():
            entry.cancel.cancel(code, detail)

    async def wait_all(self, timeout: float | None) -> bool:
        """True when every accepted job has its outcome within ``timeout``."""
        pending = {e.when_finished() for e in self.ordering.active()}
        if not pending:
            return True
        _, pending = await asyncio.wait(pending, timeout=timeout)
        return not pending

    @property
    def unfinished(self) -> int:
        return sum(self.ordering.counts())

    def _publish(self) -> None:
        self.metrics.queued.set(self.ordering.waiting)
        self.metrics.running.set(self.ordering.running)


# SwapRequest's own constructor checks its arguments by name; building the tuple directly
# skips that (one per command on the copy path).
_new_tuple: Any = tuple.__new__


def _requests(entries: list[Ordered]) -> list[SwapRequest]:
    requests = []
    for entry in entries:
        copy = _copy(entry)
        requests.append(_new_tuple(SwapRequest, (copy.device_ids, copy.host_ids, entry.cancel)))
    return requests
