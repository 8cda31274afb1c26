"""Field checkers for wire messages: each validates one decoded msgpack value.

A checker returns the value (possibly normalised) or raises ProtocolError with BAD_FIELD
or TOO_LARGE and a detail that names the field. They run on untrusted input, so they test
exact types (``type(x) is int`` rejects bools) and bound every size before iterating.

Each checker also states what it accepts as a msgspec type (``wire_type``): the typed fast
path (typed.py) decodes whole bodies with those types in one compiled call. A wire type
accepts exactly what the checker returns unchanged, never more; where that cannot be said
(a map of anything), it is None and the messages using the checker have no fast path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from msgspec import Meta

from .constants import ErrorCode, Limits
from .errors import ProtocolError

Check = Callable[[str, Any], Any]
_INT64_MAX = (1 << 63) - 1


def wire_type(check: Check) -> Any:
    """The msgspec type that accepts exactly what ``check`` passes, or None."""
    return getattr(check, "wire_type", None)


def _typed(check: Check, wire: Any) -> Check:
    check.wire_type = wire  # type: ignore[attr-defined]
    return check


def _int_type(lo: int, hi: int) -> Any:
    """msgspec bounds must fit an int64; a msgpack int never exceeds 2**64-1 anyway."""
    if lo < -_INT64_MAX - 1 or (_INT64_MAX < hi < Limits.MAX_REQ_ID):
        return None
    return Annotated[int, Meta(ge=lo)] if hi >= Limits.MAX_REQ_ID else Annotated[int, Meta(ge=lo, le=hi)]


def _bad(name: str, want: str, value: Any) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be {want}, got {type(value).__name__}")


def integer(lo: int = 0, hi: int = Limits.MAX_REQ_ID) -> Check:
    def check(name: str, value: Any) -> int:
        if type(value) is not int:
            raise _bad(name, "an int", value)
        if not lo <= value <= hi:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} = {value} is outside [{lo}, {hi}]")
        return value

    return _typed(check, _int_type(lo, hi))


def number(lo: float = 0.0, hi: float = 1e9) -> Check:
    def check(name: str, value: Any) -> float:
        if type(value) not in (int, float):
            raise _bad(name, "a number", value)
        if not lo <= value <= hi:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} = {value} is outside [{lo}, {hi}]")
        return float(value)

    # msgspec takes a msgpack int for a float field and converts it, as float() does here.
    return _typed(check, Annotated[float, Meta(ge=lo, le=hi)])


def text(max_len: int = Limits.MAX_STR, choices: frozenset[str] | None = None) -> Check:
    def check(name: str, value: Any) -> str:
        if type(value) is not str:
            raise _bad(name, "a string", value)
        if len(value) > max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} is longer than {max_len}")
        if choices is not None and value not in choices:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} = {value!r} is not one of {sorted(choices)}")
        return value

    if choices is not None:
        wire: Any = Literal[tuple(sorted(c for c in choices if len(c) <= max_len))]
    else:
        wire = Annotated[str, Meta(max_length=max_len)]
    return _typed(check, wire)


def boolean() -> Check:
    def check(name: str, value: Any) -> bool:
        if type(value) is not bool:
            raise _bad(name, "a bool", value)
        return value

    return _typed(check, bool)


def optional(inner: Check) -> Check:
    def check(name: str, value: Any) -> Any:
        return None if value is None else inner(name, value)

    inner_wire = wire_type(inner)
    return _typed(check, None if inner_wire is None else inner_wire | None)


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

    item = _int_type(lo, hi)
    return _typed(check, None if item is None else Annotated[list[item], Meta(max_length=max_len)])  # type: ignore[valid-type]


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

    # Printable ASCII without the space is exactly '!' .. '~'; \A..\Z: no trailing newline slips through.
    key = Annotated[str, Meta(min_length=1, max_length=max_key, pattern=_KEY_PATTERN)]
    return _typed(check, Annotated[list[key], Meta(max_length=max_len)])


_KEY_PATTERN = r"\A[!-~]+\Z"


def bytes_list(max_len: int = Limits.MAX_KEYS, max_item: int = 64) -> Check:
    """Opaque byte strings (msgpack bin), each at most ``max_item`` bytes."""

    def check(name: str, value: Any) -> list[bytes]:
        if type(value) is not list:
            raise _bad(name, "a list of byte strings", value)
        if len(value) > max_len:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"field {name!r} has {len(value)} entries, limit {max_len}")
        for item in value:
            if type(item) is not bytes or len(item) > max_item:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must hold byte strings of ≤ {max_item} bytes")
        return value

    return _typed(check, Annotated[list[Annotated[bytes, Meta(max_length=max_item)]], Meta(max_length=max_len)])


def key(max_key: int = Limits.MAX_KEY_BYTES) -> Check:
    """One storage key, checked like an entry of ``keys``."""
    one = key_list(1, max_key)

    def check(name: str, value: Any) -> str:
        if type(value) is not str:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field {name!r} must be a key (a string)")
        checked: str = one(name, [value])[0]
        return checked

    return _typed(check, Annotated[str, Meta(min_length=1, max_length=max_key, pattern=_KEY_PATTERN)])


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

    return _typed(check, Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=2, max_length=2)])
