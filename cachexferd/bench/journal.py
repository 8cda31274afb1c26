"""``cachexferd bench journal``: CPU per stored object of the storage journal.

Two daemons share one directory (tmpfs by default): the writer makes each STORE's records,
appends them and its follower reads them back into its view; the other daemon's follower
reads them, indexes the objects for its eviction (``learn``) and updates its view. Both run here, in
one process, on real files, timed in CPU time per record. The baseline, in the same run and
alternating with it, is the cheapest append-only log of the same bytes: one ``os.write`` of
the same frames on a file opened per append, read back with one ``read``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..daemon.server import tune_gc
from ..daemon.storage_feed import StorageFeed
from ..storage.file import FileBackend, object_path
from ..storage.journal import FileJournal, frames, stored_records

_TAG = bytes(36)  # a vLLM offload key: 32-byte block hash + 4-byte group
_OBJECT_BYTES = (1 << 20) + 64


def add_journal_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-store", default="1,16,64,256", help="comma-separated: objects per STORE")
    p.add_argument("--objects", type=int, default=20_000, help="objects stored per measurement")
    p.add_argument("--rounds", type=int, default=5, help="measurements per row (median and best reported)")
    p.add_argument("--path", help="directory for the journal (default: a temp dir in /dev/shm)")
    p.add_argument("--json", help="write the rows to this file")
    p.set_defaults(func=run)


def names_for(count: int, per_store: int, round_no: int) -> list[str]:
    return [f"w0/vllm:bench:ranks1:g0:s{per_store}r{round_no}:{i:032x}" for i in range(count)]


class Daemons:
    """The two daemons' journal objects, feeds and eviction indexes, kept from round to round
    (a daemon's index holds what it learned before)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.journal = FileJournal(str(root / ".journal"))
        self.writer = StorageFeed(self.journal, "", FileBackend(root).learn)
        self.follower = StorageFeed(FileJournal(str(root / ".journal")), "", FileBackend(root).learn)


def journal_cpu(daemons: Daemons, names: list[str], per_store: int) -> tuple[float, float]:
    """(writer, follower) CPU seconds for ``names`` stored in STOREs of ``per_store``. The
    writer makes each STORE's records, appends them and reads them back into its view, as a
    daemon's STORE and follower do (the objects' digests are those the STORE computed to
    place them); the follower reads them, indexes the objects for its eviction and updates
    its view."""
    journal, writer, follower = daemons.journal, daemons.writer, daemons.follower
    for name in names:  # a STORE has placed its objects (their digests) before it records them
        object_path(str(daemons.root), name)
    start = time.process_time()
    for i in range(0, len(names), per_store):
        part = names[i : i + per_store]
        journal.append(stored_records(part, [_TAG] * len(part), _OBJECT_BYTES))
    while writer.catch_up():  # its follower thread, every 0.1 s
        pass
    middle = time.process_time()
    while follower.catch_up():
        pass
    end = time.process_time()
    return middle - start, end - middle


def raw_cpu(root: Path, names: list[str], per_store: int) -> float:
    """CPU seconds of the same bytes through one ``os.write`` per STORE and one read back."""
    records = stored_records(names, [_TAG] * len(names), _OBJECT_BYTES)
    path = str(root / "raw.log")
    start = time.process_time()
    for i in range(0, len(records), per_store):
        data = b"".join(len(f).to_bytes(4, "little") + f for f in frames(records[i : i + per_store]))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        os.write(fd, data)
        os.close(fd)
        with open(path, "rb") as f:
            f.seek(-len(data), os.SEEK_END)
            f.read(len(data))
    return time.process_time() - start


def measure(root: Path, daemons: Daemons, per_store: int, objects: int, rounds: int) -> dict[str, Any]:
    writer, follower, raw = [], [], []
    for r in range(rounds + 1):
        names = names_for(objects, per_store, r)
        kinds = ["journal", "raw"] if r % 2 == 0 else ["raw", "journal"]  # alternate who goes first
        for kind in kinds:
            got = journal_cpu(daemons, names, per_store) if kind == "journal" else raw_cpu(root, names, per_store)
            if r == 0:
                continue  # warm-up round
            if kind == "journal":
                assert isinstance(got, tuple)
                writer.append(got[0] / objects * 1e6)
                follower.append(got[1] / objects * 1e6)
            else:
                assert isinstance(got, float)
                raw.append(got / objects * 1e6)
    med = statistics.median
    return {"per_store": per_store, "objects": objects, "writer_us": med(writer), "follower_us": med(follower),
            "raw_us": med(raw), "writer_best_us": min(writer), "follower_best_us": min(follower),
            "raw_best_us": min(raw)}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    root = Path(args.path or tempfile.mkdtemp(prefix="cx-bench-journal-", dir="/dev/shm"))
    rows = []
    tune_gc()  # the daemon's garbage collector settings: its cost per object is part of the figure
    daemons = Daemons(root)
    try:
        print("CPU per stored object, median [best], µs")
        print("objects/STORE  writer          follower        both    raw log")
        for per_store in (int(x) for x in args.per_store.split(",")):
            row = measure(root, daemons, per_store, args.objects, args.rounds)
            rows.append(row)
            both = row["writer_us"] + row["follower_us"]
            print(f"{per_store:>13}  {row['writer_us']:>6.2f} [{row['writer_best_us']:>6.2f}]  "
                  f"{row['follower_us']:>6.2f} [{row['follower_best_us']:>6.2f}]  {both:>6.2f}  "
                  f"{row['raw_us']:>6.2f} [{row['raw_best_us']:>6.2f}]", flush=True)  # fmt: skip
    finally:
        if not args.path:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load_average": os.getloadavg()}, indent=1))
    return 0
