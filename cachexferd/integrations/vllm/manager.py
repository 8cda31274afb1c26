"""Scheduler side: vLLM's OffloadingManager, a thin adapter over cachexferd's OffloadIndex.

The index (``cachexferd.index``) is the brain: it knows which blocks are in the host tier
(and, with write-through, the storage tier), allocates host block ids, evicts in LRU order
and never reuses a block with a transfer in flight. This adapter translates vLLM's calls
(one offload key at a time for lookups, batches for stores and loads) into index calls and
the index's plans into the specs the workers execute. Each request's stores are linked into
one chain per KV-cache group (index_calls.py), so eviction takes a conversation's tail first.

It also keeps a connection to every rank's daemon, which gives the host tier's size (the
smallest host cache over the ranks) and notices a daemon that restarted: its host cache is
gone, so the index is rebuilt empty. Until every daemon is reachable the manager reports
misses and stores nothing, so vLLM runs as if there were no plug-in.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)

from ...client.link import ClientError
from ...index import OffloadIndex
from .connection import DaemonConnection
from .index_calls import Chains, prepare_loads, prepare_stores
from .keys import VllmKeyNames
from .options import PluginOptions
from .prefetch import StoragePrefetch
from .transfer_specs import HostLoadSpec, HostStoreSpec

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log

IndexFactory = Callable[[int, bool], OffloadIndex]  # (host_blocks, storage) -> index


class CachexferdManager(OffloadingManager):
    def __init__(
        self,
        options: PluginOptions,
        names: VllmKeyNames,
        conn: DaemonConnection,
        make_index: IndexFactory | None = None,
    ) -> None:
        self.options = options
        self.names = names
        self.conn = conn
        self._make_index = make_index or (lambda blocks, storage: OffloadIndex(blocks, names.space, storage=storage))
        self.index: OffloadIndex | None = None
        self._opened = -1  # conn.opened the index was built for
        self._failed: set[bytes] = set()  # digests the workers reported failed, until completed
        self.prefetch = StoragePrefetch(names)
        self._storage = False  # whether the current index writes through to storage
        self.stats = {"lookups": 0, "hits": 0, "loads": 0, "stores": 0, "store_refused": 0, "rebuilds": 0}
        conn.start()
        self._refresh()

    # Host tier and daemons -------------------------------------------------------------------

    def _refresh(self) -> OffloadIndex | None:
        """The index, rebuilt after a (re)connection; None while a daemon is unreachable."""
        if self.conn.tick() is not None or not self.conn.up:
            if self.index is not None:
                self.prefetch.reset()
            self.index = None
            return None
        if self.index is None or self._opened != self.conn.opened:
            self._opened = self.conn.opened
            self.index = self._build_index()
        return self.index

    def _build_index(self) -> OffloadIndex | None:
        try:
            statuses = self.conn.client.status(timeout_s=self.options.connect_timeout_s) if self.conn.client else []
        except ClientError as exc:
            log.warning("cachexferd: status of the daemons failed: %s", exc)
            return None
        blocks = min(int(s.get("host_cache", {}).get("num_blocks", 0)) for s in statuses) if statuses else 0
        if self.options.host_blocks:
            blocks = min(blocks, self.options.host_blocks)
        if blocks <= 0:
            return None  # no worker has attached yet: the host block size is unknown
        storage = self.options.storage == "write_through" and all("storage" in s for s in statuses)
        self._storage = storage
        self.prefetch.reset()
        self.stats["rebuilds"] += 1
        log.info("cachexferd: host tier of %d blocks on %d rank(s), storage %s", blocks, len(statuses),
                 "write-through" if storage else "off")  # fmt: skip
        return self._make_index(blocks, storage)

    def _digests(self, keys: Iterable[bytes]) -> list[bytes]:
        return [self.names.block_hash(k).digest for k in keys]

    # OffloadingManager -------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        index = self._refresh()
        self.stats["lookups"] += 1
        if index is None:
            return LookupResult.MISS
        if index.lookup(self._digests([key])):
            self.stats["hits"] += 1
            return LookupResult.HIT
        if self._storage and self.prefetch.consider(key, req_context.req_id):
            return LookupResult.RETRY  # asking the storage; vLLM asks again next step
        return LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Once per step: file the storage answers, then send this step's questions."""
        client = self.conn.client
        if client is None or self.index is None:
            return
        for done in client.poll():
            self.prefetch.on_completion(done, client, self.index)
        self.prefetch.flush(client)

    def has_pending_work(self) -> bool:
        return self.prefetch.busy

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        index = self.index
        if index is None:
            # Lost between lookup and load: the worker fails the job and vLLM recomputes.
            return HostLoadSpec(req_context.req_id, keys, [-1] * len(keys), [False] * len(keys))
        placed = prepare_loads(index, self._digests(keys))
        self.stats["loads"] += 1
        trusted = [self.prefetch.boots.get(h) for h in placed.host_ids]
        return HostLoadSpec(req_context.req_id, keys, placed.host_ids, placed.from_storage, trusted)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self.index is not None:
            self.index.touch(self._digests(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        digests = self._digests(keys)
        failed = [d for d in digests if d in self._failed]
        self._failed.difference_update(failed)
        if self.index is not None:
            # After a rebuild the new index never saw these blocks: nothing to release.
            with contextlib.suppress(KeyError):
                self.index.complete_load(digests, failed=failed)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        index = self._refresh()
        if index is None:
            # No daemon: store nothing (an empty plan, not None, keeps vLLM from warning per request).
            return PrepareStoreOutput(keys_to_store=[], store_spec=HostStoreSpec([], []), evicted_keys=[])
        digests = self._digests(keys)
        by_digest = dict(zip(digests, keys))
        groups = dict(zip(digests, (get_offload_group_idx(k) for k in keys)))
        placed = prepare_stores(index, list(groups), list(groups.values()), _chains(req_context))
        if placed is None:
            self.stats["store_refused"] += 1
            return None
        self.stats["stores"] += 1
        self.prefetch.forget_hosts(placed.host_ids)
        store_keys = [by_digest[d] for d in placed.digests]
        spec = HostStoreSpec(store_keys, placed.host_ids, write_through=placed.write_through)
        # Evicted keys only feed vLLM's KV events; the index reports evictions by digest.
        return PrepareStoreOutput(keys_to_store=store_keys, store_spec=spec, evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        digests = self._digests(keys)
        failed = [d for d in digests if d in self._failed]
        self._failed.difference_update(failed)
        if self.index is None:
            return
        failed_set = set(failed)
        ok = [d for d in digests if d not in failed_set]
        if ok:
            self.index.complete_store(ok, success=success)
        if failed:
            self.index.complete_store(failed, success=False)

    def mark_failed(self, keys: Iterable[bytes]) -> None:
        """Keys a worker could not store or load; their completion follows in the same step."""
        self._failed.update(self._digests(keys))

    def reset_cache(self) -> None:
        self.index = None
        self._opened = -1
        self._failed.clear()
        self._refresh()

    def shutdown(self) -> None:
        log.info("cachexferd: scheduler-side totals: %s", self.stats)
        self.conn.close()

    def describe(self) -> dict[str, Any]:
        return {"connected": self.conn.up, "index": self.index is not None, "promoted": self.prefetch.promoted,
                **self.stats}  # fmt: skip


def _chains(req_context: ReqContext) -> Chains:
    """The request's chain tails, kept in its ReqContext for its later stores."""
    chains: Chains | None = req_context.get_state(Chains)
    if chains is None:
        chains = Chains()
        req_context.set_state(chains)
    return chains
