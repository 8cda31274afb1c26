"""The vLLM plug-in's reader of the storage journal against a fake daemon: the cursor, a
restarted daemon (a new boot id: from the start again), a store without a journal, and the
bound on what waits for the manager."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from cachexferd.integrations.vllm.journal_feed import JournalFeed, JournalView, _Reader

from .test_journal_view import VERSION, block, names, rec

NAMES = names(tp_size=1)


class FakeLink:
    """Answers STORAGE_EVENTS from a list; remembers the cursors asked for."""

    def __init__(self, answers: list[tuple[str, dict[str, Any]]]) -> None:
        self.answers = answers  # (boot id, result)
        self.asked: list[int] = []

    def call(self, cmd: Any, timeout_s: float) -> Any:
        self.asked.append(cmd.after)
        boot_id, result = self.answers.pop(0)
        return SimpleNamespace(ok=True, result=result, boot_id=boot_id, code=0, detail="", rank=0)

    def close(self) -> None:
        pass


def page(*events: list[Any], nxt: int, reset: bool = False, more: bool = False, journal: bool = True) -> dict[str, Any]:
    return {"journal": journal, "events": list(events), "next": nxt, "more": more, "reset": reset}


@pytest.fixture
def feed() -> Iterator[JournalFeed]:
    feed = JournalFeed(NAMES, timeout_s=1.0, interval_s=0.05, max_queued=3)  # its thread follows nothing
    yield feed
    feed.close()


def reader(feed: JournalFeed, link: FakeLink) -> _Reader:
    """A reader following the fake daemon (as ``_retarget`` sets one up, with a fake link)."""
    r = _Reader(feed, None)  # type: ignore[arg-type]
    r.target, r.view, r.link = ("ipc://fake", VERSION, 1), JournalView(NAMES, VERSION), link  # type: ignore[assignment]
    return r


def test_the_cursor_follows_the_answers_and_a_restarted_daemon_starts_again(feed: JournalFeed) -> None:
    a, b = block(1), block(2)
    link = FakeLink([
        ("boot1", page(rec(NAMES, "stored", a, 0), nxt=10, reset=True, more=True)),
        ("boot1", page(rec(NAMES, "stored", b, 0), nxt=20)),
        ("boot2", page(nxt=5)),  # a restarted daemon: cursor 20 means nothing there
        ("boot2", page(rec(NAMES, "stored", b, 0), nxt=7, reset=True)),
    ])  # fmt: skip
    r = reader(feed, link)
    assert r._read_once() is True and r._read_once() is False
    assert [k for c in feed.take(10) for k in c.keys] == [a, b]
    assert r._read_once() is True, "read again at once, from the start"
    assert r._read_once() is False
    assert link.asked == [0, 10, 20, 0]
    changes = feed.take(10)
    assert [(c.removed, c.keys) for c in changes] == [(True, [a])], "the restatement left a out"
    assert feed.resets == 2 and feed.journal is True


def test_a_store_without_a_journal_is_not_asked_again(feed: JournalFeed) -> None:
    link = FakeLink([("boot1", page(nxt=0, journal=False))])
    r = reader(feed, link)
    assert r._read_once() is False
    assert feed.journal is False and r.idle


def test_what_waits_for_the_manager_is_bounded_and_taken_in_whole_changes(feed: JournalFeed) -> None:
    blocks = [block(i) for i in range(4)]
    link = FakeLink([("boot1", page(*(rec(NAMES, "stored", x, 0) for x in blocks), nxt=1, reset=True))])
    r = reader(feed, link)
    assert not feed._full()
    r._read_once()
    assert feed._full(), "the reader stops reading until the manager takes"
    assert [k for c in feed.take(2) for k in c.keys] == blocks  # one change of four blocks
    assert not feed._full() and feed.take(2) == []
