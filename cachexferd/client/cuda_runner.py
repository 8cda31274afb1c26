"""Model-runner helper for the cuda backend: a KV cache on this process's GPU that the
local daemon imports over CUDA IPC.

    cache = CudaKVCache(layout, device="cuda:0")          # or CudaKVCache.wrap(layout, my_tensors)
    with RunnerClient(endpoint) as runner, runner.attached(cache):
        ...                                              # the engine swaps blocks
        with runner.released(cache):                     # RL weight update: daemon lets go first
            reload_weights()

``device_handle()`` exports the tensors afresh on every call (one torch IPC ref counter per
storage, which the daemon releases exactly once), so hand it to exactly one attach; that is
what RunnerClient.attach does. Keep the tensors alive until detach has replied; after that
they may be freed or reallocated. Ordering: the daemon does not wait for this process's
streams, so send a swap-out only after the kernels that wrote those blocks have finished
(engines do this at their step boundary).

Importing this module does not import torch; creating a cache does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..cuda_tensors import check_runner_tensors, device_uuid
from ..protocol import KVLayout
from ..protocol.cuda_ipc import SharedStorage, TensorRef, encode_device
from .runner import KVTensors, torch_dtype

if TYPE_CHECKING:
    import torch


def export_storage(storage: torch.UntypedStorage) -> SharedStorage:
    """One ``_share_cuda_`` call: bumps torch's ref counter, which the daemon releases."""
    (_, handle, size, offset, ref_counter, ref_counter_offset, event, event_sync) = storage._share_cuda_()
    return SharedStorage(
        handle=bytes(handle),
        offset=int(offset),
        size=int(size),
        ref_counter=bytes(ref_counter),
        ref_counter_offset=int(ref_counter_offset),
        event=bytes(event) if event_sync else b"",
        event_sync=bool(event_sync),
    )


def export_tensors(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The attach ``device`` map for tensors allocated in this process: each distinct
    storage exported once, each tensor as (storage index, byte offset)."""
    check_runner_tensors(layout, tensors)
    by_storage: dict[int, int] = {}
    storages: list[SharedStorage] = []
    refs: list[TensorRef] = []
    for tensor in tensors:
        untyped = tensor.untyped_storage()
        base = untyped.data_ptr()
        if base not in by_storage:
            by_storage[base] = len(storages)
            storages.append(export_storage(untyped))
        refs.append(TensorRef(by_storage[base], tensor.data_ptr() - base))
    return encode_device(device_uuid(tensors[0].device.index or 0), storages, refs)


class CudaKVCache(KVTensors):
    """``num_layers * kv_tensors`` tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    By default they are views of one allocation, evenly spaced, which lets the daemon move
    a block of every layer with one DMA call; ``one_allocation=False`` allocates each tensor
    on its own (as engines that allocate per layer do).
    """

    def __init__(self, layout: KVLayout, device: Any = "cuda", *, one_allocation: bool = True) -> None:
        import torch

        given = torch.device(device)
        if given.type != "cuda":
            raise ValueError(f"CudaKVCache needs a CUDA device, got {given}")
        index: int | None = given.index  # None for plain "cuda" (torch's stubs say int)
        target = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.layout = layout
        self.device = target
        shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        dtype = torch_dtype(layout.dtype)
        if one_allocation:
            flat = torch.zeros(layout.num_tensors * layout.tensor_bytes, dtype=torch.uint8, device=target)
            step = layout.tensor_bytes
            self.tensors = [flat[t * step : (t + 1) * step].view(dtype).view(shape) for t in range(layout.num_tensors)]
        else:
            self.tensors = [torch.zeros(shape, dtype=dtype, device=target) for _ in range(layout.num_tensors)]

    @classmethod
    def wrap(cls, layout: KVLayout, tensors: Sequence[torch.Tensor]) -> CudaKVCache:
        """Attach tensors the engine already allocated (same shape, dtype and device each)."""
        check_runner_tensors(layout, tensors)
        cache = cls.__new__(cls)
        cache.layout = layout
        cache.device = tensors[0].device
        cache.tensors = list(tensors)
        return cache

    def device_handle(self) -> dict[str, Any]:
        """A fresh export for one attach (see the module docstring)."""
        if not self.tensors:
            raise RuntimeError("cache is closed")
        return export_tensors(self.layout, self.tensors)

    def close(self) -> None:
        """Drops this object's references; the memory returns to torch's allocator once no
        other tensor refers to it (detach first)."""
        self.tensors = []

    def __enter__(self) -> CudaKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
