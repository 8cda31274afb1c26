"""Exact bytes, untouched blocks, and submission order through an in-process daemon."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.protocol import DTYPE_BYTES, KVLayout

from ..helpers import (
    SMALL,
    InProcessDaemon,
    assert_matches_model,
    assert_moved,
    assert_untouched,
    config_for,
    fill_random,
    snapshot,
    submit_random_pipeline,
)


def _ok(engine: EngineClient, *req_ids: int) -> list[dict[str, object]]:
    done = engine.wait(req_ids, timeout_s=20)
    for req_id in req_ids:
        assert done[req_id].ok, done[req_id].describe()
    return [done[r].result() for r in req_ids]


def _round_trip(engine: EngineClient, cache: ShmKVCache, src: list[int], dst: list[int], host: list[int]) -> None:
    before = snapshot(cache)
    out = engine.swap_out(src, host)
    back = engine.swap_in(dst, host)  # pipelined: must read what swap_out wrote
    _ok(engine, out, back)
    assert_moved(cache, dst, before, src)
    assert_untouched(cache, before, dst)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_exact_bytes_every_dtype(inproc: InProcessDaemon, engine: EngineClient, dtype: str) -> None:
    layout = KVLayout(**{**SMALL.to_wire(), "dtype": dtype, "head_dim": 64 // DTYPE_BYTES[dtype]})
    with ShmKVCache(layout) as cache, RunnerClient(inproc.endpoint) as runner, runner.attached(cache):
        fill_random(cache, seed=len(dtype))
        _round_trip(engine, cache, [0, 1, 2, 7], [20, 21, 22, 40], [5, 6, 7, 100])


@pytest.mark.parametrize("pattern", ["contiguous", "scattered", "reversed"])
def test_patterns(inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache, pattern: str) -> None:
    fill_random(shm_cache, seed=3)
    n = 16
    rng = random.Random(pattern)
    if pattern == "contiguous":
        src, dst, host = list(range(0, n)), list(range(24, 24 + n)), list(range(300, 300 + n))
    elif pattern == "scattered":
        src, dst = rng.sample(range(0, 24), n), rng.sample(range(24, 48), n)
        host = rng.sample(range(0, 400), n)
    else:
        src, dst, host = list(range(n - 1, -1, -1)), list(range(47, 47 - n, -1)), list(range(n, 0, -1))
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        _round_trip(engine, shm_cache, src, dst, host)


def test_mla_single_tensor_layout(inproc: InProcessDaemon, engine: EngineClient) -> None:
    layout = KVLayout(
        num_layers=4, num_blocks=32, block_size=4, num_kv_heads=1, head_dim=64, dtype="bfloat16", kv_tensors=1
    )
    with ShmKVCache(layout) as cache, RunnerClient(inproc.endpoint) as runner, runner.attached(cache):
        fill_random(cache, seed=9)
        _round_trip(engine, cache, [1, 3, 5], [2, 4, 6], [0, 1, 2])


def test_unevenly_spaced_tensors(inproc: InProcessDaemon, engine: EngineClient) -> None:
    """Tensors at irregular offsets in the segment: the per-tensor (group of one) path."""
    with ShmKVCache(SMALL) as cache, RunnerClient(inproc.endpoint) as runner:
        fill_random(cache, seed=4)
        offsets = list(cache.offsets)
        offsets[0], offsets[1] = offsets[1], offsets[0]  # tensor 0 now lives second
        handle = {**cache.device_handle(), "offsets": offsets}
        cache.tensors[0], cache.tensors[1] = cache.tensors[1], cache.tensors[0]

        class Swapped:
            layout = cache.layout

            def device_handle(self) -> dict[str, object]:
                return handle

        with runner.attached(Swapped()):
            _round_trip(engine, cache, [1, 2, 3, 9], [30, 31, 32, 33], [10, 11, 12, 13])


def test_random_pipelines_match_sequential_model(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache
) -> None:
    """Hundreds of pipelined, conflicting commands end exactly as if run one by one."""
    fill_random(shm_cache, seed=11)
    original = snapshot(shm_cache)
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        req_ids, expected = submit_random_pipeline(engine, random.Random(7), SMALL.num_blocks, 24)
        _ok(engine, *req_ids)
    assert_matches_model(shm_cache, original, expected)


def test_directions_overlap(short_tmp: Path) -> None:
    """A swap-out and a swap-in on disjoint blocks run at the same time (separate workers)."""
    layout = KVLayout(num_layers=8, num_blocks=512, block_size=32, num_kv_heads=4, head_dim=64, dtype="bfloat16")
    daemon = InProcessDaemon(config_for(short_tmp / "big", **{"host_cache.capacity": "160MiB"})).start()
    try:
        with ShmKVCache(layout) as cache, RunnerClient(daemon.endpoint) as runner, runner.attached(cache):
            with EngineClient([daemon.endpoint]) as engine:
                engine.connect()
                fill_random(cache, seed=1)
                first = list(range(0, 128))
                _ok(engine, engine.swap_out(first, first))  # fill host 0..127
                out = engine.swap_out(list(range(128, 256)), list(range(128, 256)))
                back = engine.swap_in(list(range(300, 428)), first)
                a, b = _ok(engine, out, back)
        assert a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"], (a, b)
    finally:
        daemon.stop()


def test_clear_host_is_ordered_after_readers(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache
) -> None:
    fill_random(shm_cache, seed=5)
    before = snapshot(shm_cache)
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        out = engine.swap_out([1, 2], [0, 1])
        back = engine.swap_in([10, 11], [0, 1])
        clear = engine.clear_host()
        zeros = engine.swap_in([12], [1])  # after clear: reads a discarded (zero) block
        _ok(engine, out, back, clear, zeros)
    assert_moved(shm_cache, [10, 11], before, [1, 2])
    for tensor in shm_cache.tensors:
        assert int(tensor.view(torch.uint8)[12].count_nonzero()) == 0


def test_one_batch_many_commands_both_directions(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache
) -> None:
    """One BATCH envelope of single-block swap-outs to scattered host blocks, swap-ins that
    read them back (each waits for its writer in the same envelope) and a multi-block pair:
    the copies of a batch are gathered, the bytes must still be exact and every other block
    unchanged."""
    fill_random(shm_cache, seed=12)
    before = snapshot(shm_cache)
    rng = random.Random(12)
    src, dst = rng.sample(range(0, 20), 14), rng.sample(range(24, 44), 14)
    host = rng.sample(range(0, 400), 14)
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        with engine.batch():
            outs = [engine.swap_out([s], [h]) for s, h in zip(src, host)]
            outs.append(engine.swap_out([20, 21, 22, 5], [401, 402, 403, 410]))
            backs = [engine.swap_in([d], [h]) for d, h in zip(dst, host)]
            backs.append(engine.swap_in([44, 45, 46, 47], [401, 402, 403, 410]))
        _ok(engine, *outs, *backs)
    assert_moved(shm_cache, [*dst, 44, 45, 46, 47], before, [*src, 20, 21, 22, 5])
    assert_untouched(shm_cache, before, [*dst, 44, 45, 46, 47])
