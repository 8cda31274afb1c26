"""What /proc says about another process: shared by the daemon (is an attached runner gone
or orphaned?) and the vLLM plug-in (has the daemon or vLLM's own process tree changed?)."""

from __future__ import annotations

from typing import NamedTuple


class ProcStat(NamedTuple):
    state: str  # one letter: R running, S sleeping, D disk wait, T/t stopped, ...
    ppid: int
    start_ticks: int  # start time after boot in clock ticks: a pid reused later differs here


def proc_stat(pid: int) -> ProcStat | None:
    """State, parent pid and start time of a process; None when it is gone, a zombie, or
    its stat cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name (field 2) may hold spaces and ")": split after its last ")".
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return ProcStat(fields[0].decode(), int(fields[1]), int(fields[19]))
