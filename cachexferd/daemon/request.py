"""The record of one command, made once when it is read and handed along to its outcome.

Dispatch, the block ordering, the jobs and the outcome all work on the same Request: who
sent it (the ROUTER identity), what it is (the decoded command, or only the op and req_id
of one that could not be decoded), when it arrived (for the latency histogram), and, for
asynchronous commands, the job its handler made. Nothing is copied between the stages.
A group of swaps handled together (groups.SwapGroup) is a Request too, of ``weight``
commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..protocol import Command, ProtocolError

if TYPE_CHECKING:
    from .jobs import Job


class Request:
    __slots__ = ("cmd", "identity", "job", "op", "received", "req_id", "weight")

    def __init__(self, identity: bytes, cmd: Command, received: float) -> None:
        self.identity = identity
        self.cmd: Command | None = cmd
        self.op: int = cmd.TYPE
        self.req_id = cmd.req_id
        self.received = received
        self.job: Job | None = None  # set when an asynchronous command is accepted
        self.weight = 1  # commands this request stands for

    @classmethod
    def refused(cls, identity: bytes, error: ProtocolError, received: float) -> Request:
        """A message that gave no command: its outcome carries what could be read of it."""
        req = cls.__new__(cls)
        req.identity, req.cmd, req.job, req.received = identity, None, None, received
        req.op, req.req_id, req.weight = error.msg_type, error.req_id, 1
        return req

    def __repr__(self) -> str:
        return f"Request(op={self.op}, req_id={self.req_id})"


# A command's decided outcome, on its way out: (request, code, detail, result).
Decided = tuple[Request, int, str, dict[str, Any]]
