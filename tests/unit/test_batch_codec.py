"""BATCH and EVENT_BATCH envelopes, req_id recovery from oversized bodies, and the one place
that says which commands are asynchronous."""

from __future__ import annotations

import msgpack
import pytest

from cachexferd.client.commands import CommandMethods
from cachexferd.protocol import (
    ASYNC_TYPES,
    COMMANDS,
    ErrorCode,
    Limits,
    MsgType,
    Outcome,
    ProtocolError,
    SwapOut,
    batch_item,
    batch_items,
    decode_frames,
    decode_outcomes,
    encode_batch,
    encode_event_batch,
)
from cachexferd.protocol.codec import pack, peek_req_id, unpack


def test_batch_round_trip_keeps_order_and_req_ids() -> None:
    items = [(MsgType.SWAP_OUT, {"req_id": i, "device_ids": [i], "host_ids": [i + 1]}) for i in range(1, 6)]
    frames = encode_batch(items)
    assert frames[0] == b"CX\x01\x08"
    msg_type, body = decode_frames(frames)
    assert msg_type == MsgType.BATCH
    cmds = [batch_item(item) for item in batch_items(body)]
    assert [c.req_id for c in cmds] == [1, 2, 3, 4, 5] and all(isinstance(c, SwapOut) for c in cmds)


@pytest.mark.parametrize(
    ("item", "code", "req_id"),
    [
        ("nope", ErrorCode.BAD_FIELD, 0),
        ([16], ErrorCode.BAD_FIELD, 0),
        ([int(MsgType.BATCH), {"req_id": 9, "items": []}], ErrorCode.BAD_FIELD, 9),
        ([99, {"req_id": 4}], ErrorCode.UNKNOWN_TYPE, 4),
        ([int(MsgType.SWAP_OUT), {"req_id": 5, "device_ids": "x", "host_ids": []}], ErrorCode.BAD_FIELD, 5),
    ],
)
def test_bad_batch_items_name_their_req_id(item: object, code: ErrorCode, req_id: int) -> None:
    with pytest.raises(ProtocolError) as info:
        batch_item(item)
    assert (info.value.code, info.value.req_id) == (code, req_id)


def test_batch_limits() -> None:
    with pytest.raises(ProtocolError) as info:
        batch_items({"items": [[16, {}]] * (Limits.MAX_BATCH + 1)})
    assert info.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError) as info:
        batch_items({"items": "x"})
    assert info.value.code == ErrorCode.BAD_FIELD


def test_event_batch_round_trip() -> None:
    outcomes = [Outcome(7, "boot", 3, 0, "", {"blocks": 1}, 16), Outcome(8, "boot", 3, 10, "bad id", {}, 17)]
    decoded = decode_outcomes(encode_event_batch("boot", 3, [o.to_compact() for o in outcomes]))
    assert decoded == outcomes and decoded[1].error == "ID_OUT_OF_RANGE"


def test_oversized_body_reports_its_req_id() -> None:
    big = pack({"padding": b"x" * (Limits.MAX_BODY_BYTES + 10), "req_id": 42, "after": [1, 2]})
    assert peek_req_id(big) == 42
    with pytest.raises(ProtocolError) as info:
        unpack(big)
    assert (info.value.code, info.value.req_id) == (ErrorCode.TOO_LARGE, 42)
    assert peek_req_id(b"\xc1garbage") == 0
    assert peek_req_id(msgpack.packb([1, 2, 3])) == 0
    assert peek_req_id(pack({"req_id": "seven"})) == 0


def test_async_types_come_from_the_message_classes_and_every_one_has_a_client_method() -> None:
    assert {t for t, cls in COMMANDS.items() if cls.ASYNC} == ASYNC_TYPES
    assert MsgType.SWAP_OUT in ASYNC_TYPES and MsgType.ATTACH not in ASYNC_TYPES
    for msg_type in ASYNC_TYPES:
        assert callable(getattr(CommandMethods, COMMANDS[msg_type].name(), None)), msg_type


def test_event_batch_example_in_the_spec_is_byte_exact() -> None:
    """docs/protocol.md §14.2 shows the body of an EVENT_BATCH byte by byte."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    block = text.split("## 14. Batch envelopes", 1)[1].split("```", 2)[1]
    hex_bytes = "".join(line.split("#", 1)[0].replace(" ", "") for line in block.splitlines())
    frames = encode_event_batch("b1", 0, [[7, 16, 0, "", {}], [8, 17, 10, "id", {}]])
    assert frames[1].hex() == hex_bytes
