"""Watching a peer process for its exit: a pidfd on the event loop, or polling where pidfds
are not available (a pid from another pid namespace). Used for attached runners (their
memory must not stay mapped) and for engines (their sessions and files are reclaimed)."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable

_PID_POLL_S = 1.0


class PidWatch:
    """Calls ``on_exit`` once, on the loop, when ``pid`` exits (at once if it already has)."""

    def __init__(self, pid: int, on_exit: Callable[[], None]) -> None:
        self.pid = pid
        self._on_exit = on_exit
        self._pidfd: int | None = None
        self._poll: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(pid)
            loop.add_reader(self._pidfd, self._fire)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                loop.call_soon(self._fire)
            else:
                self._poll = loop.create_task(self._poll_pid())

    async def _poll_pid(self) -> None:
        while True:
            await asyncio.sleep(_PID_POLL_S)
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._fire()
                return
            except PermissionError:
                pass  # alive, owned by someone else

    def _fire(self) -> None:
        callback, self._on_exit = self._on_exit, _nothing
        self.stop()
        callback()

    def stop(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._poll is not None and self._poll is not asyncio.current_task():
            self._poll.cancel()
        self._poll = None


def _nothing() -> None:
    pass
