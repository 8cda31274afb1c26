"""One ``handle_<command>`` per message type; the dispatch table is derived from the names.

Synchronous handlers return the reply's result map, or an awaitable of it (attach and
detach, which wait for imports and drains). Asynchronous handlers validate the command and
return a Job (the blocks it touches + the work); the daemon orders and runs it and emits its
event. Any ProtocolError raised here becomes the command's error outcome.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..backends.base import CancelToken, Direction
from ..protocol import (
    COMMANDS,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Attach,
    ClearHost,
    Command,
    Detach,
    ErrorCode,
    Hello,
    HostKeys,
    Limits,
    MsgType,
    Pause,
    ProtocolError,
    Resume,
    SetWeights,
    SwapIn,
    SwapOut,
)
from ..security import Requester
from . import validate
from .device import DeviceSlot
from .jobs import Copy, Job
from .ordering import Access, swap_access
from .pausing import Pausing
from .storage_handlers import StorageHandlers

if TYPE_CHECKING:
    from ..config import Config
    from ..metrics import DaemonMetrics
    from .host import HostCache
    from .sessions import Sessions
    from .storage_tier import StorageTier

Result = dict[str, Any] | Awaitable[dict[str, Any]]
_new_tuple: Any = tuple.__new__
SyncHandler = Callable[[bytes, Any], Result]
JobHandler = Callable[[Any], Job]


class Handlers:
    """Every command's handler; the storage commands' live in a StorageHandlers it holds."""

    def __init__(
        self,
        config: Config,
        device: DeviceSlot,
        host: HostCache,
        storage: StorageTier | None,
        sessions: Sessions,
        metrics: DaemonMetrics,
        status: Callable[[], dict[str, Any]],
        request_stop: Callable[[str], None],
        pausing: Pausing,
    ) -> None:
        self.config, self.device, self.host, self.storage = config, device, host, storage
        self.sessions, self.metrics, self.pausing = sessions, metrics, pausing
        self._status, self._request_stop = status, request_stop
        self.storage_commands = StorageHandlers(device, host, storage, metrics, pausing)
        self.sync: dict[MsgType, SyncHandler] = {}
        self.jobs: dict[MsgType, JobHandler] = {}
        for msg_type, cls in COMMANDS.items():
            name = f"handle_{cls.name()}"
            handler = getattr(self, name, None) or getattr(self.storage_commands, name)
            (self.jobs if cls.ASYNC else self.sync)[msg_type] = handler

    # Synchronous commands -------------------------------------------------------------

    def handle_hello(self, identity: bytes, cmd: Hello) -> dict[str, Any]:
        if cmd.protocol[0] != PROTOCOL_MAJOR:
            raise ProtocolError(
                ErrorCode.WRONG_VERSION, f"client speaks protocol {cmd.protocol[0]}.x, daemon {PROTOCOL_MAJOR}.x"
            )
        self.sessions.hello(identity, cmd.client, cmd.role, cmd.events, cmd.pid, cmd.batch_events, cmd.events_key)
        self.metrics.clients.set(len(self.sessions))
        host = self.host.describe()
        limits = {"max_ids": Limits.MAX_IDS, "max_keys": Limits.MAX_KEYS, "max_body_bytes": Limits.MAX_BODY_BYTES}
        return {
            "protocol": [PROTOCOL_MAJOR, PROTOCOL_MINOR],
            "version": __version__,
            "backend": self.device.backend.name,
            "rank": self.config.daemon.rank,
            "state": self.device.state.value,
            "host_blocks": host["num_blocks"],
            "host_block_bytes": host["block_bytes"],
            "limits": {**limits, "max_batch": Limits.MAX_BATCH},
            "batch": True,  # BATCH envelopes accepted (protocol 1.1)
            "pid": os.getpid(),
            "host_generation": self.host.generation,  # protocol 1.2
        }

    def handle_ping(self, identity: bytes, cmd: Command) -> dict[str, Any]:
        return {"time": time.time(), "host_generation": self.host.generation,
                "weights_version": self.host.weights_version}  # fmt: skip

    def handle_status(self, identity: bytes, cmd: Command) -> dict[str, Any]:
        return self._status()

    def handle_attach(
        self, identity: bytes, cmd: Attach, requester: Requester | None = None
    ) -> Awaitable[dict[str, Any]]:
        """``requester``: the access guard's view of the asking peer (the strictest one without)."""
        attaching = self.device.attach(cmd.layout, cmd.device, cmd.pid, requester or Requester(), cmd.supersede)
        return self._attached(attaching, cmd.weights_version)

    async def _attached(self, attaching: Awaitable[dict[str, Any]], version: int | None) -> dict[str, Any]:
        """A successful attach that names a weights version puts it in force before its reply
        is decided, so the commands held behind the attach (the barrier) are judged under it."""
        result = await attaching
        if version is not None:
            self.host.set_weights(version)
        return {**result, "weights_version": self.host.weights_version}

    def handle_detach(self, identity: bytes, cmd: Detach) -> Awaitable[dict[str, Any]]:
        timeout = self.config.daemon.drain_timeout_s if cmd.drain_timeout_s is None else cmd.drain_timeout_s
        return self.device.detach("requested by a client", timeout)

    def handle_shutdown(self, identity: bytes, cmd: Command) -> dict[str, Any]:
        self._request_stop("shutdown command")
        return {"state": "draining"}

    def handle_pause(self, identity: bytes, cmd: Pause) -> Awaitable[dict[str, Any]]:
        timeout = self.config.daemon.drain_timeout_s if cmd.drain_timeout_s is None else cmd.drain_timeout_s
        return self.pausing.pause(timeout)

    def handle_resume(self, identity: bytes, cmd: Resume) -> dict[str, Any]:
        return self.pausing.resume()

    def handle_set_weights(self, identity: bytes, cmd: SetWeights) -> dict[str, Any]:
        previous = self.host.weights_version
        self.host.set_weights(cmd.version)
        return {"previous": previous, "version": cmd.version}

    def handle_host_keys(self, identity: bytes, cmd: HostKeys) -> dict[str, Any]:
        """A page of the host blocks' identity keys (1.3); empty until the geometry is known."""
        blocks = self.host.geometry.num_blocks if self.host.geometry else 0
        host_ids, keys = self.host.keys.page(cmd.start, cmd.count)
        end = cmd.start + cmd.count
        return {"host_ids": host_ids, "keys": keys, "next": end if end < blocks else None, "host_blocks": blocks,
                "host_generation": self.host.generation, "weights_version": self.host.weights_version}  # fmt: skip

    # Asynchronous commands ------------------------------------------------------------

    def handle_swap_out(self, cmd: SwapOut) -> Job:
        return self._swap_job(cmd.device_ids, cmd.host_ids, Direction.D2H, cmd.owner, cmd.not_after, cmd.keys)

    def handle_swap_in(self, cmd: SwapIn) -> Job:
        return self._swap_job(cmd.device_ids, cmd.host_ids, Direction.H2D, cmd.owner, cmd.not_after, cmd.keys)

    def _swap_job(
        self, device_ids: list[int], host_ids: list[int], direction: Direction, owner: str | None,
        not_after: float | None, keys: list[str] | None = None,
    ) -> Job:  # fmt: skip
        self.pausing.require_running()
        if not_after is not None:
            validate.require_in_time(not_after)
        cache = self.device.require()
        geometry = self.host.require_geometry()
        to_host = direction is Direction.D2H
        dest = "host" if to_host else "device"
        validate.swap_pairs(device_ids, host_ids, cache.layout.num_blocks, geometry.num_blocks, dest)
        if keys is not None:
            validate.same_length(host_ids, keys, ("host_ids", "keys"))
        succeeded = None
        if to_host:
            serial = self.host.stamp(host_ids, owner)
            if keys:
                succeeded = self.host.keys.settler(host_ids, keys, serial)
        else:
            self.host.check_current(host_ids, owner, keys)
        # Positional tuples: a NamedTuple's keyword constructor costs more than the rest of this.
        copy = _new_tuple(Copy, (cache, direction, device_ids, host_ids))
        # Never started after its not_after (1.5): the client may have given up and reused
        # the device blocks since.
        limit = math.inf if not_after is None else not_after
        job: Job = _new_tuple(Job, (swap_access(device_ids, host_ids, to_host), None, copy, succeeded, limit))
        return job

    def handle_clear_host(self, cmd: ClearHost) -> Job:
        pool = self.host.pool
        # Takes effect when accepted (like every stamp): a later SWAP_IN naming an owner is
        # refused even if it arrives before the pool is actually cleared.
        generation = self.host.clear()

        async def work(cancel: CancelToken) -> dict[str, Any]:
            freed = await asyncio.get_running_loop().run_in_executor(None, pool.discard)
            return {"capacity_bytes": pool.capacity, "freed_bytes": freed, "host_generation": generation}

        return Job(Access(all_host_write=True), work)
