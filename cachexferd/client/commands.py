"""The engine clients' command methods, written once for the sync and asyncio clients.

Every asynchronous command type (``Command.ASYNC`` in the protocol) has one method here;
a test checks that none is missing. ``submit`` is the client's own: the sync client returns
the req_id (the outcome arrives through ``poll()``), the asyncio client a future of the
aggregated Completion (so ``await client.swap_out(...)`` works).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ..protocol import MsgType

R = TypeVar("R")
Fields = dict[str, Any] | Callable[[int], dict[str, Any]]  # same for all ranks, or per rank
Keys = Fields | Sequence[str]


class CommandMethods(Generic[R]):
    def submit(self, op: MsgType, fields: Fields, timeout_s: float | None = None) -> R:
        raise NotImplementedError

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int], timeout_s: float | None = None) -> R:
        """Device blocks -> host blocks, pairwise."""
        return self.submit(MsgType.SWAP_OUT, {"device_ids": list(device_ids), "host_ids": list(host_ids)}, timeout_s)

    def swap_in(self, device_ids: Sequence[int], host_ids: Sequence[int], timeout_s: float | None = None) -> R:
        """Host blocks -> device blocks, pairwise."""
        return self.submit(MsgType.SWAP_IN, {"device_ids": list(device_ids), "host_ids": list(host_ids)}, timeout_s)

    def clear_host(self, timeout_s: float | None = None) -> R:
        return self.submit(MsgType.CLEAR_HOST, {}, timeout_s)

    def store(self, keys: Keys, host_ids: Sequence[int], device_ids: Sequence[int] | None = None,
              timeout_s: float | None = None, parent: str | None = None,
              tags: Sequence[bytes] | None = None) -> R:  # fmt: skip
        """Host blocks (staged from ``device_ids`` when given) -> storage objects by key, one
        chain head first. ``parent``: the key before ``keys[0]`` when this extends a chain
        stored earlier; ``tags``: one per key, recorded in the storage journal (protocol 1.4).
        Per-rank ``keys`` callables put both in their map instead."""
        fields = _storage_fields(keys, host_ids, device_ids)
        extra = {k: v for k, v in (("parent", parent), ("tags", None if tags is None else list(tags))) if v is not None}
        if extra:
            if not isinstance(fields, dict):
                raise ValueError("with per-rank keys, give each rank's parent and tags in its map")
            fields.update(extra)
        return self.submit(MsgType.STORE, fields, timeout_s)

    def load(self, keys: Keys, host_ids: Sequence[int], device_ids: Sequence[int] | None = None,
             timeout_s: float | None = None) -> R:  # fmt: skip
        """Storage objects -> host blocks (-> ``device_ids`` when given); reports the delivered prefix."""
        return self.submit(MsgType.LOAD, _storage_fields(keys, host_ids, device_ids), timeout_s)

    def lookup(self, keys: Keys, timeout_s: float | None = None) -> R:
        return self.submit(MsgType.LOOKUP, _keys_only(keys), timeout_s)

    def delete(self, keys: Keys, timeout_s: float | None = None) -> R:
        return self.submit(MsgType.DELETE, _keys_only(keys), timeout_s)


def _keys_only(keys: Keys) -> Fields:
    if callable(keys):
        return keys
    return {"keys": list(keys)}


def _storage_fields(keys: Keys, host_ids: Sequence[int], device_ids: Sequence[int] | None) -> Fields:
    base = {"host_ids": list(host_ids), "device_ids": None if device_ids is None else list(device_ids)}
    if callable(keys):
        per_rank = keys
        return lambda rank: {**per_rank(rank), **base}
    return {"keys": list(keys), **base}
