"""The cachexferd wire protocol (normative spec: docs/protocol.md).

Imports neither torch nor the daemon, so engines in any process can use it.
"""

from .codec import decode_command, decode_header, decode_outcome, encode_command, encode_header, encode_outcome
from .constants import (
    ASYNC_TYPES,
    MAGIC,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    SYNC_TYPES,
    ErrorCode,
    Limits,
    MsgType,
)
from .errors import ProtocolError
from .layout import DTYPE_BYTES, KVLayout, LayoutError
from .messages import (
    COMMANDS,
    Attach,
    ClearHost,
    Command,
    Delete,
    Detach,
    Hello,
    Load,
    Lookup,
    Outcome,
    Ping,
    Shutdown,
    Status,
    Store,
    SwapIn,
    SwapOut,
)

__all__ = [
    "ASYNC_TYPES",
    "COMMANDS",
    "DTYPE_BYTES",
    "MAGIC",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "SYNC_TYPES",
    "Attach",
    "ClearHost",
    "Command",
    "Delete",
    "Detach",
    "ErrorCode",
    "Hello",
    "KVLayout",
    "LayoutError",
    "Limits",
    "Load",
    "Lookup",
    "MsgType",
    "Outcome",
    "Ping",
    "ProtocolError",
    "Shutdown",
    "Status",
    "Store",
    "SwapIn",
    "SwapOut",
    "decode_command",
    "decode_header",
    "decode_outcome",
    "encode_command",
    "encode_header",
    "encode_outcome",
]
