"""An engine's KV cache as a cachexferd device cache, without a staging copy.

The engine's KV cache is handed over as page tensors: one ``[num_blocks, page_bytes]``
view per layer (or per group of layers), all with pages of one size. On CPU, every page
tensor is a view of one buffer, which the integration has allocated in a ShmSegment from
the start (kv_memory.py); the worker attaches the segment with one daemon tensor per page
tensor (``kind: shm``, offsets measured from the segment's start), and the daemon copies
straight between the engine's cache and its host cache. On GPUs the worker exports the
cache over CUDA IPC instead (``cuda`` backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from ...client.shm_segment import ShmSegment
from ...protocol import KVLayout


class KVCacheError(RuntimeError):
    """The engine's KV cache has a shape (or an allocation) the plug-in cannot hand to the daemon."""


def page_layout(tensors: Sequence[torch.Tensor]) -> KVLayout:
    """One daemon 'layer' per page tensor; a block of it is ``page_bytes`` raw bytes."""
    if not tensors:
        raise KVCacheError("the engine registered no KV cache tensors")
    num_blocks, page_bytes = tensors[0].shape
    for t in tensors:
        if t.dim() != 2 or tuple(t.shape) != (num_blocks, page_bytes) or t.stride() != (page_bytes, 1):
            raise KVCacheError(
                f"KV cache tensor of shape {tuple(t.shape)} and stride {t.stride()} is not a contiguous "
                f"[{num_blocks}, {page_bytes}] page array like the first KV tensor: cachexferd moves a block of "
                "every KV-cache group as one page of each tensor, so the tensors' pages must have one size"
            )
    return KVLayout(
        num_layers=len(tensors), kv_tensors=1, num_blocks=int(num_blocks), block_size=1,
        num_kv_heads=1, head_dim=int(page_bytes), dtype="uint8",
    )  # fmt: skip


class PageCache(Protocol):
    """What the worker attaches: a layout, attach handles and a way to let go."""

    layout: KVLayout

    def device_handle(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def cuda_page_cache(tensors: Sequence[torch.Tensor]) -> PageCache:
    """The engine's pages on a GPU, exported to the daemon's cuda backend over CUDA IPC."""
    from ...client.cuda_runner import CudaKVCache

    layout = page_layout(tensors)
    views = [t.view(torch.uint8).view(layout.num_blocks, 1, 1, layout.head_dim) for t in tensors]
    return CudaKVCache.wrap(layout, views)


def page_cache(tensors: Sequence[torch.Tensor], segment: ShmSegment | None = None, *, hint: str = "") -> PageCache:
    """The attachable form of the engine's page tensors: over CUDA IPC on a GPU, else the
    ShmSegment the engine's CPU buffer was allocated in (``segment``). ``hint``: what the
    error says to check when there is no segment (e.g. which engine versions are supported)."""
    if tensors and tensors[0].device.type == "cuda":
        return cuda_page_cache(tensors)
    if segment is None:
        raise KVCacheError(
            "the engine allocated its CPU KV cache outside the plug-in's shared-memory allocation"
            + (f" ({hint})" if hint else "")
        )
    return ShmPageCache(tensors, segment)


class ShmPageCache:
    """The engine's page tensors, all views of one ShmSegment; implements DeviceCacheHandle. The
    daemon maps the segment by descriptor, or (first attach) by a name that exists only
    inside ``exposed()`` (RunnerClient.attach uses it)."""

    def __init__(self, tensors: Sequence[torch.Tensor], segment: ShmSegment) -> None:
        if any(t.device.type != "cpu" for t in tensors):
            raise KVCacheError("ShmPageCache needs CPU tensors")
        self.layout = page_layout(tensors)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        if len(storages) != 1:
            raise KVCacheError(f"KV cache tensors live in {len(storages)} allocations; expected one buffer")
        storage = tensors[0].untyped_storage()
        if storage.nbytes() != segment.size:
            raise KVCacheError(
                f"the engine's KV cache buffer ({storage.nbytes()} bytes) is not the shared-memory segment "
                f"({segment.size} bytes) the plug-in allocated"
            )
        self.segment = segment
        self.offsets = [t.data_ptr() - storage.data_ptr() for t in tensors]
        self.tensors = list(tensors)  # keeps the mapping alive until close

    def exposed(self) -> AbstractContextManager[str | None]:
        return self.segment.exposed()

    def device_handle(self) -> dict[str, Any]:
        return self.segment.device_map(self.offsets)

    def fence_path(self) -> str:
        """What a DeviceFence opens (client/fence.py): the segment anew, through our descriptor."""
        return f"/proc/self/fd/{self.segment.fd}"

    def close(self) -> None:
        self.tensors = []
        self.segment.close()
