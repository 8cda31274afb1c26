"""A model runner's KV cache for the cpu backend, from docs/protocol.md §8.1 to §8.3 alone:
one POSIX shared-memory file in /dev/shm, created with os.open + ftruncate + mmap."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import random
from typing import Any

from .spec import DTYPE_BYTES

SHM_DIR = "/dev/shm"
_serial = itertools.count()

# The layout most tests attach: 2 layers x (K, V), chunks of 256 bytes, host blocks of 1 KiB.
LAYOUT: dict[str, Any] = {
    "num_layers": 2,
    "kv_tensors": 2,
    "num_blocks": 64,
    "block_size": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "dtype": "bfloat16",
}


def geometry(layout: dict[str, Any]) -> tuple[int, int, int, int]:
    """(num_tensors, chunk_bytes, host_block_bytes, tensor_bytes) per §8.1."""
    num_tensors = layout["num_layers"] * layout.get("kv_tensors", 2)
    chunk = layout["block_size"] * layout["num_kv_heads"] * layout["head_dim"] * DTYPE_BYTES[layout["dtype"]]
    return num_tensors, chunk, num_tensors * chunk, layout["num_blocks"] * chunk


class ShmCache:
    """Tensor ``t`` at ``offsets[t]``; block ``b`` of tensor ``t`` is ``chunk`` bytes at
    ``offsets[t] + b * chunk`` (§8.2). Filled with seeded random bytes."""

    def __init__(
        self,
        layout: dict[str, Any] | None = None,
        offsets: list[int] | None = None,
        size: int | None = None,
        seed: int = 0,
    ) -> None:
        self.layout = dict(LAYOUT if layout is None else layout)
        self.num_tensors, self.chunk, self.block_bytes, self.tensor_bytes = geometry(self.layout)
        self.offsets = offsets if offsets is not None else [t * self.tensor_bytes for t in range(self.num_tensors)]
        self.size = size if size is not None else max(self.offsets) + self.tensor_bytes
        self.name = f"cxconf-{os.getpid()}-{next(_serial)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.map[:] = random.Random(seed).randbytes(self.size)

    def device_map(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.name, "offsets": list(self.offsets)}

    def attach_fields(self, pid: int | None = None) -> dict[str, Any]:
        fields: dict[str, Any] = {"layout": self.layout, "device": self.device_map()}
        if pid is not None:
            fields["pid"] = pid
        return fields

    def _chunk_at(self, tensor: int, block: int) -> int:
        return self.offsets[tensor] + block * self.chunk

    def block(self, block: int) -> bytes:
        """Device block ``block`` as a host block holds it: every tensor's chunk, in tensor order."""
        return b"".join(
            self.map[self._chunk_at(t, block) : self._chunk_at(t, block) + self.chunk] for t in range(self.num_tensors)
        )

    def set_block(self, block: int, data: bytes) -> None:
        assert len(data) == self.block_bytes
        for t in range(self.num_tensors):
            start = self._chunk_at(t, block)
            self.map[start : start + self.chunk] = data[t * self.chunk : (t + 1) * self.chunk]

    def snapshot(self) -> bytes:
        return bytes(self.map)

    def close(self) -> None:
        self.map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
