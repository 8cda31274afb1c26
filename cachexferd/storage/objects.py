"""The storage object format: a 64-byte header followed by one host block's bytes.

One object holds one block of one TP rank (block-major, so the payload is one contiguous
host block and is written and read in place). The header lets a reader refuse anything it
must not put in its cache. All fields little-endian::

    offset size  field
    0      4     magic            b"CXKV"
    4      2     format version   1
    6      2     header length    64
    8      2     checksum kind    1 = crc32, 2 = sum64 (below)
    10     2     reserved         0
    12     8     payload length   bytes after the header (= host block bytes)
    20     8     layout           KVLayout fingerprint (8 bytes; 16 hex chars in the API)
    28     8     name digest      blake2b-64 of the object name (``object_name``: namespace, version, key)
    36     8     payload checksum crc32 (zero-extended) or sum64 of the payload
    44     4     header crc32     zlib.crc32 of bytes 0..43
    48     16    zero

Checksums. ``crc32`` (the default) is zlib's CRC-32: it catches every error burst up to 32
bits, any reordering of the payload, and all but 2**-32 of other corruptions. ``sum64`` is
the checksum of earlier versions, still read (the header names the kind) and still writable
on request because it runs at memory speed: read the payload, zero-padded to a multiple of
8, as little-endian u64 words; S_p is the sum of page p's words (512 words = 4 KiB per page,
the last page may be shorter), A = sum of S_p, B = sum of (p + 1) * S_p, all modulo 2**64;
sum64 = A xor rotl64(B, 32). Its page sums are blind to order: it misses data moved within a
4 KiB page (two 512-byte sectors swapped by a disk or a file system) and bit flips that
cancel (one bit set in one word, the same bit cleared in another of the same page).

A reader classifies what it got: ``OK``; ``CORRUPT`` (bad magic, header or payload checksum,
wrong length on the wire, or an object stored under another name); ``MISMATCH`` (a valid
object of another format version, layout or block size). Both count as misses plus an error
metric, never as delivered blocks.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any

MAGIC = b"CXKV"
FORMAT_VERSION = 1
HEADER_BYTES = 64
try:  # ISA-L's CRC-32: the same function as zlib's, about 3x as fast (carry-less multiply), GIL released
    from isal.isal_zlib import crc32 as crc32  # also the journal's (storage/journal.py)
except ImportError:  # a platform without its wheel: zlib's (also releases the GIL)
    from zlib import crc32 as crc32

_HEAD = struct.Struct("<4sHHHHQ8s8sQ")  # everything the header crc covers (44 bytes)
_HEAD_CRC = struct.Struct("<I")
_PAD = bytes(HEADER_BYTES - _HEAD.size - _HEAD_CRC.size)
_MASK = (1 << 64) - 1
PAGE_WORDS = 512


class Checksum(IntEnum):
    CRC32 = 1
    SUM64 = 2


class Verdict(StrEnum):
    OK = "ok"
    CORRUPT = "corrupt"
    MISMATCH = "mismatch"


def object_name(key: str, weights_version: int, namespace: str = "") -> str:
    """The name a key's object is stored under: ``[namespace/]w<version>/<key>``.

    Every weights version, 0 included, puts its ``w<version>/`` part before the key, and the
    version's digits end at the first ``/`` after it: so no key under one version can spell
    an object of another (a key ``w27/x`` under version 0 is ``w0/w27/x``)."""
    scoped = f"w{weights_version}/{key}"
    return f"{namespace}/{scoped}" if namespace else scoped


def parse_object_name(name: str, namespace: str = "") -> tuple[int, str] | None:
    """(weights version, key) of an object name of ``namespace``; None for another namespace's."""
    if namespace:
        if not name.startswith(namespace + "/"):
            return None
        name = name[len(namespace) + 1 :]
    scope, sep, key = name.partition("/")
    if not sep or not key or not scope.startswith("w") or not scope[1:].isdigit():
        return None
    return int(scope[1:]), key


def name_digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=8).digest()


@functools.lru_cache(maxsize=64)
def _fingerprint_bytes(fingerprint: str) -> bytes:
    raw = bytes.fromhex(fingerprint)
    if len(raw) != 8:
        raise ValueError(f"layout fingerprint must be 16 hex chars, got {fingerprint!r}")
    return raw


def sum64(payload: Any) -> int:
    """sum64 of a buffer (see the module doc), with torch: one pass at memory speed, and its
    reductions release the GIL so I/O threads checksum in parallel."""
    import torch

    view = payload if isinstance(payload, memoryview) and payload.format == "B" else memoryview(payload).cast("B")
    page_bytes = PAGE_WORDS * 8
    if len(view) % page_bytes:  # odd sizes: zero-pad a copy to whole pages (same sum)
        padded = torch.zeros(-(-len(view) // page_bytes) * PAGE_WORDS, dtype=torch.int64)
        if len(view):
            padded.view(torch.uint8)[: len(view)] = torch.frombuffer(view, dtype=torch.uint8)
        words = padded
    else:
        words = torch.frombuffer(view, dtype=torch.int64) if len(view) else torch.zeros(0, dtype=torch.int64)
    pages = words.view(-1, PAGE_WORDS).sum(1, dtype=torch.int64)
    # One matrix-vector product gives (A, B); int64 arithmetic wraps like u64 modulo 2**64,
    # and the mask maps the signed results back.
    sums: list[int] = (_weights(len(pages)) @ pages).tolist()
    a, b = sums[0] & _MASK, sums[1] & _MASK
    return a ^ (((b << 32) | (b >> 32)) & _MASK)


_WEIGHTS: dict[int, Any] = {}


def _weights(pages: int) -> Any:
    """[[1, 1, ...], [1, 2, ...]] (int64) for ``pages`` pages, cached per size."""
    import torch

    found = _WEIGHTS.get(pages)
    if found is None:
        found = torch.stack([torch.ones(pages, dtype=torch.int64), torch.arange(1, pages + 1, dtype=torch.int64)])
        if len(_WEIGHTS) < 64:
            _WEIGHTS[pages] = found
    return found


def sum64_reference(payload: bytes) -> int:
    """The same checksum in plain Python (slow): the normative definition, used by tests."""
    data = bytes(payload) + bytes(-len(payload) % 8)
    words: tuple[int, ...] = struct.unpack(f"<{len(data) // 8}Q", data)
    pages = [sum(words[i : i + PAGE_WORDS]) for i in range(0, len(words), PAGE_WORDS)]
    a = sum(pages) & _MASK
    b = sum((p + 1) * s for p, s in enumerate(pages)) & _MASK
    return a ^ (((b << 32) | (b >> 32)) & _MASK)


def payload_checksum(kind: Checksum, payload: Any) -> int:
    if kind is Checksum.CRC32:
        return crc32(payload)
    return sum64(payload)


@dataclass(frozen=True)
class ObjectCodec:
    """Builds and checks headers for one layout (fingerprint) and block size."""

    fingerprint: str
    block_bytes: int
    checksum: Checksum = Checksum.CRC32  # what new objects carry; readers accept either

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.block_bytes

    def header(self, name: str, payload: memoryview) -> bytes:
        """The header of ``payload`` stored under ``name`` (computes the payload checksum)."""
        head = _HEAD.pack(
            MAGIC, FORMAT_VERSION, HEADER_BYTES, int(self.checksum), 0, len(payload),
            _fingerprint_bytes(self.fingerprint), name_digest(name), payload_checksum(self.checksum, payload),
        )  # fmt: skip
        return head + _HEAD_CRC.pack(zlib.crc32(head)) + _PAD

    def check(self, name: str, header: bytes | memoryview, payload: memoryview, received: int) -> tuple[Verdict, str]:
        """Verdict on an object read into ``header`` + ``payload``; ``received`` counts every
        byte the backend delivered (header included; more than object_bytes is CORRUPT)."""
        if len(header) < HEADER_BYTES or received < HEADER_BYTES:
            return Verdict.CORRUPT, f"object of {received} bytes is shorter than a header"
        head = header[: _HEAD.size]
        magic, version, header_len, kind, _, length, layout, digest, checksum = _HEAD.unpack(head)
        if magic != MAGIC:
            return Verdict.CORRUPT, "bad magic"
        if _HEAD_CRC.unpack_from(header, _HEAD.size)[0] != zlib.crc32(head):
            return Verdict.CORRUPT, "header checksum mismatch"
        if version != FORMAT_VERSION or header_len != HEADER_BYTES or kind not in iter(Checksum):
            return Verdict.MISMATCH, f"object format {version}/{header_len}/{kind}; this reads {FORMAT_VERSION}"
        if layout != _fingerprint_bytes(self.fingerprint):
            return Verdict.MISMATCH, f"object layout {layout.hex()} differs from {self.fingerprint}"
        if length != self.block_bytes:
            return Verdict.MISMATCH, f"object payload {length} B differs from the host block size {self.block_bytes}"
        if received != self.object_bytes:
            return Verdict.CORRUPT, f"object is {received} bytes, its header says {self.object_bytes}"
        if digest != name_digest(name):
            return Verdict.CORRUPT, "object was stored under another name"
        if payload_checksum(Checksum(kind), payload) != checksum:
            return Verdict.CORRUPT, "payload checksum mismatch"
        return Verdict.OK, ""
