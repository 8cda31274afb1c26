"""The attached device cache and its lifecycle: detached -> attaching -> attached -> detaching.

Every transition is driven by a command (or by the attached runner's exit) and acknowledged
by a reply; nothing is signalled through shared flags. Detach replies only after every copy
that touches the device cache has finished or been cancelled and every import is closed,
so the runner may free its memory the moment it has the reply.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ..backends.base import AttachError, DeviceCache
from ..protocol import ErrorCode, KVLayout, LayoutError, ProtocolError

if TYPE_CHECKING:
    from .server import Daemon

log = logging.getLogger(__name__)
_PID_POLL_S = 1.0  # fallback when pidfd_open is unavailable (foreign pid namespace)


class DeviceState(StrEnum):
    DETACHED = "detached"
    ATTACHING = "attaching"
    ATTACHED = "attached"
    DETACHING = "detaching"


class DeviceSlot:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.state = DeviceState.DETACHED
        self.cache: DeviceCache | None = None
        self.runner_pid: int | None = None
        self._pidfd: int | None = None
        self._pid_poll: asyncio.Task[None] | None = None
        self._detach_done: asyncio.Future[dict[str, Any]] | None = None

    def require(self) -> DeviceCache:
        if self.state is not DeviceState.ATTACHED or self.cache is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"no device cache attached (state {self.state.value})")
        return self.cache

    async def attach(self, layout_wire: dict[str, Any], device: dict[str, Any], pid: int | None) -> dict[str, Any]:
        if self.state is not DeviceState.DETACHED:
            code = ErrorCode.ALREADY_ATTACHED if self.state is DeviceState.ATTACHED else ErrorCode.BAD_STATE
            raise ProtocolError(code, f"device cache is {self.state.value}; detach first")
        try:
            layout = KVLayout.from_wire(layout_wire)
        except (LayoutError, TypeError) as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None
        geometry = self.daemon.host.bind(layout)
        self.state = DeviceState.ATTACHING
        try:
            loop = asyncio.get_running_loop()
            backend, pool = self.daemon.backend, self.daemon.host.pool
            self.cache = await loop.run_in_executor(None, backend.import_device_cache, layout, device, pool, geometry)
        except AttachError as exc:
            self.state = DeviceState.DETACHED
            raise ProtocolError(exc.code, str(exc)) from None
        except Exception as exc:
            self.state = DeviceState.DETACHED
            log.exception("attach failed")
            raise ProtocolError(ErrorCode.ATTACH_FAILED, f"{type(exc).__name__}: {exc}") from None
        self.state = DeviceState.ATTACHED
        self._watch(pid)
        self._publish()
        log.info("attached %s (runner pid %s)", self.cache.describe(), pid)
        return {
            "state": self.state.value,
            "device_blocks": layout.num_blocks,
            "host_blocks": geometry.num_blocks,
            "host_block_bytes": geometry.block_bytes,
            "fingerprint": layout.fingerprint(),
        }

    async def detach(self, reason: str, drain_timeout_s: float) -> dict[str, Any]:
        if self.state is DeviceState.DETACHING and self._detach_done is not None:
            return await asyncio.shield(self._detach_done)
        if self.state is DeviceState.ATTACHING:
            raise ProtocolError(ErrorCode.BAD_STATE, "attach in progress; retry detach after its reply")
        if self.state is DeviceState.DETACHED:
            return {"state": self.state.value, "drained": 0, "cancelled": 0}
        self.state = DeviceState.DETACHING
        self._detach_done = asyncio.get_running_loop().create_future()
        log.info("detaching: %s", reason)
        try:
            result = await self._drain_and_close(drain_timeout_s)
        finally:
            self.state = DeviceState.DETACHED
            self._publish()
        self._detach_done.set_result(result)
        self._detach_done = None
        return result

    async def _drain_and_close(self, drain_timeout_s: float) -> dict[str, Any]:
        entries = self.daemon.ordering.active(device_only=True)
        # Wait for outcomes, not for released blocks: a storage call stuck past its deadline
        # holds host blocks, never the device cache.
        pending = {e.finished for e in entries}
        if pending:
            _, pending = await asyncio.wait(pending, timeout=drain_timeout_s)
        for entry in entries:
            if entry.finished in pending:
                entry.cancel.cancel(ErrorCode.DETACHED, "device cache detached before this command finished")
        if pending:
            await asyncio.wait(pending)  # cancelled copies stop at their next checkpoint
        self._unwatch()
        cache, self.cache = self.cache, None
        if cache is not None:  # closing may sync streams or collect garbage: off the loop
            await asyncio.get_running_loop().run_in_executor(None, cache.close)
        # A copy cancelled mid-way may still have finished: count outcomes, not requests.
        cancelled = sum(1 for e in entries if e.code == ErrorCode.DETACHED)
        log.info("detached: drained %d, cancelled %d", len(entries) - cancelled, cancelled)
        return {"state": DeviceState.DETACHED.value, "drained": len(entries) - cancelled, "cancelled": cancelled}

    def _publish(self) -> None:
        m = self.daemon.metrics
        m.attached.set(1 if self.state is DeviceState.ATTACHED else 0)
        m.mappings.set(self.cache.mappings if self.cache is not None else 0)

    # Runner liveness: a runner that dies while attached must not keep its memory mapped.
    def _watch(self, pid: int | None) -> None:
        self.runner_pid = pid
        if pid is None or not self.daemon.config.daemon.watch_runner_pid:
            return
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(pid)
            loop.add_reader(self._pidfd, self._on_runner_exit)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                self._on_runner_exit()
                return
            self._pid_poll = loop.create_task(self._poll_pid(pid))

    async def _poll_pid(self, pid: int) -> None:
        while True:
            await asyncio.sleep(_PID_POLL_S)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                self._on_runner_exit()
                return
            except PermissionError:
                pass  # alive, owned by someone else

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._pid_poll is not None and self._pid_poll is not asyncio.current_task():
            self._pid_poll.cancel()
        self._pid_poll = None

    def _on_runner_exit(self) -> None:
        pid = self.runner_pid
        self._unwatch()
        if self.state is not DeviceState.ATTACHED:
            return
        log.warning("attached runner pid %s exited; detaching", pid)
        self.daemon.metrics.auto_detaches.inc()
        self.daemon.spawn(self.detach(f"runner pid {pid} exited", self.daemon.config.daemon.drain_timeout_s))

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"state": self.state.value, "runner_pid": self.runner_pid}
        if self.cache is not None:
            info.update(self.cache.describe())
        return info
