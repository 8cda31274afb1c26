"""Host blocks an earlier vLLM (or another one) left in the daemons' host caches.

A daemon that speaks protocol 1.3 knows the identity key of every host block written with
one: the storage key of its KV, which names the model, weights version, layout, KV-cache
group, rank and token prefix (keys.py). When the manager builds its index (first connection,
a restarted daemon, a cleared host cache) it reads every rank's keys (HOST_KEYS, page by page)
on a thread of its own, so vLLM's scheduler never waits, and adopts the blocks that every
rank holds at the same host id under this instance's names for the same block. Reads of
them name their keys, never our owner token: the daemon refuses a block rewritten since
(HOST_BLOCK_CHANGED), and the load is recomputed, so a stale listing costs a miss, never
wrong KV.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from ...client.link import ClientError, Link, check_ok
from ...protocol import HostKeys
from ...storage.keys import HASH_BYTES
from .keys import VllmKeyNames

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log

Found = tuple[list[bytes], list[int]]  # (digests, host ids)


def speaks_keys(hellos: Sequence[dict[str, Any]]) -> bool:
    """Whether every daemon said (hello ``protocol``) it keeps host blocks' identity keys."""
    return bool(hellos) and all(tuple(h.get("protocol") or (1, 0)) >= (1, 3) for h in hellos)


def adoptable(names: VllmKeyNames, by_rank: dict[int, dict[int, str]]) -> Found:
    """The blocks every rank holds at the same host id under our name for the same block."""
    if not by_rank or set(by_rank) != set(range(len(by_rank))):
        return [], []
    hex_len = 2 * HASH_BYTES
    prefixes = {g: names.digest_key(bytes(HASH_BYTES), g, 0)[:-hex_len] for g in names.spaces}
    digests: list[bytes] = []
    host_ids: list[int] = []
    for host, key in by_rank[0].items():
        found = _parse(key, prefixes, hex_len)
        if found is None:
            continue
        group, digest = found
        if all(by_rank[r].get(host) == names.digest_key(digest, group, r) for r in range(1, len(by_rank))):
            digests.append(digest)
            host_ids.append(host)
    return digests, host_ids


def _parse(key: str, prefixes: dict[int, str], hex_len: int) -> tuple[int, bytes] | None:
    for group, prefix in prefixes.items():
        if key.startswith(prefix) and len(key) == len(prefix) + hex_len:
            try:
                return group, bytes.fromhex(key[len(prefix) :])
            except ValueError:
                return None
    return None


class HostKeysFetch:
    """Reads every daemon's HOST_KEYS pages on a thread of its own; ``result`` once ``done``:
    the adoptable blocks, or None when a daemon did not answer, restarted (``boot_ids``) or
    changed its host cache (generation, weights version) while being read."""

    def __init__(
        self, names: VllmKeyNames, endpoints: Sequence[str], boot_ids: Sequence[str], timeout_s: float
    ) -> None:
        self.names = names
        self.endpoints, self.boot_ids, self.timeout_s = list(endpoints), list(boot_ids), timeout_s
        self.result: Found | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachexferd-host-keys", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            by_rank: dict[int, dict[int, str]] = {}
            for endpoint, boot_id in zip(self.endpoints, self.boot_ids):
                rank, keys = self._read(endpoint, boot_id)
                by_rank[rank] = keys
            self.result = adoptable(self.names, by_rank)
        except (ClientError, zmq.ZMQError, _Changed) as exc:
            log.info("cachexferd: host blocks of an earlier instance not read: %s", exc)
        except Exception:  # a bug here must not take the scheduler down
            log.exception("cachexferd: reading the host blocks' keys failed")
        finally:
            self.done.set()

    def _read(self, endpoint: str, boot_id: str) -> tuple[int, dict[int, str]]:
        ctx: zmq.Context[Any] = zmq.Context()
        link = Link(ctx, endpoint)
        keys: dict[int, str] = {}
        state: tuple[Any, ...] | None = None
        rank, start, req_id = 0, 0, 0
        try:
            while True:
                req_id += 1
                outcome = link.call(HostKeys(req_id=req_id, start=start), self.timeout_s)
                page = check_ok(outcome)
                now = (outcome.boot_id, page["host_generation"], page["weights_version"])
                if outcome.boot_id != boot_id or (state is not None and now != state):
                    raise _Changed(f"daemon {endpoint} changed while its host keys were read")
                state, rank = now, outcome.rank
                keys.update(zip(page["host_ids"], page["keys"]))
                if page["next"] is None:
                    return rank, keys
                start = int(page["next"])
        finally:
            link.close()
            ctx.term()


class _Changed(RuntimeError):
    pass
