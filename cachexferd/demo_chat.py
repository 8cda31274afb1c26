"""``cachexferd demo --chat``: a multi-turn chat workload through the prefix index.

Two daemons (TP=2, cpu backend) and two runner processes start as in ``cachexferd demo``.
An engine loop in this process serves chat requests through ``PrefixIndex``: conversations
share a few system prompts, every turn sends the whole history again, and conversations
come back after unrelated traffic. The index owns a small GPU tier (part of each runner's
KV cache), so blocks are evicted to host (swap-out) and brought back (swap-in); with
``--chat storage`` a file storage tier joins (write-through, loads when host copies are
gone). The "model" writes each computed block's KV as bytes derived from the block's hash
and rank, so every block served from a cache is checked byte for byte on both ranks, and
every block outside the index's GPU tier must still hold what its runner wrote.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .client import EngineClient
from .demo import LAYOUT, TP, clean_up, report_failure, start_runners
from .index import Lease, PrefixIndex
from .launch import DaemonProcess
from .storage.keys import BlockHash, KeySpace
from .units import human_bytes

if TYPE_CHECKING:
    import torch

GPU_BLOCKS = 96  # of the runners' 512: the rest must stay untouched
HOST_BLOCKS = {"host": 192, "storage": 48}  # the host tier; smaller with storage, so loads happen
SYSTEM_BLOCKS, USER_BLOCKS, REPLY_BLOCKS = 4, 2, 1
BATCH = 4  # requests scheduled together (their fetches share commands)


@dataclass
class Conversation:
    system: int
    history: list[int] = field(default_factory=list)


@dataclass
class Tally:
    requests: int = 0
    prompt_blocks: int = 0
    checked_blocks: int = 0
    bad: list[str] = field(default_factory=list)


class Caches:
    """The runners' device caches, mapped here so the "model" can write KV and we can check it."""

    def __init__(self, segments: list[str]) -> None:
        import torch

        size = LAYOUT.num_tensors * LAYOUT.tensor_bytes
        self.flat = []
        for name in segments:
            storage = torch.UntypedStorage.from_file(f"/dev/shm/{name}", shared=True, nbytes=size)
            self.flat.append(torch.empty(0, dtype=torch.uint8).set_(storage))  # type: ignore[arg-type]

    def tensor(self, rank: int, t: int) -> torch.Tensor:
        return self.flat[rank][t * LAYOUT.tensor_bytes : (t + 1) * LAYOUT.tensor_bytes].view(LAYOUT.num_blocks, -1)

    @staticmethod
    def kv(digest: bytes, rank: int, t: int) -> torch.Tensor:
        """The bytes the model computes for block ``digest`` on ``rank``, tensor ``t``."""
        import torch

        seed = hashlib.blake2b(digest + bytes([rank, t]), digest_size=64).digest()
        return torch.frombuffer(bytearray(seed), dtype=torch.uint8).repeat(LAYOUT.chunk_bytes // 64)

    def write(self, block: int, digest: bytes) -> None:
        for rank in range(TP):
            for t in range(LAYOUT.num_tensors):
                self.tensor(rank, t)[block] = self.kv(digest, rank, t)

    def holds(self, block: int, digest: bytes) -> bool:
        import torch

        return all(
            torch.equal(self.tensor(rank, t)[block], self.kv(digest, rank, t))
            for rank in range(TP)
            for t in range(LAYOUT.num_tensors)
        )


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", nargs="?", const="host", choices=("host", "storage"),
                   help="a chat workload through the prefix index instead ('storage': with a file tier)")  # fmt: skip
    p.add_argument("--turns", type=int, default=80, help="--chat: requests served")


def run_chat(args: argparse.Namespace) -> int:
    storage = args.chat == "storage"
    workdir = Path(tempfile.mkdtemp(prefix="cachexferd-chat-"))
    daemons: list[DaemonProcess] = []
    runners: list[subprocess.Popen[str]] = []
    print(f"cachexferd demo --chat: {TP} daemons (TP={TP}, cpu backend), a GPU tier of {GPU_BLOCKS} blocks, "
          f"host tier {HOST_BLOCKS[args.chat]} blocks{', file storage tier' if storage else ''}")  # fmt: skip
    try:
        daemons = start_daemons(workdir, storage)
        runners, segments = start_runners(daemons, args.seed)
        return 0 if serve_chats(daemons, Caches(segments), args, storage) else 1
    except Exception as exc:
        return report_failure(exc, daemons)
    finally:
        clean_up(daemons, runners, workdir, args.keep)


def start_daemons(workdir: Path, storage: bool) -> list[DaemonProcess]:
    capacity = 2 * LAYOUT.num_blocks * LAYOUT.host_block_bytes
    settings: dict[str, Any] = {"metrics.port": 0, "host_cache.capacity": capacity}
    settings.update({"storage.backend": "file", "storage.file.path": str(workdir / "pool")} if storage else {})
    daemons = [DaemonProcess(workdir / f"rank{rank}", rank=rank, settings=dict(settings)) for rank in range(TP)]
    for daemon in daemons:
        daemon.start()
    return daemons


def serve_chats(daemons: list[DaemonProcess], caches: Caches, args: argparse.Namespace, storage: bool) -> bool:
    rng = random.Random(args.seed)
    space = KeySpace.for_layout("demo-chat", LAYOUT, tp_size=TP)
    conversations = [Conversation(system=rng.randrange(3)) for _ in range(16)]
    tally = Tally()
    started = time.perf_counter()
    with EngineClient([d.endpoint for d in daemons], name="demo-chat") as client:
        client.connect()
        index = PrefixIndex(client, space, gpu_blocks=GPU_BLOCKS, host_blocks=HOST_BLOCKS[args.chat],
                            storage="write_through" if storage else "none")  # fmt: skip
        while tally.requests < args.turns:
            # Mostly conversations seen recently, sometimes one that waited behind other traffic.
            batch = rng.sample(conversations, BATCH)
            serve_batch(index, caches, space, batch, rng, tally)
        steps_until(index, lambda: not index.busy)
        check_cached(index, caches, tally)
    elapsed = time.perf_counter() - started
    tally.bad += check_untouched(caches, args.seed)
    report(index, tally, elapsed)
    return not tally.bad


def serve_batch(index: PrefixIndex, caches: Caches, space: KeySpace, batch: list[Conversation],
                rng: random.Random, tally: Tally) -> None:  # fmt: skip
    """One scheduling round: the batch's requests fetch their cached prefixes together,
    then each prefills, decodes its reply and finishes."""
    block = LAYOUT.block_size
    requests: list[tuple[Conversation, list[int], Lease]] = []
    for conv in batch:
        user = [rng.randrange(32_000) for _ in range(USER_BLOCKS * block)]
        prompt = [conv.system] * SYSTEM_BLOCKS * block + conv.history + user
        requests.append((conv, prompt, index.acquire(index.match(prompt))))
    index.flush()
    steps_until(index, lambda: all(lease.ready for _, _, lease in requests))
    for conv, prompt, lease in requests:
        hashes = space.block_hashes(prompt, partial=False)
        verify(lease, hashes, caches, tally)
        compute(index, caches, lease, hashes)
        reply = [rng.randrange(32_000) for _ in range(REPLY_BLOCKS * block)]
        compute(index, caches, lease, space.block_hashes(prompt + reply, partial=False))  # decode
        conv.history = prompt[SYSTEM_BLOCKS * block :] + reply
        tally.requests += 1
        tally.prompt_blocks += len(hashes)
        index.release(lease)
    index.flush()


def compute(index: PrefixIndex, caches: Caches, lease: Lease, hashes: list[BlockHash]) -> None:
    """The model fills the blocks past the lease's cached prefix; the index caches them."""
    need = len(hashes) - len(lease.block_ids)
    if need > 0:
        new: list[int] | None = None

        def allocated() -> bool:
            nonlocal new
            new = index.allocate(lease, need)
            return new is not None

        steps_until(index, allocated)
    for i in range(len(lease.nodes), len(hashes)):
        caches.write(lease.block_ids[i], hashes[i].digest)
    index.insert(lease, hashes)


def verify(lease: Lease, hashes: list[BlockHash], caches: Caches, tally: Tally) -> None:
    for i in range(lease.hit):
        tally.checked_blocks += 1
        if not caches.holds(lease.block_ids[i], hashes[i].digest):
            tally.bad.append(f"cached block {i} of a prompt (GPU block {lease.block_ids[i]}) has wrong bytes")


def check_cached(index: PrefixIndex, caches: Caches, tally: Tally) -> None:
    for node in index.tree:
        if node.gpu >= 0:
            tally.checked_blocks += 1
            if not caches.holds(node.gpu, node.digest):
                tally.bad.append(f"GPU block {node.gpu} does not hold the block the index says")


def check_untouched(caches: Caches, seed: int) -> list[str]:
    import torch

    from .demo_runner import known_data

    bad = []
    for rank in range(TP):
        for t in range(LAYOUT.num_tensors):
            expected = known_data(LAYOUT, seed + rank, t)[GPU_BLOCKS:]
            if not torch.equal(caches.tensor(rank, t)[GPU_BLOCKS:], expected):
                bad.append(f"rank {rank} tensor {t}: a block outside the index's GPU tier changed")
    return bad


def steps_until(index: PrefixIndex, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """The scheduler's step loop: poll completions, send what is queued, until ``done``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the index's transfers did not complete within {timeout_s} s")
        index.step()
        time.sleep(0.001)  # a real scheduler would run a model step here


def report(index: PrefixIndex, tally: Tally, elapsed: float) -> None:
    stats, moved = index.stats(), index.moves.moved
    hits = stats.hit_blocks
    total = max(1, tally.prompt_blocks)
    print(f"  requests   {tally.requests} in {elapsed:.1f} s, {tally.prompt_blocks} prompt blocks")
    print("  hit rate   " + ", ".join(f"{tier} {hits[tier] / total:.0%}" for tier in ("gpu", "host", "storage"))
          + f", recomputed {hits['miss'] / total:.0%}")  # fmt: skip
    block_bytes = LAYOUT.host_block_bytes * TP
    for op in ("swap_out", "swap_in", "store", "load"):
        if not stats.commands[op]:
            continue
        lat = sorted(moved.latencies_s[op])
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3
        print(f"  {op:10} {stats.moved_blocks[op]:5} blocks ({human_bytes(stats.moved_blocks[op] * block_bytes)}) "
              f"in {stats.commands[op]} commands, completion p50 {statistics.median(lat) * 1e3:.1f} ms, "
              f"p99 {p99:.1f} ms, {stats.failed_blocks[op]} failed")  # fmt: skip
    print(f"  verified   {tally.checked_blocks} cached blocks byte for byte on both ranks; "
          f"{LAYOUT.num_blocks - GPU_BLOCKS} blocks outside the tier untouched")  # fmt: skip
    for line in tally.bad[:10]:
        print(f"  ERROR {line}")
    print("demo chat: OK" if not tally.bad else "demo chat: FAILED")
