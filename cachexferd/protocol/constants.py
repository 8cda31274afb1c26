"""Protocol constants: version, message-type tags, error codes, limits.

Everything here is normative: docs/protocol.md documents the same numbers, and the
numbers never change meaning once released (new codes are appended).
"""

from __future__ import annotations

from enum import IntEnum

MAGIC = b"CX"
PROTOCOL_MAJOR = 1
# 1.1: BATCH and EVENT_BATCH, PAUSE/RESUME/SET_WEIGHTS; 1.2: optional fields; 1.3: host blocks' identity keys;
# 1.4: the storage journal (STORE tags, STORAGE_EVENTS)
# 1.5: device writes never start after their not_after; the device fence (ATTACH device_fence)
# 1.6: the device fence covers device reads too (ATTACH device_fence_reads); a client may hold it
PROTOCOL_MINOR = 6  # (docs/protocol.md §11)
HEADER_LEN = 4  # MAGIC (2 bytes) + major (u8) + message type (u8)


class MsgType(IntEnum):
    """Message-type tag carried in byte 3 of every header frame."""

    # Synchronous commands: the outcome is a REPLY on the command socket. Whether a type is
    # synchronous or asynchronous is declared once, by its message class (messages.py).
    HELLO = 1
    PING = 2
    STATUS = 3
    ATTACH = 4
    DETACH = 5
    SHUTDOWN = 6
    PAUSE = 7  # protocol 1.1: refuse new copies, reply once the running ones are done
    RESUME = 9
    SET_WEIGHTS = 10  # protocol 1.1: the weights version host blocks and storage names are tagged with
    HOST_KEYS = 11  # protocol 1.3: a page of the host blocks' identity keys
    STORAGE_EVENTS = 12  # protocol 1.4: what the shared store gained and lost, in the journal's order
    # An envelope carrying many commands (protocol 1.1); each keeps its own outcome.
    BATCH = 8
    # Asynchronous commands: the outcome is an EVENT on the client's event socket.
    SWAP_OUT = 16
    SWAP_IN = 17
    CLEAR_HOST = 18
    STORE = 32
    LOAD = 33
    LOOKUP = 34
    DELETE = 35
    # Daemon -> client.
    REPLY = 128
    EVENT = 129
    EVENT_BATCH = 130  # many EVENT outcomes in one message (protocol 1.1, when asked for in HELLO)


class ErrorCode(IntEnum):
    """Stable outcome codes. 0 is success; never renumber, only append."""

    OK = 0
    BAD_FRAME = 1  # header or body could not be decoded
    UNKNOWN_TYPE = 2  # header carries a type the daemon does not know
    WRONG_VERSION = 3  # protocol major differs
    BAD_FIELD = 4  # missing field, wrong type, value out of its documented range
    TOO_LARGE = 5  # body or a list over the documented limits
    NO_EVENT_CHANNEL = 6  # asynchronous command from a client that named no event endpoint
    NOT_ATTACHED = 7  # needs an attached device cache
    ALREADY_ATTACHED = 8
    LAYOUT_MISMATCH = 9  # attach layout does not fit the host cache
    ID_OUT_OF_RANGE = 10
    DUPLICATE_ID = 11  # a destination block id appears twice
    LENGTH_MISMATCH = 12  # paired lists differ in length
    STALE_BOOT = 13  # command addressed to another boot of the daemon
    SHUTTING_DOWN = 14
    DETACHED = 15  # cancelled because the device cache was detached
    ATTACH_FAILED = 16  # the device cache handles could not be imported
    BUSY = 17  # too many commands in flight
    DUPLICATE_REQ_ID = 18  # req_id already in flight for this client
    INTERNAL = 19  # bug in the daemon; the detail says what
    BAD_STATE = 20  # command not valid in the daemon's current lifecycle state
    STALE_WEIGHTS = 21  # host blocks written under another weights version
    PAUSED = 22  # copies are refused while the daemon is paused
    HOST_BLOCK_CHANGED = 23  # (1.2) a host block no longer holds what its owner wrote there
    EXPIRED = 24  # (1.2) a copy read after its not_after time
    # Storage tier (32..63).
    STORAGE_UNAVAILABLE = 32  # backend down or unreachable
    STORAGE_TIMEOUT = 33
    STORAGE_ERROR = 34  # backend answered with an error
    NO_STORAGE = 35  # no storage backend configured
    # Produced by clients, never sent by a daemon (64..95).
    CLIENT_TIMEOUT = 64
    DAEMON_RESTARTED = 65
    SEND_FAILED = 66
    DAEMON_LOST = 67  # the connection to the daemon dropped with the command in flight


class Limits:
    """Wire limits. A message over any of them gets TOO_LARGE (or BAD_FIELD)."""

    MAX_BODY_BYTES = 8 << 20  # body frame
    MAX_SOCKET_MSG_BYTES = 64 << 20  # hard cap set on the socket; larger kills the peer link
    MAX_IDS = 65536  # entries in one block-id list
    MAX_KEYS = 65536  # entries in one storage key list
    MAX_STR = 4096  # bytes in one string field
    MAX_KEY_BYTES = 256  # bytes in one storage key
    MAX_MAP = 64  # entries in one map
    MAX_TENSORS = 4096  # device tensors in one attach
    MAX_BLOCK_ID = (1 << 31) - 1
    MAX_REQ_ID = (1 << 64) - 1
    MAX_BATCH = 4096  # commands in one BATCH envelope
