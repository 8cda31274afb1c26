"""vLLM's CPU KV cache as a cachexferd device cache, without a staging copy.

On CPU, vLLM allocates every layer's KV cache as a view of one ``torch.zeros`` buffer and
hands the offloading worker one ``[num_blocks, page_bytes]`` int8 view per layer. The cpu
backend needs the runner's cache in a named POSIX shared-memory file, so the plug-in moves
that buffer's storage into shared memory *in place* (``UntypedStorage._share_filename_cpu_``,
a private torch API: torch copies the bytes into a new ``/dev/shm/torch_*`` file and swaps
the storage's data pointer, so every view vLLM holds stays valid). Torch's file starts with
a 64-byte header; the tensor offsets handed to the daemon are measured from the file start.
docs/vllm.md explains why this beats a staging area (measured there).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ...protocol import KVLayout

SHM_DIR = "/dev/shm"


class VllmCacheError(RuntimeError):
    """vLLM's KV cache has a shape this plug-in cannot hand to the daemon."""


def page_layout(tensors: Sequence[torch.Tensor]) -> KVLayout:
    """One daemon 'layer' per vLLM page tensor; a block of it is ``page_bytes`` raw bytes."""
    if not tensors:
        raise VllmCacheError("vLLM registered no KV cache tensors")
    num_blocks, page_bytes = tensors[0].shape
    for t in tensors:
        if t.dim() != 2 or tuple(t.shape) != (num_blocks, page_bytes) or t.stride() != (page_bytes, 1):
            raise VllmCacheError(
                f"KV cache tensor of shape {tuple(t.shape)} and stride {t.stride()} is not a contiguous "
                f"[{num_blocks}, {page_bytes}] page array (packed or hybrid layouts are not supported)"
            )
    return KVLayout(
        num_layers=len(tensors), kv_tensors=1, num_blocks=int(num_blocks), block_size=1,
        num_kv_heads=1, head_dim=int(page_bytes), dtype="uint8",
    )  # fmt: skip


def _shared_file(storage: torch.UntypedStorage) -> tuple[str, int]:
    """Moves ``storage`` into a named shared-memory file (once); returns (name, data offset)."""
    _manager, handle, size = storage._share_filename_cpu_()
    name = handle.decode().lstrip("/")
    file_size = os.stat(os.path.join(SHM_DIR, name)).st_size
    header = file_size - size
    if header < 0 or header > 4096:
        raise VllmCacheError(f"unexpected shared-memory file {name}: {file_size} bytes for a {size}-byte storage")
    return name, header


class PageCache(Protocol):
    """What the worker attaches: a layout, attach handles and a way to let go."""

    layout: KVLayout

    def device_handle(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def cuda_page_cache(tensors: Sequence[torch.Tensor]) -> PageCache:
    """vLLM's pages on a GPU, exported to the daemon's cuda backend over CUDA IPC."""
    from ...client.cuda_runner import CudaKVCache

    layout = page_layout(tensors)
    views = [t.view(torch.uint8).view(layout.num_blocks, 1, 1, layout.head_dim) for t in tensors]
    return CudaKVCache.wrap(layout, views)


def page_cache(tensors: Sequence[torch.Tensor]) -> PageCache:
    if tensors and tensors[0].device.type == "cuda":
        return cuda_page_cache(tensors)
    return VllmShmCache(tensors)


class VllmShmCache:
    """vLLM's page tensors, now in one shared-memory file; implements DeviceCacheHandle."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if any(t.device.type != "cpu" for t in tensors):
            raise VllmCacheError("VllmShmCache needs CPU tensors")
        self.layout = page_layout(tensors)
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        if len(storages) != 1:
            raise VllmCacheError(f"KV cache tensors live in {len(storages)} allocations; expected vLLM's one buffer")
        storage = tensors[0].untyped_storage()
        base_before = storage.data_ptr()
        relative = [t.data_ptr() - base_before for t in tensors]
        self.name, header = _shared_file(storage)
        self.offsets = [header + r for r in relative]
        self.tensors = list(tensors)  # keeps the storage (and so the file) alive until close

    def device_handle(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.name, "offsets": list(self.offsets)}

    def close(self) -> None:
        self.tensors = []
