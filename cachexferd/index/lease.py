"""What a match found, and a request's hold on cached blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .transfers import Transfer
    from .tree import Node


@dataclass
class Match:
    """The leading blocks of a prompt found in the index, by the tier each would come from.

    ``gpu`` blocks are usable in place, ``host`` blocks come back by swap-in (``swap_in``
    lists their host block ids), ``storage`` blocks by a load (``load`` lists their digests),
    in prompt order; ``blocks`` = their sum is the cached prefix length in blocks. Pass the
    match to ``PrefixIndex.acquire`` to act on it.
    """

    nodes: list[Node] = field(repr=False)
    gpu: int = 0
    host: int = 0
    storage: int = 0
    swap_in: list[int] = field(default_factory=list, repr=False)
    load: list[bytes] = field(default_factory=list, repr=False)
    hashes: list[bytes] = field(default_factory=list, repr=False)  # all full-block digests asked about

    @property
    def blocks(self) -> int:
        return len(self.nodes)


class Lease:
    """A request's hold on its blocks: references on the cached ones it uses, and the GPU
    block ids of its block table.

    ``block_ids[i]`` is the GPU block of block ``i``: the first ``hit`` come from the cache
    (usable once ``ready``), the rest from ``PrefixIndex.allocate``. A fetch that fails
    shortens ``hit`` (and ``block_ids``) to the blocks that did arrive; ``truncated`` tells
    the engine to recompute from there. When GPU blocks for the fetches are not free yet
    (evicted blocks are still being swapped out) the lease waits for them across polls.
    """

    __slots__ = ("block_ids", "generation", "hit", "nodes", "placed", "private", "released", "truncated", "waiting")

    def __init__(self, generation: int = 0) -> None:
        self.generation = generation  # the index's weights generation when it was acquired
        self.nodes: list[Node] = []  # cached blocks referenced by this lease, in order
        self.block_ids: list[int] = []
        self.private: set[int] = set()  # ids in block_ids that this lease owns (freed on release)
        self.waiting: set[Transfer] = set()  # fetches the cached blocks still wait for
        self.hit = 0
        self.placed = 0  # leading cached blocks that have their GPU block (the rest wait for room)
        self.released = False
        self.truncated = False

    @property
    def ready(self) -> bool:
        """True once every cached block it uses is on the GPU."""
        return not self.waiting and self.placed >= self.hit

    def __repr__(self) -> str:
        state = "released" if self.released else ("ready" if self.ready else f"waiting on {len(self.waiting)}")
        return f"Lease(hit={self.hit}, blocks={len(self.block_ids)}, {state})"
