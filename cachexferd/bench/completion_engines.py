"""The scheduler loop of ``cachexferd bench completion`` and its client-side engines.

The scheduler does a step of CPU work, then takes the completions that arrived and submits
the commands that are due. An engine is how completions reach it: ``ClientEngine``
(EngineClient, ``poll()`` at the boundary), ``AsyncClientEngine`` (AsyncEngineClient
futures), ``IdleEngine`` (no traffic) and, in ``polled_queue``, the polled manager queue.
Engines use only the clients' public API.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..protocol import KVLayout, MsgType
from .completion_report import StepLog

# 2 layers x K/V of 2 KiB chunks: 8 KiB per block, so the copy itself is negligible.
LAYOUT = KVLayout(num_layers=2, num_blocks=256, block_size=16, num_kv_heads=1, head_dim=64, dtype="float16")


# The scheduler's work -----------------------------------------------------------------


def burn(n: int) -> int:
    """Pure Python work that holds the GIL, like a scheduler step."""
    x = 0
    for i in range(n):
        x = (x + i * i) % 1_000_003
    return x


def calibrate(step_s: float) -> tuple[Callable[[], int], int, float]:
    """(work, iterations, measured seconds): ``work()`` takes about ``step_s`` unloaded."""
    n = 2000
    best = min(_timed(n) for _ in range(20))
    n = max(1, round(n * step_s / best))
    measured = min(_timed(n) for _ in range(20))
    return (lambda: burn(n)), n, measured


def _timed(n: int) -> float:
    start = time.perf_counter()
    burn(n)
    return time.perf_counter() - start


def processes_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads) so far; a process
    that is gone counts 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


# The engines (how completions reach the scheduler) -------------------------------------


class ClientTime:
    """Wall time the scheduler thread spends inside the client, by part (submit, poll,
    yield). perf_counter only: a thread_time() call costs about a microsecond here, as much
    as a tenth of what it would measure."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}

    @staticmethod
    def start() -> float:
        return time.perf_counter()

    def stop(self, part: str, started: float) -> None:
        self.wall[part] = self.wall.get(part, 0.0) + time.perf_counter() - started


class Engine(Protocol):
    client_time: ClientTime

    def begin(self) -> None: ...
    def submit(self, count: int) -> None: ...
    def collect(self) -> list[tuple[float, bool]]: ...  # (origin time, ok) seen now
    @property
    def expected(self) -> int: ...
    def settled(self) -> bool: ...
    def peer_cpu_s(self) -> float: ...  # CPU time so far of the processes at the other end


class IdleEngine:
    expected = 0

    def __init__(self) -> None:
        self.client_time = ClientTime()

    def begin(self) -> None:
        pass

    def submit(self, count: int) -> None:
        pass

    def collect(self) -> list[tuple[float, bool]]:
        return []

    def settled(self) -> bool:
        return True

    def peer_cpu_s(self) -> float:
        return 0.0


def swap_command(i: int) -> tuple[MsgType, dict[str, list[int]]]:
    """Command ``i``: swap-out and swap-in alternate, each on block i mod num_blocks, so
    consecutive commands touch different blocks and never wait for one another."""
    block = i % LAYOUT.num_blocks
    return (MsgType.SWAP_OUT if i % 2 == 0 else MsgType.SWAP_IN), {"device_ids": [block], "host_ids": [block]}


class OriginEngine:
    """An engine that notes each command's submit time until its completion is seen."""

    def __init__(self, daemon_pids: list[int]) -> None:
        self.daemon_pids = daemon_pids
        self.origins: dict[int, float] = {}  # req_id -> submit time
        self.errors: Counter[str] = Counter()  # error name -> failed completions
        self.sent = 0
        self.client_time = ClientTime()

    def begin(self) -> None:
        pass

    @property
    def expected(self) -> int:
        return self.sent

    def settled(self) -> bool:
        return not self.origins

    def peer_cpu_s(self) -> float:
        return processes_cpu_s(self.daemon_pids)


class ClientEngine(OriginEngine):
    """EngineClient: submits swaps, ``poll()`` once per step boundary. ``batched``: the
    swaps of one step go out together (``with client.batch():``, one BATCH per rank)."""

    def __init__(self, client: Any, daemon_pids: list[int], batched: bool = False) -> None:
        super().__init__(daemon_pids)
        self.client, self.batched = client, batched

    def submit(self, count: int) -> None:
        started = self.client_time.start()
        with self.client.batch() if self.batched else contextlib.nullcontext():
            for _ in range(count):
                op, fields = swap_command(self.sent)
                swap = self.client.swap_out if op is MsgType.SWAP_OUT else self.client.swap_in
                origin = time.monotonic()
                self.origins[swap(fields["device_ids"], fields["host_ids"])] = origin
                self.sent += 1
        self.client_time.stop("submit", started)

    def collect(self) -> list[tuple[float, bool]]:
        started = self.client_time.start()
        done = self.client.poll()
        self.client_time.stop("poll", started)
        self.errors.update(name for c in done if not c.ok for name, _ in c.errors.values())
        return [(self.origins.pop(c.req_id), c.ok) for c in done if c.req_id in self.origins]


class AsyncClientEngine(ClientEngine):
    """AsyncEngineClient: ``submit()`` returns a future per command. The pump resolves it
    while the scheduler yields between steps (that yield is timed as client time); its
    done-callback, like the wake-up of a task awaiting it, runs one loop iteration later."""

    def __init__(self, client: Any, daemon_pids: list[int]) -> None:
        super().__init__(client, daemon_pids)
        self.outstanding = 0
        self.arrived: list[tuple[float, bool]] = []

    def submit(self, count: int) -> None:
        started = self.client_time.start()
        for _ in range(count):
            origin = time.monotonic()
            future = self.client.submit(*swap_command(self.sent))
            future.add_done_callback(functools.partial(self._arrived, origin))
            self.sent += 1
            self.outstanding += 1
        self.client_time.stop("submit", started)

    def _arrived(self, origin: float, future: asyncio.Future[Any]) -> None:
        ok = not future.cancelled() and future.exception() is None and future.result().ok
        self.arrived.append((origin, ok))

    def collect(self) -> list[tuple[float, bool]]:
        seen, self.arrived = self.arrived, []
        self.outstanding -= len(seen)
        return seen

    def settled(self) -> bool:
        return not self.outstanding


def steps(engine: Engine, work: Callable[[], Any], rate: float, duration_s: float, drain_s: float,
          log: StepLog) -> Iterator[None]:  # fmt: skip
    """The scheduler: a step of work, then take completions and submit what is due; yields
    after each step. After ``duration_s`` it submits nothing and steps on until every
    completion arrived or ``drain_s`` more passed."""
    cpu0, proc0 = time.thread_time(), time.process_time()
    engine.begin()
    peer0 = engine.peer_cpu_s()
    start = time.monotonic()
    end, submitted, in_traffic = start + duration_s, 0, True
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        work()
        log.work_s += time.perf_counter() - t0
        log.work_cpu_s += time.thread_time() - c0
        seen = engine.collect()
        now = time.monotonic()  # after collect: nothing seen can postdate its boundary
        log.boundaries.append(now)
        log.seen += [(origin, len(log.boundaries) - 1) for origin, _ in seen]
        log.failed += sum(not ok for _, ok in seen)
        if now < end:
            due = int((now - start) * rate) - submitted
            if due > 0:
                engine.submit(due)
                submitted += due
        elif in_traffic:
            in_traffic = False
            log.traffic_steps, log.traffic_s, log.delivered_in_run = len(log.boundaries), now - start, len(log.seen)
            log.traffic_work_cpu_s = log.work_cpu_s
        if not in_traffic and (engine.settled() or now >= end + drain_s):
            break
        yield
    log.thread_cpu_s, log.process_cpu_s = time.thread_time() - cpu0, time.process_time() - proc0
    log.peer_cpu_s = engine.peer_cpu_s() - peer0
