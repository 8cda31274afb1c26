"""The block-major host cache: one page-aligned anonymous mapping, viewed as blocks.

The mapping is created with mmap rather than torch's pinned allocator, which rounds sizes
up to a power of two (100 GB would become 128 GB). The cuda backend pins this same
mapping in chunks (cudaHostRegister); the cpu backend uses it as it is. Layout of a block:
see cachexferd/protocol/layout.py and docs/protocol.md, "Host cache layout".
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HostGeometry:
    """How the pool is cut into blocks; fixed by config or by the first attach."""

    block_bytes: int
    num_blocks: int


class HostPool:
    """Owns the host cache bytes for the daemon's lifetime."""

    def __init__(self, capacity: int) -> None:
        import torch

        if capacity < mmap.PAGESIZE:
            raise ValueError(f"host cache capacity {capacity} is below one page")
        self.capacity = capacity
        self._map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Fewer TLB misses on large copies; harmless where THP is off.
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.tensor: torch.Tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self.ready_bytes = capacity  # bytes usable now; a pinning backend raises this as it goes
        self.pinned = False

    def geometry(self, block_bytes: int) -> HostGeometry:
        return HostGeometry(block_bytes, self.capacity // block_bytes)

    def blocks(self, geometry: HostGeometry, num_tensors: int) -> torch.Tensor:
        """View ``[num_blocks, num_tensors, chunk_bytes]`` of the pool (uint8)."""
        used = geometry.num_blocks * geometry.block_bytes
        return self.tensor[:used].view(geometry.num_blocks, num_tensors, geometry.block_bytes // num_tensors)

    def memory(self, offset: int, nbytes: int) -> memoryview:
        """Writable view of pool bytes, for storage I/O straight into the cache."""
        return memoryview(self._map)[offset : offset + nbytes]

    def discard(self) -> int:
        """Gives the pages back to the OS (they come back, zeroed, when next touched);
        returns the bytes given back. A pinned pool keeps its pages: 0."""
        if self.pinned:
            return 0
        self._map.madvise(mmap.MADV_DONTNEED)
        return self.capacity
