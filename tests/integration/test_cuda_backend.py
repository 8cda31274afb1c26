"""The cuda backend on a real GPU (skipped without one).

Two tiers: in-process swaps through ``CudaBackend.local_device_cache`` (checks the host
bytes directly, every dtype, every copy method, K/V as two tensors per layer in one buffer
or in separate allocations, or K|V in one page per layer; one direction and both at once),
and a real daemon
subprocess importing this process's cache over CUDA IPC (pipelined ordering, 1000
attach/detach cycles without leaks, detach with copies in flight, refused attaches)."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from cachexferd.client import ClientError, EngineClient, RunnerClient
from cachexferd.client.cuda_runner import CudaKVCache
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import DTYPE_BYTES, ErrorCode, KVLayout

from ..helpers import (
    assert_matches_model,
    assert_moved,
    assert_untouched,
    fill_random,
    snapshot,
    submit_random_pipeline,
)

pytestmark = pytest.mark.cuda

Spawn = Callable[..., DaemonProcess]
MIB = 1 << 20
BASE = KVLayout(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def layout_for(dtype: str, **changes: int) -> KVLayout:
    """Same bytes per block whatever the dtype (4 KiB chunks for BASE)."""
    fields: dict[str, Any] = {**BASE.to_wire(), "dtype": dtype, "head_dim": 128 // DTYPE_BYTES[dtype], **changes}
    return KVLayout(**fields)


def ids_for(pattern: str, n: int, seed: int, device_blocks: int, host_blocks: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    if pattern == "contiguous":
        return list(range(2, 2 + n)), list(range(7, 7 + n))
    return rng.sample(range(device_blocks), n), rng.sample(range(host_blocks), n)


# In-process: CudaBackend.local_device_cache -----------------------------------------------


METHODS = ["dma", "staging", "kernel", "auto"]
PLACEMENTS = {"one_buffer": (True, 2), "per_tensor": (False, 2), "kv_page": (True, 1)}


@pytest.fixture(scope="module", params=METHODS)
def local_backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    from cachexferd.backends.cuda.backend import CudaBackend
    from cachexferd.config import load_config

    config = load_config(overrides={"cuda.copy_method": request.param, "cuda.pin_chunk": "8MiB"}, environ={})
    backend = CudaBackend(config.cuda, rank=0)
    if request.param in ("kernel", "auto"):
        assert backend.kernel is not None, "Triton did not load: the kernel method would not be tested"
    yield backend
    backend.close()


def _swap(cache: Any, direction: Any, device_ids: list[int], host_ids: list[int]) -> int:
    from cachexferd.backends.base import CancelToken

    async def run() -> int:
        moved: int = await asyncio.wait_for(cache.swap(direction, device_ids, host_ids, CancelToken()), 60)
        return moved

    return asyncio.run(run())


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
def test_local_swaps_exact_host_bytes(local_backend: Any, dtype: str, placement: str, pattern: str) -> None:
    from cachexferd.backends.base import Direction

    one_allocation, kv = PLACEMENTS[placement]
    layout = layout_for(dtype, kv_tensors=kv)
    pool = local_backend.create_host_pool(32 * MIB)
    geometry = pool.geometry(layout.host_block_bytes)
    with CudaKVCache(layout, "cuda:0", one_allocation=one_allocation) as kv:
        fill_random(kv, seed=DTYPE_BYTES[dtype])
        pool.tensor.fill_(0xA5)
        cache = local_backend.local_device_cache(layout, kv.tensors, pool, geometry)
        src, host = ids_for(pattern, 12, 3, layout.num_blocks // 2, geometry.num_blocks)
        before = snapshot(kv)
        assert _swap(cache, Direction.D2H, src, host) == 12 * layout.host_block_bytes
        blocks = pool.blocks(geometry, layout.num_tensors)
        for t in range(layout.num_tensors):
            for d, h in zip(src, host):
                assert torch.equal(blocks[h, t], before[t][d].reshape(-1).cpu()), f"host block {h} tensor {t}"
        untouched = torch.ones(geometry.num_blocks, dtype=torch.bool)
        untouched[host] = False
        assert bool((blocks[untouched] == 0xA5).all()), "swap-out wrote outside its host blocks"
        dst = [layout.num_blocks // 2 + i for i in range(12)]
        _swap(cache, Direction.H2D, dst, host)
        assert_moved(kv, dst, before, src)
        assert_untouched(kv, before, dst)
        expected = local_backend.config.copy_method
        if expected != "auto":
            assert cache.methods[expected] == 2, cache.methods
        cache.close()
    pool.close()


def test_local_swap_waits_for_pinning_and_honours_cancel(local_backend: Any) -> None:
    from cachexferd.backends.base import CancelToken, Direction
    from cachexferd.protocol import ProtocolError

    layout = layout_for("bfloat16")
    pool = local_backend.create_host_pool(512 * MIB)  # 64 chunks of 8 MiB: pinning takes a while
    geometry = pool.geometry(layout.host_block_bytes)
    with CudaKVCache(layout, "cuda:0") as kv:
        fill_random(kv, seed=1)
        cache = local_backend.local_device_cache(layout, kv.tensors, pool, geometry)
        last = geometry.num_blocks - 1
        _swap(cache, Direction.D2H, [5], [last])  # waits until the last chunk is pinned
        assert pool.ready_bytes == pool.capacity
        assert torch.equal(pool.blocks(geometry, layout.num_tensors)[last, 0], kv.block_bytes(0, 5).cpu())
        token = CancelToken()
        token.cancel(ErrorCode.DETACHED, "cancelled before start")
        with pytest.raises(ProtocolError):
            asyncio.run(cache.swap(Direction.H2D, [1, 2], [3, 4], token))
        cache.close()
    pool.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
@pytest.mark.parametrize("pattern", ["contiguous", "scattered"])
def test_local_both_directions_at_once(local_backend: Any, dtype: str, pattern: str) -> None:
    """Swap-out of some blocks while others are swapped in from different host blocks:
    both exact, nothing else touched (auto takes staging for the direction that starts
    second, so at least one goes through the copy engines)."""
    from cachexferd.backends.base import CancelToken, Direction

    layout = layout_for(dtype, num_blocks=512)
    pool = local_backend.create_host_pool(64 * MIB)
    geometry = pool.geometry(layout.host_block_bytes)
    blocks = pool.blocks(geometry, layout.num_tensors)
    with CudaKVCache(layout, "cuda:0") as kv:
        fill_random(kv, seed=4)
        cache = local_backend.local_device_cache(layout, kv.tensors, pool, geometry)
        out_dev, out_host = ids_for(pattern, 200, 1, 256, 256)
        in_dev = [256 + d for d in ids_for(pattern, 200, 2, 256, 256)[0]]
        in_host = [256 + h for h in ids_for(pattern, 200, 3, 256, 256)[1]]
        gen = torch.Generator().manual_seed(9)
        blocks[256:512].copy_(torch.randint(0, 256, tuple(blocks[256:512].shape), dtype=torch.uint8, generator=gen))
        host_before, before = blocks.clone(), snapshot(kv)

        async def both() -> None:
            out = cache.swap(Direction.D2H, out_dev, out_host, CancelToken())
            back = cache.swap(Direction.H2D, in_dev, in_host, CancelToken())
            await asyncio.wait_for(asyncio.gather(out, back), 60)

        asyncio.run(both())
        for t in range(layout.num_tensors):
            for d, h in zip(out_dev, out_host):
                assert torch.equal(blocks[h, t], before[t][d].reshape(-1).cpu()), f"swap-out: tensor {t} block {d}"
            for d, h in zip(in_dev, in_host):
                assert torch.equal(kv.block_bytes(t, d).cpu(), host_before[h, t]), f"swap-in: tensor {t} block {d}"
        assert_untouched(kv, before, in_dev)
        keep = sorted(set(range(geometry.num_blocks)) - set(out_host))
        assert torch.equal(blocks[keep], host_before[keep]), "a host block outside the swap-out changed"
        print(f"{local_backend.config.copy_method}: units by method {cache.methods}")
        if local_backend.config.copy_method == "auto":
            assert cache.methods["staging"] > 0, "auto should stage while the other direction runs"
        cache.close()
    pool.close()


def test_the_driver_uses_its_fast_paths(local_backend: Any) -> None:
    """The doorbell is written by the stream, the kernel launched through its compiled entry,
    host runs copied by one batched call (CUDA 12.8 and later): each was checked on this
    device when the driver was made, and a fallback here is a finding, not a failure of the
    bytes (the other tests check those)."""
    if local_backend.config.copy_method == "dma":
        pytest.skip("no kernel with copy_method dma")
    layout = layout_for("bfloat16")
    pool = local_backend.create_host_pool(32 * MIB)
    with CudaKVCache(layout, "cuda:0") as kv:
        cache = local_backend.local_device_cache(layout, kv.tensors, pool, pool.geometry(layout.host_block_bytes))
        driver = local_backend.describe()["driver"]
        cache.close()
    pool.close()
    assert driver["doorbell"] == "cuStreamWriteValue64", driver
    assert driver["kernel"]["compiled"] >= 1 and driver["kernel"]["dispatch"] == 0, driver
    version = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if version >= (12, 8):
        assert driver["batched_copy"] == "cuMemcpyBatchAsync", driver


# Through a daemon subprocess (CUDA IPC) ---------------------------------------------------


def cuda_daemon(spawn: Spawn, **settings: Any) -> DaemonProcess:
    base = {"daemon.backend": "cuda", "host_cache.capacity": "64MiB", "cuda.pin_chunk": "8MiB"}
    daemon: DaemonProcess = spawn(settings={**base, **{k.replace("__", "."): v for k, v in settings.items()}})
    return daemon


@pytest.fixture
def engine_factory() -> Iterator[Callable[[str], EngineClient]]:
    made: list[EngineClient] = []

    def make(endpoint: str) -> EngineClient:
        client = EngineClient([endpoint], timeout_s=60)
        client.connect()
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def _ok(engine: EngineClient, *req_ids: int) -> None:
    done = engine.wait(req_ids, timeout_s=60)
    for req_id in req_ids:
        assert done[req_id].ok, done[req_id].describe()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_ipc_round_trip_exact(spawn_daemon: Spawn, engine_factory: Any, method: str, dtype: str) -> None:
    daemon = cuda_daemon(spawn_daemon, cuda__copy_method=method)
    engine = engine_factory(daemon.endpoint)
    layout = layout_for(dtype)
    with (
        CudaKVCache(layout, "cuda:0", one_allocation=dtype != "float32") as kv,
        RunnerClient(daemon.endpoint) as runner,
    ):
        fill_random(kv, seed=7)
        torch.cuda.synchronize()  # the daemon does not order against this process's streams
        with runner.attached(kv):
            assert runner.status()["device"]["mappings"] >= 1
            for pattern in ("contiguous", "scattered"):
                before = snapshot(kv)
                src, host = ids_for(pattern, 10, 5, 32, 1024)
                dst = [32 + i for i in range(10)]
                out, back = engine.swap_out(src, host), engine.swap_in(dst, host)  # pipelined
                _ok(engine, out, back)
                assert_moved(kv, dst, before, src)
                assert_untouched(kv, before, dst)


def test_ipc_pipelined_same_block_ordering(spawn_daemon: Spawn, engine_factory: Any) -> None:
    """Hundreds of conflicting pipelined swaps end exactly as if run one by one."""
    daemon = cuda_daemon(spawn_daemon)
    engine = engine_factory(daemon.endpoint)
    layout = layout_for("bfloat16")
    with CudaKVCache(layout, "cuda:0") as kv, RunnerClient(daemon.endpoint) as runner:
        fill_random(kv, seed=11)
        torch.cuda.synchronize()
        original = snapshot(kv)
        with runner.attached(kv):
            req_ids, expected = submit_random_pipeline(engine, random.Random(11), layout.num_blocks, 24)
            _ok(engine, *req_ids)
        assert_matches_model(kv, original, expected)


def _free_everything() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()  # frees exported blocks whose counters the daemon released
    torch.cuda.empty_cache()


@pytest.mark.slow
@pytest.mark.alone
def test_thousand_attach_detach_cycles_leak_nothing(spawn_daemon: Spawn, engine_factory: Any) -> None:
    daemon = cuda_daemon(spawn_daemon, cuda__copy_method="dma")
    engine = engine_factory(daemon.endpoint)
    layout = layout_for("bfloat16", num_blocks=8192)  # 8 tensors x 32 MiB
    size = layout.num_tensors * layout.tensor_bytes
    with RunnerClient(daemon.endpoint) as runner:
        with CudaKVCache(layout, "cuda:0") as warm:  # the daemon's context and streams exist from here on
            runner.attach(warm)
            _ok(engine, engine.swap_out([0], [0]))
            runner.detach()
        _free_everything()
        reserved0, free0 = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
        kv = CudaKVCache(layout, "cuda:0")
        for cycle in range(1000):
            if cycle and cycle % 100 == 0:  # an RL weight update: free and reallocate
                kv.close()
                kv = CudaKVCache(layout, "cuda:0")
            runner.attach(kv)
            if cycle % 50 == 0:  # the re-imported memory is the runner's current cache
                fill_random(kv, seed=cycle)
                torch.cuda.synchronize()
                want = [kv.block_bytes(t, d).clone() for t in range(layout.num_tensors) for d in (1, 2, 3)]
                _ok(engine, engine.swap_out([1, 2, 3], [4, 5, 6]), engine.swap_in([10, 11, 12], [4, 5, 6]))
                got = [kv.block_bytes(t, d) for t in range(layout.num_tensors) for d in (10, 11, 12)]
                assert all(torch.equal(a, b) for a, b in zip(got, want)), f"cycle {cycle}: wrong bytes"
                del want, got
            runner.detach()
            assert runner.status()["device"]["state"] == "detached"
        kv.close()
        del kv
        _free_everything()
        assert torch.cuda.memory_reserved() == reserved0, "exported memory still held: a ref counter was not released"
        leaked = free0 - torch.cuda.mem_get_info()[0]
        assert leaked < size // 4, f"{leaked} bytes of device memory not returned: an IPC mapping is still open"
    assert "still referenced" not in daemon.log_tail(200)


def test_detach_while_copies_in_flight(spawn_daemon: Spawn, engine_factory: Any) -> None:
    daemon = cuda_daemon(spawn_daemon, host_cache__capacity="512MiB")
    engine = engine_factory(daemon.endpoint)
    layout = layout_for("bfloat16", num_blocks=16384)  # 8 tensors x 64 MiB
    ids = list(range(8192))
    with RunnerClient(daemon.endpoint) as runner:
        _free_everything()
        reserved0 = torch.cuda.memory_reserved()
        kv = CudaKVCache(layout, "cuda:0")
        runner.attach(kv)
        req_ids = [engine.swap_out(ids, ids) if i % 2 else engine.swap_in(ids, ids) for i in range(12)]
        reply = runner.detach(drain_timeout_s=0.0)
        assert reply["state"] == "detached"
        kv.close()  # the runner may free the memory the moment detach replies
        del kv
        done = engine.wait(req_ids, timeout_s=60)
        codes = {ErrorCode(o.code) for c in done.values() for o in c.outcomes.values()}
        assert len(done) == len(req_ids) and codes <= {ErrorCode.OK, ErrorCode.DETACHED}, codes
        assert ErrorCode.DETACHED in codes, "detach with drain 0 should have cancelled queued swaps"
        _free_everything()
        assert torch.cuda.memory_reserved() == reserved0, "a cancelled swap kept the runner's memory referenced"
        with CudaKVCache(layout_for("bfloat16", num_blocks=16384), "cuda:0") as again, runner.attached(again):
            fill_random(again, seed=3)
            torch.cuda.synchronize()
            before = snapshot(again)
            _ok(engine, engine.swap_out([0, 1], [0, 1]), engine.swap_in([5, 6], [0, 1]))
            assert_moved(again, [5, 6], before, [0, 1])


def test_refused_attach_releases_the_runners_memory(spawn_daemon: Spawn) -> None:
    daemon = cuda_daemon(spawn_daemon)
    layout = layout_for("bfloat16", num_blocks=4096)
    _free_everything()
    reserved0 = torch.cuda.memory_reserved()
    with RunnerClient(daemon.endpoint) as runner:
        kv = CudaKVCache(layout, "cuda:0")
        handle = kv.device_handle()
        handle["device_uuid"] = "GPU-00000000-0000-0000-0000-000000000000"

        class Foreign:
            def __init__(self) -> None:
                self.layout = layout

            def device_handle(self) -> dict[str, Any]:
                return handle

        with pytest.raises(ClientError) as info:
            runner.attach(Foreign())
        assert info.value.code == ErrorCode.ATTACH_FAILED
        kv.close()
        del kv
        _free_everything()
        assert torch.cuda.memory_reserved() == reserved0, "the refused attach left a ref counter unreleased"


def test_status_answers_at_once_while_pinning(spawn_daemon: Spawn) -> None:
    started = time.monotonic()
    daemon = cuda_daemon(spawn_daemon, host_cache__capacity="8GiB", cuda__pin_chunk="256MiB")
    first = time.monotonic() - started
    status = daemon.status(5)
    pinning = status["backend"]["pinning"][0]
    assert status["host_cache"]["capacity_bytes"] == 8 << 30
    deadline = time.monotonic() + 120
    while not status["host_cache"]["pinned"] and time.monotonic() < deadline:
        asked = time.monotonic()
        status = daemon.status(5)
        assert time.monotonic() - asked < 1.0, "status was slow while pinning"
        time.sleep(0.2)
    pinning = status["backend"]["pinning"][0]
    assert status["host_cache"]["pinned"] and pinning["done"] and pinning["error"] is None, pinning
    print(f"first status after {first:.2f}s; pinned 8 GiB in {pinning['seconds']}s")
