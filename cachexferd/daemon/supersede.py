"""When a new runner may take the device slot from the attached one (ATTACH ``supersede``, 1.2).

A runner that was SIGKILLed is detached by the pid watch; but one whose engine died around
it (an orphaned worker process, still alive) keeps its attachment, and its successor would
be refused with ALREADY_ATTACHED for as long as the orphan lives. An ATTACH with
``supersede: true`` replaces the attached runner when:

- the asking process is known (an ipc connection: the kernel names its uid and pid), and
  runs as the same user as the attached runner (or as root); and
- the attached runner is gone, or is orphaned: its parent process is no longer the one it
  had when it attached.

A live runner whose parent is alive is never replaced: its engine is still running.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..procs import proc_stat
from ..security import Peer


@dataclass(frozen=True)
class RunnerProcess:
    """What the daemon noted of an attached runner when it attached."""

    pid: int
    ppid: int | None  # its parent then (None: unknown, e.g. another pid namespace)
    uid: int | None  # its user (None: unknown)

    @classmethod
    def note(cls, pid: int | None, peer: Peer | None) -> RunnerProcess | None:
        if pid is None:
            return None
        uid = peer.uid if peer is not None and peer.pid == pid else _uid(pid)
        return cls(pid, _ppid(pid), uid)


def supersede_refusal(attached: RunnerProcess | None, asker: Peer | None) -> str | None:
    """Why ``asker`` may not replace the attached runner, or None when it may."""
    if attached is None:
        return "the attached runner named no pid, so its state cannot be checked"
    if asker is None:
        return "the asking process is unknown (supersede needs an ipc connection)"
    if asker.uid != 0 and attached.uid != asker.uid:
        return f"the attached runner (pid {attached.pid}) runs as uid {attached.uid}, the asker as uid {asker.uid}"
    if not _alive(attached.pid):
        return None
    ppid = _ppid(attached.pid)
    if attached.ppid is not None and ppid is not None and ppid != attached.ppid:
        return None  # its parent died: orphaned
    return f"the attached runner (pid {attached.pid}) is alive and its parent (pid {ppid}) too"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _ppid(pid) is not None  # a zombie has exited


def _ppid(pid: int) -> int | None:
    """The parent pid of a running process (None: gone, a zombie, or unreadable)."""
    stat = proc_stat(pid)
    return None if stat is None else stat.ppid


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
