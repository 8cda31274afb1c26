"""Worker side: moves vLLM's KV blocks through this rank's daemon.

Each store or load job becomes one or more asynchronous daemon commands (SWAP_OUT,
SWAP_IN, STORE, LOAD) sent on one EngineClient; their completions are drained by
``poll()`` when vLLM asks for finished jobs, once per step, with no thread of our own.

vLLM asserts that every transfer succeeds, so this worker always reports success and
keeps what failed on the side: the connector hands failed loads' GPU blocks to vLLM's
recompute path and failed offload keys to the manager, which forgets them.

A host block is only read back while the daemon that wrote it is still the one we talk
to: the worker remembers the boot id under which each host block was written, and fails a
load of a block written by an earlier boot (a restarted daemon has lost its host cache).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, OffloadKey, TransferResult

from ...client import EngineClient
from ...client.pending import Completion
from ...protocol import MsgType
from .connection import CONNECTION_ERRORS, DaemonConnection
from .keys import VllmKeyNames
from .transfer_specs import HostLoadSpec, HostStoreSpec

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log


@dataclass
class _Job:
    job_id: int
    is_load: bool
    keys: list[OffloadKey]
    device_ids: list[int]
    started: float = field(default_factory=time.monotonic)
    parts: int = 0  # daemon commands not yet completed
    failed: bool = False
    nbytes: int = 0


@dataclass
class _Part:
    job: _Job | None  # None: a storage write no job waits for
    op: MsgType
    device_ids: list[int]
    host_ids: list[int]
    keys: list[OffloadKey]


class FailureLog:
    """Warns about failed transfers at most every ``interval_s``, with counts in between."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last = 0.0
        self._suppressed = 0

    def warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        log.warning("cachexferd: " + message + more, *args)
        self._last, self._suppressed = now, 0


class CachexferdWorker(OffloadingWorker):
    def __init__(self, conn: DaemonConnection, names: VllmKeyNames, rank: int, timeout_s: float) -> None:
        self.conn = conn
        self.names = names
        self.rank = rank
        self.timeout_s = timeout_s
        self._parts: dict[int, _Part] = {}  # daemon req_id -> part
        self._jobs: dict[int, _Job] = {}  # vLLM job_id -> job in flight
        self._finished: list[TransferResult] = []
        self._host_boot: dict[int, str] = {}  # host block -> boot id of the daemon that wrote it
        self.invalid_block_ids: set[int] = set()  # GPU blocks whose load failed (for recompute)
        self.failed_keys: list[OffloadKey] = []  # offload keys that are not where the manager thinks
        self.stats = {"stores": 0, "loads": 0, "failed_stores": 0, "failed_loads": 0, "bytes": 0}
        self._failures = FailureLog()

    # Submission ------------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, HostStoreSpec)
        job = _Job(job_id, False, dst_spec.keys, [int(b) for b in src_spec.block_ids])
        self._jobs[job_id] = job
        if len(job.device_ids) != len(dst_spec.host_ids):
            return self._fail_now(job, f"store of {len(job.device_ids)} GPU blocks into {len(dst_spec.host_ids)}")
        client = self._client()
        if client is None:
            return self._fail_now(job, "daemon not connected")
        if dst_spec.evicted_keys:
            # Same DEALER, sent first: the daemon reads these host blocks before the swap-out
            # below may overwrite them (write-after-read keeps receive order).
            rid = client.store(self.names.keys(dst_spec.evicted_keys, self.rank), dst_spec.evicted_host_ids)
            self._parts[rid] = _Part(None, MsgType.STORE, [], dst_spec.evicted_host_ids, dst_spec.evicted_keys)
        self._add_part(job, client.swap_out(job.device_ids, dst_spec.host_ids),
                       MsgType.SWAP_OUT, job.device_ids, dst_spec.host_ids)  # fmt: skip
        if dst_spec.write_through:
            rid = client.store(self.names.keys(dst_spec.keys, self.rank), dst_spec.host_ids)
            self._parts[rid] = _Part(None, MsgType.STORE, [], dst_spec.host_ids, dst_spec.keys)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HostLoadSpec)
        job = _Job(job_id, True, src_spec.keys, [int(b) for b in dst_spec.block_ids])
        self._jobs[job_id] = job
        if len(job.device_ids) != len(src_spec.host_ids):
            return self._fail_now(job, f"load of {len(src_spec.host_ids)} blocks into {len(job.device_ids)} GPU blocks")
        if any(h < 0 for h in src_spec.host_ids):
            return self._fail_now(job, "the manager could not place every block")
        client = self._client()
        if client is None:
            return self._fail_now(job, "daemon not connected")
        boot = self.conn.boot_ids[0]
        stale = [
            h for h, s, by in zip(src_spec.host_ids, src_spec.from_storage, src_spec.written_by)
            if not s and self._host_boot.get(h) != boot and (by is None or by[self.rank] != boot)
        ]  # fmt: skip
        if stale:
            return self._fail_now(job, f"{len(stale)} host blocks were written before the daemon restarted")
        swap = [(d, h, k) for d, h, k, s in zip(job.device_ids, src_spec.host_ids, src_spec.keys, src_spec.from_storage)
                if not s]  # fmt: skip
        load = [(d, h, k) for d, h, k, s in zip(job.device_ids, src_spec.host_ids, src_spec.keys, src_spec.from_storage)
                if s]  # fmt: skip
        if swap:
            d, h, k = (list(x) for x in zip(*swap))
            self._add_part(job, client.swap_in(d, h), MsgType.SWAP_IN, d, h, k)
        if load:
            d, h, k = (list(x) for x in zip(*load))
            self._add_part(job, client.load(self.names.keys(k, self.rank), h, d), MsgType.LOAD, d, h, k)
        if job.parts == 0:
            self._finish(job)
        return True

    def _client(self) -> EngineClient | None:
        if self.conn.client is None:
            self._check_connection()
        return self.conn.client

    def _add_part(
        self, job: _Job, rid: int, op: MsgType, device_ids: list[int], host_ids: list[int],
        keys: list[OffloadKey] | None = None,
    ) -> None:  # fmt: skip
        job.parts += 1
        self._parts[rid] = _Part(job, op, device_ids, host_ids, keys if keys is not None else job.keys)

    # Completions -------------------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        self._check_connection()
        if self.conn.client is not None:
            self._file(self.conn.client.poll())
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until those jobs finished (or failed: at most ``timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s
        while any(j in self._jobs for j in job_ids):
            if self.conn.client is None or time.monotonic() > deadline:
                self._fail_all("daemon did not finish transfers vLLM waits for")
                break
            self._file(self.conn.client.poll(timeout_ms=20))

    def _check_connection(self) -> None:
        reason = self.conn.tick()
        if reason is not None:
            self._fail_all(reason)

    def _file(self, completions: list[Completion]) -> None:
        for done in completions:
            part = self._parts.pop(done.req_id, None)
            if part is None:
                continue
            if not done.ok and any(code in CONNECTION_ERRORS for code in self._codes(done)):
                self._fail_part(part, done.describe())
                self.conn.lose(done.describe())
                self._fail_all("connection lost")
                return
            self._complete_part(part, done)

    @staticmethod
    def _codes(done: Completion) -> list[int]:
        return [o.code for o in done.outcomes.values()]

    def _complete_part(self, part: _Part, done: Completion) -> None:
        if log.isEnabledFor(logging.DEBUG) and done.ok:
            result = done.result()
            run_s = float(result.get("finished_at", 0.0)) - float(result.get("started_at", 0.0))
            log.debug("cachexferd: %s of %d blocks: %.1f ms from submit to completion, %.1f ms copying",
                      done.op.name, len(part.host_ids), done.latency_s * 1000, run_s * 1000)  # fmt: skip
        boot = self.conn.boot_ids[0] if self.conn.boot_ids else ""
        delivered = len(part.host_ids) if done.ok else 0
        if done.ok and part.op is MsgType.LOAD:
            delivered = done.min_result("loaded")
        if part.op in (MsgType.SWAP_OUT, MsgType.LOAD):
            for h in part.host_ids[:delivered]:
                self._host_boot[h] = boot
        if part.job is None:  # a storage write: a failure only means a later storage miss
            if not done.ok or done.min_result("stored") < len(part.keys):
                self._failures.warn("storage write of %d blocks incomplete: %s", len(part.keys), done.describe())
            return
        if delivered < len(part.host_ids):
            self._fail_part(part, done.describe() if not done.ok else f"storage delivered {delivered}/{len(part.keys)}",
                            start=delivered)  # fmt: skip
        else:
            part.job.nbytes += int(done.result().get("bytes", 0))
        part.job.parts -= 1
        if part.job.parts == 0:
            self._finish(part.job)

    def _fail_part(self, part: _Part, why: str, start: int = 0) -> None:
        if part.job is None:
            return
        part.job.failed = True
        if part.job.is_load:
            self.invalid_block_ids.update(part.device_ids[start:])
        self.failed_keys.extend(part.keys[start:])
        kind = "load" if part.job.is_load else "store"
        self._failures.warn("%s job %d failed (%s); vLLM recomputes what it needed", kind, part.job.job_id, why)

    def _fail_now(self, job: _Job, why: str) -> bool:
        self._fail_part(_Part(job, MsgType.SWAP_IN if job.is_load else MsgType.SWAP_OUT, job.device_ids, [], job.keys),
                        why)  # fmt: skip
        self._finish(job)
        return True  # vLLM asserts on False; the failure travels on the side

    def _fail_all(self, why: str) -> None:
        for part in list(self._parts.values()):
            if part.job is not None and part.job.job_id in self._jobs:
                self._fail_part(part, why)
        self._parts.clear()
        for job in list(self._jobs.values()):
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        if self._jobs.pop(job.job_id, None) is None:
            return
        kind = "loads" if job.is_load else "stores"
        self.stats[kind] += 1
        if job.failed:
            self.stats["failed_" + kind] += 1
        self.stats["bytes"] += job.nbytes
        self._finished.append(
            TransferResult(job.job_id, success=True, transfer_size=job.nbytes or None,
                           transfer_time=(time.monotonic() - job.started) if job.nbytes else None)
        )  # fmt: skip

    # Side channel for the connector ----------------------------------------------------------

    def take_invalid_block_ids(self) -> set[int]:
        out, self.invalid_block_ids = self.invalid_block_ids, set()
        return out

    def take_failed_keys(self) -> list[OffloadKey]:
        out, self.failed_keys = self.failed_keys, []
        return out

    def shutdown(self) -> None:
        self._fail_all("shutting down")
        self.conn.close()
        log.info("cachexferd: worker rank %d done: %s", self.rank, self.stats)
