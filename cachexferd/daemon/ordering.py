"""Submission-order guarantees for commands that touch the same blocks, at O(ids touched).

Every asynchronous command declares which device blocks, host blocks and storage keys it
reads and writes (an ``Access``). A scoreboard per id space remembers, for each id, the last
unfinished writer and the unfinished readers since that writer. A new command depends only
on those: read-after-write on the writer, write-after-read on the readers, write-after-write
on the writer. Registration and release touch exactly the ids of the command, whatever the
number of commands in flight; independent commands have no dependency and start at once.

Registration happens on the event loop in the order commands arrive, which is what makes
the order the submission order. Nothing here awaits: an entry counts its unfinished
dependencies, and ``release`` returns the entries whose count reached zero, in registration
order, for the caller to start.

CLEAR_HOST writes every host block: it depends on every unreleased host access, and every
later host access depends on it (a host barrier), without any per-block scan.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable
from enum import IntEnum
from typing import Any, Generic, NamedTuple, TypeVar

from ..backends.base import CancelToken


class Access(NamedTuple):
    """The blocks and keys one command reads and writes (a tuple: one is made per command)."""

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

    @property
    def touches_host(self) -> bool:
        return bool(self.host_read or self.host_write or self.all_host_write)

    def conflicts_with(self, earlier: Access) -> bool:
        """The rule the scoreboard implements, stated pairwise (for tests and docs)."""
        if self.all_host_write and earlier.touches_host:
            return True
        if earlier.all_host_write and self.touches_host:
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


_NONE: frozenset[Any] = frozenset()
_new_access = tuple.__new__  # positional, without NamedTuple's keyword handling: one per swap


def swap_access(device_ids: Iterable[int], host_ids: Iterable[int], to_host: bool) -> Access:
    device, host = frozenset(device_ids), frozenset(host_ids)
    if to_host:  # (device_read, device_write, host_read, host_write, all_host_write, keys_read, keys_write)
        return _new_access(Access, (device, _NONE, _NONE, host, False, _NONE, _NONE))
    return _new_access(Access, (_NONE, device, host, _NONE, False, _NONE, _NONE))


class Phase(IntEnum):
    WAITING = 0  # registered; some dependency unreleased, or not yet started
    RUNNING = 1
    FINISHED = 2  # outcome decided; blocks may still be held (see jobs.HoldBlocks)
    RELEASED = 3


_RUNNING, _FINISHED, _RELEASED = Phase.RUNNING, Phase.FINISHED, Phase.RELEASED
P = TypeVar("P")  # what the caller registers with each entry (the daemon: its Request)


class Entry(Generic[P]):
    """One registered command, or a group of commands that run and end together (a BATCH's
    swaps on disjoint blocks: ``weight`` commands). ``payload`` is the caller's (what to run
    when ready)."""

    __slots__ = ("_waiters", "access", "cancel", "code", "dependents", "payload", "phase", "unmet", "weight")

    def __init__(self, access: Access, payload: P, weight: int = 1) -> None:
        self.access = access
        self.payload = payload
        self.weight = weight
        self.cancel = CancelToken()
        self.phase = Phase.WAITING
        self.unmet = 0  # unreleased entries this one waits for
        self.dependents: list[Entry[P]] = []
        self.code = 0  # the outcome's code, set by finish()
        self._waiters: list[asyncio.Future[None]] | None = None

    @property
    def ready(self) -> bool:
        return self.unmet == 0

    def when_finished(self) -> asyncio.Future[None]:
        """A future resolved when the outcome is decided (created only when asked for)."""
        future = asyncio.get_running_loop().create_future()
        if self.phase >= Phase.FINISHED:
            future.set_result(None)
        else:
            self._waiters = self._waiters or []
            self._waiters.append(future)
        return future

    def _resolve_waiters(self) -> None:
        for future in self._waiters or ():
            if not future.done():
                future.set_result(None)
        self._waiters = None


class _Board(Generic[P]):
    """One id space: the last unreleased writer of each id and the readers since it."""

    __slots__ = ("readers", "writer")

    def __init__(self) -> None:
        self.writer: dict[Hashable, Entry[P]] = {}
        self.readers: dict[Hashable, set[Entry[P]]] = {}

    def claim(self, entry: Entry[P], reads: frozenset[Any], writes: frozenset[Any], deps: set[Entry[P]]) -> int:
        """Records the entry's accesses, adds what it must wait for; returns ids examined."""
        for i in reads:
            if writes and i in writes:
                continue  # a write covers it
            writer = self.writer.get(i)
            if writer is not None:
                deps.add(writer)
            readers = self.readers.get(i)
            if readers is None:
                self.readers[i] = {entry}
            else:
                readers.add(entry)
        for i in writes:
            writer = self.writer.get(i)
            if writer is not None:
                deps.add(writer)
            readers = self.readers.pop(i, None)
            if readers:
                deps.update(readers)
            self.writer[i] = entry
        return len(reads) + len(writes)

    def drop(self, entry: Entry[P], reads: frozenset[Any], writes: frozenset[Any]) -> None:
        for i in writes:
            if self.writer.get(i) is entry:
                del self.writer[i]
        for i in reads:
            readers = self.readers.get(i)
            if readers is not None:
                readers.discard(entry)
                if not readers:
                    del self.readers[i]


class BlockOrdering(Generic[P]):
    def __init__(self) -> None:
        self._device: _Board[P] = _Board()
        self._host: _Board[P] = _Board()
        self._keys: _Board[P] = _Board()
        self._entries: dict[Entry[P], None] = {}  # unreleased, in registration order
        self._device_entries: dict[Entry[P], None] = {}
        self._host_entries: dict[Entry[P], None] = {}
        self._host_barrier: Entry[P] | None = None  # the last unreleased CLEAR_HOST
        self.waiting = 0  # commands registered, not started
        self.running = 0  # commands started, outcome not decided
        self.commands = 0  # commands registered, not released
        self.examined = 0  # ids and dependencies looked at, ever (a work count for tests)

    def register(self, access: Access, payload: P, weight: int = 1) -> Entry[P]:
        """Adds a command (``weight`` commands that run as one); ``entry.ready`` tells whether
        it may start now. A board the command does not touch is not visited: a swap looks at
        two boards, a lookup at one."""
        entry = Entry(access, payload, weight)
        deps: set[Entry[P]] = set()
        device_read, device_write, host_read, host_write, all_host, keys_read, keys_write = access
        examined = 0
        if device_read or device_write:
            examined += self._device.claim(entry, device_read, device_write, deps)
            self._device_entries[entry] = None
        if host_read or host_write or all_host:
            examined += self._host.claim(entry, host_read, host_write, deps)
            if all_host or self._host_barrier is not None:
                self._claim_all_host(entry, deps)
            self._host_entries[entry] = None
        if keys_read or keys_write:
            examined += self._keys.claim(entry, keys_read, keys_write, deps)
        if deps:
            for dep in deps:
                dep.dependents.append(entry)
            entry.unmet = len(deps)
            examined += len(deps)
        self.examined += examined
        self._entries[entry] = None
        self.waiting += weight
        self.commands += weight
        return entry

    def _claim_all_host(self, entry: Entry[P], deps: set[Entry[P]]) -> None:
        barrier = self._host_barrier
        if barrier is not None:
            deps.add(barrier)
        if entry.access.all_host_write:
            deps.update(self._host_entries)  # only CLEAR_HOST pays for the host work in flight
            self._host_barrier = entry

    def start(self, entry: Entry[P]) -> None:
        if entry.phase is Phase.WAITING:
            entry.phase = Phase.RUNNING
            self.waiting -= entry.weight
            self.running += entry.weight

    def finish(self, entry: Entry[P], code: int) -> None:
        """The outcome is decided; the blocks stay claimed until ``release``."""
        if entry.phase >= Phase.FINISHED:
            return
        if entry.phase is Phase.RUNNING:
            self.running -= entry.weight
        else:
            self.waiting -= entry.weight
        entry.phase, entry.code = Phase.FINISHED, code
        entry._resolve_waiters()

    def release(self, entry: Entry[P]) -> list[Entry[P]]:
        """Frees the entry's blocks; returns dependents that became ready, in order."""
        if entry.phase is Phase.RELEASED:
            return []
        return self.complete(entry, entry.code)

    def complete(self, entry: Entry[P], code: int) -> list[Entry[P]]:
        """``finish`` and ``release`` at once (the common end of a job); returns the
        dependents that became ready, in registration order."""
        phase = entry.phase
        if phase is _RELEASED:
            return []
        if phase is _RUNNING:  # ``finish``, inlined: this runs once per command
            self.running -= entry.weight
            entry.code = code
            if entry._waiters is not None:
                entry._resolve_waiters()
        elif phase is not _FINISHED:
            self.finish(entry, code)
        entry.phase = _RELEASED
        device_read, device_write, host_read, host_write, all_host, keys_read, keys_write = entry.access
        if device_read or device_write:
            self._device.drop(entry, device_read, device_write)
            del self._device_entries[entry]
        if host_read or host_write or all_host:
            self._host.drop(entry, host_read, host_write)
            del self._host_entries[entry]
            if self._host_barrier is entry:
                self._host_barrier = None
        if keys_read or keys_write:
            self._keys.drop(entry, keys_read, keys_write)
        del self._entries[entry]
        self.commands -= entry.weight
        dependents = entry.dependents
        if not dependents:
            return []
        entry.dependents = []
        ready = []
        for dependent in dependents:
            dependent.unmet -= 1
            if dependent.unmet == 0:
                ready.append(dependent)
        return ready

    def active(self, device_only: bool = False) -> list[Entry[P]]:
        """Unreleased entries in registration order (all, or those touching the device)."""
        return list(self._device_entries if device_only else self._entries)

    def counts(self) -> tuple[int, int]:
        """(commands waiting to start, commands running)."""
        return self.waiting, self.running

    def __len__(self) -> int:
        """Commands registered and not released (a group counts each of its commands)."""
        return self.commands
