"""``cachexferd bench eviction``: the prefix index's own costs, no daemon involved.

- eviction: ``--blocks`` unreferenced GPU blocks (chains of ``--depth``, so parents become
  leaves as their children go) evicted with ``PrefixIndex.evict`` and recycled into the
  free list, once with the freed ids recycled in one batch after the loop and once with
  each freed id recycled at once inside the loop (through the same free-list call); for
  context also per id into a free list kept as a min-heap (one ``heappush`` per id, the
  reference design's free structure). Interleaved, best of ``--repeat``; blocks per second
  end to end (the ``evict`` call).
- match: ``match_hashes`` of a ``--prompt-tokens`` prompt whose block hashes are known,
  all cached, with ``--cached`` blocks in the index; beside it, the time to hash that many
  tokens (``KeySpace.block_hashes``), which ``match(tokens)`` adds.
- memory: bytes per cached block (tracemalloc; nodes, the hash map, the free list) for an
  index of ``--memory-blocks`` blocks.

Block digests are synthetic (unique 16-byte values): the index treats them as opaque.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import platform
import statistics
import struct
import sys
import time
import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from ..index import PrefixIndex, Tier
from ..index.blocks import FreeList
from ..storage.keys import BlockHash, KeySpace

SPACE = KeySpace(model="bench", dtype="bfloat16", layout="bench", block_size=16)
TARGETS = {"evict_blocks_per_s": 200_000, "match_ms": 1.0, "bytes_per_block": 300}
_DIGEST = struct.Struct("<QQ")


def add_eviction_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=100_000, help="unreferenced blocks to evict")
    p.add_argument("--depth", type=int, default=4, help="blocks per chain in the eviction test")
    p.add_argument("--repeat", type=int, default=3, help="rounds of each eviction variant (best is reported)")
    p.add_argument("--cached", type=int, default=1_000_000, help="cached blocks in the index for the match test")
    p.add_argument("--prompt-tokens", type=int, default=32_768, help="prompt length for the match test")
    p.add_argument("--memory-blocks", type=int, default=250_000, help="cached blocks for the memory test")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, figures meaningless)")
    p.add_argument("--json", help="write the figures (and machine info) to this file")
    p.set_defaults(func=run)


def digests(chain: int, length: int) -> list[bytes]:
    return [_DIGEST.pack(chain, i) for i in range(length)]


def cache_chains(index: PrefixIndex, chains: Iterator[list[bytes]]) -> None:
    """Caches each chain as a request would: acquire (nothing hit), allocate, insert, release."""
    empty = index.match_hashes([])
    for chain in chains:
        lease = index.acquire(empty)
        if index.allocate(lease, len(chain)) is None:
            raise RuntimeError("the bench index is too small for its chains")
        index.insert(lease, chain)
        index.release(lease)


class HeapFreeList(FreeList):
    """Free ids kept as a min-heap, recycled one heappush per id (for comparison only)."""

    __slots__ = ()

    def release(self, ids: list[int]) -> None:
        for block in ids:
            heapq.heappush(self._free, block)


def eviction_round(blocks: int, depth: int, variant: str) -> float:
    """Seconds to evict (and recycle) ``blocks`` unreferenced blocks, nothing to swap out to."""
    index = PrefixIndex(None, SPACE, gpu_blocks=blocks, host_blocks=0)
    cache_chains(index, (digests(c, depth) for c in range(blocks // depth)))
    cached = len(index.tree)
    if variant == "per_node_heap":
        heap_free = HeapFreeList(0)
        heap_free.capacity, heap_free._free = blocks, sorted(index.tree.gpu_free.free_ids())
        index.tree.gpu_free = heap_free
    gc.collect()
    started = time.perf_counter()
    evicted = index.evict(cached, Tier.GPU, batch=variant == "batched")
    elapsed = time.perf_counter() - started
    if evicted != cached or len(index.tree.gpu_free) != blocks or len(index.tree):
        raise RuntimeError(f"evicted {evicted} of {cached}; {len(index.tree.gpu_free)} of {blocks} free afterwards")
    return elapsed


def bench_eviction(blocks: int, depth: int, repeat: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"batched": [], "per_node": [], "per_node_heap": []}
    for _ in range(repeat):  # interleaved, so all see the same machine load
        for variant, runs in times.items():
            runs.append(eviction_round(blocks, depth, variant))
    cached = blocks // depth * depth
    best = {k: min(v) for k, v in times.items()}
    return {
        "blocks": cached,
        "depth": depth,
        **{f"{k}_blocks_per_s": cached / v for k, v in best.items()},
        "speedup": best["per_node"] / best["batched"],
        "speedup_vs_heap": best["per_node_heap"] / best["batched"],
        **{f"{k}_s": v for k, v in times.items()},
    }


def bench_match(cached: int, prompt_tokens: int, rounds: int = 200) -> dict[str, Any]:
    length = prompt_tokens // SPACE.block_size
    chains = max(1, cached // length)
    index = PrefixIndex(None, SPACE, gpu_blocks=chains * length)
    cache_chains(index, (digests(c, length) for c in range(chains)))
    query = digests(chains // 2, length)
    query_hashes = [BlockHash(d, SPACE.block_size, False) for d in query]
    gc.collect()
    by_digest = _timed(lambda: index.match_hashes(query), rounds, expect=length)
    by_hash = _timed(lambda: index.match_hashes(query_hashes), rounds, expect=length)
    tokens = list(range(prompt_tokens))
    hashing = [_once(lambda: SPACE.block_hashes(tokens)) for _ in range(5)]
    return {
        "cached_blocks": len(index.tree),
        "prompt_tokens": prompt_tokens,
        "prompt_blocks": length,
        "match_ms_p50": statistics.median(by_digest) * 1e3,
        "match_ms_p99": _p99(by_digest) * 1e3,
        "match_blockhash_ms_p50": statistics.median(by_hash) * 1e3,
        "hash_tokens_ms_p50": statistics.median(hashing) * 1e3,
    }


def bench_memory(blocks: int, chain: int = 2048) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(None, SPACE, gpu_blocks=blocks)
        cache_chains(index, (digests(c, min(chain, blocks - c * chain)) for c in range(-(-blocks // chain))))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return {"cached_blocks": len(index.tree), "bytes": used, "bytes_per_block": used / max(1, len(index.tree))}


def _timed(fn: Any, rounds: int, expect: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        match = fn()
        out.append(time.perf_counter() - started)
        if match.blocks != expect:
            raise RuntimeError(f"match found {match.blocks} of {expect} blocks")
    return out


def _once(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": " ".join(["cachexferd", *sys.argv[1:]]),
    }


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.blocks, args.cached, args.memory_blocks, args.repeat = 2_000, 20_000, 5_000, 1
        args.prompt_tokens = min(args.prompt_tokens, 4096)
    if min(args.blocks, args.depth, args.repeat, args.cached, args.memory_blocks) < 1:
        print("cachexferd bench eviction: sizes must be positive", file=sys.stderr)
        return 2
    if args.prompt_tokens < SPACE.block_size:
        print(f"cachexferd bench eviction: --prompt-tokens must be at least {SPACE.block_size}", file=sys.stderr)
        return 2
    result = {
        "eviction": bench_eviction(args.blocks, args.depth, args.repeat),
        "match": bench_match(args.cached, args.prompt_tokens),
        "memory": bench_memory(args.memory_blocks),
        "targets": TARGETS,
        "machine": machine(),
    }
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def report(result: dict[str, Any]) -> None:
    ev, m, mem = result["eviction"], result["match"], result["memory"]
    print(f"eviction of {ev['blocks']} unreferenced blocks (chains of {ev['depth']}), best of {len(ev['batched_s'])}:")
    for label, key in (("batched recycling", "batched"), ("per-node recycling", "per_node"),
                       ("per-node, heap list", "per_node_heap")):  # fmt: skip
        rate = ev[f"{key}_blocks_per_s"]
        ratio = "" if key == "batched" else f"   (batched is {rate and ev['batched_blocks_per_s'] / rate:.2f}x)"
        print(f"  {label:20} {rate / 1e3:8.0f} k blocks/s{ratio}")
    print(f"match of a {m['prompt_tokens']}-token prompt ({m['prompt_blocks']} blocks, all cached), "
          f"{m['cached_blocks']} blocks in the index:")  # fmt: skip
    print(f"  by digest            p50 {m['match_ms_p50']:.3f} ms, p99 {m['match_ms_p99']:.3f} ms")
    print(f"  by BlockHash         p50 {m['match_blockhash_ms_p50']:.3f} ms")
    print(
        f"  hashing the tokens   p50 {m['hash_tokens_ms_p50']:.2f} ms (KeySpace.block_hashes, added by match(tokens))"
    )
    print(f"memory: {mem['bytes_per_block']:.0f} bytes per cached block ({mem['cached_blocks']} blocks, tracemalloc)")
    met = [
        ev["batched_blocks_per_s"] >= TARGETS["evict_blocks_per_s"],
        m["match_ms_p50"] <= TARGETS["match_ms"],
        mem["bytes_per_block"] <= TARGETS["bytes_per_block"],
    ]
    print(f"targets: eviction >= 200k blocks/s {'met' if met[0] else 'MISSED'}, match <= 1 ms "
          f"{'met' if met[1] else 'MISSED'}, <= 300 B/block {'met' if met[2] else 'MISSED'}")  # fmt: skip
