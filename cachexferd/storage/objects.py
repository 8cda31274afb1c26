"""The storage object format: a 64-byte header followed by one host block's bytes.

One object holds one block of one TP rank (block-major, so the payload is one contiguous
host block and is written and read in place). The header lets a reader refuse anything it
must not put in its cache::

    offset size  field
    0      4     magic            b"CXKV"
    4      2     format version   1 (u16, little-endian like every field)
    6      2     header length    64
    8      4     flags            0 (reserved)
    12     8     payload length   bytes after the header (= host block bytes)
    20     8     layout           KVLayout fingerprint (8 bytes; 16 hex chars in the API)
    28     8     name digest      blake2b-64 of the object name (namespace + key)
    36     4     payload crc32    zlib.crc32 of the payload
    40     4     header crc32     zlib.crc32 of bytes 0..39
    44     20    zero

A reader classifies what it got: ``OK``; ``CORRUPT`` (bad magic, header or payload checksum,
wrong length on the wire, or an object stored under another name); ``MISMATCH`` (a valid
object of another format version, layout or block size). Both count as misses plus an error
metric, never as delivered blocks. crc32 runs at ~7 GB/s per core here (see docs/storage.md).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from enum import StrEnum

MAGIC = b"CXKV"
FORMAT_VERSION = 1
HEADER_BYTES = 64
_HEAD = struct.Struct("<4sHHIQ8s8sI")  # everything the header crc covers (40 bytes)
_HEAD_CRC = struct.Struct("<I")
_PAD = bytes(HEADER_BYTES - _HEAD.size - _HEAD_CRC.size)


class Verdict(StrEnum):
    OK = "ok"
    CORRUPT = "corrupt"
    MISMATCH = "mismatch"


def name_digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=8).digest()


def _fingerprint_bytes(fingerprint: str) -> bytes:
    raw = bytes.fromhex(fingerprint)
    if len(raw) != 8:
        raise ValueError(f"layout fingerprint must be 16 hex chars, got {fingerprint!r}")
    return raw


@dataclass(frozen=True)
class ObjectCodec:
    """Builds and checks headers for one layout (fingerprint) and block size."""

    fingerprint: str
    block_bytes: int

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.block_bytes

    def header(self, name: str, payload: memoryview) -> bytes:
        """The header of ``payload`` stored under ``name`` (computes the payload crc)."""
        head = _HEAD.pack(
            MAGIC, FORMAT_VERSION, HEADER_BYTES, 0, len(payload),
            _fingerprint_bytes(self.fingerprint), name_digest(name), zlib.crc32(payload),
        )  # fmt: skip
        return head + _HEAD_CRC.pack(zlib.crc32(head)) + _PAD

    def check(self, name: str, header: bytes | memoryview, payload: memoryview, received: int) -> tuple[Verdict, str]:
        """Verdict on an object read into ``header`` + ``payload``; ``received`` counts every
        byte the backend delivered (header included; more than object_bytes is CORRUPT)."""
        if len(header) < HEADER_BYTES or received < HEADER_BYTES:
            return Verdict.CORRUPT, f"object of {received} bytes is shorter than a header"
        head = bytes(header[: _HEAD.size])
        magic, version, header_len, _flags, length, layout, digest, crc = _HEAD.unpack(head)
        if magic != MAGIC:
            return Verdict.CORRUPT, "bad magic"
        if _HEAD_CRC.unpack_from(header, _HEAD.size)[0] != zlib.crc32(head):
            return Verdict.CORRUPT, "header checksum mismatch"
        if version != FORMAT_VERSION or header_len != HEADER_BYTES:
            return Verdict.MISMATCH, f"object format {version} (header {header_len} B); this reads {FORMAT_VERSION}"
        if layout != _fingerprint_bytes(self.fingerprint):
            return Verdict.MISMATCH, f"object layout {layout.hex()} differs from {self.fingerprint}"
        if length != self.block_bytes:
            return Verdict.MISMATCH, f"object payload {length} B differs from the host block size {self.block_bytes}"
        if received != self.object_bytes:
            return Verdict.CORRUPT, f"object is {received} bytes, its header says {self.object_bytes}"
        if digest != name_digest(name):
            return Verdict.CORRUPT, "object was stored under another name"
        if zlib.crc32(payload) != crc:
            return Verdict.CORRUPT, "payload checksum mismatch"
        return Verdict.OK, ""
