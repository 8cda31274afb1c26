"""Every thread the cuda backend starts: the completion watcher of each attached cache, and
the host pool's pinning workers. The copy path itself runs on the event loop's thread
(lanes.py); these threads only block where the loop must not.

The watcher waits, one event at a time and in the order given, for blocking-sync events
recorded after long units, and then wakes the loop once per event with
``call_soon_threadsafe``. It never touches a lane's state: the loop reads the doorbells
when it wakes, so one wake settles everything finished by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable

from .driver import Driver, DriverError

log = logging.getLogger(__name__)

Wake = Callable[[int, BaseException | None], None]  # (event, error): runs on the loop


class Watcher:
    def __init__(self, driver: Driver, name: str = "cx-cuda-watch") -> None:
        self.driver = driver
        self._queue: queue.SimpleQueue[tuple[int, Wake, asyncio.AbstractEventLoop] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._name = name

    def watch(self, event: int, wake: Wake, loop: asyncio.AbstractEventLoop) -> None:
        """Calls ``wake(event, error)`` on ``loop`` once ``event`` has passed (error: the
        driver's, when waiting failed). Any thread may call it."""
        if not self._started:
            self._started = True
            self._thread.start()
        self._queue.put((event, wake, loop))

    def _run(self) -> None:
        self.driver.bind_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, wake, loop = item
            error: BaseException | None = None
            try:
                self.driver.wait_event(event)
            except DriverError as exc:  # an asynchronous CUDA error surfaces here
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(wake, event, error)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stops after the wait in progress; False when that wait did not end in time."""
        if not self._started:
            return True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("%s: still waiting for the GPU after %.0f s; leaving it", self._name, timeout_s)
            return False
        return True


def start_threads(count: int, target: Callable[[], None], name: str) -> list[threading.Thread]:
    """``count`` daemon threads running ``target`` (the pinning workers)."""
    threads = [threading.Thread(target=target, name=f"{name}-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads
