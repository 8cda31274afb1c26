"""Host and storage tiers for an engine that owns its GPU tier itself.

An engine with its own GPU prefix cache (vLLM's scheduler, for one) decides which blocks
to offload and asks this index where they go and where they are, by block hash only::

    index = OffloadIndex(host_blocks=4096, space=keyspace, storage=True)
    n = index.lookup(hashes)                    # leading blocks offloaded (host or storage)
    plan = index.prepare_load(hashes[:n])       # protected from eviction until complete_load
    ...                                         # worker: swap_in / load into the GPU blocks
    index.complete_load(hashes[:n])
    plan = index.prepare_store(new_hashes)      # None when the host tier has no room
    ...                                         # worker: swap_out into plan.host_ids
    index.complete_store(plan.hashes, success=True)

The index moves no bytes and sends no command: the caller's worker does, with
``EngineClient`` (docs/index.md shows the calls). Not thread-safe: call it from one thread
(the scheduler's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..storage.keys import BlockHash, KeySpace
from .tree import BUSY, DEAD, HOST_IN, STORED, Node, Tree
from .types import HashLike, Invalidation, LoadPlan, NoRoomError, OffloadEvent, StorePlan, Tier

__all__ = ["NoRoomError", "OffloadIndex"]


class OffloadIndex:
    """Host + storage tiers, addressed by block hash (a ``BlockHash`` or its digest bytes).

    ``host_blocks``: host block ids ``0..host_blocks-1`` are this index's to hand out (the
    daemon's host pool). ``space``: the KeySpace that names storage objects; with
    ``storage=True`` every block written to the host tier is also written to storage
    (write-through: ``StorePlan.write_through``), so host evictions only drop host copies
    and blocks stay loadable from storage. ``events=True`` records what ``take_events``
    returns (leave it off when nobody drains them). ``debug=True`` checks every free for
    double frees (slower). Only full blocks are cached: a partial ``BlockHash`` ends a lookup
    and is refused by ``prepare_store``.

    The caller's hashes are taken to be one chain (each block's hash covers its prefix), so
    reads find blocks by hash alone, however many calls stored them. The tree's links only
    order eviction: a block's predecessor stays until its successors' host copies are gone.
    Blocks stored in one call are linked; ``prepare_store(..., parent=)`` links a call to
    the block before it. A block whose predecessor is not offloaded starts a chain of its own.
    """

    def __init__(
        self,
        host_blocks: int,
        space: KeySpace | None = None,
        *,
        storage: bool = False,
        events: bool = False,
        debug: bool = False,
    ) -> None:
        if storage and space is None:
            raise ValueError("storage=True needs the KeySpace that names storage objects")
        self.tree = Tree(0, host_blocks, debug=debug)
        self.space = space
        self.storage = storage
        self._record = events
        self._events: list[OffloadEvent] = []
        self._held: dict[bytes, Node] = {}  # protected by prepare_load (node.ref counts holders)
        self._loading: dict[bytes, Node] = {}  # storage -> host reads in flight
        self._storing: dict[bytes, Node] = {}  # host writes in flight (prepare_store)

    # Reads -------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[HashLike]) -> int:
        """How many leading blocks of ``hashes`` are offloaded and readable now, in the host
        tier or (with storage) the storage tier. Blocks still being written do not count.
        Storage hits are counted only as far as host blocks can be found to load them into."""
        hits = from_storage = 0
        nodes = self.tree.present(_full_digests(hashes))
        for node in nodes:
            if node.host >= 0 and not node.flags & HOST_IN:
                hits += 1
            elif self._loadable_from_storage(node):
                hits += 1
                from_storage += 1
            else:
                break
        short = from_storage - len(self.tree.host_free)
        if short <= 0:
            return hits
        # Count storage hits only as far as host blocks can be freed to read them into.
        room = len(self.tree.host_free) + self.tree.evictable_host(short)
        for i, node in enumerate(nodes[:hits]):
            if node.host < 0 or node.flags & HOST_IN:
                if room == 0:
                    return i
                room -= 1
        return hits

    def storing(self, digest: bytes) -> bool:
        """Whether the block is being written into the host tier (``prepare_store`` and no
        ``complete_store`` yet) and still in the tree: it becomes readable when that write
        completes, unless the write fails."""
        node = self._storing.get(digest)
        return node is not None and not node.flags & DEAD

    def prepare_load(self, hashes: Sequence[HashLike]) -> LoadPlan:
        """Where each block is: its host block id, or (storage) a host block allocated here
        that the block must be read into first (``LoadPlan.from_storage``). Every block is
        protected from eviction until ``complete_load``. Call it with blocks ``lookup``
        counted; raises KeyError for a block that is not offloaded and NoRoomError when no
        host block can be freed for a storage block (nothing is protected then)."""
        digests = _full_digests(hashes)
        nodes = self.tree.present(digests)
        if len(nodes) < len(digests):
            raise KeyError(f"block {digests[len(nodes)].hex()[:16]} is not offloaded")
        from_storage = [i for i, node in enumerate(nodes) if node.host < 0 or node.flags & HOST_IN]
        for i in from_storage:
            if not self._loadable_from_storage(nodes[i]):
                raise KeyError(f"block {digests[i].hex()[:16]} is not readable now")
        for node in nodes:
            node.ref += 1  # before any eviction below, so none of them is chosen
        host_ids = self._allocate_host(len(from_storage))
        if host_ids is None:
            self._unhold(nodes)
            raise NoRoomError(f"no host block can be freed to load {len(from_storage)} blocks from storage")
        for i, host in zip(from_storage, host_ids):
            self.tree.set_host(nodes[i], host)
            nodes[i].flags |= HOST_IN
            self._loading[digests[i]] = nodes[i]
        for digest, node in zip(digests, nodes):
            self._held[digest] = node
        return LoadPlan(digests, [node.host for node in nodes], from_storage, self.space)

    def complete_load(self, hashes: Sequence[HashLike], failed: Sequence[HashLike] = ()) -> None:
        """The load of ``hashes`` (as given to prepare_load) finished: they may be evicted
        again. Blocks read from storage become host blocks. Blocks in ``failed`` are
        forgotten in every tier, so no later lookup sends the engine after them again: a
        block missing in storage or unreadable stops counting as stored, and one whose host
        copy could not be read loses its host block too (once no other load holds it).
        Hashes that were not prepared are ignored."""
        missing = set(_full_digests(failed))
        for digest in _full_digests(hashes):
            node = self._held.get(digest)
            if node is None:
                continue
            node.ref -= 1
            if not node.ref:
                del self._held[digest]
            if self._loading.pop(digest, None) is not None:
                self._finish_storage_read(node, ok=digest not in missing)
            elif digest in missing:
                self._forget(node)
            self.tree.settle(node)
        self.tree.recycle()

    def touch(self, hashes: Sequence[HashLike]) -> None:
        """Marks the blocks (those that are offloaded) as just used, for LRU eviction."""
        stamp = self.tree.tick()
        get = self.tree.nodes.get
        for digest in _full_digests(hashes):
            node = get(digest)
            if node is not None:
                node.stamp = stamp

    # Writes ------------------------------------------------------------------------------

    def prepare_store(self, hashes: Sequence[HashLike], parent: HashLike | None = None) -> StorePlan | None:
        """Allocates host blocks for the hashes not already offloaded or in flight, evicting
        least recently used unprotected host blocks if needed (never blocks being loaded,
        stored or protected by prepare_load). Returns None when there is not enough room for
        all of them: nothing is allocated then (blocks evicted while trying are reported by
        ``take_events``). The allocated blocks are protected until ``complete_store``.
        ``parent``: the block just before ``hashes[0]``, when an earlier call stored it; new
        blocks then hang under it (if it is still offloaded) instead of starting a chain."""
        digests = _full_digests(hashes, strict=True)
        get = self.tree.nodes.get
        wanted = [d for d in dict.fromkeys(digests) if _needs_host_copy(get(d))]
        if not wanted:
            return StorePlan([], [], [], self.storage, self.space)
        # The blocks of this chain that are already offloaded must survive the eviction.
        present = [node for node in map(get, digests) if node is not None]
        for node in present:
            node.ref += 1
        evicted: list[bytes] = []
        host_ids = self._allocate_host(len(wanted), evicted)
        self._unhold(present)
        if host_ids is None:
            return None
        self.tree.tick()
        anchor = _full_digests([parent]) if parent is not None else []
        self._place_stores(digests, wanted, host_ids, anchor[0] if anchor else None)
        return StorePlan(wanted, host_ids, evicted, self.storage, self.space)

    def complete_store(self, hashes: Sequence[HashLike], success: bool = True) -> None:
        """The writes prepared by prepare_store finished. On success the blocks become
        readable (and, with write-through, count as stored); on failure their host blocks
        are freed and the blocks are forgotten. Hashes that were not being stored are
        ignored, so the caller may pass the whole list it gave prepare_store."""
        done: list[bytes] = []
        for digest in _full_digests(hashes):
            node = self._storing.pop(digest, None)
            if node is None:
                continue
            node.flags &= ~HOST_IN
            if success:
                node.flags |= STORED if self.storage else 0
                done.append(digest)
            elif node.host >= 0:
                self.tree.freed_host.append(self.tree.clear_host(node))
            self.tree.settle(node)
        self.tree.recycle()
        if done:
            self._event(done, Tier.HOST, removed=False)
            if self.storage:
                self._event(done, Tier.STORAGE, removed=False)

    def adopt(self, hashes: Sequence[HashLike], host_ids: Sequence[int]) -> list[bytes]:
        """Blocks already in the host cache that this index did not place (an earlier engine,
        or another one, wrote them; the daemon vouches for their identity, protocol 1.3):
        ``hashes[i]`` becomes readable at ``host_ids[i]``, a chain of its own. Blocks already
        known and ids not free now are skipped. Returns the digests adopted."""
        get = self.tree.nodes.get
        pairs = dict(zip(_full_digests(hashes), host_ids))
        pairs = {d: h for d, h in pairs.items() if get(d) is None and 0 <= h < self.tree.host_free.capacity}
        taken = set(self.tree.host_free.take_these(pairs.values()))
        stamp = self.tree.tick()
        adopted: list[bytes] = []
        for digest, host in pairs.items():
            if host not in taken:
                continue
            taken.discard(host)  # two digests at one id: the first one wins
            node = self.tree.child(self.tree.root, digest)
            self.tree.set_host(node, host)
            node.stamp = stamp
            self.tree.settle(node)
            adopted.append(digest)
        self.tree.host_free.release(list(taken))
        self._event(adopted, Tier.HOST, removed=False)
        return adopted

    # Weights, events, checks ---------------------------------------------------------------

    def new_weights(self, weights_version: str) -> Invalidation:
        """Forgets every block (host and storage) computed with the old weights: storage keys
        of the new KeySpace never match old objects. Blocks with transfers in flight are
        freed when those complete. Returns what was dropped."""
        old = self.space.weights_version if self.space is not None else ""
        if self._record:
            self._event([n.digest for n in self.tree if n.host >= 0], Tier.HOST, removed=True)
            self._event([n.digest for n in self.tree if n.flags & STORED], Tier.STORAGE, removed=True)
        dropped = self.tree.kill_all()
        self.tree.recycle()
        if self.space is not None:
            self.space = dataclasses.replace(self.space, weights_version=weights_version)
        return Invalidation(old, weights_version, dropped.nodes, 0, dropped.host, dropped.stored)

    def take_events(self) -> list[OffloadEvent]:
        """Blocks that became readable or were dropped since the last call, per tier
        (always empty unless the index was made with ``events=True``)."""
        events, self._events = self._events, []
        return events

    @property
    def host_free(self) -> int:
        return len(self.tree.host_free)

    def __len__(self) -> int:
        return len(self.tree)

    def check(self) -> None:
        """Invariants (for tests): the tree's, and every host id exactly once in the free
        list or on a node."""
        self.tree.check()
        nodes = {id(n): n for n in [*self.tree, *self._held.values(), *self._storing.values()]}
        held = [n.host for n in nodes.values() if n.host >= 0]
        free = self.tree.host_free.free_ids()
        assert not self.tree.freed_host, "freed host ids not recycled"
        assert len(held) + len(free) == self.tree.host_free.capacity, (len(held), len(free))
        assert len(set(held) | set(free)) == self.tree.host_free.capacity, "a host id is in two places"

    # Helpers -----------------------------------------------------------------------------

    def _loadable_from_storage(self, node: Node) -> bool:
        return self.storage and node.host < 0 and node.flags & (STORED | BUSY | DEAD) == STORED

    def _allocate_host(self, n: int, evicted: list[bytes] | None = None) -> list[int] | None:
        tree = self.tree
        short = n - len(tree.host_free)
        if short > 0:
            out = tree.evict_host(short, spill=False)  # write-through: storage already has them
            tree.recycle()
            if out.digests:
                self._event(out.digests, Tier.HOST, removed=True)
                if evicted is not None:
                    evicted += out.digests
        return tree.host_free.take(n)

    def _place_stores(
        self, digests: list[bytes], wanted: list[bytes], host_ids: list[int], parent: bytes | None
    ) -> None:
        """Creates the nodes of ``digests`` that are missing, in chain order (under the node of
        ``parent``, when given and known), and gives each wanted one its host block (in flight
        until complete_store)."""
        get, ids = self.tree.nodes.get, dict(zip(wanted, host_ids))
        prev: Node | None = get(parent) if parent is not None else None
        for digest in digests:
            node = get(digest)
            if node is None:
                node = self.tree.child(prev or self.tree.root, digest)
            host = ids.pop(digest, -1)
            if host >= 0:
                self.tree.set_host(node, host)
                node.flags |= HOST_IN
                self._storing[digest] = node
            node.stamp = self.tree.clock
            prev = node

    def _finish_storage_read(self, node: Node, ok: bool) -> None:
        node.flags &= ~HOST_IN
        if ok:
            self._event([node.digest], Tier.HOST, removed=False)
            return
        if node.host >= 0:
            self.tree.freed_host.append(self.tree.clear_host(node))
        node.flags &= ~STORED  # the store no longer has it
        self._event([node.digest], Tier.STORAGE, removed=True)

    def _forget(self, node: Node) -> None:
        """A host copy that failed to load: dropped with its stored mark, unless another
        load still holds it (that load fails too, and drops it then)."""
        if node.ref or node.flags & BUSY:
            return
        if node.host >= 0:
            self.tree.freed_host.append(self.tree.clear_host(node))
            self._event([node.digest], Tier.HOST, removed=True)
        if node.flags & STORED:
            node.flags &= ~STORED
            self._event([node.digest], Tier.STORAGE, removed=True)

    def _unhold(self, nodes: list[Node]) -> None:
        for node in nodes:
            node.ref -= 1
            self.tree.settle(node)

    def _event(self, digests: list[bytes], tier: Tier, removed: bool) -> None:
        if self._record and digests:
            self._events.append(OffloadEvent(list(digests), tier, removed))


def _needs_host_copy(node: Node | None) -> bool:
    return node is None or (node.host < 0 and not node.flags & DEAD)


def _full_digests(hashes: Sequence[HashLike], *, strict: bool = False) -> list[bytes]:
    """Digests of the leading full blocks; a partial BlockHash ends the list (or, strict,
    is refused)."""
    out = []
    for h in hashes:
        if isinstance(h, BlockHash):
            if h.partial:
                if strict:
                    raise ValueError("partial blocks are not cached: pass full blocks only")
                break
            out.append(h.digest)
        else:
            out.append(bytes(h))
    return out
