"""The file backend's eviction index on its own: leaves before their parents, least recently
used first, pins and reservations, links that would make a cycle, scans merged in."""

from __future__ import annotations

from cachexferd.storage.base import stamps
from cachexferd.storage.eviction import EvictionIndex

SIZE = 100


def chain(index: EvictionIndex, names: list[str], parent: str | None = None, now: int = 10**18) -> None:
    """``names`` used as one command would: head first, linked, stamped head newest."""
    links = [parent, *names[:-1]]
    for name, link, stamp in zip(names, links, stamps(len(names), now)):
        index.used(name, SIZE, stamp, link)


def scanned(index: EvictionIndex) -> EvictionIndex:
    index.merge([], 0)
    return index


def test_a_chain_is_evicted_from_its_tail() -> None:
    index = scanned(EvictionIndex(0))
    chain(index, ["a0", "a1", "a2", "a3"])
    assert index.victims(need=2 * SIZE) == ["a3", "a2"]
    assert index.victims(need=SIZE) == ["a1"]
    assert len(index) == 1 and index.total == SIZE


def test_older_chains_go_first_but_never_a_parent_before_its_child() -> None:
    index = scanned(EvictionIndex(0))
    chain(index, ["a0", "a1"], now=1_000_000_000)
    chain(index, ["b0", "b1"], now=2_000_000_000)
    index.used("a0", SIZE, 3_000_000_000)  # the head of a is read again: a1 still goes before it
    assert index.victims(need=3 * SIZE) == ["a1", "b1", "b0"]


def test_an_extension_naming_its_parent_protects_the_chain_it_extends() -> None:
    index = scanned(EvictionIndex(0))
    chain(index, ["a0", "a1"], now=1_000_000_000)
    chain(index, ["a2", "a3"], parent="a1", now=2_000_000_000)
    chain(index, ["b0"], now=3_000_000_000)
    assert index.victims(need=2 * SIZE) == ["a3", "a2"]
    without = scanned(EvictionIndex(0))
    chain(without, ["a0", "a1"], now=1_000_000_000)
    chain(without, ["a2", "a3"], now=2_000_000_000)
    assert without.victims(need=2 * SIZE) == ["a1", "a0"]  # unlinked: the older part goes first


def test_a_capacity_past_its_limit_is_trimmed_to_the_low_water_mark() -> None:
    index = scanned(EvictionIndex(10 * SIZE))
    chain(index, [f"k{i}" for i in range(12)])
    assert index.victims() == [f"k{i}" for i in range(11, 8, -1)]  # 12 -> 9 objects (90%)


def test_reserve_pins_makes_room_from_others_and_counts_what_fits() -> None:
    index = scanned(EvictionIndex(10 * SIZE))
    chain(index, [f"old{i}" for i in range(8)])
    room, evicted = index.reserve([f"new{i}" for i in range(6)], SIZE)
    # 8 + 6 objects for 10: the old chain is cut down to leave 90% (9) after the 6 new ones.
    assert room == 6 and evicted == [f"old{i}" for i in range(7, 2, -1)]
    # A second store while the first runs cannot evict the first's objects, written or not.
    chain(index, ["new0", "new1"])
    room2, evicted2 = index.reserve([f"other{i}" for i in range(5)], SIZE)
    assert set(evicted2) == {"old0", "old1", "old2"} and room2 == 4  # 10 - 2 written - 4 reserved
    index.release([f"new{i}" for i in range(6)])
    index.release([f"other{i}" for i in range(5)])
    # Released: the four new objects never written no longer count; the written ones may go now.
    room3, evicted3 = index.reserve([f"z{i}" for i in range(10)], SIZE)
    assert room3 == 10 and set(evicted3) == {"new0", "new1"}


def test_reserve_respects_the_free_space_of_the_file_system() -> None:
    index = scanned(EvictionIndex(0))  # no capacity: only the disk limits
    chain(index, ["old0", "old1"])
    room, evicted = index.reserve(["n0", "n1", "n2"], SIZE, disk_free=4096 * 2, block=4096)
    assert room == 3 and evicted == ["old1"]  # each object takes a 4 KiB block; one more was needed
    index.release(["n0", "n1", "n2"])


def test_links_that_would_close_a_cycle_are_ignored() -> None:
    index = scanned(EvictionIndex(0))
    chain(index, ["a", "b"])
    chain(index, ["b", "a"])  # odd keys: a LOAD naming the chain backwards
    assert sorted(index.victims(need=2 * SIZE)) == ["a", "b"]  # still evictable: no cycle


def test_a_scan_keeps_links_and_forgets_vanished_objects() -> None:
    index = EvictionIndex(0)
    chain(index, ["a0", "a1", "a2"], now=5_000)
    index.merge([("a0", SIZE, 1_000), ("a1", SIZE, 1_000), ("x", SIZE, 500)], started=10_000)
    assert index.scanned and len(index) == 3  # a2 was gone at the scan
    assert index.victims(need=2 * SIZE) == ["x", "a1"]


def test_a_store_never_evicts_the_end_of_the_chain_it_extends() -> None:
    """Room for an extension is not made by evicting its parent (which would cut the new
    objects off from the head): with nothing else to evict, the extension does not fit."""
    index = scanned(EvictionIndex(10 * SIZE))
    chain(index, [f"a{i}" for i in range(10)])
    room, evicted = index.reserve(["a10", "a11"], SIZE, parent="a9")
    assert (room, evicted) == (0, [])
    index.release(["a10", "a11"], parent="a9")
    room, evicted = index.reserve(["b0", "b1"], SIZE)  # a chain of its own may shorten `a`
    assert room == 2 and evicted == ["a9", "a8", "a7"]  # down to 90% with the two new ones


def test_objects_cut_off_from_their_head_go_first() -> None:
    index = scanned(EvictionIndex(0))
    chain(index, ["a0", "a1", "a2", "a3"], now=1_000_000_000)
    chain(index, ["b0", "b1"], now=2_000_000_000)
    index.discard("a1")  # removed by hand: a2 and a3 no longer load from a0
    assert not index.whole("a2") and not index.whole("a3") and index.whole("a0")
    assert index.victims(need=3 * SIZE) == ["a3", "a2", "a0"]  # then the oldest leaf left


def test_a_cut_off_extension_evicts_only_cut_off_objects() -> None:
    """An extension whose parent is not stored cannot load from the head: it never shortens a
    chain that can, but takes the room of other cut-off objects."""
    index = scanned(EvictionIndex(6 * SIZE))
    chain(index, ["a0", "a1", "a2", "a3"])
    chain(index, ["x1", "x2"], parent="x0")  # x0 never stored: cut off
    room, evicted = index.reserve(["y1", "y2", "y3"], SIZE, parent="y0")
    assert evicted == ["x2", "x1"] and room == 2, (room, evicted)
    index.release(["y1", "y2", "y3"], parent="y0")
    assert len(index) == 4 and index.whole("a3")


def test_a_parent_stored_again_makes_what_follows_it_whole_again() -> None:
    index = scanned(EvictionIndex(0))
    chain(index, ["a0", "a1", "a2", "a3"])
    index.discard("a1")
    assert not index.whole("a3")
    index.used("a1", SIZE, parent="a0")  # stored again by a STORE naming its parent
    assert index.whole("a3") and index.whole("a2")
    assert index.victims(need=SIZE) == ["a3"]


def test_an_extension_of_a_running_store_counts_as_whole() -> None:
    """Stores of one chain pipelined: the second's parent is reserved by the first, not yet written."""
    index = scanned(EvictionIndex(10 * SIZE))
    chain(index, ["a0", "a1"])
    assert index.reserve(["a2", "a3"], SIZE, parent="a1")[0] == 2
    chain(index, ["old0", "old1"], now=1)
    room, evicted = index.reserve(["a4", "a5", "a6", "a7", "a8", "a9"], SIZE, parent="a3")
    assert room == 6 and evicted == ["old1", "old0"]  # a whole extension may evict other chains


# Objects other daemons stored, learned from the journal in batches (``arrived``) ------------


def test_arrived_objects_are_evicted_by_age_among_this_daemons_own() -> None:
    index = scanned(EvictionIndex(0))
    index.arrived(["x0", "x1"], [SIZE, SIZE], 1_000)
    chain(index, ["a0", "a1"], now=2_000_000)
    index.arrived(["y0", "x0"], [SIZE, SIZE], 3_000_000_000)  # x0 again: counted once, keeps its age
    assert len(index) == 5 and index.total == 5 * SIZE and "x1" in index and "y0" in index
    assert sorted(index.victims(need=2 * SIZE)) == ["x0", "x1"]
    assert index.victims(need=3 * SIZE) == ["a1", "a0", "y0"]
    assert len(index) == 0 and index.total == 0


def test_cut_off_objects_go_before_arrived_ones() -> None:
    index = scanned(EvictionIndex(0))
    index.arrived(["x0"], [SIZE], 1_000)
    chain(index, ["a1", "a2"], parent="a0", now=2_000_000_000)  # a0 never stored: cut off
    assert index.victims(need=SIZE, cut_only=True) == ["a2"]
    assert index.victims(need=2 * SIZE) == ["a1", "x0"]


def test_an_arrived_object_used_here_takes_the_age_of_its_use() -> None:
    index = scanned(EvictionIndex(0))
    index.arrived(["x0", "x1"], [SIZE, SIZE], 1_000)
    chain(index, ["a0"], now=2_000_000)
    index.used("x0", SIZE, 3_000_000_000)  # read by this daemon: no longer among the oldest
    assert index.victims(need=2 * SIZE) == ["x1", "a0"]
    assert index.victims(need=SIZE) == ["x0"] and index.total == 0


def test_an_arrived_object_extended_here_is_not_evicted_before_its_extension() -> None:
    index = scanned(EvictionIndex(0))
    index.arrived(["x0"], [SIZE], 1_000)
    chain(index, ["x1"], parent="x0", now=2_000_000)
    assert index.whole("x1")
    assert index.victims(need=2 * SIZE) == ["x1", "x0"]


def test_a_missing_parent_that_arrives_makes_its_extension_whole() -> None:
    index = scanned(EvictionIndex(0))
    chain(index, ["x1", "x2"], parent="x0")
    assert not index.whole("x2")
    index.arrived(["x0"], [SIZE], 1_000)  # another daemon stored the parent
    assert index.whole("x2") and index.whole("x1")
    assert index.victims(need=SIZE, cut_only=True) == []
    assert index.victims(need=3 * SIZE) == ["x2", "x1", "x0"]


def test_a_store_pins_the_arrived_object_it_extends_until_it_ends() -> None:
    index = scanned(EvictionIndex(2 * SIZE))
    index.arrived(["x0", "y0"], [SIZE, SIZE], 1_000)
    room, evicted = index.reserve(["x1"], SIZE, parent="x0")
    assert room == 1 and evicted == ["y0"]  # x0 is the parent: never the room for x1
    index.release(["x1"], parent="x0")
    assert index.victims(need=SIZE) == ["x0"]  # a candidate again once the store ended


def test_arrived_objects_removed_forgotten_and_rescanned() -> None:
    index = scanned(EvictionIndex(0))
    index.arrived(["x0", "x1", "x2"], [SIZE, 2 * SIZE, 3 * SIZE], 1_000)
    index.discard("x1")  # the journal says another daemon removed it
    assert "x1" not in index and index.total == 4 * SIZE
    index.merge([("x0", SIZE, 1_000)], started=10_000)  # x2 was gone at the scan
    assert len(index) == 1 and index.total == SIZE and index.victims(need=SIZE) == ["x0"]


def test_the_arrival_queue_does_not_grow_with_objects_gone_from_it() -> None:
    """Objects promoted or removed leave stale places in the queue: compacted, never kept."""
    index = scanned(EvictionIndex(0))
    for batch in range(50):
        keys = [f"b{batch}-{i}" for i in range(256)]
        index.arrived(keys, [SIZE] * len(keys), 1_000 + batch)
        for key in keys[:-1]:
            index.discard(key)
    assert len(index) == 50 and index._queued <= 2 * 50 + 4096
    assert index.victims(need=2 * SIZE) == ["b0-255", "b1-255"]
