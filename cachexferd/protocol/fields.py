"""Field checkers for wire messages: each validates one decoded msgpack value.

A checker returns the value (possibly normalised) or raises ProtocolError with BAD_FIELD
or TOO_LARGE and a detail that names the field. They run on untrusted input, so they test
exact types (``type(x) is int`` rejects bools) and bound every size before iterating.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .constants import ErrorCode, Limits
from .errors import ProtocolError

Check = Callable[[str, Any], Any]


def _bad(name: str, want: str, value: Any) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be {want}, got {type(value).__name__}")


def integer(lo: int = 0, hi: int = Limits.MAX_REQ_ID) -> Check:
    def check(name: str, value: Any) -> int:
        if type(value) is not int:
            raise _bad(name, "an int", value)
        if not lo <= value <= hi:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} = {value} is outside [{lo}, {hi}]")
        return value

    return check


def number(lo: float = 0.0, hi: float = 1e9) -> Check:
    def check(name: str, value: Any) -> float:
        if type(value) not in (int, float):
            raise _bad(name, "a number", value)
        if not lo <= value <= hi:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} = {value} is outside [{lo}, {hi}]")
        return float(value)

    return check


def text(max_len: int = Limits.MAX_STR, choices: frozenset[str] | None = None) -> Check:
    def check(name: str, value: Any) -> str:
        if type(value) is not str:
            raise _bad(name, "a string", value)
        if len(value) > max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} is longer than {max_len}")
        if choices is not None and value not in choices:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} = {value!r} is not one of {sorted(choices)}")
        return value

    return check


def boolean() -> Check:
    def check(name: str, value: Any) -> bool:
        if type(value) is not bool:
            raise _bad(name, "a bool", value)
        return value

    return check


def optional(inner: Check) -> Check:
    def check(name: str, value: Any) -> Any:
        return None if value is None else inner(name, value)

    return check


def int_list(max_len: int = Limits.MAX_IDS, lo: int = 0, hi: int = Limits.MAX_BLOCK_ID) -> Check:
    def check(name: str, value: Any) -> list[int]:
        if type(value) is not list:
            raise _bad(name, "a list of ints", value)
        if len(value) > max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} has {len(value)} entries, limit {max_len}")
        if not all(type(v) is int for v in value):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must hold only ints")
        if value and (min(value) < lo or max(value) > hi):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} holds a value outside [{lo}, {hi}]")
        return value

    return check


def key_list(max_len: int = Limits.MAX_KEYS, max_key: int = Limits.MAX_KEY_BYTES) -> Check:
    """Storage keys: strings of printable ASCII without spaces, at most max_key bytes."""

    def check(name: str, value: Any) -> list[str]:
        if type(value) is not list:
            raise _bad(name, "a list of strings", value)
        if len(value) > max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} has {len(value)} entries, limit {max_len}")
        for key in value:
            if type(key) is not str or not 0 < len(key) <= max_key or not key.isascii() or not key.isprintable():
                raise ProtocolError(
                    ErrorCode.BAD_FIELD, f"field {name!r} holds a key that is not 1..{max_key} printable ASCII chars"
                )
            if " " in key:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} holds a key with a space")
        return value

    return check


def mapping(max_len: int = Limits.MAX_MAP) -> Check:
    def check(name: str, value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise _bad(name, "a map", value)
        if len(value) > max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} has more than {max_len} entries")
        return value

    return check


def version_pair() -> Check:
    def check(name: str, value: Any) -> list[int]:
        if type(value) is not list or len(value) != 2 or not all(type(v) is int and v >= 0 for v in value):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be [major, minor]")
        return value

    return check
