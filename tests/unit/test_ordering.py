"""Same-block commands keep submission order; independent ones do not wait."""

from __future__ import annotations

import asyncio

from cachexferd.daemon.ordering import Access, BlockOrdering, swap_access


def test_conflict_rules() -> None:
    out7 = swap_access([1], [7], to_host=True)  # reads device 1, writes host 7
    in7 = swap_access([2], [7], to_host=False)  # reads host 7, writes device 2
    in8 = swap_access([2], [8], to_host=False)
    out_dev2 = swap_access([2], [9], to_host=True)
    assert in7.conflicts_with(out7)  # read-after-write on host 7
    assert out7.conflicts_with(in7)  # write-after-read
    assert not in8.conflicts_with(out7)  # disjoint host blocks
    assert out_dev2.conflicts_with(in8)  # reads device 2 that in8 writes
    assert in8.conflicts_with(in7)  # write-after-write on device 2
    reads_only = swap_access([1], [3], to_host=True)
    assert not swap_access([1], [4], to_host=True).conflicts_with(reads_only)  # two reads of device 1
    clear = Access(all_host_write=True)
    assert clear.conflicts_with(out7) and out7.conflicts_with(clear) and not clear.conflicts_with(Access())


def test_register_waits_only_for_conflicts() -> None:
    async def scenario() -> None:
        order = BlockOrdering()
        a, wa = order.register(swap_access([1], [7], to_host=True))
        b, wb = order.register(swap_access([2], [8], to_host=True))
        c, wc = order.register(swap_access([3], [7], to_host=False))
        assert wa == [] and wb == [] and wc == [a.done]
        assert order.counts() == (3, 0)
        order.release(a)
        assert a.done.done() and not b.done.done()
        order.release(b)
        order.release(c)
        assert order.active() == []

    asyncio.run(scenario())


def test_device_only_listing() -> None:
    async def scenario() -> None:
        order = BlockOrdering()
        order.register(Access(host_read=frozenset({1})))
        dev, _ = order.register(swap_access([1], [2], to_host=True))
        assert order.active(device_only=True) == [dev]

    asyncio.run(scenario())


def test_finished_and_done_are_separate() -> None:
    """An entry held past its outcome (storage call stuck) still blocks conflicting work."""

    async def scenario() -> None:
        order = BlockOrdering()
        held, _ = order.register(Access(host_write=frozenset({5}), device_read=frozenset({1})))
        order.finish(held, 33)
        assert held.finished.done() and not held.done.done()
        _, waits = order.register(Access(host_read=frozenset({5})))
        assert waits == [held.done]
        order.release(held)
        assert held.done.done()

    asyncio.run(scenario())
