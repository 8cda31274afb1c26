"""tests/vllm_layouts.py (how the CUDA export tests lay out vLLM's KV cache without vLLM)
against vLLM 0.32's own allocation code: the same per-layer views, byte for byte."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..vllm_layouts import LAYOUTS, VllmShape, allocate, byte_strides

SHAPE = VllmShape(num_layers=3, num_blocks=10, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_our_layout_is_vllms(layout: str) -> None:
    assert KVCacheLayout[layout].stride_order == LAYOUTS[layout]
    spec = FullAttentionSpec(
        block_size=SHAPE.block_size, num_kv_heads=SHAPE.num_kv_heads, head_size=SHAPE.head_size, dtype=SHAPE.dtype
    )
    assert spec.page_size_bytes == SHAPE.page_bytes
    strides = compute_layout_strides(spec, SHAPE.num_blocks, SHAPE.num_layers, KVCacheLayout[layout])
    assert tuple(strides) == byte_strides(SHAPE, layout)
    ours = allocate(SHAPE, layout, "cpu")
    placement = KVCacheTensor(
        size=ours.raw.numel(), layers=[f"l{i}" for i in range(SHAPE.num_layers)],
        layer_stride=strides[0], block_stride=strides[1],
    )  # fmt: skip
    theirs = create_kv_cache_views(ours.raw, spec, SHAPE.num_blocks, KVCacheLayout[layout], placement)
    for layer, view in enumerate(theirs):
        mine = ours.layers[layer].view(SHAPE.dtype)
        assert view.data_ptr() == mine.data_ptr() and view.shape == mine.shape and view.stride() == mine.stride()
