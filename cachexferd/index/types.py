"""Plain result types of the prefix index (no torch, no daemon, no client)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ..storage.keys import BlockHash, KeySpace

HashLike = BlockHash | bytes  # a block's chained hash: a BlockHash, or its raw digest bytes


class Tier(IntEnum):
    GPU = 0
    HOST = 1
    STORAGE = 2


class NoRoomError(RuntimeError):
    """No block of the tier can be freed now: every one is in use or has a transfer in flight."""


class DoubleFreeError(AssertionError):
    """A block id was freed twice, or freed without being allocated (a bug in the caller)."""


def full_block(digest: bytes, space: KeySpace) -> BlockHash:
    """The BlockHash of a cached (always full) block, from its digest: for storage keys."""
    return BlockHash(digest, space.block_size, False)


@dataclass(frozen=True)
class LoadPlan:
    """Where each block of an ``OffloadIndex.prepare_load`` call is, in the order given.

    ``host_ids[i]`` is the host block holding block ``i`` once the load is done. For the
    positions in ``from_storage`` that host block was allocated by this call and is empty: the
    block must first be read from storage into it (``EngineClient.load(plan.storage_keys(),
    host_ids=plan.storage_host_ids(), device_ids=...)`` does both steps in one command).
    """

    hashes: list[bytes]
    host_ids: list[int]
    from_storage: list[int]  # positions in ``hashes`` (ascending) that are read from storage
    space: KeySpace | None = field(default=None, repr=False, compare=False)

    def storage_host_ids(self) -> list[int]:
        return [self.host_ids[i] for i in self.from_storage]

    def storage_keys(self) -> Callable[[int], dict[str, Any]]:
        """Per-rank keys of the storage positions, in the form ``EngineClient.load`` accepts."""
        if self.space is None:
            raise ValueError("this index has no KeySpace, so no storage tier")
        blocks = [full_block(self.hashes[i], self.space) for i in self.from_storage]
        return self.space.keys_by_rank(blocks)


@dataclass(frozen=True)
class StorePlan:
    """What an ``OffloadIndex.prepare_store`` call decided.

    ``hashes`` are the blocks that still need writing (the others are already offloaded or
    in flight), ``host_ids`` the host blocks allocated for them (one each), ``evicted`` the
    hashes dropped from the host tier to make room (in eviction order). When
    ``write_through`` is true the blocks also go to storage: write them with one
    ``EngineClient.store(plan.storage_keys(), host_ids=plan.host_ids, device_ids=...)``
    (GPU -> host -> storage), never a swap-out followed by a separate store, which would
    store whatever the host blocks held if the copy failed.
    """

    hashes: list[bytes]
    host_ids: list[int]
    evicted: list[bytes]
    write_through: bool = False
    space: KeySpace | None = field(default=None, repr=False, compare=False)

    def storage_keys(self) -> Callable[[int], dict[str, Any]]:
        if self.space is None:
            raise ValueError("this index has no KeySpace, so no storage tier")
        return self.space.keys_by_rank([full_block(d, self.space) for d in self.hashes])


@dataclass(frozen=True)
class Invalidation:
    """What a weights-version change dropped from the index."""

    old_version: str
    new_version: str
    nodes: int  # cached blocks forgotten
    gpu_blocks: int  # GPU copies dropped (freed now, or when their request or transfer ends)
    host_blocks: int
    storage_blocks: int  # storage objects no longer reachable (their keys name the old version)


@dataclass(frozen=True)
class OffloadEvent:
    """A block became available in a tier (``removed`` false) or left it (true)."""

    hashes: list[bytes]
    tier: Tier
    removed: bool
