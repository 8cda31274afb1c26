"""The daemon's one home of id and key validation: codes and details."""

from __future__ import annotations

import pytest

from cachexferd.daemon.validate import first_duplicate, ids_in_range, swap_pairs, unique_keys
from cachexferd.protocol import ErrorCode, ProtocolError


def test_ids_in_range() -> None:
    ids_in_range([0, 9], 10, "x")
    with pytest.raises(ProtocolError) as info:
        ids_in_range([3, 10], 10, "host_ids")
    assert info.value.code == ErrorCode.ID_OUT_OF_RANGE and "host_ids holds 10" in info.value.detail


def test_first_duplicate() -> None:
    assert first_duplicate([1, 2, 3]) is None
    assert first_duplicate([1, 2, 1, 2]) == 1
    assert first_duplicate(["a", "b", "b"]) == "b"


@pytest.mark.parametrize(
    ("device", "host", "dest", "code"),
    [
        ([1, 2], [3], "host", ErrorCode.LENGTH_MISMATCH),
        ([1, 99], [3, 4], "host", ErrorCode.ID_OUT_OF_RANGE),
        ([1, 2], [3, 99], "host", ErrorCode.ID_OUT_OF_RANGE),
        ([1, 2], [3, 3], "host", ErrorCode.DUPLICATE_ID),
        ([1, 1], [3, 4], "device", ErrorCode.DUPLICATE_ID),
    ],
)
def test_swap_pairs_errors(device: list[int], host: list[int], dest: str, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        swap_pairs(device, host, 10, 10, dest)
    assert info.value.code == code


def test_swap_pairs_allows_duplicate_sources() -> None:
    swap_pairs([1, 1], [3, 4], 10, 10, "host")  # one device block copied to two host blocks
    unique_keys(["a", "b"])
    with pytest.raises(ProtocolError) as info:
        unique_keys(["a", "a"])
    assert info.value.code == ErrorCode.DUPLICATE_ID
