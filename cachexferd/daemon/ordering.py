"""Submission-order guarantees for commands that touch the same blocks.

Every asynchronous command declares which device and host blocks (and which storage keys)
it reads and writes.
A new command waits for every earlier, still-unfinished command it conflicts with:
read-after-write, write-after-read and write-after-write on any block. Commands with no
conflict start at once, so independent work overlaps. Registration happens on the event
loop in the order commands arrive, which is what makes the order the submission order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..backends.base import CancelToken


@dataclass(frozen=True)
class Access:
    device_read: frozenset[int] = frozenset()
    device_write: frozenset[int] = frozenset()
    host_read: frozenset[int] = frozenset()
    host_write: frozenset[int] = frozenset()
    all_host_write: bool = False  # clear-host: writes every host block
    keys_read: frozenset[str] = frozenset()  # storage objects (load, lookup)
    keys_write: frozenset[str] = frozenset()  # storage objects (store, delete)

    @property
    def touches_device(self) -> bool:
        return bool(self.device_read or self.device_write)

    def conflicts_with(self, earlier: Access) -> bool:
        if self.all_host_write and (earlier.host_read or earlier.host_write or earlier.all_host_write):
            return True
        if earlier.all_host_write and (self.host_read or self.host_write):
            return True
        return (
            _overlap(self.device_write, earlier.device_read, earlier.device_write)
            or _overlap(self.device_read, earlier.device_write)
            or _overlap(self.host_write, earlier.host_read, earlier.host_write)
            or _overlap(self.host_read, earlier.host_write)
            or _overlap(self.keys_write, earlier.keys_read, earlier.keys_write)
            or _overlap(self.keys_read, earlier.keys_write)
        )


def _overlap(mine: frozenset[int] | frozenset[str], *theirs: frozenset[int] | frozenset[str]) -> bool:
    return bool(mine) and any(not mine.isdisjoint(other) for other in theirs if other)


def swap_access(device_ids: Iterable[int], host_ids: Iterable[int], to_host: bool) -> Access:
    device, host = frozenset(device_ids), frozenset(host_ids)
    if to_host:
        return Access(device_read=device, host_write=host)
    return Access(host_read=host, device_write=device)


@dataclass(eq=False)
class Entry:
    """One registered command. ``finished`` resolves when its outcome is decided; ``done``
    when its blocks are free for later commands (later only for work that overran, see
    jobs.HoldBlocks)."""

    access: Access
    done: asyncio.Future[None]
    finished: asyncio.Future[None]
    cancel: CancelToken = field(default_factory=CancelToken)
    started: bool = False
    code: int = 0  # the outcome's code, set just before release


class BlockOrdering:
    def __init__(self) -> None:
        self._active: list[Entry] = []  # in registration order

    def register(self, access: Access) -> tuple[Entry, list[asyncio.Future[None]]]:
        """Adds a command; returns it and the futures it must wait for (in order)."""
        waits = [e.done for e in self._active if access.conflicts_with(e.access)]
        loop = asyncio.get_running_loop()
        entry = Entry(access, loop.create_future(), loop.create_future())
        self._active.append(entry)
        return entry, waits

    @staticmethod
    def finish(entry: Entry, code: int) -> None:
        entry.code = code
        if not entry.finished.done():
            entry.finished.set_result(None)

    def release(self, entry: Entry) -> None:
        self._active.remove(entry)
        if not entry.done.done():
            entry.done.set_result(None)

    def active(self, device_only: bool = False) -> list[Entry]:
        return [e for e in self._active if e.access.touches_device or not device_only]

    def counts(self) -> tuple[int, int]:
        """(waiting for dependencies, running)."""
        running = sum(1 for e in self._active if e.started)
        return len(self._active) - running, running
