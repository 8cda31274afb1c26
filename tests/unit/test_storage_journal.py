"""The storage journal's files and the daemon's view of them (storage/journal.py,
daemon/storage_feed.py): writers in several processes never interleave or lose a record,
files rotate and old ones go, a reader that fell behind learns it lost records, and the
STORAGE_EVENTS pages restate the state, then follow it, and start over when they must."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import msgpack
import pytest

from cachexferd.daemon.storage_feed import StorageFeed
from cachexferd.storage import journal as journal_module
from cachexferd.storage.journal import (
    REMOVED,
    STORED,
    Batch,
    FileJournal,
    JournalRecord,
    Row,
    batches_of,
    decode_frame,
    object_id,
    rows_of,
)

WRITERS, PER_WRITER, BATCH = 3, 400, 4


def stored_records(names: list[str], tags: list[bytes], size: int) -> list[Row]:
    """The rows of a STORE's objects (``size`` bytes each), with their tags."""
    return [(STORED, object_id(n), n, t, size) for n, t in zip(names, tags)]


def decode(body: bytes) -> list[Row]:
    """A frame's records as rows; none when the bytes are not a frame of this format."""
    batch = decode_frame(body)
    return [] if batch is None else batch.rows()


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
        mine = [r[2] for r in records if r[3] == bytes([writer])]
        assert mine == [f"w0/k-{writer}-{j:05d}" for j in range(PER_WRITER)], "each writer's order kept"
    assert len(list(Path(directory).glob("*.log"))) > 3, "8 KiB files: the journal rotated"


def test_a_reader_that_reached_the_end_of_a_file_before_the_next_was_started_reads_on(tmp_path: Path) -> None:
    """A reader may reach the end of a file that the last write filled before the writer
    started the next one: that file never grows again, and what follows is in the next."""
    writer = FileJournal(str(tmp_path / "j"), segment_bytes=1024, keep=100)
    writer.append([JournalRecord(STORED, object_id(f"w0/{i}"), f"w0/{i}", b"") for i in range(60)])  # > 1 KiB
    reader = FileJournal(str(tmp_path / "j"))
    end_of_first = os.path.getsize(tmp_path / "j" / "000000000000.log")  # as read before the next file existed
    assert reader.read(end_of_first, 100).records == []
    writer.append([JournalRecord(STORED, object_id("w0/late"), "w0/late", b"")])
    assert os.path.getsize(tmp_path / "j" / "000000000000.log") == end_of_first, "the late record went to the next file"
    assert [r[2] for r in read_all(reader, end_of_first)[0]] == ["w0/late"]


def test_a_reader_in_the_newest_file_reads_on_without_listing_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every daemon reads after every append: where it reads on in the newest file, two
    ``stat``s say so and no listing of the directory is made; once a later file exists, it is
    listed and read."""
    writer = FileJournal(str(tmp_path / "j"), segment_bytes=1024, keep=100)
    reader = FileJournal(str(tmp_path / "j"))
    listings: list[int] = []
    real_segments = reader._segments
    monkeypatch.setattr(reader, "_segments", lambda: listings.append(1) or real_segments())
    writer.append([JournalRecord(STORED, object_id("w0/0"), "w0/0", b"")])
    first = reader.read(0, 100)  # where to start: listed
    assert [r[2] for r in first.records] == ["w0/0"] and len(listings) == 1
    position, names = first.position, []
    for i in range(1, 60):  # past 1 KiB: a second file starts
        writer.append([JournalRecord(STORED, object_id(f"w0/{i}"), f"w0/{i}", b"")])
        read = reader.read(position, 100)
        position, names = read.position, names + [r[2] for r in read.records]
    assert names == [f"w0/{i}" for i in range(1, 60)]
    assert os.path.exists(tmp_path / "j" / "000000000001.log"), "the appends filled a file"
    assert 1 < len(listings) <= 3, f"{len(listings)} listings: one per read, or none to find the next file"


def test_old_files_are_deleted_and_a_reader_behind_them_learns_of_the_gap(tmp_path: Path) -> None:
    journal = FileJournal(str(tmp_path / "j"), segment_bytes=1 << 10, keep=2)
    journal.append([JournalRecord(STORED, object_id("w0/first"), "w0/first", b"t")])
    first = journal.read(0, 10)
    assert [r[2] for r in first.records] == ["w0/first"] and not first.gap
    for i in range(200):
        journal.append([JournalRecord(REMOVED, object_id(f"w0/x{i}"))])
    assert len(list((tmp_path / "j").glob("*.log"))) == 2
    behind = journal.read(first.position, 10)
    assert behind.gap and behind.records and behind.position > first.position
    assert journal.read(behind.position, 10).gap is False


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
    for _ in range(100_000):  # bounded: a feed that always says `more` fails the test
        page = feed.page(cursor, limit)
        if page["reset"]:
            resets += 1
            held.clear()
        for _, op, version, key, tag in page["events"]:
            assert version == 3
            if op == "stored":
                held[key] = tag
            else:
                held.pop(key, None)
                removed.append(key)
        cursor = page["next"]
        if not page["more"]:
            return held, removed, resets, cursor
    raise AssertionError("the pages never ended")


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
    """A frame per run of one op and size, at most FRAME_RECORDS each; read back in order."""
    from cachexferd.storage.journal import FRAME_RECORDS, frames

    stores = [JournalRecord(STORED, object_id(f"w0/{i}"), f"w0/{i}", b"\x00t", 4096) for i in range(2500)]
    records = [*stores[:2400], *(JournalRecord(REMOVED, r.object_id) for r in stores[:3]), *stores[2400:]]
    records.append(JournalRecord(STORED, object_id("w0/big"), "w0/big", b"", 8192))  # another size
    parts = frames(batches_of(records))
    assert len(parts) == 3 + 1 + 1 + 1  # 2400 stores in three frames, the removals, 100 stores, the big one
    assert max(len(decode(p)) for p in parts) == FRAME_RECORDS
    assert [r for p in parts for r in decode(p)] == records
    two_sizes = records[-11:]  # stores only: ten of one size, then one of another
    assert len(frames(batches_of(two_sizes))) == 2
    assert [r for p in frames(batches_of(two_sizes)) for r in decode(p)] == two_sizes
    # Batches of one op and size in a row (STOREs queued together) share frames.
    queued = [batches_of(records[i : i + 7])[0] for i in range(0, 2100, 7)]
    assert len(frames(queued)) == 3 and [r for p in frames(queued) for r in decode(p)] == records[:2100]


def test_frames_that_are_not_of_this_format_are_skipped() -> None:
    """Damage or a writer of another format: the frame is skipped whole, never half-used."""
    from cachexferd.storage.journal import FORMAT

    good = [FORMAT, STORED, 10, bytes(32), ["w0/a", "w0/b"], [b"", b"t"]]
    assert decode(msgpack.packb(good, use_bin_type=True)) == [(STORED, bytes(16), "w0/a", b"", 10),
                                                              (STORED, bytes(16), "w0/b", b"t", 10)]  # fmt: skip
    assert decode(b"\xc1") == [] and decode(b"\x91\x01") == [] and decode(b"") == []
    rows_of_an_earlier_format = [[0, bytes(16), "w0/a", b"", 1]]
    for at, value in [(0, FORMAT + 1), (1, 2), (1, True), (2, -1), (2, "10"), (3, bytes(31)), (3, "x" * 32),
                      (4, ["w0/a"]), (4, ["w0/a", b"w0/b"]), (5, [b"", "t"]), (5, [b""]), (4, "w0/a")]:  # fmt: skip
        bad = [*good]
        bad[at] = value
        assert decode(msgpack.packb(bad, use_bin_type=True)) == [], (at, value)
    for bad in (good[:5], [*good, 1], rows_of_an_earlier_format, {"r": 1}):
        assert decode(msgpack.packb(bad, use_bin_type=True)) == [], bad


def test_a_long_backlog_is_read_in_full_pages(tmp_path: Path) -> None:
    """A read fills its page from a file much larger than one read of it takes."""
    journal = FileJournal(str(tmp_path / "j"), segment_bytes=1 << 20, keep=100)  # several files, all kept
    long = "k" * 200  # records longer than one read's share of each
    for i in range(0, 40_000, 1000):
        names = [f"w0/{long}{j}" for j in range(i, i + 1000)]
        journal.append([JournalRecord(STORED, object_id(n), n, bytes(36)) for n in names])
    first = journal.read(0, 30_000)
    assert len(first.records) >= 30_000
    rest = journal.read(first.position, 30_000)
    assert len(first.records) + len(rest.records) == 40_000


def test_a_writer_reads_its_own_stores_back_from_memory_and_others_from_the_file(tmp_path: Path) -> None:
    """What a daemon appended as stores is taken back from memory (its backend knows those
    objects: they are not in ``news``); other writers' records and its own removals are decoded.
    Every reader sees the same records in the same order."""
    directory = str(tmp_path / "j")
    mine, theirs = FileJournal(directory), FileJournal(directory)
    stored = [JournalRecord(STORED, object_id(f"w0/m{i}"), f"w0/m{i}", b"m", 7) for i in range(3)]
    other = [JournalRecord(STORED, object_id("w0/o"), "w0/o", b"o", 9)]
    removed = [JournalRecord(REMOVED, object_id("w0/m0"))]
    mine.append(stored[:2])
    theirs.append(other)
    mine.append(removed)
    mine.append(stored[2:])
    read = mine.read(0, 100)
    want = [*stored[:2], *other, *removed, *stored[2:]]
    assert [tuple(r) for r in read.records] == [tuple(r) for r in want]
    assert [tuple(r) for r in rows_of(read.news)] == [tuple(r) for r in [*other, *removed]]
    fresh = FileJournal(directory).read(0, 100)
    assert [tuple(r) for r in fresh.records] == [tuple(r) for r in want] and rows_of(fresh.news) == fresh.records
    assert not mine._mine, "every own append read back is forgotten"


def test_the_file_backend_indexes_what_other_daemons_stored_and_forgets_what_they_removed(tmp_path: Path) -> None:
    """``learn``: a batch of stores (the usual) and a mixed batch give the same index: every
    stored object once, with its size; a removal forgets it; a record without a size whose
    file is gone is skipped."""
    from cachexferd.storage.file import FileBackend

    backend = FileBackend(tmp_path / "s")
    names = [f"w0/k{i}" for i in range(4)]
    rows = [(STORED, object_id(n), n, b"", 100 + i) for i, n in enumerate(names)]
    backend.learn(batches_of(rows[:3]))  # stores only, each of its own size
    backend.learn(batches_of(rows[2:]))  # k2 again: counted once
    assert all(object_id(n) in backend.index for n in names) and backend.index.total == sum(range(100, 104))
    backend.learn([Batch(REMOVED, [object_id(names[0])]), Batch(STORED, [object_id("w0/x")], 0, ["w0/x"], [b""])])
    assert object_id(names[0]) not in backend.index, "removed"
    assert object_id("w0/x") not in backend.index, "no size and no file: skipped"
    assert backend.index.total == sum(range(101, 104)) and len(backend.index) == 3
    # In the journal's order: stored after its removal is there, removed after its store is not.
    again, gone = object_id(names[1]), object_id("w0/y")
    backend.learn([Batch(REMOVED, [again]), Batch(STORED, [again, gone], 7, ["w0/k1", "w0/y"], [b"", b""]),
                   Batch(REMOVED, [gone])])  # fmt: skip
    assert again in backend.index and gone not in backend.index
    assert backend.index.total == 7 + 102 + 103 and len(backend.index) == 3


# Grouped writes ------------------------------------------------------------------------------


class Gated(FileJournal):
    """A file journal whose writes wait for ``gate`` (``entered``: a write began); ``written``:
    each write's batches as (op, size, ids, names, tags), as they were written."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.written_batches: list[list[tuple[int, int, list[bytes], list[str], list[bytes]]]] = []

    def _write(self, batches: list[Batch]) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.written_batches.append([(b.op, b.size, list(b.ids), list(b.names), list(b.tags)) for b in batches])
        super()._write(batches)


def stores(prefix: str, count: int) -> list[Row]:
    return stored_records([f"w0/{prefix}{i}" for i in range(count)], [prefix.encode()] * count, 5)


def names_in(directory: str) -> list[str]:
    records, _ = read_all(FileJournal(directory))
    return [r[2] for r in records]


def test_records_queued_during_a_write_go_together_in_the_next_one_in_order(tmp_path: Path) -> None:
    directory = str(tmp_path / "j")
    journal = Gated(directory)
    first = journal.submit(stores("a", 1))
    assert journal.entered.wait(5), "the writer thread took the first record"
    later = [journal.submit(stores(f"b{i}-", 2)) for i in range(5)]
    assert not first.done() and not any(f.done() for f in later), "submitting never waits for a write"
    journal.gate.set()
    for written in (first, *later):
        assert written.result(timeout=5) is None
    assert (journal.submits, journal.writes) == (6, 2), "the five queued during the first write share the next"
    assert names_in(directory) == ["w0/a0", *(f"w0/b{i}-{j}" for i in range(5) for j in range(2))]
    journal.close()


def store_objects(journal: FileJournal, prefix: str, count: int, size: int = 5) -> Future[None]:
    """A STORE's records handed over as the storage tier does (one tag per name, and one more)."""
    names = [f"w0/{prefix}{i}" for i in range(count)]
    return journal.store(names, [prefix.encode()] * count + [b"beyond"], size)


def stored_as(prefix: str, count: int, size: int = 5) -> list[tuple[int, bytes, str, bytes, int]]:
    return [(STORED, object_id(f"w0/{prefix}{i}"), f"w0/{prefix}{i}", prefix.encode(), size) for i in range(count)]


def test_stores_queued_one_behind_the_other_join_one_batch_in_the_journals_order(tmp_path: Path) -> None:
    directory = str(tmp_path / "j")
    journal = Gated(directory)
    first = store_objects(journal, "a", 1)
    assert journal.entered.wait(5), "the writer thread took the first STORE"
    later = [store_objects(journal, f"b{i}-", 1 + i % 2) for i in range(4)]
    removal = journal.submit([JournalRecord(REMOVED, object_id("w0/a0"))])
    after = [store_objects(journal, "c", 2), store_objects(journal, "d", 1, size=7), store_objects(journal, "e", 1, 7)]
    assert not first.done() and not any(f.done() for f in (*later, removal, *after)), "a STORE never waits"
    assert len({id(f) for f in (*later, removal, *after)}) == 1, "all of them go with the next write"
    journal.gate.set()
    for written in (first, *later, removal, *after):
        assert written.result(timeout=5) is None
    assert (journal.submits, journal.writes) == (9, 2)
    b_rows = [row for i in range(4) for row in stored_as(f"b{i}-", 1 + i % 2)]
    second = journal.written_batches[1]
    assert [(op, size, len(ids)) for op, size, ids, _, _ in second] == [(STORED, 5, 6), (REMOVED, 0, 1),
                                                                        (STORED, 5, 2), (STORED, 7, 2)]  # fmt: skip
    for op, _, ids, names, tags in second:
        assert ids == [object_id(n) for n in names] or op == REMOVED, "every id is its name's"
        assert len(names) == len(tags) == len(ids)
    expected = [*stored_as("a", 1), *b_rows, (REMOVED, object_id("w0/a0"), "", b"", 0), *stored_as("c", 2),
                *stored_as("d", 1, 7), *stored_as("e", 1, 7)]  # fmt: skip
    records, _ = read_all(FileJournal(directory))
    assert [tuple(r) for r in records] == expected, "another daemon reads every record, in order, whole"
    feed = StorageFeed(journal, "")
    while feed.catch_up():
        pass
    assert sorted(feed._objects) == sorted(r[1] for r in expected[1:] if r[0] == STORED)
    journal.close()


def test_a_store_after_its_batchs_write_began_goes_in_the_next_write(tmp_path: Path) -> None:
    directory = str(tmp_path / "j")
    journal = Gated(directory)
    journal.gate.set()
    store_objects(journal, "x", 1).result(timeout=5)  # the journal is busy from now on: no write waits
    journal.gate.clear()
    journal.entered.clear()
    queued = store_objects(journal, "y", 2)  # queued: a batch of the journal's own, open for more
    assert journal.entered.wait(5), "the writer thread took it"
    during = store_objects(journal, "z", 1)  # its batch is being written: a new one
    assert during is not queued
    journal.gate.set()
    assert queued.result(timeout=5) is None and during.result(timeout=5) is None
    assert [[names for _, _, _, names, _ in write] for write in journal.written_batches] == [
        [["w0/x0"]],
        [["w0/y0", "w0/y1"]],
        [["w0/z0"]],
    ], "a batch grew after its write began"
    records, _ = read_all(FileJournal(directory))
    assert [tuple(r) for r in records] == [*stored_as("x", 1), *stored_as("y", 2), *stored_as("z", 1)]
    journal.close()


def test_flush_waits_for_the_write_under_way(tmp_path: Path) -> None:
    journal = Gated(str(tmp_path / "j"))
    written = journal.submit(stores("f", 2))
    assert journal.entered.wait(5)
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (journal.flush(10), flushed.set()))
    flusher.start()
    assert not flushed.wait(0.2), "flush returned while the write was blocked"
    journal.gate.set()
    assert flushed.wait(5) and written.done()
    flusher.join(5)
    journal.close()


def test_each_threads_records_keep_their_order_and_none_is_lost(tmp_path: Path) -> None:
    directory = str(tmp_path / "j")
    journal = FileJournal(directory)

    def submit_many(thread: int) -> None:
        for i in range(100):
            journal.submit(stores(f"t{thread}-{i:03d}-", 2))

    threads = [threading.Thread(target=submit_many, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    journal.flush(10)
    names = names_in(directory)
    assert len(names) == 4 * 100 * 2
    for t in range(4):
        mine = [n for n in names if n.startswith(f"w0/t{t}-")]
        assert mine == [f"w0/t{t}-{i:03d}-{j}" for i in range(100) for j in range(2)]
    assert journal.writes < journal.submits, "threads submitting at once shared writes"
    journal.close()


def test_a_failed_write_fails_every_record_in_it_and_is_reported(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    journal = FileJournal(str(blocker / "j"))  # its directory cannot be made: every write fails
    failed: list[int] = []
    journal.on_failure = failed.append
    written = [journal.submit(stores(f"x{i}-", 3)) for i in range(4)]
    for each in written:
        with pytest.raises(OSError):
            each.result(timeout=5)
    with pytest.raises(OSError):
        journal.append(stores("y", 1))
    assert journal.failed == sum(failed) == 4 * 3 + 1 and journal.writes == 0
    journal.close()


def test_close_writes_what_is_queued_and_records_after_it_at_once(tmp_path: Path) -> None:
    directory = str(tmp_path / "j")
    journal = FileJournal(directory)
    queued = journal.submit(stores("q", 3))
    journal.close()
    assert queued.done() and queued.exception() is None
    late = journal.submit(stores("late", 1))
    assert late.done() and late.exception() is None, "written by its caller once the writer thread is gone"
    assert names_in(directory) == ["w0/q0", "w0/q1", "w0/q2", "w0/late0"]


def test_a_record_after_a_quiet_spell_is_written_at_once_and_one_soon_after_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "LINGER_S", 10.0)  # writes start at most every 10 s
    directory = str(tmp_path / "j")
    journal = FileJournal(directory)
    assert journal.submit(stores("a", 1)).result(timeout=5) is None, "the first write did not wait"
    second = journal.submit(stores("b", 1))
    time.sleep(0.3)
    assert not second.done(), "a record within 10 s of a write waits for the rest of the 10 s"
    journal.append(stores("c", 1))  # a caller that waits: its write (and the one queued before) goes now
    assert second.done() and names_in(directory) == ["w0/a0", "w0/b0", "w0/c0"]
    assert journal.writes == 2
    journal.close()


def test_a_caller_that_may_block_writes_a_lone_store_itself_and_queues_one_soon_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "LINGER_S", 10.0)  # writes start at most every 10 s
    directory = str(tmp_path / "j")
    journal = FileJournal(directory)
    lone = journal.submit(stores("a", 2), here=True)
    assert lone.done() and lone.exception() is None, "written before submit returned"
    assert journal._writer is None, "no thread was started (or woken) for a lone store"
    soon = journal.submit(stores("b", 1), here=True)  # within 10 s of that write: it waits, with the next
    time.sleep(0.3)
    assert not soon.done(), "a record soon after a write waits for the rest of LINGER_S, here or not"
    journal.append(stores("c", 1))
    assert soon.done() and names_in(directory) == ["w0/a0", "w0/a1", "w0/b0", "w0/c0"]
    assert (journal.submits, journal.writes) == (3, 2)
    alone = journal.submit(stores("d", 1), here=True, now=True)  # no others expected: no linger
    assert alone.done() and journal.writes == 3 and names_in(directory)[-1] == "w0/d0"
    journal.close()


def test_records_queued_while_a_caller_writes_its_own_are_written_after_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The two submits below must share a group however slowly a loaded machine runs them.
    monkeypatch.setattr(journal_module, "LINGER_S", 1.0)
    directory = str(tmp_path / "j")
    journal = Gated(directory)
    first: list[Future[None]] = []
    caller = threading.Thread(target=lambda: first.append(journal.submit(stores("a", 1), here=True)))
    caller.start()
    assert journal.entered.wait(5), "the caller began writing its own record"
    assert journal._writer is None
    queued = journal.submit(stores("b", 2))  # from the event loop: never waits for the write under way
    also_here = journal.submit(stores("c", 1), here=True)  # the journal is busy: queued, not written here
    assert not queued.done() and also_here is queued
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (journal.flush(10), flushed.set()))
    flusher.start()
    assert not flushed.wait(0.2), "flush returned while the caller's write was blocked"
    journal.gate.set()
    caller.join(5)
    assert flushed.wait(5) and first[0].done() and queued.result(timeout=5) is None
    flusher.join(5)
    assert names_in(directory) == ["w0/a0", "w0/b0", "w0/b1", "w0/c0"]
    assert (journal.submits, journal.writes) == (3, 2)
    journal.close()


@pytest.mark.parametrize("ring", [3, 50, 100_000])
def test_a_follower_ends_with_the_store_whatever_the_pages_and_the_ring(tmp_path: Path, ring: int) -> None:
    """Stores in batches of every size (some objects stored again under another tag),
    removals between them, followed page by page with page sizes from 1 up, by clients that
    start over or keep their cursor: each ends holding exactly what is in the store, and one
    that keeps its cursor while the ring holds its changes gets each change once, in order."""
    import random

    rng = random.Random(ring)
    journal, feed = feed_over(tmp_path, ring=ring)
    truth: dict[str, bytes] = {}
    cursors: list[int] = [0, 0]
    helds: list[dict[str, bytes]] = [{}, {}]
    for step in range(60):
        if truth and rng.random() < 0.3:
            gone = rng.sample(sorted(truth), k=min(len(truth), rng.randint(1, 4)))
            journal.append([JournalRecord(REMOVED, object_id(f"w3/{k}")) for k in gone])
            for k in gone:
                del truth[k]
        else:
            keys = [f"k{rng.randint(0, 80)}" for _ in range(rng.randint(1, 12))]
            tag = f"s{step}".encode()
            journal.append([JournalRecord(STORED, object_id(f"w3/{k}"), f"w3/{k}", tag, 5) for k in keys])
            truth.update(dict.fromkeys(keys, tag))
        feed.catch_up()
        for client in (0, 1):
            if client == 0 and rng.random() < 0.2:
                cursors[0], helds[0] = 0, {}  # a client that starts over
            cursor, held = cursors[client], helds[client]
            for _ in range(100_000):  # bounded: a feed that always says `more` fails the test
                page = feed.page(cursor, rng.randint(1, 7))
                if page["reset"]:
                    held.clear()
                numbers = [e[0] for e in page["events"]]
                if numbers and cursor and not page["reset"] and not cursor & (1 << 62):  # a cursor in the changes
                    first = (cursor & ((1 << 42) - 1)) + 1
                    assert numbers == list(range(first, first + len(numbers))), "each change once, in order"
                for _, op, _, key, tag in page["events"]:
                    if op == "stored":
                        held[key] = tag
                    else:
                        held.pop(key, None)
                cursor = page["next"]
                if not page["more"]:
                    break
            else:
                raise AssertionError("the pages never ended")
            cursors[client] = cursor
            assert held == truth, (step, client)


def test_objects_removed_or_stored_again_while_a_client_reads_the_state_are_not_lost(tmp_path: Path) -> None:
    """The state is restated page by page: an object removed before its page is left out
    (its removal follows), one stored again comes with its latest tag, and what was stored
    since comes after the state: the client ends holding what the store holds."""
    journal, feed = feed_over(tmp_path)
    stored(journal, *[f"k{i}" for i in range(10)])  # one batch
    stored(journal, "solo")  # a lone record
    feed.catch_up()
    first = feed.page(0, 3)
    assert first["reset"] and first["more"] and len(first["events"]) == 3
    journal.append([JournalRecord(REMOVED, object_id(f"w3/{k}")) for k in ("k5", "k9", "solo")])
    journal.append([JournalRecord(STORED, object_id("w3/k7"), "w3/k7", b"again")])
    stored(journal, "new")
    feed.catch_up()
    held = {e[3]: e[4] for e in first["events"]}
    rest, removed, resets, _ = follow(feed, first["next"], limit=2)
    assert resets == 0
    for key in removed:
        held.pop(key, None)
    held.update(rest)
    want = {f"k{i}": f"k{i}".encode() for i in range(10) if i not in (5, 9)} | {"k7": b"again", "new": b"new"}
    assert held == want


def test_what_the_view_keeps_stays_plain_tuples_unless_batches_are_mostly_held(tmp_path: Path) -> None:
    """A record read alone is kept as a row (a plain tuple, which the garbage collector stops
    tracking); a batch once most of its objects are removed leaves its remaining ones as
    rows, so it does not keep every record it came with for the sake of a few."""
    import gc

    journal, feed = feed_over(tmp_path)
    stored(journal, "solo")
    feed.catch_up()
    stored(journal, *[f"k{i}" for i in range(64)])
    feed.catch_up()
    gc.collect()
    assert not gc.is_tracked(feed._objects[object_id("w3/solo")])
    assert gc.is_tracked(batch := feed._objects[object_id("w3/k0")]) and len(batch) == 64  # type: ignore[arg-type]
    journal.append([JournalRecord(REMOVED, object_id(f"w3/k{i}")) for i in range(48)])  # 16 of 64 left
    feed.catch_up()
    assert feed._objects[object_id("w3/k63")] is batch, "a quarter held: the batch stays"
    journal.append([JournalRecord(REMOVED, object_id("w3/k48"))])
    feed.catch_up()
    gc.collect()
    assert not any(gc.is_tracked(v) for v in feed._objects.values()), "15 of 64 left: kept as rows"
    assert held_keys(feed) == {"solo", *[f"k{i}" for i in range(49, 64)]}


def held_keys(feed: StorageFeed) -> set[str]:
    return set(follow(feed, 0)[0])
