"""Object headers: a reader accepts exactly what was written under that name and layout."""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any

import pytest

from cachexferd.storage.objects import (
    HEADER_BYTES,
    Checksum,
    ObjectCodec,
    Verdict,
    payload_checksum,
    sum64,
    sum64_reference,
)
from tests.storage_rig import cancel_flips, swap_sectors

FP = "0123456789abcdef"
BLOCK = 3072


def block(seed: int = 1) -> bytearray:
    return bytearray(os.urandom(BLOCK)) if seed else bytearray(BLOCK)


@pytest.mark.parametrize("kind", list(Checksum))
def test_roundtrip_and_payload_corruption(kind: Checksum) -> None:
    codec = ObjectCodec(FP, BLOCK, kind)
    payload = block()
    header = codec.header("k", memoryview(payload))
    assert len(header) == HEADER_BYTES
    assert codec.check("k", header, memoryview(payload), HEADER_BYTES + BLOCK) == (Verdict.OK, "")
    for pos in (0, 1000, BLOCK - 1):
        bad = bytearray(payload)
        bad[pos] ^= 0x01
        assert codec.check("k", header, memoryview(bad), HEADER_BYTES + BLOCK)[0] is Verdict.CORRUPT


def test_reader_accepts_either_checksum_kind() -> None:
    payload = memoryview(block())
    written = ObjectCodec(FP, BLOCK, Checksum.CRC32).header("k", payload)
    assert ObjectCodec(FP, BLOCK, Checksum.SUM64).check("k", written, payload, HEADER_BYTES + BLOCK)[0] is Verdict.OK


def test_header_damage_name_and_length() -> None:
    codec = ObjectCodec(FP, BLOCK)
    payload = memoryview(block())
    header = bytearray(codec.header("k", payload))
    full = HEADER_BYTES + BLOCK
    assert codec.check("other-key", header, payload, full)[0] is Verdict.CORRUPT
    assert codec.check("k", header, payload, full + 1)[0] is Verdict.CORRUPT  # object longer than its header says
    assert codec.check("k", header, payload, full - 1)[0] is Verdict.CORRUPT  # truncated
    assert codec.check("k", header, payload, 10)[0] is Verdict.CORRUPT
    for pos in (0, 13, 30, 41):  # magic, payload length, name digest, header crc
        bad = bytearray(header)
        bad[pos] ^= 0xFF
        assert codec.check("k", bad, payload, full)[0] is Verdict.CORRUPT, pos


def _reheader(header: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    """Rewrites one field and fixes the header crc: a valid header with other contents."""
    raw = bytearray(header)
    struct.pack_into(fmt, raw, offset, value)
    struct.pack_into("<I", raw, 44, zlib.crc32(bytes(raw[:44])))
    return bytes(raw)


def test_valid_objects_of_another_layout_size_or_format_are_mismatches() -> None:
    codec = ObjectCodec(FP, BLOCK)
    payload = memoryview(block())
    header = codec.header("k", payload)
    full = HEADER_BYTES + BLOCK
    assert ObjectCodec("fedcba9876543210", BLOCK).check("k", header, payload, full)[0] is Verdict.MISMATCH
    bigger = ObjectCodec(FP, BLOCK * 2)
    assert bigger.check("k", header, memoryview(bytearray(BLOCK * 2)), full)[0] is Verdict.MISMATCH
    assert codec.check("k", _reheader(header, 4, "<H", 2), payload, full)[0] is Verdict.MISMATCH  # version
    assert codec.check("k", _reheader(header, 8, "<H", 9), payload, full)[0] is Verdict.MISMATCH  # checksum kind


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4095, 4096, 4097, 3072, 12345, 1 << 16])
def test_sum64_matches_its_reference_definition(size: int) -> None:
    data = bytearray(os.urandom(size))
    assert sum64(data) == sum64_reference(bytes(data))


def test_sum64_wraps_and_sees_moved_pages() -> None:
    ones = bytearray(b"\xff" * 8192)  # sums overflow 64 bits
    assert sum64(ones) == sum64_reference(bytes(ones))
    data = bytearray(os.urandom(8192))
    swapped = data[4096:] + data[:4096]  # same words, pages exchanged
    assert sum64(data) != sum64(swapped)
    zeroed = bytearray(data)
    zeroed[100:200] = bytes(100)
    assert sum64(zeroed) != sum64(data)


def test_bad_fingerprint_is_refused() -> None:
    with pytest.raises(ValueError):
        ObjectCodec("xyz", BLOCK).header("k", memoryview(block()))


@pytest.mark.parametrize("damage", [swap_sectors, cancel_flips])
def test_default_checksum_catches_reordered_sectors_and_cancelling_flips(damage: Any) -> None:
    codec = ObjectCodec(FP, BLOCK)  # the default kind
    assert codec.checksum is Checksum.CRC32
    payload = block()
    header = codec.header("k", memoryview(payload))
    assert codec.check("k", header, memoryview(damage(payload)), HEADER_BYTES + BLOCK)[0] is Verdict.CORRUPT
    # Why sum64 stopped being the default: both corruptions pass it.
    legacy = ObjectCodec(FP, BLOCK, Checksum.SUM64)
    old_header = legacy.header("k", memoryview(payload))
    assert legacy.check("k", old_header, memoryview(damage(payload)), HEADER_BYTES + BLOCK)[0] is Verdict.OK


def test_objects_written_with_sum64_are_still_read() -> None:
    payload = memoryview(block())
    written = ObjectCodec(FP, BLOCK, Checksum.SUM64).header("k", payload)
    assert ObjectCodec(FP, BLOCK).check("k", written, payload, HEADER_BYTES + BLOCK) == (Verdict.OK, "")


@pytest.mark.parametrize("size", [0, 1, 63, 4096, (1 << 20) + 7])
def test_the_crc32_objects_carry_is_zlibs(size: int) -> None:
    """Objects are checked with ISA-L's CRC-32 where it is installed: it must be zlib's exactly,
    so objects written by either are read by the other."""
    data = os.urandom(size)
    view = memoryview(bytearray(data))[1:]
    assert payload_checksum(Checksum.CRC32, data) == zlib.crc32(data)
    assert payload_checksum(Checksum.CRC32, view) == zlib.crc32(view)
