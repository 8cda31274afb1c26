"""The index's building blocks: free lists, the tree and its LRU leaf eviction, the import
guard, and the eviction benchmark at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachexferd.index import DoubleFreeError, PrefixIndex, Tier
from cachexferd.index.blocks import FreeList
from cachexferd.storage.keys import KeySpace

SPACE = KeySpace("m", "float16", "layout", 4)
ROOT = Path(__file__).resolve().parents[2]


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}-{i}".encode().ljust(16, b".") for i in range(n)]


def cache(index: PrefixIndex, digests: list[bytes]) -> list[int]:
    """Caches a chain as a finished request would; returns its GPU blocks."""
    lease = index.acquire(index.match_hashes(digests))
    assert lease.ready
    assert index.allocate(lease, len(digests) - lease.hit) is not None
    index.insert(lease, digests)
    blocks = list(lease.block_ids)
    index.release(lease)
    return blocks


def test_free_list_hands_out_and_takes_back_batches() -> None:
    free = FreeList(6, debug=True)
    assert free.take(4) == [0, 1, 2, 3] and len(free) == 2 and free.used == 4
    assert free.take(3) is None and len(free) == 2  # all or nothing
    free.release([2, 0])
    assert sorted(free.free_ids()) == [0, 2, 4, 5]
    assert free.take_one() == 0 and free.take(0) == []


def test_free_list_refuses_a_double_free_in_debug_mode() -> None:
    free = FreeList(4, debug=True)
    ids = free.take(2)
    assert ids is not None
    free.release(ids)
    with pytest.raises(DoubleFreeError, match="freed twice"):
        free.release([ids[0]])
    with pytest.raises(DoubleFreeError, match="outside"):
        free.release([9])


def test_eviction_takes_least_recently_used_leaves_first() -> None:
    index = PrefixIndex(None, SPACE, gpu_blocks=8, debug=True)
    old, new = chain("old", 3), chain("new", 3)
    cache(index, old)
    cache(index, new)
    assert index.evict(2) == 2
    # The old chain's leaf went first, then its parent, which became a leaf in the same loop.
    assert [n.gpu >= 0 for n in index.tree.present(old)] == [True]
    assert index.match_hashes(old).gpu == 1 and index.match_hashes(new).gpu == 3
    index.check()


def test_a_touched_block_is_evicted_after_the_others() -> None:
    index = PrefixIndex(None, SPACE, gpu_blocks=8, debug=True)
    a, b = chain("a", 1), chain("b", 1)
    cache(index, a)
    cache(index, b)
    index.release(index.acquire(index.match_hashes(a)))  # a used again: b is now the oldest
    assert index.evict(1) == 1
    assert index.match_hashes(a).gpu == 1 and index.match_hashes(b).blocks == 0


def test_whole_chains_evict_in_one_call_and_every_block_is_freed_once() -> None:
    index = PrefixIndex(None, SPACE, gpu_blocks=400, debug=True)  # debug: a double free raises
    for c in range(100):
        cache(index, chain(f"c{c}", 4))
    assert index.evict(400) == 400
    assert len(index.tree) == 0 and len(index.tree.gpu_free) == 400
    assert sorted(index.tree.gpu_free.free_ids()) == list(range(400))
    index.check()


def test_referenced_blocks_and_their_parents_are_never_evicted() -> None:
    index = PrefixIndex(None, SPACE, gpu_blocks=8, debug=True)
    shared = chain("sys", 3)
    cache(index, shared)
    lease = index.acquire(index.match_hashes(shared[:2]))  # a running request holds 2 of 3
    assert index.evict(8) == 1  # only the unreferenced leaf
    assert index.match_hashes(shared).gpu == 2
    index.release(lease)
    assert index.evict(8) == 2
    index.check()


def test_chained_hashes_that_do_not_form_one_chain_are_refused() -> None:
    index = PrefixIndex(None, SPACE, gpu_blocks=8)
    a = chain("a", 2)
    cache(index, a)
    lease = index.acquire(index.match_hashes([]))
    index.allocate(lease, 1)
    with pytest.raises(ValueError, match="another prefix"):
        index.insert(lease, [a[1]])  # a[1] is cached under a[0], not at the root


def test_importing_the_index_imports_neither_torch_nor_zmq_nor_the_daemon() -> None:
    probe = (
        "import sys, json, cachexferd.index\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'zmq')"
        " or m.startswith(('cachexferd.daemon', 'cachexferd.client', 'cachexferd.backends')))))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_eviction_bench_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "eviction.json"
    argv = [sys.executable, "-m", "cachexferd", "bench", "eviction", "--quick", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    ev, match, memory = data["eviction"], data["match"], data["memory"]
    assert ev["blocks"] == 2000 and ev["batched_blocks_per_s"] > 0 and ev["per_node_blocks_per_s"] > 0
    assert match["prompt_blocks"] == 256 and match["cached_blocks"] > 10_000 and match["match_ms_p50"] > 0
    assert 50 < memory["bytes_per_block"] < 2000
    assert data["machine"]["cores"] and data["machine"]["date"]
    assert "targets:" in proc.stdout and "k blocks/s" in proc.stdout


def test_eviction_bench_refuses_bad_sizes() -> None:
    argv = [sys.executable, "-m", "cachexferd", "bench", "eviction", "--blocks", "0"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "must be positive" in proc.stderr


def test_storage_tier_is_not_evicted_by_the_index() -> None:
    with pytest.raises(ValueError, match="backend"):
        PrefixIndex(None, SPACE, gpu_blocks=1).evict(1, Tier.STORAGE)
