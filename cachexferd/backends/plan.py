"""Copy planning shared by every backend: coalescing ids into runs and sharding runs.

Pure Python (no torch) so it is cheap to import and easy to test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """``length`` consecutive device blocks from ``device`` paired with consecutive host blocks from ``host``."""

    device: int
    host: int
    length: int


def coalesce(device_ids: Sequence[int], host_ids: Sequence[int]) -> list[Run]:
    """Pairs ids into maximal runs where both sides advance by one, keeping the given order."""
    runs: list[Run] = []
    if not device_ids:
        return runs
    start_d, start_h, length = device_ids[0], host_ids[0], 1
    for d, h in zip(device_ids[1:], host_ids[1:]):
        if d == start_d + length and h == start_h + length:
            length += 1
            continue
        runs.append(Run(start_d, start_h, length))
        start_d, start_h, length = d, h, 1
    runs.append(Run(start_d, start_h, length))
    return runs


def shard(runs: Sequence[Run], parts: int) -> list[list[Run]]:
    """Splits runs into at most ``parts`` lists of nearly equal block counts.

    Long runs are cut so one huge run still spreads over all workers. Shards never share
    a block, so they can run on different threads without coordination.
    """
    return [[run for _, piece in part for run in piece] for part in shard_tagged([(0, runs)], parts)]


def shard_tagged(jobs: Sequence[tuple[int, Sequence[Run]]], parts: int) -> list[list[tuple[int, list[Run]]]]:
    """``shard`` for the runs of several commands at once, keeping each run's command tag:
    at most ``parts`` lists of (tag, runs) with nearly equal block counts, in order."""
    total = sum(run.length for _, runs in jobs for run in runs)
    if total == 0:
        return []
    target = -(-total // max(1, min(parts, total)))  # ceil
    shards: list[list[tuple[int, list[Run]]]] = [[]]
    room = target
    for tag, runs in jobs:
        piece: list[Run] = []
        shards[-1].append((tag, piece))
        for run in runs:
            d, h, left = run.device, run.host, run.length
            while left:
                if room == 0:
                    shards.append([])
                    piece = []
                    shards[-1].append((tag, piece))
                    room = target
                take = min(left, room)
                piece.append(Run(d, h, take))
                d, h, left, room = d + take, h + take, left - take, room - take
    return [[(tag, piece) for tag, piece in part if piece] for part in shards if any(p for _, p in part)]


def even_groups(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index, count, stride) for maximal runs of evenly spaced, increasing values:
    tensors at such offsets (or addresses) can be moved as one strided view."""
    groups: list[tuple[int, int, int]] = []
    i = 0
    while i < len(values):
        count, stride = 1, 0
        if i + 1 < len(values) and values[i + 1] > values[i]:
            stride = values[i + 1] - values[i]
            while i + count < len(values) and values[i + count] - values[i + count - 1] == stride:
                count += 1
        groups.append((i, count, stride))
        i += count
    return groups
