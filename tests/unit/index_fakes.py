"""An in-memory stand-in for the engine client and its daemons, for the index's unit tests.

It keeps what each device block, host block and storage object holds (a label: the block
digest the engine computed into it), executes commands in submission order when polled,
and fails the ones a test asks it to: a failed copy leaves garbage in its destinations, as
a real one may. Completions are the client's own ``Completion`` objects.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from cachexferd.client.pending import Completion
from cachexferd.protocol import ErrorCode, MsgType, Outcome

GARBAGE = b"garbage"
OPS = {"swap_out": MsgType.SWAP_OUT, "swap_in": MsgType.SWAP_IN, "store": MsgType.STORE, "load": MsgType.LOAD}
# (op, number of blocks) -> blocks that succeed (a prefix; < n fails the rest, 0 with ok=False fails all)
FailPolicy = Callable[[str, int], tuple[bool, int]]


def all_ok(op: str, n: int) -> tuple[bool, int]:
    return True, n


class FakeEngine:
    def __init__(self, gpu_blocks: int, host_blocks: int, *, ranks: int = 2, policy: FailPolicy = all_ok) -> None:
        self.device: list[bytes | None] = [None] * gpu_blocks
        self.host: list[bytes | None] = [None] * host_blocks
        self.storage: dict[str, bytes] = {}
        self.ranks = ranks
        self.policy = policy
        self.hold = False  # True: poll() completes nothing
        self.queue: list[tuple[int, str, dict[str, Any], float]] = []
        self.sent: list[tuple[str, int]] = []  # (op, blocks) per command, in order
        self._ids = itertools.count(1)

    # The EngineClient methods the index uses ---------------------------------------------

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int], timeout_s: float | None = None) -> int:
        return self._submit("swap_out", {"device_ids": list(device_ids), "host_ids": list(host_ids)})

    def swap_in(self, device_ids: Sequence[int], host_ids: Sequence[int], timeout_s: float | None = None) -> int:
        return self._submit("swap_in", {"device_ids": list(device_ids), "host_ids": list(host_ids)})

    def store(self, keys: Any, host_ids: Sequence[int], device_ids: Sequence[int] | None = None,
              timeout_s: float | None = None) -> int:  # fmt: skip
        return self._submit("store", {"keys": keys, "host_ids": list(host_ids), "device_ids": device_ids})

    def load(self, keys: Any, host_ids: Sequence[int], device_ids: Sequence[int] | None = None,
             timeout_s: float | None = None) -> int:  # fmt: skip
        return self._submit("load", {"keys": keys, "host_ids": list(host_ids), "device_ids": device_ids})

    def poll(self, timeout_ms: int = 0) -> list[Completion]:
        if self.hold:
            return []
        queue, self.queue = self.queue, []
        return [self._run(*item) for item in queue]

    # Simulation --------------------------------------------------------------------------

    def _submit(self, op: str, fields: dict[str, Any]) -> int:
        req_id = next(self._ids)
        n = len(fields["host_ids"])
        assert n > 0, "the index sent an empty command"
        if op in ("swap_out", "swap_in", "load"):
            dest = fields["host_ids"] if op == "swap_out" else fields["device_ids"]
            assert len(set(dest)) == len(dest), f"{op} with duplicate destinations"
        self.sent.append((op, n))
        self.queue.append((req_id, op, fields, time.monotonic()))
        return req_id

    def _run(self, req_id: int, op: str, fields: dict[str, Any], submitted: float) -> Completion:
        n = len(fields["host_ids"])
        ok, good = self.policy(op, n)
        if op.startswith("swap") and good < n:
            ok = False  # a swap either copies every block or fails (its result has no prefix)
        good = good if ok else 0
        result: dict[str, Any] = getattr(self, f"_{op}")(fields, good)
        completion = Completion(req_id, OPS[op], submitted=submitted, finished=time.monotonic())
        for rank in range(self.ranks):
            code = ErrorCode.OK if ok else ErrorCode.STORAGE_ERROR
            completion.outcomes[rank] = Outcome(req_id, "boot", rank, int(code), "" if ok else "injected", result)
        return completion

    def _swap_out(self, f: dict[str, Any], good: int) -> dict[str, Any]:
        for i, (d, h) in enumerate(zip(f["device_ids"], f["host_ids"])):
            self.host[h] = self.device[d] if i < good else GARBAGE
        return {"blocks": good, "bytes": 0}

    def _swap_in(self, f: dict[str, Any], good: int) -> dict[str, Any]:
        for i, (d, h) in enumerate(zip(f["device_ids"], f["host_ids"])):
            self.device[d] = self.host[h] if i < good else GARBAGE
        return {"blocks": good, "bytes": 0}

    def _store(self, f: dict[str, Any], good: int) -> dict[str, Any]:
        keys = self._keys(f["keys"])
        for i, (key, h) in enumerate(zip(keys, f["host_ids"])):
            if i < good:
                value = self.host[h]
                assert value is not None and value != GARBAGE, f"stored an unwritten host block {h}"
                self.storage[key] = value
        return {"stored": good, "failed": len(keys) - good, "bytes": 0}

    def _load(self, f: dict[str, Any], good: int) -> dict[str, Any]:
        keys = self._keys(f["keys"])
        loaded = 0
        for key in keys[:good]:
            if key not in self.storage:
                break
            loaded += 1
        for i, (key, h, d) in enumerate(zip(keys, f["host_ids"], f["device_ids"])):
            value = self.storage[key] if i < loaded else GARBAGE
            self.host[h] = value
            self.device[d] = value
        return {"loaded": loaded, "bytes": 0}

    def _keys(self, keys: Any) -> list[str]:
        """Rank 0's keys (every rank's must be present and of the same length)."""
        if not callable(keys):
            return list(keys)
        per_rank = [keys(r)["keys"] for r in range(self.ranks)]
        assert len({len(k) for k in per_rank}) == 1
        return list(per_rank[0])
