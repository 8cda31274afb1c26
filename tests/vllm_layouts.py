"""vLLM 0.32's KV-cache allocation on a GPU, reproduced without vLLM, so the plug-in's CUDA
export can be tested on tensors laid out exactly as vLLM lays them out (tests/vllm checks
this module against vLLM's own code where vLLM is installed).

What vLLM 0.32 does (vllm/v1/kv_cache_layout.py, vllm/v1/kv_cache_interface.py
``compute_layout_strides`` and ``create_kv_cache_views``, vllm/v1/core/kv_cache_utils.py):
the layers of one KV-cache group share one int8 buffer, seen as the logical
``[L, B, H, N, C]`` — layers, blocks, KV heads, tokens of a block, and C = one token's K
then V bytes (``(head_size + head_size_v) x dtype bytes``; so K and V of a block share one
page) — stored in the physical order the resolved ``KVCacheLayout`` names. Each attention
layer gets the 4D view ``[B, H, N, C]`` (in its dtype); FlashAttention splits it into K and
V along C. The offloading connector
(vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py ``register_kv_caches``)
hands an offloading spec int8 ``[num_blocks, page]`` tensors: one per layer for
layer-outermost layouts, or, for block-outermost ones (a block holds every layer's page),
one ``[num_blocks, L x page]`` tensor over the whole buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Physical order of the logical axes [L, B, H, N, C] (vllm/v1/kv_cache_layout.py). LHBNC is
# left out: its pages are not contiguous, and vLLM's offloading connector cannot offload it.
LAYOUTS = {
    "LBNHC": (0, 1, 3, 2, 4),  # layer-outermost, tokens before heads (FlashAttention's first choice)
    "LBHNC": (0, 1, 2, 3, 4),  # layer-outermost, head-major block interiors (FlashInfer on Blackwell)
    "BLNHC": (1, 0, 3, 2, 4),  # block-outermost: a block holds every layer's page
    "BLHNC": (1, 0, 2, 3, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True)
class VllmShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:
        """C: one token's K and V of one head."""
        return 2 * self.head_size * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * self.token_bytes

    @property
    def logical(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_blocks, self.num_kv_heads, self.block_size, self.token_bytes)


def byte_strides(shape: VllmShape, layout: str) -> tuple[int, ...]:
    """Strides in bytes of the logical [L, B, H, N, C] axes, dense in the physical order."""
    strides = [0] * 5
    step = 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = step
        step *= shape.logical[axis]
    return tuple(strides)


def block_outermost(layout: str) -> bool:
    return LAYOUTS[layout][0] == 1


@dataclass
class VllmCache:
    raw: torch.Tensor  # the one buffer, one element per byte
    layers: list[torch.Tensor]  # per layer [B, H, N, C bytes] views of raw
    canonical: list[torch.Tensor]  # what the offloading connector hands the plug-in

    def kv(self, layer: int, dtype: torch.dtype, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, [B, H, N, head_size] each, as FlashAttention splits them."""
        typed = self.layers[layer].view(dtype)
        return typed[..., :head_size], typed[..., head_size:]


def views(raw: torch.Tensor, shape: VllmShape, layout: str) -> VllmCache:
    """vLLM's views of ``raw`` (1-D, one element per byte: int8 as vLLM allocates it, or any
    integer type for address checks)."""
    strides = byte_strides(shape, layout)
    five = torch.as_strided(raw, shape.logical, strides)
    layers = [five[layer] for layer in range(shape.num_layers)]
    page, nb = shape.page_bytes, shape.num_blocks
    if block_outermost(layout):
        block = strides[1]
        canonical = [torch.as_strided(raw, (nb, block), (block, 1), 0)]
    else:
        assert strides[1] == page, "a layer-outermost page is one contiguous run"
        layer_stride = strides[0]
        canonical = [torch.as_strided(raw, (nb, page), (page, 1), i * layer_stride) for i in range(shape.num_layers)]
    return VllmCache(raw, layers, canonical)


def allocate(shape: VllmShape, layout: str, device: str | torch.device) -> VllmCache:
    """The int8 buffer vLLM allocates for a group of layers, and its views."""
    total = shape.num_layers * shape.num_blocks * shape.page_bytes
    return views(torch.zeros(total, dtype=torch.int8, device=device), shape, layout)
