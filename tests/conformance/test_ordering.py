"""docs/protocol.md §9 (and §12's storage rows): pipelined commands that touch the same
blocks or keys take effect in the order the daemon received them. Every test sends its
commands in one burst, before reading any outcome, and checks the bytes in the runner's
shared memory."""

from __future__ import annotations

import time

import pytest

from .conftest import Attached
from .helpers import burst
from .spec import T

pytestmark = pytest.mark.conformance


def swap_out(device: list[int], host: list[int]) -> tuple[int, dict[str, list[int]]]:
    return T.SWAP_OUT, {"device_ids": device, "host_ids": host}


def swap_in(device: list[int], host: list[int]) -> tuple[int, dict[str, list[int]]]:
    return T.SWAP_IN, {"device_ids": device, "host_ids": host}


def test_read_after_write(attached: Attached) -> None:
    """Swap out device 3 -> host 7, then swap in host 7 -> device 9: reads what was written."""
    client, cache = attached.client, attached.cache
    want = cache.block(3)
    ids = burst(client, [swap_out([3], [7]), swap_in([9], [7])])
    outcomes = client.wait_all(ids)
    assert all(o.ok for o in outcomes), outcomes
    assert cache.block(9) == want
    assert outcomes[1].result["started_at"] >= outcomes[0].result["finished_at"]


def test_read_after_write_many_rounds(attached: Attached) -> None:
    """The same host blocks reused round after round within one burst."""
    client, cache = attached.client, attached.cache
    sources = [[2 * r, 2 * r + 1] for r in range(8)]
    want = [[cache.block(b) for b in pair] for pair in sources]
    commands = []
    for r, pair in enumerate(sources):
        commands += [swap_out(pair, [500, 501]), swap_in([40 + 2 * r, 41 + 2 * r], [500, 501])]
    outcomes = client.wait_all(burst(client, commands))
    assert all(o.ok for o in outcomes), outcomes
    assert [[cache.block(40 + 2 * r), cache.block(41 + 2 * r)] for r in range(8)] == want


def test_write_after_read(attached: Attached) -> None:
    """Swap in host 7 -> device 1, then swap out device 2 -> host 7: the first reads the old
    content of host 7."""
    client, cache = attached.client, attached.cache
    assert client.call(T.SWAP_OUT, device_ids=[5], host_ids=[7]).ok
    old, new = cache.block(5), cache.block(2)
    outcomes = client.wait_all(burst(client, [swap_in([1], [7]), swap_out([2], [7]), swap_in([10], [7])]))
    assert all(o.ok for o in outcomes), outcomes
    assert cache.block(1) == old and cache.block(10) == new


def test_write_after_write(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    want = cache.block(4)
    outcomes = client.wait_all(burst(client, [swap_out([3], [7]), swap_out([4], [7]), swap_in([9], [7])]))
    assert all(o.ok for o in outcomes), outcomes
    assert cache.block(9) == want


def test_device_side_write_after_write(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    assert client.call(T.SWAP_OUT, device_ids=[11, 12], host_ids=[20, 21]).ok
    want = cache.block(12)
    outcomes = client.wait_all(burst(client, [swap_in([30], [20]), swap_in([30], [21])]))
    assert all(o.ok for o in outcomes), outcomes
    assert cache.block(30) == want


def test_clear_host_orders_against_host_blocks(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    want = cache.block(6)
    outcomes = client.wait_all(
        burst(client, [swap_out([6], [7]), swap_in([13], [7]), (T.CLEAR_HOST, {}), swap_in([14], [7])])
    )
    assert all(o.ok for o in outcomes), outcomes
    assert cache.block(13) == want
    assert cache.block(14) == bytes(cache.block_bytes), "swap in after CLEAR_HOST reads a cleared block (cpu: zeros)"


def test_conflicting_events_arrive_in_submission_order(attached: Attached) -> None:
    client = attached.client
    ids = burst(client, [swap_out([b], [600]) for b in range(20)])
    arrived: list[int] = []
    deadline = time.monotonic() + 15
    while len(arrived) < len(ids):
        assert time.monotonic() < deadline, f"only {len(arrived)} of {len(ids)} events arrived"
        arrived += [o.req_id for o in client.collect(0.1)]
    assert arrived == ids


def test_storage_commands_order_against_swaps_and_keys(attached: Attached) -> None:
    """swap out -> store (reads host 700) -> swap out over host 700 -> load into host 701 ->
    swap in from 701: the load delivers what the store read, not the later overwrite."""
    client, cache = attached.client, attached.cache
    key = f"order-{client.boot_id}"
    first, second = cache.block(15), cache.block(16)
    ids = burst(
        client,
        [
            swap_out([15], [700]),
            (T.STORE, {"keys": [key], "host_ids": [700]}),
            swap_out([16], [700]),
            (T.LOAD, {"keys": [key], "host_ids": [701]}),
            swap_in([17], [701]),
            swap_in([18], [700]),
            (T.DELETE, {"keys": [key]}),
            (T.LOOKUP, {"keys": [key]}),
        ],
    )
    outcomes = client.wait_all(ids)
    assert all(o.ok for o in outcomes), outcomes
    assert outcomes[1].result["stored"] == 1 and outcomes[3].result["loaded"] == 1
    assert outcomes[6].result["deleted"] == 1 and outcomes[7].result["prefix"] == 0
    assert cache.block(17) == first and cache.block(18) == second
