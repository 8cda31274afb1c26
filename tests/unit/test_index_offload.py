"""OffloadIndex: the host + storage API for engines that own their GPU tier (what a vLLM
offloading manager calls), by block hash only."""

from __future__ import annotations

import contextlib
import random

import pytest

from cachexferd.index import NoRoomError, OffloadIndex, Tier
from cachexferd.storage.keys import KeySpace

SPACE = KeySpace("m", "float16", "layout", 4, tp_size=2)


def blocks(name: int, n: int) -> list[bytes]:
    return [h.digest for h in SPACE.block_hashes([name * 100 + i for i in range(4 * n)])]


def offload(index: OffloadIndex, hashes: list[bytes], success: bool = True) -> list[int]:
    plan = index.prepare_store(hashes)
    assert plan is not None
    index.complete_store(plan.hashes, success=success)
    index.check()
    return plan.host_ids


def test_store_then_lookup_and_load_from_host() -> None:
    index = OffloadIndex(8, SPACE, debug=True)
    a = blocks(1, 3)
    assert index.lookup(a) == 0
    plan = index.prepare_store(a)
    assert plan is not None and plan.hashes == a and len(set(plan.host_ids)) == 3 and plan.evicted == []
    assert index.lookup(a) == 0  # not readable before the write completed
    index.complete_store(a)
    assert index.lookup(a) == 3 and index.lookup(a[1:]) == 2  # lookups may start mid-chain
    load = index.prepare_load(a)
    assert load.host_ids == plan.host_ids and load.from_storage == []
    index.complete_load(a)
    index.check()


def test_reads_find_a_chain_stored_by_several_calls() -> None:
    index = OffloadIndex(8, SPACE, debug=True)
    a = blocks(1, 4)
    offload(index, a[2:])  # the tail first, as its own chain
    offload(index, a[:2])
    assert index.lookup(a) == 4  # the seam between the two calls is no gap
    load = index.prepare_load(a)
    assert len(set(load.host_ids)) == 4 and load.from_storage == []
    index.complete_load(a)
    assert index.lookup([a[0], blocks(2, 1)[0], a[2]]) == 1  # a missing block still ends the run
    index.check()


def test_a_call_linked_to_its_parent_is_evicted_tail_first() -> None:
    index = OffloadIndex(4, events=True, debug=True)
    a, b = blocks(1, 4), blocks(2, 1)
    offload(index, a[:2])
    plan = index.prepare_store(a[2:], parent=a[1])
    assert plan is not None
    index.complete_store(plan.hashes)
    assert [index.tree.nodes[d].parent for d in a[1:]] == [index.tree.nodes[d] for d in a[:3]]
    index.touch(a[2:])  # the tail is newer than the head: plain LRU would take the head first
    plan = index.prepare_store(b)
    assert plan is not None and plan.evicted == [a[3]]  # the leaf, so a[:3] stays a usable prefix
    index.complete_store(plan.hashes)
    assert index.lookup(a) == 3
    index.check()


def test_a_parent_that_is_gone_starts_a_new_chain() -> None:
    index = OffloadIndex(4, debug=True)
    a = blocks(1, 3)
    plan = index.prepare_store(a[1:], parent=a[0])  # a[0] was never offloaded
    assert plan is not None and plan.hashes == a[1:]
    index.complete_store(plan.hashes)
    assert index.tree.nodes[a[1]].parent is index.tree.root
    assert index.lookup(a) == 0 and index.lookup(a[1:]) == 2
    index.check()


def test_store_skips_blocks_already_offloaded_or_in_flight() -> None:
    index = OffloadIndex(8, debug=True)
    a = blocks(1, 4)
    offload(index, a[:2])
    first = index.prepare_store(a[:3])
    assert first is not None and first.hashes == [a[2]]
    second = index.prepare_store(a)
    assert second is not None and second.hashes == [a[3]]  # a[2] is in flight
    index.complete_store(a)  # the whole list: hashes not being stored are ignored
    assert index.lookup(a) == 4
    index.check()


def test_storing_says_which_blocks_a_completed_write_will_make_readable() -> None:
    index = OffloadIndex(8, SPACE, debug=True)
    a, b, c = blocks(1, 2), blocks(2, 1), blocks(3, 1)
    offload(index, a[:1])
    for chain in (a, b, c):
        assert index.prepare_store(chain) is not None
    assert [index.storing(d) for d in a + b + c] == [False, True, True, True]  # a[0] is readable already
    assert index.lookup(a) == 1
    index.complete_store(a)
    index.complete_store(b, success=False)
    assert [index.storing(d) for d in a + b] == [False, False, False]
    assert index.lookup(a) == 2 and index.lookup(b) == 0
    index.new_weights("step-2")  # c is dropped while its write is in flight: it will never be readable
    assert not index.storing(c[0])
    index.complete_store(c)
    assert index.lookup(c) == 0 and not index.storing(c[0])
    index.check()


def test_eviction_takes_lru_unprotected_blocks_and_reports_them() -> None:
    index = OffloadIndex(4, events=True, debug=True)
    a, b, c = blocks(1, 2), blocks(2, 2), blocks(3, 2)
    offload(index, a)
    offload(index, b)
    index.touch(a)  # b is now the least recently used
    plan = index.prepare_store(c)
    assert plan is not None and plan.evicted == [b[1], b[0]]  # leaf first, then its parent
    index.complete_store(c)
    assert index.lookup(a) == 2 and index.lookup(b) == 0
    removed = [e for e in index.take_events() if e.removed]
    assert removed[0].tier is Tier.HOST and removed[0].hashes == [b[1], b[0]]
    assert index.take_events() == []


def test_protected_and_in_flight_blocks_are_never_evicted() -> None:
    index = OffloadIndex(4, debug=True)
    a, b, c = blocks(1, 2), blocks(2, 2), blocks(3, 1)
    offload(index, a)
    loading = index.prepare_load(a)  # protected until complete_load
    in_flight = index.prepare_store(b)  # protected until complete_store
    assert loading and in_flight
    assert index.prepare_store(c) is None  # no room: nothing allocated
    index.check()
    index.complete_load(a)
    plan = index.prepare_store(c)
    assert plan is not None and set(plan.evicted) <= set(a)
    index.complete_store(b)
    index.complete_store(c)
    index.check()


def test_a_failed_store_frees_its_blocks() -> None:
    index = OffloadIndex(4, debug=True)
    a = blocks(1, 4)
    offload(index, a, success=False)
    assert index.lookup(a) == 0 and index.host_free == 4 and len(index) == 0


def test_write_through_blocks_stay_loadable_from_storage_after_host_eviction() -> None:
    index = OffloadIndex(4, SPACE, storage=True, events=True, debug=True)
    a, b = blocks(1, 3), blocks(2, 3)
    plan = index.prepare_store(a)
    assert plan is not None and plan.write_through
    keys = plan.storage_keys()
    assert keys(0)["keys"] == SPACE.keys([h for h in SPACE.block_hashes([100 + i for i in range(12)])], 0)
    assert keys(1)["keys"][0].split(":")[2] == "r1of2"
    index.complete_store(plan.hashes)
    offload(index, b)  # evicts a from host: still in storage
    assert index.lookup(b) == 3 and index.lookup(a) == 3
    on_host = set(index_host_hashes(index))
    load = index.prepare_load(a)
    assert load.from_storage == [i for i, h in enumerate(a) if h not in on_host]
    assert load.from_storage and load.storage_host_ids() == [load.host_ids[i] for i in load.from_storage]
    assert len(load.storage_keys()(0)["keys"]) == len(load.from_storage)
    assert index.lookup(a) == load.from_storage[0]  # blocks being read are not readable yet
    index.complete_load(a, failed=[a[load.from_storage[-1]]])
    index.check()
    assert index.lookup(a) == load.from_storage[-1]  # the failed block is gone from storage too
    kinds = {(e.tier, e.removed) for e in index.take_events()}
    assert (Tier.STORAGE, True) in kinds and (Tier.STORAGE, False) in kinds


def index_host_hashes(index: OffloadIndex) -> list[bytes]:
    return [n.digest for n in index.tree if n.host >= 0]


def test_prepare_load_refuses_blocks_it_does_not_have() -> None:
    index = OffloadIndex(4, debug=True)
    with pytest.raises(KeyError, match="not offloaded"):
        index.prepare_load(blocks(1, 1))
    with pytest.raises(ValueError, match="partial"):
        index.prepare_store(SPACE.block_hashes([1, 2, 3]))
    assert index.lookup(SPACE.block_hashes([1, 2, 3])) == 0


def test_storage_loads_need_host_room() -> None:
    index = OffloadIndex(2, SPACE, storage=True, debug=True)
    a, b = blocks(1, 2), blocks(2, 2)
    offload(index, a)
    offload(index, b)  # a only in storage now
    index.prepare_load(b)  # b protected: nothing can be evicted for a
    assert index.lookup(a) == 0
    with pytest.raises(NoRoomError):
        index.prepare_load(a)
    index.complete_load(b)
    index.check()


def test_new_weights_forget_every_block() -> None:
    index = OffloadIndex(4, SPACE, storage=True, debug=True)
    a = blocks(1, 2)
    offload(index, a)
    pending = index.prepare_store(blocks(2, 1))
    dropped = index.new_weights("step-7")
    assert (dropped.nodes, dropped.host_blocks, dropped.storage_blocks) == (3, 3, 2)
    assert index.lookup(a) == 0 and index.space is not None and index.space.weights_version == "step-7"
    assert pending is not None
    index.complete_store(pending.hashes)  # completes after the update: freed, not visible
    assert index.host_free == 4 and index.lookup(blocks(2, 1)) == 0
    index.check()


def test_random_calls_keep_every_host_block_in_one_place() -> None:
    rng = random.Random(7)
    index = OffloadIndex(6, SPACE, storage=True, debug=True)
    chains = [blocks(c, 3) for c in range(6)]
    loads: list[list[bytes]] = []
    stores: list[list[bytes]] = []
    for _ in range(400):
        chain = rng.choice(chains)
        action = rng.random()
        if action < 0.35:
            start = rng.randint(0, 2)  # a call may start mid-chain, linked to the block before
            plan = index.prepare_store(
                chain[start : rng.randint(start + 1, 3)], parent=chain[start - 1] if start else None
            )
            if plan is not None:
                stores.append(plan.hashes)
        elif action < 0.6 and stores:
            index.complete_store(stores.pop(rng.randrange(len(stores))), success=rng.random() < 0.8)
        elif action < 0.8:
            n = index.lookup(chain)
            if n:
                with contextlib.suppress(NoRoomError):
                    loads.append(index.prepare_load(chain[:n]).hashes)
        elif loads:
            done = loads.pop(rng.randrange(len(loads)))
            index.complete_load(done, failed=done[-1:] if rng.random() < 0.2 else [])
        else:
            index.touch(chain)
        index.check()


def test_a_failed_host_load_is_forgotten_in_every_tier() -> None:
    """A block whose host copy could not be read is dropped, so lookups stop offering it
    (an engine would otherwise load it, fail and recompute at every step)."""
    index = OffloadIndex(4, SPACE, storage=True, debug=True)
    a = blocks(1, 3)
    offload(index, a)
    assert index.lookup(a) == 3
    load = index.prepare_load(a)
    assert load.from_storage == []  # all three are host copies
    index.complete_load(a, failed=[a[1]])
    index.check()
    assert index.lookup(a) == 1, "the failed block (and so what follows it) must miss"
    assert index.host_free == 2  # 4 blocks, 3 stored, the failed one's freed
    again = index.prepare_load(a[:1])  # the others are untouched
    index.complete_load(a[:1])
    assert again.host_ids == load.host_ids[:1]
    index.check()


def test_a_failed_load_held_by_another_load_is_dropped_when_the_last_one_fails() -> None:
    index = OffloadIndex(4, SPACE, storage=False, debug=True)
    a = blocks(2, 2)
    offload(index, a)
    index.prepare_load(a)
    index.prepare_load(a)
    index.complete_load(a, failed=a)  # the other load still reads these host blocks
    assert index.host_free == 2
    index.complete_load(a, failed=a)
    assert index.lookup(a) == 0 and index.host_free == 4
    index.check()


def test_adopted_host_blocks_are_readable_where_they_are() -> None:
    index = OffloadIndex(8, debug=True)
    d = [bytes([i]) * 16 for i in range(4)]
    # Two digests at one id: the first wins; a digest at a taken id is skipped.
    assert index.adopt(d[:3], [5, 6, 5]) == d[:2]
    index.check()
    assert index.lookup([d[0]]) == 1 and index.lookup([d[1], d[2]]) == 1
    assert index.prepare_load([d[1]]).host_ids == [6]
    index.complete_load([d[1]])
    plan = index.prepare_store([d[3]])
    assert plan is not None and plan.host_ids[0] not in (5, 6)
    index.complete_store([d[3]])
    assert index.adopt([b"\x09" * 16, b"\x0a" * 16], [plan.host_ids[0], 99]) == []  # in use; out of range
    assert index.adopt([d[3]], [7]) == []  # already known
    index.check()
