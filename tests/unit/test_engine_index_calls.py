"""The engine-side index calls (no engine needed): whole-call placement, per-request
chains per KV-cache group, and the block-by-block fallbacks when a whole call cannot go."""

from __future__ import annotations

from cachexferd.index import OffloadIndex
from cachexferd.integrations.engine.index_calls import Chains, prepare_loads, prepare_stores
from cachexferd.storage.keys import KeySpace

SPACE = KeySpace("m", "float16", "layout", 4)


def blocks(name: int, n: int) -> list[bytes]:
    return [h.digest for h in SPACE.block_hashes([name * 100 + i for i in range(4 * n)])]


def store(index: OffloadIndex, digests: list[bytes], groups: list[int] | None = None,
          chains: Chains | None = None) -> list[bytes]:  # fmt: skip
    placed = prepare_stores(index, digests, groups, chains)
    assert placed is not None
    index.complete_store(placed.digests)
    index.check()
    return placed.digests


def test_a_requests_stores_form_one_chain_per_group() -> None:
    index = OffloadIndex(16, debug=True)
    a, b = blocks(1, 4), blocks(2, 4)  # two groups of one request
    chains = Chains()
    store(index, [a[0], a[1], b[0], b[1]], [0, 0, 1, 1], chains)
    store(index, [a[2], a[3], b[2], b[3]], [0, 0, 1, 1], chains)  # the next step's blocks
    nodes = index.tree.nodes
    for chain in (a, b):
        assert [nodes[d].parent for d in chain[1:]] == [nodes[d] for d in chain[:-1]], "one chain per group"
        assert nodes[chain[0]].parent is index.tree.root
    assert chains.tails == {0: a[3], 1: b[3]}
    placed = prepare_loads(index, a)  # blocks of two calls, one load
    assert len(set(placed.host_ids)) == 4 and min(placed.host_ids) >= 0 and placed.from_storage == [False] * 4
    index.complete_load(a)
    index.check()


def test_a_store_that_does_not_fit_places_its_leading_blocks() -> None:
    index = OffloadIndex(3, debug=True)
    held = blocks(1, 2)
    store(index, held)
    index.prepare_load(held)  # protected: the only free host block is the third
    a = blocks(2, 3)
    chains = Chains()
    placed = prepare_stores(index, a, chains=chains)
    assert placed is not None and placed.digests == a[:1] and len(placed.host_ids) == 1
    assert chains.tails == {}, "a chain is only extended by a store that placed all of it"
    assert prepare_stores(index, blocks(3, 1)) is None  # no room for any: None, nothing placed
    index.complete_store(placed.digests)
    index.complete_load(held)
    index.check()


def test_a_load_with_a_block_gone_protects_the_leading_blocks_only() -> None:
    index = OffloadIndex(8, debug=True)
    a = blocks(1, 3)
    store(index, [a[0], a[2]])  # a[1] was never stored
    placed = prepare_loads(index, a)
    assert placed.digests == a and placed.host_ids[0] >= 0 and placed.host_ids[1:] == [-1, -1]
    index.complete_load(a[:1])
    index.check()


def test_a_store_names_the_block_its_chain_continues_from() -> None:
    index = OffloadIndex(16, debug=True)
    a, b = blocks(1, 4), blocks(2, 2)
    chains = Chains()
    first = prepare_stores(index, a[:2], chains=chains)
    assert first is not None and first.parent is None, "a request's first store starts its chain"
    index.complete_store(first.digests)
    second = prepare_stores(index, a[2:], chains=chains)
    assert second is not None and second.parent == a[1], "storage must learn what the store extends"
    index.complete_store(second.digests)
    both = prepare_stores(index, [b[0], b[1]], [0, 1], Chains({0: a[3], 1: a[3]}))
    assert both is not None and both.parent is None, "blocks of two chains in one store name no parent"
    index.complete_store(both.digests)
    index.check()
