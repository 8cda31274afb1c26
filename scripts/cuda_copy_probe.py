"""Measures the cuda backend's copy methods against a raw pinned copy, to check the rule
``cuda.copy_method = auto`` uses (cuda.dma_min_bytes, cuda.staging_below) against data.

    python3 scripts/cuda_copy_probe.py --out $OUT/copy_probe.json

In-process (CudaBackend.local_device_cache, no daemon): for chunk sizes 4 KiB..256 KiB
(bytes of one block of one tensor; 64 tensors, so host blocks of 256 KiB..16 MiB), both
tensor placements (one buffer / one allocation per tensor), contiguous and scattered ids,
and every method (auto, dma, staging, kernel), it times swap-out and swap-in of ~1 GiB and
reports GB/s and the ratio to a raw 1 GiB contiguous pinned copy measured in the same run,
warmed first (a cold link reads several times slower) and measured again at the end (both
are reported; ratios use the better). It also times both directions at once. Needs a GPU
with ~4 GiB free and ~5 GiB of host memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cachexferd.backends.base import CancelToken, Direction
from cachexferd.backends.cuda.backend import CudaBackend
from cachexferd.backends.cuda.device_cache import CudaDeviceCache
from cachexferd.client.cuda_runner import CudaKVCache
from cachexferd.config import load_config
from cachexferd.protocol import KVLayout

GIB = 1 << 30
TENSORS = 64  # 32 layers x K/V
METHODS = ("auto", "dma", "staging", "kernel")
WARM_S = 1.0  # raw copies run this long per direction before the first timing


def raw_copy_gbps(reps: int) -> dict[str, float]:
    """Best of ``reps`` timed 1 GiB copies per direction, after WARM_S of untimed ones (the
    first copies after idle run at a fraction of the link's speed)."""
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"d2h": (host, dev), "h2d": (dev, host)}.items():
        deadline = time.perf_counter() + WARM_S
        while time.perf_counter() < deadline:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(max(3, reps)):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out[name] = round(GIB / best / 1e9, 2)
    del host, dev
    return out


def timed_swaps(cache: CudaDeviceCache, jobs: list[tuple[Direction, list[int], list[int]]], reps: int) -> float:
    """GB/s of running ``jobs`` concurrently, ``reps`` times."""

    async def once() -> None:
        await asyncio.gather(*(cache.swap(d, dev, host, CancelToken()) for d, dev, host in jobs))

    asyncio.run(once())  # warm-up (and pinning wait)
    start = time.perf_counter()
    for _ in range(reps):
        asyncio.run(once())
    moved = reps * sum(len(dev) for _, dev, _ in jobs) * cache.layout.host_block_bytes
    return round(moved / (time.perf_counter() - start) / 1e9, 2)


def measure(backend: CudaBackend, pool: Any, chunk: int, one_buffer: bool, reps: int) -> list[dict[str, Any]]:
    head_dim = chunk // (16 * 2 * 2)
    count = GIB // (TENSORS * chunk)  # ~1 GiB per swap
    layout = KVLayout(num_layers=TENSORS // 2, num_blocks=2 * count, block_size=16, num_kv_heads=2,
                      head_dim=head_dim, dtype="bfloat16")  # fmt: skip
    geometry = pool.geometry(layout.host_block_bytes)
    rows = []
    with CudaKVCache(layout, backend.device, one_allocation=one_buffer) as kv:
        cache = backend.local_device_cache(layout, kv.tensors, pool, geometry)
        rng = random.Random(chunk)
        patterns = {
            "contiguous": (list(range(count)), list(range(count))),
            "scattered": (rng.sample(range(2 * count), count), rng.sample(range(geometry.num_blocks), count)),
        }
        for pattern, (dev, host) in patterns.items():
            for method in METHODS:
                backend.config = dataclasses.replace(backend.config, copy_method=method)
                placement = "one_buffer" if one_buffer else "per_tensor"
                row: dict[str, Any] = {"chunk": chunk, "host_block": layout.host_block_bytes, "placement": placement}
                row.update(pattern=pattern, method=method)
                for name, direction in (("d2h", Direction.D2H), ("h2d", Direction.H2D)):
                    row[name] = timed_swaps(cache, [(direction, dev, host)], reps)
                half = count // 2
                row["both"] = timed_swaps(
                    cache, [(Direction.D2H, dev[:half], host[:half]), (Direction.H2D, dev[half:], host[half:])], reps
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
        cache.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="4096,16384,65536,262144")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    config = load_config(overrides={"cuda.pin_chunk": "1GiB"}, environ={})
    backend = CudaBackend(config.cuda, rank=0)
    pool = backend.create_host_pool(4 * GIB)
    raw_before = raw_copy_gbps(args.reps)
    print(json.dumps({"raw_pinned_gbps": raw_before}), flush=True)
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        for one_buffer in (True, False):
            rows += measure(backend, pool, chunk, one_buffer, args.reps)
    raw_after = raw_copy_gbps(args.reps)
    print(json.dumps({"raw_pinned_gbps_after": raw_after}), flush=True)
    raw = {d: max(raw_before[d], raw_after[d]) for d in raw_before}
    for row in rows:
        row["d2h_ratio"] = round(row["d2h"] / raw["d2h"], 3)
        row["h2d_ratio"] = round(row["h2d"] / raw["h2d"], 3)
        row["both_vs_one"] = round(row["both"] / max(row["d2h"], row["h2d"]), 3)
    result = {"device": backend.device_name, "memcpy_api": backend.describe()["memcpy_api"],
              "kernel": backend.describe()["kernel"], "raw_pinned_gbps": raw, "raw_before": raw_before,
              "raw_after": raw_after, "rows": rows}  # fmt: skip
    backend.close()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
