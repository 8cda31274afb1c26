"""One frozen dataclass per command, plus the outcome shape (Reply and Event).

Each command field declares its checker in ``metadata["check"]``; ``decode_command``
(codec.py) uses them on untrusted input. Unknown body fields are ignored so that minor
protocol versions can add optional fields. Each command class also declares, once, whether
it is asynchronous (its outcome is an EVENT) or synchronous (a REPLY): the daemon's dispatch
tables, its outcome routing and the clients' methods all derive from that.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from . import fields as f
from .constants import ErrorCode, Limits, MsgType
from .errors import ProtocolError

ROLES = frozenset({"engine", "runner", "tool"})
OWNER_CHARS = 64  # longest owner token of a host block (protocol 1.2)
HOST_KEYS_PAGE = 16_384  # most host blocks one HOST_KEYS covers (protocol 1.3)
STORAGE_EVENTS_PAGE = 16_384  # most records one STORAGE_EVENTS answer holds (protocol 1.4)
TAG_BYTES = 64  # longest tag of a stored object (protocol 1.4)
STORAGE_SOURCES = frozenset({"host", "device"})


def _spec(check: f.Check, default: Any = MISSING) -> Any:
    if default is MISSING:
        return field(metadata={"check": check})
    return field(default=default, metadata={"check": check})


@dataclass(frozen=True, kw_only=True)
class Command:
    """Fields every command carries."""

    TYPE: ClassVar[MsgType]
    ASYNC: ClassVar[bool] = False  # True: ordered work whose outcome is an EVENT
    req_id: int = _spec(f.integer(1))
    # When set, the daemon refuses the command with STALE_BOOT unless this is its boot id:
    # a command queued for a daemon that died is not run by its successor.
    boot_id: str | None = _spec(f.optional(f.text(64)), None)

    def to_wire(self) -> dict[str, Any]:
        return {fld.name: getattr(self, fld.name) for fld in fields(self)}

    @classmethod
    def name(cls) -> str:
        return cls.TYPE.name.lower()

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Command:
        values: dict[str, Any] = {}
        for name, check, required in _SPECS[cls.TYPE]:
            if name not in body:
                if required:
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"{cls.name()} needs field {name!r}")
                continue
            values[name] = check(name, body[name])
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Hello(Command):
    TYPE = MsgType.HELLO
    protocol: list[int] = _spec(f.version_pair())
    client: str = _spec(f.text(128), "")
    role: str = _spec(f.text(16, ROLES), "engine")
    events: str | None = _spec(f.optional(f.text(512)), None)  # ZeroMQ endpoint the client's PULL binds
    pid: int | None = _spec(f.optional(f.integer(1, 1 << 31)), None)
    # Protocol 1.1: deliver this client's events in EVENT_BATCH messages.
    batch_events: bool = _spec(f.boolean(), False)
    # Protocol 1.2: the Z85 CURVE public key of the client's event socket, a CURVE server on
    # tcp (any address): the daemon's PUSH connects to it as a CURVE client.
    events_key: str | None = _spec(f.optional(f.text(40)), None)


@dataclass(frozen=True, kw_only=True)
class Ping(Command):
    TYPE = MsgType.PING


@dataclass(frozen=True, kw_only=True)
class Status(Command):
    TYPE = MsgType.STATUS


@dataclass(frozen=True, kw_only=True)
class Attach(Command):
    TYPE = MsgType.ATTACH
    layout: dict[str, Any] = _spec(f.mapping())  # KVLayout.to_wire()
    device: dict[str, Any] = _spec(f.mapping())  # backend-specific handles, see docs/protocol.md
    pid: int | None = _spec(f.optional(f.integer(1, 1 << 31)), None)  # watched: its exit detaches
    # Protocol 1.2: replace an attached runner that is gone or orphaned (same user only).
    supersede: bool = _spec(f.boolean(), False)
    # Protocol 1.2: the weights version the runner's model runs, in force as the attach
    # succeeds (a re-attach after a daemon restart restores it before any copy can run).
    weights_version: int | None = _spec(f.optional(f.integer(0, (1 << 63) - 1)), None)


@dataclass(frozen=True, kw_only=True)
class Detach(Command):
    TYPE = MsgType.DETACH
    drain_timeout_s: float | None = _spec(f.optional(f.number(0.0, 3600.0)), None)


@dataclass(frozen=True, kw_only=True)
class Shutdown(Command):
    TYPE = MsgType.SHUTDOWN


@dataclass(frozen=True, kw_only=True)
class Pause(Command):
    """Refuse new copies (PAUSED); reply once those running have finished."""

    TYPE = MsgType.PAUSE
    drain_timeout_s: float | None = _spec(f.optional(f.number(0.0, 3600.0)), None)


@dataclass(frozen=True, kw_only=True)
class Resume(Command):
    TYPE = MsgType.RESUME


@dataclass(frozen=True, kw_only=True)
class SetWeights(Command):
    """The weights version new host blocks and storage names are tagged with."""

    TYPE = MsgType.SET_WEIGHTS
    version: int = _spec(f.integer(0, (1 << 63) - 1))


@dataclass(frozen=True, kw_only=True)
class HostKeys(Command):
    """Protocol 1.3: the identity keys of host blocks ``start .. start+count-1`` (a page)."""

    TYPE = MsgType.HOST_KEYS
    start: int = _spec(f.integer(0, (1 << 31) - 1), 0)
    count: int = _spec(f.integer(1, HOST_KEYS_PAGE), HOST_KEYS_PAGE)


@dataclass(frozen=True, kw_only=True)
class StorageEvents(Command):
    """Protocol 1.4: the storage journal's records after cursor ``after`` (0: the current
    state first, as ``stored`` records), at most ``max``."""

    TYPE = MsgType.STORAGE_EVENTS
    after: int = _spec(f.integer(0, (1 << 63) - 1), 0)
    max: int = _spec(f.integer(1, STORAGE_EVENTS_PAGE), 4096)


@dataclass(frozen=True, kw_only=True)
class SwapOut(Command):
    """Device blocks -> host blocks, pairwise."""

    TYPE = MsgType.SWAP_OUT
    ASYNC = True
    device_ids: list[int] = _spec(f.int_list())
    host_ids: list[int] = _spec(f.int_list())
    # Protocol 1.2: stamp the written host blocks with this owner token.
    owner: str | None = _spec(f.optional(f.text(OWNER_CHARS)), None)
    # Protocol 1.2: refused with EXPIRED when read after this time (daemon wall clock, epoch s).
    not_after: float | None = _spec(f.optional(f.number(0.0, 1e12)), None)
    # Protocol 1.3: the identity key of each written host block (one per host id).
    keys: list[str] | None = _spec(f.optional(f.key_list()), None)


@dataclass(frozen=True, kw_only=True)
class SwapIn(Command):
    """Host blocks -> device blocks, pairwise."""

    TYPE = MsgType.SWAP_IN
    ASYNC = True
    device_ids: list[int] = _spec(f.int_list())
    host_ids: list[int] = _spec(f.int_list())
    # Protocol 1.2: every host block read must carry this owner token (HOST_BLOCK_CHANGED).
    owner: str | None = _spec(f.optional(f.text(OWNER_CHARS)), None)
    not_after: float | None = _spec(f.optional(f.number(0.0, 1e12)), None)  # as SWAP_OUT's
    # Protocol 1.3: every host block read must carry exactly its key (HOST_BLOCK_CHANGED).
    keys: list[str] | None = _spec(f.optional(f.key_list()), None)


@dataclass(frozen=True, kw_only=True)
class ClearHost(Command):
    TYPE = MsgType.CLEAR_HOST
    ASYNC = True


@dataclass(frozen=True, kw_only=True)
class Store(Command):
    """Host blocks (or device blocks staged through host_ids) -> storage objects by key."""

    TYPE = MsgType.STORE
    ASYNC = True
    keys: list[str] = _spec(f.key_list())
    host_ids: list[int] = _spec(f.int_list())
    device_ids: list[int] | None = _spec(f.optional(f.int_list()), None)
    # Protocol 1.2: the host blocks read must carry this owner token (STORE of host blocks)
    owner: str | None = _spec(f.optional(f.text(OWNER_CHARS)), None)
    not_after: float | None = _spec(f.optional(f.number(0.0, 1e12)), None)  # as SWAP_OUT's (1.2)
    # Protocol 1.2: the key before keys[0] in its chain, when this STORE extends a chain stored
    # earlier (an eviction hint: chain tails are evicted before heads).
    parent: str | None = _spec(f.optional(f.key()), None)
    # Protocol 1.4: an opaque tag per key, recorded with each stored object in the storage
    # journal (STORAGE_EVENTS), e.g. the engine's own name for the block.
    tags: list[bytes] | None = _spec(f.optional(f.bytes_list(max_item=TAG_BYTES)), None)


@dataclass(frozen=True, kw_only=True)
class Load(Command):
    """Storage objects -> host blocks (-> device blocks when device_ids is given)."""

    TYPE = MsgType.LOAD
    ASYNC = True
    keys: list[str] = _spec(f.key_list())
    host_ids: list[int] = _spec(f.int_list())
    device_ids: list[int] | None = _spec(f.optional(f.int_list()), None)
    # Protocol 1.2: stamp the written host blocks with this owner token
    owner: str | None = _spec(f.optional(f.text(OWNER_CHARS)), None)
    not_after: float | None = _spec(f.optional(f.number(0.0, 1e12)), None)  # as SWAP_OUT's (1.2)


@dataclass(frozen=True, kw_only=True)
class Lookup(Command):
    TYPE = MsgType.LOOKUP
    ASYNC = True
    keys: list[str] = _spec(f.key_list())


@dataclass(frozen=True, kw_only=True)
class Delete(Command):
    TYPE = MsgType.DELETE
    ASYNC = True
    keys: list[str] = _spec(f.key_list())


COMMANDS: dict[MsgType, type[Command]] = {
    cls.TYPE: cls
    for cls in (Hello, Ping, Status, Attach, Detach, Shutdown, Pause, Resume, SetWeights, HostKeys, StorageEvents,
                SwapOut, SwapIn, ClearHost, Store, Load, Lookup, Delete)
}  # fmt: skip
ASYNC_TYPES = frozenset(t for t, cls in COMMANDS.items() if cls.ASYNC)
SYNC_TYPES = frozenset(t for t, cls in COMMANDS.items() if not cls.ASYNC)
COMMAND_TYPES = frozenset(COMMANDS)

# (name, checker, required) per field, computed once: decoding is on the daemon's hot path.
_SPECS: dict[MsgType, tuple[tuple[str, f.Check, bool], ...]] = {
    t: tuple((fld.name, fld.metadata["check"], fld.default is MISSING) for fld in fields(cls))
    for t, cls in COMMANDS.items()
}


# The checkers of an outcome's fields (built once: outcomes are decoded on the clients' hot path).
_REQ_ID, _RANK, _CODE, _OP = f.integer(0), f.integer(0, 1 << 20), f.integer(0, 1 << 16), f.integer(0, 255)
_BOOT_ID, _DETAIL, _RESULT = f.text(64), f.text(Limits.MAX_STR * 4), f.mapping(1 << 16)


@dataclass(slots=True)
class Outcome:
    """The single outcome of a command: a Reply (sync) or an Event (async). Treat it as
    read-only; it is not a frozen dataclass because clients decode thousands per second and
    a frozen one costs several times more to build."""

    req_id: int
    boot_id: str
    rank: int
    code: int = ErrorCode.OK
    detail: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    op: int = 0  # the command's MsgType; set on events and replies alike

    @property
    def ok(self) -> bool:
        return self.code == ErrorCode.OK

    @property
    def error(self) -> str:
        return error_name(self.code)

    def to_wire(self) -> dict[str, Any]:
        return {
            "req_id": self.req_id,
            "boot_id": self.boot_id,
            "rank": self.rank,
            "op": self.op,
            "code": int(self.code),
            "error": self.error,
            "detail": self.detail,
            "result": self.result,
        }

    def to_compact(self) -> list[Any]:
        """The entry of this outcome in an EVENT_BATCH's ``events`` list."""
        return [self.req_id, self.op, int(self.code), self.detail, self.result]

    @classmethod
    def from_compact(cls, entry: Any, boot_id: str, rank: int) -> Outcome:
        if type(entry) is not list or len(entry) != 5:
            raise ProtocolError(ErrorCode.BAD_FIELD, "an EVENT_BATCH entry must be [req_id, op, code, detail, result]")
        req_id, op, code, detail, result = entry
        return cls(
            req_id=_REQ_ID("req_id", req_id),
            boot_id=boot_id,
            rank=rank,
            code=_CODE("code", code),
            detail=_DETAIL("detail", detail),
            result=_RESULT("result", result),
            op=_OP("op", op),
        )

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Outcome:
        try:
            return cls(
                req_id=_REQ_ID("req_id", body["req_id"]),
                boot_id=_BOOT_ID("boot_id", body["boot_id"]),
                rank=_RANK("rank", body["rank"]),
                code=_CODE("code", body["code"]),
                detail=_DETAIL("detail", body.get("detail", "")),
                result=_RESULT("result", body.get("result", {})),
                op=_OP("op", body.get("op", 0)),
            )
        except KeyError as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"outcome needs field {exc.args[0]!r}") from None


_ERROR_NAMES = {int(code): code.name for code in ErrorCode}


def error_name(code: int) -> str:
    """The name of an error code as outcomes carry it (UNKNOWN_<n> for codes this build lacks)."""
    return _ERROR_NAMES.get(code) or f"UNKNOWN_{code}"
