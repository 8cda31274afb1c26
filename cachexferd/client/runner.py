"""Model-runner helper: own a KV cache, attach it to the local daemon, detach it safely.

The runner allocates its cache in its own process (its compute never runs on imported
memory) and hands the daemon a handle. For the cpu backend the cache is one POSIX
shared-memory segment; every tensor is ``[num_blocks, block_size, num_kv_heads, head_dim]``::

    cache = ShmKVCache(KVLayout(num_layers=32, num_blocks=4096, block_size=16,
                                num_kv_heads=8, head_dim=128, dtype="bfloat16"))
    with RunnerClient("ipc:///run/cachexferd/0/cmd.sock") as runner, runner.attached(cache, reattach=True):
        ...                                   # serve requests; the engine swaps blocks
        with runner.weight_update(cache, version=step):   # RL: pause, detach, ...
            reload_weights()                               # ... set the version, attach, resume

The client remembers the weights version it set (``set_weights``, ``weight_update``) and sends
it with every attach, so an attach after a daemon restart (by hand, or by the ``reattach``
keeper) puts the version back before any copy can run: a restarted daemon starts at 0.

Importing this module does not import torch; creating a cache does.
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import zmq

from ..protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Attach,
    Detach,
    Hello,
    KVLayout,
    Pause,
    Resume,
    SetWeights,
    Status,
)
from ..security import client_keys_or_none, group_id
from .link import ClientError, Link, check_ok
from .reattach import Reattacher

if TYPE_CHECKING:
    import torch


class DeviceCacheHandle(Protocol):
    """What RunnerClient needs from a cache: its layout and the attach handles."""

    layout: KVLayout

    def device_handle(self) -> dict[str, Any]: ...


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dtype


class KVTensors:
    """Accessors shared by the runner-side caches (``layout`` + ``tensors``)."""

    layout: KVLayout
    tensors: list[torch.Tensor]

    def layer(self, index: int) -> tuple[torch.Tensor, ...]:
        """(K, V) of one layer, or (latent,) for single-tensor (MLA) caches."""
        kv = self.layout.kv_tensors
        return tuple(self.tensors[index * kv : (index + 1) * kv])

    def block_bytes(self, tensor: int, block: int) -> torch.Tensor:
        """The raw bytes of one block of one tensor (for checks)."""
        import torch

        return self.tensors[tensor][block].reshape(-1).view(torch.uint8)


class ShmKVCache(KVTensors):
    """A device KV cache for the cpu backend, in /dev/shm, owned (and unlinked) by the runner.

    The segment is private to the runner's user (0600). A daemon that runs as another user
    (a systemd service) maps it through a shared ``group`` (name or gid, usually the daemon's
    ``access.group``): the segment is then 0660 and owned by that group."""

    def __init__(self, layout: KVLayout, name: str | None = None, group: str | int | None = None) -> None:
        import torch

        self.layout = layout
        self.name = name or f"cachexferd-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = f"/dev/shm/{self.name}"
        size = layout.num_tensors * layout.tensor_bytes
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        # A segment outlives its process unless unlinked: at close(), when the cache is
        # collected, or at interpreter exit, whichever comes first.
        self._unlink = weakref.finalize(self, _unlink_quietly, self.path)
        try:
            if group is not None:  # widened only after the group is set: never readable by others
                os.fchown(fd, -1, group if isinstance(group, int) else group_id(group))
                os.fchmod(fd, 0o660)
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(self.path, shared=True, nbytes=size))
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.offsets = [t * layout.tensor_bytes for t in range(layout.num_tensors)]
        shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        dtype = torch_dtype(layout.dtype)
        self.tensors: list[torch.Tensor] = [
            flat[o : o + layout.tensor_bytes].view(dtype).view(shape) for o in self.offsets
        ]

    def device_handle(self) -> dict[str, Any]:
        return {"kind": "shm", "name": self.name, "offsets": list(self.offsets)}

    def fence_path(self) -> str:
        """What a DeviceFence opens (client/fence.py)."""
        return self.path

    def close(self) -> None:
        self.tensors = []
        self._unlink()

    def __enter__(self) -> ShmKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def _step(step: str, state: str) -> Iterator[None]:
    """One step of a weight update after its block: a ClientError becomes WeightUpdateError."""
    try:
        yield
    except ClientError as exc:
        raise WeightUpdateError(step, exc, state) from exc


def _unlink_quietly(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


class WeightUpdateError(ClientError):
    """A step after the block of ``RunnerClient.weight_update`` failed. ``step`` names it
    (``set_weights``, ``attach`` or ``resume``); the message says what state the daemon was
    left in and how to leave it. The runner's new weights version is remembered by the client
    either way: its next attach carries it."""

    def __init__(self, step: str, cause: ClientError, state: str) -> None:
        super().__init__(cause.code, f"weight update: {step} failed ({cause.detail}); {state}", cause.rank)
        self.step, self.cause = step, cause


@dataclass
class WeightUpdate:
    """What ``RunnerClient.weight_update`` yields: set ``cache`` (and ``version``) inside."""

    cache: DeviceCacheHandle
    version: int | None = None
    paused: dict[str, Any] = field(default_factory=dict)  # PAUSE result
    detached: dict[str, Any] = field(default_factory=dict)  # DETACH result
    attached: dict[str, Any] = field(default_factory=dict)  # ATTACH result, after the block


class RunnerClient:
    """Attach/detach calls for one model runner and its local daemon."""

    def __init__(
        self,
        endpoint: str,
        *,
        name: str = "runner",
        timeout_s: float = 60.0,
        server_key: str | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | None = None,
    ) -> None:
        """``server_key`` (the daemon's public key file) and ``client_key`` (this client's
        secret key file) for a daemon that serves tcp with CURVE."""
        curve = client_keys_or_none(server_key, client_key)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.link = Link(self.ctx, endpoint, curve=curve)
        self.timeout_s = timeout_s
        # The weights version this runner's model runs, as far as this client knows (it set
        # it): sent with every attach, so a restarted daemon gets it back. None: never set.
        self.weights_version: int | None = None
        self._next = 0
        hello = Hello(
            req_id=self._req_id(),
            protocol=[PROTOCOL_MAJOR, PROTOCOL_MINOR],
            client=name,
            role="runner",
            pid=os.getpid(),
        )
        try:
            outcome = self.link.call(hello, timeout_s)
            check_ok(outcome)
        except BaseException:
            self.close()
            raise
        self.link.remember_hello(outcome)

    def _req_id(self) -> int:
        self._next += 1
        return self._next

    @property
    def daemon_info(self) -> dict[str, Any]:
        return self.link.info

    def attach(
        self, cache: DeviceCacheHandle, weights_version: int | None = None, supersede: bool = False
    ) -> dict[str, Any]:
        """Attaches ``cache``; the daemon's weights version becomes ``weights_version`` (default:
        the version this client last set, if any) in the same step. A cache with an
        ``exposed()`` context (a ShmSegment-backed one) has a name only for the duration of
        this call. ``supersede`` (protocol 1.2): replace an attached runner of the same user
        that is gone or orphaned (docs/protocol.md §7.15)."""
        version = self.weights_version if weights_version is None else weights_version
        if version is not None and not self._speaks(1, 2):  # a 1.1 daemon: a SET_WEIGHTS right after
            result = self._attach(cache, None, supersede)
            self.set_weights(version)
            return result
        return self._attach(cache, version, supersede)

    def _attach(self, cache: DeviceCacheHandle, weights_version: int | None, supersede: bool) -> dict[str, Any]:
        exposed = getattr(cache, "exposed", None)
        with exposed() if callable(exposed) else nullcontext():
            cmd = Attach(
                req_id=self._req_id(), layout=cache.layout.to_wire(), device=cache.device_handle(), pid=os.getpid(),
                weights_version=weights_version, supersede=supersede,
            )  # fmt: skip
            return check_ok(self.link.call(cmd, self.timeout_s))

    def _speaks(self, major: int, minor: int) -> bool:
        protocol = self.daemon_info.get("protocol") or [PROTOCOL_MAJOR, 0]
        return bool(protocol[0] == major and protocol[1] >= minor)

    def detach(self, drain_timeout_s: float | None = None) -> dict[str, Any]:
        """Returns once the daemon has closed every import: the memory may be freed then."""
        return check_ok(self.link.call(Detach(req_id=self._req_id(), drain_timeout_s=drain_timeout_s), self.timeout_s))

    def status(self) -> dict[str, Any]:
        return check_ok(self.link.call(Status(req_id=self._req_id()), self.timeout_s))

    @contextmanager
    def attached(self, cache: DeviceCacheHandle, reattach: bool = False) -> Iterator[dict[str, Any]]:
        """Attached for the block; with ``reattach``, attached again by itself after a daemon
        restart (client.reattach.Reattacher), until the block ends."""
        info = self.attach(cache)
        keeper = None
        if reattach:
            keeper = Reattacher(self.link.endpoint, cache, self.link.boot_id, lambda: self.weights_version)
        try:
            yield info
        finally:
            if keeper is not None:
                keeper.stop()
            self.detach()

    def pause(self, drain_timeout_s: float | None = None) -> dict[str, Any]:
        """Copies are refused (PAUSED) from now on; returns once those running are done."""
        cmd = Pause(req_id=self._req_id(), drain_timeout_s=drain_timeout_s)
        return check_ok(self.link.call(cmd, self.timeout_s))

    def resume(self) -> dict[str, Any]:
        return check_ok(self.link.call(Resume(req_id=self._req_id()), self.timeout_s))

    def set_weights(self, version: int) -> dict[str, Any]:
        """Host blocks written before are no longer served (STALE_WEIGHTS); storage names move on.
        The version is remembered first, so even when this call fails, the next attach sets it."""
        self.weights_version = version
        return check_ok(self.link.call(SetWeights(req_id=self._req_id(), version=version), self.timeout_s))

    @contextmanager
    def weight_update(self, cache: DeviceCacheHandle, version: int | None = None) -> Iterator[WeightUpdate]:
        """An RL weight update: pause -> detach -> (the block frees, reloads and reallocates;
        set ``update.cache`` to the new cache, whose ``num_blocks`` may differ) -> set the
        weights version -> attach -> resume.

        Every step is one call bounded by this client's timeout, and nothing waits on a flag:
        a daemon that dies or stalls makes the step raise ClientError, never hang. If the
        block (or the detach) raises, the daemon is resumed (best effort) with the cache left
        detached, and the error propagates. If a step after the block fails, it raises
        WeightUpdateError and leaves the daemon paused, so no copy can mix KV of two versions:
        an attach the daemon refuses (a cache of another layout) leaves it paused and detached
        at the new version; attach a cache it accepts, then resume."""
        update = WeightUpdate(cache, version)
        update.paused = self.pause()
        try:
            update.detached = self.detach()
            yield update
        except BaseException:
            with suppress(ClientError):
                self.resume()
            raise
        self._finish_update(update)

    def _finish_update(self, update: WeightUpdate) -> None:
        """set weights -> attach -> resume; a failed step says where it left the daemon."""
        target = "its weights version" if update.version is None else f"weights version {update.version}"
        with _step("set_weights", "the daemon is paused and detached (or down); attach the new cache (the attach "
                   "carries the version), then resume"):  # fmt: skip
            if update.version is not None:
                self.set_weights(update.version)
        with _step("attach", f"the daemon is paused and detached at {target}: attach a cache it accepts, then "
                   "resume (runner.attach(cache); runner.resume()); a cache of another layout needs a daemon "
                   "restart first"):  # fmt: skip
            update.attached = self.attach(update.cache)
        with _step("resume", f"the cache is attached at {target} but the daemon may still be paused: resume it "
                   "(runner.resume())"):  # fmt: skip
            self.resume()

    @contextmanager
    def released(self, cache: DeviceCacheHandle) -> Iterator[None]:
        """Detach for a weight update or sleep, re-attach after (the cache may be reallocated
        inside the block as long as its layout stays the same: pass the new cache to attach)."""
        self.detach()
        yield
        self.attach(cache)

    def close(self) -> None:
        self.link.close()
        self.ctx.term()

    def __enter__(self) -> RunnerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
