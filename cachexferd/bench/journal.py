"""``cachexferd bench journal``: CPU per stored object of the storage journal.

Two daemons share one directory (tmpfs by default): the writer makes each STORE's records and
hands them to the journal as a STORE's I/O thread does: written by that thread at once when
the journal is idle, else queued for the journal's thread (STOREs that finish within
``LINGER_S`` of each other share a write), and its follower reads them back into its view;
the other daemon's follower reads them, indexes the objects for its eviction (``learn``) and
updates its view. Both run here, in one process, on real files, timed in CPU time per record
(every thread of the process). STOREs come back to back or paced (``--pace-us`` between
them: fewer share a write); the pacing's own CPU, measured alone in the same round, is
taken off. The baseline, in the same run, alternating with it and paced the same way, is the
cheapest append-only log of the same bytes: one ``os.write`` of the same frames per STORE on
a file opened per append, read back with one ``read``. (Paced, both cost more per call than
back to back on a machine whose CPU idles between them: compare a paced row with its own
baseline.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..daemon.server import tune_gc
from ..daemon.storage_feed import StorageFeed
from ..storage.file import FileBackend, object_path
from ..storage.journal import FileJournal, file_frames, frames, stored_batch
from .journal_live import OBJECT_BYTES, TAG, live_rows, print_rows


def add_journal_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-store", default="1,16,64,256", help="comma-separated: objects per STORE")
    p.add_argument("--objects", type=int, default=20_000, help="objects stored per measurement")
    p.add_argument("--pace-us", default="0,200,2000", help="comma-separated: µs between STOREs (0: back to back)")
    p.add_argument("--pace-s", type=float, default=1.0, help="most seconds one paced measurement lasts")
    p.add_argument("--rounds", type=int, default=5, help="measurements per row (median and best reported)")
    p.add_argument("--live-ms", default="20,200",
                   help="comma-separated: ms between one-object STOREs that another daemon follows as they come "
                        "('': skip those rows)")  # fmt: skip
    p.add_argument("--live-records", type=int, default=20, help="STOREs per live measurement")
    p.add_argument("--path", help="directory for the journal (default: a temp dir in /dev/shm)")
    p.add_argument("--json", help="write the rows to this file")
    p.set_defaults(func=run)


def names_for(count: int, label: str) -> list[str]:
    """Names of new objects (``label`` tells the measurement and its round apart)."""
    return [f"w0/vllm:bench:ranks1:g0:{label}:{i:032x}" for i in range(count)]


class Daemons:
    """The two daemons' journal objects, feeds and eviction indexes, kept from round to round
    (a daemon's index holds what it learned before)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.journal = FileJournal(str(root / ".journal"))
        self.writer = StorageFeed(self.journal, "", FileBackend(root).learn)
        self.follower = StorageFeed(FileJournal(str(root / ".journal")), "", FileBackend(root).learn)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="bench-io")  # one: records stay in order


def journal_cpu(
    daemons: Daemons, names: list[str], per_store: int, pace_s: float, grouped: bool
) -> tuple[float, float]:
    """(writer, follower) CPU seconds for ``names`` stored in STOREs of ``per_store``, one
    every ``pace_s`` (0: back to back). The writer makes each STORE's records and hands them
    to the journal, as a daemon's STORE does on its I/O thread (the objects' digests are those
    the STORE computed to place them), then reads them back into its view, as a daemon's
    follower does; the follower reads them, indexes the objects for its eviction and updates its view.
    Not ``grouped``: each STORE's records are written on an I/O thread by a write of their
    own (the journal's write, handed to a thread per STORE), the baseline for grouping."""
    journal, writer, follower = daemons.journal, daemons.writer, daemons.follower
    for name in names:  # a STORE has placed its objects (their digests) before it records them
        object_path(str(daemons.root), name)
    start = time.process_time()
    for i, at in zip(range(0, len(names), per_store), _pace(pace_s)):
        part = names[i : i + per_store]
        if grouped:
            written = journal.store(part, [TAG] * len(part), OBJECT_BYTES, here=True)
        else:
            written = daemons.io.submit(journal._write, [stored_batch(part, [TAG] * len(part), OBJECT_BYTES)])
        at()
    journal.flush()
    written.result()
    while writer.catch_up():  # its follower thread, every 0.1 s
        pass
    middle = time.process_time()
    while follower.catch_up():
        pass
    end = time.process_time()
    return middle - start, end - middle


def _pace(pace_s: float) -> Iterator[Callable[[], None]]:
    """For each STORE, what waits for the next one's time (deadlines, so the rate holds)."""
    if pace_s <= 0:
        yield from itertools.repeat(_nothing)
    nxt = time.monotonic()

    def wait() -> None:
        nonlocal nxt
        nxt += pace_s
        ahead = nxt - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)

    yield from itertools.repeat(wait)


def _nothing() -> None:
    pass


def pace_cpu(stores: int, pace_s: float) -> float:
    """CPU seconds of the pacing alone (taken off the journal's figure)."""
    start = time.process_time()
    for _, at in zip(range(stores), _pace(pace_s)):
        at()
    return time.process_time() - start


def raw_cpu(root: Path, names: list[str], per_store: int, pace_s: float) -> float:
    """CPU seconds of the same bytes through one ``os.write`` per STORE and one read back,
    one STORE every ``pace_s`` (0: back to back)."""
    stores = [stored_batch(names[i : i + per_store], [TAG] * per_store, OBJECT_BYTES)
              for i in range(0, len(names), per_store)]  # fmt: skip
    path = str(root / "raw.log")
    start = time.process_time()
    for batch, at in zip(stores, _pace(pace_s)):
        data = file_frames(frames([batch]))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        os.write(fd, data)
        os.close(fd)
        with open(path, "rb") as f:
            f.seek(-len(data), os.SEEK_END)
            f.read(len(data))
        at()
    return time.process_time() - start


def measure(
    root: Path, pairs: dict[bool, Daemons], per_store: int, pace_us: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One row. ``pairs``: the daemons of grouped writes (True) and of a write each (False),
    on journals of their own, so that neither's indexes grow with the other's objects."""
    stores = args.objects // per_store
    if pace_us:  # a paced measurement lasts at most --pace-s
        stores = min(stores, max(20, int(args.pace_s * 1e6 / pace_us)))
    objects, pace_s = stores * per_store, pace_us / 1e6
    writer: list[float] = []
    alone: list[float] = []
    follower: list[float] = []
    raw: list[float] = []
    grouped_submits = grouped_writes = 0
    for r in range(args.rounds + 1):
        names = names_for(objects, f"s{per_store}p{pace_us}r{r}")
        kinds = ["grouped", "alone", "raw"]
        for kind in kinds[r % 3 :] + kinds[: r % 3]:  # who goes first rotates
            if kind == "raw":
                spent = raw_cpu(root, names, per_store, pace_s) - (pace_cpu(stores, pace_s) if pace_us else 0.0)
                if r:  # round 0 warms up
                    raw.append(spent / objects * 1e6)
                continue
            grouped = kind == "grouped"
            daemons = pairs[grouped]
            submitted, wrote = daemons.journal.submits, daemons.journal.writes
            ours = names if grouped else names_for(objects, f"s{per_store}p{pace_us}r{r}a")
            spent, read = journal_cpu(daemons, ours, per_store, pace_s, grouped)
            spent -= pace_cpu(stores, pace_s) if pace_us else 0.0
            if grouped:
                grouped_submits += daemons.journal.submits - submitted
                grouped_writes += daemons.journal.writes - wrote
            if r:
                (writer if grouped else alone).append(spent / objects * 1e6)
                if grouped:
                    follower.append(read / objects * 1e6)
    med = statistics.median
    return {"per_store": per_store, "pace_us": pace_us, "stores_per_write": grouped_submits / max(1, grouped_writes),
            "objects": objects, "writer_us": med(writer), "writer_alone_us": med(alone), "follower_us": med(follower),
            "raw_us": med(raw), "writer_best_us": min(writer), "writer_alone_best_us": min(alone),
            "follower_best_us": min(follower), "raw_best_us": min(raw)}  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def run(args: argparse.Namespace) -> int:
    root = Path(args.path or tempfile.mkdtemp(prefix="cx-bench-journal-", dir="/dev/shm"))
    rows = []
    live: list[dict[str, Any]] = []
    tune_gc()  # the daemon's garbage collector settings: its cost per object is part of the figure
    pairs = {True: Daemons(root / "grouped"), False: Daemons(root / "each")}
    try:
        print("CPU per stored object, median [best], µs; writer: grouped writes, or a write per STORE on an I/O thread")
        print("objects/STORE  pace µs  STOREs/write  writer          a write each    follower        raw log")
        for per_store, pace_us in itertools.product(_ints(args.per_store), _ints(args.pace_us)):
            row = measure(root, pairs, per_store, pace_us, args)
            rows.append(row)
            print(f"{per_store:>13}  {pace_us:>7}  {row['stores_per_write']:>12.1f}  "
                  f"{row['writer_us']:>6.2f} [{row['writer_best_us']:>6.2f}]  "
                  f"{row['writer_alone_us']:>6.2f} [{row['writer_alone_best_us']:>6.2f}]  "
                  f"{row['follower_us']:>6.2f} [{row['follower_best_us']:>6.2f}]  "
                  f"{row['raw_us']:>6.2f} [{row['raw_best_us']:>6.2f}]", flush=True)  # fmt: skip
        if args.live_ms:
            live = live_rows(root, [float(x) for x in args.live_ms.split(",")], args.live_records, min(args.rounds, 3))
            print_rows(live)
    finally:
        if not args.path:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "live": live, "load_average": os.getloadavg()}, indent=1))
    return 0
