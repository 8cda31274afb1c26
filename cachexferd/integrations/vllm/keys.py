"""Storage keys for vLLM's offload keys.

vLLM names a block by an ``OffloadKey``: its chained prefix hash (covering every token of
the prefix, LoRA, multimodal inputs and cache salt) plus a 4-byte KV-cache-group index. The
plug-in digests that into a cachexferd ``BlockHash`` and builds the key in the ``KeySpace``
of the block's group, which names the model, weights version, dtype, the worker's page
layout, vLLM's hash algorithm, the group's tokens per block, the TP size and the group
itself (docs/storage.md §2). Two instances of the same model and layout therefore compute
the same keys and share stored blocks; any other model, layout or group never matches.

KV that every tensor-parallel rank holds identically (the latent of an MLA model) is named
once for all ranks (``replicated``): one object, written by rank 0, loaded by every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...storage.keys import HASH_BYTES, BlockHash, KeySpace

PERSON = b"cx-vllm"  # BLAKE2b personalisation of an offload key's digest (docs/storage.md §2.8)


def group_of(offload_key: bytes) -> int:
    """vLLM's KV-cache group index: the last 4 bytes of an offload key, big-endian."""
    return int.from_bytes(offload_key[-4:], "big")


def block_digest(offload_key: bytes) -> bytes:
    return hashlib.blake2b(offload_key, digest_size=HASH_BYTES, person=PERSON).digest()


@dataclass(frozen=True)
class VllmKeyNames:
    spaces: Mapping[int, KeySpace]  # vLLM's group index -> that group's key space

    @classmethod
    def create(
        cls, *, model: str, weights_version: str, dtype: str, layout: str, tokens_per_block: Mapping[int, int],
        tp_size: int, replicated: bool = False,
    ) -> VllmKeyNames:  # fmt: skip
        """``tokens_per_block``: per offloaded group (vLLM's group index), its tokens per block."""
        base = KeySpace(model=model, dtype=dtype, layout=layout, block_size=1, weights_version=weights_version,
                        tp_size=tp_size, replicated=replicated)  # fmt: skip
        spaces = {g: replace(base, block_size=tokens, group=g) for g, tokens in tokens_per_block.items()}
        if not spaces:
            raise ValueError("no KV-cache group to name")
        return cls(spaces)

    @property
    def space(self) -> KeySpace:
        """The first group's key space (its digest names this model's keys in logs)."""
        return self.spaces[min(self.spaces)]

    @property
    def replicated(self) -> bool:
        return self.space.replicated

    def _space(self, group: int) -> KeySpace:
        space = self.spaces.get(group)
        if space is None:
            raise KeyError(f"KV-cache group {group} is not offloaded")
        return space

    def block_hash(self, offload_key: bytes) -> BlockHash:
        space = self._space(group_of(offload_key))
        return BlockHash(block_digest(offload_key), space.block_size, partial=False)

    def key(self, offload_key: bytes, rank: int) -> str:
        return self._space(group_of(offload_key)).key(self.block_hash(offload_key), rank)

    def digest_key(self, digest: bytes, group: int, rank: int) -> str:
        """The key of a block of ``group`` known by its digest (``block_hash(...).digest``)."""
        space = self._space(group)
        return space.key(BlockHash(digest, space.block_size, partial=False), rank)

    def keys(self, offload_keys: Sequence[bytes], rank: int) -> list[str]:
        return [self.key(k, rank) for k in offload_keys]

    def keys_by_rank(self, offload_keys: Sequence[bytes]) -> Callable[[int], dict[str, Any]]:
        """Per-rank keys in the form EngineClient's storage commands accept."""
        return lambda rank: {"keys": self.keys(offload_keys, rank)}


def layout_name(
    *, layers: int, block_bytes: int, tokens_per_block: int, kv_cache_layout: str, hash_algo: str, groups: int = 1
) -> str:
    """What one stored block holds, from facts the scheduler and every worker share."""
    name = f"vllm:{kv_cache_layout}:{layers}layers:{block_bytes}B:{tokens_per_block}tok:{hash_algo}"
    return name if groups == 1 else f"{name}:{groups}groups"
