"""The vLLM plug-in's CUDA attach on a GPU, without vLLM: the plug-in's own export
(``cuda_page_cache``, which ``CachexferdOffloadingSpec.get_worker`` calls with what vLLM's
offloading connector hands it) on KV caches laid out exactly as vLLM 0.32 allocates them on
a GPU (tests/vllm_layouts.py, checked against vLLM's code in tests/vllm), through a real
cuda daemon: K and V of every layer exact after a swap-out and a swap-in, every other block
unchanged."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from cachexferd.client import EngineClient, RunnerClient
from cachexferd.integrations.engine.shm_cache import cuda_page_cache
from cachexferd.launch import DaemonProcess

from ..vllm_layouts import LAYOUTS, VllmShape, allocate

pytestmark = pytest.mark.cuda

# A GQA model's rank at TP=8: one KV head, 16-token blocks, head size 128, bf16 (4 KiB per
# layer's K or V of a block), and a second shape with two heads in fp8.
SHAPES = {
    "bf16-1head": VllmShape(num_layers=8, num_blocks=256, block_size=16, num_kv_heads=1, head_size=128,
                            dtype=torch.bfloat16),
    "fp8-2heads": VllmShape(num_layers=4, num_blocks=128, block_size=16, num_kv_heads=2, head_size=64,
                            dtype=torch.float8_e4m3fn),
}  # fmt: skip


@pytest.fixture
def engine_for() -> Iterator[Callable[[str], EngineClient]]:
    made: list[EngineClient] = []

    def make(endpoint: str) -> EngineClient:
        client = EngineClient([endpoint], timeout_s=60)
        client.connect()
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def _block(cache: Any, layer: int, block: int, shape: VllmShape) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = cache.kv(layer, torch.uint8 if shape.dtype.itemsize == 1 else shape.dtype, shape.head_size)
    return k[block].contiguous().view(torch.uint8).cpu(), v[block].contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("method", ["auto", "dma"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape_name", sorted(SHAPES))
def test_vllm_cuda_cache_round_trip_through_a_daemon(
    spawn_daemon: Callable[..., DaemonProcess], engine_for: Any, shape_name: str, layout: str, method: str
) -> None:
    """A daemon per layout (its host cache keeps the first layout it serves, as with one
    model per daemon): attached, swapped out and in, detached, and attached again."""
    shape = SHAPES[shape_name]
    settings = {"daemon.backend": "cuda", "host_cache.capacity": "64MiB", "cuda.pin_chunk": "8MiB",
                "cuda.copy_method": method}  # fmt: skip
    daemon = spawn_daemon(settings=settings)
    engine = engine_for(daemon.endpoint)
    with RunnerClient(daemon.endpoint) as runner:
        for _ in range(2):  # a re-attach of the same layout (a restarted runner) is served too
            _round_trip(runner, engine, shape, layout)


def _round_trip(runner: RunnerClient, engine: EngineClient, shape: VllmShape, layout: str) -> None:
    cache = allocate(shape, layout, "cuda:0")
    gen = torch.Generator(device="cuda:0").manual_seed(len(layout))
    cache.raw.copy_(torch.randint(-128, 128, cache.raw.shape, dtype=torch.int8, device="cuda:0", generator=gen))
    torch.cuda.synchronize()  # the daemon does not order against this process's streams
    before = cache.raw.cpu()
    rng = random.Random(3)
    src = rng.sample(range(shape.num_blocks // 2), 40)
    dst = rng.sample(range(shape.num_blocks // 2, shape.num_blocks), 40)
    host = rng.sample(range(64), 40)
    original = {(layer, b): _block(cache, layer, b, shape) for layer in range(shape.num_layers) for b in src}

    handle = cuda_page_cache(cache.canonical)  # the plug-in's export, as its worker calls it
    with runner.attached(handle):
        out, back = engine.swap_out(src, host), engine.swap_in(dst, host)  # pipelined: back reads what out wrote
        done = engine.wait([out, back], timeout_s=60)
        assert all(done[r].ok for r in (out, back)), [done[r].describe() for r in (out, back)]

    for layer in range(shape.num_layers):
        for s, d in zip(src, dst):
            k, v = _block(cache, layer, d, shape)
            assert torch.equal(k, original[(layer, s)][0]), f"{layout}: layer {layer} K of block {d} != block {s}"
            assert torch.equal(v, original[(layer, s)][1]), f"{layout}: layer {layer} V of block {d} != block {s}"
    after, then = allocate(shape, layout, "cpu"), allocate(shape, layout, "cpu")
    after.raw.copy_(cache.raw.cpu())
    then.raw.copy_(before)
    untouched = [b for b in range(shape.num_blocks) if b not in dst]
    for layer in range(shape.num_layers):
        assert torch.equal(after.layers[layer][untouched], then.layers[layer][untouched]), f"{layout}: layer {layer}"
