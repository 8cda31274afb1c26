"""Codec round trips and hostile-input decoding."""

from __future__ import annotations

import msgpack
import pytest

from cachexferd.protocol import (
    COMMANDS,
    Attach,
    ErrorCode,
    Hello,
    Limits,
    MsgType,
    Outcome,
    ProtocolError,
    SwapOut,
    decode_command,
    decode_outcome,
    encode_command,
    encode_header,
    encode_outcome,
)
from cachexferd.protocol.codec import pack

SAMPLES = {
    MsgType.HELLO: {"protocol": [1, 0], "client": "e", "role": "engine", "events": "ipc:///tmp/x", "pid": 7},
    MsgType.PING: {},
    MsgType.STATUS: {},
    MsgType.ATTACH: {"layout": {"num_layers": 1}, "device": {"kind": "shm"}, "pid": 3},
    MsgType.DETACH: {"drain_timeout_s": 1.5},
    MsgType.SHUTDOWN: {},
    MsgType.PAUSE: {"drain_timeout_s": 2.0},
    MsgType.RESUME: {},
    MsgType.SET_WEIGHTS: {"version": 7},
    MsgType.HOST_KEYS: {"start": 4, "count": 8},
    MsgType.STORAGE_EVENTS: {"after": 1 << 62, "max": 16},
    MsgType.SWAP_OUT: {"device_ids": [1, 2], "host_ids": [3, 4], "keys": ["k1", "k2"]},
    MsgType.SWAP_IN: {"device_ids": [], "host_ids": []},
    MsgType.CLEAR_HOST: {},
    MsgType.STORE: {"keys": ["a", "b"], "host_ids": [1, 2], "device_ids": None, "tags": [b"t", b""]},
    MsgType.LOAD: {"keys": ["a"], "host_ids": [1], "device_ids": [5]},
    MsgType.LOOKUP: {"keys": ["k"]},
    MsgType.DELETE: {"keys": ["k"]},
}


@pytest.mark.parametrize("op", sorted(SAMPLES))
def test_every_command_round_trips(op: MsgType) -> None:
    cmd = COMMANDS[op](req_id=42, boot_id="b" * 32, **SAMPLES[op])
    frames = encode_command(cmd)
    assert frames[0] == b"CX" + bytes([1, int(op)])
    assert decode_command(frames) == cmd


def test_every_command_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(COMMANDS)


def test_outcome_round_trip() -> None:
    out = Outcome(9, "boot", 1, int(ErrorCode.ID_OUT_OF_RANGE), "bad id", {"blocks": 3}, int(MsgType.SWAP_IN))
    kind, back = decode_outcome(encode_outcome(out, MsgType.EVENT))
    assert kind == MsgType.EVENT and back == out and back.error == "ID_OUT_OF_RANGE" and not back.ok


def _expect(frames: list[bytes], code: ErrorCode) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_command(frames)
    assert info.value.code == code, info.value
    return info.value


def test_garbage_frames() -> None:
    _expect([b"hello"], ErrorCode.BAD_FRAME)
    _expect([b"XX\x01\x02", pack({})], ErrorCode.BAD_FRAME)
    _expect([encode_header(MsgType.PING), b"\xc1\xc1\xc1"], ErrorCode.BAD_FRAME)
    _expect([encode_header(MsgType.PING), msgpack.packb([1, 2])], ErrorCode.BAD_FRAME)
    _expect([encode_header(MsgType.PING), pack({"req_id": 1}), b"extra"], ErrorCode.BAD_FRAME)


def test_wrong_version_keeps_req_id() -> None:
    err = _expect([b"CX\x02\x02", pack({"req_id": 77})], ErrorCode.WRONG_VERSION)
    assert err.req_id == 77 and err.msg_type == MsgType.PING


def test_unknown_type() -> None:
    err = _expect([b"CX\x01\x63", pack({"req_id": 5})], ErrorCode.UNKNOWN_TYPE)
    assert err.req_id == 5


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"device_ids": [1], "host_ids": [1]}, ErrorCode.BAD_FIELD),  # no req_id
        ({"req_id": 0, "device_ids": [], "host_ids": []}, ErrorCode.BAD_FIELD),
        ({"req_id": "7", "device_ids": [], "host_ids": []}, ErrorCode.BAD_FIELD),
        ({"req_id": True, "device_ids": [], "host_ids": []}, ErrorCode.BAD_FIELD),
        ({"req_id": 1, "device_ids": "12", "host_ids": []}, ErrorCode.BAD_FIELD),
        ({"req_id": 1, "device_ids": [1.5], "host_ids": [1]}, ErrorCode.BAD_FIELD),
        ({"req_id": 1, "device_ids": [-1], "host_ids": [1]}, ErrorCode.BAD_FIELD),
        ({"req_id": 1, "device_ids": [2**40], "host_ids": [1]}, ErrorCode.BAD_FIELD),
        ({"req_id": 1, "device_ids": [True], "host_ids": [1]}, ErrorCode.BAD_FIELD),
        ({"req_id": 1, "host_ids": [1]}, ErrorCode.BAD_FIELD),
        ({"req_id": 1, "device_ids": list(range(Limits.MAX_IDS + 1)), "host_ids": []}, ErrorCode.TOO_LARGE),
    ],
)
def test_bad_swap_fields(body: dict[str, object], code: ErrorCode) -> None:
    _expect([encode_header(MsgType.SWAP_OUT), pack(body)], code)


def test_oversized_body_is_refused_before_parsing() -> None:
    body = b"\x00" * (Limits.MAX_BODY_BYTES + 1)
    _expect([encode_header(MsgType.PING), body], ErrorCode.TOO_LARGE)


def test_bad_keys() -> None:
    for keys, code in ((["a b"], ErrorCode.BAD_FIELD), ([""], ErrorCode.BAD_FIELD), (["x" * 300], ErrorCode.BAD_FIELD),
                       ([b"bytes"], ErrorCode.BAD_FIELD), (["é"], ErrorCode.BAD_FIELD)):  # fmt: skip
        _expect([encode_header(MsgType.LOOKUP), pack({"req_id": 1, "keys": keys})], code)


def test_hello_fields_are_checked() -> None:
    _expect([encode_header(MsgType.HELLO), pack({"req_id": 1, "protocol": [1]})], ErrorCode.BAD_FIELD)
    _expect(
        [encode_header(MsgType.HELLO), pack({"req_id": 1, "protocol": [1, 0], "role": "admin"})], ErrorCode.BAD_FIELD
    )
    ok = decode_command([encode_header(MsgType.HELLO), pack({"req_id": 1, "protocol": [1, 3], "future_field": 1})])
    assert isinstance(ok, Hello) and ok.events is None  # unknown fields are ignored (minor versions add fields)


def test_attach_maps_are_bounded() -> None:
    big = {f"k{i}": i for i in range(Limits.MAX_MAP + 1)}
    _expect([encode_header(MsgType.ATTACH), pack({"req_id": 1, "layout": big, "device": {}})], ErrorCode.TOO_LARGE)
    cmd = decode_command(encode_command(Attach(req_id=3, layout={"a": 1}, device={"kind": "shm"})))
    assert isinstance(cmd, Attach)


def test_outcome_decoding_rejects_commands() -> None:
    with pytest.raises(ProtocolError):
        decode_outcome(encode_command(SwapOut(req_id=1, device_ids=[], host_ids=[])))


def test_huge_containers_are_too_large() -> None:
    body = msgpack.packb({"req_id": 1, "device_ids": [0] * (4 * Limits.MAX_IDS + 1), "host_ids": []})
    _expect([encode_header(MsgType.SWAP_OUT), body], ErrorCode.TOO_LARGE)
