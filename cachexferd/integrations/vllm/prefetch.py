"""Storage hits for blocks this vLLM instance never stored: a restart, or another instance.

The index only knows the blocks it placed itself. When a lookup misses it, the manager asks
the daemons' storage (LOOKUP, one per request and step, all ranks) and promotes the blocks
found into the host tier: ``index.prepare_store`` allocates host blocks as for any store,
the manager LOADs the objects into them (no device ids), and ``complete_store`` makes them
readable. vLLM's lookup answers RETRY meanwhile, so the request waits a step or two and
then loads the blocks from the host like any other hit.

Blocks the storage does not have are remembered as misses for ``ttl_s``, so a cold prompt
costs one LOOKUP, not one per step. A LOOKUP or LOAD not answered within ``timeout_s`` is
given up (its blocks are misses): a request never waits longer than that for the storage.
The LOAD stamps the host blocks with the instance's owner token, which the workers' reads
name (protocol 1.2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...client import EngineClient
from ...client.pending import Completion
from ...index import OffloadIndex
from ...protocol import MsgType
from ..engine.index_calls import prepare_stores
from .keys import VllmKeyNames, group_of
from .vllm_api import OffloadKey

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log


@dataclass
class _Batch:
    keys: list[OffloadKey]
    digests: list[bytes]
    host_ids: list[int] = field(default_factory=list)  # set once the LOAD is sent


class StoragePrefetch:
    def __init__(
        self, names: VllmKeyNames, ttl_s: float = 5.0, owner: str = "", timeout_s: float = 0.5,
        on_place: Callable[[list[OffloadKey], list[bytes]], None] | None = None,
    ) -> None:  # fmt: skip
        self.names = names
        self.on_place = on_place  # told the (keys, digests) of blocks it places in the host tier
        self.ttl_s = ttl_s
        self.owner = owner
        self.timeout_s = timeout_s
        self._queued: dict[tuple[str, int], list[OffloadKey]] = {}  # (req_id, group) -> keys asked this step
        self._pending: dict[int, _Batch] = {}  # daemon req_id -> batch (LOOKUP or LOAD)
        self._inflight: set[OffloadKey] = set()
        self._missed: dict[OffloadKey, float] = {}  # key -> when the storage did not have it
        self.promoted = 0

    def consider(self, key: OffloadKey, req_id: str) -> bool:
        """True: ask again later (a LOOKUP or LOAD is on its way); False: a miss."""
        if key in self._inflight:
            return True
        missed = self._missed.get(key)
        if missed is not None and time.monotonic() - missed < self.ttl_s:
            return False
        self._missed.pop(key, None)
        self._queued.setdefault((req_id, group_of(key)), []).append(key)
        self._inflight.add(key)
        return True

    @property
    def busy(self) -> bool:
        return bool(self._queued or self._pending)

    def flush(self, client: EngineClient) -> None:
        """Sends this step's LOOKUPs (one per request and KV-cache group: LOOKUP counts a
        contiguous prefix, and each group's blocks form a chain of their own)."""
        for keys in self._queued.values():
            digests = [self.names.block_hash(k).digest for k in keys]
            rid = client.lookup(self.names.keys_by_rank(keys), timeout_s=self.timeout_s)
            self._pending[rid] = _Batch(keys, digests)
        self._queued.clear()

    def on_completion(self, done: Completion, client: EngineClient, index: OffloadIndex) -> bool:
        batch = self._pending.pop(done.req_id, None)
        if batch is None:
            return False
        if done.op == MsgType.LOOKUP:
            found = done.min_result("prefix") if done.ok else 0
            self._miss(batch.keys[found:])
            if found:
                self._load(_Batch(batch.keys[:found], batch.digests[:found]), client, index)
        else:
            loaded = done.min_result("loaded") if done.ok else 0
            index.complete_store(batch.digests[:loaded], success=True)
            index.complete_store(batch.digests[loaded:], success=False)
            self._miss(batch.keys[loaded:])
            self._inflight.difference_update(batch.keys[:loaded])
            self.promoted += loaded
        return True

    def _load(self, batch: _Batch, client: EngineClient, index: OffloadIndex) -> None:
        placed = prepare_stores(index, batch.digests)
        if placed is None or not placed.digests:
            self._inflight.difference_update(batch.keys)  # no room now, or already there
            return
        wanted = set(placed.digests)
        keys = [k for k, d in zip(batch.keys, batch.digests) if d in wanted]
        if self.on_place is not None:
            self.on_place(keys, [d for d in batch.digests if d in wanted])
        self._inflight.difference_update(k for k, d in zip(batch.keys, batch.digests) if d not in wanted)
        by_rank = self.names.keys_by_rank(keys)
        host_ids = list(placed.host_ids)
        # not_after: a daemon that reads it after we gave up refuses it (protocol 1.2).
        fields = {"host_ids": host_ids, "device_ids": None, "owner": self.owner,
                  "not_after": time.time() + self.timeout_s}  # fmt: skip
        rid = client.submit(MsgType.LOAD, lambda rank: {**by_rank(rank), **fields}, self.timeout_s)
        self._pending[rid] = _Batch(keys, list(placed.digests), host_ids)

    def _miss(self, keys: list[OffloadKey]) -> None:
        now = time.monotonic()
        for key in keys:
            self._missed[key] = now
            self._inflight.discard(key)
        if len(self._missed) > 100_000:  # bounded: forget the oldest half
            for key in sorted(self._missed, key=self._missed.__getitem__)[:50_000]:
                del self._missed[key]

    def drop_queued(self) -> None:
        """This step's questions are not sent (the daemon is behind): their keys are misses."""
        for keys in self._queued.values():
            self._inflight.difference_update(keys)
        self._queued.clear()

    def reset(self) -> None:
        """The connection was lost: pending commands will never complete."""
        self._queued.clear()
        self._pending.clear()
        self._inflight.clear()
