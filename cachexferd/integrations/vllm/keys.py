"""Storage keys for vLLM's offload keys.

vLLM names a block by an ``OffloadKey``: its chained prefix hash (covering every token of
the prefix, LoRA, multimodal inputs and cache salt) plus a 4-byte KV-cache-group index. The
plug-in digests that into a cachexferd ``BlockHash`` and builds the key in a ``KeySpace``
that names the model, weights version, dtype, the worker's page layout, vLLM's hash
algorithm and the TP size. Two instances of the same model and layout therefore compute the
same keys and share stored blocks; any other model or layout never matches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from ...storage.keys import HASH_BYTES, BlockHash, KeySpace


@dataclass(frozen=True)
class VllmKeyNames:
    space: KeySpace
    tokens_per_block: int

    @classmethod
    def create(
        cls, *, model: str, weights_version: str, dtype: str, layout: str, tokens_per_block: int, tp_size: int
    ) -> VllmKeyNames:
        space = KeySpace(
            model=model, dtype=dtype, layout=layout, block_size=tokens_per_block,
            weights_version=weights_version, tp_size=tp_size,
        )  # fmt: skip
        return cls(space, tokens_per_block)

    def block_hash(self, offload_key: bytes) -> BlockHash:
        digest = hashlib.blake2b(offload_key, digest_size=HASH_BYTES, person=b"cx-vllm").digest()
        return BlockHash(digest, self.tokens_per_block, partial=False)

    def key(self, offload_key: bytes, rank: int) -> str:
        return self.space.key(self.block_hash(offload_key), rank)

    def digest_key(self, digest: bytes, rank: int) -> str:
        """The key of a block known by its digest (``block_hash(...).digest``)."""
        return self.space.key(BlockHash(digest, self.tokens_per_block, partial=False), rank)

    def keys(self, offload_keys: Sequence[bytes], rank: int) -> list[str]:
        return [self.key(k, rank) for k in offload_keys]


def layout_name(*, layers: int, block_bytes: int, tokens_per_block: int, kv_cache_layout: str, hash_algo: str) -> str:
    """What one stored block holds, from facts the scheduler and every worker share."""
    return f"vllm:{kv_cache_layout}:{layers}layers:{block_bytes}B:{tokens_per_block}tok:{hash_algo}"
