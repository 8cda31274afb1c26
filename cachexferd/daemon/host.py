"""The daemon's view of its host cache: the pool plus the block geometry once it is known.

The geometry (bytes per host block, hence the number of blocks) comes from
``host_cache.block_bytes`` or from the first successful attach, and then stays for the daemon's life;
a later attach must describe blocks of the same size and the same layout fingerprint, so
host blocks written under one layout are never read back under another.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

from ..host_cache import HostGeometry, HostPool
from ..protocol import ErrorCode, KVLayout, ProtocolError


class HostCache:
    """Also remembers, per host block, the weights version it was written under and (protocol
    1.2) the owner token of the command that wrote it. A block is stamped when the command
    that writes it is accepted (arrival order is the order of effect); a command that would
    read it under another version is refused (STALE_WEIGHTS), and one that names an owner
    is refused unless the block still carries that owner (HOST_BLOCK_CHANGED).

    ``generation`` counts CLEAR_HOSTs: every client can see (HELLO, PING, STATUS) that the
    whole host cache was given up since it last looked."""

    def __init__(self, pool: HostPool, block_bytes: int) -> None:
        self.pool = pool
        self.geometry: HostGeometry | None = None
        self.fingerprint: str | None = None
        self.weights_version = 0
        self.generation = 0
        self._versions = array("q")  # per host block
        self.owners = OwnerStamps()
        self.keys = IdentityKeys()  # protocol 1.3
        if block_bytes:
            if block_bytes > pool.capacity:
                raise ValueError(f"host_cache.block_bytes {block_bytes} exceeds capacity {pool.capacity}")
            self._set_geometry(pool.geometry(block_bytes))

    def _set_geometry(self, geometry: HostGeometry) -> None:
        self.geometry = geometry
        self._versions = array("q", [self.weights_version]) * geometry.num_blocks
        self.owners.resize(geometry.num_blocks)
        self.keys.resize(geometry.num_blocks)

    def stamp(self, host_ids: Sequence[int], owner: str | None = None) -> int:
        """These blocks are about to hold KV computed under the current weights, written by
        ``owner`` (None: by nobody in particular). They lose their identity keys until the
        write succeeds: returns the write's serial for ``IdentityKeys.settle``."""
        version, versions = self.weights_version, self._versions
        for h in host_ids:
            versions[h] = version
        self.owners.stamp(host_ids, owner)
        return self.keys.begin(host_ids)

    def check_current(
        self, host_ids: Sequence[int], owner: str | None = None, keys: Sequence[str] | None = None
    ) -> None:
        """STALE_WEIGHTS unless every block was written under the current weights version;
        with ``owner``, HOST_BLOCK_CHANGED unless every block was last written by it; with
        ``keys``, unless every block carries its key."""
        version, versions = self.weights_version, self._versions
        for h in host_ids:
            if versions[h] != version:
                raise ProtocolError(
                    ErrorCode.STALE_WEIGHTS,
                    f"host block {h} holds KV of weights version {versions[h]}; the daemon is at {version}",
                )
        if owner is not None:
            self.owners.check(host_ids, owner)
        if keys is not None:
            self.keys.check(host_ids, keys)

    def set_weights(self, version: int) -> None:
        """A new weights version: no block holds KV of it, so none keeps its identity key."""
        if version != self.weights_version:
            self.keys.clear()
        self.weights_version = version

    def clear(self) -> int:
        """CLEAR_HOST was accepted: no block belongs to anyone any more. Returns the new generation."""
        self.generation += 1
        self.owners.clear()
        self.keys.clear()
        return self.generation

    def plan(self, layout: KVLayout) -> HostGeometry:
        """The geometry ``layout`` would use, checked against what the cache holds; binds nothing."""
        need = layout.host_block_bytes
        if self.geometry is not None and self.geometry.block_bytes != need:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"layout needs {need} bytes per host block; the host cache uses {self.geometry.block_bytes}",
            )
        if self.fingerprint is not None and self.fingerprint != layout.fingerprint():
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"host cache holds blocks of layout {self.fingerprint}, not {layout.fingerprint()}; "
                "restart the daemon to change models",
            )
        if need > self.pool.capacity:
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH, f"one host block of {need} bytes exceeds capacity {self.pool.capacity}"
            )
        return self.geometry or self.pool.geometry(need)

    def commit(self, layout: KVLayout, geometry: HostGeometry) -> None:
        """Binds the geometry and layout after a successful attach."""
        if self.geometry is None:
            self._set_geometry(geometry)
        self.fingerprint = layout.fingerprint()

    def require_geometry(self) -> HostGeometry:
        if self.geometry is None:
            raise ProtocolError(
                ErrorCode.NOT_ATTACHED, "host block size is unknown until the first attach (or host_cache.block_bytes)"
            )
        return self.geometry

    def describe(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "capacity_bytes": self.pool.capacity,
            "ready_bytes": self.pool.ready_bytes,
            "pinned": self.pool.pinned,
            "block_bytes": g.block_bytes if g else 0,
            "num_blocks": g.num_blocks if g else 0,
            "fingerprint": self.fingerprint,
            "weights_version": self.weights_version,
            "generation": self.generation,
        }


class OwnerStamps:
    """The owner token of every host block, as a small int per block (0: no owner).

    Tokens are numbered as they first appear; when the table is full it starts over, and
    every block loses its owner (a later read that names one is refused, never wrongly served)."""

    MAX_OWNERS = 4096

    def __init__(self) -> None:
        self._stamps = array("H")
        self._ids: dict[str, int] = {}

    def resize(self, num_blocks: int) -> None:
        self._stamps = array("H", [0]) * num_blocks

    def _id(self, owner: str) -> int:
        found = self._ids.get(owner)
        if found is not None:
            return found
        if len(self._ids) >= self.MAX_OWNERS:
            self.clear()
        self._ids[owner] = len(self._ids) + 1
        return self._ids[owner]

    def stamp(self, host_ids: Sequence[int], owner: str | None) -> None:
        stamp, stamps = (0 if owner is None else self._id(owner)), self._stamps
        for h in host_ids:
            stamps[h] = stamp

    def check(self, host_ids: Sequence[int], owner: str) -> None:
        want, stamps = self._ids.get(owner), self._stamps
        for h in host_ids:
            if want is None or stamps[h] != want:
                raise ProtocolError(
                    ErrorCode.HOST_BLOCK_CHANGED,
                    f"host block {h} was rewritten or cleared since owner {owner!r} wrote it",
                )

    def clear(self) -> None:
        self._ids.clear()
        self._stamps = array("H", [0]) * len(self._stamps)


class IdentityKeys:
    """The identity key of every host block (protocol 1.3): the storage key of the KV it
    holds, as the client that wrote it named it. Two equal keys name the same KV (model,
    weights, layout, group and tokens), so a block may be read by any client that names
    its key, not only by its writer.

    A block carries a key only once the write that named it has succeeded: every accepted
    write takes the block's key away at once (``begin``, in arrival order) and hands back a
    serial; ``settle`` then sets the keys of the blocks that no later write has touched
    since. A failed, cancelled or partial write leaves its blocks without keys."""

    def __init__(self) -> None:
        self._keys: list[str | None] = []
        self._serials = array("Q")  # per block: the serial of the write that touched it last
        self._serial = 0
        self._keyed = 0  # keys set since the last clear (0: nothing to take away)

    def resize(self, num_blocks: int) -> None:
        self._keys = [None] * num_blocks
        self._serials = array("Q", [0]) * num_blocks
        self._keyed = 0

    def begin(self, host_ids: Sequence[int]) -> int:
        self._serial += 1
        serial, serials = self._serial, self._serials
        if self._keyed:
            keys = self._keys
            for h in host_ids:
                serials[h] = serial
                keys[h] = None
        else:
            for h in host_ids:
                serials[h] = serial
        return serial

    def settle(self, host_ids: Sequence[int], keys: Sequence[str], serial: int) -> None:
        """The write ``serial`` put the KV of ``keys[i]`` into ``host_ids[i]``."""
        mine, serials = self._keys, self._serials
        for h, key in zip(host_ids, keys):
            if serials[h] == serial:
                mine[h] = key
                self._keyed += 1

    def settler(self, host_ids: Sequence[int], keys: Sequence[str], serial: int) -> Callable[[], None]:
        """``settle`` for later (a copy's success)."""
        return lambda: self.settle(host_ids, keys, serial)

    def check(self, host_ids: Sequence[int], keys: Sequence[str]) -> None:
        if len(keys) != len(host_ids):
            raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"{len(keys)} keys for {len(host_ids)} host blocks")
        mine = self._keys
        for h, key in zip(host_ids, keys):
            if mine[h] != key:
                raise ProtocolError(ErrorCode.HOST_BLOCK_CHANGED, f"host block {h} does not hold the KV of key {key!r}")

    def page(self, start: int, count: int) -> tuple[list[int], list[str]]:
        """The keyed blocks among ``start .. start+count-1``: (host ids, keys)."""
        ids: list[int] = []
        keys: list[str] = []
        if self._keyed:
            for h, key in enumerate(self._keys[start : start + count], start):
                if key is not None:
                    ids.append(h)
                    keys.append(key)
        return ids, keys

    def clear(self) -> None:
        """Every key goes, and so does every pending write's claim (serials restart at 0)."""
        self.resize(len(self._keys))
