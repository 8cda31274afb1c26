"""The attached device cache and its lifecycle: detached -> attaching -> attached -> detaching.

Every transition is driven by a command (or by the attached runner's exit) and acknowledged
by a reply; nothing is signalled through shared flags. Detach replies only after every copy
that touches the device cache has finished or been cancelled and every import is closed,
so the runner may free its memory the moment it has the reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from ..backends.base import AttachError, Backend, DeviceCache
from ..host_cache import HostGeometry
from ..protocol import ErrorCode, KVLayout, LayoutError, ProtocolError
from ..security import Requester
from .pidwatch import PidWatch
from .supersede import RunnerProcess, supersede_refusal

if TYPE_CHECKING:
    from ..config import DaemonConfig
    from ..metrics import DaemonMetrics
    from .host import HostCache
    from .ordering import BlockOrdering

Spawn = Callable[[Coroutine[Any, Any, Any]], None]

log = logging.getLogger(__name__)


class DeviceState(StrEnum):
    DETACHED = "detached"
    ATTACHING = "attaching"
    ATTACHED = "attached"
    DETACHING = "detaching"


class DeviceSlot:
    def __init__(
        self,
        backend: Backend,
        host: HostCache,
        ordering: BlockOrdering[Any],
        metrics: DaemonMetrics,
        config: DaemonConfig,
        spawn: Spawn,
    ) -> None:
        self.backend, self.host, self.ordering = backend, host, ordering
        self.metrics, self.config, self._spawn = metrics, config, spawn
        self.state = DeviceState.DETACHED
        self.cache: DeviceCache | None = None
        self.runner_pid: int | None = None
        self._runner: RunnerProcess | None = None  # for ATTACH supersede (1.2)
        self._pid_watch: PidWatch | None = None
        self._owner_gone = False  # the attached runner died: remove what only it would have
        self._detach_done: asyncio.Future[dict[str, Any]] | None = None

    def require(self) -> DeviceCache:
        if self.state is not DeviceState.ATTACHED or self.cache is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, f"no device cache attached (state {self.state.value})")
        return self.cache

    def attach(
        self, layout_wire: dict[str, Any], device: dict[str, Any], pid: int | None, requester: Requester,
        supersede: bool = False,
    ) -> Awaitable[dict[str, Any]]:  # fmt: skip
        """Checks the request now (state, layout, host fit) and returns the import to await.
        A failed attach changes nothing: the host geometry is bound only on success.
        ``device`` goes to the backend as the client sent it; ``requester`` beside it. With
        ``supersede`` (1.2), an attached runner that is gone or orphaned is detached first."""
        try:
            if supersede and self.state is DeviceState.ATTACHED:
                return self._supersede(layout_wire, device, pid, requester)
            layout, geometry = self._check_attach(layout_wire)
        except ProtocolError as exc:
            log.info("attach refused (runner pid %s): %s: %s", pid, exc.code.name, exc.detail)
            raise
        self.state = DeviceState.ATTACHING
        return self._import(layout, geometry, device, pid, requester)

    def _supersede(
        self, layout_wire: dict[str, Any], device: dict[str, Any], pid: int | None, requester: Requester
    ) -> Awaitable[dict[str, Any]]:
        refusal = supersede_refusal(self._runner, requester.peer)
        if refusal is not None:
            raise ProtocolError(ErrorCode.ALREADY_ATTACHED, f"cannot supersede: {refusal}")
        old = self.runner_pid
        log.warning("runner pid %s supersedes runner pid %s (gone or orphaned)", pid, old)
        self._owner_gone = True
        drained = self.detach(f"superseded by runner pid {pid}", self.config.drain_timeout_s)

        async def then_attach() -> dict[str, Any]:
            await drained
            layout, geometry = self._check_attach(layout_wire)
            self.state = DeviceState.ATTACHING
            return await self._import(layout, geometry, device, pid, requester)

        return then_attach()

    def _check_attach(self, layout_wire: dict[str, Any]) -> tuple[KVLayout, HostGeometry]:
        if self.state is not DeviceState.DETACHED:
            code = ErrorCode.ALREADY_ATTACHED if self.state is DeviceState.ATTACHED else ErrorCode.BAD_STATE
            raise ProtocolError(code, f"device cache is {self.state.value}; detach first")
        try:
            layout = KVLayout.from_wire(layout_wire)
        except (LayoutError, TypeError) as exc:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(exc)) from None
        return layout, self.host.plan(layout)

    async def _import(
        self, layout: KVLayout, geometry: HostGeometry, device: dict[str, Any], pid: int | None, requester: Requester
    ) -> dict[str, Any]:
        try:
            loop = asyncio.get_running_loop()
            import_cache, pool = self.backend.import_device_cache, self.host.pool
            self.cache = await loop.run_in_executor(None, import_cache, layout, device, pool, geometry, requester)
        except AttachError as exc:
            self.state = DeviceState.DETACHED
            log.info("attach refused (runner pid %s): %s: %s", pid, exc.code.name, exc)
            raise ProtocolError(exc.code, str(exc)) from None
        except Exception as exc:
            self.state = DeviceState.DETACHED
            log.exception("attach failed")
            raise ProtocolError(ErrorCode.ATTACH_FAILED, f"{type(exc).__name__}: {exc}") from None
        self.host.commit(layout, geometry)
        self.state = DeviceState.ATTACHED
        self._watch(pid, requester)
        self._publish()
        log.info("attached %s (runner pid %s)", self.cache.describe(), pid)
        return {
            "state": self.state.value,
            "device_blocks": layout.num_blocks,
            "host_blocks": geometry.num_blocks,
            "host_block_bytes": geometry.block_bytes,
            "fingerprint": layout.fingerprint(),
            "device_fence": self.cache.fence,  # 1.5: how a client knows no copy into its blocks runs
            "device_fence_reads": self.cache.fence_reads,  # 1.6: nor out of them
        }

    def detach(self, reason: str, drain_timeout_s: float) -> Awaitable[dict[str, Any]]:
        """Marks the cache detaching now (later commands see it) and returns the drain to
        await; its result means every import is closed and the runner may free its memory."""
        if self.state is DeviceState.DETACHING and self._detach_done is not None:
            return asyncio.shield(self._detach_done)
        if self.state is DeviceState.ATTACHING:
            raise ProtocolError(ErrorCode.BAD_STATE, "attach in progress; retry detach after its reply")
        done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if self.state is DeviceState.DETACHED:
            done.set_result({"state": self.state.value, "drained": 0, "cancelled": 0})
            return done
        self.state = DeviceState.DETACHING
        self._detach_done = done
        log.info("detaching: %s", reason)
        return self._detach(done, drain_timeout_s)

    async def _detach(self, done: asyncio.Future[dict[str, Any]], drain_timeout_s: float) -> dict[str, Any]:
        try:
            result = await self._drain_and_close(drain_timeout_s)
        except BaseException as exc:
            done.set_exception(exc)
            raise
        finally:
            self.state = DeviceState.DETACHED
            self._detach_done = None
            self._publish()
        done.set_result(result)
        return result

    async def _drain_and_close(self, drain_timeout_s: float) -> dict[str, Any]:
        entries = self.ordering.active(device_only=True)
        # Wait for outcomes, not for released blocks: a storage call stuck past its deadline
        # holds host blocks, never the device cache.
        finished = {e: e.when_finished() for e in entries}
        pending = set(finished.values())
        if pending:
            _, pending = await asyncio.wait(pending, timeout=drain_timeout_s)
        for entry in entries:
            if finished[entry] in pending:
                entry.cancel.cancel(ErrorCode.DETACHED, "device cache detached before this command finished")
        if pending:
            await asyncio.wait(pending)  # cancelled copies stop at their next checkpoint
        self._unwatch()
        # The flag goes with the cache it was raised for, whatever happens below: a later
        # runner's detach must never remove that runner's memory.
        cache, self.cache = self.cache, None
        orphaned, self._owner_gone = self._owner_gone, False
        if cache is not None:  # closing may sync streams or collect garbage: off the loop
            await asyncio.get_running_loop().run_in_executor(None, cache.close)
            if orphaned:
                _remove_orphaned(cache)
        # A copy cancelled mid-way may still have finished: count outcomes, not requests.
        cancelled = sum(e.weight for e in entries if e.code == ErrorCode.DETACHED)
        drained = sum(e.weight for e in entries) - cancelled
        log.info("detached: drained %d, cancelled %d", drained, cancelled)
        return {"state": DeviceState.DETACHED.value, "drained": drained, "cancelled": cancelled}

    def _publish(self) -> None:
        m = self.metrics
        m.attached.set(1 if self.state is DeviceState.ATTACHED else 0)
        m.mappings.set(self.cache.mappings if self.cache is not None else 0)

    # Runner liveness: a runner that dies while attached must not keep its memory mapped.
    def _watch(self, pid: int | None, requester: Requester) -> None:
        self.runner_pid = pid
        self._runner = RunnerProcess.note(pid, requester.peer)
        if pid is not None and self.config.watch_runner_pid:
            self._pid_watch = PidWatch(pid, self._on_runner_exit)

    def _unwatch(self) -> None:
        if self._pid_watch is not None:
            self._pid_watch.stop()
            self._pid_watch = None

    def _on_runner_exit(self) -> None:
        pid = self.runner_pid
        self._unwatch()
        if self.state is not DeviceState.ATTACHED:
            return
        log.warning("attached runner pid %s exited; detaching", pid)
        self.metrics.auto_detaches.inc()
        self._owner_gone = True
        self._spawn(_awaited(self.detach(f"runner pid {pid} exited", self.config.drain_timeout_s)))

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"state": self.state.value, "runner_pid": self.runner_pid}
        if self.cache is not None:
            info.update(self.cache.describe())
        return info


def _remove_orphaned(cache: DeviceCache) -> None:
    """What only the dead runner would have removed; a failure is logged, never raised (the
    detach itself has succeeded: the memory is unmapped)."""
    try:
        cache.orphaned()
    except Exception:
        log.exception("could not remove what the dead runner left behind")


async def _awaited(awaitable: Awaitable[Any]) -> None:
    """An automatic detach, run as a task nobody awaits: its failure is logged here."""
    try:
        await awaitable
    except Exception:
        log.exception("automatic detach failed")
