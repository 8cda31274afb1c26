"""Failed transfers reported as one log line per burst, with counts.

A daemon fault fails every transfer in flight and, until the plug-in has noticed, every new
one: hundreds in a second. One warning each would bury the engine's log, and one per interval
would still say nothing about how many. A burst is a run of failures less than ``gap_s``
apart; its line is written when it ends (or every ``span_s`` while it lasts)::

    cachexferd: 41 transfers failed over 0.8s (load: 29, store: 12; errors: DAEMON_LOST;
    the engine recomputed or skipped them); first: load job 7 failed (daemon at ... exited)

``errors`` names every daemon error code the burst's failures carried, so a burst of
different causes shows them all, not only its first.
"""

from __future__ import annotations

import re
import time
from collections import Counter

from ...protocol import ErrorCode
from .logs import log

_ERROR_NAMES = re.compile(r"\b(" + "|".join(sorted(ErrorCode.__members__, key=len, reverse=True)) + r")\b")


class FailureLog:
    def __init__(self, gap_s: float = 2.0, span_s: float = 30.0) -> None:
        self.gap_s = gap_s
        self.span_s = span_s
        self.lines = 0  # lines written so far
        self._counts: Counter[str] = Counter()
        self._errors: set[str] = set()  # daemon error codes named by the burst's failures
        self._first = ""
        self._started = 0.0
        self._last = 0.0

    def note(self, kind: str, why: str) -> None:
        """One failed transfer of ``kind`` (load, store, storage write)."""
        now = time.monotonic()
        if not self._counts:
            self._started, self._first = now, f"{kind}: {why}"
        self._counts[kind] += 1
        self._errors.update(_ERROR_NAMES.findall(why))
        self._last = now

    def flush(self, force: bool = False) -> None:
        """Writes the burst's line once it is over (``force``: now, e.g. at shutdown)."""
        if not self._counts:
            return
        now = time.monotonic()
        if not force and now - self._last < self.gap_s and now - self._started < self.span_s:
            return
        total = sum(self._counts.values())
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(self._counts.items()))
        if self._errors:
            kinds += f"; errors: {', '.join(sorted(self._errors))}"
        log.warning("cachexferd: %d transfer(s) failed over %.1fs (%s; the engine recomputed or skipped them); "
                    "first: %s", total, self._last - self._started, kinds, self._first)  # fmt: skip
        self.lines += 1
        self._counts.clear()
        self._errors.clear()
