"""Free block ids of one tier.

A LIFO stack in a plain list: taking or returning ``n`` ids is one slice or one ``extend``
(C loops, no per-id Python work), so recycling everything an eviction loop freed in one
batch after the loop costs about as much as a single id does. ``debug=True`` also keeps a
byte per id and refuses a free of an id that is not allocated (a double free).
"""

from __future__ import annotations

from collections.abc import Iterable

from .types import DoubleFreeError


class FreeList:
    __slots__ = ("_free", "_used", "capacity")

    def __init__(self, capacity: int, *, debug: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first
        self._used: bytearray | None = bytearray(capacity) if debug else None

    def __len__(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def take(self, n: int) -> list[int] | None:
        """``n`` free ids, or None (and nothing taken) when fewer are free."""
        free = self._free
        if n > len(free):
            return None
        if n <= 0:
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        if self._used is not None:
            self._mark(ids, 1)
        return ids

    def take_one(self) -> int:
        """One free id; -1 when none is free."""
        if not self._free:
            return -1
        block = self._free.pop()
        if self._used is not None:
            self._mark((block,), 1)
        return block

    def take_these(self, ids: Iterable[int]) -> list[int]:
        """Those of ``ids`` that are free now, taken (one pass over the free list)."""
        wanted = set(ids)
        taken = [b for b in self._free if b in wanted]
        if taken:
            self._free = [b for b in self._free if b not in wanted]
            if self._used is not None:
                self._mark(taken, 1)
        return taken

    def release(self, ids: list[int]) -> None:
        """Returns allocated ids (one batch)."""
        if self._used is not None:
            self._mark(ids, 0)
        self._free.extend(ids)

    def is_free(self, block: int) -> bool:
        """Debug mode only: whether ``block`` is free now."""
        if self._used is None:
            raise RuntimeError("is_free needs debug=True")
        return not self._used[block]

    def free_ids(self) -> list[int]:
        return list(self._free)

    def _mark(self, ids: Iterable[int], state: int) -> None:
        used = self._used
        assert used is not None
        for block in ids:
            if not 0 <= block < self.capacity:
                raise DoubleFreeError(f"block id {block} is outside [0, {self.capacity})")
            if used[block] == state:
                what = "freed twice" if state == 0 else "allocated twice"
                raise DoubleFreeError(f"block {block} {what}")
            used[block] = state
