"""Same-block commands keep submission order; independent ones do not wait; the cost of
ordering a command does not grow with the number of commands in flight."""

from __future__ import annotations

import asyncio
import random

from cachexferd.daemon.ordering import Access, BlockOrdering, Entry, swap_access


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
    order = BlockOrdering()
    a = order.register(swap_access([1], [7], to_host=True), None)
    b = order.register(swap_access([2], [8], to_host=True), None)
    c = order.register(swap_access([3], [7], to_host=False), None)
    assert a.ready and b.ready and not c.ready
    assert order.counts() == (3, 0)
    assert order.release(b) == []
    assert order.release(a) == [c]
    assert order.release(c) == []
    assert order.active() == [] and len(order) == 0


def test_readers_share_and_writer_waits_for_all_of_them() -> None:
    order = BlockOrdering()
    w1 = order.register(Access(host_write=frozenset({5})), None)
    r1 = order.register(Access(host_read=frozenset({5})), None)
    r2 = order.register(Access(host_read=frozenset({5})), None)
    w2 = order.register(Access(host_write=frozenset({5})), None)
    assert [w1.ready, r1.ready, r2.ready, w2.ready] == [True, False, False, False]
    assert order.release(w1) == [r1, r2]  # both readers at once
    assert order.release(r1) == []
    assert order.release(r2) == [w2]


def test_device_only_listing() -> None:
    order = BlockOrdering()
    order.register(Access(host_read=frozenset({1})), None)
    dev = order.register(swap_access([1], [2], to_host=True), None)
    assert order.active(device_only=True) == [dev]


def test_finished_and_released_are_separate() -> None:
    """An entry held past its outcome (storage call stuck) still blocks conflicting work."""

    async def scenario() -> None:
        order = BlockOrdering()
        held = order.register(Access(host_write=frozenset({5}), device_read=frozenset({1})), None)
        waiter = held.when_finished()
        order.start(held)
        order.finish(held, 33)
        assert waiter.done() and held.code == 33 and order.counts() == (0, 0)
        later = order.register(Access(host_read=frozenset({5})), None)
        assert not later.ready
        assert order.release(held) == [later]

    asyncio.run(scenario())


def test_clear_host_is_a_barrier_for_every_host_access() -> None:
    order = BlockOrdering()
    before = [order.register(Access(host_read=frozenset({i})), None) for i in range(3)]
    device_only = order.register(Access(device_write=frozenset({9})), None)
    clear = order.register(Access(all_host_write=True), None)
    after = order.register(Access(host_write=frozenset({77})), None)
    assert device_only.ready and not clear.ready and not after.ready
    for entry in before[:-1]:
        assert order.release(entry) == []
    assert order.release(before[-1]) == [clear]
    assert order.release(clear) == [after]


def _check_against_pairwise_rule(seed: int, steps: int = 600) -> None:
    """Random registrations and releases: an entry is ready exactly when every earlier
    entry it conflicts with (the pairwise rule of docs/protocol.md §9) has been released."""
    rng = random.Random(seed)
    order = BlockOrdering()
    live: list[Entry] = []  # unreleased, in registration order

    def random_access() -> Access:
        pick = lambda: frozenset(rng.sample(range(6), rng.randint(0, 2)))  # noqa: E731
        if rng.random() < 0.03:
            return Access(all_host_write=True)
        return Access(pick(), pick(), pick(), pick(), keys_read=frozenset(map(str, pick())))

    for _ in range(steps):
        if live and rng.random() < 0.45:
            ready = [e for e in live if e.ready]
            victim = rng.choice(ready)
            order.release(victim)
            live.remove(victim)
        else:
            live.append(order.register(random_access(), None))
        for i, entry in enumerate(live):
            blocked = any(entry.access.conflicts_with(earlier.access) for earlier in live[:i])
            assert entry.ready == (not blocked), (seed, i)


def test_scoreboard_matches_the_pairwise_rule() -> None:
    for seed in range(25):
        _check_against_pairwise_rule(seed)


def test_work_per_command_does_not_grow_with_commands_in_flight() -> None:
    """Registration and release cost O(ids in the command): counted, not timed."""

    def examined_per_command(chain: int, independent: int) -> float:
        order = BlockOrdering()
        for i in range(independent):  # in flight, untouched by the chain
            order.register(swap_access([1000 + i], [1000 + i], to_host=True), None)
        start = order.examined
        entries = [order.register(swap_access([1], [7], to_host=i % 2 == 0), None) for i in range(chain)]
        for entry in entries:
            assert entry.ready
            order.release(entry)
        return (order.examined - start) / chain

    small = examined_per_command(1_000, 0)
    assert small <= 4  # two ids, at most one dependency each
    assert abs(examined_per_command(10_000, 0) - small) < 0.01
    assert abs(examined_per_command(1_000, 20_000) - small) < 0.01


def test_a_group_counts_as_its_commands() -> None:
    """A group of swaps is one entry of ``weight`` commands: every count is in commands."""
    order = BlockOrdering()
    group = order.register(swap_access([1, 2, 3], [7, 8, 9], to_host=True), None, weight=3)
    single = order.register(swap_access([4], [10], to_host=True), None)
    behind = order.register(swap_access([5], [8], to_host=False), None)  # reads host 8, which the group writes
    assert len(order) == 5 and order.counts() == (5, 0)
    assert behind.unmet == 1 and group.ready
    order.start(group)
    assert order.counts() == (2, 3)
    assert order.complete(group, 0) == [behind]
    assert len(order) == 2 and order.counts() == (2, 0)
    order.start(single)
    order.finish(single, 0)
    assert order.counts() == (1, 0) and len(order) == 2  # finished, not yet released
    order.release(single)
    assert len(order) == 1


def test_pause_reports_every_command_of_a_group() -> None:
    """PAUSE's drained and cancelled counts are commands, whatever their grouping."""
    from cachexferd.daemon.pausing import Pausing
    from cachexferd.protocol import ErrorCode

    async def scenario() -> dict[str, object]:
        order = BlockOrdering()
        drained = order.register(swap_access([1, 2], [7, 8], to_host=True), None, weight=2)
        stuck = order.register(swap_access([3, 4, 5], [9, 10, 11], to_host=True), None, weight=3)
        for entry in (drained, stuck):
            order.start(entry)

        async def copies() -> None:
            await asyncio.sleep(0.01)
            order.complete(drained, 0)  # finishes within the drain timeout
            while not stuck.cancel.cancelled:  # the other stops at its checkpoint once cancelled
                await asyncio.sleep(0.005)
            order.complete(stuck, stuck.cancel.code)

        running = asyncio.ensure_future(copies())
        result = await asyncio.wait_for(Pausing(order).pause(0.2), timeout=10)
        await asyncio.wait_for(running, timeout=10)
        assert stuck.code == ErrorCode.PAUSED
        return result

    assert asyncio.run(scenario()) == {"paused": True, "drained": 2, "cancelled": 3}
