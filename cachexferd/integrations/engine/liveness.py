"""Is a daemon there, slow, stopped, or gone? Answered without ever blocking.

A ``Probe`` PINGs one daemon from a DEALER of its own (a non-blocking send; replies are
read at the next look) and remembers the boot id, the daemon's pid (from a STATUS it asks
for once per boot) and the host-cache generation the replies carry.

What counts as what (``Probe.verdict``):

- **lost**: a reply carries a new boot id (a restart: the host cache is gone); the
  daemon's process no longer exists (checked in /proc when the daemon is on this host, an
  ``ipc://`` endpoint); nothing listens on its ``ipc://`` socket any more (a daemon whose
  pid this process cannot see, e.g. in a sidecar container: a stopped or busy process still
  accepts connections, an exited one does not); or no reply at all for ``lost_after_s``
  (a daemon on another host, or one hung for good).
- **unresponsive**: alive but behind: a ping unanswered for ``slow_after_s``, or the process
  stopped (SIGSTOP, a debugger). The link is kept (the daemon keeps its attachment and its
  host blocks); the plug-in only stops giving it new work until it answers again.
- **up**: otherwise.

A daemon starved of CPU by the engine beside it answers late, not never: it is
unresponsive for a moment, never lost, so a loaded machine does not make the link flap.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import zmq

from ...client.link import ClientError, Link
from ...procs import proc_stat
from ...protocol import MsgType, Ping, Status


class Verdict(Enum):
    UP = "up"
    UNRESPONSIVE = "unresponsive"
    LOST = "lost"


class Probe:
    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.endpoint = endpoint
        self.local = endpoint.startswith("ipc://")
        self.link = Link(ctx, endpoint)
        self.boot_id: str | None = None  # from the last reply; None until one arrives
        self.pid: int | None = None  # the daemon's process, from a STATUS of this boot
        self.generation: int | None = None  # host-cache generation (protocol 1.2; None from older daemons)
        self.weights_version: int | None = None  # the daemon's weights version (None from older daemons)
        self.status: dict[str, Any] = {}  # the last STATUS result
        self.unanswered_since: float | None = None  # send time of the oldest unanswered ping
        self.last_reply = 0.0
        self._next_id = 0
        self._want_status = True
        self._listen_checked = 0.0  # when the ipc socket was last found listening

    def ping(self) -> bool:
        """Sends a PING (or a STATUS when one is due); False when nothing listens at the ipc path."""
        if self.local and not Path(self.endpoint[len("ipc://") :]).exists():
            return False
        self._next_id += 1
        now = time.monotonic()
        if self.unanswered_since is None:
            self.unanswered_since = now
        cmd = Status(req_id=self._next_id) if self._want_status else Ping(req_id=self._next_id)
        with contextlib.suppress(ClientError):  # a full queue: the next interval tries again
            self.link.send(cmd)
        return True

    @property
    def geometry_known(self) -> bool:
        """Whether the last STATUS gave the host cache's blocks (known once a runner attached)."""
        return bool((self.status.get("host_cache") or {}).get("num_blocks"))

    def ask_status(self) -> None:
        """The next ping is a STATUS (its result lands in ``status``)."""
        self._want_status = True

    def drain(self) -> None:
        while (outcome := self.link.recv_nowait()) is not None:
            if not outcome.ok:
                continue
            if outcome.boot_id != self.boot_id:
                self.pid = None
                self._want_status = True  # learn the new boot's pid
            self.boot_id = outcome.boot_id
            self.unanswered_since = None
            self.last_reply = time.monotonic()
            result = outcome.result
            if outcome.op == MsgType.STATUS:
                self.status = result
                pid = result.get("pid")
                # Checked locally only when that pid is the daemon here (not another pid namespace).
                self.pid = pid if self.local and isinstance(pid, int) and _is_daemon(pid) else None
                host = result.get("host_cache") or {}
                generation, weights = host.get("generation"), host.get("weights_version")
                # Until a runner attaches, the host block size (and count) is unknown: ask again.
                self._want_status = not host.get("num_blocks")
            else:
                generation, weights = result.get("host_generation"), result.get("weights_version")
            if isinstance(generation, int):
                self.generation = generation
            if isinstance(weights, int):
                self.weights_version = weights

    def verdict(
        self, now: float, known_boot: str | None, slow_after_s: float, lost_after_s: float
    ) -> tuple[Verdict, str]:
        """(verdict, why) for a daemon we hold a connection to (said hello under ``known_boot``)."""
        if self.boot_id is not None and known_boot is not None and self.boot_id != known_boot:
            return Verdict.LOST, f"daemon at {self.endpoint} restarted (boot {known_boot} -> {self.boot_id})"
        state = process_state(self.pid) if self.pid is not None else "unknown"
        if state == "gone":
            return Verdict.LOST, f"daemon at {self.endpoint} (pid {self.pid}) exited"
        silent = 0.0 if self.unanswered_since is None else now - self.unanswered_since
        if state == "unknown" and silent > slow_after_s and not self._still_listening(now):
            return Verdict.LOST, f"daemon at {self.endpoint} no longer listens"
        if silent > lost_after_s:
            return Verdict.LOST, f"daemon at {self.endpoint} did not answer for {silent:.0f}s"
        if state == "stopped":
            return Verdict.UNRESPONSIVE, f"daemon at {self.endpoint} (pid {self.pid}) is stopped"
        if silent > slow_after_s:
            return Verdict.UNRESPONSIVE, f"daemon at {self.endpoint} has not answered for {silent:.1f}s"
        return Verdict.UP, ""

    def _still_listening(self, now: float) -> bool:
        """For a silent local daemon whose pid is unknown: does its socket accept a
        connection? Asked at most every 0.1 s (a connect is a few µs, but steps are many)."""
        if not self.local or now - self._listen_checked < 0.1:
            return True
        if accepts_connections(self.endpoint[len("ipc://") :]):
            self._listen_checked = now
            return True
        return False

    def forget(self) -> None:
        """After a loss: the next reply starts afresh."""
        self.boot_id = None
        self.pid = None
        self.generation = None
        self.weights_version = None
        self._want_status = True

    def close(self) -> None:
        self.link.close()


def why_unreachable(endpoint: str) -> str:
    """What an operator checks first about a daemon that does not answer at ``endpoint``."""
    if not endpoint.startswith("ipc://"):
        return f"nothing answers at {endpoint}"
    path = Path(endpoint[len("ipc://") :])
    if str(path).startswith("@"):
        return f"nothing answers at the abstract socket {path}"
    if path.parent.is_dir() and not os.access(path.parent, os.X_OK):
        return (
            f"{path.parent} is not open to this user (the daemon's runtime directory admits its user and access.group)"
        )
    if not path.exists():
        return f"no socket at {path}: no daemon serves there yet, or the endpoint names another path"
    if not accepts_connections(str(path)):
        return f"the socket {path} exists but nothing listens on it: the daemon stopped and left it"
    return f"the daemon at {path} accepts connections but does not answer: stopped, hung or starting"


def process_state(pid: int) -> str:
    """'gone', 'stopped' or 'alive', from /proc/<pid>/stat (same pid namespace)."""
    stat = proc_stat(pid)
    if stat is None:
        return "gone"
    return "stopped" if stat.state in ("T", "t") else "alive"


def accepts_connections(path: str) -> bool:
    """Whether a process listens on the unix socket ``path`` (``@name``: abstract). Only a
    refused or missing socket says no: anything else (a full backlog, a permission) is
    taken as someone there."""
    address = "\0" + path[1:] if path.startswith("@") else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            sock.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True


def _is_daemon(pid: int) -> bool:
    """Whether ``pid`` here is a cachexferd process (its command line names it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"cachexferd" in f.read()
    except OSError:
        return False


# Lineage: is this process of an engine orphaned? ---------------------------------------------

# What the command line of a process started by multiprocessing (spawn or forkserver) holds.
_MULTIPROCESSING = (b"multiprocessing.spawn", b"multiprocessing.forkserver")


def engine_lineage(titles: Sequence[bytes], max_depth: int = 6) -> list[tuple[int, int]]:
    """(pid, start time) of the processes this one depends on: when the engine started it
    (a worker or engine-core process), its parent, and up through the engine's own processes
    to its main process (the first ancestor the engine did not spawn). A process the engine
    spawned is a multiprocessing child, or one whose command line starts with one of
    ``titles`` (the titles the engine gives its processes). Empty in a process the user
    started (an in-process engine): nothing above it is the engine's."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return []
    lineage: list[tuple[int, int]] = []
    pid = os.getppid()
    for _ in range(max_depth):
        info = proc_stat(pid)
        if info is None or pid <= 1:
            break
        lineage.append((pid, info.start_ticks))
        if not _spawned(pid, tuple(titles)):
            break  # the engine's main process: its own parent (a shell, systemd) does not matter
        pid = info.ppid
    return lineage


def orphaned(lineage: list[tuple[int, int]]) -> int | None:
    """The pid of the first process of ``lineage`` that is gone (or was replaced), else None."""
    for pid, started in lineage:
        info = proc_stat(pid)
        if info is None or info.start_ticks != started:
            return pid
    return None


def _spawned(pid: int, titles: tuple[bytes, ...]) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return cmdline.startswith(titles) or any(mark in cmdline for mark in _MULTIPROCESSING)
