"""Facts about a runner's CUDA KV tensors that both the runner helper (client) and the cuda
backend need: whether a list of tensors fits a layout, and a device's UUID.

Shared by both sides so that neither imports the other; torch is imported only inside the
functions that need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .protocol import KVLayout
from .protocol.cuda_ipc import normalize_uuid

if TYPE_CHECKING:
    import torch


def check_runner_tensors(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> None:
    """Raises ValueError unless ``tensors`` are the layout's tensors: one CUDA device, each
    contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]`` of the layout's dtype."""
    shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if len(tensors) != layout.num_tensors:
        raise ValueError(f"layout needs {layout.num_tensors} tensors, got {len(tensors)}")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device or t.device.type != "cuda":
            raise ValueError(f"tensor {i} is on {t.device}; every tensor must be on one CUDA device ({device})")
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"tensor {i} must be contiguous with shape {shape}, got {tuple(t.shape)}")
        if str(t.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"tensor {i} has dtype {t.dtype}, layout says {layout.dtype}")


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index`` (the name the daemon checks)."""
    import torch

    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))
