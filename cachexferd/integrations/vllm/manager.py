"""Scheduler side: vLLM's OffloadingManager, a thin adapter over cachexferd's OffloadIndex.

The index (``cachexferd.index``) is the brain: it knows which blocks are in the host tier
(and, with write-through, the storage tier), allocates host block ids, evicts in LRU order
and never reuses a block with a transfer in flight. This adapter translates vLLM's calls
(one offload key at a time for lookups, batches for stores and loads) into index calls and
the index's plans into the specs the workers execute. Each request's stores are linked into
one chain per KV-cache group (engine/index_calls.py), so eviction takes a conversation's tail first.

It also keeps a connection to every rank's daemon, which gives the host tier's size (the
smallest host cache over the ranks, from the STATUS its probes ask for) and notices what
makes the host tier untrustworthy: a restarted daemon (new boot id) or a cleared host cache
(a new host-cache generation) empties the index. Until every daemon is reachable the
manager reports misses and stores nothing, so vLLM runs as if there were no plug-in. A
failed load or store is forgotten in every tier (``mark_failed``), so vLLM is not sent after
the same block again.

With vLLM's KV events on, write-through storage and daemons whose storage keeps a journal
(protocol 1.4), the storage tier in the events is that of every instance sharing the store,
read from rank 0's daemon's journal on a thread of its own (journal_feed.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ...index import OffloadEvent, OffloadIndex, Tier
from ..engine.connection import DaemonConnection
from ..engine.index_calls import Chains, prepare_loads, prepare_stores
from ..engine.options import PluginOptions
from .adoption import HostKeysFetch, speaks_keys
from .events import TierEvents
from .journal_feed import JournalFeed, speaks_journal
from .keys import VllmKeyNames
from .prefetch import StoragePrefetch
from .transfer_specs import HostLoadSpec, HostStoreSpec
from .vllm_api import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log
ATTACH_WAIT_S = 2.0  # after a (re)connection, how long lookups and stores wait for the host tier to open
JOURNAL_BLOCKS_PER_STEP = 20_000  # storage journal changes taken per step (a bound on the step's work)

IndexFactory = Callable[[int, bool], OffloadIndex]  # (host_blocks, storage) -> index


class CachexferdManager(OffloadingManager):
    def __init__(
        self,
        options: PluginOptions,
        names: VllmKeyNames,
        conn: DaemonConnection,
        make_index: IndexFactory | None = None,
        owner: str = "",
        serve_loads: bool = True,
        events: bool = False,
    ) -> None:
        self.options = options
        # False where vLLM cannot compute on top of a loaded prefix (it turned its prefix
        # caching off, as it does for MLA on CPUs): every lookup is a miss, stores go on.
        self.serve_loads = serve_loads
        self.names = names
        self.conn = conn
        self.events = TierEvents(enabled=events)  # the host and storage tiers in vLLM's KV events
        self._make_index = make_index or (
            lambda blocks, storage: OffloadIndex(blocks, names.space, storage=storage, events=events)
        )
        self.index: OffloadIndex | None = None
        self._built_for: tuple[int, list[int | None], list[int | None]] = (-1, [], [])  # (conn.opened,
        # host generations, weights versions)
        self._failed: set[bytes] = set()  # digests the workers reported failed, until completed
        # req_id -> its first lookup that found a block being stored (until the request finishes)
        self._store_waits: dict[str, float] = {}
        self._owner_base = owner
        self._epoch = 0  # indexes built so far: part of the owner token of the current one
        self.prefetch = StoragePrefetch(names, owner=owner, timeout_s=options.max_stall_s, on_place=self.events.know)
        self._storage = False  # whether the current index writes through to storage
        self._adoption: HostKeysFetch | None = None  # reading what an earlier instance left (1.3)
        self.journal: JournalFeed | None = None  # the shared storage's journal (1.4), with events on
        self.stats = {"lookups": 0, "hits": 0, "loads": 0, "stores": 0, "store_refused": 0, "rebuilds": 0,
                      "failed": 0, "adopted": 0, "waited_for_stores": 0}  # fmt: skip
        conn.start()
        self._refresh()

    # Host tier and daemons -------------------------------------------------------------------

    def _refresh(self) -> OffloadIndex | None:
        """The index, rebuilt after a (re)connection or a cleared host cache; None while a
        daemon is unreachable or no worker has attached yet."""
        with self.conn.lock:
            if self.conn.tick() is not None or not self.conn.up:
                self._drop_index()
                return None
            built_for = (self.conn.opened, self.conn.generations(), self.conn.weights_versions())
            if self.index is not None and built_for != self._built_for:
                if built_for[0] == self._built_for[0] and built_for[2] != self._built_for[2]:
                    log.warning("cachexferd: a daemon's weights version changed (%s -> %s): the host and "
                                "storage tiers start empty", self._built_for[2], built_for[2])  # fmt: skip
                    self.events.gone(Tier.STORAGE)  # objects of other weights are never found
                elif built_for[0] == self._built_for[0]:
                    log.warning("cachexferd: a daemon's host cache was cleared (generation %s -> %s): "
                                "the host tier starts empty", self._built_for[1], built_for[1])  # fmt: skip
                self._drop_index()
            if self.index is None:
                self.index = self._build_index()
                if self.index is not None:
                    self._built_for = built_for
                    self._read_host_keys()
                    self._follow_journal()
            self._adopt()
            return self.index

    def _attaching(self) -> bool:
        """Just connected to daemons whose host tier opens once the workers' attach shows
        in their status (within a step or two): until then lookups and stores wait for it
        instead of missing it, for at most ``ATTACH_WAIT_S``."""
        return self.conn.usable and time.monotonic() - self.conn.opened_at < ATTACH_WAIT_S

    def _read_host_keys(self) -> None:
        """A new index: learn, off this thread, which host blocks an earlier instance left."""
        self._adoption = None
        if speaks_keys(self.conn.hellos):
            self._adoption = HostKeysFetch(self.names, self.conn.endpoints, self.conn.boot_ids,
                                           self.options.connect_timeout_s)  # fmt: skip

    def _follow_journal(self) -> None:
        """A new index: follow rank 0's daemon's storage journal, for the KV events (1.4)."""
        version = self._built_for[2][0] if self._built_for[2] else None
        if not (self.events.enabled and self._storage and speaks_journal(self.conn.hellos)) or version is None:
            return
        if self.journal is None:
            self.journal = JournalFeed(self.names, self.options.connect_timeout_s,
                                       min(self.options.retry_interval_s, 0.25))  # fmt: skip
        self.journal.follow(self.conn.endpoints[0], version, self.conn.opened)

    def _take_journal(self) -> None:
        """The storage journal's changes under the current weights version, into the events."""
        if self.journal is None or self.index is None or not self._storage:
            return  # (what waits is read when there is an index writing to storage again)
        version = self._built_for[2][0]
        for change in self.journal.take(JOURNAL_BLOCKS_PER_STEP):
            if change.version != version:
                continue  # read before a new weights version: their blocks are gone already
            if not change.removed:
                self.events.know([OffloadKey(k) for k in change.keys], change.digests)
            self.events.add([OffloadEvent(change.digests, Tier.STORAGE, change.removed)])

    def _adopt(self) -> None:
        """Files the host blocks read for the current index (nothing waits for them)."""
        fetch, index = self._adoption, self.index
        if fetch is None or index is None or not fetch.done.is_set():
            return
        self._adoption = None
        if fetch.result is not None and fetch.result[0]:
            adopted = index.adopt(*fetch.result)
            self.stats["adopted"] += len(adopted)
            log.info("cachexferd: %d of %d block(s) an earlier instance left in the host tier are loadable",
                     len(adopted), len(fetch.result[0]))  # fmt: skip

    def _drop_index(self) -> None:
        self._adoption = None  # read for the old index: the next one reads again
        if self.index is not None:
            self.prefetch.reset()
            self.events.host_gone()  # nothing of the old host tier is loadable any more
        self.index = None

    def _build_index(self) -> OffloadIndex | None:
        """From the daemons' last STATUS (asked for by their probes: nothing blocks here)."""
        statuses = self.conn.statuses()
        blocks = min(int((s.get("host_cache") or {}).get("num_blocks", 0)) for s in statuses) if statuses else 0
        if self.options.host_blocks and blocks:
            blocks = min(blocks, self.options.host_blocks)
        if blocks <= 0:
            self.conn.ask_status()  # no worker has attached yet: the host block size is unknown
            return None
        storage = self.options.uses_storage and all(_has_storage(s) for s in statuses)
        self._storage = storage
        # A new owner token per index: stores the old index planned may still land in host
        # blocks the new one hands out; their stamps then refuse any read the new one plans.
        self._epoch += 1
        self.prefetch.owner = self.owner
        self.prefetch.reset()
        self.stats["rebuilds"] += 1
        log.info("cachexferd: host tier of %d blocks on %d rank(s), storage %s", blocks, len(statuses),
                 "write-through" if storage else "off")  # fmt: skip
        return self._make_index(blocks, storage)

    @property
    def owner(self) -> str:
        """The owner token of the current index's host blocks."""
        return f"{self._owner_base}-e{self._epoch}"

    def _digests(self, keys: Iterable[bytes]) -> list[bytes]:
        return [self.names.block_hash(k).digest for k in keys]

    # OffloadingManager -------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        index = self._refresh()  # (the scheduler's single thread uses the index; the lock guards the connection)
        self.stats["lookups"] += 1
        if (index is None or self._adoption is not None) and self._attaching():
            # The host tier is about to open, or to learn what an earlier instance left in
            # it: vLLM asks again next step.
            return LookupResult.RETRY
        if index is None or not self.conn.usable or not self.serve_loads:
            return LookupResult.MISS  # a daemon behind: no load it could not serve (nor failure to forget)
        digests = self._digests([key])
        if index.lookup(digests):
            self.stats["hits"] += 1
            return LookupResult.HIT
        if index.storing(digests[0]) and self._may_wait_for_store(req_context.req_id):
            return LookupResult.HIT_PENDING  # readable once its store completes: vLLM asks again next step
        if self._storage and self.prefetch.consider(key, req_context.req_id):
            return LookupResult.RETRY  # asking the storage; vLLM asks again next step
        return LookupResult.MISS

    def _may_wait_for_store(self, req_id: str) -> bool:
        """A request whose prefix runs into blocks still being stored (a prompt that comes
        back while its first turn's stores are in flight) waits for them, as for vLLM's own
        offloading, but at most ``max_stall_s`` from its first such lookup: then it computes
        them (a store to a daemon that stopped answering may take ``transfer_timeout_s``)."""
        now = time.monotonic()
        since = self._store_waits.get(req_id)
        if since is None:
            since = self._store_waits[req_id] = now
            self.stats["waited_for_stores"] += 1
        return now - since < self.options.max_stall_s

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._store_waits.pop(req_context.req_id, None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Once per step: notice a lost daemon or a cleared host cache (its blocks are then
        reported removed this step), file the storage answers, send this step's questions."""
        self._refresh()
        with self.conn.lock:
            client = self.conn.client
            if client is None or self.index is None:
                return
            for done in client.poll():
                self.prefetch.on_completion(done, client, self.index)
            if self.conn.usable:
                self.prefetch.flush(client)
            else:
                self.prefetch.drop_queued()  # a daemon behind: these lookups are misses this time

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
        return HostLoadSpec(req_context.req_id, keys, placed.host_ids, placed.from_storage, self.owner)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self.index is not None:
            self.index.touch(self._digests(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        digests = self._digests(keys)
        failed = [d for d in digests if d in self._failed]
        self._failed.difference_update(failed)
        self.stats["failed"] += len(failed)
        if self.index is not None:
            # After a rebuild the new index never saw these blocks: nothing to release.
            # Failed ones are forgotten in every tier: no later lookup offers them again.
            with contextlib.suppress(KeyError):
                self.index.complete_load(digests, failed=failed)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        index = self._refresh()
        if index is None and self._attaching():
            return None  # the host tier is about to open: vLLM offers these blocks again next step
        if index is None or not self.conn.usable:
            # No daemon (or one behind): store nothing (an empty plan, not None, keeps vLLM
            # from warning per request).
            return PrepareStoreOutput(keys_to_store=[], store_spec=HostStoreSpec([], []), evicted_keys=[])
        digests = self._digests(keys)
        self.events.know(keys, digests)
        by_digest = dict(zip(digests, keys))
        groups = dict(zip(digests, (get_offload_group_idx(k) for k in keys)))
        placed = prepare_stores(index, list(groups), list(groups.values()), _chains(req_context))
        if placed is None:
            self.stats["store_refused"] += 1
            return None
        self.stats["stores"] += 1
        store_keys = [by_digest[d] for d in placed.digests]
        spec = HostStoreSpec(store_keys, placed.host_ids, write_through=placed.write_through, owner=self.owner,
                             parent=placed.parent)  # fmt: skip
        # Evicted keys only feed vLLM's KV events; the index reports evictions by digest.
        return PrepareStoreOutput(keys_to_store=store_keys, store_spec=spec, evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        digests = self._digests(keys)
        failed = [d for d in digests if d in self._failed]
        self._failed.difference_update(failed)
        self.stats["failed"] += len(failed)
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

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What became loadable from, or left, the host tier (medium CPU) and the storage tier
        (medium STORAGE) since the last call (vLLM asks once per step when its KV events are on)."""
        if self.index is not None:
            self.events.add(self.index.take_events())
        self._take_journal()
        return self.events.take()

    def reset_cache(self) -> None:
        self._drop_index()
        self._failed.clear()
        self._refresh()

    def shutdown(self) -> None:
        log.info("cachexferd: scheduler-side totals: %s", {**self.stats, "events_dropped": self.events.dropped})
        if self.journal is not None:
            self.journal.close()
        self.conn.close()

    def describe(self) -> dict[str, Any]:
        return {"connected": self.conn.up, "index": self.index is not None, "promoted": self.prefetch.promoted,
                **self.stats, "events_dropped": self.events.dropped,
                "storage_journal": self.journal.journal if self.journal is not None else None}  # fmt: skip


def _has_storage(status: dict[str, Any]) -> bool:
    return str((status.get("storage") or {}).get("backend", "none")) != "none"


def _chains(req_context: ReqContext) -> Chains:
    """The request's chain tails, kept in its ReqContext for its later stores."""
    chains: Chains | None = req_context.get_state(Chains)
    if chains is None:
        chains = Chains()
        req_context.set_state(chains)
    return chains
