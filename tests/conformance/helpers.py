"""Small things several conformance tests need, all derived from the docs."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from .daemons import REPO
from .spec import T
from .wire import Client


def fingerprint(layout: dict[str, Any]) -> str:
    """docs/protocol.md §8.1."""
    text = "{}:{}:{}:{}:{}:{}".format(
        layout["dtype"],
        layout["num_layers"],
        layout.get("kv_tensors", 2),
        layout["block_size"],
        layout["num_kv_heads"],
        layout["head_dim"],
    )
    return hashlib.blake2s(text.encode("ascii"), digest_size=8).hexdigest()


@cache
def vectors() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REPO / "docs" / "vectors.json").read_text(encoding="utf-8"))
    return data


def chain(name: str) -> dict[str, Any]:
    return next(c for c in vectors()["chains"] if c["name"] == name)


def object_name(key: str, weights_version: int = 0, namespace: str = "") -> str:
    """The object name of ``key`` (docs/storage.md §1.9)."""
    scoped = f"w{weights_version}/{key}"
    return f"{namespace}/{scoped}" if namespace else scoped


def object_file(store: Path, key: str, weights_version: int = 0) -> Path:
    """Where the file backend keeps the object of ``key`` (docs/storage.md §1.9, §4.1); the
    suite's daemons set no storage namespace."""
    name = object_name(key, weights_version)
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).hexdigest()
    return store / digest[:2] / digest[2:4] / digest


def ensure_detached(client: Client, timeout_s: float = 10.0) -> None:
    """Cleanup after a test that may have failed half way: DETACH until the daemon says it is
    detached (a DETACH during an attach may be refused with BAD_STATE)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = client.call(T.DETACH)
        if reply.ok and reply.result.get("state") == "detached":
            return
        assert time.monotonic() < deadline, f"cannot detach: {reply}"
        time.sleep(0.05)


def burst(client: Client, commands: Sequence[tuple[int, Mapping[str, Any]]]) -> list[int]:
    """Sends every command before reading anything (one pipelined burst); returns req_ids."""
    return [client.command(msg_type, **fields) for msg_type, fields in commands]


@contextmanager
def hung_object(store: Path, name: str, reader_wait_s: float = 5.0) -> Iterator[Path]:
    """Makes the object of key ``name`` a FIFO: the file backend's read of it blocks until released.
    On exit the FIFO is released so that no reader can stay stuck, whenever it opens it."""
    path = object_file(store, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    try:
        yield path
    finally:
        release_fifo(path, reader_wait_s)


def release_fifo(path: Path, reader_wait_s: float) -> None:
    """Lets the reader of FIFO ``path`` see end-of-file and removes the FIFO.

    The daemon's read may not have reached open() yet: a writer that came and went before
    it would leave it blocked for good. So wait (bounded) until a reader is there; if none
    comes, hold both ends open while unlinking, so a late open either finds a writer (and
    then end-of-file) or finds no file at all."""
    deadline = time.monotonic() + reader_wait_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # succeeds once a reader is there
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            if time.monotonic() < deadline:
                time.sleep(0.005)
                continue
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer for any late reader
        try:
            path.unlink()
        finally:
            os.close(fd)
        return


@contextmanager
def held_in_flight(client: Client, store: Path, req_id: int, host_block: int = 16000) -> Iterator[None]:
    """Sends a host-only LOAD with ``req_id`` whose object read hangs (a FIFO), so the command
    stays in flight for the body of the ``with``; on exit the read is released and the LOAD
    finishes. ``store`` is the daemon's storage directory."""
    name = f"held-{req_id}-{client.boot_id}"
    with hung_object(store, name):
        client.command(T.LOAD, req_id=req_id, keys=[name], host_ids=[host_block])
        yield
