"""The tiered prefix index for an engine that lets cachexferd manage all three tiers.

The index owns the GPU, host and storage block bookkeeping, and drives the daemons with an
``EngineClient`` (anything with its ``swap_out / swap_in / store / load / poll`` methods).
One scheduler step::

    index.poll()                               # completions: fetched blocks arrive, evicted ones leave
    match = index.match(prompt_tokens)         # or match_hashes(block_hashes)
    lease = index.acquire(match)               # references + swap-ins (host hits) + loads (storage hits)
    ...                                        # once lease.ready: lease.block_ids[:lease.hit] hold the prefix
    index.allocate(lease, n)                   # GPU blocks for the rest (evicts; None: not yet)
    index.insert(lease, block_hashes)          # after prefill / decode filled them
    index.release(lease)                       # request finished
    index.flush()                              # one command per kind for everything this step moves

Not thread-safe: call it from the scheduler's thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..storage.keys import BlockHash, ExtraKey, KeySpace
from .lease import Lease, Match
from .transfers import Transfer, TransferClient, Transfers, release_from
from .tree import BUSY, DEAD, GPU_IN, HOST_IN, STORED, Node, Tree
from .types import HashLike, Invalidation, Tier

StoragePolicy = Literal["none", "write_through", "on_eviction"]
_LOADABLE = STORED | BUSY | DEAD  # a storage hit has exactly STORED of these


@dataclass(frozen=True)
class IndexStats:
    nodes: int
    gpu_free: int
    gpu_used: int
    host_free: int
    host_used: int
    hit_blocks: dict[str, int]  # blocks acquired by source tier ("gpu", "host", "storage") and "miss"
    commands: dict[str, int]  # commands sent per kind
    moved_blocks: dict[str, int]  # blocks moved per kind (successful)
    failed_blocks: dict[str, int]
    moved_bytes: int  # summed over ranks
    inflight: int  # commands sent and not yet completed
    quarantined: int  # ids held back after client-side timeouts


class PrefixIndex:
    """GPU / host / storage prefix cache over the chained block hashes of ``space``.

    ``gpu_blocks`` / ``host_blocks``: the ids ``0..n-1`` of each tier belong to the index
    (the runner's whole KV cache and the daemon's host pool, or the parts reserved for it).
    ``storage``: "none"; "write_through" (every block that reaches the host tier is also
    stored); "on_eviction" (a host block is stored when it is evicted, then freed).
    ``client``: an EngineClient (None: bookkeeping only; flush() then refuses to send).
    ``debug=True`` checks every free for double frees.
    """

    def __init__(
        self,
        client: TransferClient | None,
        space: KeySpace,
        *,
        gpu_blocks: int,
        host_blocks: int = 0,
        storage: StoragePolicy = "none",
        timeout_s: float | None = None,
        debug: bool = False,
    ) -> None:
        if storage not in ("none", "write_through", "on_eviction"):
            raise ValueError(f"storage must be none, write_through or on_eviction, got {storage!r}")
        self.space = space
        self.storage = storage
        self.tree = Tree(gpu_blocks, host_blocks, debug=debug)
        self.moves = Transfers(self.tree, client, lambda: self.space, storage == "write_through", timeout_s)
        self.hit_blocks = {"gpu": 0, "host": 0, "storage": 0, "miss": 0}
        self._leases: set[Lease] = set()
        self._generation = 0  # bumped by new_weights: older leases cache nothing more
        self._room_waiters: list[Lease] = []  # leases whose fetches wait for GPU/host room

    # Matching ----------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None) -> Match:
        """``match_hashes`` of the full blocks of ``tokens`` (hashed here)."""
        return self.match_hashes(self.space.block_hashes(tokens, extra_keys, partial=False))

    def match_hashes(self, hashes: Sequence[HashLike]) -> Match:
        """The leading blocks of ``hashes`` (chained from block 0) found in the index, with
        the tier each would come from. Changes nothing."""
        digests = [h.digest if type(h) is BlockHash else h for h in hashes]
        get, storage = self.tree.nodes.get, self.storage != "none"
        nodes: list[Node] = []
        swap_in: list[int] = []
        load: list[bytes] = []
        gpu, prev = 0, self.tree.root
        for digest in digests:
            node = get(digest)  # type: ignore[arg-type]
            if node is None or node.parent is not prev:
                break
            if node.gpu >= 0:
                gpu += 1
            elif node.host >= 0 and not node.flags & HOST_IN:
                swap_in.append(node.host)
            elif storage and node.flags & _LOADABLE == STORED:
                load.append(node.digest)
            else:
                break
            nodes.append(node)
            prev = node
        return Match(nodes, gpu, len(swap_in), len(load), swap_in, load, digests)  # type: ignore[arg-type]

    # A request's blocks ------------------------------------------------------------------

    def acquire(self, match: Match) -> Lease:
        """Takes the matched blocks for a request: references them, and queues a swap-in for
        each host hit and a load for each storage hit into newly allocated GPU blocks (after
        evicting, if needed: the lease then waits across polls for the evicted blocks to be
        swapped out; if no room can come, the hit is shortened). The lease is ``ready`` once
        every fetch completed."""
        stamp = self.tree.tick()
        nodes = self._still_cached(match.nodes)
        for node in nodes:
            node.ref += 1  # first, so that the evictions below never pick them
            node.stamp = stamp
        lease = Lease(self._generation)
        lease.nodes, lease.hit = nodes, len(nodes)
        self._leases.add(lease)
        self.hit_blocks["miss"] += len(match.hashes) - len(nodes)
        self._place(lease)
        if lease.placed < lease.hit:
            self._room_waiters.append(lease)
        return lease

    def allocate(self, lease: Lease, n: int) -> list[int] | None:
        """``n`` more GPU blocks for the lease's block table (evicting if needed), or None when
        not enough can be freed now (evictions that swap out free theirs on completion)."""
        self._check_usable(lease)
        self._make_room(Tier.GPU, n)
        ids = self.tree.gpu_free.take(n)
        if ids is None:
            return None
        lease.block_ids += ids
        lease.private.update(ids)
        return ids

    def insert(self, lease: Lease, hashes: Sequence[HashLike]) -> int:
        """Caches the lease's computed blocks. ``hashes``: the request's full-block hashes
        from block 0 (a partial BlockHash ends them); blocks beyond those already cached and
        within the lease's block table are added. Returns how many were added (none for a
        lease acquired before the last ``new_weights``: its KV is from the old weights)."""
        self._check_usable(lease)
        if lease.generation != self._generation:
            return 0
        digests = _full_digests(hashes)
        start, end = len(lease.nodes), min(len(digests), len(lease.block_ids))
        if start and start <= len(digests) and digests[start - 1] != lease.nodes[-1].digest:
            raise ValueError("hashes do not continue this lease's cached blocks")
        tree, stamp = self.tree, self.tree.tick()
        prev = lease.nodes[-1] if lease.nodes else tree.root
        for i in range(start, end):
            node = tree.child(prev, digests[i])
            block = lease.block_ids[i]
            if node.gpu < 0:  # else another request cached it first: ours stays private
                tree.set_gpu(node, block)
                lease.private.discard(block)
            node.ref += 1
            node.stamp = stamp
            lease.nodes.append(node)
            prev = node
        return max(0, end - start)

    def release(self, lease: Lease) -> None:
        """The request finished: its cached blocks become evictable (most recently used first
        to stay), the blocks it owned alone are freed."""
        if lease.released:
            return
        for transfer in lease.waiting:
            transfer.waiters.remove(lease)
        lease.waiting.clear()
        if lease in self._room_waiters:
            self._room_waiters.remove(lease)
        self.tree.tick()
        release_from(self.tree, lease, 0)
        lease.released = True
        self._leases.discard(lease)
        self.tree.recycle()

    # Eviction and steps ------------------------------------------------------------------

    def evict(self, n: int, tier: Tier = Tier.GPU, *, batch: bool = True) -> int:
        """Evicts up to ``n`` blocks of ``tier`` (unreferenced leaves, LRU first); returns how
        many. GPU: swapped out to host while host blocks can be had (after evicting host
        leaves), else dropped. Host: stored first with storage="on_eviction", else dropped.
        Swapped-out / stored blocks are freed when their completion arrives. ``batch=False``
        recycles each dropped block at once instead of once after the loop (for comparison)."""
        tree = self.tree
        if tier is Tier.GPU:
            spill = tree.host_free.capacity > 0
            if spill:
                self._make_room(Tier.HOST, n)
            out = tree.evict_gpu(n, spill=spill, batch=batch)
            for node, gpu, host in out.spilled:
                self.moves.queue("swap_out", node, gpu, host)
        elif tier is Tier.HOST:
            out = tree.evict_host(n, spill=self.storage == "on_eviction")
            for node, _, host in out.spilled:
                self.moves.queue_store(node, host, spilled=True)
        else:
            raise ValueError("the storage tier is evicted by its backend, not by the index")
        tree.recycle()
        return out.count

    def poll(self) -> list[Any]:
        """Takes every completion available from the client and applies the index's own;
        returns the others (commands the engine sent itself). Never blocks."""
        if self.moves.client is None:
            return []
        others = [c for c in self.moves.client.poll() if not self.moves.complete(c)]
        self.tree.recycle()
        if self._room_waiters:
            for lease in list(self._room_waiters):
                self._place(lease)
            self._room_waiters = [lease for lease in self._room_waiters if lease.placed < lease.hit]
            self.tree.recycle()
        return others

    def flush(self) -> None:
        """Sends everything queued since the last flush: at most one command per kind."""
        self.moves.flush()
        self.tree.recycle()

    def step(self) -> list[Any]:
        """``poll()`` then ``flush()``: once per scheduler step."""
        others = self.poll()
        self.flush()
        return others

    @property
    def busy(self) -> bool:
        """Transfers queued or in flight."""
        return bool(self.moves.queued or self.moves.inflight)

    # Weights, stats, checks --------------------------------------------------------------

    def new_weights(self, weights_version: str) -> Invalidation:
        """Forgets every cached block of the old weights in one call: GPU and host copies
        (freed now, or when their request or transfer ends) and stored objects (the new
        KeySpace names other keys, so they never match again)."""
        old = self.space.weights_version
        self._generation += 1
        dropped = self.tree.kill_all()
        self.tree.recycle()
        self.space = dataclasses.replace(self.space, weights_version=weights_version)
        return Invalidation(old, weights_version, dropped.nodes, dropped.gpu, dropped.host, dropped.stored)

    def stats(self) -> IndexStats:
        moved, tree = self.moves.moved, self.tree
        return IndexStats(
            len(tree), len(tree.gpu_free), tree.gpu_free.used, len(tree.host_free), tree.host_free.used,
            dict(self.hit_blocks), dict(moved.commands), dict(moved.blocks), dict(moved.failed_blocks), moved.bytes,
            len(self.moves.inflight), sum(len(q) for q in self.moves.quarantined.values()),
        )  # fmt: skip

    def check(self) -> None:
        """Invariants (tests, debug): the tree's; each GPU and host id in exactly one place
        (free, a node, a transfer, a lease, quarantine); references = leases holding them."""
        from .checks import check_index

        check_index(self)

    # Helpers -----------------------------------------------------------------------------

    def _still_cached(self, nodes: list[Node]) -> list[Node]:
        """The leading matched nodes that are still hits (the match may be from before a poll)."""
        storage = self.storage != "none"
        for i, node in enumerate(nodes):
            flags = node.flags
            hit = node.gpu >= 0 or (node.host >= 0 and not flags & HOST_IN) or (storage and flags & _LOADABLE == STORED)
            if flags & DEAD or not hit:
                return nodes[:i]
        return list(nodes)

    def _place(self, lease: Lease) -> None:
        """Gives the lease's cached blocks GPU blocks, in order, fetching the ones not on the
        GPU; stops where no room is free yet but some is on its way (swap-outs in flight),
        and shortens the hit where none can come."""
        pending = lease.nodes[lease.placed : lease.hit]
        # Host blocks for the loads first: the GPU evictions below may swap out into free ones.
        need_host = sum(1 for node in pending if node.gpu < 0 and node.host < 0)
        self._make_room(Tier.HOST, need_host)
        staging = self.tree.host_free.take(min(need_host, len(self.tree.host_free))) or []
        self._make_room(Tier.GPU, sum(1 for node in pending if node.gpu < 0))
        try:
            self._place_in_order(lease, staging)
        finally:
            if staging:
                self.tree.host_free.release(staging)

    def _place_in_order(self, lease: Lease, staging: list[int]) -> None:
        tree, leaving = self.tree, self.moves.leaving
        for i in range(lease.placed, lease.hit):
            node = lease.nodes[i]
            if node.gpu < 0:
                from_host = node.host >= 0 and not node.flags & HOST_IN
                if not from_host and not (self.storage != "none" and node.flags & _LOADABLE == STORED):
                    self._shorten(lease, i)  # no longer cached anywhere
                    return
                short_gpu, short_host = not tree.gpu_free, not from_host and not staging
                if short_gpu or short_host:
                    if (not short_gpu or leaving[Tier.GPU]) and (not short_host or leaving[Tier.HOST]):
                        lease.placed = i  # room is on its way: try again after the next poll
                    else:
                        self._shorten(lease, i)
                    return
            self._bring_to_gpu(lease, node, staging)
        lease.placed = lease.hit

    def _shorten(self, lease: Lease, keep: int) -> None:
        self.hit_blocks["miss"] += lease.hit - keep
        release_from(self.tree, lease, keep)
        lease.placed = lease.hit = keep
        lease.truncated = True

    def _bring_to_gpu(self, lease: Lease, node: Node, staging: list[int]) -> None:
        tree, moves = self.tree, self.moves
        transfer: Transfer | None
        if node.gpu >= 0:
            self.hit_blocks["gpu"] += 1
            transfer = moves.arriving.get(node)  # another request's fetch: wait for it too
        else:
            gpu = tree.gpu_free.take_one()
            tree.set_gpu(node, gpu)
            if node.host >= 0:
                self.hit_blocks["host"] += 1
                node.flags |= GPU_IN
                transfer = moves.queue("swap_in", node, gpu, node.host)
            else:
                self.hit_blocks["storage"] += 1
                tree.set_host(node, staging.pop())
                node.flags |= GPU_IN | HOST_IN
                transfer = moves.queue("load", node, gpu, node.host)
        if transfer is not None and lease not in transfer.waiters:
            transfer.waiters.append(lease)
            lease.waiting.add(transfer)
        lease.block_ids.append(node.gpu)

    def _make_room(self, tier: Tier, n: int) -> None:
        """Evicts what ``n`` blocks need beyond the free ones and those already leaving."""
        free = len(self.tree.gpu_free if tier is Tier.GPU else self.tree.host_free) + self.moves.leaving[tier]
        if n > free:
            self.evict(n - free, tier)

    @staticmethod
    def _check_usable(lease: Lease) -> None:
        if lease.released:
            raise RuntimeError("this lease was released")
        if not lease.ready:
            raise RuntimeError("this lease still waits for its cached blocks: poll() until lease.ready")


def _full_digests(hashes: Sequence[HashLike]) -> list[bytes]:
    out = []
    for h in hashes:
        if isinstance(h, BlockHash):
            if h.partial:
                break
            out.append(h.digest)
        else:
            out.append(bytes(h))
    return out
