"""The plug-in's pending KV events are bounded: when vLLM takes none for a while, the oldest
are dropped, and the dropped blocks are counted where the scheduler's totals are seen. vLLM's
engine is not needed; its offloading types are."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.index import OffloadEvent, Tier
from cachexferd.integrations.vllm.events import TierEvents
from cachexferd.integrations.vllm.vllm_api import Medium, OffloadKey

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(60)]


def placed(events: TierEvents, first: int, count: int) -> list[bytes]:
    digests = [i.to_bytes(8, "big") for i in range(first, first + count)]
    events.know([OffloadKey(b"k" + d) for d in digests], digests)
    return digests


def test_pending_events_are_bounded_the_oldest_dropped_and_counted() -> None:
    events = TierEvents(enabled=True, max_pending=10)
    for step in range(5):  # vLLM takes nothing for five steps of 4 blocks each
        events.add([OffloadEvent(placed(events, 4 * step, 4), Tier.HOST, removed=False)])
    assert events.dropped == 10
    out = events.take()
    kept = [k for e in out for k in e.keys]
    assert kept == [b"k" + i.to_bytes(8, "big") for i in range(10, 20)], "the newest blocks, in order"
    assert all(e.medium == Medium.CPU and not e.removed for e in out)
    assert events.take() == [] and events.dropped == 10


def test_a_removal_of_the_whole_host_tier_keeps_its_newest_blocks_within_the_bound() -> None:
    events = TierEvents(enabled=True, max_pending=3)
    digests = placed(events, 0, 3)
    events.add([OffloadEvent(digests, Tier.HOST, removed=False)])
    assert len([k for e in events.take() for k in e.keys]) == 3 and events.dropped == 0
    events.add([OffloadEvent(placed(events, 3, 2), Tier.HOST, removed=False)])
    events.host_gone()  # five blocks removed on top of two pending: four dropped
    out = events.take()
    assert sum(len(e.keys) for e in out) == 3 and events.dropped == 4
    assert out[-1].removed and out[-1].medium == Medium.CPU


def test_events_off_keep_nothing() -> None:
    events = TierEvents(enabled=False, max_pending=1)
    events.add([OffloadEvent(placed(events, 0, 5), Tier.HOST, removed=False)])
    events.host_gone()
    assert events.take() == [] and events.dropped == 0


def test_storage_events_are_published_on_changes_only() -> None:
    """Two sources name the storage tier (this instance's index, the storage journal): a block
    announced by one is not announced again by the other, one never announced is not removed."""
    events = TierEvents(enabled=True)
    a, b = placed(events, 0, 2)
    events.add([OffloadEvent([a], Tier.STORAGE, removed=False)])
    events.add([OffloadEvent([a, b, b], Tier.STORAGE, removed=False)])
    events.add([OffloadEvent([b], Tier.STORAGE, removed=True), OffloadEvent([b], Tier.STORAGE, removed=True)])
    out = [(e.removed, k) for e in events.take() for k in e.keys]
    assert out == [(False, b"k" + a), (False, b"k" + b), (True, b"k" + b)]
    assert all(e.medium == Medium.STORAGE for e in events.take())
