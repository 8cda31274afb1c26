"""The one exception type that carries a wire error code."""

from __future__ import annotations

from .constants import ErrorCode


class ProtocolError(Exception):
    """A command that gets an error outcome: stable code plus a human-readable detail."""

    def __init__(self, code: ErrorCode, detail: str, req_id: int = 0, msg_type: int = 0) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail
        self.req_id = req_id  # 0 when the body was too broken to read one
        self.msg_type = msg_type  # 0 when the header was too broken to read one
