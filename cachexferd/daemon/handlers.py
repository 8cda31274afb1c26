"""One ``handle_<command>`` per message type, mapped by the dispatch tables at the bottom.

Synchronous handlers return the reply's result map. Asynchronous handlers validate the
command and return a Job (the blocks it touches + the work); the daemon orders and runs it
and emits its event. Any ProtocolError raised here becomes the command's error outcome.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..backends.base import CancelToken, Direction
from ..backends.plan import check_ids, first_duplicate
from ..protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Attach,
    Command,
    Detach,
    ErrorCode,
    Hello,
    Limits,
    MsgType,
    ProtocolError,
    SwapIn,
    SwapOut,
)
from .jobs import Job
from .ordering import Access, swap_access
from .storage_handlers import StorageHandlers

if TYPE_CHECKING:
    from .server import Daemon
    from .sessions import Session

SyncHandler = Callable[[bytes, Any], Awaitable[dict[str, Any]]]
JobHandler = Callable[["Session", Any], Job]


def validate_pairs(
    device_ids: Sequence[int], host_ids: Sequence[int], device_blocks: int, host_blocks: int, dest: str
) -> None:
    """Lengths equal, ids in range, destination ids unique (dest is 'device' or 'host')."""
    if len(device_ids) != len(host_ids):
        raise ProtocolError(
            ErrorCode.LENGTH_MISMATCH, f"device_ids has {len(device_ids)} entries, host_ids {len(host_ids)}"
        )
    for ids, limit, name in ((device_ids, device_blocks, "device_ids"), (host_ids, host_blocks, "host_ids")):
        reason = check_ids(ids, limit, name)
        if reason:
            raise ProtocolError(ErrorCode.ID_OUT_OF_RANGE, reason)
    dup = first_duplicate(device_ids if dest == "device" else host_ids)
    if dup is not None:
        raise ProtocolError(ErrorCode.DUPLICATE_ID, f"destination {dest} block {dup} appears more than once")


class Handlers:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.sync: dict[MsgType, SyncHandler] = {
            MsgType.HELLO: self.handle_hello,
            MsgType.PING: self.handle_ping,
            MsgType.STATUS: self.handle_status,
            MsgType.ATTACH: self.handle_attach,
            MsgType.DETACH: self.handle_detach,
            MsgType.SHUTDOWN: self.handle_shutdown,
        }
        self.jobs: dict[MsgType, JobHandler] = {
            MsgType.SWAP_OUT: self.handle_swap_out,
            MsgType.SWAP_IN: self.handle_swap_in,
            MsgType.CLEAR_HOST: self.handle_clear_host,
        }
        self.jobs.update(StorageHandlers(daemon).jobs)  # STORE, LOAD, LOOKUP, DELETE

    # Synchronous commands -------------------------------------------------------------

    async def handle_hello(self, identity: bytes, cmd: Hello) -> dict[str, Any]:
        if cmd.protocol[0] != PROTOCOL_MAJOR:
            raise ProtocolError(
                ErrorCode.WRONG_VERSION, f"client speaks protocol {cmd.protocol[0]}.x, daemon {PROTOCOL_MAJOR}.x"
            )
        self.d.sessions.hello(identity, cmd.client, cmd.role, cmd.events, cmd.pid)
        self.d.metrics.clients.set(len(self.d.sessions))
        host = self.d.host.describe()
        return {
            "protocol": [PROTOCOL_MAJOR, PROTOCOL_MINOR],
            "version": __version__,
            "backend": self.d.backend.name,
            "rank": self.d.rank,
            "state": self.d.device.state.value,
            "host_blocks": host["num_blocks"],
            "host_block_bytes": host["block_bytes"],
            "limits": {"max_ids": Limits.MAX_IDS, "max_keys": Limits.MAX_KEYS, "max_body_bytes": Limits.MAX_BODY_BYTES},
            "pid": os.getpid(),
        }

    async def handle_ping(self, identity: bytes, cmd: Command) -> dict[str, Any]:
        return {"time": time.time()}

    async def handle_status(self, identity: bytes, cmd: Command) -> dict[str, Any]:
        return self.d.status()

    async def handle_attach(self, identity: bytes, cmd: Attach) -> dict[str, Any]:
        return await self.d.device.attach(cmd.layout, cmd.device, cmd.pid)

    async def handle_detach(self, identity: bytes, cmd: Detach) -> dict[str, Any]:
        timeout = self.d.config.daemon.drain_timeout_s if cmd.drain_timeout_s is None else cmd.drain_timeout_s
        return await self.d.device.detach("requested by a client", timeout)

    async def handle_shutdown(self, identity: bytes, cmd: Command) -> dict[str, Any]:
        self.d.request_stop("shutdown command")
        return {"state": "draining"}

    # Asynchronous commands ------------------------------------------------------------

    def handle_swap_out(self, session: Session, cmd: SwapOut) -> Job:
        return self._swap_job(cmd.device_ids, cmd.host_ids, Direction.D2H)

    def handle_swap_in(self, session: Session, cmd: SwapIn) -> Job:
        return self._swap_job(cmd.device_ids, cmd.host_ids, Direction.H2D)

    def _swap_job(self, device_ids: list[int], host_ids: list[int], direction: Direction) -> Job:
        cache = self.d.device.require()
        geometry = self.d.host.require_geometry()
        to_host = direction is Direction.D2H
        validate_pairs(
            device_ids, host_ids, cache.layout.num_blocks, geometry.num_blocks, "host" if to_host else "device"
        )

        async def work(cancel: CancelToken) -> dict[str, Any]:
            moved = await cache.swap(direction, device_ids, host_ids, cancel) if device_ids else 0
            self.d.metrics.transfer_bytes.labels(direction.value).inc(moved)
            return {"blocks": len(device_ids), "bytes": moved}

        return Job(swap_access(device_ids, host_ids, to_host), work)

    def handle_clear_host(self, session: Session, cmd: Command) -> Job:
        pool = self.d.host.pool

        async def work(cancel: CancelToken) -> dict[str, Any]:
            await asyncio.get_running_loop().run_in_executor(None, pool.discard)
            return {"capacity_bytes": pool.capacity}

        return Job(Access(all_host_write=True), work)
