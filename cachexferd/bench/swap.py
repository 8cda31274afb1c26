"""``cachexferd bench swap``: swap throughput against a raw contiguous copy of the same bytes.

For every (direction, block size, block count, id pattern, copy method) the benchmark
measures, in the same process and in alternation, the backend's swap of those blocks and
one raw contiguous copy of the same number of bytes (cpu: torch ``copy_`` between two host
tensors using all cores; cuda: one pinned host <-> device copy, warmed before the first
case). Ratios, not absolute numbers, are what compare across the shared, noisy machines
this runs on.

Swaps run on one uvloop event loop for the whole run (the daemon's loop), timed one after
another inside one coroutine, so the figures hold no event-loop start-up. Beside each ratio
(from the best round of each) the *fixed cost*: a round's time minus the raw copy's median
time for the same bytes, in µs, at the median and the 90th percentile of the rounds. With
the cuda backend the backend's own stage times follow (queued -> issued -> done -> settled,
µs, p50). ``--backend cuda-fake`` measures the event loop's CPU per swap instead
(bench/swap_cost.py).

A host block is ``layers x 2`` pieces (one layer's K or V of one block). ``--pieces`` sizes
the blocks by their piece instead of ``--sizes``; ``--preset vllm`` is the set of shapes
vLLM's caches have (pieces of 4, 16 and 32 KiB; 1, 16, 128 and 1024 scattered blocks; each
direction and both at once; every cuda copy method), a single block of 1-2 MiB included.
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
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import parse_size
from ..protocol import KVLayout

DEFAULT_SIZES = "16KiB,64KiB,128KiB,256KiB,1MiB,4MiB"
DEFAULT_COUNTS = "1,16,128,1024"
CUDA_METHODS = ("auto", "dma", "staging", "kernel")
# --preset vllm: what it sets (flags given explicitly still win).
PRESETS = {
    "vllm": {
        "pieces": "4KiB,16KiB,32KiB",
        "counts": "1,16,128,1024",
        "patterns": "scattered",
        "directions": "d2h,h2d,both",
        "layers": 32,
        "methods": ",".join(CUDA_METHODS),
    },
}


@dataclass
class Row:
    direction: str  # d2h, h2d, both
    block_bytes: int
    blocks: int
    pattern: str  # contiguous, scattered
    swap_gbps: float
    raw_gbps: float
    method: str = "-"  # cuda: the cuda.copy_method setting the swap ran with
    piece_bytes: int = 0  # one layer's K or V of one block
    in_flight: int = 1  # swaps of `blocks` blocks each submitted at once (per direction)
    fixed_p50_us: float = 0.0  # a round's time minus the raw copy's median, median round
    fixed_p90_us: float = 0.0  # the same, 90th percentile round
    stages: dict[str, float] = field(default_factory=dict)  # cuda: the backend's stage times, µs p50

    @property
    def ratio(self) -> float:
        return self.swap_gbps / self.raw_gbps if self.raw_gbps else 0.0


def add_swap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "cuda-fake"),
                   help="cuda-fake: the event loop's CPU per swap, fake driver, against a bare loop")  # fmt: skip
    p.add_argument("--preset", choices=sorted(PRESETS), help="a set of shapes (vllm: vLLM's pieces and counts)")
    p.add_argument("--sizes", default=None, help=f"host block sizes, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--pieces", default=None, help="piece sizes instead of --sizes (block = piece x layers x 2)")
    p.add_argument("--counts", default=None, help=f"blocks per swap, comma-separated (default {DEFAULT_COUNTS})")
    p.add_argument("--patterns", default=None, help="contiguous,scattered (default both)")
    p.add_argument("--directions", default=None, help="d2h,h2d,both (default all)")
    p.add_argument("--methods", default=None, help="cuda copy methods to compare: auto,dma,staging,kernel")
    p.add_argument("--layers", type=int, default=None, help="layers (x2 tensors) a host block is split into (32)")
    p.add_argument(
        "--max-bytes", default="512MiB", help="skip cases moving more than this (all swaps in flight together)"
    )
    p.add_argument("--min-time", type=float, default=0.2, help="seconds to repeat each measurement for")
    p.add_argument("--threads", type=int, default=2, help="cpu copy workers per direction")
    p.add_argument(
        "--in-flight", type=int, default=1, metavar="N",
        help="swaps submitted at once per direction, each of --counts blocks (default 1: one at a time)",
    )  # fmt: skip
    p.add_argument("--json", help="write the rows (and machine info) to this file")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def apply_preset(args: argparse.Namespace) -> None:
    """Fills the options left unset from --preset, then from the defaults."""
    defaults: dict[str, Any] = {"counts": DEFAULT_COUNTS, "patterns": "contiguous,scattered",
                                "directions": "d2h,h2d,both", "layers": 32, "methods": "auto"}  # fmt: skip
    preset = PRESETS.get(args.preset or "", {})
    for name, value in {**defaults, **preset}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.sizes is None and args.pieces is None:
        args.sizes = DEFAULT_SIZES


def methods_for(args: argparse.Namespace) -> list[str]:
    if args.backend != "cuda":
        return ["-"]
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(CUDA_METHODS)
    if unknown:
        raise SystemExit(f"--methods: unknown {sorted(unknown)}; choose from {list(CUDA_METHODS)}")
    return methods


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


@dataclass
class Timings:
    """Seconds of each round of the swaps and of the raw copy, measured in alternation."""

    swap: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)

    def fixed_us(self, q: float) -> float:
        return (_quantile(self.swap, q) - statistics.median(self.raw)) * 1e6


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def swap_rounds(round_fn: Callable[[], Awaitable[Any]], seconds: float, times: list[float]) -> None:
    """Rounds of swaps one after another in this coroutine, each timed, for ``seconds``."""
    clock = time.perf_counter
    deadline = clock() + seconds
    while True:
        start = clock()
        await round_fn()
        end = clock()
        times.append(end - start)
        if end > deadline:
            return


def raw_rounds(copy: Callable[[], Any], seconds: float, times: list[float]) -> None:
    clock = time.perf_counter
    deadline = clock() + seconds
    while True:
        start = clock()
        copy()
        end = clock()
        times.append(end - start)
        if end > deadline:
            return


def timed(h: SwapHarness, round_fn: Callable[[], Awaitable[Any]], raw: Callable[[], Any], min_time: float) -> Timings:
    """Swaps and raw copies in four alternating blocks (the machine's noise hits both),
    after one untimed round of each (page faults, compiles, thread starts)."""
    h.run(round_fn())
    raw()
    out = Timings()
    for _ in range(4):
        h.run(swap_rounds(round_fn, min_time / 4, out.swap))
        raw_rounds(raw, min_time / 4, out.raw)
    return out


class SwapHarness:
    """One backend, one host pool, one device cache sized for a (block size, count) case."""

    def __init__(self, args: argparse.Namespace, block_bytes: int, count: int) -> None:
        from . import harness

        self.args = args
        self.in_flight = max(1, args.in_flight)
        blocks = count * self.in_flight  # every swap in flight has blocks of its own
        self.layout = layout_for(block_bytes, args.layers, 2 * blocks)
        self.bytes = block_bytes * blocks
        self.loop = event_loop()
        self.kit = harness.make(args.backend, self.layout, blocks, args.threads)

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.kit.close()


_LOOP: list[asyncio.AbstractEventLoop] = []


def event_loop() -> asyncio.AbstractEventLoop:
    """The run's one uvloop loop (the daemon's kind of loop), made on first use."""
    if not _LOOP:
        import uvloop

        _LOOP.append(uvloop.new_event_loop())
    return _LOOP[0]


def measure_case(
    h: SwapHarness, direction: str, pattern: str, count: int, rng: random.Random, method: str = "-"
) -> tuple[float, float, Timings]:
    """GB/s of the swaps (``h.in_flight`` of ``count`` blocks at once, per direction) and of
    one raw contiguous copy of the same bytes (best rounds), and every round's time."""
    from ..backends.base import CancelToken, Direction

    if method != "-":
        h.kit.set_method(method)
    dev, host = ids_for(pattern, count * h.in_flight, rng)
    token = CancelToken()
    swap = h.kit.device.swap
    swaps = [(dev[i : i + count], host[i : i + count]) for i in range(0, len(dev), count)]
    if direction == "both":
        # Out of the first half of each swap's pairs, into the second half: disjoint blocks.
        half = max(1, count // 2)
        outs = [(d[:half], hs[:half]) for d, hs in swaps]
        ins = [(d[half:] or d, hs[half:] or hs) for d, hs in swaps]
        moved = sum(len(d) for d, _ in outs + ins) * h.layout.host_block_bytes
        work = [(Direction.D2H, pairs) for pairs in outs] + [(Direction.H2D, pairs) for pairs in ins]
    else:
        moved = h.bytes
        d = Direction.D2H if direction == "d2h" else Direction.H2D
        work = [(d, pairs) for pairs in swaps]

    async def one() -> None:
        (d, (ids, hosts)) = work[0]
        await swap(d, ids, hosts, token)

    async def together() -> None:
        await asyncio.gather(*(swap(d, ids, hosts, token) for d, (ids, hosts) in work))

    times = timed(h, one if len(work) == 1 else together, lambda: h.kit.raw_copy(moved, direction), h.args.min_time)
    return moved / min(times.swap) / 1e9, moved / min(times.raw) / 1e9, times


def block_sizes(args: argparse.Namespace) -> list[int]:
    if args.pieces:
        return [parse_size(p) * args.layers * 2 for p in args.pieces.split(",")]
    return [parse_size(s) for s in args.sizes.split(",")]


def cases(args: argparse.Namespace) -> Iterator[tuple[int, int]]:
    limit = parse_size(args.max_bytes)
    for size in block_sizes(args):
        for count in (int(c) for c in args.counts.split(",")):
            if size * count * max(1, args.in_flight) <= limit:
                yield size, count


def run(args: argparse.Namespace) -> int:
    if args.backend == "cuda-fake":
        from .swap_cost import run_cost

        return run_cost(args)
    apply_preset(args)
    rng = random.Random(args.seed)
    methods = methods_for(args)
    rows: list[Row] = []
    print(header(args), flush=True)
    print(
        f"{'dir':5} {'block':>8} {'piece':>7} {'count':>6} {'pattern':11} {'method':8} "
        f"{'swap GB/s':>10} {'raw GB/s':>9} {'ratio':>6} {'fixed us p50/p90':>17}  stages us p50"
    )
    for size, count in cases(args):
        harness = SwapHarness(args, size, count)
        try:
            for direction in args.directions.split(","):
                for pattern in args.patterns.split(","):
                    for method in methods:
                        row = measure_row(harness, direction, pattern, count, rng, method)
                        rows.append(row)
                        print(format_row(row), flush=True)
        finally:
            harness.close()
    print(summary(rows))
    write_rows(args.json, machine(args), [asdict(r) | {"ratio": r.ratio} for r in rows])
    return 0


def write_rows(path: str | None, info: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The ``--json`` file: the machine, then one map per row."""
    if path:
        with open(path, "w") as out:
            json.dump({"machine": info, "rows": rows}, out, indent=1)


def measure_row(h: SwapHarness, direction: str, pattern: str, count: int, rng: random.Random, method: str) -> Row:
    h.kit.reset_stages()
    swap_gbps, raw_gbps, times = measure_case(h, direction, pattern, count, rng, method)
    return Row(
        direction, h.layout.host_block_bytes, count, pattern, swap_gbps, raw_gbps, method, h.layout.chunk_bytes,
        h.in_flight, round(times.fixed_us(0.5), 1), round(times.fixed_us(0.9), 1), h.kit.stages(),
    )  # fmt: skip


def _size(nbytes: int) -> str:
    return f"{nbytes >> 10}KiB" if nbytes < 1 << 20 else f"{nbytes >> 20}MiB"


def format_row(row: Row) -> str:
    stages = " ".join(f"{v:.0f}" for v in row.stages.values())
    fixed = f"{row.fixed_p50_us:.0f}/{row.fixed_p90_us:.0f}"
    return (
        f"{row.direction:5} {_size(row.block_bytes):>8} {_size(row.piece_bytes):>7} {row.blocks:>6} "
        f"{row.pattern:11} {row.method:8} {row.swap_gbps:>10.2f} {row.raw_gbps:>9.2f} {row.ratio:>6.0%} "
        f"{fixed:>17}  {stages}"
    ).rstrip()


def summary(rows: list[Row]) -> str:
    lines = []
    for method in dict.fromkeys(r.method for r in rows):
        big = [r for r in rows if r.method == method and r.direction != "both" and r.blocks >= 16]
        big = [r for r in big if r.block_bytes >= 128 << 10]
        label = "" if method == "-" else f"method {method}: "
        if not big:
            lines.append(f"{label}no rows with blocks >= 128 KiB and >= 16 blocks")
            continue
        ratios = [r.ratio for r in big]
        lines.append(
            f"{label}blocks >= 128 KiB, >= 16 per swap, one direction: ratio to raw min {min(ratios):.0%}, "
            f"median {statistics.median(ratios):.0%}, max {max(ratios):.0%} over {len(big)} cases"
        )
    return "\n".join(lines) or "no rows"


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
        "load_average": list(os.getloadavg()),
        **harness.versions(args.backend),
        "command": " ".join(sys.argv),
    }


def header(args: argparse.Namespace) -> str:
    info = machine(args)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"cachexferd bench swap: backend {info['backend']} on {info['device']} ({info['cpus']} cpus, load {load}); "
        f"host block = {args.layers} layers x 2 tensors; raw = one contiguous copy of the same bytes"
        + (f"; {args.in_flight} swaps in flight per direction" if args.in_flight > 1 else "; one swap at a time")
    )
