"""The vLLM plug-in's CUDA export, the parts that need no GPU: for every layout vLLM 0.32 may
allocate (tests/vllm_layouts.py), the tensors its offloading connector hands over cover
exactly the K and V bytes of each block, and the plug-in derives the daemon layout whose
host block is every layer's K and V of one block."""

from __future__ import annotations

import pytest
import torch

from cachexferd.integrations.engine.shm_cache import page_layout

from ..vllm_layouts import LAYOUTS, VllmShape, block_outermost, views

SHAPE = VllmShape(num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_canonical_blocks_hold_exactly_the_kv_bytes_of_that_block(layout: str) -> None:
    total = SHAPE.num_layers * SHAPE.num_blocks * SHAPE.page_bytes
    cache = views(torch.arange(total, dtype=torch.int64), SHAPE, layout)  # each element: its byte address
    for block in range(SHAPE.num_blocks):
        kv_bytes = torch.cat([layer[block].reshape(-1) for layer in cache.layers]).sort().values
        canonical = torch.cat([t[block].reshape(-1) for t in cache.canonical]).sort().values
        assert torch.equal(canonical, kv_bytes), f"{layout}: block {block}"
    assert len(torch.cat([t.reshape(-1) for t in cache.canonical]).unique()) == total, "pages overlap"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_plugin_layout_for_vllm_pages(layout: str) -> None:
    cache = views(torch.zeros(SHAPE.num_layers * SHAPE.num_blocks * SHAPE.page_bytes, dtype=torch.int8), SHAPE, layout)
    derived = page_layout(cache.canonical)
    packed = block_outermost(layout)
    assert derived.num_layers == (1 if packed else SHAPE.num_layers) and derived.kv_tensors == 1
    assert derived.num_blocks == SHAPE.num_blocks and derived.dtype == "uint8"
    assert derived.host_block_bytes == SHAPE.num_layers * SHAPE.page_bytes  # every layer's K and V of a block
    assert derived.chunk_bytes == (SHAPE.num_layers * SHAPE.page_bytes if packed else SHAPE.page_bytes)


def test_flashattention_reads_k_and_v_from_one_page() -> None:
    """K and V of a token share a page: C is K's bytes then V's (what FlashAttention splits)."""
    cache = views(torch.zeros(SHAPE.num_layers * SHAPE.num_blocks * SHAPE.page_bytes, dtype=torch.int8), SHAPE, "LBNHC")
    k, v = cache.kv(1, SHAPE.dtype, SHAPE.head_size)
    assert k.shape == v.shape == (SHAPE.num_blocks, SHAPE.num_kv_heads, SHAPE.block_size, SHAPE.head_size)
    assert v.data_ptr() - k.data_ptr() == SHAPE.head_size * 2
