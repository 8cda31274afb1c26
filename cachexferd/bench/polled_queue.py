"""The polled-queue completion path that ``cachexferd bench completion`` compares against.

This is how engines commonly receive transfer completions without cachexferd: a
``multiprocessing`` manager serves a queue, the transfer process puts one record per
finished command into it, and a thread in the engine process polls it with
``get_nowait()``, sleeping 1 ms whenever it is empty, and hands what it got to the
scheduler (here through a ``collections.deque`` the scheduler drains at its step boundary).

Every ``get_nowait()`` is a round trip to the manager process, made by a Python thread that
needs the GIL, so the poller competes with the scheduler thread for it.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections import deque
from multiprocessing.managers import BaseManager
from typing import Any, cast

from .completion_engines import ClientTime, processes_cpu_s

# Lives in the manager's server process; clients reach it through proxies.
_COMPLETIONS: queue.Queue[tuple[int, float]] = queue.Queue()
_AUTHKEY = b"cachexferd-bench-completion"
_POLL_SLEEP_S = 0.001


def _completion_queue() -> queue.Queue[tuple[int, float]]:
    return _COMPLETIONS


class _QueueManager(BaseManager):
    pass


_QueueManager.register("completion_queue", callable=_completion_queue)


def _connect(address: tuple[str, int]) -> Any:
    manager = _QueueManager(address=address, authkey=_AUTHKEY)
    manager.connect()
    return manager.completion_queue()  # type: ignore[attr-defined]


def _produce(address: tuple[str, int], rate: float, duration_s: float, events: dict[str, Any], produced: Any) -> None:
    """The transfer process's side: one (seq, put time) record per command, at ``rate``/s.
    ``produced`` is a shared integer: how many records were put so far."""
    completions = _connect(address)
    events["ready"].set()
    events["go"].wait(30.0)
    start = time.monotonic()
    sent = 0
    while (now := time.monotonic()) < start + duration_s:
        for _ in range(int((now - start) * rate) - sent):
            completions.put((sent, time.monotonic()))
            sent += 1
            produced.value = sent
        time.sleep(0.0002)  # the next record is due in 1/rate s at the earliest
    events["done"].set()
    events["stop"].wait(60.0)  # stay until the engine has read our CPU time


def _poll(completions: Any, handoff: deque[tuple[int, float]], stop: threading.Event, cpu_s: list[float]) -> None:
    """The engine's poller thread, as the reference design had it: drain, else sleep 1 ms."""
    while not stop.is_set():
        try:
            handoff.append(completions.get_nowait())
        except queue.Empty:
            time.sleep(_POLL_SLEEP_S)
    cpu_s.append(time.thread_time())


class PolledQueueEngine:
    """A manager queue fed at ``rate``/s by a producer process, polled by a thread here.

    Same interface as the client adapters in ``completion``: ``begin()`` starts the
    traffic, ``submit()`` is a no-op (the producer keeps its own clock), ``collect()``
    drains the hand-off deque at the scheduler's step boundary.
    """

    def __init__(self, rate: float, duration_s: float) -> None:
        self.ctx = multiprocessing.get_context("spawn")  # no fork of a process with zmq threads
        self.manager = _QueueManager(address=("127.0.0.1", 0), authkey=_AUTHKEY, ctx=self.ctx)
        self.manager.start()
        address = cast(tuple[str, int], self.manager.address)
        self.events = {name: self.ctx.Event() for name in ("ready", "go", "done", "stop")}
        self.produced: Any = self.ctx.Value("q", 0, lock=False)  # written by the producer only
        self.producer = self.ctx.Process(
            target=_produce, args=(address, rate, duration_s, self.events, self.produced), daemon=True
        )
        self.producer.start()
        if not self.events["ready"].wait(60.0):
            self.close()
            raise RuntimeError("the polled-queue producer did not connect to its manager in 60 s")
        self.handoff: deque[tuple[int, float]] = deque()
        self.stop = threading.Event()
        self.poller_cpu: list[float] = []
        self.poller = threading.Thread(
            target=_poll, args=(_connect(address), self.handoff, self.stop, self.poller_cpu), daemon=True
        )
        self.delivered = 0
        self.client_time = ClientTime()

    def begin(self) -> None:
        self.poller.start()
        self.events["go"].set()

    def submit(self, count: int) -> None:
        pass

    def collect(self) -> list[tuple[float, bool]]:
        """(put time, ok) of every record the poller handed over since the last step."""
        started = self.client_time.start()
        seen: list[tuple[float, bool]] = []
        while True:
            try:
                seen.append((self.handoff.popleft()[1], True))
            except IndexError:
                break
        self.delivered += len(seen)
        self.client_time.stop("poll", started)
        return seen

    @property
    def expected(self) -> int:
        return int(self.produced.value)

    def settled(self) -> bool:
        return self.events["done"].is_set() and self.delivered >= self.expected

    def peer_cpu_s(self) -> float:
        """CPU time of the manager's server process and the producer."""
        return processes_cpu_s([p.pid for p in self.ctx.active_children() if p.pid is not None])

    def helper_cpu_s(self) -> float:
        """CPU time of the poller thread (valid after close())."""
        return self.poller_cpu[0] if self.poller_cpu else 0.0

    def close(self) -> None:
        self.stop.set()
        self.events["stop"].set()
        if self.poller.is_alive():
            self.poller.join(10.0)
        self.producer.join(10.0)
        if self.producer.is_alive():
            self.producer.kill()
            self.producer.join(10.0)
        self.manager.shutdown()
