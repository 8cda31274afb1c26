"""``cachexferd bench journal --live-ms``: what following the journal costs another daemon
when STOREs come one at a time.

A STORE that comes alone is a journal write of its own, and every other daemon on the store
wakes to read it: the cost per record is then that wake-up and read, not the decoding the
back-to-back rows measure. Here a writer appends one-object STOREs (as a daemon's I/O thread
does) every ``pace`` ms into a file journal on tmpfs while another daemon's follower thread
(its real ``StorageFeed``, with its eviction index) reads them as they come; its thread's CPU
time per record, wake-ups included, is the figure. The baseline, alternating with it, is the
cheapest live follower of the same appends: a thread that waits on the same inotify watch and
reads each append's bytes with one ``pread`` (the writer makes one ``os.write`` of the same
framed bytes per record).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..daemon.storage_feed import POLL_S, StorageFeed
from ..storage.file import FileBackend
from ..storage.journal import FileJournal, file_frames, frames, stored_batch
from ..storage.journal_watch import LOCAL_POLL_S, watch_directory

TAG = bytes(36)  # a vLLM offload key: 32-byte block hash + 4-byte group
OBJECT_BYTES = (1 << 20) + 64  # a block of 1 MiB with its object header
_DRAIN_S = 5.0  # the longest a follower may take to read the last record


def live_rows(root: Path, paces_ms: list[float], records: int, rounds: int) -> list[dict[str, Any]]:
    """One row per pace: the follower's and the baseline's CPU µs per record (median, best)."""
    rows = []
    for pace_ms in paces_ms:
        follower: list[float] = []
        bare: list[float] = []
        for r in range(rounds):
            where = root / f"live-{pace_ms:g}-{r}"
            kinds = [("follower", follower), ("bare", bare)]
            for kind, out in kinds[r % 2 :] + kinds[: r % 2]:  # who goes first alternates
                measure = follower_cpu if kind == "follower" else bare_cpu
                out.append(measure(where / kind, pace_ms / 1e3, records) / records * 1e6)
        med = statistics.median
        rows.append({"pace_ms": pace_ms, "records": records, "follower_us": med(follower),
                     "follower_best_us": min(follower), "bare_us": med(bare), "bare_best_us": min(bare)})  # fmt: skip
    return rows


def follower_cpu(root: Path, pace_s: float, records: int) -> float:
    """CPU seconds of another daemon's follower thread while ``records`` one-object STOREs
    are journaled, one every ``pace_s``."""
    journal = FileJournal(str(root / ".journal"))
    journal.store(["w0/live:first"], [TAG], OBJECT_BYTES, now=True).result()  # the directory exists
    feed = StorageFeed(FileJournal(str(root / ".journal")), "", FileBackend(root).learn)
    feed.start()
    try:
        _until(lambda: feed.records >= 1, "the follower to read the first record")
        time.sleep(0.2)  # it waits on its watch now
        start = feed.read_cpu_s
        for i in range(records):
            journal.store([f"w0/live:{i:032x}"], [TAG], OBJECT_BYTES, here=True, now=True)
            time.sleep(pace_s)
        _until(lambda: feed.records >= records + 1, "the follower to read every record")
        return feed.read_cpu_s - start
    finally:
        feed.close()
        journal.close()


def bare_cpu(root: Path, pace_s: float, records: int) -> float:
    """CPU seconds of the cheapest live follower of the same appends."""
    root.mkdir(parents=True)
    path = str(root / "raw.log")
    data = [file_frames(frames([stored_batch([f"w0/live:{i:032x}"], [TAG], OBJECT_BYTES)])) for i in range(records)]
    follower = _BareFollower(str(root), path, sum(map(len, data)))
    try:
        for chunk in data:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            os.write(fd, chunk)
            os.close(fd)
            time.sleep(pace_s)
        return follower.finish()
    finally:
        follower.stop()


class _BareFollower:
    """A thread that waits for appends to ``path`` and reads each one's bytes."""

    def __init__(self, directory: str, path: str, total: int) -> None:
        self.path, self.total = path, total
        self._watch = watch_directory(directory, LOCAL_POLL_S)  # None: no inotify here, poll as a daemon would
        self._position = 0
        self._cpu = 0.0
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="bench-bare-follower", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        started = time.thread_time()
        while self._position < self.total and not self._stopping.is_set():
            if self._watch is not None:
                self._watch.wait()
            else:
                self._stopping.wait(POLL_S)
            try:
                size = os.stat(self.path).st_size
            except FileNotFoundError:
                continue
            if size > self._position:
                fd = os.open(self.path, os.O_RDONLY)
                os.pread(fd, size - self._position, self._position)
                os.close(fd)
                self._position = size
        self._cpu = time.thread_time() - started
        self._done.set()

    def finish(self) -> float:
        if not self._done.wait(_DRAIN_S):
            raise RuntimeError("bench journal: the bare follower did not read every append")
        return self._cpu

    def stop(self) -> None:
        self._stopping.set()
        if self._watch is not None:
            self._watch.wake()
        self._thread.join(timeout=2.0)
        if self._watch is not None:
            self._watch.close()


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _DRAIN_S
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench journal: timed out waiting for {what}")
        time.sleep(0.005)


def print_rows(rows: list[dict[str, Any]]) -> None:
    print("another daemon following one-object STOREs as they come: CPU per record (its thread, wake-ups included), "
          "median [best], µs")  # fmt: skip
    print("pace ms  records  follower           bare follower")
    for row in rows:
        print(f"{row['pace_ms']:>7g}  {row['records']:>7}  {row['follower_us']:>8.1f} [{row['follower_best_us']:>7.1f}]"
              f"  {row['bare_us']:>8.1f} [{row['bare_best_us']:>7.1f}]", flush=True)  # fmt: skip
