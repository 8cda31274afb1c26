"""Property tests of the codec on hostile input: whatever arrives, decoding either succeeds or
raises ProtocolError (which the daemon turns into an error outcome), never anything else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachexferd.protocol import (
    COMMANDS,
    MAGIC,
    Limits,
    MsgType,
    ProtocolError,
    batch_item,
    batch_items,
    command_from_body,
    decode_command,
    decode_frames,
    decode_outcome,
    decode_outcomes,
    encode_command,
)

SETTINGS = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# Every key any message or outcome uses, so that random maps reach the field checkers.
KEYS = sorted(
    {name for cls in COMMANDS.values() for name in cls.__dataclass_fields__}
    | {"items", "op", "code", "error", "detail", "result", "rank", "events", "boot_id", "kind", "name", "offsets"}
    | {"num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype"}
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=24)
    | st.binary(max_size=24)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4))
)
any_keys = st.sampled_from(KEYS) | st.text(max_size=8) | st.integers(-5, 5) | st.binary(max_size=4)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(any_keys, inner, max_size=5), max_leaves=24
)
plausible_maps = st.dictionaries(st.sampled_from(KEYS), values, max_size=9)
message_types = st.sampled_from([int(t) for t in MsgType]) | st.integers(0, 255)
item_types = message_types | st.integers(-(2**63), 2**64 - 1)  # a BATCH item's type is any msgpack int
headers = st.builds(lambda major, t: MAGIC + bytes((major, t)), st.sampled_from([1, 1, 1, 0, 2, 255]), message_types)


def pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def bodies() -> st.SearchStrategy[bytes]:
    return st.binary(max_size=64) | plausible_maps.map(pack) | values.map(pack)


def only_protocol_errors(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except ProtocolError as exc:
        # The daemon echoes these in the error outcome: they must fit its fields.
        assert exc.code != 0 and isinstance(exc.detail, str)
        assert 0 <= exc.msg_type <= 255 and 0 <= exc.req_id <= Limits.MAX_REQ_ID, (exc.msg_type, exc.req_id)
        return None


@SETTINGS
@given(st.lists(st.binary(max_size=32), max_size=4))
def test_arbitrary_frames(frames: list[bytes]) -> None:
    only_protocol_errors(decode_frames, frames)
    only_protocol_errors(decode_outcomes, frames)


@SETTINGS
@given(headers, bodies())
def test_header_and_arbitrary_body(header: bytes, body: bytes) -> None:
    for decode in (decode_frames, decode_command, decode_outcome, decode_outcomes):
        only_protocol_errors(decode, [header, body])


@SETTINGS
@given(message_types, plausible_maps)
def test_commands_from_plausible_maps(msg_type: int, body: dict[str, Any]) -> None:
    cmd = only_protocol_errors(command_from_body, msg_type, body)
    if cmd is not None:  # what the checkers accept survives a round trip unchanged
        assert decode_command(encode_command(cmd)) == cmd


@SETTINGS
@given(plausible_maps | st.fixed_dictionaries({"items": values}), st.lists(values, max_size=4))
def test_batch_envelopes_and_items(body: dict[str, Any], items: list[Any]) -> None:
    only_protocol_errors(batch_items, body)
    for item in items:
        only_protocol_errors(batch_item, item)
        only_protocol_errors(batch_item, [int(MsgType.PING), item])


@settings(SETTINGS, max_examples=100)
@given(st.lists(st.tuples(item_types, plausible_maps).map(list), max_size=4))
def test_batch_items_of_plausible_commands(items: list[Any]) -> None:
    for item in only_protocol_errors(batch_items, {"items": items}) or []:
        only_protocol_errors(batch_item, item)


@SETTINGS
@given(
    st.sampled_from([MsgType.REPLY, MsgType.EVENT, MsgType.EVENT_BATCH]),
    plausible_maps | st.fixed_dictionaries({"boot_id": st.text(max_size=4), "rank": st.integers(0, 3),
                                            "events": st.lists(values, max_size=4)}),
)  # fmt: skip
def test_outcomes_from_plausible_maps(msg_type: MsgType, body: dict[str, Any]) -> None:
    frames = [MAGIC + bytes((1, int(msg_type))), pack(body)]
    only_protocol_errors(decode_outcomes, frames)
    only_protocol_errors(decode_outcome, frames)
