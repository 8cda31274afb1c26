"""Baselines for ``cachexferd bench storage``: each backend's own client moving the same
object sizes (header + block), with the same number of threads the daemon's tier uses,
and none of the daemon's work (no protocol, no headers or checksums, no temp file + rename,
no fan-out directories, no copy into a host pool).

- file: ``open`` / ``write`` / ``close`` of one file per object into one directory, and
  ``open`` / ``readv`` into a preallocated buffer;
- redis: redis-py pipelined SET of prebuilt bytes values, and MGET (the same 64 MiB chunks);
- mooncake: a second MooncakeDistributedStore client in the benchmark process, with its
  buffer registered, ``batch_put_from`` / ``batch_get_into``.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_MGET_BYTES = 64 << 20


def run_threads(count: int, threads: int, fn: Callable[[int, int], None]) -> None:
    """Calls fn(lo, hi) for ``threads`` contiguous slices of range(count), in parallel."""
    bounds = [count * i // threads for i in range(threads + 1)]
    errors: list[BaseException] = []

    def guard(lo: int, hi: int) -> None:
        try:
            fn(lo, hi)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=guard, args=(bounds[i], bounds[i + 1])) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


class RawClient:
    """put(tag) writes ``count`` objects of ``object_bytes``; get(tag) reads them back."""

    def __init__(self, count: int, object_bytes: int, threads: int) -> None:
        self.count, self.object_bytes, self.threads = count, object_bytes, threads
        self.src = mmap.mmap(-1, count * object_bytes)
        self.dst = mmap.mmap(-1, count * object_bytes)
        self.src.write(os.urandom(min(len(self.src), 1 << 20)) * (len(self.src) // min(len(self.src), 1 << 20)))
        self.dst.write(bytes(len(self.dst)))  # fault the pages in outside the timed region

    def view(self, buf: mmap.mmap, i: int) -> memoryview:
        return memoryview(buf)[i * self.object_bytes : (i + 1) * self.object_bytes]

    def put(self, tag: str) -> None:
        raise NotImplementedError

    def get(self, tag: str) -> None:
        raise NotImplementedError

    def drop(self, tag: str) -> None:
        """Removes the objects of ``tag`` (untimed)."""

    def close(self) -> None:
        self.src.close()
        self.dst.close()


class RawFile(RawClient):
    def __init__(self, root: Path, count: int, object_bytes: int, threads: int) -> None:
        super().__init__(count, object_bytes, threads)
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, tag: str, i: int) -> str:
        return str(self.root / f"{tag}-{i}")

    def put(self, tag: str) -> None:
        def work(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                fd = os.open(self._path(tag, i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, self.view(self.src, i))
                finally:
                    os.close(fd)

        run_threads(self.count, self.threads, work)

    def get(self, tag: str) -> None:
        def work(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                fd = os.open(self._path(tag, i), os.O_RDONLY)
                try:
                    if os.readv(fd, [self.view(self.dst, i)]) != self.object_bytes:
                        raise RuntimeError("raw file read came back short")
                finally:
                    os.close(fd)

        run_threads(self.count, self.threads, work)

    def drop(self, tag: str) -> None:
        for i in range(self.count):
            os.unlink(self._path(tag, i))


class RawRedis(RawClient):
    def __init__(self, url: str, count: int, object_bytes: int, threads: int) -> None:
        import redis

        super().__init__(count, object_bytes, threads)
        self.client = redis.Redis.from_url(url, socket_timeout=60)
        self.values = [bytes(self.view(self.src, i)) for i in range(count)]

    def put(self, tag: str) -> None:
        def work(lo: int, hi: int) -> None:
            pipe = self.client.pipeline(transaction=False)
            for i in range(lo, hi):
                pipe.set(f"raw:{tag}:{i}", self.values[i])
            if not all(pipe.execute()):
                raise RuntimeError("raw redis SET failed")

        run_threads(self.count, self.threads, work)

    def get(self, tag: str) -> None:
        per_call = max(1, _MGET_BYTES // self.object_bytes)

        def work(lo: int, hi: int) -> None:
            for start in range(lo, hi, per_call):
                values = self.client.mget([f"raw:{tag}:{i}" for i in range(start, min(hi, start + per_call))])
                if any(v is None for v in values):
                    raise RuntimeError("raw redis MGET missed")

        run_threads(self.count, self.threads, work)

    def drop(self, tag: str) -> None:
        self.client.unlink(*[f"raw:{tag}:{i}" for i in range(self.count)])

    def close(self) -> None:
        self.client.close()
        super().close()


class RawMooncake(RawClient):
    def __init__(self, master: str, count: int, object_bytes: int, threads: int) -> None:
        import ctypes

        from mooncake.store import MooncakeDistributedStore

        super().__init__(count, object_bytes, threads)
        self.store: Any = MooncakeDistributedStore()
        if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise RuntimeError(f"raw mooncake client: setup against {master} failed")
        self.addr = {id(b): ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in (self.src, self.dst)}
        for buf in (self.src, self.dst):
            if self.store.register_buffer(self.addr[id(buf)], len(buf)) != 0:
                raise RuntimeError("raw mooncake client: register_buffer failed")

    def _ptrs(self, buf: mmap.mmap, lo: int, hi: int) -> list[int]:
        return [self.addr[id(buf)] + i * self.object_bytes for i in range(lo, hi)]

    def put(self, tag: str) -> None:
        def work(lo: int, hi: int) -> None:
            names = [f"raw:{tag}:{i}" for i in range(lo, hi)]
            codes = self.store.batch_put_from(names, self._ptrs(self.src, lo, hi), [self.object_bytes] * (hi - lo))
            if any(c != 0 for c in codes):
                raise RuntimeError(f"raw mooncake put failed: {sorted(set(codes))}")

        run_threads(self.count, self.threads, work)

    def get(self, tag: str) -> None:
        def work(lo: int, hi: int) -> None:
            names = [f"raw:{tag}:{i}" for i in range(lo, hi)]
            codes = self.store.batch_get_into(names, self._ptrs(self.dst, lo, hi), [self.object_bytes] * (hi - lo))
            if any(c != self.object_bytes for c in codes):
                raise RuntimeError(f"raw mooncake get failed: {sorted(set(codes))}")

        run_threads(self.count, self.threads, work)

    def drop(self, tag: str) -> None:
        self.store.batch_remove([f"raw:{tag}:{i}" for i in range(self.count)], True)

    def close(self) -> None:
        for buf in (self.src, self.dst):
            self.store.unregister_buffer(self.addr[id(buf)])
        self.store.close()
        super().close()
