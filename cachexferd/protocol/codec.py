"""Frame encoding and decoding.

Every message is two ZeroMQ frames: a 4-byte header (``b"CX"``, protocol major, message
type) and a msgpack body (a map with string keys). The ROUTER adds the peer identity in
front; this module never sees it. Decoding treats its input as hostile: sizes are checked
before parsing and msgpack runs with explicit container limits.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .constants import COMMAND_TYPES, HEADER_LEN, MAGIC, PROTOCOL_MAJOR, ErrorCode, Limits, MsgType
from .errors import ProtocolError
from .messages import COMMANDS, Command, Outcome


def encode_header(msg_type: MsgType) -> bytes:
    return MAGIC + bytes((PROTOCOL_MAJOR, int(msg_type)))


def pack(body: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def unpack(data: bytes) -> dict[str, Any]:
    if len(data) > Limits.MAX_BODY_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body of {len(data)} bytes exceeds {Limits.MAX_BODY_BYTES}")
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
            raise ProtocolError(ErrorCode.TOO_LARGE, f"body holds a container over the limits: {exc}") from None
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack: {exc}") from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack: {type(exc).__name__}") from None
    if type(body) is not dict:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body must be a msgpack map, got {type(body).__name__}")
    return body


def encode_command(cmd: Command) -> list[bytes]:
    return [encode_header(cmd.TYPE), pack(cmd.to_wire())]


def encode_outcome(outcome: Outcome, msg_type: MsgType) -> list[bytes]:
    return [encode_header(msg_type), pack(outcome.to_wire())]


def decode_header(frame: bytes) -> tuple[int, int]:
    """Returns (major, msg_type); raises BAD_FRAME for anything that is not a header."""
    if len(frame) != HEADER_LEN or frame[:2] != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, "first frame is not a cachexferd header (b'CX' + major + type)")
    return frame[2], frame[3]


def _peek_req_id(body: dict[str, Any]) -> int:
    req_id = body.get("req_id")
    return req_id if type(req_id) is int and 0 < req_id <= Limits.MAX_REQ_ID else 0


def decode_command(frames: list[bytes]) -> Command:
    """Decodes a client's frames (identity already removed) into a Command.

    On failure the ProtocolError carries whatever req_id and msg_type could be read, so
    the daemon can still address its error outcome.
    """
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"expected 2 frames (header, body), got {len(frames)}")
    major, msg_type = decode_header(frames[0])
    try:
        body = unpack(frames[1])
    except ProtocolError as exc:
        exc.msg_type = msg_type
        raise
    req_id = _peek_req_id(body)
    if major != PROTOCOL_MAJOR:
        raise ProtocolError(
            ErrorCode.WRONG_VERSION, f"protocol major {major} is not {PROTOCOL_MAJOR}", req_id, msg_type
        )
    if msg_type not in COMMAND_TYPES:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown command type {msg_type}", req_id, msg_type)
    try:
        return COMMANDS[MsgType(msg_type)].from_wire(body)
    except ProtocolError as exc:
        exc.req_id, exc.msg_type = req_id, msg_type
        raise


def decode_outcome(frames: list[bytes]) -> tuple[MsgType, Outcome]:
    """Decodes a daemon's reply or event. Raises ProtocolError on anything else."""
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"expected 2 frames, got {len(frames)}")
    major, msg_type = decode_header(frames[0])
    if major != PROTOCOL_MAJOR:
        raise ProtocolError(ErrorCode.WRONG_VERSION, f"daemon speaks protocol major {major}")
    if msg_type not in (MsgType.REPLY, MsgType.EVENT):
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"type {msg_type} is not a reply or event")
    return MsgType(msg_type), Outcome.from_wire(unpack(frames[1]))
