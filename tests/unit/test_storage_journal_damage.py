"""A file journal that holds bytes which are not a whole frame (storage/journal.py): a write
torn by a full disk or a writer killed in the middle of it, a crash's zero-filled tail, a
flipped bit, junk. Readers skip exactly those bytes and read every whole frame around them;
a damaged frame is never read as other records; a write cut short fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from cachexferd.storage.journal import (
    STORED,
    FileJournal,
    JournalRecord,
    file_frames,
    frames,
    object_id,
    stored_batch,
)

FIRST = Path("j") / "000000000000.log"


def records(prefix: str, count: int) -> list[JournalRecord]:
    names = [f"w0/{prefix}{i:04d}" for i in range(count)]
    return [JournalRecord(STORED, object_id(n), n, n[-4:].encode(), 7) for n in names]


def names_of(rows: list) -> list[str]:
    return [r[2] for r in rows]


def read_on(journal: FileJournal, position: int = 0) -> tuple[list[str], int]:
    """Every record after ``position``, and where reading stopped (bounded: never hangs)."""
    names: list[str] = []
    for _ in range(1000):
        read = journal.read(position, 256)
        names += names_of(read.records)
        if read.position == position:
            return names, position
        position = read.position
    raise AssertionError("the reader never stopped")


def later_writes(tmp_path: Path) -> list[str]:
    """Another daemon's three writes (1, 50 and 1,500 records: frames of one, one and two
    sizes of frame), the names it wrote."""
    other = FileJournal(str(tmp_path / "j"))
    written: list[str] = []
    for prefix, count in (("b", 1), ("c", 50), ("d", 1500)):
        batch = records(prefix, count)
        other.append(batch)
        written += [r.name for r in batch]
    return written


def a_frame(prefix: str, count: int) -> bytes:
    batch = stored_batch([f"w0/{prefix}{i}" for i in range(count)], [b"t"] * count, 7)
    return file_frames(frames([batch]))


TORN = {
    "inside the header": lambda: a_frame("torn", 40)[:6],
    "the magic alone": lambda: a_frame("torn", 40)[:4],
    "half the frame": lambda: (f := a_frame("torn", 40))[: len(f) // 2],
    "all but a byte": lambda: a_frame("torn", 40)[:-1],
    "a zero-filled tail": lambda: bytes(4096),
}


@pytest.mark.parametrize("how", list(TORN))
def test_a_torn_write_costs_only_its_own_records(tmp_path: Path, how: str) -> None:
    journal = FileJournal(str(tmp_path / "j"))
    journal.append(records("a", 3))
    with open(tmp_path / FIRST, "ab") as f:
        f.write(TORN[how]())
    follower = FileJournal(str(tmp_path / "j"))
    seen, position = read_on(follower)  # reaches the torn bytes before anything follows them
    assert seen == ["w0/a0000", "w0/a0001", "w0/a0002"]
    written = later_writes(tmp_path)
    more, _ = read_on(follower, position)
    assert more == written  # every later record, none of the torn write's
    fresh = FileJournal(str(tmp_path / "j"))
    assert read_on(fresh)[0] == seen + written
    assert fresh.counts()["skipped"] == 1 and follower.counts()["skipped"] >= 1


def test_a_reader_passes_a_torn_write_as_soon_as_a_whole_frame_follows_it(tmp_path: Path) -> None:
    """Not once the bytes after it have filled the length the torn frame claimed."""
    journal = FileJournal(str(tmp_path / "j"))
    journal.append(records("a", 1))
    big = a_frame("torn", 1000)
    with open(tmp_path / FIRST, "ab") as f:
        f.write(big[: len(big) // 2])
    follower = FileJournal(str(tmp_path / "j"))
    seen, position = read_on(follower)
    FileJournal(str(tmp_path / "j")).append(records("b", 1))  # far fewer bytes than the torn frame lacks
    assert seen == ["w0/a0000"] and read_on(follower, position)[0] == ["w0/b0000"]
    assert follower.counts()["skipped"] == 1


def test_a_frame_still_being_written_is_waited_for_not_skipped(tmp_path: Path) -> None:
    journal = FileJournal(str(tmp_path / "j"))
    journal.append(records("a", 1))
    frame = a_frame("late", 30)
    with open(tmp_path / FIRST, "ab") as f:
        f.write(frame[:100])  # what a reader may see of a write under way
    follower = FileJournal(str(tmp_path / "j"))
    seen, position = read_on(follower)
    with open(tmp_path / FIRST, "ab") as f:
        f.write(frame[100:])
    assert seen == ["w0/a0000"] and read_on(follower, position)[0] == [f"w0/late{i}" for i in range(30)]
    assert follower.counts()["skipped"] == 0


@pytest.mark.parametrize("where", ["a name", "an object id", "the length"])
def test_a_damaged_frame_is_skipped_never_read_as_other_records(tmp_path: Path, where: str) -> None:
    journal = FileJournal(str(tmp_path / "j"))
    journal.append(records("x", 2))
    start = os.path.getsize(tmp_path / FIRST)
    journal.append(records("y", 3))
    journal.append(records("z", 2))
    data = bytearray((tmp_path / FIRST).read_bytes())
    frame = bytes(data[start:])
    at = {"a name": frame.index(b"w0/y0001") + 6, "an object id": frame.index(object_id("w0/y0002")) + 3,
          "the length": 4}[where]  # fmt: skip
    data[start + at] ^= 0x01
    (tmp_path / FIRST).write_bytes(bytes(data))
    reader = FileJournal(str(tmp_path / "j"))
    rows = reader.read(0, 256).records
    expected = records("x", 2) + records("z", 2)
    assert [(r[1], r[2], r[3]) for r in rows] == [(r.object_id, r.name, r.tag) for r in expected]
    assert reader.counts()["skipped"] == 1


def test_junk_and_frames_of_another_format_are_skipped_not_fatal(tmp_path: Path) -> None:
    journal = FileJournal(str(tmp_path / "j"))
    journal.append(records("a", 1))
    rows = msgpack.packb([[STORED, object_id("w0/x"), "w0/x", b"", 1]], use_bin_type=True)  # rows, not columns
    with open(tmp_path / FIRST, "ab") as f:
        f.write(b"\x05\x00\x00\x00junk!")  # an earlier release's framing around junk
        f.write(file_frames([rows]))  # a whole frame of another format
    journal.append(records("b", 1))
    reader = FileJournal(str(tmp_path / "j"))
    assert read_on(reader)[0] == ["w0/a0000", "w0/b0000"]
    assert reader.counts()["skipped"] == 2 and journal.counts()["skipped"] == 0


def test_a_torn_write_that_ends_a_finished_file_is_left_behind_once_it_stops_changing(tmp_path: Path) -> None:
    journal = FileJournal(str(tmp_path / "j"))
    journal.append(records("a", 2))
    with open(tmp_path / FIRST, "ab") as f:
        f.write(a_frame("torn", 40)[:300])
    follower = FileJournal(str(tmp_path / "j"))
    seen, position = read_on(follower)
    nxt = FileJournal(str(tmp_path / "j"))
    nxt._rotate(1)  # another daemon started the next file and writes there
    nxt.append(records("b", 5))
    # A writer may still be finishing the last frame of the earlier file: wait for it...
    assert seen == ["w0/a0000", "w0/a0001"] and read_on(follower, position)[0] == []
    old = time.time() - 60
    os.utime(tmp_path / FIRST, (old, old))  # ...until the file has not changed for a while
    assert read_on(follower, position)[0] == [f"w0/b{i:04d}" for i in range(5)]
    assert follower.counts()["skipped"] == 1


CUT_SHORT = """
import json, os, resource, signal, sys
from cachexferd.storage.journal import FileJournal, JournalRecord, STORED, object_id
journal = FileJournal(sys.argv[1])
journal.append([JournalRecord(STORED, object_id("w0/first"), "w0/first", b"", 7)])
limit = os.path.getsize(sys.argv[1] + "/000000000000.log") + 100
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
names = [f"w0/cut{i:04d}" for i in range(200)]
try:
    journal.append([JournalRecord(STORED, object_id(n), n, b"", 7) for n in names])
    error = ""
except OSError as exc:
    error = str(exc)
print(json.dumps({"limit": limit, "error": error, "counts": journal.counts()}))
"""


def test_a_write_cut_short_fails_and_readers_skip_its_bytes(tmp_path: Path) -> None:
    """The kernel itself cuts the write short (a file size limit, as a full disk does)."""
    directory = str(tmp_path / "j")
    child = subprocess.run([sys.executable, "-c", CUT_SHORT, directory], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout)
    assert os.path.getsize(tmp_path / FIRST) == got["limit"]  # 100 bytes of the write landed
    assert "cut short (100 of" in got["error"]
    assert got["counts"]["not_written"] == 200 and got["counts"]["written"] == 1
    written = later_writes(tmp_path)
    assert read_on(FileJournal(directory))[0] == ["w0/first", *written]


def a_frame_holding(inner: bytes, before: int, after: int) -> bytes:
    """A whole frame of one record whose tag holds ``inner`` between ``before`` and ``after``
    bytes of padding (a tag is the client's: it may hold anything)."""
    return file_frames(frames([stored_batch(["w0/holder"], [bytes(before) + inner + bytes(after)], 7)]))


def test_a_frames_bytes_inside_a_write_under_way_are_not_taken_for_a_frame(tmp_path: Path) -> None:
    journal = FileJournal(str(tmp_path / "j"))
    journal.append(records("a", 1))
    fake = a_frame("fake", 1)
    holder = a_frame_holding(fake, 100, 2000)
    seen_to = holder.index(fake) + len(fake) + 500  # a reader sees the write this far
    with open(tmp_path / FIRST, "ab") as f:
        f.write(holder[:seen_to])
    follower = FileJournal(str(tmp_path / "j"))
    seen, position = read_on(follower)
    with open(tmp_path / FIRST, "ab") as f:
        f.write(holder[seen_to:])
    assert seen == ["w0/a0000"] and read_on(follower, position)[0] == ["w0/holder"]
    assert follower.counts()["skipped"] == 0


def test_a_frame_that_runs_past_one_read_is_read_whole_whatever_it_holds(tmp_path: Path) -> None:
    """A long backlog is read a few MiB at a time: a frame cut by that bound is not torn, even
    when the bytes before the bound end in a frame's bytes held in its tag."""
    fillers = [file_frames(frames([stored_batch([f"w0/filler{i}"], [bytes(900_000)], 7)])) for i in range(2)]
    fake = a_frame("fake", 1)
    first_read = 2 << 20  # what one read takes (2 MiB: two frames of the most)
    probe = a_frame_holding(fake, 100_000, 1000)  # a tag as long in msgpack's terms (a 4-byte length)
    before = first_read - sum(map(len, fillers)) - (probe.index(fake) - 100_000) - len(fake)
    holder = a_frame_holding(fake, before, 1000)
    assert sum(map(len, fillers)) + holder.index(fake) + len(fake) == first_read  # the fake ends the first read
    (tmp_path / "j").mkdir()
    (tmp_path / FIRST).write_bytes(b"".join(fillers) + holder)
    reader = FileJournal(str(tmp_path / "j"))
    assert read_on(reader)[0] == ["w0/filler0", "w0/filler1", "w0/holder"]
    assert reader.counts()["skipped"] == 0
