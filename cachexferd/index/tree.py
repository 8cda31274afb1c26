"""The radix tree over chained block hashes, its per-tier leaf heaps and its free lists.

One node per cached full block, keyed by the block's chained digest
(``cachexferd.storage.keys``): equal digests mean equal prefixes, so one dict lookup per
block finds a node, and the parent pointer is the tree edge. A node's copies: ``gpu`` and
``host`` block ids (-1: none) and the STORED flag (an object under the current KeySpace).

Eviction takes unreferenced leaves of a tier in LRU order: a node is a GPU leaf when no
child holds a GPU copy (``gpu_kids == 0``), a host leaf likewise. Each tier keeps a lazy
heap of (stamp, serial, node): a node has at most one entry per heap (the QUEUED flags), is
checked again when popped (still a leaf, unreferenced, idle, stamp unchanged; a touched node
is pushed back with its new stamp) and is pushed when it becomes a leaf. The victim leaves
its tier and its parent's count drops *before* the parent is considered for the heap, so a
parent is never queued while a child still counts, and every node leaves a tier once.
Freed ids are collected in ``freed_gpu`` / ``freed_host`` and returned to the free lists in
one batch by ``recycle()``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from .blocks import FreeList

STORED = 1  # an object exists in storage (as far as the index knows)
GPU_QUEUED = 2  # has an entry in the GPU leaf heap
HOST_QUEUED = 4  # has an entry in the host leaf heap
GPU_IN = 8  # node.gpu is the destination of a swap-in or load in flight
GPU_OUT = 16  # a swap-out reads the node's old GPU block (its id lives in the transfer)
HOST_IN = 32  # node.host is the destination of a write in flight (swap-out, load, engine store)
HOST_OUT = 64  # a store to storage reads the node's host block
DEAD = 128  # no longer in the tree (removed or invalidated): only its ids remain to free
BUSY = GPU_IN | GPU_OUT | HOST_IN | HOST_OUT


class Node:
    """One cached block. ``kids``: children in the tree; ``gpu_kids`` / ``host_kids``: those
    holding a GPU / host copy (a node is a tier leaf when its count is 0)."""

    __slots__ = ("digest", "flags", "gpu", "gpu_kids", "host", "host_kids", "kids", "parent", "ref", "stamp")

    def __init__(self, digest: bytes, parent: Node | None, stamp: int) -> None:
        self.digest = digest
        self.parent = parent
        self.gpu = -1
        self.host = -1
        self.flags = 0
        self.ref = 0
        self.stamp = stamp
        self.kids = 0
        self.gpu_kids = 0
        self.host_kids = 0

    def __repr__(self) -> str:
        return f"Node({self.digest.hex()[:8]} gpu={self.gpu} host={self.host} flags={self.flags:#x} ref={self.ref})"


@dataclass
class Dropped:
    """Counts of what ``Tree.kill_all`` dropped."""

    nodes: int = 0
    gpu: int = 0
    host: int = 0
    stored: int = 0


@dataclass
class Evicted:
    """Outcome of one eviction loop. ``spilled``: victims whose copy moves down a tier
    (GPU: (node, gpu id, host id) swap-outs; host: (node, 0, host id) stores), their old
    block still reserved until the transfer completes."""

    count: int = 0
    digests: list[bytes] = field(default_factory=list)  # host victims, in eviction order
    spilled: list[tuple[Node, int, int]] = field(default_factory=list)


class Tree:
    def __init__(self, gpu_blocks: int, host_blocks: int, *, debug: bool = False) -> None:
        self.debug = debug
        self.gpu_free = FreeList(gpu_blocks, debug=debug)
        self.host_free = FreeList(host_blocks, debug=debug)
        self.freed_gpu: list[int] = []
        self.freed_host: list[int] = []
        self.clock = 0
        self._serial = itertools.count()
        self._reset()

    def _reset(self) -> None:
        self.nodes: dict[bytes, Node] = {}
        self.root = Node(b"", None, 0)
        self._gpu_heap: list[tuple[int, int, Node]] = []
        self._host_heap: list[tuple[int, int, Node]] = []

    def tick(self) -> int:
        """Advances the LRU clock: every node touched in one operation shares the stamp."""
        self.clock += 1
        return self.clock

    def __len__(self) -> int:
        return len(self.nodes)

    # Structure ---------------------------------------------------------------------------

    def child(self, parent: Node, digest: bytes) -> Node:
        """The node of ``digest`` under ``parent``, created when missing."""
        node = self.nodes.get(digest)
        if node is None:
            node = Node(digest, parent, self.clock)
            self.nodes[digest] = node
            parent.kids += 1
        elif node.parent is not parent:
            raise ValueError(f"block {digest.hex()[:16]} is cached under another prefix: hashes are not one chain")
        return node

    def present(self, digests: list[bytes]) -> list[Node]:
        """The nodes of the longest leading run of ``digests`` that are all in the tree,
        wherever each hangs (for callers whose hashes are known to be one chain)."""
        get = self.nodes.get
        out: list[Node] = []
        for digest in digests:
            node = get(digest)
            if node is None:
                break
            out.append(node)
        return out

    def _remove(self, node: Node) -> None:
        """Takes a node without copies or children out of the tree, then its parents that
        are left the same way."""
        root, nodes = self.root, self.nodes
        while True:
            del nodes[node.digest]
            node.flags |= DEAD
            parent = node.parent
            assert parent is not None
            parent.kids -= 1
            if parent is root or parent.kids or parent.ref or parent.gpu >= 0 or parent.host >= 0:
                return
            if parent.flags & (STORED | BUSY):
                return
            node = parent

    # Copies ------------------------------------------------------------------------------

    def set_gpu(self, node: Node, block: int) -> None:
        assert node.gpu < 0
        node.gpu = block
        node.parent.gpu_kids += 1  # type: ignore[union-attr]

    def clear_gpu(self, node: Node) -> int:
        block, node.gpu = node.gpu, -1
        if not node.flags & DEAD:
            node.parent.gpu_kids -= 1  # type: ignore[union-attr]
        return block

    def set_host(self, node: Node, block: int) -> None:
        assert node.host < 0
        node.host = block
        node.parent.host_kids += 1  # type: ignore[union-attr]

    def clear_host(self, node: Node) -> int:
        block, node.host = node.host, -1
        if not node.flags & DEAD:
            node.parent.host_kids -= 1  # type: ignore[union-attr]
        return block

    def settle(self, node: Node) -> None:
        """After a change to ``node``: queue it where it is now a leaf, take it out of the
        tree when nothing holds it, or (dead) free what it still holds."""
        flags = node.flags
        if flags & DEAD:
            self._reap(node)
            return
        if node.ref or flags & BUSY or node is self.root:
            return
        if node.gpu >= 0 and not node.gpu_kids and not flags & GPU_QUEUED:
            self._push(self._gpu_heap, node, GPU_QUEUED)
        if node.host >= 0:
            if not node.host_kids and not flags & HOST_QUEUED:
                self._push(self._host_heap, node, HOST_QUEUED)
        elif node.gpu < 0 and not flags & STORED and not node.kids:
            self._remove(node)

    def _reap(self, node: Node) -> None:
        if node.ref or node.flags & BUSY:
            return
        if node.gpu >= 0:
            self.freed_gpu.append(node.gpu)
            node.gpu = -1
        if node.host >= 0:
            self.freed_host.append(node.host)
            node.host = -1

    def _push(self, heap: list[tuple[int, int, Node]], node: Node, queued: int) -> None:
        node.flags |= queued
        heapq.heappush(heap, (node.stamp, next(self._serial), node))

    def recycle(self) -> None:
        """Returns every id freed since the last call to the free lists, one batch per tier."""
        if self.freed_gpu:
            self.gpu_free.release(self.freed_gpu)
            self.freed_gpu = []
        if self.freed_host:
            self.host_free.release(self.freed_host)
            self.freed_host = []

    # Eviction ----------------------------------------------------------------------------

    def evict_gpu(self, n: int, *, spill: bool, batch: bool = True) -> Evicted:
        """Evicts up to ``n`` GPU copies of unreferenced GPU leaves, least recently used
        first. A victim already on host just drops its GPU copy; otherwise, with ``spill``
        and a free host block, it is swapped out (``Evicted.spilled``; its GPU block stays
        reserved until the swap-out completes); otherwise it is dropped. ``batch=False``
        recycles each dropped id at once through the free list (for comparison only).

        The hot loop of the index: the common cases are inlined (no call per block)."""
        heap, out, root, nodes = self._gpu_heap, Evicted(), self.root, self.nodes
        take_host, freed, spilled = self.host_free.take_one, self.freed_gpu, out.spilled
        release, pop, push, serial = self.gpu_free.release, heapq.heappop, heapq.heappush, self._serial
        count = 0
        while count < n and heap:
            stamp, _, node = pop(heap)
            flags = node.flags = node.flags & ~GPU_QUEUED
            if node.gpu < 0 or node.ref or node.gpu_kids or flags & (BUSY | DEAD):
                continue  # no longer a candidate: queued again when it is one
            if stamp != node.stamp:
                self._push(heap, node, GPU_QUEUED)  # touched since it was queued
                continue
            block, node.gpu = node.gpu, -1
            parent: Node = node.parent  # type: ignore[assignment]
            parent.gpu_kids -= 1  # detach first: the parent may now be a leaf itself
            count += 1
            if node.host < 0 and spill and (host := take_host()) >= 0:
                node.host = host
                parent.host_kids += 1
                node.flags = flags | GPU_OUT | HOST_IN
                spilled.append((node, block, host))
            else:
                if batch:
                    freed.append(block)
                else:
                    release([block])
                if node.host < 0 and not flags & STORED and not node.kids:
                    del nodes[node.digest]  # nothing left of it: out of the tree
                    node.flags = flags | DEAD
                    parent.kids -= 1
            if parent is root or parent.gpu_kids:
                continue
            if parent.gpu >= 0:
                if not parent.ref and not parent.flags & (BUSY | GPU_QUEUED):
                    parent.flags |= GPU_QUEUED
                    push(heap, (parent.stamp, next(serial), parent))
            else:
                self.settle(parent)  # not on the GPU: maybe nothing is left of it either
        out.count = count
        return out

    def evict_host(self, n: int, *, spill: bool) -> Evicted:
        """Evicts up to ``n`` host copies of unreferenced host leaves, LRU first. With
        ``spill``, a victim not yet in storage is stored first (``Evicted.spilled``: its host
        block stays reserved until the store completes); otherwise its host copy is dropped
        (the node stays as long as it has a GPU copy, a stored object or children)."""
        heap, out, root, freed = self._host_heap, Evicted(), self.root, self.freed_host
        while out.count < n and heap:
            stamp, _, node = heapq.heappop(heap)
            flags = node.flags = node.flags & ~HOST_QUEUED
            if node.host < 0 or node.ref or node.host_kids or flags & (BUSY | DEAD):
                continue
            if stamp != node.stamp:
                self._push(heap, node, HOST_QUEUED)
                continue
            block, node.host = node.host, -1
            parent: Node = node.parent  # type: ignore[assignment]
            parent.host_kids -= 1
            out.count += 1
            out.digests.append(node.digest)
            if spill and not flags & STORED:
                node.flags = flags | HOST_OUT
                out.spilled.append((node, 0, block))
            else:
                freed.append(block)
                if node.gpu < 0 and not flags & STORED and not node.kids:
                    self._remove(node)
            if not parent.host_kids and parent.host >= 0 and parent is not root:
                self.settle(parent)
        return out

    def evictable_host(self, limit: int) -> int:
        """How many host copies an eviction could free now, counting up to ``limit`` (a lower
        bound: the queued leaves that are still evictable, not the parents behind them)."""
        found = 0
        for _, _, node in self._host_heap:
            if found >= limit:
                break
            if node.host >= 0 and not node.ref and not node.host_kids and not node.flags & (BUSY | DEAD):
                found += 1
        return found

    # Invalidation and checks -------------------------------------------------------------

    def kill_all(self) -> Dropped:
        """Drops every node (a new weights version). Idle ones free their ids now; those
        still referenced or with transfers in flight free them when those end."""
        dropped = Dropped(nodes=len(self.nodes))
        for node in self.nodes.values():
            node.flags |= DEAD
            dropped.gpu += node.gpu >= 0 or bool(node.flags & GPU_OUT)
            dropped.host += node.host >= 0 or bool(node.flags & HOST_OUT)
            dropped.stored += bool(node.flags & STORED)
            self._reap(node)
        self._reset()
        return dropped

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def check(self) -> None:
        """Structural invariants (tests and debug mode): every node reachable from the root
        through nodes in the tree, children counts exact, references not negative."""
        kids: dict[int, list[int]] = {}
        for node in self.nodes.values():
            assert not node.flags & DEAD, f"{node} is dead but in the tree"
            assert node.ref >= 0, f"{node} has a negative reference count"
            parent = node.parent
            assert parent is not None and (parent is self.root or self.nodes.get(parent.digest) is parent), node
            counts = kids.setdefault(id(parent), [0, 0, 0])
            counts[0] += 1
            counts[1] += node.gpu >= 0
            counts[2] += node.host >= 0
        for node in [self.root, *self.nodes.values()]:
            want = kids.get(id(node), [0, 0, 0])
            assert [node.kids, node.gpu_kids, node.host_kids] == want, f"{node}: child counts {want} expected"
