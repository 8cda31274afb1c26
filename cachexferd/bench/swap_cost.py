"""``cachexferd bench swap --backend cuda-fake``: the event loop's CPU per swap on the cuda
backend's copy path, without a GPU.

The cuda backend's real device cache runs over the fake driver in its inline mode: every
driver call returns at once and the "device" finishes at once (nothing is copied), so what
is measured is what the loop thread spends to issue a unit and to settle it, plus the
await of its result. Beside it, in alternation and in the same run, a *bare loop* does the
least an awaited completion costs: a future resolved by a callback in the next loop
iteration. "net" is the difference: the copy path's own CPU per unit. The fake driver's
calls are Python too; their share is measured on their own and shown beside ("fake").

Figures are per unit: a swap of ``--counts`` blocks is one unit unless it is larger than a
unit (16 MiB), and then it is several ("units"). ``--in-flight N`` awaits N swaps at once
per round (gathered), as a daemon does with the swaps of a loop turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..config import parse_size

TARGET_US = 8.0  # net loop CPU per unit at 16 blocks, on a 2-core VM


@dataclass
class CostRow:
    direction: str
    piece_bytes: int
    blocks: int
    in_flight: int
    units: float  # units per swap (a swap above the unit size is split)
    cpu_us: float  # loop-thread CPU per unit, copy path
    bare_us: float  # loop-thread CPU of the bare loop, per awaited completion
    fake_us: float  # of cpu_us: the fake driver's own calls
    wall_us: float  # wall time per unit, copy path
    polls: float  # doorbell reads per unit

    @property
    def net_us(self) -> float:
        return self.cpu_us - self.bare_us


class FakeRig:
    """CPU tensors, a host pool and the cuda device cache over an inline fake driver."""

    def __init__(self, piece: int, layers: int, blocks: int) -> None:
        import torch

        from ..backends.cuda.device_cache import CopySettings, CudaDeviceCache
        from ..backends.cuda.fake import FakeDriver
        from ..host_cache import HostPool
        from .swap import layout_for

        self.layout = layout_for(piece * layers * 2, layers, blocks)
        hb = self.layout.host_block_bytes
        self.tensors = [torch.zeros(self.layout.tensor_bytes, dtype=torch.uint8) for _ in range(layers * 2)]
        self.pool = HostPool(max(4096, blocks * hb))
        self.driver = FakeDriver(inline=True, move_bytes=False)
        addrs = [t.data_ptr() for t in self.tensors]
        self.cache = CudaDeviceCache(self.driver, self.layout, addrs, self.pool, self.pool.geometry(hb), CopySettings())

    def close(self) -> None:
        self.cache.close()


async def _cpu_per_round(round_fn: Callable[[], Awaitable[Any]], seconds: float) -> tuple[int, int, int]:
    """(rounds, loop-thread CPU ns, wall ns) of rounds run back to back for ``seconds``."""
    rounds, wall0, cpu0 = 0, time.perf_counter_ns(), time.thread_time_ns()
    deadline = wall0 + int(seconds * 1e9)
    while True:
        await round_fn()
        rounds += 1
        if rounds % 64 == 0 and time.perf_counter_ns() > deadline:
            return rounds, time.thread_time_ns() - cpu0, time.perf_counter_ns() - wall0


def _bare_round(in_flight: int) -> Callable[[], Awaitable[Any]]:
    async def bare() -> None:
        loop = asyncio.get_running_loop()
        futures = []
        for _ in range(in_flight):
            future = loop.create_future()
            loop.call_soon(future.set_result, None)
            futures.append(future)
        if in_flight == 1:
            await futures[0]
        else:
            await asyncio.gather(*futures)

    return bare


def _swap_round(rig: FakeRig, direction: Any, count: int, in_flight: int) -> Callable[[], Awaitable[Any]]:
    from ..backends.base import CancelToken, SwapRequest

    token = CancelToken()
    requests = [[SwapRequest(list(range(i * count, (i + 1) * count)), list(range(i * count, (i + 1) * count)), token)]
                for i in range(in_flight)]  # fmt: skip
    swap_many = rig.cache.swap_many

    async def swaps() -> None:
        if in_flight == 1:
            await swap_many(direction, requests[0])
        else:
            await asyncio.gather(*(swap_many(direction, r) for r in requests))

    return swaps


def fake_calls_us(rig: FakeRig, direction: Any, reps: int = 2000) -> float:
    """CPU µs of the fake driver's calls for one zero-copy unit, on their own."""
    lane = rig.cache.lanes[direction]
    method, stream = lane.methods["kernel"], lane.streams[0]
    launch = method.launch  # type: ignore[attr-defined]
    driver, memory = rig.driver, lane.memory
    start = time.thread_time_ns()
    for _ in range(reps):
        driver.memcpy_async(memory.device_slots[0], memory.host_slots[0], 8 * 33, stream.handle)
        driver.launch(launch, memory.device_slots[0], 16, 8, stream.handle)
        driver.write_doorbell(stream.handle, stream.address, stream.seq)
    return (time.thread_time_ns() - start) / reps / 1e3


def measure(loop: asyncio.AbstractEventLoop, rig: FakeRig, direction: Any, count: int, args: Any) -> CostRow:
    n = max(1, args.in_flight)
    swap, bare = _swap_round(rig, direction, count, n), _bare_round(n)
    loop.run_until_complete(swap())  # warm-up
    lane = rig.cache.lanes[direction]
    polls0, units0 = lane.counts["polls"], lane.counts["units"]
    totals = {"swap": [0, 0, 0], "bare": [0, 0, 0]}
    for _ in range(4):  # alternation: the machine's noise hits both
        for name, fn in (("swap", swap), ("bare", bare)):
            rounds, cpu, wall = loop.run_until_complete(_cpu_per_round(fn, args.min_time / 8))
            totals[name] = [a + b for a, b in zip(totals[name], (rounds, cpu, wall))]
    (rounds, cpu, wall), (bare_rounds, bare_cpu, _) = totals["swap"], totals["bare"]
    units = lane.counts["units"] - units0  # a swap larger than a unit is several
    return CostRow(
        direction.value, rig.layout.chunk_bytes, count, n, round(units / (rounds * n), 2), round(cpu / units / 1e3, 2),
        round(bare_cpu / (bare_rounds * n) / 1e3, 2), round(fake_calls_us(rig, direction), 2),
        round(wall / units / 1e3, 2), round((lane.counts["polls"] - polls0) / units, 2),
    )  # fmt: skip


def run_cost(args: argparse.Namespace) -> int:
    from ..backends.base import Direction
    from .swap import event_loop, write_rows

    pieces = [parse_size(p) for p in (args.pieces or "4KiB,16KiB,32KiB").split(",")]
    counts = [int(c) for c in (args.counts or "1,16,128").split(",")]
    directions = [Direction(d) for d in (args.directions or "d2h,h2d").split(",") if d != "both"]
    layers = args.layers or 32
    loop = event_loop()
    print(
        f"cachexferd bench swap --backend cuda-fake: loop-thread CPU per unit (one swap), fake driver inline; "
        f"{os.cpu_count()} cpus, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {layers} layers x 2 pieces"
    )
    print(f"{'dir':4} {'piece':>6} {'blocks':>6} {'x':>3} {'units':>5} {'cpu us':>7} {'bare us':>8} {'net us':>7} "
          f"{'fake us':>8} {'wall us':>8} {'polls':>6}")  # fmt: skip
    rows = []
    for piece in pieces:
        for count in counts:
            rig = FakeRig(piece, layers, 2 * count * max(1, args.in_flight))
            try:
                for direction in directions:
                    row = measure(loop, rig, direction, count, args)
                    rows.append(row)
                    print(format_cost(row), flush=True)
            finally:
                rig.close()
    print(cost_summary(rows))
    info = {"cpus": os.cpu_count(), "load_average": list(os.getloadavg())}
    write_rows(args.json, info, [asdict(r) | {"net_us": r.net_us} for r in rows])
    return 0


def format_cost(r: CostRow) -> str:
    return (f"{r.direction:4} {r.piece_bytes >> 10:>4}Ki {r.blocks:>6} {r.in_flight:>3} {r.units:>5.2f} "
            f"{r.cpu_us:>7.2f} {r.bare_us:>8.2f} {r.net_us:>7.2f} {r.fake_us:>8.2f} {r.wall_us:>8.2f} "
            f"{r.polls:>6.2f}")  # fmt: skip


def cost_summary(rows: list[CostRow]) -> str:
    at16 = [r.net_us for r in rows if r.blocks == 16]
    if not at16:
        return "no rows at 16 blocks"
    worst = max(at16)
    verdict = "met" if worst <= TARGET_US else "MISSED"
    return (f"net loop CPU per unit at 16 blocks: median {statistics.median(at16):.2f} us, worst {worst:.2f} us "
            f"(target <= {TARGET_US:.0f} us: {verdict})")  # fmt: skip
