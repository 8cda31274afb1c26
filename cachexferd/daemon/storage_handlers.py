"""STORE / LOAD / LOOKUP / DELETE: validation, the blocks and keys each command touches, and
the work (device<->host copies through the copy backend, storage I/O through the tier).

Ordering. Each command declares an Access like a swap does, so it keeps submission order
against every command touching the same blocks:
- store reads ``host_ids``; with ``device_ids`` it first copies device -> host into
  ``host_ids`` (staging), so it reads those device blocks and writes those host blocks;
- load writes ``host_ids`` (and ``device_ids``, copied host -> device for the delivered prefix);
- lookup and delete touch no blocks.
Storage keys are ordered by the same machinery (Access.keys_read / keys_write): store and
delete write their keys, load and lookup read them. So "store K" then "load K" on one daemon
reads what was stored, and "delete K" then "store K" leaves K stored, while loads and
lookups of a shared prefix run concurrently.

Weights version. A command's object names are fixed when it is read: the handler captures the
daemon's weights version at accept time and the work names its objects under it, so a
STORE read before a SET_WEIGHTS (even one that runs after it, behind a long swap or a
PAUSE) writes under the version it was read under, and a LOAD read after it never finds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..backends.base import CancelToken, Direction
from ..protocol import Delete, ErrorCode, Load, Lookup, ProtocolError, StorageEvents, Store
from . import validate
from .jobs import Job
from .ordering import Access

if TYPE_CHECKING:
    from ..backends.base import DeviceCache
    from ..metrics import DaemonMetrics
    from .device import DeviceSlot
    from .host import HostCache
    from .pausing import Pausing
    from .storage_tier import StorageTier


class StorageHandlers:
    """The handlers of the storage commands (the daemon's Handlers holds one)."""

    def __init__(
        self, device: DeviceSlot, host: HostCache, storage: StorageTier | None, metrics: DaemonMetrics, pausing: Pausing
    ) -> None:
        self.device, self.host, self.storage, self.metrics, self.pausing = device, host, storage, metrics, pausing

    def _tier(self) -> StorageTier:
        if self.storage is None:
            raise ProtocolError(ErrorCode.NO_STORAGE, "no storage backend configured (storage.backend = none)")
        return self.storage

    def _geometry(self) -> tuple[int, int, str]:
        """(host blocks, bytes per block, layout fingerprint) of the host cache."""
        geometry = self.host.require_geometry()
        fingerprint = self.host.fingerprint
        if fingerprint is None:
            raise ProtocolError(ErrorCode.NOT_ATTACHED, "the layout of host blocks is unknown until the first attach")
        return geometry.num_blocks, geometry.block_bytes, fingerprint

    def _validate(self, cmd: Store | Load, writes_keys: bool) -> tuple[int, str, DeviceCache | None, int]:
        """Checks a store/load; returns (block bytes, fingerprint, device cache or None, the
        serial of its host write or 0). Host blocks that will be written are stamped with the
        weights version (and the command's owner) and lose their identity keys until the
        write succeeds; a store of host blocks alone needs them to hold KV of the current
        version (and, when it names an owner, to be that owner's)."""
        keys, host_ids, device_ids, owner = cmd.keys, cmd.host_ids, cmd.device_ids, cmd.owner
        self.pausing.require_running()
        validate.require_in_time(cmd.not_after)
        host_blocks, block_bytes, fingerprint = self._geometry()
        validate.same_length(keys, host_ids, ("keys", "host_ids"))
        if isinstance(cmd, Store) and cmd.tags is not None:
            validate.same_length(keys, cmd.tags, ("keys", "tags"))
        validate.ids_in_range(host_ids, host_blocks, "host_ids")
        cache = None
        if device_ids is not None:
            cache = self.device.require()
            validate.same_length(keys, device_ids, ("keys", "device_ids"))
            validate.ids_in_range(device_ids, cache.layout.num_blocks, "device_ids")
            validate.unique_blocks(host_ids if writes_keys else device_ids, "host" if writes_keys else "device")
        if writes_keys:  # store: the keys are its destinations
            validate.unique_keys(keys)
        else:  # load: host blocks are its destinations
            validate.unique_blocks(host_ids, "host")
        if writes_keys and device_ids is None:
            self.host.check_current(host_ids, owner)
            return block_bytes, fingerprint, cache, 0
        return block_bytes, fingerprint, cache, self.host.stamp(host_ids, owner)

    # STORE ------------------------------------------------------------------------------

    def handle_store(self, cmd: Store) -> Job:
        tier = self._tier()
        block_bytes, fingerprint, cache, serial = self._validate(cmd, writes_keys=True)
        keys, host_ids, device_ids, parent, tags = cmd.keys, cmd.host_ids, cmd.device_ids, cmd.parent, cmd.tags
        version = self.host.weights_version  # fixed on arrival, however late the work runs

        async def work(cancel: CancelToken) -> dict[str, Any]:
            if cache is not None and device_ids:
                moved = await cache.swap(Direction.D2H, device_ids, host_ids, cancel)
                self.metrics.transfer_bytes.labels(Direction.D2H.value).inc(moved)
                cancel.check()
                self.host.keys.settle(host_ids, keys, serial)  # staged: the blocks hold these keys' KV
            return await tier.store(keys, host_ids, block_bytes, fingerprint, version, cancel, parent, tags)

        if device_ids is None:
            access = Access(host_read=frozenset(host_ids), keys_write=frozenset(keys))
        else:
            access = Access(
                device_read=frozenset(device_ids), host_write=frozenset(host_ids), keys_write=frozenset(keys)
            )
        return Job(access, work)

    # LOAD -------------------------------------------------------------------------------

    def handle_load(self, cmd: Load) -> Job:
        tier = self._tier()
        block_bytes, fingerprint, cache, serial = self._validate(cmd, writes_keys=False)
        keys, host_ids, device_ids, not_after = cmd.keys, cmd.host_ids, cmd.device_ids, cmd.not_after
        version = self.host.weights_version

        async def work(cancel: CancelToken) -> dict[str, Any]:
            loaded = await tier.load(keys, host_ids, block_bytes, fingerprint, version, cancel) if keys else 0
            self.host.keys.settle(host_ids[:loaded], keys[:loaded], serial)  # verified: they hold these keys' KV
            result: dict[str, Any] = {"loaded": loaded, "bytes": loaded * block_bytes}
            if cache is not None and device_ids and loaded:
                cancel.check()
                if not_after is not None:  # into device blocks: never started after it (1.5)
                    cancel.not_after = not_after
                moved = await cache.swap(Direction.H2D, device_ids[:loaded], host_ids[:loaded], cancel)
                self.metrics.transfer_bytes.labels(Direction.H2D.value).inc(moved)
            return result

        access = Access(
            device_write=frozenset(device_ids or ()), keys_read=frozenset(keys), host_write=frozenset(host_ids)
        )
        return Job(access, work)

    # STORAGE_EVENTS (synchronous, answered from the daemon's view of the journal) --------

    def handle_storage_events(self, identity: bytes, cmd: StorageEvents) -> dict[str, Any]:
        feed = self._tier().feed
        if feed is None:  # this backend keeps no journal: nothing to follow
            return {"journal": False, "events": [], "next": cmd.after, "reset": False, "more": False}
        return feed.page(cmd.after, cmd.max)

    # LOOKUP / DELETE ----------------------------------------------------------------------

    def handle_lookup(self, cmd: Lookup) -> Job:
        tier = self._tier()
        keys, version = cmd.keys, self.host.weights_version

        async def work(cancel: CancelToken) -> dict[str, Any]:
            return {"prefix": await tier.lookup(keys, version, cancel)}

        return Job(Access(keys_read=frozenset(keys)), work)

    def handle_delete(self, cmd: Delete) -> Job:
        tier = self._tier()
        keys, version = cmd.keys, self.host.weights_version

        async def work(cancel: CancelToken) -> dict[str, Any]:
            return {"deleted": await tier.delete(keys, version, cancel)}

        return Job(Access(keys_write=frozenset(keys)), work)
