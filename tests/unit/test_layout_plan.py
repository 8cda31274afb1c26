"""Layout math, id coalescing and sharding."""

from __future__ import annotations

import random

import pytest

from cachexferd.backends.plan import Run, coalesce, shard
from cachexferd.protocol import KVLayout, LayoutError


def test_layout_sizes() -> None:
    layout = KVLayout(num_layers=32, num_blocks=100, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert layout.chunk_bytes == 16 * 8 * 128 * 2
    assert layout.num_tensors == 64
    assert layout.host_block_bytes == 64 * layout.chunk_bytes
    assert layout.tensor_bytes == 100 * layout.chunk_bytes
    assert layout.host_chunk_offset(3, 5) == 3 * layout.host_block_bytes + 5 * layout.chunk_bytes
    mla = KVLayout(
        num_layers=4, num_blocks=8, block_size=64, num_kv_heads=1, head_dim=576, dtype="float8_e4m3fn", kv_tensors=1
    )
    assert mla.num_tensors == 4 and mla.chunk_bytes == 64 * 576


def test_fingerprint_ignores_block_count_but_not_shape() -> None:
    a = KVLayout(num_layers=2, num_blocks=10, block_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    b = KVLayout(num_layers=2, num_blocks=99, block_size=16, num_kv_heads=2, head_dim=64, dtype="float16")
    c = KVLayout(num_layers=2, num_blocks=10, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


@pytest.mark.parametrize(
    "wire",
    [
        {"num_layers": 0, "num_blocks": 1, "block_size": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "float16"},
        {"num_layers": 1, "num_blocks": 1, "block_size": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "float64"},
        {
            "num_layers": 1,
            "num_blocks": 1,
            "block_size": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "float16",
            "kv_tensors": 3,
        },
        {"num_layers": 1, "num_blocks": 1, "block_size": 1, "num_kv_heads": 1, "head_dim": 1},
        {
            "num_layers": 1,
            "num_blocks": 1,
            "block_size": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "float16",
            "x": 1,
        },
        {"num_layers": "1", "num_blocks": 1, "block_size": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "float16"},
        [1, 2, 3],
    ],
)
def test_bad_layouts(wire: object) -> None:
    with pytest.raises(LayoutError):
        KVLayout.from_wire(wire)


def test_layout_wire_round_trip() -> None:
    layout = KVLayout(
        num_layers=2, num_blocks=10, block_size=16, num_kv_heads=2, head_dim=64, dtype="uint8", kv_tensors=1
    )
    assert KVLayout.from_wire(layout.to_wire()) == layout


def test_coalesce_runs() -> None:
    assert coalesce([], []) == []
    assert coalesce([5, 6, 7, 1, 2, 9], [0, 1, 2, 3, 4, 10]) == [Run(5, 0, 3), Run(1, 3, 2), Run(9, 10, 1)]
    # Runs must advance on both sides at once.
    assert coalesce([1, 2, 3], [4, 6, 7]) == [Run(1, 4, 1), Run(2, 6, 2)]


def _expand(runs: list[Run]) -> list[tuple[int, int]]:
    return [(r.device + i, r.host + i) for r in runs for i in range(r.length)]


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_shard_preserves_every_pair_once(parts: int) -> None:
    rng = random.Random(parts)
    device = rng.sample(range(1000), 300)
    host = sorted(rng.sample(range(1000), 300))
    runs = coalesce(device, host)
    shards = shard(runs, parts)
    assert len(shards) <= parts
    assert sorted(p for s in shards for p in _expand(s)) == sorted(zip(device, host))
    sizes = [sum(r.length for r in s) for s in shards]
    assert max(sizes) - min(sizes) <= max(sizes) // 2 + 1


def test_shard_cuts_one_long_run() -> None:
    shards = shard([Run(0, 100, 10)], 3)
    assert [sum(r.length for r in s) for s in shards] == [4, 4, 2]
    assert _expand([r for s in shards for r in s]) == [(i, 100 + i) for i in range(10)]
