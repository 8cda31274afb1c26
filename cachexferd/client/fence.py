"""The client's side of the device fence (protocol 1.5, docs/protocol.md §7.14).

A client that stops waiting for a copy into its device blocks (the daemon is stopped or
starved of CPU) recomputes those blocks and will reuse them. That is safe only once no copy
into them can still land. A daemon whose ATTACH result says ``device_fence: "flock"`` makes
every copy into device blocks whose command carries a ``not_after`` while holding a shared
flock on its own open file description of the device segment, and checks that ``not_after``
once it holds it. So after a
copy's ``not_after`` has passed, an exclusive flock taken without waiting on the client's own
open file description of the segment tells: got it, no copy is running and none can start;
refused, a copy is running right now (try again later). A daemon that died holds nothing.
"""

from __future__ import annotations

import fcntl
import os


class DeviceFence:
    def __init__(self, path: str) -> None:
        """``path``: the device segment, opened here anew (``/proc/self/fd/N`` for a descriptor):
        a flock belongs to an open file description, and the daemon has its own."""
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def quiet(self) -> bool:
        """Whether no copy into the device blocks is running now. Never waits."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
