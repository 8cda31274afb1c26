"""The client's side of the device fence (protocol 1.5 and 1.6, docs/protocol.md §7.14).

A client that stops waiting for a copy of its device blocks (the daemon is stopped or
starved of CPU) recomputes those blocks and will reuse them. That is safe only once no copy
of them can still run: one into them would overwrite what the client computed, one out of
them (1.6) would put what the client wrote since into host blocks under the old blocks'
identity keys. A daemon whose ATTACH result says ``device_fence: "flock"`` makes every copy
into device blocks (and, with ``device_fence_reads``, out of them) whose command carries a
``not_after`` while holding a shared flock on its own open file description of the device
segment, and checks that ``not_after`` once it holds it. So after a copy's ``not_after`` has
passed, an exclusive flock taken without waiting on the client's own open file description
of the segment tells: got it, no copy is running and none can start; refused, a copy is
running right now (try again later). A daemon that died holds nothing.

A client that must hand blocks back before the ``not_after`` of the copies it gave up (vLLM
reuses a store's blocks as soon as waiting for it ends) may instead keep the exclusive lock
until then (``hold_until``): no copy can start meanwhile, and any that starts afterwards is
too late and refused.
"""

from __future__ import annotations

import fcntl
import os
import time


class DeviceFence:
    def __init__(self, path: str) -> None:
        """``path``: the device segment, opened here anew (``/proc/self/fd/N`` for a descriptor):
        a flock belongs to an open file description, and the daemon has its own."""
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._held_until = 0.0  # wall clock: we hold the lock until then (0: we do not hold it)

    @property
    def held(self) -> bool:
        """Whether this client holds the fence now."""
        return self._held_until > 0

    def quiet(self) -> bool:
        """Whether no copy of the device blocks is running now. Never waits."""
        if self.held:
            return True
        if not self._take():
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def hold_until(self, until: float) -> bool:
        """Holds the fence (without waiting) until wall-clock time ``until`` (the later of this and
        any earlier one); False when a copy is running now."""
        if not self.held and not self._take():
            return False
        self._held_until = max(self._held_until, until)
        return True

    def release_if_due(self, now: float | None = None) -> None:
        """Lets copies run again once the time given to ``hold_until`` has passed."""
        if self.held and (time.time() if now is None else now) > self._held_until:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held_until = 0.0

    def _take(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        """Closes the descriptor (which drops a lock held)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._held_until = 0.0
