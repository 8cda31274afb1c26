"""The prefix index driving real daemons: two TP ranks (subprocess daemons, cpu backend),
each with a shared-memory KV cache attached. Blocks the index swaps out, drops from host,
stores and brings back carry exactly the bytes the runner wrote for them, on every rank,
and every block the index does not own is unchanged."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.index import Lease, PrefixIndex, StoragePolicy
from cachexferd.launch import DaemonProcess
from cachexferd.storage.keys import BlockHash, KeySpace

from ..helpers import SMALL, assert_untouched, fill_random, snapshot

Spawn = Callable[..., DaemonProcess]
GPU_BLOCKS = 16  # the index owns device blocks 0..15; 16..47 must never change


def block_bytes(cache: ShmKVCache, digest: bytes, rank: int, tensor: int) -> torch.Tensor:
    """What the runner of ``rank`` computes into one tensor's chunk of the block ``digest``."""
    seed = int.from_bytes(digest[:7], "little") * 31 + rank * 7 + tensor
    shape = cache.tensors[tensor].view(torch.uint8)[0].shape
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class Scheduler:
    """An engine's scheduler around the index and the two runners' caches."""

    def __init__(self, index: PrefixIndex, caches: list[ShmKVCache]) -> None:
        self.index, self.caches = index, caches

    def steps_until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "the index's transfers did not complete in time"
            self.index.step()
            time.sleep(0.002)

    def serve(self, tokens: list[int]) -> int:
        """Runs one request to the end; returns how many blocks came from the cache."""
        hashes = self.index.space.block_hashes(tokens, partial=False)
        lease = self.index.acquire(self.index.match_hashes(hashes))
        self.index.flush()
        self.steps_until(lambda: lease.ready)
        self.check_blocks(lease.block_ids[: lease.hit], hashes)
        new: list[int] | None = None

        def allocated() -> bool:
            nonlocal new
            new = self.index.allocate(lease, len(hashes) - lease.hit)
            return new is not None

        self.steps_until(allocated)
        self.compute(lease, hashes)
        self.index.insert(lease, hashes)
        hit = lease.hit
        self.index.release(lease)
        self.index.flush()
        return hit

    def compute(self, lease: Lease, hashes: list[BlockHash]) -> None:
        for i in range(lease.hit, len(hashes)):
            for rank, cache in enumerate(self.caches):
                for t, tensor in enumerate(cache.tensors):
                    tensor.view(torch.uint8)[lease.block_ids[i]] = block_bytes(cache, hashes[i].digest, rank, t)

    def check_blocks(self, block_ids: list[int], hashes: list[BlockHash]) -> None:
        for block, h in zip(block_ids, hashes):
            for rank, cache in enumerate(self.caches):
                for t, tensor in enumerate(cache.tensors):
                    expected = block_bytes(cache, h.digest, rank, t)
                    assert torch.equal(tensor.view(torch.uint8)[block], expected), (
                        f"rank {rank} tensor {t} block {block}"
                    )

    def check_cached(self) -> None:
        """Every block the index says is on the GPU holds its bytes on both ranks."""
        cached = [(n.gpu, BlockHash(n.digest, SMALL.block_size, False)) for n in self.index.tree if n.gpu >= 0]
        self.check_blocks([b for b, _ in cached], [h for _, h in cached])


@pytest.fixture
def daemons(spawn_daemon: Spawn, short_tmp: Path) -> Iterator[tuple[list[DaemonProcess], list[ShmKVCache]]]:
    settings = {"storage.backend": "file", "storage.file.path": str(short_tmp / "pool")}
    procs = [spawn_daemon(rank=r, settings=settings) for r in (0, 1)]
    caches = [ShmKVCache(SMALL) for _ in procs]
    runners = [RunnerClient(d.endpoint) for d in procs]
    for rank, (cache, runner) in enumerate(zip(caches, runners)):
        fill_random(cache, seed=300 + rank)
        runner.attach(cache)
    yield procs, caches
    for cache, runner in zip(caches, runners):
        runner.detach()
        runner.close()
        cache.close()


def prompt(conversation: int, blocks: int) -> list[int]:
    return [conversation * 10_000 + i for i in range(blocks * SMALL.block_size)]


def run_conversations(
    daemons: tuple[list[DaemonProcess], list[ShmKVCache]], storage: StoragePolicy, host_blocks: int
) -> tuple[Scheduler, list[int]]:
    procs, caches = daemons
    before = [snapshot(c) for c in caches]
    space = KeySpace.for_layout("test-model", SMALL, tp_size=2)
    hits = []
    with EngineClient([d.endpoint for d in procs]) as client:
        client.connect()
        index = PrefixIndex(client, space, gpu_blocks=GPU_BLOCKS, host_blocks=host_blocks, storage=storage, debug=True)
        scheduler = Scheduler(index, caches)
        # Three 6-block conversations through a 16-block GPU tier, then the first one returns.
        # Each turn's swap-outs and stores end before the next turn starts (a user's think
        # time): a GPU victim that finds every host block still being stored is dropped, not
        # spilled, so without the pause which blocks survive would depend on timing.
        for conversation in (1, 2, 3, 1, 4, 5, 2):
            hits.append(scheduler.serve(prompt(conversation, 6)))
            scheduler.check_cached()
            scheduler.steps_until(lambda: not index.busy)
        index.check()
        stats = index.stats()
        assert stats.failed_blocks == dict.fromkeys(stats.failed_blocks, 0), stats
    for cache, snap in zip(caches, before):
        assert_untouched(cache, snap, list(range(GPU_BLOCKS)))
    return scheduler, hits


def test_blocks_swapped_out_and_back_in_keep_their_bytes(
    daemons: tuple[list[DaemonProcess], list[ShmKVCache]],
) -> None:
    scheduler, hits = run_conversations(daemons, "none", host_blocks=24)
    stats = scheduler.index.stats()
    assert hits[3] == 6  # conversation 1 came back whole, part of it from host
    assert stats.hit_blocks["host"] >= 4 and stats.moved_blocks["swap_in"] >= 4
    assert stats.commands["swap_out"] >= 1 and stats.moved_bytes > 0


def test_blocks_loaded_back_from_storage_keep_their_bytes(
    daemons: tuple[list[DaemonProcess], list[ShmKVCache]],
) -> None:
    scheduler, hits = run_conversations(daemons, "write_through", host_blocks=8)
    stats = scheduler.index.stats()
    assert stats.moved_blocks["store"] >= 12
    assert hits[-1] == 6, hits  # conversation 2 came back after its host copies were evicted
    assert stats.hit_blocks["storage"] >= 1 and stats.moved_blocks["load"] == stats.hit_blocks["storage"], stats


@pytest.mark.slow
def test_chat_demo_runs_every_tier_and_verifies_its_bytes() -> None:
    argv = [sys.executable, "-m", "cachexferd", "demo", "--chat", "storage", "--turns", "80"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "demo chat: OK" in out and "ERROR" not in out
    for line in ("hit rate", "swap_out", "store", "load", "verified"):
        assert f"  {line}" in out, out
    assert re.search(r"verified\s+[1-9]\d* cached blocks", out), out
