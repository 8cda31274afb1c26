"""What every instance sharing the storage tier stored and lost: the daemons' storage journal.

A daemon of protocol 1.4 whose storage keeps a journal records every object a STORE writes,
with the tag the STORE gave it, in the shared store; every daemon on that store lists the
records of all of them (STORAGE_EVENTS). The plug-in's workers tag each object with vLLM's
offload key of its block, so a record names the block as vLLM does.

``JournalFeed`` follows rank 0's daemon's journal on a thread of its own (never on vLLM's
step) and ``JournalView`` turns the records into changes of the storage tier: a block is
stored once every rank's object is there (one object for all ranks when the KV is
replicated), and removed as soon as any of them is gone. A record counts only when its key
is the one this instance would give that block on that rank, which also leaves out other
models, layouts and KV-cache groups sharing the store; and only under the daemons' current
weights version (objects are named per version). The manager hands the changes to vLLM's KV
events (events.py) a bounded number per step; the thread reads no further while they wait,
so a stalled step costs a bounded amount of memory, and what it has not read waits in the
journal (a reader too far behind is answered with a reset).

A reset (the first answer, a restarted daemon, a new connection, a reader too far behind)
restates what the store holds now: a block announced before and not restated is removed
once the restatement is complete.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from ...client.link import ClientError, Link, check_ok
from ...protocol import StorageEvents
from .keys import VllmKeyNames, group_of

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log

MAX_QUEUED_BLOCKS = 200_000  # blocks in changes waiting for the manager before the thread stops reading
PAGE = 4096  # records per STORAGE_EVENTS answer


def speaks_journal(hellos: Sequence[dict[str, Any]]) -> bool:
    """Whether every daemon said (hello ``protocol``) it takes STORE tags and lists the journal."""
    return bool(hellos) and all(tuple(h.get("protocol") or (1, 0)) >= (1, 4) for h in hellos)


@dataclass(frozen=True)
class Change:
    """Blocks of the storage tier stored (or removed) under weights ``version``."""

    removed: bool
    keys: list[bytes]  # vLLM's offload keys
    digests: list[bytes]
    version: int


class JournalView:
    """The blocks whose every object is in the store, from the journal's records, and what
    each answer changed. No I/O: used by the feed's thread only."""

    def __init__(self, names: VllmKeyNames, version: int) -> None:
        self.names = names
        self.version = version
        self.ranks = 1 if names.replicated else names.space.tp_size  # objects a block needs
        self._objects: dict[str, tuple[bytes, int]] = {}  # object key -> (offload key, rank)
        self._present: dict[bytes, set[int]] = {}  # offload key -> ranks whose object is stored
        self._complete: set[bytes] = set()  # offload keys announced stored
        self._restating: set[bytes] | None = None  # announced before a reset, until its restatement ends

    def apply(self, answer: dict[str, Any]) -> list[Change]:
        """The changes one STORAGE_EVENTS answer makes, in the journal's order."""
        if answer.get("reset"):  # (also during a restatement: another one starts over)
            self._restating = self._complete | (self._restating or set())
            self._objects, self._present, self._complete = {}, {}, set()
        changes: list[Change] = []
        for _pos, op, version, key, tag in answer.get("events") or ():
            if version != self.version:
                continue
            if op == "stored":
                self._note(changes, False, self._stored(str(key), bytes(tag)))
            elif op == "removed":
                self._note(changes, True, self._removed(str(key)))
        if self._restating is not None and not answer.get("more"):
            gone, self._restating = self._restating - self._complete, None
            for block in gone:
                self._note(changes, True, block)
        return changes

    def _stored(self, key: str, tag: bytes) -> bytes | None:
        rank = self._rank_of(key, tag)
        if rank is None or self._objects.get(key) == (tag, rank):
            return None
        if key in self._objects:  # rewritten under another block's tag
            self._removed(key)
        self._objects[key] = (tag, rank)
        present = self._present.setdefault(tag, set())
        present.add(rank)
        if len(present) < self.ranks or tag in self._complete:
            return None
        self._complete.add(tag)
        restated = self._restating is not None and tag in self._restating
        return None if restated else tag  # restated after a reset: announced already

    def _removed(self, key: str) -> bytes | None:
        found = self._objects.pop(key, None)
        if found is None:
            return None
        tag, rank = found
        present = self._present.get(tag, set())
        present.discard(rank)
        if not present:
            self._present.pop(tag, None)
        if tag not in self._complete:
            return None
        self._complete.discard(tag)
        if self._restating is not None:
            self._restating.discard(tag)
        return tag

    def _rank_of(self, key: str, tag: bytes) -> int | None:
        """The rank whose object of block ``tag`` is named ``key`` here; None when this
        instance would name no object so (another model, layout or group, or no offload key)."""
        space = self.names.spaces.get(group_of(tag)) if len(tag) > 4 else None
        if space is None:
            return None
        block = self.names.block_hash(tag)
        for rank in range(self.ranks):
            if space.key(block, rank) == key:
                return rank
        return None

    def _note(self, changes: list[Change], removed: bool, tag: bytes | None) -> None:
        if tag is None:
            return
        if not changes or changes[-1].removed != removed:
            changes.append(Change(removed, [], [], self.version))
        changes[-1].keys.append(tag)
        changes[-1].digests.append(self.names.block_hash(tag).digest)


class JournalFeed:
    """Follows one daemon's storage journal (``follow``) every ``interval_s`` on a thread of
    its own; the manager ``take``s the changes."""

    def __init__(self, names: VllmKeyNames, timeout_s: float, interval_s: float,
                 max_queued: int = MAX_QUEUED_BLOCKS) -> None:  # fmt: skip
        self.names = names
        self.timeout_s, self.interval_s, self.max_queued = timeout_s, interval_s, max_queued
        self.journal: bool | None = None  # whether the daemon's storage keeps a journal (None: not known yet)
        self.resets = 0  # answers that restated the store (a restarted daemon, a reader too far behind)
        self._lock = threading.Lock()  # guards _target, _changes, _queued (the manager's thread and ours)
        self._target: tuple[str, int, int] | None = None  # (endpoint, weights version, connection)
        self._changes: deque[Change] = deque()
        self._queued = 0  # blocks in _changes
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachexferd-storage-journal", daemon=True)
        self._thread.start()

    def follow(self, endpoint: str, version: int, connection: int) -> None:
        """Reads the journal of the daemon at ``endpoint`` under weights ``version``; a new
        ``connection`` (or endpoint, or version) starts again from a reset."""
        with self._lock:
            if self._target != (endpoint, version, connection):
                self._target = (endpoint, version, connection)
                self._wake.set()

    def take(self, max_blocks: int) -> list[Change]:
        """Changes in order, about ``max_blocks`` blocks at most (whole changes)."""
        out: list[Change] = []
        taken = 0
        with self._lock:
            while self._changes and taken < max_blocks:
                change = self._changes.popleft()
                out.append(change)
                taken += len(change.keys)
            self._queued -= taken
        return out

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(1.0)  # a call in flight is left to its timeout (a daemon thread)

    # The thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            _Reader(self, ctx).loop()
        except Exception:  # a bug here must not take the scheduler down: storage events stop
            log.exception("cachexferd: following the storage journal failed; other instances' stored blocks are "
                          "no longer reported")  # fmt: skip
        finally:
            ctx.destroy(linger=0)

    def _push(self, changes: list[Change]) -> None:
        with self._lock:
            self._changes.extend(changes)
            self._queued += sum(len(c.keys) for c in changes)

    def _full(self) -> bool:
        with self._lock:
            return self._queued >= self.max_queued

    def _current(self) -> tuple[str, int, int] | None:
        with self._lock:
            return self._target

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()


class _Reader:
    """The feed thread's state: one link, the cursor, the view."""

    def __init__(self, feed: JournalFeed, ctx: zmq.Context[Any]) -> None:
        self.feed, self.ctx = feed, ctx
        self.link: Link | None = None
        self.target: tuple[str, int, int] | None = None
        self.view: JournalView | None = None
        self.cursor, self.boot_id, self.req_id = 0, "", 0
        self.idle = False  # no journal there: nothing to ask until the target changes
        self.logged = ""

    def loop(self) -> None:
        feed = self.feed
        while not feed._stop.is_set():
            target = feed._current()
            if target != self.target:
                self._retarget(target)
            if self.link is None or self.idle or feed._full():
                feed._sleep(feed.interval_s)
                continue
            if not self._read_once():
                feed._sleep(feed.interval_s)
        self._close()

    def _retarget(self, target: tuple[str, int, int] | None) -> None:
        self._close()
        self.target, self.cursor, self.idle = target, 0, False
        if target is None:
            return
        if self.view is None or self.view.version != target[1]:
            # Blocks of other weights were removed by the manager; a restarted daemon or a new
            # connection keeps the view: the reset's restatement removes what is gone.
            self.view = JournalView(self.feed.names, target[1])
        self.link = Link(self.ctx, target[0])

    def _read_once(self) -> bool:
        """One STORAGE_EVENTS; True when more records are ready now."""
        assert self.link is not None and self.view is not None
        self.req_id += 1
        try:
            outcome = self.link.call(StorageEvents(req_id=self.req_id, after=self.cursor, max=PAGE),
                                     self.feed.timeout_s)  # fmt: skip
            answer = check_ok(outcome)
        except (ClientError, zmq.ZMQError) as exc:
            self._lost(str(exc))
            return False
        if outcome.boot_id != self.boot_id:
            self.boot_id = outcome.boot_id
            if self.cursor != 0:  # a restarted daemon: its cursor means nothing to us
                self.cursor = 0
                return True
        self.feed.journal = bool(answer.get("journal"))
        if not self.feed.journal:
            self.idle = True
            return False
        self.feed.resets += bool(answer.get("reset"))
        self.feed._push(self.view.apply(answer))
        self.cursor = int(answer["next"])
        self.logged = ""
        return bool(answer.get("more"))

    def _lost(self, why: str) -> None:
        """A failed call: a new link (and a reset) at the next try."""
        if why != self.logged:
            log.info("cachexferd: storage journal not read: %s", why)
            self.logged = why
        self.target = None  # a new link at the next turn
        self._close()

    def _close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
