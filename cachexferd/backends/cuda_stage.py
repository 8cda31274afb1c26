"""Device tensors as the daemon sees them, and the staging copy path (torch ops on the
lane's stream).

Staging moves a batch of blocks through a block-major buffer on the device: swap-out
gathers the blocks of every tensor group with one ``index_select`` per group, then copies
whole host runs buffer -> pinned host (contiguous on both sides: a plain DMA); swap-in
copies host runs into the buffer and scatters them with one ``index_copy_`` per group.
Bytes are viewed as the widest integer type that divides every size and address, so the
kernels move words rather than single bytes.

The caller makes the lane's stream current: the buffer and the index tensor come from
torch's caching allocator on that stream, so their memory is reused only by later work on
the same stream, after this batch (stream order), and needs no explicit lifetime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..protocol import KVLayout
from .cuda_copy import StagingBatch, element_size
from .plan import even_groups

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class DeviceTensor:
    """One device KV tensor: ``offset`` bytes into an (imported or local) storage."""

    storage: torch.UntypedStorage
    offset: int

    @property
    def address(self) -> int:
        return int(self.storage.data_ptr()) + self.offset


def from_tensors(tensors: Sequence[torch.Tensor]) -> list[DeviceTensor]:
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        out.append(DeviceTensor(storage, t.data_ptr() - storage.data_ptr()))
    return out


def storage_groups(tensors: Sequence[DeviceTensor]) -> list[tuple[int, int, int]]:
    """(first, count, stride) of evenly spaced tensors *within one storage*: torch can view
    only one storage as one strided tensor (DMA planning groups by address alone)."""
    groups: list[tuple[int, int, int]] = []
    i = 0
    while i < len(tensors):
        j = i + 1
        base = tensors[i].storage.data_ptr()
        while j < len(tensors) and tensors[j].storage.data_ptr() == base:
            j += 1
        for first, count, stride in even_groups([t.address for t in tensors[i:j]]):
            groups.append((i + first, count, stride))
        i = j
    return groups


@dataclass(frozen=True)
class _Group:
    first: int
    count: int
    view: torch.Tensor  # [num_blocks, count, width] over the device tensors


class Stager:
    def __init__(
        self, layout: KVLayout, tensors: Sequence[DeviceTensor], host: torch.Tensor, device: torch.device
    ) -> None:
        """``host`` is the pool's ``[host_blocks, num_tensors, chunk]`` uint8 view."""
        chunk = layout.chunk_bytes
        groups = storage_groups(tensors)
        sizes = [chunk, host.data_ptr(), *(t.address for t in tensors), *(t.offset for t in tensors)]
        sizes += [stride for _, _, stride in groups]
        self.elem = element_size(sizes)
        self.dtype = _DTYPES[self.elem]
        self.width = chunk // self.elem
        self.num_tensors = layout.num_tensors
        self.num_blocks = layout.num_blocks
        self.device = device
        self.host = host.view(self.dtype)  # [host_blocks, num_tensors, width]
        self.groups = [self._view(tensors[first], first, count, stride, chunk) for first, count, stride in groups]

    def _view(self, first_tensor: DeviceTensor, first: int, count: int, stride: int, chunk: int) -> _Group:
        base = torch.empty(0, dtype=torch.uint8, device=self.device).set_(first_tensor.storage)
        view = torch.as_strided(base, (self.num_blocks, count, chunk), (chunk, stride or chunk, 1), first_tensor.offset)
        return _Group(first, count, view.view(self.dtype))

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.int64)
        if self.device.type != "cuda":
            return index  # the CPU tests run this path on host "devices"
        # From pinned memory: a pageable upload would synchronise the stream first.
        return index.pin_memory().to(self.device, non_blocking=True)

    def _buffer(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self.num_tensors, self.width), dtype=self.dtype, device=self.device)

    def to_host(self, batch: StagingBatch) -> None:
        index = self._index(batch.device_ids)
        staging = self._buffer(len(batch.device_ids))
        for g in self.groups:
            staging[:, g.first : g.first + g.count] = g.view.index_select(0, index)
        for run in batch.host_runs:
            rows = staging[run.device : run.device + run.length]
            self.host[run.host : run.host + run.length].copy_(rows, non_blocking=True)

    def to_device(self, batch: StagingBatch) -> None:
        index = self._index(batch.device_ids)
        staging = self._buffer(len(batch.device_ids))
        for run in batch.host_runs:
            rows = self.host[run.host : run.host + run.length]
            staging[run.device : run.device + run.length].copy_(rows, non_blocking=True)
        for g in self.groups:
            g.view.index_copy_(0, index, staging[:, g.first : g.first + g.count])
