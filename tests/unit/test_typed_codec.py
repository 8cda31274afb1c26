"""The typed fast path (protocol/typed.py) against the checked decoder it stands in for:
generated from the message dataclasses (a field added to a message is decoded, or the
message loses its fast path), and never accepting a body the checked path would refuse or
decode differently."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachexferd.protocol import (
    COMMANDS,
    Command,
    Limits,
    MsgType,
    ProtocolError,
    batch_item,
    batch_items,
    command_from_body,
    decode_commands,
    decode_frames,
    encode_batch,
    encode_body,
    encode_event_batch,
    encode_outcome_fields,
)
from cachexferd.protocol import fields as f
from cachexferd.protocol.codec import unpack
from cachexferd.protocol.messages import _spec
from cachexferd.protocol.typed import BODIES, body_struct, decode_batch, decode_body

SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# The commands of the hot path must keep their fast path: a new field on one of them needs a
# checker that declares its wire type (protocol/fields.py).
HOT = {MsgType.SWAP_OUT, MsgType.SWAP_IN, MsgType.CLEAR_HOST, MsgType.PING, MsgType.STORE, MsgType.LOAD,
       MsgType.LOOKUP, MsgType.DELETE, MsgType.HELLO, MsgType.STATUS}  # fmt: skip


def test_structs_have_exactly_the_dataclass_fields() -> None:
    for msg_type, cls in COMMANDS.items():
        struct = BODIES.get(int(msg_type))
        if struct is None:
            assert any(f.wire_type(fld.metadata["check"]) is None for fld in fields(cls)), msg_type
            continue
        wire = [(w.name, w.required, None if w.required else w.default) for w in msgspec.structs.fields(struct)]
        want = [(d.name, d.default is MISSING, None if d.default is MISSING else d.default) for d in fields(cls)]
        assert wire == want, msg_type
    assert {MsgType(t) for t in BODIES} >= HOT


def test_a_field_added_to_a_message_is_decoded_or_the_fast_path_is_dropped() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Extended(Command):
        TYPE: ClassVar[MsgType] = MsgType.SWAP_OUT
        device_ids: list[int] = _spec(f.int_list())  # noqa: RUF009
        owner: str | None = _spec(f.optional(f.text(32)), None)

    struct = body_struct(Extended)
    assert struct is not None and "owner" in struct.__struct_fields__

    @dataclass(frozen=True, kw_only=True)
    class Untyped(Command):
        TYPE: ClassVar[MsgType] = MsgType.SWAP_OUT
        extra: Any = _spec(lambda name, value: value)  # noqa: RUF009 (a checker with no wire type)

    assert body_struct(Untyped) is None


def checked(msg_type: int, data: bytes) -> Command | None:
    try:
        return command_from_body(msg_type, unpack(data))
    except ProtocolError:
        return None


# Field values near every checker's edges, of the right and the wrong types.
ints = st.sampled_from([-1, 0, 1, 7, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1])
leaves = (
    ints | st.none() | st.booleans() | st.sampled_from([0.0, 1.5, 3600.0, 3600.5, float("nan"), -0.0])
    | st.sampled_from(["", "engine", "runner", "king", "k", "a b", "x" * 65, "x" * 257, "ab\n", "é", "ipc:///x"])
    | st.binary(max_size=3)
)  # fmt: skip
field_values = leaves | st.lists(leaves, max_size=4) | st.dictionaries(st.sampled_from(["a", "b"]), leaves, max_size=2)
FIELD_NAMES = sorted({fld.name for cls in COMMANDS.values() for fld in fields(cls)} | {"unknown"})
bodies = st.dictionaries(st.sampled_from(FIELD_NAMES), field_values, max_size=6)


@SETTINGS
@given(st.sampled_from(sorted(BODIES)), bodies)
def test_fast_body_is_the_checked_body_or_nothing(msg_type: int, body: dict[str, Any]) -> None:
    data = msgpack.packb(body, use_bin_type=True)
    fast, slow = decode_body(msg_type, data), checked(msg_type, data)
    if fast is not None:
        assert fast == slow and type(fast) is type(slow)
    elif slow is not None:  # only keys the type does not know may send an acceptable body the long way
        assert set(body) - {fld.name for fld in fields(COMMANDS[MsgType(msg_type)])}


def complete_bodies(msg_type: int) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies holding every field of the type (of any value), sometimes more."""
    names = [fld.name for fld in fields(COMMANDS[MsgType(msg_type)])]
    ids = st.lists(ints, max_size=3) | field_values
    return st.fixed_dictionaries(
        {name: ids if name.endswith("_ids") else field_values for name in names},
        optional={"unknown": field_values},
    )


@SETTINGS
@given(st.sampled_from(sorted(BODIES)).flatmap(lambda t: st.tuples(st.just(t), complete_bodies(t))))
def test_complete_bodies_decode_alike(case: tuple[int, dict[str, Any]]) -> None:
    msg_type, body = case
    test_fast_body_is_the_checked_body_or_nothing.hypothesis.inner_test(msg_type, body)  # type: ignore[attr-defined]


@pytest.mark.parametrize("msg_type", sorted(BODIES))
def test_fast_body_takes_what_the_checked_path_takes(msg_type: int) -> None:
    cls = COMMANDS[MsgType(msg_type)]
    sample = {
        "req_id": 2**64 - 1, "boot_id": "b" * 64, "device_ids": [0, 2**31 - 1], "host_ids": [5, 6],
        "keys": ["k!~", "x" * 256], "protocol": [1, 2], "client": "c", "role": "tool", "events": None, "pid": 9,
        "batch_events": True, "drain_timeout_s": 3600, "version": 2**63 - 1, "parent": "p~!",
        "events_key": "k" * 40, "weights_version": 7, "owner": "o" * 64, "not_after": 1e12, "supersede": True,
        "start": 2**31 - 1, "count": 16384, "after": 2**63 - 1, "max": 16384, "tags": [b"t" * 64, b""],
    }  # fmt: skip
    body = {fld.name: sample[fld.name] for fld in fields(cls)}
    data = msgpack.packb(body, use_bin_type=True)
    fast = decode_body(msg_type, data)
    assert fast is not None and fast == checked(msg_type, data)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(sorted(BODIES)), bodies), min_size=1, max_size=5))
def test_fast_batch_is_the_checked_batch_or_nothing(items: list[tuple[int, dict[str, Any]]]) -> None:
    frames = encode_batch([(MsgType(t), b) for t, b in items])
    fast = decode_commands(frames)
    slow: list[Command] = []
    _, envelope = decode_frames(frames)
    for item in batch_items(envelope):
        try:
            slow.append(batch_item(item))
        except ProtocolError:
            assert fast is None  # one bad item sends the whole envelope the checked way
            return
    if fast is not None:
        assert fast == slow


@pytest.mark.parametrize(
    "items",
    [
        [[16, {"req_id": 1, "device_ids": [1], "host_ids": [1]}, 3]],  # a third element
        [[16, {"req_id": 1, "device_ids": [1], "host_ids": [1], "x": 1}]],  # an unknown key
        [[True, {"req_id": 1}]],  # a bool is not a type
        [[99, {"req_id": 1}]],  # unknown type
        [[8, {"req_id": 1, "items": []}]],  # nested batch
        [[16, {"req_id": True, "device_ids": [1], "host_ids": [1]}]],
        [[16, {"req_id": 1, "device_ids": [1.0], "host_ids": [1]}]],
        [[4, {"req_id": 1, "layout": {}, "device": {}}]],  # ATTACH has no fast path (maps of anything)
    ],
)
def test_doubtful_items_take_the_checked_path(items: list[Any]) -> None:
    assert decode_batch(msgpack.packb({"items": items}, use_bin_type=True)) is None


def test_envelope_limits_take_the_checked_path() -> None:
    one = [16, {"req_id": 1, "device_ids": [1], "host_ids": [1]}]
    assert decode_batch(msgpack.packb({"items": [one] * Limits.MAX_BATCH})) is not None
    assert decode_batch(msgpack.packb({"items": [one] * (Limits.MAX_BATCH + 1)})) is None
    assert decode_batch(msgpack.packb({"items": [one], "more": 1})) is None
    # A map that repeats a key more than 65 536 times: the checked decoder says TOO_LARGE.
    repeated = b"\xde\xff\xff" + b"\xa3pid\x01" * 0xFFFF
    assert decode_body(MsgType.HELLO, repeated) is None


def test_frames_that_are_not_one_well_formed_message_take_the_checked_path() -> None:
    good = encode_body(MsgType.PING, {"req_id": 3})
    assert decode_commands(good) is not None
    assert decode_commands([good[0]]) is None
    assert decode_commands([b"CX\x02\x02", good[1]]) is None  # another major
    assert decode_commands([b"XX\x01\x02", good[1]]) is None
    assert decode_commands([good[0], good[1] + b"\x00"]) is None  # trailing bytes
    # A str that is not UTF-8 (msgspec raises UnicodeDecodeError for it, not its own errors).
    bad_text = b"\x82\xa6req_id\x03\xa7boot_id\xa2\xf1\x80"
    assert decode_body(MsgType.PING, bad_text) is None and checked(MsgType.PING, bad_text) is None
    assert decode_batch(b"\x81\xa5items\x91\x92\x02" + bad_text) is None


outcome_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@SETTINGS
@given(st.integers(0, 2**64 - 1), st.integers(0, 255), st.text(max_size=300),
       st.dictionaries(st.text(), outcome_values))  # fmt: skip
def test_outcomes_are_the_bytes_msgpack_writes(req_id: int, op: int, detail: str, result: dict[str, Any]) -> None:
    """The encoder changed from msgpack to msgspec: the bytes must not."""
    frames = encode_outcome_fields(MsgType.EVENT, req_id, "b" * 32, 3, op, 5, detail, result)
    body = {"req_id": req_id, "boot_id": "b" * 32, "rank": 3, "op": op, "code": 5, "error": "TOO_LARGE",
            "detail": detail, "result": result}  # fmt: skip
    assert frames[1] == msgpack.packb(body, use_bin_type=True)
    batch = encode_event_batch("b1", 0, [[req_id, op, 0, detail, result]])
    assert batch[1] == msgpack.packb({"boot_id": "b1", "rank": 0, "events": [[req_id, op, 0, detail, result]]},
                                     use_bin_type=True)  # fmt: skip


def checked_outcomes(frames: list[bytes]) -> list[Any] | None:
    from cachexferd.protocol.codec import _outcome_frames
    from cachexferd.protocol.messages import Outcome

    try:
        msg_type, body = _outcome_frames(frames)
        if msg_type == MsgType.EVENT_BATCH:
            return [Outcome.from_compact(e, body["boot_id"], body["rank"]) for e in body["events"]]
        return [Outcome.from_wire(body)]
    except (ProtocolError, KeyError, TypeError):
        return None


entry_values = (
    st.sampled_from([-1, 0, 7, 255, 256, 2**16, 2**64 - 1]) | st.text(max_size=3) | st.none()
    | st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2)
)  # fmt: skip
entries = st.lists(entry_values, min_size=4, max_size=6)


@SETTINGS
@given(st.text(max_size=70) | st.integers(-9, 9), st.integers(-1, 2**21), st.lists(entries, max_size=3))
def test_fast_outcomes_are_the_checked_outcomes_or_nothing(boot_id: Any, rank: int, events: list[Any]) -> None:
    from cachexferd.protocol.typed import decode_outcomes as fast_outcomes

    frames = [b"CX\x01\x82", msgpack.packb({"boot_id": boot_id, "rank": rank, "events": events})]
    fast = fast_outcomes(frames)
    if fast is not None:
        assert fast == checked_outcomes(frames)
    single = {"req_id": rank, "boot_id": boot_id, "rank": rank, "code": 0, "op": 16, "error": "OK", "result": {}}
    frames = [b"CX\x01\x80", msgpack.packb(single)]
    fast = fast_outcomes(frames)
    if fast is not None:
        assert fast == checked_outcomes(frames)
    elif isinstance(boot_id, str) and len(boot_id) <= 64 and 0 <= rank <= 2**20:
        pytest.fail("a well-formed reply took the checked path")
