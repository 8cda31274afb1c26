"""The ``redis`` backend: Redis or Valkey through redis-py, one string value per object.

Writes are pipelined SETs. The value is sent from two buffers (the 64-byte header and the
host block itself) as one RESP bulk string, so a block is never concatenated into a new
bytes object on the way out. Reads are pipelined MGETs, chunked to bound client memory;
each value is checked and copied into its host block. Presence is pipelined EXISTS; delete
is UNLINK (the server frees memory off its main thread).

Redis is a cache here: run it with ``maxmemory`` and an LRU policy; an evicted key is a
normal miss, and a SET refused for memory (OOM) is a per-object store failure. A STORE larger
than the room Redis has may see its own first keys evicted to fit its last ones: the daemon
asks which are still there before it reports them stored (``drops_writes``).
The storage journal (journal.py) is a stream on the same server.
Connection errors become StorageUnavailable; redis-py reconnects on the next call, so the
daemon recovers by itself when the server returns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .base import (
    MISSING,
    GetItem,
    GetResult,
    GetStatus,
    PutItem,
    StorageBackend,
    StorageFailure,
    StorageTimeoutError,
    StorageUnavailable,
)
from .journal import RedisJournal
from .objects import HEADER_BYTES
from .resp import ProtocolViolation, RespError, RespReader

if TYPE_CHECKING:
    import redis as redis_lib

    from ..config import Config

_MGET_BYTES = 64 << 20  # value bytes one MGET may bring back
_PIPELINE_KEYS = 1024  # keys per EXISTS / UNLINK pipeline round trip


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


class RedisBackend(StorageBackend):
    name = "redis"
    drops_writes = True  # maxmemory: Redis may evict a pipeline's first keys to fit its last ones

    def __init__(self, url: str, timeout_s: float, max_connections: int, journal: bool = False) -> None:
        import redis as redis_lib

        self._redis_lib = redis_lib
        self.url = url
        self.client: redis_lib.Redis = redis_lib.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=min(timeout_s, 2.0),
            max_connections=max_connections,
            retry_on_timeout=False,
            protocol=2,  # RESP2: what every Redis and Valkey speaks, and what RespReader parses
        )
        self._state = "unknown"
        self.journal = RedisJournal(self.client) if journal else None

    @contextmanager
    def _connection(self) -> Iterator[tuple[Any, RespReader]]:
        """A pooled connection and a reader for its replies; redis-py and socket errors
        become the storage exceptions, and a connection left out of step is dropped."""
        errors = self._redis_lib.exceptions
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()
            if conn._sock is None:  # the pool normally hands out connected connections
                conn.connect()
        except errors.TimeoutError as exc:
            raise self._down(StorageTimeoutError, exc) from None
        except (errors.ConnectionError, OSError) as exc:
            raise self._down(StorageUnavailable, exc) from None
        try:
            sock: Any = conn._sock
            reader = RespReader(sock)
            yield conn, reader
            if reader.pending:
                conn.disconnect()
            self._state = "ready"
        except (errors.TimeoutError, TimeoutError) as exc:
            conn.disconnect()
            raise self._down(StorageTimeoutError, exc) from None
        except (errors.ConnectionError, ConnectionError, OSError) as exc:  # ProtocolViolation too
            conn.disconnect()
            raise self._down(StorageUnavailable, exc) from None
        except (errors.RedisError, RespError) as exc:
            conn.disconnect()
            raise StorageFailure(f"redis: {exc}") from None
        except BaseException:
            conn.disconnect()  # a half-read reply would poison the pooled connection
            raise
        finally:
            pool.release(conn)

    def _down(self, kind: type[Exception], exc: BaseException) -> Exception:
        self._state = "unavailable"
        return kind(f"redis at {_redacted(self.url)}: {exc}")

    def start(self) -> None:
        pass  # redis-py connects on first use; nothing to do ahead of time

    def put(self, items: list[PutItem], stop: threading.Event) -> list[str | None]:
        with self._connection() as (conn, reader):
            sent = 0
            for item in items:
                if stop.is_set():
                    break
                header = item.header()
                head = (
                    b"*3\r\n$3\r\nSET\r\n" + _bulk(item.name.encode()) + b"$%d\r\n" % (len(header) + len(item.payload))
                )
                conn.send_packed_command([head, header, item.payload, b"\r\n"], check_health=False)
                sent += 1
            replies = [reader.simple() for _ in range(sent)]
        reasons = [None if reply == b"OK" else f"redis: {reply!r}" for reply in replies]
        return reasons + ["stopped"] * (len(items) - sent)

    def get(self, items: list[GetItem], stop: threading.Event) -> list[GetResult]:
        results: list[GetResult] = []
        for chunk in _chunks_by_bytes(items, HEADER_BYTES + max((len(i.payload) for i in items), default=0)):
            if stop.is_set():
                results += [GetResult(GetStatus.FAILED, detail="stopped")] * len(chunk)
                continue
            with self._connection() as (conn, reader):
                conn.send_command("MGET", *[item.name for item in chunk], check_health=False)
                if reader.array_length() != len(chunk):
                    raise ProtocolViolation("MGET answered with a different number of values")
                results += [item.landed(self._receive(reader, item, stop)) for item in chunk]
        return results

    @staticmethod
    def _receive(reader: RespReader, item: GetItem, stop: threading.Event) -> GetResult:
        """One MGET value: header into the result, payload straight into the host block."""
        length = reader.bulk_length()
        if length < 0:
            return MISSING
        if length != HEADER_BYTES + len(item.payload) or stop.is_set():
            reader.skip(length)  # never touch host memory for a wrong-size object or after a stop
            reader.end_of_bulk()
            if stop.is_set():
                return GetResult(GetStatus.FAILED, detail="stopped")
            return GetResult(GetStatus.MISMATCH, received=length, detail=f"object is {length} bytes")
        header = memoryview(bytearray(HEADER_BYTES))
        reader.into(header)
        reader.into(item.payload)
        reader.end_of_bulk()
        return GetResult(GetStatus.OK, bytes(header), length)

    def exists(self, names: list[str]) -> list[bool]:
        found: list[bool] = []
        with self._connection() as (conn, reader):
            for start in range(0, len(names), _PIPELINE_KEYS):
                chunk = names[start : start + _PIPELINE_KEYS]
                conn.send_packed_command(conn.pack_commands([("EXISTS", n) for n in chunk]), check_health=False)
                found += [reader.simple() == 1 for _ in chunk]
                if not all(found):
                    break  # a prefix query needs nothing past the first miss
        return found + [False] * (len(names) - len(found))

    def delete(self, names: list[str]) -> int:
        removed = 0
        with self._connection() as (conn, reader):
            for start in range(0, len(names), _PIPELINE_KEYS):
                conn.send_command("UNLINK", *names[start : start + _PIPELINE_KEYS], check_health=False)
                reply = reader.simple()
                if isinstance(reply, RespError):
                    raise StorageFailure(f"redis UNLINK: {reply}")
                removed += int(reply)
        return removed

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "url": _redacted(self.url), "state": self._state}

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()  # what is queued is written first
        self.client.close()
        self.client.connection_pool.disconnect()


def _chunks_by_bytes(items: list[GetItem], object_bytes: int) -> Iterator[list[GetItem]]:
    per_chunk = max(1, _MGET_BYTES // max(1, object_bytes))
    for start in range(0, len(items), per_chunk):
        yield items[start : start + per_chunk]


def _redacted(url: str) -> str:
    """The URL without its password, for logs and status."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()


def create(config: Config, pool: object = None) -> RedisBackend:
    url = config.storage.redis.url or "redis://127.0.0.1:6379/0"
    return RedisBackend(url, config.storage.timeout_s, max_connections=config.storage.io_threads + 4,
                        journal=config.storage.journal)  # fmt: skip
