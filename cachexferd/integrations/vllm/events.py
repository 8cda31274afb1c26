"""The plug-in's tiers in vLLM's KV events: what routers learn of the host and storage tiers.

vLLM publishes the KV events of its offloading connector (``BlockStored`` / ``BlockRemoved``
with a ``medium``; vLLM's ``kv_events_config`` turns them on) from what the manager's
``take_events`` returns each step. The index records, per tier, the blocks that became
loadable or stopped being loadable; this module turns them into vLLM's ``OffloadingEvent``:
medium ``CPU`` for the daemon's host tier, ``STORAGE`` for the storage tier, vLLM's offload
keys (the index knows blocks by digest only, so the keys are remembered when blocks are
placed). A host tier the manager drops (a daemon lost or restarted, a cleared host cache, a
reset) is reported removed block by block, the same step.

What waits for vLLM to take it is bounded (``max_pending`` blocks): should vLLM stop taking
events (a stalled step), the oldest are dropped and counted (``dropped``), so events cost a
bounded amount of memory and never hold a step or a copy.

A host block is announced only once every rank has it (vLLM completes a store when all
workers did), and removed as soon as the index stops offering it, so no event claims a
block a load would not deliver.

The storage tier has two sources: this instance's index (what it stored or found) and, with
daemons whose storage keeps a journal, what every instance sharing the store stored and
lost (journal_feed.py). Both name the same blocks, so storage events are published only on
a real change: a block already announced is not announced again, one not announced is not
removed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from ...index import OffloadEvent, Tier
from .vllm_api import Medium, OffloadingEvent, OffloadKey

_MEDIUM = {Tier.HOST: Medium.CPU, Tier.STORAGE: Medium.STORAGE}
_SPARE_KEYS = 100_000  # keys of blocks in flight (or failed) kept beyond those resident
MAX_PENDING_BLOCKS = 500_000  # blocks named by events waiting for vLLM (~100 bytes each)


class TierEvents:
    def __init__(self, enabled: bool, max_pending: int = MAX_PENDING_BLOCKS) -> None:
        self.enabled = enabled
        self.max_pending = max_pending
        self.dropped = 0  # blocks named by events dropped unpublished (the oldest first)
        self._keys: dict[bytes, OffloadKey] = {}  # digest -> vLLM's offload key
        self._resident: dict[Tier, set[bytes]] = {Tier.HOST: set(), Tier.STORAGE: set()}
        self._pending: deque[OffloadingEvent] = deque()
        self._pending_blocks = 0

    def know(self, keys: Sequence[OffloadKey], digests: Sequence[bytes]) -> None:
        """Blocks about to be placed: their keys, for the events that will name them."""
        if self.enabled:
            self._keys.update(zip(digests, keys))
            held = len(self._keys)  # every step calls this: the resident count only when it may matter
            if held > 2 * _SPARE_KEYS and held > self._resident_count() + 2 * _SPARE_KEYS:
                self._prune()

    def add(self, events: Iterable[OffloadEvent]) -> None:
        if not self.enabled:
            return
        for event in events:
            resident = self._resident[event.tier]
            hashes = event.hashes
            if event.tier is Tier.STORAGE:  # two sources (see above): changes only
                hashes = [d for d in dict.fromkeys(hashes) if (d in resident) == event.removed]
            if event.removed:
                resident.difference_update(hashes)
            else:
                resident.update(hashes)
            keys = list(filter(None, map(self._keys.get, hashes)))  # in C; a key is never empty
            if keys:
                self._pending.append(OffloadingEvent(keys=keys, medium=_MEDIUM[event.tier], removed=event.removed))
                self._pending_blocks += len(keys)
        if self._pending_blocks > self.max_pending:
            self._drop_oldest()

    def gone(self, *tiers: Tier) -> None:
        """Whole tiers stopped being loadable (the host tier, or also storage on new weights)."""
        for tier in tiers:
            if self.enabled and self._resident[tier]:
                self.add([OffloadEvent(list(self._resident[tier]), tier, removed=True)])

    def host_gone(self) -> None:
        """The whole host tier stopped being loadable."""
        self.gone(Tier.HOST)

    def take(self) -> list[OffloadingEvent]:
        if not self._pending:  # most steps
            return []
        out, self._pending, self._pending_blocks = list(self._pending), deque(), 0
        return out

    def _drop_oldest(self) -> None:
        """Down to ``max_pending`` blocks: whole events first, then the front of the oldest."""
        excess = self._pending_blocks - self.max_pending
        while excess > 0:
            oldest = self._pending[0]
            if len(oldest.keys) <= excess:
                self._pending.popleft()
                cut = len(oldest.keys)
            else:
                self._pending[0] = OffloadingEvent(keys=oldest.keys[excess:], medium=oldest.medium,
                                                   removed=oldest.removed)  # fmt: skip
                cut = excess
            excess -= cut
            self._pending_blocks -= cut
            self.dropped += cut

    def _resident_count(self) -> int:
        return sum(len(r) for r in self._resident.values())

    def _prune(self) -> None:
        """Forgets the keys of blocks no tier holds (stores that failed, never to complete)."""
        keep = self._resident[Tier.HOST] | self._resident[Tier.STORAGE]
        self._keys = {d: k for d, k in self._keys.items() if d in keep}
