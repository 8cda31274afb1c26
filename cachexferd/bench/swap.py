"""``cachexferd bench swap``: swap throughput against a raw contiguous copy of the same bytes.

For every (direction, block size, block count, id pattern) the benchmark measures, in the
same process and back to back, the backend's swap of those blocks and one raw contiguous
copy of the same number of bytes (cpu: torch ``copy_`` between two host tensors using all
cores; cuda: one pinned host <-> device copy). Ratios, not absolute numbers, are what
compare across the shared, noisy machines this runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from ..config import parse_size
from ..protocol import KVLayout

DEFAULT_SIZES = "16KiB,64KiB,128KiB,256KiB,1MiB,4MiB"
DEFAULT_COUNTS = "1,16,128,1024"


@dataclass
class Row:
    direction: str  # d2h, h2d, both
    block_bytes: int
    blocks: int
    pattern: str  # contiguous, scattered
    swap_gbps: float
    raw_gbps: float

    @property
    def ratio(self) -> float:
        return self.swap_gbps / self.raw_gbps if self.raw_gbps else 0.0


def add_swap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="host block sizes, comma-separated")
    p.add_argument("--counts", default=DEFAULT_COUNTS, help="blocks per swap, comma-separated")
    p.add_argument("--patterns", default="contiguous,scattered")
    p.add_argument("--directions", default="d2h,h2d,both")
    p.add_argument("--layers", type=int, default=32, help="layers (x2 tensors) a host block is split into")
    p.add_argument("--max-bytes", default="512MiB", help="skip cases moving more than this per swap")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds to repeat each measurement for")
    p.add_argument("--threads", type=int, default=2, help="cpu copy workers per direction")
    p.add_argument("--json", help="write the rows (and machine info) to this file")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def layout_for(block_bytes: int, layers: int, num_blocks: int) -> KVLayout:
    """A uint8 layout whose host block is exactly block_bytes, split into layers x 2 chunks."""
    tensors = layers * 2
    if block_bytes % tensors:
        raise ValueError(f"block size {block_bytes} is not divisible into {tensors} tensor chunks")
    return KVLayout(
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=1,
        num_kv_heads=1,
        head_dim=block_bytes // tensors,
        dtype="uint8",
    )


def ids_for(pattern: str, count: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(device ids, host ids) over a device cache of 2*count blocks and a host cache of count."""
    if pattern == "contiguous":
        return list(range(count)), list(range(count))
    device = sorted(rng.sample(range(2 * count), count)) if count > 1 else [1]
    host = list(range(count))
    rng.shuffle(host)
    return device, host


def best_times(fns: list[Callable[[], Any]], min_time: float) -> list[float]:
    """Best time of each function, measured in alternation so that the machine's noise
    (other tenants, frequency changes) hits the swap and its baseline alike."""
    for fn in fns:
        fn()  # warm-up: page faults, allocator, thread start
    best = [float("inf")] * len(fns)
    spent = 0.0
    while spent < min_time * len(fns) or float("inf") in best:
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            best[i], spent = min(best[i], took), spent + took
    return best


class SwapHarness:
    """One backend, one host pool, one device cache sized for a (block size, count) case."""

    def __init__(self, args: argparse.Namespace, block_bytes: int, count: int) -> None:
        from . import harness

        self.args = args
        self.layout = layout_for(block_bytes, args.layers, 2 * count)
        self.bytes = block_bytes * count
        self.loop = asyncio.new_event_loop()
        self.kit = harness.make(args.backend, self.layout, count, args.threads)

    def run(self, coro_fn: Callable[[], Awaitable[Any]]) -> None:
        self.loop.run_until_complete(coro_fn())

    def close(self) -> None:
        self.kit.close()
        self.loop.close()


def measure_case(h: SwapHarness, direction: str, pattern: str, count: int, rng: random.Random) -> tuple[float, float]:
    from ..backends.base import CancelToken, Direction

    dev, host = ids_for(pattern, count, rng)
    token = CancelToken()
    swap = h.kit.device.swap
    if direction == "both":
        # Out of the first half of the pairs, into the second half: disjoint blocks.
        half = max(1, count // 2)
        out_pairs, in_pairs = (dev[:half], host[:half]), (dev[half:] or dev, host[half:] or host)
        moved = (half + len(in_pairs[0])) * h.layout.host_block_bytes

        async def work() -> None:
            await asyncio.gather(swap(Direction.D2H, *out_pairs, token), swap(Direction.H2D, *in_pairs, token))
    else:
        moved = h.bytes
        d = Direction.D2H if direction == "d2h" else Direction.H2D

        async def work() -> None:
            await swap(d, dev, host, token)

    swap_s, raw_s = best_times([lambda: h.run(work), lambda: h.kit.raw_copy(moved, direction)], h.args.min_time)
    return moved / swap_s / 1e9, moved / raw_s / 1e9


def cases(args: argparse.Namespace) -> Iterator[tuple[int, int]]:
    limit = parse_size(args.max_bytes)
    for size in (parse_size(s) for s in args.sizes.split(",")):
        for count in (int(c) for c in args.counts.split(",")):
            if size * count <= limit:
                yield size, count


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    rows: list[Row] = []
    print(header(args), flush=True)
    print(f"{'dir':5} {'block':>8} {'count':>6} {'pattern':11} {'swap GB/s':>10} {'raw GB/s':>9} {'ratio':>6}")
    for size, count in cases(args):
        harness = SwapHarness(args, size, count)
        try:
            for direction in args.directions.split(","):
                for pattern in args.patterns.split(","):
                    swap_gbps, raw_gbps = measure_case(harness, direction, pattern, count, rng)
                    row = Row(direction, size, count, pattern, swap_gbps, raw_gbps)
                    rows.append(row)
                    print(format_row(row), flush=True)
        finally:
            harness.close()
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine(args), "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}, out, indent=1)
    return 0


def format_row(row: Row) -> str:
    size = f"{row.block_bytes >> 10}KiB" if row.block_bytes < 1 << 20 else f"{row.block_bytes >> 20}MiB"
    return (
        f"{row.direction:5} {size:>8} {row.blocks:>6} {row.pattern:11} "
        f"{row.swap_gbps:>10.2f} {row.raw_gbps:>9.2f} {row.ratio:>6.0%}"
    )


def summary(rows: list[Row]) -> str:
    big = [r for r in rows if r.block_bytes >= 128 << 10 and r.direction != "both" and r.blocks >= 16]
    if not big:
        return "no rows with blocks >= 128 KiB and >= 16 blocks"
    ratios = [r.ratio for r in big]
    return (
        f"blocks >= 128 KiB, >= 16 per swap, one direction: ratio to raw min {min(ratios):.0%}, "
        f"median {statistics.median(ratios):.0%}, max {max(ratios):.0%} over {len(big)} cases"
    )


def machine(args: argparse.Namespace) -> dict[str, Any]:
    from . import harness

    return {
        "backend": args.backend,
        "device": harness.device_name(args.backend),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "layers": args.layers,
        "threads": args.threads,
        "command": " ".join(sys.argv),
    }


def header(args: argparse.Namespace) -> str:
    info = machine(args)
    return (
        f"cachexferd bench swap: backend {info['backend']} on {info['device']} ({info['cpus']} cpus); "
        f"host block = {args.layers} layers x 2 tensors; raw = one contiguous copy of the same bytes"
    )
