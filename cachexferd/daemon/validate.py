"""The one home of id and key validation for every command (swap, store, load).

The wire decoder (protocol/fields.py) has already checked types and list sizes; these
checks need the daemon's state: how many device and host blocks there are, and which side
of a pairing is the destination. Each raises the documented error code.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import TypeVar

from ..protocol import ErrorCode, ProtocolError

H = TypeVar("H", bound=Hashable)


def ids_in_range(ids: Sequence[int], limit: int, name: str) -> None:
    """ID_OUT_OF_RANGE unless every id is in [0, limit)."""
    if ids and (min(ids) < 0 or max(ids) >= limit):
        bad = next(i for i in ids if not 0 <= i < limit)
        raise ProtocolError(ErrorCode.ID_OUT_OF_RANGE, f"{name} holds {bad}, outside [0, {limit})")


def same_length(first: Sequence[object], second: Sequence[object], names: tuple[str, str]) -> None:
    if len(first) != len(second):
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"{names[0]} has {len(first)} entries, {names[1]} {len(second)}")


def first_duplicate(values: Sequence[H]) -> H | None:
    if len(set(values)) == len(values):
        return None
    seen: set[H] = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None  # unreachable


def unique_blocks(ids: Sequence[int], side: str) -> None:
    """DUPLICATE_ID when a destination block id appears twice (``side``: device or host)."""
    dup = first_duplicate(ids)
    if dup is not None:
        raise ProtocolError(ErrorCode.DUPLICATE_ID, f"destination {side} block {dup} appears more than once")


def unique_keys(keys: Sequence[str]) -> None:
    dup = first_duplicate(keys)
    if dup is not None:
        raise ProtocolError(ErrorCode.DUPLICATE_ID, f"key {dup!r} appears more than once (each key is one object)")


def swap_pairs(device_ids: Sequence[int], host_ids: Sequence[int], device_blocks: int, host_blocks: int,
               dest: str) -> None:  # fmt: skip
    """A swap's lists: equal lengths, ids in range, destination ids unique (dest: device or host)."""
    if (
        len(device_ids) == 1
        and len(host_ids) == 1
        and 0 <= device_ids[0] < device_blocks
        and 0 <= host_ids[0] < host_blocks
    ):
        return  # the common single-block command: valid, nothing more to check
    same_length(device_ids, host_ids, ("device_ids", "host_ids"))
    ids_in_range(device_ids, device_blocks, "device_ids")
    ids_in_range(host_ids, host_blocks, "host_ids")
    unique_blocks(device_ids if dest == "device" else host_ids, dest)


def require_in_time(not_after: float | None) -> None:
    """EXPIRED when a copy is read after its ``not_after`` time (protocol 1.2, wall clock).

    Its sender has given up on it (it waited for a daemon that was stopped or starved):
    copying now could land in blocks the engine has reused since."""
    if not_after is not None:
        late = time.time() - not_after
        if late > 0:
            raise ProtocolError(ErrorCode.EXPIRED, f"read {late:.3f}s after its not_after time")
