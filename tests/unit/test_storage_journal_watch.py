"""Following the storage journal by its directory's changes (storage/journal_watch.py, inotify):
a follower reads an append at once, hardly wakes while the journal is quiet, finds the
journal's directory when it is made, and polls where it cannot watch."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cachexferd.daemon.storage_feed import StorageFeed
from cachexferd.storage import journal_watch
from cachexferd.storage.journal import STORED, FileJournal, JournalRead, JournalRecord, object_id
from cachexferd.storage.journal_watch import LOCAL_POLL_S, DirectoryWatch, mount_type, watch_directory
from tests.storage_rig import seen_within

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/sys/fs/inotify"), reason="needs Linux inotify")


def later(delay_s: float, act: Callable[[], object]) -> threading.Thread:
    thread = threading.Timer(delay_s, act)
    thread.start()
    return thread


def a_watch(directory: Path, poll_s: float = 30.0, once: bool = False) -> DirectoryWatch:
    watch = watch_directory(str(directory), poll_s, once)
    assert watch is not None
    return watch


def test_a_write_in_the_directory_ends_a_wait_at_once(tmp_path: Path) -> None:
    watch = a_watch(tmp_path)
    try:
        assert watch.wait(0.2) is False  # nothing changed
        writer = later(0.2, lambda: (tmp_path / "x.log").write_bytes(b"record"))
        started = time.monotonic()
        assert watch.wait(10.0) is True
        assert time.monotonic() - started < 5.0 and not watch.gone
        writer.join(5.0)
        watch.wait(0.1)  # the write's last events, should they have come after the first
        assert watch.wait(0.1) is False  # every change was taken
    finally:
        watch.close()


def test_wake_ends_a_wait_without_a_change(tmp_path: Path) -> None:
    watch = a_watch(tmp_path)
    try:
        waker = later(0.2, watch.wake)
        started = time.monotonic()
        assert watch.wait(10.0) is False and time.monotonic() - started < 5.0
        waker.join(5.0)
    finally:
        watch.close()


def test_a_directory_removed_or_watched_once_is_watched_again(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    watch, parent = a_watch(gone), a_watch(tmp_path, once=True)
    try:
        gone.rmdir()
        assert watch.wait(5.0) is True and watch.gone
        assert parent.wait(0.2) is False  # a removal is nothing made
        (tmp_path / "made").mkdir()
        assert parent.wait(5.0) is True and parent.gone
    finally:
        watch.close()
        parent.close()


MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
41 22 0:40 / /mnt/pool rw,relatime shared:20 - nfs4 server:/export rw,vers=4.2
42 41 0:41 / /mnt/pool/local\040disk rw,relatime shared:21 - xfs /dev/sdb1 rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [("/var/lib/cachexferd/storage", "ext4"), ("/dev/shm/x", "tmpfs"), ("/dev/shmx", "ext4"),
     ("/mnt/pool/storage/.journal", "nfs4"), ("/mnt/pool/local disk/s", "xfs"), ("/mnt/pool", "nfs4")],
)  # fmt: skip
def test_the_file_system_is_that_of_the_longest_mount_point_above_the_path(path: str, kind: str) -> None:
    assert mount_type(path, MOUNTINFO) == kind


def test_a_network_file_system_is_polled_as_often_as_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert journal_watch.file_system_of("/proc") == "proc"
    monkeypatch.setattr(journal_watch, "file_system_of", lambda path: "nfs4")
    remote = a_watch(tmp_path, poll_s=0.1)
    monkeypatch.setattr(journal_watch, "file_system_of", lambda path: "ext4")
    local = a_watch(tmp_path, poll_s=0.1)
    try:
        assert remote.poll_s == 0.1 and local.poll_s == LOCAL_POLL_S
    finally:
        remote.close()
        local.close()


class Counted(FileJournal):
    """A file journal that counts its reads."""

    reads = 0

    def read(self, position: int, limit: int) -> JournalRead:
        self.reads += 1
        return super().read(position, limit)


def stored(directory: Path, name: str) -> bytes:
    FileJournal(str(directory)).append([JournalRecord(STORED, object_id(name), name, b"", 1)])
    return object_id(name)


def test_a_follower_reads_an_append_at_once_and_wakes_for_nothing_while_it_is_quiet(tmp_path: Path) -> None:
    journal_dir = tmp_path / "store" / ".journal"
    first = stored(journal_dir, "w0/first")
    journal = Counted(str(journal_dir))
    feed = StorageFeed(journal, "", poll_s=0.05)
    feed.start()
    try:
        seen_within(feed, first, 5.0)
        reads = journal.reads
        time.sleep(1.0)  # quiet: polling every 0.05 s would read about 20 times
        assert journal.reads - reads <= 2
        assert seen_within(feed, stored(journal_dir, "w0/next"), 5.0) < 1.0  # not the 2 s safety poll
        assert feed.describe()["watched"] is True
        time.sleep(0.2)  # the follower waits for the next change
    finally:
        closed_quickly(feed)


def test_a_follower_finds_the_journal_when_the_first_append_makes_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    journal = Counted(str(store / ".journal"))
    feed = StorageFeed(journal, "", poll_s=0.05)
    feed.start()
    try:
        time.sleep(0.5)
        assert journal.reads <= 3  # the storage directory is watched until the journal's appears
        assert seen_within(feed, stored(store / ".journal", "w0/first"), 5.0) < 1.0
        assert seen_within(feed, stored(store / ".journal", "w0/second"), 5.0) < 1.0
    finally:
        feed.close()


def test_a_follower_polls_where_the_journal_cannot_be_watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal_dir = tmp_path / ".journal"
    stored(journal_dir, "w0/first")
    journal = Counted(str(journal_dir))
    monkeypatch.setattr(journal, "watch", lambda poll_s: None)  # no inotify (another OS, no instances left)
    feed = StorageFeed(journal, "", poll_s=0.05)
    feed.start()
    try:
        time.sleep(0.6)
        assert journal.reads >= 5
        assert seen_within(feed, stored(journal_dir, "w0/next"), 5.0) < 1.0
        assert feed.describe()["watched"] is False
    finally:
        feed.close()


def test_while_records_come_reads_stay_a_poll_apart_and_close_does_not_wait_for_one(tmp_path: Path) -> None:
    journal_dir = tmp_path / ".journal"
    stored(journal_dir, "w0/first")
    journal = Counted(str(journal_dir))
    feed = StorageFeed(journal, "", poll_s=0.1)
    feed.start()
    writer = FileJournal(str(journal_dir))
    try:
        started = time.monotonic()
        for i in range(200):  # an append every 5 ms for about a second
            writer.append([JournalRecord(STORED, object_id(f"w0/r{i}"), f"w0/r{i}", b"", 1)])
            time.sleep(0.005)
        spent = time.monotonic() - started
        assert journal.reads <= spent / 0.1 + 5  # not one read per append
        seen_within(feed, object_id("w0/r199"), 5.0)
    finally:
        closed_quickly(feed)


class CountedStop(threading.Event):
    """A follower's stop event that counts the timed waits made on it."""

    waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_a_lone_append_wakes_the_follower_once(tmp_path: Path) -> None:
    """A follower that read records waits for the next append before it waits out the rest of
    its ``poll_s``: appends further apart than that cost one wake-up each, not two."""
    journal_dir = tmp_path / ".journal"
    stored(journal_dir, "w0/first")
    journal = Counted(str(journal_dir))
    feed = StorageFeed(journal, "", poll_s=0.1)
    stop = feed._stop = CountedStop()
    feed.start()
    try:
        seen_within(feed, object_id("w0/first"), 5.0)
        time.sleep(0.3)
        waits, reads = stop.waits, journal.reads
        for i in range(3):
            assert seen_within(feed, stored(journal_dir, f"w0/lone{i}"), 5.0) < 1.0
            time.sleep(0.3)
        assert journal.reads - reads == 3, "one read per lone append"
        assert stop.waits == waits, "no timed wait after reading a lone append"
    finally:
        closed_quickly(feed)


def closed_quickly(feed: StorageFeed) -> None:
    started = time.monotonic()
    feed.close()
    assert time.monotonic() - started < 0.45  # the follower's wait is woken, not waited out


def test_a_follower_whose_watch_fails_polls_and_reads_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal_dir = tmp_path / ".journal"
    stored(journal_dir, "w0/first")
    journal = Counted(str(journal_dir))

    def no_descriptors(poll_s: float) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(journal, "watch", no_descriptors)
    feed = StorageFeed(journal, "", poll_s=0.05)
    feed.start()
    try:
        assert seen_within(feed, stored(journal_dir, "w0/next"), 5.0) < 1.0  # the follower did not die
        reads = journal.reads
        time.sleep(0.5)
        assert journal.reads - reads >= 3 and feed.describe()["watched"] is False  # it polls
        assert len([r for r in caplog.records if "waiting for appends failed" in r.getMessage()]) == 1
    finally:
        closed_quickly(feed)
