"""The plug-in's tiers in vLLM's KV events: what routers learn of the host and storage tiers.

vLLM publishes the KV events of its offloading connector (``BlockStored`` / ``BlockRemoved``
with a ``medium``; vLLM's ``kv_events_config`` turns them on) from what the manager's
``take_events`` returns each step. The index records, per tier, the blocks that became
loadable or stopped being loadable; this module turns them into vLLM's ``OffloadingEvent``:
medium ``CPU`` for the daemon's host tier, ``STORAGE`` for the storage tier, vLLM's offload
keys (the index knows blocks by digest only, so the keys are remembered when blocks are
placed). A host tier the manager drops (a daemon lost or restarted, a cleared host cache, a
reset) is reported removed block by block, the same step.

A host block is announced only once every rank has it (vLLM completes a store when all
workers did), and removed as soon as the index stops offering it, so no event claims a
block a load would not deliver.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...index import OffloadEvent, Tier
from .vllm_api import Medium, OffloadingEvent, OffloadKey

_MEDIUM = {Tier.HOST: Medium.CPU, Tier.STORAGE: Medium.STORAGE}
_SPARE_KEYS = 100_000  # keys of blocks in flight (or failed) kept beyond those resident


class TierEvents:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._keys: dict[bytes, OffloadKey] = {}  # digest -> vLLM's offload key
        self._resident: dict[Tier, set[bytes]] = {Tier.HOST: set(), Tier.STORAGE: set()}
        self._pending: list[OffloadingEvent] = []

    def know(self, keys: Sequence[OffloadKey], digests: Sequence[bytes]) -> None:
        """Blocks about to be placed: their keys, for the events that will name them."""
        if self.enabled:
            self._keys.update(zip(digests, keys))
            if len(self._keys) > self._resident_count() + 2 * _SPARE_KEYS:
                self._prune()

    def add(self, events: Iterable[OffloadEvent]) -> None:
        if not self.enabled:
            return
        for event in events:
            resident = self._resident[event.tier]
            if event.removed:
                resident.difference_update(event.hashes)
            else:
                resident.update(event.hashes)
            keys = [self._keys[d] for d in event.hashes if d in self._keys]
            if keys:
                self._pending.append(OffloadingEvent(keys=keys, medium=_MEDIUM[event.tier], removed=event.removed))

    def host_gone(self) -> None:
        """The whole host tier stopped being loadable."""
        host = self._resident[Tier.HOST]
        if self.enabled and host:
            self.add([OffloadEvent(list(host), Tier.HOST, removed=True)])

    def take(self) -> list[OffloadingEvent]:
        out, self._pending = self._pending, []
        return out

    def _resident_count(self) -> int:
        return sum(len(r) for r in self._resident.values())

    def _prune(self) -> None:
        """Forgets the keys of blocks no tier holds (stores that failed, never to complete)."""
        keep = self._resident[Tier.HOST] | self._resident[Tier.STORAGE]
        self._keys = {d: k for d, k in self._keys.items() if d in keep}
