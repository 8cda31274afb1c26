"""A lane: one direction of one attached cache, run from the event loop's thread.

Issue. ``submit`` takes a batch of commands (the daemon hands over a loop turn's ready
swaps of one direction at once) and issues it as *units*: up to ``unit_blocks`` block pairs
each, gathered across the batch's commands, one id slot each, one method each
(methods.MethodChooser), ending in one doorbell write. A large command spans several units
(its chunks); a batch has at most ``lookahead`` units in flight and takes turns with the
other batches waiting, so a small swap behind a large one waits a chunk, not the whole
swap. Cancel tokens are read as each unit is built: a command cancelled before its first
unit never starts, one cancelled later stops after its issued units. Units go to the lane's
streams in turn.

Completion. Each stream's doorbell is a pinned 64-bit word the stream overwrites with the
sequence number of every unit it finishes, so one read settles every finished unit of that
stream. The loop reads it (``poll``) in every loop iteration while a unit it expects soon is
in flight (a ``call_soon`` re-armed each time: about a microsecond an iteration, sockets
still served). A unit predicted to take longer than ``spin_ns`` (bytes at the method's
measured rate) gets a blocking event recorded after it; the cache's one watcher thread
waits for it and wakes the loop once, which then reads the doorbells. A unit running past
its prediction by ``spin_ns`` is handed to the watcher the same way; one not done long
after its prediction (``stall_ns``) fails the lane, as does an error from the driver.

Nothing here blocks, and nothing allocates beyond a few small Python objects per unit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...protocol import ErrorCode, ProtocolError
from ..base import Direction, SwapRequest
from .driver import Driver, DriverError, HostBuffer
from .methods import CopyMethod, LaneMemory, MethodChooser
from .threads import Watcher

log = logging.getLogger(__name__)

Results = list[BaseException | None]
STAGES = ("queued", "issued", "done", "settled")
_STAGE_ROWS = 4096  # units whose stage times are kept (a ring)
_DOORBELL_STRIDE = 8  # words between two streams' doorbells (one cache line each)
_RATE_MIN_BYTES = 1 << 20  # smaller units are bound by their launch, not by the link


@dataclass(frozen=True)
class LaneSettings:
    unit_blocks: int  # block pairs per unit at most
    lookahead: int = 2  # units of one batch in flight at once
    spin_ns: int = 300_000  # poll every loop iteration for units due within this
    stall_ns: int = 5_000_000_000  # a unit this late past its prediction fails the lane
    launch_ns: int = 15_000  # predicted time from issue to the GPU starting a unit
    initial_gbps: float = 20.0  # predicted rate of a method before it was measured


class Batch:
    """One ``submit``: its commands, where issuing stands, and the future of its results."""

    __slots__ = ("cmd", "future", "in_flight", "parked", "pos", "queued_ns", "requests", "results")

    def __init__(self, requests: Sequence[SwapRequest], future: asyncio.Future[Results]) -> None:
        self.requests, self.future = requests, future
        self.results: Results = [None] * len(requests)
        self.cmd = self.pos = self.in_flight = 0  # next pair to issue: requests[cmd] pair pos
        self.parked = False  # waits for one of its units to settle (lookahead reached)
        self.queued_ns = time.perf_counter_ns()

    @property
    def issued_all(self) -> bool:
        return self.cmd >= len(self.requests)

    def fail(self, commands: Iterable[int], error: BaseException) -> None:
        for index in commands:
            if self.results[index] is None:
                self.results[index] = error


_FIRST = (0,)  # the commands of a batch of one


class Unit:
    __slots__ = ("batch", "commands", "dev", "due_ns", "error", "host", "issued_ns", "method", "nbytes", "seq", "slot",
                 "staging", "stream")  # fmt: skip

    def __init__(
        self, batch: Batch, commands: Sequence[int], dev: Sequence[int], host: Sequence[int], method: CopyMethod
    ) -> None:
        self.batch, self.commands, self.dev, self.host, self.method = batch, commands, dev, host, method
        self.nbytes = 0
        self.slot = self.staging = self.seq = self.stream = 0
        self.issued_ns = self.due_ns = 0
        self.error: BaseException | None = None


class StreamState:
    __slots__ = ("address", "fifo", "handle", "index", "last_done_ns", "last_due_ns", "seq", "watched")

    def __init__(self, index: int, handle: int, address: int) -> None:
        self.index, self.handle, self.address = index, handle, address
        self.fifo: deque[Unit] = deque()
        self.seq = 0  # last unit issued
        self.watched = 0  # last unit a watcher event covers
        self.last_due_ns = self.last_done_ns = 0


class Lane:
    def __init__(
        self, direction: Direction, driver: Driver, memory: LaneMemory, methods: dict[str, CopyMethod],
        chooser: MethodChooser, streams: Sequence[int], doorbells: HostBuffer, events: list[int], watcher: Watcher,
        settings: LaneSettings, host_block_bytes: int,
    ) -> None:  # fmt: skip
        self.direction, self.driver, self.memory, self.methods = direction, driver, memory, methods
        self.chooser, self.watcher, self.settings, self.block_bytes = chooser, watcher, settings, host_block_bytes
        self.doorbells = doorbells.words
        self._bells = doorbells.words.data  # a plain read per poll, no numpy scalar
        self.streams = [
            StreamState(i, h, doorbells.device_address + i * _DOORBELL_STRIDE * 8) for i, h in enumerate(streams)
        ]
        self.events = events  # free blocking events for the watcher
        self.free_slots = list(range(memory.shape.slots))
        self.free_staging = list(range(len(memory.staging)))
        self.waiting: deque[Batch] = deque()
        self.other: Lane | None = None  # the other direction (duplex rule)
        self.in_flight = 0
        self.broken: BaseException | None = None
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._next_stream = 0
        self._poll_scheduled = False
        self._stall_timer: asyncio.TimerHandle | None = None
        self._rate = {name: settings.initial_gbps for name in methods}  # GB/s (bytes per ns), measured
        self._ns_per_byte = {name: 1.0 / settings.initial_gbps for name in methods}
        self.stages = np.zeros((_STAGE_ROWS, len(STAGES)), dtype=np.int64)
        self._stage_words = self.stages.reshape(-1).data
        self.counts = {"units": 0, "bytes": 0, "polls": 0, "watched": 0, "wakes": 0}
        self.by_method = dict.fromkeys(methods, 0)
        self._early = (chooser.early(False), chooser.early(True))  # fixed per attach, unless None
        self._launch_ns, self._spin_ns = settings.launch_ns, settings.spin_ns

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or bool(self.waiting)

    # Issue --------------------------------------------------------------------------------

    def submit(self, requests: Sequence[SwapRequest]) -> asyncio.Future[Results]:
        """Issues what it can now; the future resolves, on this loop, with one result per
        command once every unit of the batch has finished."""
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            self._adopt(loop)
        future: asyncio.Future[Results] = loop.create_future()
        batch = Batch(requests, future)
        if self.broken is not None or self.closed:
            batch.fail(range(len(requests)), self.broken or _closed())
            future.set_result(batch.results)
        elif self.waiting or not self.free_slots:  # others were first
            self.waiting.append(batch)
        else:
            state = self._issue_next(batch)
            if state > 0 and not batch.issued_all:  # a large swap: its second unit too, now
                self._requeue(batch)
                self._pump()
            elif state < 0:
                self.waiting.append(batch)
            elif state == 0:
                self._maybe_done(batch)
        return future

    def _adopt(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop this lane settles on (a daemon has one; tests and benchmarks may run
        one after another, never two at once)."""
        if self.busy:
            raise RuntimeError("a cuda lane is busy on another event loop")
        self.loop = loop
        self._poll_scheduled = False
        self._stall_timer = None
        self.driver.bind_thread()

    def _pump(self) -> None:
        """Issues units while slots are free, one batch after another in turn."""
        if self.closed:
            return
        waiting, free = self.waiting, self.free_slots
        while waiting and free:
            batch = waiting.popleft()
            state = self._issue_next(batch)
            if state < 0:  # no staging slot now: wait for one
                waiting.appendleft(batch)
                return
            if state == 0:
                self._maybe_done(batch)
            elif not batch.issued_all:
                self._requeue(batch)

    def _requeue(self, batch: Batch) -> None:
        if batch.in_flight < self.settings.lookahead:
            self.waiting.append(batch)
        else:
            batch.parked = True

    def _issue_next(self, batch: Batch) -> int:
        """Issues the batch's next unit: 1; or 0 when nothing is left (cancelled commands
        skipped), -1 when its method needs a staging slot and none is free."""
        other = self.other
        name = self._early[1 if other is not None and (other.in_flight or other.waiting) else 0]
        method = self.methods[name] if name is not None else None
        if method is not None and method.needs_staging and not self.free_staging:
            return -1
        requests = batch.requests
        if batch.cmd == 0 and len(requests) == 1 and len(requests[0][0]) <= self.settings.unit_blocks:
            dev, host, cancel = requests[0]  # the common case: one command, one unit
            batch.cmd = 1
            if cancel.cancelled or not dev:
                if cancel.cancelled:
                    batch.fail(_FIRST, ProtocolError(cancel.code, cancel.detail))
                return 0
            commands: Sequence[int] = _FIRST
        else:
            dev, host = [], []
            commands = self._take(batch, dev, host)
            if not dev:
                return 0
        if method is None:
            method = self._late(dev, host)
        unit = Unit(batch, commands, dev, host, method)
        unit.slot = self.free_slots.pop()
        if method.needs_staging:
            unit.staging = self.free_staging.pop()
        self._issue(unit, len(dev) * self.block_bytes)
        return 1

    def _late(self, dev: Sequence[int], host: Sequence[int]) -> CopyMethod:
        other = self.other
        name = self.chooser.late(dev, host, other is not None and other.busy)
        if self.methods[name].needs_staging and not self.free_staging:
            name = "kernel" if "kernel" in self.methods else "dma"
        return self.methods[name]

    def _take(self, batch: Batch, dev: list[int], host: list[int]) -> list[int]:
        """Moves up to unit_blocks pairs from the batch's cursor into ``dev`` / ``host``;
        returns the commands they belong to."""
        room, commands, requests = self.settings.unit_blocks, [], batch.requests
        while room and batch.cmd < len(requests):
            device_ids, host_ids, cancel = requests[batch.cmd]
            if cancel.cancelled:  # before its first unit, or between two of its units
                batch.fail([batch.cmd], ProtocolError(cancel.code, cancel.detail))
                batch.cmd, batch.pos = batch.cmd + 1, 0
                continue
            pos, total = batch.pos, len(device_ids)
            take = min(room, total - pos)
            if take == total:
                dev += device_ids
                host += host_ids
            elif take:
                dev += device_ids[pos : pos + take]
                host += host_ids[pos : pos + take]
            if take:
                commands.append(batch.cmd)
            room -= take
            batch.pos = pos + take
            if batch.pos >= total:
                batch.cmd, batch.pos = batch.cmd + 1, 0
        return commands

    def _issue(self, unit: Unit, nbytes: int) -> None:
        streams = self.streams
        stream = streams[self._next_stream]
        self._next_stream = (stream.index + 1) % len(streams)
        stream.seq += 1
        unit.seq, unit.stream, unit.nbytes = stream.seq, stream.index, nbytes
        try:
            unit.method.issue(unit.slot, unit.staging, unit.dev, unit.host, stream.handle)
        except DriverError as exc:  # the unit's commands fail; its slot comes back with the doorbell
            unit.error = exc
        try:
            self.driver.write_doorbell(stream.handle, stream.address, unit.seq)
        except DriverError as exc:
            stream.seq -= 1
            self._fail_lane(exc, extra=unit)
            return
        now = unit.issued_ns = time.perf_counter_ns()
        start = now + self._launch_ns
        if stream.last_due_ns > start:
            start = stream.last_due_ns
        unit.due_ns = stream.last_due_ns = start + int(nbytes * self._ns_per_byte[unit.method.name])
        stream.fifo.append(unit)
        unit.batch.in_flight += 1
        self.in_flight += 1
        if unit.due_ns - now > self._spin_ns and self._watch(stream):
            return
        if not self._poll_scheduled:  # spin: read the doorbell next loop iteration
            self._poll_scheduled = True
            self.loop.call_soon(self.poll)  # type: ignore[union-attr]

    # Completion ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Settles every unit whose doorbell has passed, issues what that freed, and decides
        how the next completion will be noticed. Runs on the loop."""
        self._poll_scheduled = False
        self.counts["polls"] += 1
        now = time.perf_counter_ns()
        bells = self._bells
        for stream in self.streams:
            fifo = stream.fifo
            if not fifo:
                continue
            seen = bells[stream.index * _DOORBELL_STRIDE]
            while fifo and fifo[0].seq <= seen:
                self._settle(fifo.popleft(), stream, now)
        if self.broken is None:
            if self.waiting:
                self._pump()
            if self.in_flight:
                self._arm(now)

    def _settle(self, unit: Unit, stream: StreamState, now: int) -> None:
        self.free_slots.append(unit.slot)
        if unit.method.needs_staging:
            self.free_staging.append(unit.staging)
        self.in_flight -= 1
        name, counts = unit.method.name, self.counts
        started = unit.issued_ns if unit.issued_ns > stream.last_done_ns else stream.last_done_ns
        stream.last_done_ns = now
        if unit.nbytes >= _RATE_MIN_BYTES and now > started and unit.error is None:
            self._measured(name, unit.nbytes / (now - started))
        self.by_method[name] += 1
        units = counts["units"] = counts["units"] + 1
        counts["bytes"] += unit.nbytes
        batch = unit.batch
        if unit.error is not None:
            batch.fail(unit.commands, unit.error)
        batch.in_flight -= 1
        settled = now
        if not batch.in_flight and batch.cmd >= len(batch.requests) and not batch.parked:
            settled = self._maybe_done(batch)
        row, words = (units % _STAGE_ROWS) * 4, self._stage_words
        words[row], words[row + 1], words[row + 2], words[row + 3] = batch.queued_ns, unit.issued_ns, now, settled
        if batch.parked:
            batch.parked = False
            self.waiting.append(batch)

    def _measured(self, name: str, gbps: float) -> None:
        """The method's rate, smoothed (bytes per ns = GB/s), from units large enough that
        their time is mostly the link's."""
        rate = self._rate[name] = 0.8 * self._rate[name] + 0.2 * max(0.05, gbps)
        self._ns_per_byte[name] = 1.0 / rate

    def _maybe_done(self, batch: Batch) -> int:
        """Resolves the batch's future when it has nothing left to issue or wait for;
        returns when (0: not yet)."""
        if batch.in_flight or not batch.issued_all or batch.parked or batch.future.done():
            return 0
        batch.future.set_result(batch.results)
        return time.perf_counter_ns()

    def _arm(self, now: int) -> None:
        """Spin (poll next iteration) while an unwatched unit is due soon; hand a unit that
        overran its prediction to the watcher."""
        spin = False
        for stream in self.streams:
            if not stream.fifo:
                continue
            head = stream.fifo[0]
            if head.seq <= stream.watched:
                continue
            if now > head.due_ns + self.settings.spin_ns and self._watch(stream):
                continue
            spin = True
        if spin and not self._poll_scheduled:
            self._poll_scheduled = True
            assert self.loop is not None
            self.loop.call_soon(self.poll)
        if self.in_flight:
            self._arm_stall_timer()

    def _watch(self, stream: StreamState) -> bool:
        """Records an event after everything issued on ``stream`` for the watcher; False
        when every event is in use (the loop keeps polling instead)."""
        if not self.events:
            return False
        event = self.events.pop()
        try:
            self.driver.record_event(event, stream.handle)
        except DriverError as exc:
            self.events.append(event)
            self._fail_lane(exc)
            return True
        stream.watched = stream.seq
        self.counts["watched"] += 1
        assert self.loop is not None
        self.watcher.watch(event, self._woken, self.loop)
        self._arm_stall_timer()
        return True

    def _woken(self, event: int, error: BaseException | None) -> None:
        """The watcher's event passed (or failed): on the loop."""
        self.events.append(event)
        self.counts["wakes"] += 1
        if error is not None:
            self._fail_lane(error)
            return
        if self.broken is None:
            self.poll()

    def _arm_stall_timer(self) -> None:
        if self._stall_timer is None and self.loop is not None:
            self._stall_timer = self.loop.call_later(self.settings.stall_ns / 1e9, self._check_stall)

    def _check_stall(self) -> None:
        self._stall_timer = None
        if self.broken is not None or not self.in_flight:
            return
        self.poll()
        now = time.perf_counter_ns()
        late = [s.fifo[0] for s in self.streams if s.fifo and now > s.fifo[0].due_ns + self.settings.stall_ns]
        if late:
            seconds = (now - late[0].issued_ns) / 1e9
            self._fail_lane(
                DriverError(f"the GPU has not finished a {self.direction.value} copy after {seconds:.1f} s")
            )
        elif self.in_flight:
            self._arm_stall_timer()

    def _fail_lane(self, error: BaseException, extra: Unit | None = None, quiet: bool = False) -> None:
        """A driver error: every command with work in flight or waiting fails, and so does
        every later one (the GPU may still write to the rings: nothing is reused)."""
        if self.broken is None:
            if not quiet:
                log.error("cuda %s lane failed: %s", self.direction.value, error)
            self.broken = error
        units = [u for s in self.streams for u in s.fifo] + ([extra] if extra is not None else [])
        for stream in self.streams:
            stream.fifo.clear()
        batches = {id(u.batch): u.batch for u in units} | {id(b): b for b in self.waiting}
        self.waiting.clear()
        self.in_flight = 0
        for batch in batches.values():
            batch.fail(range(len(batch.requests)), error)
            batch.in_flight, batch.parked, batch.cmd = 0, False, len(batch.requests)
            self._maybe_done(batch)
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    # Reporting ----------------------------------------------------------------------------

    def stage_percentiles(self) -> dict[str, dict[str, float]]:
        """µs from each stage to the next (p50, p90) over the units kept."""
        rows = self.stages[self.stages[:, 1] > 0]
        if not len(rows):
            return {}
        out = {}
        for i in range(1, len(STAGES)):
            span = (rows[:, i] - rows[:, i - 1]) / 1e3
            out[f"{STAGES[i - 1]}_to_{STAGES[i]}_us"] = {
                "p50": round(float(np.percentile(span, 50)), 1), "p90": round(float(np.percentile(span, 90)), 1)
            }  # fmt: skip
        return out

    def describe(self) -> dict[str, Any]:
        return {**self.counts, "by_method": dict(self.by_method), "in_flight": self.in_flight,
                "rates_gbps": {k: round(v, 2) for k, v in self._rate.items()}, "stages": self.stage_percentiles(),
                "broken": None if self.broken is None else str(self.broken)}  # fmt: skip

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until every unit issued has passed its doorbell (close, when a drain did
        not end in time). Reads only: the loop settles them (``finish_closed``)."""
        deadline = time.monotonic() + timeout_s
        while not all(int(self.doorbells[s.index * _DOORBELL_STRIDE]) >= s.seq for s in self.streams):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def finish_closed(self) -> None:
        """On the loop, after close: settles what finished, fails what never will run."""
        self.closed = True
        if self.loop is None:
            return
        self.poll()
        if self.busy:
            self._fail_lane(_closed(), quiet=True)


def _closed() -> ProtocolError:
    return ProtocolError(ErrorCode.DETACHED, "the device cache was closed")
