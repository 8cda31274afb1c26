"""Measures what the cuda backend's copy path costs on this GPU host, part by part.

    python3 scripts/gpu_fastpath_probe.py --out $OUT/probe.jsonl [--steps A,B,E,F]

One JSON line per measurement (also printed). Each step bounds its own work and records an
error instead of stopping the others:

- A: CPU µs per driver call on the event loop's thread (p50/p90 of 2,000 calls): the ids
  upload, the kernel launch (the compiled kernel's direct entry and Triton's dispatch),
  the doorbell write, an event record, a batched copy of 16 and 128 descriptors; and which
  paths the driver chose (doorbell, batched copy, kernel launch).
- B: a lone 1-block (256 KiB) swap-out, 1,000 times on a uvloop loop: its time beside a raw
  pinned copy of the same bytes, and the backend's stage times (issued -> done is the GPU
  plus detection), polling (default) and with the watcher alone (spin_us = 0).
- E: swap-in through the zero-copy kernel at 32, 48 and 64 programs and staged, alone and
  while a bf16 GEMM loop runs on the default stream: GB/s and the GEMM's slowdown.
- F: the driver calls of A while a thread pins host memory in 1 GiB chunks (the pool's
  pinning): p50 / p99 / max µs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cachexferd.backends.base import CancelToken, Direction
from cachexferd.backends.cuda.backend import CudaBackend
from cachexferd.backends.cuda.device_cache import CopySettings, CudaDeviceCache
from cachexferd.bench.swap import layout_for
from cachexferd.client.cuda_runner import CudaKVCache
from cachexferd.config import load_config

KIB, MIB = 1 << 10, 1 << 20


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(ordered[-1], 2), "n": len(ordered)}


class Rig:
    """A cuda backend, a pinned pool and a local device cache of 32 layers x 2 pieces."""

    def __init__(self, piece: int, blocks: int, **settings: Any) -> None:
        config = load_config(overrides={"daemon.backend": "cuda", "cuda.pin_chunk": "256MiB"}, environ={})
        self.backend = CudaBackend(config.cuda, rank=0)
        self.layout = layout_for(piece * 64, 32, blocks)
        self.pool = self.backend.create_host_pool(blocks * self.layout.host_block_bytes)
        self.pool.wait_all_pinned()  # type: ignore[attr-defined]
        self.kv = CudaKVCache(self.layout, self.backend.device)
        geometry = self.pool.geometry(self.layout.host_block_bytes)
        self.cache = self.backend.local_device_cache(self.layout, self.kv.tensors, self.pool, geometry)
        if settings:
            base = self.backend.settings(self.pool)
            fields = {**base.__dict__, **settings}
            tensors = [t.data_ptr() for t in self.kv.tensors]
            self.cache.close()
            self.cache = CudaDeviceCache(self.backend.driver, self.layout, tensors, self.pool, geometry,
                                         CopySettings(**fields))  # fmt: skip

    def close(self) -> None:
        self.cache.close()
        self.kv.close()
        self.backend.close()


def call_costs(rig: Rig, reps: int = 2000) -> dict[str, Any]:
    driver, lane = rig.backend.driver, rig.cache.lanes[Direction.D2H]
    stream, memory = lane.streams[0], lane.memory
    kernel = lane.methods.get("kernel")
    ids_dev, ids_host = memory.device_slots[0], memory.host_slots[0]
    calls: dict[str, Callable[[], None]] = {
        "memcpy_async_272B": lambda: driver.memcpy_async(ids_dev, ids_host, 272, stream.handle),
        "write_doorbell": lambda: driver.write_doorbell(stream.handle, stream.address, 0),
        "record_event": lambda: driver.record_event(lane.events[0], stream.handle),
    }
    if kernel is not None:
        launch = kernel.launch  # type: ignore[attr-defined]
        calls["launch_1_block"] = lambda: driver.launch(launch, memory.device_slots[0], 0, 1, stream.handle)
    for count in (16, 128):
        dst = torch.empty(count * 4 * KIB, dtype=torch.uint8, device=rig.backend.device)
        src = torch.empty(count * 4 * KIB, dtype=torch.uint8, pin_memory=True)
        arrays = [np.array([base + i * 4 * KIB for i in range(count)], dtype=np.uint64) for base in
                  (dst.data_ptr(), src.data_ptr())] + [np.full(count, 4 * KIB, dtype=np.uint64)]  # fmt: skip
        calls[f"memcpy_batch_{count}"] = lambda a=arrays, c=count, keep=(dst, src): driver.memcpy_batch_async(
            a[0], a[1], a[2], c, stream.handle
        )
    out: dict[str, Any] = {}
    for name, call in calls.items():
        samples = []
        for i in range(reps):
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e6)
            if i % 256 == 255:
                driver.synchronize(stream.handle)
        driver.synchronize(stream.handle)
        out[name] = percentiles(samples)
    return out


def step_a() -> dict[str, Any]:
    rig = Rig(4 * KIB, 64)
    try:
        return {"calls_us": call_costs(rig), "driver": rig.backend.driver.describe()}
    finally:
        rig.close()


def lone_swaps(rig: Rig, n: int = 1000) -> dict[str, Any]:
    import uvloop

    size = rig.layout.host_block_bytes
    host, dev = rig.pool.tensor[:size], torch.empty(size, dtype=torch.uint8, device="cuda")

    async def swaps() -> list[float]:
        times = []
        for i in range(n):
            start = time.perf_counter()
            await rig.cache.swap(Direction.D2H, [i % 8], [i % 8], CancelToken())
            times.append((time.perf_counter() - start) * 1e6)
        return times

    raw = []
    for _ in range(n):
        start = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        raw.append((time.perf_counter() - start) * 1e6)
    rig.cache.reset_stages()
    times = uvloop.new_event_loop().run_until_complete(swaps())
    return {"swap_us": percentiles(times), "raw_us": percentiles(raw), "stages_us_p50": rig.cache.stage_summary(),
            "fixed_us_p50": round(statistics.median(times) - statistics.median(raw), 1)}  # fmt: skip


def step_b() -> dict[str, Any]:
    out = {}
    for name, spin in (("polling", 300), ("watcher", 0)):
        rig = Rig(4 * KIB, 16, copy_method="kernel", spin_us=spin)
        try:
            out[name] = lone_swaps(rig)
        finally:
            rig.close()
    return out


def gemm_ms(stop: threading.Event, times: list[float]) -> None:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    while not stop.is_set():
        start = time.perf_counter()
        torch.matmul(a, b)
        torch.cuda.current_stream().synchronize()
        times.append((time.perf_counter() - start) * 1e3)


def swap_in_gbps(rig: Rig, seconds: float = 2.0) -> float:
    ids = list(range(128))

    async def loop() -> float:
        moved, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            await rig.cache.swap(Direction.H2D, ids, ids, CancelToken())
            moved += len(ids) * rig.layout.host_block_bytes
        return moved / (time.perf_counter() - start) / 1e9

    return round(asyncio.new_event_loop().run_until_complete(loop()), 2)


def step_e() -> dict[str, Any]:
    alone: list[float] = []
    stop = threading.Event()
    worker = threading.Thread(target=gemm_ms, args=(stop, alone))
    worker.start()
    time.sleep(2.0)
    stop.set()
    worker.join()
    out: dict[str, Any] = {"gemm_ms_alone": round(statistics.median(alone[2:]), 3)}
    for name, settings in (("kernel_32", {"programs_h2d": 32}), ("kernel_48", {"programs_h2d": 48}),
                           ("kernel_64", {"programs_h2d": 64}), ("staging", {"copy_method": "staging"})):  # fmt: skip
        rig = Rig(4 * KIB, 256, **{"copy_method": "kernel", **settings})
        try:
            row = {"alone_gbps": swap_in_gbps(rig)}
            busy: list[float] = []
            stop = threading.Event()
            worker = threading.Thread(target=gemm_ms, args=(stop, busy))
            worker.start()
            row["with_gemm_gbps"] = swap_in_gbps(rig)
            stop.set()
            worker.join()
            row["gemm_slowdown_pct"] = round(100 * (statistics.median(busy[2:]) / out["gemm_ms_alone"] - 1), 1)
            out[name] = row
        finally:
            rig.close()
    return out


def step_f() -> dict[str, Any]:
    rig = Rig(4 * KIB, 64)
    try:
        idle = call_costs(rig, reps=1000)
        rig.backend.create_host_pool(8 << 30)  # pinned by the pool's workers meanwhile
        try:
            pinning = call_costs(rig, reps=1000)
        finally:
            rig.backend.pools[-1].close()
        return {"idle_us": idle, "while_pinning_us": pinning}
    finally:
        rig.close()


STEPS: dict[str, Callable[[], dict[str, Any]]] = {"A": step_a, "B": step_b, "E": step_e, "F": step_f}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="A,B,E,F")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    lines = [{"step": "env", **env}]
    for step in args.steps.split(","):
        started = time.monotonic()
        try:
            result = {"step": step, **STEPS[step]()}
        except Exception as exc:  # one step's failure must not hide the others
            result = {"step": step, "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - started, 1)
        lines.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0 if all("error" not in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
