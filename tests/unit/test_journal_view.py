"""The storage journal's records as the vLLM plug-in reads them (JournalView): a block is
stored once every rank's object is, removed when any is gone; records of other weights,
models or KV-cache groups count for nothing; a reset removes what it does not restate."""

from __future__ import annotations

from typing import Any

from cachexferd.integrations.vllm.journal_feed import Change, JournalView
from cachexferd.integrations.vllm.keys import VllmKeyNames

VERSION = 3


def names(tp_size: int = 2, model: str = "m", replicated: bool = False) -> VllmKeyNames:
    return VllmKeyNames.create(model=model, weights_version="", dtype="bfloat16", layout="l",
                               tokens_per_block={0: 32}, tp_size=tp_size, replicated=replicated)  # fmt: skip


def block(i: int, group: int = 0) -> bytes:
    """vLLM's offload key: a block hash and the group index (4 bytes, big-endian)."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def rec(view_names: VllmKeyNames, op: str, tag: bytes, rank: int, version: int = VERSION) -> list[Any]:
    return [0, op, version, view_names.key(tag, rank), tag]


def answer(*events: list[Any], reset: bool = False, more: bool = False) -> dict[str, Any]:
    return {"journal": True, "events": list(events), "next": 1, "more": more, "reset": reset}


def flat(changes: list[Change]) -> list[tuple[str, bytes]]:
    return [("removed" if c.removed else "stored", k) for c in changes for k in c.keys]


def test_a_block_is_stored_once_every_rank_has_its_object_and_removed_when_one_goes() -> None:
    n = names()
    view = JournalView(n, VERSION)
    a, b = block(1), block(2)
    assert view.apply(answer(rec(n, "stored", a, 0), rec(n, "stored", b, 1))) == []
    changes = view.apply(answer(rec(n, "stored", a, 1), rec(n, "stored", a, 1)))
    assert flat(changes) == [("stored", a)]
    assert changes[0].digests == [n.block_hash(a).digest] and changes[0].version == VERSION
    assert flat(view.apply(answer(rec(n, "stored", b, 0), rec(n, "removed", a, 0)))) == [("stored", b), ("removed", a)]
    assert view.apply(answer(rec(n, "removed", a, 1))) == [], "not announced any more: nothing to remove"
    # Removed, then stored again in one answer: the order is kept.
    assert flat(view.apply(answer(rec(n, "removed", b, 1), rec(n, "stored", b, 1)))) == [("removed", b), ("stored", b)]


def test_records_of_other_weights_models_groups_and_odd_tags_count_for_nothing() -> None:
    n, other = names(), names(model="other")
    view = JournalView(n, VERSION)
    a = block(1)
    odd = [
        rec(n, "stored", a, 0, version=VERSION + 1),
        rec(other, "stored", a, 1),  # another model's object of the same vLLM block
        [0, "stored", VERSION, n.key(a, 1), block(1, group=5)],  # a group this instance does not offload
        [0, "stored", VERSION, n.key(a, 1), b"x"],  # not an offload key
        [0, "stored", VERSION, n.key(a, 1), block(2)],  # the key of another block
    ]
    assert view.apply(answer(rec(n, "stored", a, 0), *odd)) == []
    assert flat(view.apply(answer(rec(n, "stored", a, 1)))) == [("stored", a)]
    assert view.apply(answer(rec(n, "removed", a, 0, version=VERSION + 1))) == []


def test_a_replicated_block_has_one_object_for_every_rank() -> None:
    n = names(tp_size=4, replicated=True)
    view = JournalView(n, VERSION)
    assert flat(view.apply(answer(rec(n, "stored", block(7), 0)))) == [("stored", block(7))]


def test_a_reset_restates_the_store_and_removes_what_it_does_not_restate() -> None:
    n = names(tp_size=1)
    view = JournalView(n, VERSION)
    a, b, c = block(1), block(2), block(3)
    first = view.apply(answer(*(rec(n, "stored", x, 0) for x in (a, b)), reset=True))
    assert flat(first) == [("stored", a), ("stored", b)]
    # A restarted daemon: its restatement comes in two answers; nothing is removed before it ends.
    assert flat(view.apply(answer(rec(n, "stored", a, 0), rec(n, "stored", c, 0), reset=True, more=True))) == [
        ("stored", c)
    ]
    assert flat(view.apply(answer())) == [("removed", b)]
    assert view.apply(answer()) == []
    # A block removed while being restated is removed once.
    view.apply(answer(rec(n, "stored", a, 0), reset=True, more=True))
    assert flat(view.apply(answer(rec(n, "removed", a, 0)))) == [("removed", a), ("removed", c)]


def test_a_reset_during_a_restatement_still_removes_what_neither_restates() -> None:
    n = names(tp_size=1)
    view = JournalView(n, VERSION)
    a, b = block(1), block(2)
    view.apply(answer(rec(n, "stored", a, 0), rec(n, "stored", b, 0), reset=True))
    assert view.apply(answer(rec(n, "stored", a, 0), reset=True, more=True)) == []
    assert view.apply(answer(reset=True, more=True)) == [], "the daemon started its restatement over"
    assert flat(view.apply(answer(rec(n, "stored", a, 0)))) == [("removed", b)]
