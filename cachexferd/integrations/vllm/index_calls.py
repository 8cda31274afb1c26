"""OffloadIndex calls one block at a time.

vLLM hands the manager offload keys in pieces: lookups one key at a time, stores starting
wherever a request's unstored blocks start (the block before may be cached, or may never
have been offered), loads spanning blocks that were stored by different calls. The index's
tree links a block to its predecessor only when both arrive in one call, and refuses a
block it already holds under another predecessor. So the adapter gives it one block per
call: every block is a chain of its own, eviction is plain LRU over blocks (which is what
vLLM's prefix lookup, itself block by block, needs), and no call can meet a block under a
predecessor it did not expect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...index import NoRoomError, OffloadIndex


@dataclass
class Placed:
    """Where the blocks of a store or load went, in the order asked; ``host_ids[i] < 0``
    for a block the index could not place (no room, or no longer offloaded)."""

    digests: list[bytes] = field(default_factory=list)
    host_ids: list[int] = field(default_factory=list)
    from_storage: list[bool] = field(default_factory=list)
    write_through: bool = False


def prepare_stores(index: OffloadIndex, digests: list[bytes]) -> Placed | None:
    """Host blocks for the digests that need one; None when there was no room for any."""
    placed = Placed()
    for digest in digests:
        try:
            plan = index.prepare_store([digest])
        except NoRoomError:
            plan = None
        if plan is None:
            return placed if placed.digests else None  # the rest waits for a later step
        placed.write_through = plan.write_through
        placed.digests += plan.hashes
        placed.host_ids += plan.host_ids
    return placed


def prepare_loads(index: OffloadIndex, digests: list[bytes]) -> Placed:
    """Protects every block until complete_load and says where it is."""
    placed = Placed(digests=list(digests))
    for i, digest in enumerate(digests):
        try:
            plan = index.prepare_load([digest])
        except (KeyError, NoRoomError):
            rest = len(digests) - i
            placed.host_ids += [-1] * rest  # the worker fails these and vLLM recomputes
            placed.from_storage += [False] * rest
            break
        placed.host_ids += plan.host_ids
        placed.from_storage.append(bool(plan.from_storage))
    return placed
