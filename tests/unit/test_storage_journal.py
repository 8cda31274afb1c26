"""The storage journal's files and the daemon's view of them (storage/journal.py,
daemon/storage_feed.py): writers in several processes never interleave or lose a record,
files rotate and old ones go, a reader that fell behind learns it lost records, and the
STORAGE_EVENTS pages restate the state, then follow it, and start over when they must."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from cachexferd.daemon.storage_feed import StorageFeed
from cachexferd.storage.journal import REMOVED, STORED, FileJournal, JournalRecord, object_id

WRITERS, PER_WRITER, BATCH = 3, 400, 4


def write_many(directory: str, writer: int) -> None:
    journal = FileJournal(directory, segment_bytes=8 << 10, keep=1000)
    for i in range(0, PER_WRITER, BATCH):
        names = [f"w0/k-{writer}-{j:05d}" for j in range(i, i + BATCH)]
        journal.append([JournalRecord(STORED, object_id(n), n, bytes([writer])) for n in names])
    journal.close()


def read_all(journal: FileJournal, position: int = 0) -> tuple[list[JournalRecord], int]:
    records: list[JournalRecord] = []
    while True:
        read = journal.read(position, 256)
        records += read.records
        if not read.records:
            return records, read.position
        assert read.position > position
        position = read.position


def test_writers_in_several_processes_never_interleave_and_files_rotate(tmp_path: Path) -> None:
    directory = str(tmp_path / "journal")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=write_many, args=(directory, w)) for w in range(WRITERS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    records, _ = read_all(FileJournal(directory))
    assert len(records) == WRITERS * PER_WRITER, "every record, once"
    for writer in range(WRITERS):
        mine = [r.name for r in records if r.tag == bytes([writer])]
        assert mine == [f"w0/k-{writer}-{j:05d}" for j in range(PER_WRITER)], "each writer's order kept"
    assert len(list(Path(directory).glob("*.log"))) > 3, "8 KiB files: the journal rotated"


def test_old_files_are_deleted_and_a_reader_behind_them_learns_of_the_gap(tmp_path: Path) -> None:
    journal = FileJournal(str(tmp_path / "j"), segment_bytes=1 << 10, keep=2)
    journal.append([JournalRecord(STORED, object_id("w0/first"), "w0/first", b"t")])
    first = journal.read(0, 10)
    assert [r.name for r in first.records] == ["w0/first"] and not first.gap
    for i in range(200):
        journal.append([JournalRecord(REMOVED, object_id(f"w0/x{i}"))])
    assert len(list((tmp_path / "j").glob("*.log"))) == 2
    behind = journal.read(first.position, 10)
    assert behind.gap and behind.records and behind.position > first.position
    assert journal.read(behind.position, 10).gap is False


def test_damaged_bytes_are_skipped_not_fatal(tmp_path: Path) -> None:
    journal = FileJournal(str(tmp_path / "j"))
    journal.append([JournalRecord(STORED, object_id("w0/a"), "w0/a", b"")])
    with open(tmp_path / "j" / "000000000000.log", "ab") as f:
        f.write(b"\x05\x00\x00\x00junk!")  # a frame that does not decode
    journal.append([JournalRecord(STORED, object_id("w0/b"), "w0/b", b"")])
    names = [r.name for r in read_all(journal)[0]]
    assert names == ["w0/a", "w0/b"]


def feed_over(tmp_path: Path, namespace: str = "", ring: int = 1000) -> tuple[FileJournal, StorageFeed]:
    journal = FileJournal(str(tmp_path / "j"))
    return journal, StorageFeed(journal, namespace, ring=ring)


def stored(journal: FileJournal, *keys: str, namespace: str = "") -> None:
    names = [f"{namespace + '/' if namespace else ''}w3/{k}" for k in keys]
    journal.append([JournalRecord(STORED, object_id(n), n, k.encode()) for n, k in zip(names, keys)])


def follow(feed: StorageFeed, cursor: int, limit: int = 4096) -> tuple[dict[str, bytes], list[str], int, int]:
    """(held, removed, resets, cursor) after reading every page from ``cursor``."""
    held: dict[str, bytes] = {}
    removed: list[str] = []
    resets = 0
    while True:
        page = feed.page(cursor, limit)
        if page["reset"]:
            resets += 1
            held.clear()
        for _, op, version, key, tag in page["events"]:
            assert version == 3
            if op == STORED:
                held[key] = tag
            else:
                held.pop(key, None)
                removed.append(key)
        cursor = page["next"]
        if not page["more"]:
            return held, removed, resets, cursor


def test_pages_restate_the_state_then_follow_it(tmp_path: Path) -> None:
    journal, feed = feed_over(tmp_path)
    stored(journal, *[f"k{i}" for i in range(10)])
    journal.append([JournalRecord(REMOVED, object_id("w3/k4"))])
    feed.catch_up()
    held, removed, resets, cursor = follow(feed, 0, limit=3)  # several snapshot pages
    assert resets == 1 and removed == [] and sorted(held) == sorted(f"k{i}" for i in range(10) if i != 4)
    assert held["k7"] == b"k7"
    stored(journal, "k10")
    journal.append([JournalRecord(REMOVED, object_id("w3/k0"))])
    feed.catch_up()
    more, removed, resets, cursor = follow(feed, cursor)
    assert resets == 0 and more == {"k10": b"k10"} and removed == ["k0"]
    assert feed.page(cursor, 10)["events"] == [], "nothing new"


def test_a_cursor_the_daemon_cannot_serve_starts_over(tmp_path: Path) -> None:
    journal, feed = feed_over(tmp_path, ring=4)
    stored(journal, "a")
    feed.catch_up()
    _, _, _, cursor = follow(feed, 0)
    stored(journal, *[f"b{i}" for i in range(10)])  # more than the ring holds
    feed.catch_up()
    held, _, resets, _ = follow(feed, cursor)
    assert resets == 1 and set(held) == {"a", *[f"b{i}" for i in range(10)]}
    assert follow(feed, cursor + 1000)[2] == 1, "a cursor from the future"
    assert follow(feed, 12345)[2] == 1, "a cursor of another view"


def test_another_namespace_is_not_reported(tmp_path: Path) -> None:
    journal, feed = feed_over(tmp_path, namespace="prod")
    stored(journal, "mine", namespace="prod")
    stored(journal, "theirs", namespace="staging")
    stored(journal, "bare")
    feed.catch_up()
    assert set(follow(feed, 0)[0]) == {"mine"}


def test_frames_round_trip_and_split() -> None:
    from cachexferd.storage.journal import FRAME_RECORDS, decode, frames

    records = [
        JournalRecord(STORED if i % 3 else REMOVED, object_id(f"w0/{i}"), f"w0/{i}", b"\x00t") for i in range(2500)
    ]
    parts = frames(records)
    assert len(parts) == -(-2500 // FRAME_RECORDS)
    assert [r for p in parts for r in decode(p)] == records
    assert decode(b"\xc1") == [] and decode(b"\x91\x01") == []
