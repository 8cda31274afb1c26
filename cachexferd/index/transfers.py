"""The index's transfers: batched per step, sent with the engine client, applied on completion.

Everything a step moves goes in at most one command per kind (swap-out, swap-in, store,
load). Completions are taken at step boundaries through the client's ``poll()``. No block
written or read by a transfer is reused before its completion arrives: a swapped-out GPU
block, a spilled host block, a destination; on failure the copy stays where it was (a
failed swap-out or store) or the fetch becomes a miss (a failed swap-in or load). After a
client-side timeout the daemon may still write a destination later, so such ids are held
back (``quarantined``) instead of being reused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..storage.keys import KeySpace
from .lease import Lease
from .tree import DEAD, GPU_IN, GPU_OUT, HOST_IN, HOST_OUT, STORED, Node, Tree
from .types import Tier, full_block

Op = Literal["swap_out", "swap_in", "store", "load"]
ORDER: tuple[Op, ...] = ("swap_out", "swap_in", "store", "load")
RESULT_KEY = {"store": "stored", "load": "loaded"}  # results that say how many leading blocks made it


class CompletionLike(Protocol):
    req_id: int

    @property
    def ok(self) -> bool: ...

    @property
    def errors(self) -> dict[int, tuple[str, str]]: ...

    @property
    def latency_s(self) -> float: ...

    def min_result(self, key: str) -> int: ...

    def result(self, rank: int | None = None) -> dict[str, Any]: ...


class TransferClient(Protocol):
    """The part of ``cachexferd.client.EngineClient`` the index uses."""

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int], timeout_s: float | None = None) -> int: ...

    def swap_in(self, device_ids: Sequence[int], host_ids: Sequence[int], timeout_s: float | None = None) -> int: ...

    def store(self, keys: Any, host_ids: Sequence[int], device_ids: Sequence[int] | None = None,
              timeout_s: float | None = None) -> int: ...  # fmt: skip

    def load(self, keys: Any, host_ids: Sequence[int], device_ids: Sequence[int] | None = None,
             timeout_s: float | None = None) -> int: ...  # fmt: skip

    def poll(self, timeout_ms: int = 0) -> Sequence[Any]: ...


@dataclass(eq=False)
class Transfer:
    """One command: entries (node, gpu id, host id). Stores use the gpu field as a flag: 1
    when the host copy was evicted (spilled) and goes once the store succeeded."""

    op: Op
    entries: list[tuple[Node, int, int]] = field(default_factory=list)
    waiters: list[Lease] = field(default_factory=list)
    req_id: int = -1


@dataclass
class Moved:
    """Counters of what the transfers did (blocks per op, bytes summed over ranks)."""

    commands: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORDER, 0))
    blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORDER, 0))
    failed_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORDER, 0))
    bytes: int = 0
    latencies_s: dict[str, deque[float]] = field(default_factory=lambda: {op: deque(maxlen=4096) for op in ORDER})


class Transfers:
    def __init__(self, tree: Tree, client: TransferClient | None, space: Callable[[], KeySpace],
                 write_through: bool, timeout_s: float | None) -> None:  # fmt: skip
        self.tree, self.client, self.space = tree, client, space
        self.write_through, self.timeout_s = write_through, timeout_s
        self.queued: dict[Op, Transfer] = {}
        self.inflight: dict[int, Transfer] = {}
        self.arriving: dict[Node, Transfer] = {}  # nodes whose GPU copy a fetch is writing
        self.quarantined: dict[Tier, list[int]] = {Tier.GPU: [], Tier.HOST: []}
        self.leaving = {Tier.GPU: 0, Tier.HOST: 0}  # evicted blocks freed when their transfer completes
        self.moved = Moved()

    def queue(self, op: Op, node: Node, gpu: int, host: int) -> Transfer:
        transfer = self.queued.get(op)
        if transfer is None:
            transfer = self.queued[op] = Transfer(op)
        transfer.entries.append((node, gpu, host))
        if op in ("swap_in", "load"):
            self.arriving[node] = transfer
        elif op == "swap_out":
            self.leaving[Tier.GPU] += 1
        return transfer

    def queue_store(self, node: Node, host: int, spilled: bool) -> None:
        node.flags |= HOST_OUT
        self.queue("store", node, int(spilled), host)
        self.leaving[Tier.HOST] += spilled

    def transfers(self) -> list[Transfer]:
        return [*self.queued.values(), *self.inflight.values()]

    # Sending -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Sends what this step queued: one command per kind."""
        if self.queued and self.client is None:
            raise RuntimeError("this index has no client to move blocks with")
        queued, self.queued = self.queued, {}
        for op in ORDER:
            transfer = queued.get(op)
            if transfer is None:
                continue
            live = [e for e in transfer.entries if not e[0].flags & DEAD]
            if len(live) < len(transfer.entries):  # invalidated before it was sent: never send old KV
                self._apply(Transfer(op, [e for e in transfer.entries if e[0].flags & DEAD]), ok_blocks=0)
                transfer.entries = live
            if not transfer.entries:
                self._wake(transfer)
                continue
            transfer.req_id = self._send(transfer)
            self.inflight[transfer.req_id] = transfer
            self.moved.commands[op] += 1

    def _send(self, t: Transfer) -> int:
        client, timeout = self.client, self.timeout_s
        assert client is not None
        gpu = [e[1] for e in t.entries]
        host = [e[2] for e in t.entries]
        if t.op == "swap_out":
            return client.swap_out(gpu, host, timeout_s=timeout)
        if t.op == "swap_in":
            return client.swap_in(gpu, host, timeout_s=timeout)
        space = self.space()
        keys = space.keys_by_rank([full_block(e[0].digest, space) for e in t.entries])
        if t.op == "store":
            return client.store(keys, host_ids=host, timeout_s=timeout)
        return client.load(keys, host_ids=host, device_ids=gpu, timeout_s=timeout)

    # Completions -------------------------------------------------------------------------

    def complete(self, completion: CompletionLike) -> bool:
        """Applies a completion of ours (returns False for anybody else's)."""
        transfer = self.inflight.pop(completion.req_id, None)
        if transfer is None:
            return False
        n = len(transfer.entries)
        ok_blocks = n if completion.ok else 0
        if completion.ok and transfer.op in RESULT_KEY:
            ok_blocks = min(n, completion.min_result(RESULT_KEY[transfer.op]))
        timed_out = any(name == "CLIENT_TIMEOUT" for name, _ in completion.errors.values())
        self._apply(transfer, ok_blocks, timed_out)
        moved = self.moved
        moved.blocks[transfer.op] += ok_blocks
        moved.failed_blocks[transfer.op] += n - ok_blocks
        if completion.ok:
            outcomes = getattr(completion, "outcomes", {})
            moved.bytes += sum(int(o.result.get("bytes", 0)) for o in outcomes.values())
        moved.latencies_s[transfer.op].append(completion.latency_s)
        return True

    def _apply(self, t: Transfer, ok_blocks: int, timed_out: bool = False) -> None:
        apply = {"swap_out": self._swapped_out, "swap_in": self._fetched, "load": self._fetched, "store": self._stored}
        handler = apply[t.op]
        for i, (node, gpu, host) in enumerate(t.entries):
            handler(node, gpu, host, i < ok_blocks, timed_out)
            self.tree.settle(node)
        self._wake(t)

    def _discard(self, tier: Tier, block: int, timed_out: bool) -> None:
        """A destination of a failed transfer: free, or held back if it may still be written."""
        if timed_out:
            self.quarantined[tier].append(block)
        else:
            (self.tree.freed_gpu if tier is Tier.GPU else self.tree.freed_host).append(block)

    def _swapped_out(self, node: Node, gpu: int, host: int, ok: bool, timed_out: bool) -> None:
        tree = self.tree
        self.leaving[Tier.GPU] -= 1
        node.flags &= ~(GPU_OUT | HOST_IN)
        if node.flags & DEAD:
            tree.freed_gpu.append(gpu)
            if not ok and node.host == host:
                node.host = -1
                self._discard(Tier.HOST, host, timed_out)
        elif ok:
            tree.freed_gpu.append(gpu)  # the host copy is complete: the GPU block may go
            if self.write_through and not node.flags & STORED:
                self.queue_store(node, host, spilled=False)
        else:  # the block stays on the GPU
            tree.clear_host(node)
            self._discard(Tier.HOST, host, timed_out)
            if node.gpu < 0:
                tree.set_gpu(node, gpu)
            else:
                tree.freed_gpu.append(gpu)  # recomputed meanwhile: keep the newer copy

    def _fetched(self, node: Node, gpu: int, host: int, ok: bool, timed_out: bool) -> None:
        loaded = node.flags & HOST_IN
        node.flags &= ~(GPU_IN | HOST_IN)
        self.arriving.pop(node, None)
        if ok:
            return
        # A miss for whoever waits on it; the copy it came from is untouched (host) or gone (storage).
        self.tree.clear_gpu(node)
        self._discard(Tier.GPU, gpu, timed_out)
        if loaded:
            self.tree.clear_host(node)
            self._discard(Tier.HOST, host, timed_out)
            node.flags &= ~STORED

    def _stored(self, node: Node, spilled: int, host: int, ok: bool, timed_out: bool) -> None:
        node.flags &= ~HOST_OUT
        if ok:
            node.flags |= STORED
        if not spilled:
            return
        self.leaving[Tier.HOST] -= 1
        if ok or node.flags & DEAD or node.host >= 0:
            self.tree.freed_host.append(host)
        else:
            self.tree.set_host(node, host)  # the store failed: the host copy stays

    def _wake(self, transfer: Transfer) -> None:
        for lease in transfer.waiters:
            lease.waiting.discard(transfer)
            truncate_to_arrived(self.tree, lease)
        transfer.waiters = []


def truncate_to_arrived(tree: Tree, lease: Lease) -> None:
    """Shortens the lease's cached prefix to the blocks whose GPU copy is (or is still
    becoming) the one in its block table: a failed fetch turns the rest into misses."""
    if lease.released:
        return
    for i in range(min(lease.hit, len(lease.block_ids))):
        node = lease.nodes[i]
        if node.gpu != lease.block_ids[i]:
            release_from(tree, lease, i)
            lease.truncated = True
            return


def release_from(tree: Tree, lease: Lease, keep: int) -> None:
    """Drops the lease's blocks from position ``keep`` on: references, and the ids it owns."""
    for node in lease.nodes[keep:]:
        node.ref -= 1
        node.stamp = tree.clock
        tree.settle(node)
    for block in lease.block_ids[keep:]:
        if block in lease.private:
            lease.private.discard(block)
            tree.freed_gpu.append(block)
    del lease.nodes[keep:]
    del lease.block_ids[keep:]
    lease.hit = min(lease.hit, keep)
