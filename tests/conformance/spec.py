"""The numbers of docs/protocol.md, transcribed from its tables (§2, §3, §4, §6, §8).

Nothing here comes from the cachexferd package: the conformance suite talks to a daemon the
way a client written in another language would. test_spec_tables.py checks that these
transcriptions still match the document.
"""

from __future__ import annotations

from enum import IntEnum

MAGIC = b"CX"
MAJOR = 1
MINOR = 6


class T(IntEnum):
    """Message types (§3)."""

    HELLO = 1
    PING = 2
    STATUS = 3
    ATTACH = 4
    DETACH = 5
    SHUTDOWN = 6
    PAUSE = 7
    BATCH = 8
    RESUME = 9
    SET_WEIGHTS = 10
    HOST_KEYS = 11
    STORAGE_EVENTS = 12
    SWAP_OUT = 16
    SWAP_IN = 17
    CLEAR_HOST = 18
    STORE = 32
    LOAD = 33
    LOOKUP = 34
    DELETE = 35
    REPLY = 128
    EVENT = 129
    EVENT_BATCH = 130


SYNC = frozenset(
    {
        T.HELLO,
        T.PING,
        T.STATUS,
        T.ATTACH,
        T.DETACH,
        T.SHUTDOWN,
        T.PAUSE,
        T.RESUME,
        T.SET_WEIGHTS,
        T.HOST_KEYS,
        T.STORAGE_EVENTS,
    }
)
ASYNC = frozenset({T.SWAP_OUT, T.SWAP_IN, T.CLEAR_HOST, T.STORE, T.LOAD, T.LOOKUP, T.DELETE})


class E(IntEnum):
    """Error codes (§6)."""

    OK = 0
    BAD_FRAME = 1
    UNKNOWN_TYPE = 2
    WRONG_VERSION = 3
    BAD_FIELD = 4
    TOO_LARGE = 5
    NO_EVENT_CHANNEL = 6
    NOT_ATTACHED = 7
    ALREADY_ATTACHED = 8
    LAYOUT_MISMATCH = 9
    ID_OUT_OF_RANGE = 10
    DUPLICATE_ID = 11
    LENGTH_MISMATCH = 12
    STALE_BOOT = 13
    SHUTTING_DOWN = 14
    DETACHED = 15
    ATTACH_FAILED = 16
    BUSY = 17
    DUPLICATE_REQ_ID = 18
    INTERNAL = 19
    BAD_STATE = 20
    STALE_WEIGHTS = 21
    PAUSED = 22
    HOST_BLOCK_CHANGED = 23
    EXPIRED = 24
    STORAGE_UNAVAILABLE = 32
    STORAGE_TIMEOUT = 33
    STORAGE_ERROR = 34
    NO_STORAGE = 35
    CLIENT_TIMEOUT = 64
    DAEMON_RESTARTED = 65


CLIENT_ONLY = frozenset({E.CLIENT_TIMEOUT, E.DAEMON_RESTARTED})  # §6: never sent by a daemon

# §4 Limits
MAX_BODY = 8 * 1024 * 1024
MAX_SOCKET_MESSAGE = 64 * 1024 * 1024
MAX_IDS = 65536
MAX_KEYS = 65536
MAX_KEY_CHARS = 256
MAX_STRING = 4096
MAX_MAP = 64
MAX_BLOCK_ID = 2**31 - 1
MAX_REQ_ID = 2**64 - 1
MAX_BATCH = 4096  # §14
MIN_HOST_CAPACITY = 1024 * 1024

# §8.1 element sizes
DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
