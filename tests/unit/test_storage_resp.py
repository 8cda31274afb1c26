"""The RESP reply reader the redis backend uses, fed over a real socket pair."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from cachexferd.storage.resp import ProtocolViolation, RespError, RespReader


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, RespReader]]:
    a, b = socket.socketpair()
    b.settimeout(5)
    yield a, RespReader(b, chunk=7)  # tiny chunks: every boundary case gets exercised
    a.close()
    b.close()


def test_simple_replies(pair: tuple[socket.socket, RespReader]) -> None:
    server, reader = pair
    server.sendall(b"+OK\r\n:42\r\n-OOM command not allowed\r\n")
    assert reader.simple() == b"OK"
    assert reader.simple() == 42
    err = reader.simple()
    assert isinstance(err, RespError) and "OOM" in str(err)


def test_bulk_strings_land_in_caller_buffers(pair: tuple[socket.socket, RespReader]) -> None:
    server, reader = pair
    payload = bytes(range(256)) * 40
    server.sendall(b"*3\r\n$%d\r\n%s\r\n$-1\r\n_\r\n" % (len(payload), payload))
    assert reader.array_length() == 3
    assert reader.bulk_length() == len(payload)
    target = bytearray(len(payload))
    reader.into(memoryview(target))
    reader.end_of_bulk()
    assert target == payload
    assert reader.bulk_length() == -1  # RESP2 nil
    assert reader.bulk_length() == -1  # RESP3 null


def test_skip_and_violations(pair: tuple[socket.socket, RespReader]) -> None:
    server, reader = pair
    server.sendall(b"$5\r\nhello\r\n$2\r\nabXY:1\r\n")
    reader.skip(reader.bulk_length())
    reader.end_of_bulk()
    assert reader.bulk_length() == 2
    reader.skip(2)
    with pytest.raises(ProtocolViolation):
        reader.end_of_bulk()
    with pytest.raises(ProtocolViolation):
        reader.array_length()  # ':1' is not an array


def test_error_instead_of_array_and_closed_socket(pair: tuple[socket.socket, RespReader]) -> None:
    server, reader = pair
    server.sendall(b"-WRONGTYPE\r\n")
    with pytest.raises(RespError):
        reader.array_length()
    server.close()
    with pytest.raises(ConnectionError):
        reader.line()
