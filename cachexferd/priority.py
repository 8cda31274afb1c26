"""The daemon's CPU priority: it must run the moment a command arrives, also where every core
runs the engine.

A daemon mostly sleeps, and a Linux scheduler group that mostly sleeps (a session's
autogroup, a cgroup) weighs little against groups that are always busy: on a 2-core host
whose cores run vLLM's workers the daemon's loop was measured waiting seconds to run, and
the engine gave up its loads. Raising the priority of the daemon's threads (nice) and of its
autogroup, where the kernel groups by session, makes it run within milliseconds; the
daemon's CPU time stays what its copies need. Under systemd the unit sets ``Nice=`` and
``CPUWeight=`` for its cgroup as well (docs/operations.md, "CPU priority").
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")


def raise_priority(nice: int) -> str:
    """Sets this process's nice value (inherited by every thread started after it) and its
    autogroup's to ``nice``; returns one line saying what it did or why it could not. Call
    it before any thread starts: on Linux a nice value belongs to a thread."""
    done = []
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        done.append(f"nice {nice}")
    except PermissionError:
        return (
            f"CPU priority kept at nice {os.getpriority(os.PRIO_PROCESS, 0)}: nice {nice} needs root or "
            "CAP_SYS_NICE (docs/operations.md, 'CPU priority')"
        )
    if _set_autogroup(nice):
        done.append(f"autogroup nice {nice}")
    return "CPU priority: " + ", ".join(done)


def _set_autogroup(nice: int) -> bool:
    """The session's scheduling group (Linux autogroup): where the kernel groups tasks by
    session, the group's weight is what the daemon competes with. Absent elsewhere."""
    try:
        AUTOGROUP.write_text(str(nice))
    except OSError:
        return False  # no autogroup support, or not permitted: the nice value still helps within the group
    return True
