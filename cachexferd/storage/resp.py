"""A minimal RESP2 reply reader that lands bulk strings straight in caller buffers.

redis-py's parser copies a value several times (socket chunks, a buffer, a bytes object)
before the daemon could copy it into a host block; at block sizes that costs more than the
network. The redis backend sends MGET / SET through redis-py's connection (connect, auth,
db selection, pooling stay redis-py's) and reads the replies here, so an object's payload
goes from the socket into its host block with one ``recv_into``.

Only the reply shapes those commands produce are understood: simple strings (+), errors
(-), integers (:), bulk strings ($, $-1 for nil) and arrays (*) of bulk strings.
"""

from __future__ import annotations

import socket


class RespError(Exception):
    """An error reply from the server (the connection stays usable)."""


class ProtocolViolation(ConnectionError):
    """A reply this reader cannot parse; the connection must be dropped."""


class RespReader:
    def __init__(self, sock: socket.socket, chunk: int = 1 << 16) -> None:
        self.sock = sock
        self.chunk = chunk
        self.buf = bytearray()
        self.pos = 0

    @property
    def pending(self) -> int:
        """Bytes received but not consumed: non-zero after a full exchange means the
        connection is out of step with its replies and must be dropped."""
        return len(self.buf) - self.pos

    def _fill(self) -> None:
        if self.pos and self.pos >= len(self.buf) // 2:  # keep the buffer from growing forever
            del self.buf[: self.pos]
            self.pos = 0
        data = self.sock.recv(self.chunk)
        if not data:
            raise ConnectionError("redis closed the connection")
        self.buf += data

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", self.pos)) < 0:
            self._fill()
        out = bytes(self.buf[self.pos : end])
        self.pos = end + 2
        return out

    def into(self, view: memoryview) -> None:
        """Fills ``view`` with the next len(view) bytes of the stream."""
        have = min(len(view), len(self.buf) - self.pos)
        view[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        filled = have
        while filled < len(view):
            got = self.sock.recv_into(view[filled:])
            if got == 0:
                raise ConnectionError("redis closed the connection")
            filled += got

    def skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, 1 << 20)))
        while count:
            step = min(count, len(scratch))
            self.into(scratch[:step])
            count -= step

    def header(self) -> tuple[bytes, bytes]:
        """(type byte, rest of line) of the next reply."""
        text = self.line()
        if not text:
            raise ProtocolViolation("empty reply line")
        return text[:1], text[1:]

    def simple(self) -> bytes | int | RespError:
        """The next +, - or : reply (an error reply is returned, not raised)."""
        kind, rest = self.header()
        if kind == b"+":
            return rest
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        raise ProtocolViolation(f"unexpected reply type {kind!r}")

    def array_length(self) -> int:
        kind, rest = self.header()
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind != b"*":
            raise ProtocolViolation(f"expected an array, got {kind!r}")
        return int(rest)

    def bulk_length(self) -> int:
        """Length of the next bulk string; -1 for nil (RESP2 $-1, or RESP3 _)."""
        kind, rest = self.header()
        if kind == b"_":
            return -1
        if kind != b"$":
            raise ProtocolViolation(f"expected a bulk string, got {kind!r}")
        return int(rest)

    def end_of_bulk(self) -> None:
        crlf = bytearray(2)
        self.into(memoryview(crlf))
        if crlf != b"\r\n":
            raise ProtocolViolation("bulk string not followed by CRLF")
