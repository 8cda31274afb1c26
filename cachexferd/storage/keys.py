"""Storage keys for KV blocks: the one module that prefill and decode engines both import.

It imports neither torch nor the daemon (nor anything outside the standard library), so an
engine process on either side computes exactly the same keys from the same tokens::

    space = KeySpace(model="meta-llama/Llama-3.1-8B", weights_version="step-1200",
                     dtype="bfloat16", layout=kv_layout.fingerprint(), block_size=16, tp_size=2)
    hashes = space.block_hashes(prompt_token_ids)          # rank-independent, for a prefix index
    req = engine.store(space.keys_by_rank(hashes), host_ids=..., device_ids=...)

Block hashes are chained: the hash of block ``i`` covers block ``i``'s token ids, its extra
keys (multimodal hashes, LoRA ids, ...) and the hash of block ``i-1``; block 0 chains from the
namespace digest. So equal hashes mean equal prefixes, and a change in any token changes the
hash of its block and of every later block. A trailing partial block (fewer than
``block_size`` tokens) hashes with its token count and gets its own key form, so it never
collides with a full block and a decode instance asks for exactly what prefill wrote.

Key format (printable ASCII, no spaces, at most 85 bytes)::

    cx1:<namespace digest, 16 hex>:r<rank>of<tp_size>:f:<block hash, 32 hex>     full block
    cx1:<namespace digest, 16 hex>:r<rank>of<tp_size>:p<count>:<block hash, 32 hex>  partial
    cx1:<namespace digest>:g<group>:r<rank>of<tp_size>:...     a KV-cache group other than 0
    cx1:<namespace digest>:ranks<tp_size>:...                  KV identical on every rank

The namespace digest covers the model id, weights version, dtype, layout fingerprint, block
size and TP size (and the group and replication when set): KV written under other weights
(an RL update bumps ``weights_version``) or another layout simply misses. One object is
stored per (block, rank), or per block when every rank holds the same bytes (``replicated``,
e.g. an MLA latent).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

KEY_FORMAT = "cx1"
HASH_BYTES = 16
MAX_GROUPS = 1024  # KV-cache groups a key space may name (vLLM's largest models have a handful)
ExtraKey = int | str | bytes
_I64 = struct.Struct("<q")


class HasFingerprint(Protocol):
    """What ``KeySpace.for_layout`` needs from a KVLayout (duck-typed: no protocol import)."""

    @property
    def dtype(self) -> str: ...

    @property
    def block_size(self) -> int: ...

    def fingerprint(self) -> str: ...


@dataclass(frozen=True)
class BlockHash:
    """One block's chained hash; ``tokens`` < block_size marks a trailing partial block."""

    digest: bytes
    tokens: int
    partial: bool

    @property
    def hex(self) -> str:
        return self.digest.hex()


def _field(data: bytes) -> bytes:
    """Length-prefixed, so that ('ab', 'c') and ('a', 'bc') hash differently."""
    return _I64.pack(len(data)) + data


def _extra_bytes(extra: Sequence[ExtraKey]) -> bytes:
    parts = []
    for item in extra:
        if isinstance(item, bool) or not isinstance(item, (int, str, bytes)):
            raise TypeError(f"extra keys must be int, str or bytes, got {type(item).__name__}")
        if isinstance(item, int):
            parts.append(b"i" + _field(str(item).encode()))
        elif isinstance(item, str):
            parts.append(b"s" + _field(item.encode()))
        else:
            parts.append(b"b" + _field(item))
    return b"".join(parts)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as signed 64-bit little-endian integers, whatever the machine's byte order."""
    try:
        ids = array("q", tokens)
    except (TypeError, OverflowError) as exc:
        raise TypeError(f"token ids must be ints in the int64 range: {exc}") from None
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


@dataclass(frozen=True)
class KeySpace:
    """Everything that makes KV bytes of the same tokens different, plus how tokens form blocks."""

    model: str
    dtype: str
    layout: str  # KVLayout.fingerprint(): what one block holds
    block_size: int  # tokens per block
    weights_version: str = "0"
    tp_size: int = 1
    # The engine's KV-cache group (a model with sliding-window or Mamba layers beside full
    # attention has several): group 0 keeps the single-group names, others are named apart.
    group: int = 0
    # Every rank holds the same bytes for a block (an MLA latent): one object serves all ranks.
    replicated: bool = False

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if type(self.tp_size) is not int or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {self.tp_size!r}")
        if type(self.group) is not int or not 0 <= self.group < MAX_GROUPS:
            raise ValueError(f"group must be an int in 0..{MAX_GROUPS - 1}, got {self.group!r}")

    @classmethod
    def for_layout(
        cls, model: str, layout: HasFingerprint, *, weights_version: str = "0", tp_size: int = 1, group: int = 0,
        replicated: bool = False,
    ) -> KeySpace:  # fmt: skip
        return cls(
            model, layout.dtype, layout.fingerprint(), layout.block_size, weights_version, tp_size, group, replicated
        )

    @property
    def digest(self) -> str:
        """16 hex chars naming this namespace (in every key)."""
        return self._root().hex()[:16]

    def _root(self) -> bytes:
        text = [self.model, self.weights_version, self.dtype, self.layout, str(self.block_size), str(self.tp_size)]
        if self.group:
            text.append(f"g{self.group}")
        if self.replicated:
            text.append("replicated")
        data = KEY_FORMAT.encode() + b"".join(_field(t.encode()) for t in text)
        return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()

    def block_hashes(
        self,
        tokens: Sequence[int],
        extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
        *,
        partial: bool = True,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Chained hashes of ``tokens`` cut into blocks. ``extra_keys[i]`` (optional) joins
        block i's hash. ``partial=False`` drops a trailing partial block. ``parent`` continues
        a chain (the hash of the block before ``tokens[0]``; must be a full block)."""
        if parent is not None and parent.partial:
            raise ValueError("a chain cannot continue after a partial block")
        n_full, rest = divmod(len(tokens), self.block_size)
        if extra_keys is not None and len(extra_keys) > n_full + (1 if rest else 0):
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n_full + (1 if rest else 0)} blocks")
        n_blocks = n_full + (1 if rest and partial else 0)
        prev = parent.digest if parent is not None else self._root()
        out: list[BlockHash] = []
        for i in range(n_blocks):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
            digest = _chain(prev, chunk, extra, len(chunk) < self.block_size)
            out.append(BlockHash(digest, len(chunk), len(chunk) < self.block_size))
            prev = digest
        return out

    def key(self, block: BlockHash, rank: int = 0) -> str:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} is outside tp_size {self.tp_size}")
        kind = f"p{block.tokens}" if block.partial else "f"
        return f"{KEY_FORMAT}:{self.digest}{self._scope(rank)}:{kind}:{block.hex}"

    def _scope(self, rank: int) -> str:
        """The group and rank part of a key: the same for every rank when replicated."""
        group = f":g{self.group}" if self.group else ""
        ranks = f":ranks{self.tp_size}" if self.replicated else f":r{rank}of{self.tp_size}"
        return group + ranks

    def keys(self, blocks: Sequence[BlockHash], rank: int = 0) -> list[str]:
        return [self.key(b, rank) for b in blocks]

    def keys_by_rank(
        self, blocks: Sequence[BlockHash], parent: BlockHash | None = None
    ) -> Callable[[int], dict[str, Any]]:
        """Per-rank keys in the form EngineClient.store/load/lookup/delete accept. ``parent``
        (for a STORE that extends a chain stored earlier): the block before ``blocks[0]``."""
        if parent is None:
            return lambda rank: {"keys": self.keys(blocks, rank)}
        return lambda rank: {"keys": self.keys(blocks, rank), "parent": self.key(parent, rank)}

    def token_keys(self, tokens: Sequence[int], rank: int = 0, **kwargs: Any) -> list[str]:
        """Shortcut: keys of ``tokens`` for one rank (block_hashes + keys)."""
        return self.keys(self.block_hashes(tokens, **kwargs), rank)


def _chain(prev: bytes, tokens: Sequence[int], extra: Sequence[ExtraKey] | None, partial: bool) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(prev)
    # Partial blocks hash with a different tag and their count: never equal to a full block.
    h.update(b"P" if partial else b"F")
    h.update(_I64.pack(len(tokens)))
    h.update(_token_bytes(tokens))
    h.update(_field(_extra_bytes(extra or ())))
    return h.digest()
