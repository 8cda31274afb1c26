"""Whole-index invariants, for tests and debug runs (walks everything: not for hot paths)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .tree import GPU_OUT, HOST_OUT, Node
from .types import Tier

if TYPE_CHECKING:
    from .prefix import PrefixIndex


def check_index(index: PrefixIndex) -> None:
    tree, moves = index.tree, index.moves
    tree.check()
    assert not tree.freed_gpu and not tree.freed_host, "freed ids were not recycled"
    leases = index._leases
    nodes: dict[int, Node] = {id(n): n for n in tree}
    for lease in leases:
        nodes.update((id(n), n) for n in lease.nodes)
    transfers = moves.transfers()
    for transfer in transfers:
        nodes.update((id(e[0]), e[0]) for e in transfer.entries)
    refs = Counter(id(node) for lease in leases for node in lease.nodes)
    for key, node in nodes.items():
        assert node.ref == refs.get(key, 0), f"{node}: {refs.get(key, 0)} leases hold it"
    gpu = [n.gpu for n in nodes.values() if n.gpu >= 0]
    host = [n.host for n in nodes.values() if n.host >= 0]
    for transfer in transfers:
        if transfer.op == "swap_out":
            gpu += [e[1] for e in transfer.entries if e[0].flags & GPU_OUT]
        elif transfer.op == "store":
            host += [e[2] for e in transfer.entries if e[1] and e[0].flags & HOST_OUT]
    for lease in leases:
        gpu += [b for b in lease.block_ids if b in lease.private]
        assert len(lease.private) == len([b for b in lease.block_ids if b in lease.private]), lease
    _each_once("GPU", gpu + moves.quarantined[Tier.GPU], tree.gpu_free.free_ids(), tree.gpu_free.capacity)
    _each_once("host", host + moves.quarantined[Tier.HOST], tree.host_free.free_ids(), tree.host_free.capacity)


def _each_once(tier: str, held: list[int], free: list[int], capacity: int) -> None:
    counts = Counter(held) + Counter(free)
    twice = [block for block, n in counts.items() if n > 1]
    assert not twice, f"{tier} ids in two places: {sorted(twice)[:8]}"
    assert len(held) + len(free) == capacity, f"{tier}: {len(held)} held + {len(free)} free != {capacity}"
