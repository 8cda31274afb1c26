"""KV-cache layout description and the block-major host layout math.

Device side (the model runner's cache): ``num_layers * kv_tensors`` tensors, each shaped
``[num_blocks, block_size, num_kv_heads, head_dim]`` and contiguous, tensor ``t`` being
layer ``t // kv_tensors``, K when ``t % kv_tensors == 0`` and V otherwise. One block of one
tensor is ``chunk_bytes`` contiguous bytes.

Host side (the daemon's cache) is block-major: host block ``h`` is ``host_block_bytes``
contiguous bytes holding the chunks of all tensors in tensor order, so the chunk of tensor
``t`` in host block ``h`` starts at byte ``h * host_block_bytes + t * chunk_bytes``.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

# Element size of every dtype the daemon accepts. Copies move bytes; the dtype only sizes
# chunks and keeps caches of different precision from being mixed.
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

_INT_FIELDS = ("num_layers", "kv_tensors", "num_blocks", "block_size", "num_kv_heads", "head_dim")
_REQUIRED = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype")
_MAX_FIELD = 1 << 24


class LayoutError(ValueError):
    """A layout that cannot describe a KV cache."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_tensors: int = 2  # 2: K and V per layer; 1: one latent tensor per layer (MLA)

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= _MAX_FIELD:
                raise LayoutError(f"layout.{name} must be an int in [1, {_MAX_FIELD}], got {value!r}")
        if self.kv_tensors not in (1, 2):
            raise LayoutError(f"layout.kv_tensors must be 1 or 2, got {self.kv_tensors}")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"layout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def num_tensors(self) -> int:
        return self.num_layers * self.kv_tensors

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one block in one device tensor."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block: every tensor's chunk of that block."""
        return self.num_tensors * self.chunk_bytes

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one whole device tensor."""
        return self.num_blocks * self.chunk_bytes

    def host_chunk_offset(self, host_block: int, tensor: int) -> int:
        return host_block * self.host_block_bytes + tensor * self.chunk_bytes

    def fingerprint(self) -> str:
        """Identifies what one host block holds, independent of how many device blocks exist."""
        shape = (self.num_layers, self.kv_tensors, self.block_size, self.num_kv_heads, self.head_dim)
        text = f"{self.dtype}:{':'.join(map(str, shape))}"
        return hashlib.blake2s(text.encode(), digest_size=8).hexdigest()

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> KVLayout:
        if not isinstance(data, dict):
            raise LayoutError(f"layout must be a map, got {type(data).__name__}")
        unknown = set(data) - set(_INT_FIELDS) - {"dtype"}
        if unknown:
            raise LayoutError(f"layout has unknown fields {sorted(map(str, unknown))}")
        missing = [name for name in _REQUIRED if name not in data]
        if missing:
            raise LayoutError(f"layout is missing {missing}")
        return cls(**data)
