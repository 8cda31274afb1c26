"""OffloadIndex calls for the pieces of work an engine hands its offloading manager.

Lookups come one key at a time; a store holds the blocks of one request that filled up in a
step, so a request's blocks arrive over many calls; a load may span blocks stored by
different calls. The index finds blocks by hash alone, so a load is one call. Each store is
linked to the block the same request stored last in the same KV-cache group (``Chains``),
so a request's blocks form one chain in the index and host eviction takes a chain's tail
before its head: an engine's prefix lookup stops at the first miss, so a tail kept without
its head is dead weight. When a whole store does not fit, or a block of a load is gone, the
blocks are placed one at a time, as far as they go.
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
    # The block before digests[0] in its chain, when a store extends one (None: a chain
    # start, or blocks of several chains): storage keeps such a chain's head longest.
    parent: bytes | None = None

    def add(self, other: Placed) -> None:
        self.digests += other.digests
        self.host_ids += other.host_ids
        self.write_through = other.write_through


@dataclass
class Chains:
    """The last block one request stored, per KV-cache group (the integration keeps one per
    request)."""

    tails: dict[int, bytes] = field(default_factory=dict)


def prepare_stores(
    index: OffloadIndex, digests: list[bytes], groups: list[int] | None = None, chains: Chains | None = None
) -> Placed | None:
    """Host blocks for the digests that need one, each run of one group linked to that
    group's chain; None when there was no room for any. ``groups[i]`` is the KV-cache group
    of ``digests[i]`` (all 0 when not given)."""
    placed, runs_placed = Placed(), 0
    for group, run in _runs(digests, groups or [0] * len(digests)):
        parent = chains.tails.get(group) if chains is not None else None
        got, whole = _store_run(index, run, parent)
        if got is not None:
            placed.add(got)
            placed.parent = parent if runs_placed == 0 else None
            runs_placed += 1
        if not whole:
            break  # no room for the rest: it waits for a later step
        if chains is not None:
            chains.tails[group] = run[-1]
    return placed if runs_placed else None


def prepare_loads(index: OffloadIndex, digests: list[bytes]) -> Placed:
    """Protects every block until complete_load and says where it is."""
    try:
        plan = index.prepare_load(digests)
    except (KeyError, NoRoomError):
        return _load_one_by_one(index, digests)
    storage = set(plan.from_storage)
    return Placed(list(digests), list(plan.host_ids), [i in storage for i in range(len(digests))])


def _runs(digests: list[bytes], groups: list[int]) -> list[tuple[int, list[bytes]]]:
    """Consecutive digests of one group, in order."""
    runs: list[tuple[int, list[bytes]]] = []
    for digest, group in zip(digests, groups):
        if runs and runs[-1][0] == group:
            runs[-1][1].append(digest)
        else:
            runs.append((group, [digest]))
    return runs


def _store_run(index: OffloadIndex, run: list[bytes], parent: bytes | None) -> tuple[Placed | None, bool]:
    """(what was placed or None, whether all of ``run`` was)."""
    try:
        plan = index.prepare_store(run, parent=parent)
    except NoRoomError:
        plan = None
    if plan is not None:
        return Placed(plan.hashes, plan.host_ids, write_through=plan.write_through), True
    placed = Placed()  # no room for all of them: as many leading blocks as fit
    for digest in run:
        try:
            plan = index.prepare_store([digest], parent=parent)
        except NoRoomError:
            plan = None
        if plan is None:
            return (placed if placed.digests else None), False
        placed.add(Placed(plan.hashes, plan.host_ids, write_through=plan.write_through))
        parent = digest
    return placed, True


def _load_one_by_one(index: OffloadIndex, digests: list[bytes]) -> Placed:
    """The leading blocks the index can still protect; the rest get host id -1 (the worker
    fails them and the engine recomputes)."""
    placed = Placed(digests=list(digests))
    for i, digest in enumerate(digests):
        try:
            plan = index.prepare_load([digest])
        except (KeyError, NoRoomError):
            rest = len(digests) - i
            placed.host_ids += [-1] * rest
            placed.from_storage += [False] * rest
            break
        placed.host_ids += plan.host_ids
        placed.from_storage.append(bool(plan.from_storage))
    return placed
