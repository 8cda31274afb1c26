"""The typed fast path of the decoder: whole bodies and whole BATCH envelopes decoded into
the command dataclasses in one compiled msgspec call.

Every struct here is generated from a command dataclass (messages.py): one field per
dataclass field, with the msgspec type its checker declares (fields.wire_type), so a field
added to a message is decoded here too. A message with a field whose checker declares no
wire type has no fast path at all; tests/unit/test_typed_codec.py checks both.

The fast path only ever says yes to input the checked path (codec.py) would accept with the
same values: its structs refuse unknown keys, and every type is at least as strict as its
checker. Anything else, unknown keys included, goes to the checked path, which decides the
outcome (error code, detail, req_id echo) exactly as it always has. So well-formed traffic
pays one compiled decode, and malformed traffic costs what it did before.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import MISSING, fields
from typing import Annotated, Any

import msgspec

from .constants import MAGIC, PROTOCOL_MAJOR, Limits, MsgType
from .fields import wire_type
from .messages import COMMANDS, Command, Outcome

_asdict = msgspec.structs.asdict
_new = object.__new__


def body_struct(cls: type[Command]) -> type[msgspec.Struct] | None:
    """A struct with the fields of ``cls`` (same names, defaults and accepted values), or None
    when some field's checker declares no wire type."""
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for fld in fields(cls):
        wire = wire_type(fld.metadata["check"])
        if wire is None:
            return None
        spec.append((fld.name, wire) if fld.default is MISSING else (fld.name, wire, fld.default))
    struct: type[msgspec.Struct] = msgspec.defstruct(
        f"{cls.__name__}Body", spec, kw_only=True, forbid_unknown_fields=True
    )
    return struct


def _item_struct(msg_type: MsgType, body: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``[type, body]``: an array whose first element, the tag, is the message type."""
    item: type[msgspec.Struct] = msgspec.defstruct(
        f"{body.__name__}Item", [("body", body)], array_like=True, tag=int(msg_type), forbid_unknown_fields=True
    )
    return item


BODIES: dict[int, type[msgspec.Struct]] = {
    int(t): s for t, cls in COMMANDS.items() if (s := body_struct(cls)) is not None
}
_CLASS_OF: dict[type[msgspec.Struct], type[Command]] = {BODIES[int(t)]: cls for t, cls in COMMANDS.items()
                                                         if int(t) in BODIES}  # fmt: skip
_BODY_DECODERS = {t: msgspec.msgpack.Decoder(s) for t, s in BODIES.items()}
_ANY_ITEM: Any = functools.reduce(operator.or_, (_item_struct(MsgType(t), s) for t, s in BODIES.items()))
_Batch = msgspec.defstruct(
    "BatchBody",
    [("items", Annotated[list[_ANY_ITEM], msgspec.Meta(max_length=Limits.MAX_BATCH)])],
    forbid_unknown_fields=True,
)
_BATCH_DECODER = msgspec.msgpack.Decoder(_Batch)
_PREFIX = MAGIC + bytes((PROTOCOL_MAJOR,))

# The checked decoder refuses a map of more than 65 536 entries (TOO_LARGE); msgspec has no
# such bound, and a map of known keys can only be that long by repeating them. Each entry
# takes at least the shortest field name (plus its length byte) and a one-byte value, so a
# body below this size cannot hold such a map; larger bodies take the checked path.
_SHORTEST_NAME = min(len(f) for s in BODIES.values() for f in s.__struct_fields__)
_MAX_FAST_BYTES = min(Limits.MAX_BODY_BYTES, (1 << 16) * (_SHORTEST_NAME + 2))


def command_of(body: msgspec.Struct) -> Command:
    """The command dataclass holding a decoded struct's values. The values are final (the
    struct's types are the checkers' own), so the frozen dataclass is filled directly
    instead of through its ``__init__``, which costs several times more."""
    cmd: Command = _new(_CLASS_OF[type(body)])
    cmd.__dict__.update(_asdict(body))
    return cmd


def decode_commands(frames: list[bytes]) -> list[Command] | None:
    """The commands in a client's frames (one, or a BATCH envelope's items in order), or None:
    then only the checked path (codec.decode_frames and what follows it) can say."""
    if len(frames) != 2 or frames[0][:3] != _PREFIX or len(frames[0]) != 4:
        return None
    msg_type = frames[0][3]
    if msg_type == MsgType.BATCH:
        return decode_batch(frames[1])
    cmd = decode_body(msg_type, frames[1])
    return None if cmd is None else [cmd]


def decode_body(msg_type: int, data: bytes) -> Command | None:
    """The command in a single message's body, or None: ask the checked path."""
    decoder = _BODY_DECODERS.get(msg_type)
    if decoder is None or len(data) >= _MAX_FAST_BYTES:
        return None
    try:
        return command_of(decoder.decode(data))
    except Exception:  # msgspec's errors, and UnicodeDecodeError for a str that is not UTF-8
        return None


def decode_batch(data: bytes) -> list[Command] | None:
    """The commands of a BATCH body in item order, or None: ask the checked path."""
    if len(data) >= _MAX_FAST_BYTES:
        return None
    try:
        items = _BATCH_DECODER.decode(data).items  # type: ignore[attr-defined]
    except Exception:  # msgspec's errors, and UnicodeDecodeError for a str that is not UTF-8
        return None
    return [command_of(item.body) for item in items]


# Outcomes, for the clients --------------------------------------------------------------

_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Compact(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One entry of an EVENT_BATCH: the bounds of Outcome.from_compact's checkers."""

    req_id: _Count
    op: Annotated[int, msgspec.Meta(ge=0, le=255)]
    code: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    detail: Annotated[str, msgspec.Meta(max_length=Limits.MAX_STR * 4)]
    result: Annotated[dict[str, Any], msgspec.Meta(max_length=1 << 16)]


class _EventBatch(msgspec.Struct, forbid_unknown_fields=True):
    boot_id: str
    rank: int
    events: list[_Compact]


class _Outcome(msgspec.Struct, forbid_unknown_fields=True):
    """A REPLY or EVENT body: the bounds of Outcome.from_wire's checkers."""

    req_id: _Count
    boot_id: Annotated[str, msgspec.Meta(max_length=64)]
    rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    code: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
    detail: Annotated[str, msgspec.Meta(max_length=Limits.MAX_STR * 4)] = ""
    result: Annotated[dict[str, Any], msgspec.Meta(max_length=1 << 16)] = {}
    op: Annotated[int, msgspec.Meta(ge=0, le=255)] = 0
    error: str = ""  # follows from code; not kept


_EVENT_BATCH = msgspec.msgpack.Decoder(_EventBatch)
_OUTCOME = msgspec.msgpack.Decoder(_Outcome)
_OUTCOME_TYPES = (MsgType.REPLY, MsgType.EVENT)


def decode_outcomes(frames: list[bytes]) -> list[Outcome] | None:
    """The outcomes in a daemon's REPLY, EVENT or EVENT_BATCH, or None: ask the checked path
    (codec.decode_outcomes). Values inside a ``result`` map are taken as they come."""
    if len(frames) != 2 or frames[0][:3] != _PREFIX or len(frames[0]) != 4 or len(frames[1]) > Limits.MAX_BODY_BYTES:
        return None
    msg_type = frames[0][3]
    try:
        if msg_type == MsgType.EVENT_BATCH:
            batch = _EVENT_BATCH.decode(frames[1])
            boot_id, rank = batch.boot_id, batch.rank
            return [Outcome(e.req_id, boot_id, rank, e.code, e.detail, e.result, e.op) for e in batch.events]
        if msg_type in _OUTCOME_TYPES:
            o = _OUTCOME.decode(frames[1])
            return [Outcome(o.req_id, o.boot_id, o.rank, o.code, o.detail, o.result, o.op)]
    except Exception:  # msgspec's errors, and UnicodeDecodeError for a str that is not UTF-8
        return None
    return None
