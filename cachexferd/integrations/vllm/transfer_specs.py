"""What the scheduler-side manager tells the workers (vLLM carries these to every rank).

Host block ids are the same on every rank: each rank's daemon has its own host cache cut
into the same number of blocks, and the manager allocates ids for all of them at once.
``owner`` is the owner token of the manager's index that placed the blocks (protocol 1.2:
written blocks are stamped with it, reads name it): a transfer planned by an index the
manager has since dropped can never be read back under the new one.
"""

from __future__ import annotations

from .vllm_api import LoadStoreSpec, OffloadKey


class HostStoreSpec(LoadStoreSpec):
    """Store job: copy the GPU blocks to ``host_ids`` (one per key). Before that, write each
    evicted block (``evicted_keys[i]`` in ``evicted_host_ids[i]``) to storage; with
    ``write_through``, also write the new blocks to storage once they are on the host, naming
    ``parent`` (the digest of the block before ``keys[0]`` in its chain, if any) so storage
    eviction keeps the chain's head."""

    def __init__(
        self,
        keys: list[OffloadKey],
        host_ids: list[int],
        evicted_keys: list[OffloadKey] | None = None,
        evicted_host_ids: list[int] | None = None,
        write_through: bool = False,
        owner: str = "",
        parent: bytes | None = None,
    ) -> None:
        self.keys = list(keys)
        self.owner = owner
        self.parent = parent
        self.host_ids = list(host_ids)
        self.evicted_keys = list(evicted_keys or [])
        self.evicted_host_ids = list(evicted_host_ids or [])
        self.write_through = write_through

    def __repr__(self) -> str:
        return f"HostStoreSpec(host_ids={self.host_ids}, evicted={self.evicted_host_ids})"


class HostLoadSpec(LoadStoreSpec):
    """Load job: block ``i`` comes from host block ``host_ids[i]``; where ``from_storage[i]``
    it is first read from storage into that host block (LOAD), else it is already there."""

    def __init__(
        self, req_id: str, keys: list[OffloadKey], host_ids: list[int], from_storage: list[bool], owner: str = ""
    ) -> None:
        self.req_id = req_id
        self.owner = owner
        self.keys = list(keys)
        self.host_ids = list(host_ids)
        self.from_storage = list(from_storage)

    def __repr__(self) -> str:
        return f"HostLoadSpec(req={self.req_id}, host_ids={self.host_ids}, from_storage={self.from_storage})"
