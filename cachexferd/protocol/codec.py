"""Frame encoding and decoding.

Every message is two ZeroMQ frames: a 4-byte header (``b"CX"``, protocol major, message
type) and a msgpack body (a map with string keys). The ROUTER adds the peer identity in
front; this module never sees it. Decoding treats its input as hostile: sizes are checked
before parsing and msgpack runs with explicit container limits.

Protocol 1.1 adds two envelopes: BATCH (client -> daemon, ``{"items": [[type, body], ...]}``)
and EVENT_BATCH (daemon -> client, ``{"boot_id", "rank", "events": [[req_id, op, code,
detail, result], ...]}``). Every command inside keeps its own req_id and its own outcome.
"""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec

from . import typed
from .constants import HEADER_LEN, MAGIC, PROTOCOL_MAJOR, ErrorCode, Limits, MsgType
from .errors import ProtocolError
from .messages import COMMAND_TYPES, COMMANDS, Command, Outcome, error_name

_HEADERS = {t: MAGIC + bytes((PROTOCOL_MAJOR, int(t))) for t in MsgType}
# msgspec writes the bytes msgpack's packb(use_bin_type=True) writes (shortest int and str
# forms, str for str, bin for bytes, float 64) several times faster: packb builds a Packer
# per call. tests/unit/test_typed_codec.py holds the two to the same bytes.
_encode = msgspec.msgpack.Encoder().encode


def encode_header(msg_type: MsgType) -> bytes:
    return _HEADERS[msg_type]


def pack(body: dict[str, Any]) -> bytes:
    return _encode(body)


def unpack(data: bytes) -> dict[str, Any]:
    if len(data) > Limits.MAX_BODY_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"body of {len(data)} bytes exceeds {Limits.MAX_BODY_BYTES}", peek_req_id(data)
        )
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=Limits.MAX_BODY_BYTES,
            max_bin_len=Limits.MAX_BODY_BYTES,
            # Generous container limits bound memory; the field checkers apply the real ones
            # so that the error names the field.
            max_array_len=4 * max(Limits.MAX_IDS, Limits.MAX_KEYS),
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except ValueError as exc:
        if "exceeds max" in str(exc):
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"body holds a container over the limits: {exc}", peek_req_id(data)
            ) from None
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack: {exc}") from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack: {type(exc).__name__}") from None
    if type(body) is not dict:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body must be a msgpack map, got {type(body).__name__}")
    return body


def peek_req_id(data: bytes) -> int:
    """The top-level ``req_id`` of a body too large to decode, or 0 when it cannot be read.

    Only the map's keys are decoded; every other value is skipped unparsed, so the cost is
    bounded by the number of top-level entries, not by the body's size."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data) + 1, strict_map_key=False)
    unpacker.feed(data)
    try:
        for _ in range(min(unpacker.read_map_header(), 1 << 16)):
            if unpacker.unpack() == "req_id":
                value = unpacker.unpack()
                return value if type(value) is int and 0 < value <= Limits.MAX_REQ_ID else 0
            unpacker.skip()
    except Exception:  # garbage, truncated, or not a map: nothing readable
        return 0
    return 0


def encode_command(cmd: Command) -> list[bytes]:
    return [encode_header(cmd.TYPE), pack(cmd.to_wire())]


def encode_body(msg_type: MsgType, body: dict[str, Any]) -> list[bytes]:
    """Frames of a command given as its wire map (the clients' fast path)."""
    return [encode_header(msg_type), pack(body)]


def encode_batch(items: list[tuple[MsgType, dict[str, Any]]]) -> list[bytes]:
    """One BATCH envelope carrying ``items`` (message type, wire map), in order."""
    return [encode_header(MsgType.BATCH), pack({"items": [[int(t), body] for t, body in items]})]


def encode_outcome(outcome: Outcome, msg_type: MsgType) -> list[bytes]:
    return [encode_header(msg_type), pack(outcome.to_wire())]


def encode_outcome_fields(
    msg_type: MsgType, req_id: int, boot_id: str, rank: int, op: int, code: int, detail: str, result: dict[str, Any]
) -> list[bytes]:
    """``encode_outcome`` without building an Outcome first (the daemon's hot path)."""
    body = {"req_id": req_id, "boot_id": boot_id, "rank": rank, "op": op, "code": code,
            "error": error_name(code), "detail": detail, "result": result}  # fmt: skip
    return [encode_header(msg_type), pack(body)]


def encode_event_batch(boot_id: str, rank: int, entries: list[list[Any]]) -> list[bytes]:
    """One EVENT_BATCH of compact entries ``[req_id, op, code, detail, result]``
    (``Outcome.to_compact``), in the order their outcomes were decided."""
    body = {"boot_id": boot_id, "rank": rank, "events": entries}
    return [encode_header(MsgType.EVENT_BATCH), pack(body)]


def decode_header(frame: bytes) -> tuple[int, int]:
    """Returns (major, msg_type); raises BAD_FRAME for anything that is not a header."""
    if len(frame) != HEADER_LEN or frame[:2] != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, "first frame is not a cachexferd header (b'CX' + major + type)")
    return frame[2], frame[3]


def _peek_req_id(body: dict[str, Any]) -> int:
    req_id = body.get("req_id")
    return req_id if type(req_id) is int and 0 < req_id <= Limits.MAX_REQ_ID else 0


def decode_frames(frames: list[bytes]) -> tuple[int, dict[str, Any]]:
    """(message type, body map) of a client's frames (identity already removed).

    A wrong protocol major is refused here, with whatever req_id could be read."""
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"expected 2 frames (header, body), got {len(frames)}")
    major, msg_type = decode_header(frames[0])
    try:
        body = unpack(frames[1])
    except ProtocolError as exc:
        exc.msg_type = msg_type
        raise
    if major != PROTOCOL_MAJOR:
        raise ProtocolError(
            ErrorCode.WRONG_VERSION, f"protocol major {major} is not {PROTOCOL_MAJOR}", _peek_req_id(body), msg_type
        )
    return msg_type, body


def command_from_body(msg_type: int, body: dict[str, Any]) -> Command:
    """The Command of one decoded body. On failure the ProtocolError carries whatever
    req_id and msg_type could be read, so the daemon can still address its error outcome."""
    req_id = _peek_req_id(body)
    if msg_type not in COMMAND_TYPES:
        # A BATCH item's type is any msgpack int; the outcome's op must fit a header byte.
        op = msg_type if 0 <= msg_type <= 255 else 0
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown command type {msg_type}", req_id, op)
    try:
        return COMMANDS[msg_type].from_wire(body)  # type: ignore[index]  # an IntEnum key matches its int
    except ProtocolError as exc:
        exc.req_id, exc.msg_type = req_id, msg_type
        raise


def decode_command(frames: list[bytes]) -> Command:
    """Decodes a client's frames into a Command (a BATCH envelope is refused here)."""
    msg_type, body = decode_frames(frames)
    return command_from_body(msg_type, body)


def batch_items(body: dict[str, Any]) -> list[Any]:
    """The raw ``items`` of a BATCH body; each is decoded with ``batch_item``."""
    items = body.get("items")
    if type(items) is not list:
        raise ProtocolError(ErrorCode.BAD_FIELD, "batch needs field 'items': a list of [type, body]", 0, MsgType.BATCH)
    if len(items) > Limits.MAX_BATCH:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"batch has {len(items)} items, limit {Limits.MAX_BATCH}", 0, MsgType.BATCH
        )
    return items


def _item_req_id(item: Any) -> int:
    """The req_id of a malformed batch item: that of the item itself when it is a map, else of
    the first map in it (docs/protocol.md §14.1); 0 when there is none."""
    maps = [item] if type(item) is dict else [x for x in item if type(x) is dict] if type(item) is list else []
    return _peek_req_id(maps[0]) if maps else 0


def batch_item(item: Any) -> Command:
    """One BATCH item, ``[type, body]``, as a Command. Envelopes do not nest."""
    if type(item) is not list or len(item) != 2 or type(item[0]) is not int or type(item[1]) is not dict:
        detail = "a batch item must be [type, body map]"
        raise ProtocolError(ErrorCode.BAD_FIELD, detail, _item_req_id(item), MsgType.BATCH)
    msg_type, body = item
    if msg_type == MsgType.BATCH:
        raise ProtocolError(ErrorCode.BAD_FIELD, "batches do not nest", _peek_req_id(body), msg_type)
    return command_from_body(msg_type, body)


def decode_outcome(frames: list[bytes]) -> tuple[MsgType, Outcome]:
    """Decodes a daemon's reply or event. Raises ProtocolError on anything else."""
    msg_type, body = _outcome_frames(frames)
    if msg_type not in (MsgType.REPLY, MsgType.EVENT):
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"type {msg_type} is not a reply or event")
    return MsgType(msg_type), Outcome.from_wire(body)


def decode_outcomes(frames: list[bytes]) -> list[Outcome]:
    """The outcomes in a REPLY, EVENT or EVENT_BATCH message."""
    fast = typed.decode_outcomes(frames)  # one compiled call for well-formed messages
    if fast is not None:
        return fast
    msg_type, body = _outcome_frames(frames)
    if msg_type in (MsgType.REPLY, MsgType.EVENT):
        return [Outcome.from_wire(body)]
    if msg_type != MsgType.EVENT_BATCH:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"type {msg_type} is not a reply or event")
    boot_id, rank, events = body.get("boot_id"), body.get("rank"), body.get("events")
    if type(boot_id) is not str or type(rank) is not int or type(events) is not list:
        raise ProtocolError(ErrorCode.BAD_FIELD, "event batch needs boot_id (str), rank (int) and events (list)")
    return [Outcome.from_compact(entry, boot_id, rank) for entry in events]


def _outcome_frames(frames: list[bytes]) -> tuple[int, dict[str, Any]]:
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"expected 2 frames, got {len(frames)}")
    major, msg_type = decode_header(frames[0])
    if major != PROTOCOL_MAJOR:
        raise ProtocolError(ErrorCode.WRONG_VERSION, f"daemon speaks protocol major {major}")
    return msg_type, unpack(frames[1])
