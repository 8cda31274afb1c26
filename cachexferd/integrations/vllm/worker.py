"""Worker side: moves vLLM's KV blocks through this rank's daemon.

Each store job becomes a SWAP_OUT (and, with write-through, a STORE of the same host blocks
once the SWAP_OUT has succeeded); each load job a SWAP_IN (or a LOAD with device ids for
blocks read from storage). What vLLM submits in one call (the previous step's stores, the
step's loads) reaches the daemon as one BATCH (``one_message``), as do a step's
write-through STOREs. Completions are drained by ``poll()`` when vLLM asks for finished
jobs, once per step.

Never holding vLLM up:
- a job is only sent to a daemon that is up and answering (engine/connection.py); otherwise it
  fails at once: a load is recomputed, a store skipped;
- a load (or a store vLLM waits for, ``wait``) whose daemon has answered nothing since it
  was sent is given up after ``max_stall_s``: vLLM recomputes it. A load carries that
  moment as ``not_after``: a daemon that reads it later (it was hung) refuses it, so it
  cannot land in blocks vLLM has reused since;
- a daemon that has answered since is reading its socket, if slowly (starved of CPU): the
  job is waited for, up to three times ``max_stall_s``, since it will either run or be
  refused (``not_after``); a store nobody waits for has ``transfer_timeout_s``;
- a job given up, or whose outcome is unknown (its link dropped with it in flight: the
  daemon, starved of CPU, may still run it), is reported to vLLM (which recomputes a load's
  blocks, and reuses the blocks of both) only once no copy of its GPU blocks can run any
  more: its ``not_after`` has passed and, with a daemon that copies inside the device fence,
  none is running (``_release_held``, client/fence.py). A store vLLM waits for cannot wait
  that long: the worker holds the fence until its ``not_after`` instead (``wait``).

vLLM asserts that every transfer succeeds, so this worker always reports success and keeps
what failed on the side: the connector hands failed loads' GPU blocks to vLLM's recompute
path and failed offload keys to the manager, which forgets them in every tier.

Every host block this instance writes is stamped with the owner token of the manager's
index that placed it, and every read names it (protocol 1.2): a block cleared (CLEAR_HOST),
rewritten by another client or by a store an earlier index planned, or lost with a
restarted daemon is refused by the daemon (HOST_BLOCK_CHANGED) instead of being served.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...client import EngineClient
from ...client.fence import DeviceFence
from ...client.pending import Completion
from ...protocol import MsgType
from ..engine import liveness
from ..engine.connection import OUTCOME_UNKNOWN, RESTART_ERRORS, DaemonConnection
from ..engine.failures import FailureLog
from .adoption import speaks_keys
from .journal_feed import speaks_journal
from .keys import VllmKeyNames, group_of
from .transfer_specs import HostLoadSpec, HostStoreSpec
from .vllm_api import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, OffloadKey, TransferResult

log = logging.getLogger("vllm.cachexferd")  # a child of vLLM's logger: our lines show in its log


@dataclass
class _Job:
    job_id: int
    is_load: bool
    keys: list[OffloadKey]
    device_ids: list[int]
    deadline: float  # monotonic: given up after this whatever happens
    soft: float  # monotonic: given up after this if the daemon has answered nothing since ``started``
    not_after: float  # wall clock: sent as ``not_after`` (a load: ``soft``; a store: ``deadline``)
    owner: str = ""  # the owner token of the index that planned it (protocol 1.2)
    req_id: str = ""  # vLLM's request (loads): a failed load fails this request's receive
    started: float = field(default_factory=time.monotonic)
    parts: int = 0  # daemon commands not yet completed
    failed: bool = False
    nbytes: int = 0
    given_up: str = ""  # why, once given up; held until no copy of its blocks can run (_release_held)
    unsettled: list[_Part] = field(default_factory=list)  # its parts without an outcome, when given up
    link_lost: bool = False  # given up with its link: nothing sent after it is ordered after it
    daemons: tuple[int, ...] | None = None  # the processes its commands went to (None: not known here)

    @property
    def kind(self) -> str:
        return "load" if self.is_load else "store"


@dataclass
class _Part:
    job: _Job | None  # None: a storage write no job waits for
    op: MsgType
    device_ids: list[int]
    host_ids: list[int]
    keys: list[OffloadKey]
    then_store: bool = False  # write-through: STORE the host blocks once this SWAP_OUT succeeded
    parent: bytes | None = None  # the digest of the block before keys[0] in its chain (STORE's parent)


@dataclass
class _Write:
    """A write-through STORE waiting for the next send."""

    keys: list[OffloadKey]
    host_ids: list[int]
    owner: str
    parent: bytes | None


class _GoneDaemons:
    """Which daemon processes have exited, each looked up once per step (jobs held together
    went to the same daemons): none of an exited daemon's copies can run any more (its device
    copies end with its process)."""

    def __init__(self) -> None:
        self._gone: dict[int, bool] = {}

    def all(self, pids: tuple[int, ...] | None) -> bool:
        """Whether every one of ``pids`` has exited (None: not known here, so not)."""
        if pids is None:
            return False
        for pid in pids:
            if pid not in self._gone:
                self._gone[pid] = liveness.process_state(pid) == "gone"
            if not self._gone[pid]:
                return False
        return True


@dataclass
class WorkerTimes:
    max_stall_s: float  # loads, and stores vLLM waits for
    transfer_timeout_s: float  # stores nobody waits for


class CachexferdWorker(OffloadingWorker):
    def __init__(self, conn: DaemonConnection, names: VllmKeyNames, rank: int, times: WorkerTimes, owner: str) -> None:
        self.conn = conn
        self.names = names
        self.rank = rank
        self.times = times
        self.owner = owner
        self._parts: dict[int, _Part] = {}  # daemon req_id -> part
        self._jobs: dict[int, _Job] = {}  # vLLM job_id -> job in flight
        self._finished: list[TransferResult] = []
        self._writes: list[_Write] = []  # write-through STOREs to send
        self._held: list[_Job] = []  # jobs given up whose GPU blocks a copy might still reach
        # SWAP_OUTs given up, as (GPU blocks, host blocks): scrubbed once the daemon answers (_send_scrubs)
        self._scrubs: list[tuple[list[int], list[int]]] = []
        self._fence: DeviceFence | None = None  # opened when a daemon says it fences its device copies
        self._sent_on: EngineClient | None = None  # the client the commands in flight went out on
        self.invalid_block_ids: set[int] = set()  # GPU blocks whose load failed (for recompute)
        self.failed_keys: list[OffloadKey] = []  # offload keys that are not where the manager thinks
        self.failed_load_reqs: set[str] = set()  # requests a load of which failed (for recompute)
        self.stats = {"stores": 0, "loads": 0, "failed_stores": 0, "failed_loads": 0, "given_up": 0, "bytes": 0}
        self.failures = FailureLog()
        # KV every rank holds alike (an MLA latent) has one object for all ranks: rank 0 writes
        # it, every rank reads it. Each rank still keeps its own host copy, next to its GPU.
        self.writes_storage = not names.replicated or rank == 0
        conn.on_keeper_tick.append(self._flush_failures)

    # Submission ------------------------------------------------------------------------

    @contextlib.contextmanager
    def one_message(self) -> Iterator[None]:
        """The commands submitted inside go to the daemon together, as one BATCH, at the end
        (the connector wraps each vLLM call that submits jobs): one send for the engine, and
        the daemon checks and copies disjoint swaps as a group. Blocks nest (the outermost
        one sends). A connection lost meanwhile has failed them already (its closed client
        sends nothing); a new one sends at once."""
        with self.conn.lock:
            client = self.conn.client
            with client.batch() if client is not None else contextlib.nullcontext():
                yield

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, HostStoreSpec)
        with self.conn.lock:
            job = self._new_job(job_id, False, dst_spec.keys, src_spec.block_ids, dst_spec.owner)
            if len(job.device_ids) != len(dst_spec.host_ids):
                return self._fail_now(job, f"store of {len(job.device_ids)} GPU blocks into {len(dst_spec.host_ids)}")
            client, why = self._client()
            if client is None:
                return self._fail_now(job, why)
            if dst_spec.evicted_keys:
                # Same DEALER, sent first: the daemon reads these host blocks before the swap-out
                # below may overwrite them (write-after-read keeps receive order).
                self._send_store(client, dst_spec.evicted_keys, dst_spec.evicted_host_ids, job.owner)
            fields = self._copy_fields(job, job.device_ids, dst_spec.host_ids, job.keys)
            rid = client.submit(MsgType.SWAP_OUT, fields, self._timeout(job))
            self._add_part(job, rid, _Part(job, MsgType.SWAP_OUT, job.device_ids, dst_spec.host_ids, job.keys,
                                           then_store=dst_spec.write_through and self.writes_storage,
                                           parent=dst_spec.parent))  # fmt: skip
            return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HostLoadSpec)
        with self.conn.lock:
            job = self._new_job(job_id, True, src_spec.keys, dst_spec.block_ids, src_spec.owner)
            job.req_id = src_spec.req_id
            if len(job.device_ids) != len(src_spec.host_ids):
                return self._fail_now(job, f"load of {len(src_spec.host_ids)} blocks into {len(job.device_ids)}")
            if any(h < 0 for h in src_spec.host_ids):
                return self._fail_now(job, "the manager could not place every block")
            client, why = self._client()
            if client is None:
                return self._fail_now(job, why)
            rows = list(zip(job.device_ids, src_spec.host_ids, src_spec.keys, src_spec.from_storage))
            swap = [(d, h, k) for d, h, k, from_storage in rows if not from_storage]
            load = [(d, h, k) for d, h, k, from_storage in rows if from_storage]
            if swap:
                d, h, k = (list(x) for x in zip(*swap))
                rid = client.submit(MsgType.SWAP_IN, self._copy_fields(job, d, h, k), self._timeout(job))
                self._add_part(job, rid, _Part(job, MsgType.SWAP_IN, d, h, k))
            if load:
                d, h, k = (list(x) for x in zip(*load))
                fields = {**self._copy_fields(job, d, h), "keys": self.names.keys(k, self.rank)}
                rid = client.submit(MsgType.LOAD, fields, self._timeout(job))
                self._add_part(job, rid, _Part(job, MsgType.LOAD, d, h, k))
            if job.parts == 0:
                self._finish(job)
            self.conn.nudge()  # its answer tells a slow daemon from a hung one (_expire)
            return True

    def _new_job(
        self, job_id: int, is_load: bool, keys: list[OffloadKey], block_ids: Iterable[Any], owner: str
    ) -> _Job:
        now, stall = time.monotonic(), self.times.max_stall_s
        hard = now + (3 * stall if is_load else self.times.transfer_timeout_s)
        # not_after: a load is refused if the daemon reads it (or would start its copy) after
        # we may have given up on it; a store when nobody waits for it any more (one vLLM
        # gave up on is scrubbed: _send_scrubs). On the daemon's wall clock (same host).
        not_after = time.time() + (stall if is_load else hard - now)
        device_ids = [int(b) for b in block_ids]
        job = _Job(job_id, is_load, list(keys), device_ids, hard, now + stall, not_after, owner or self.owner,
                   daemons=self.conn.daemon_pids())  # fmt: skip
        self._jobs[job_id] = job
        return job

    def _client(self) -> tuple[EngineClient | None, str]:
        """The client when the daemon can take work now, else (None, why not)."""
        self._check_connection()
        if self.conn.client is None:
            return None, "daemon not connected"
        if not self.conn.usable:
            return None, f"daemon {self.conn.verdict.value}"
        self._sent_on = self.conn.client
        return self.conn.client, ""

    def _check_connection(self) -> None:
        """Gives up every job when the connection their commands went out on was lost, seen
        by this thread's ``tick`` or already by the connection's keeper thread (their
        outcomes will never come: that client is closed)."""
        reason = self.conn.tick()
        if reason is None and self._parts and self._sent_on is not None and self.conn.client is not self._sent_on:
            reason = self.conn.last_loss or "connection lost"
        if reason is not None:
            self._fail_all(reason)
            self._sent_on = None

    def _copy_fields(
        self, job: _Job, device_ids: list[int], host_ids: list[int], keys: list[OffloadKey] | None = None
    ) -> dict[str, object]:
        fields = {"device_ids": device_ids, "host_ids": host_ids, "owner": job.owner, "not_after": job.not_after}
        if keys is not None and speaks_keys(self.conn.hellos):
            # Protocol 1.3: swaps name each block's identity key. A SWAP_IN then reads by key
            # alone (the block may be one an earlier instance wrote: adoption.py).
            fields["keys"] = self.names.keys(keys, self.rank)
            if job.is_load:
                del fields["owner"]
        return fields

    @staticmethod
    def _timeout(job: _Job) -> float:
        return max(0.001, job.deadline - time.monotonic()) + 1.0  # the client's own bound: we give up first

    def _add_part(self, job: _Job, rid: int, part: _Part) -> None:
        job.parts += 1
        self._parts[rid] = part

    def _send_store(self, client: EngineClient, keys: list[OffloadKey], host_ids: list[int], owner: str,
                    parent: bytes | None = None) -> None:  # fmt: skip
        fields = {"keys": self.names.keys(keys, self.rank), "host_ids": host_ids, "device_ids": None,
                  "owner": owner}  # fmt: skip
        if parent is not None:  # the block before keys[0] in its chain: the same group
            fields["parent"] = self.names.digest_key(parent, group_of(keys[0]), self.rank)
        if speaks_journal(self.conn.hellos):
            # Protocol 1.4: the storage journal records each object with vLLM's name for its
            # block, so every instance sharing the store reports it in its KV events.
            fields["tags"] = [bytes(k) for k in keys]
        rid = client.submit(MsgType.STORE, fields)
        self._parts[rid] = _Part(None, MsgType.STORE, [], host_ids, keys)

    # Completions -------------------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        with self.conn.lock:
            self._check_connection()
            client = self.conn.client
            if client is not None:
                self._file(client.poll())
            self._expire(time.monotonic())
            self._release_held()
            self._send_writes()
            self.failures.flush()
            done, self._finished = self._finished, []
            return done

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until those jobs finished: at most ``max_stall_s`` for a daemon that answers
        nothing meanwhile, three times that for one that does; then they are given up."""
        with self.conn.lock:
            start = time.monotonic()
            self.conn.nudge()
            while any(j in self._jobs for j in job_ids):
                client, why = self._client()
                waited = time.monotonic() - start
                stalled = waited > self.times.max_stall_s and not self.conn.heard_since(start)
                if client is None or stalled or waited > 3 * self.times.max_stall_s:
                    why = why or f"not done after {waited:.2f}s"
                    for job_id in job_ids:
                        self._give_up(job_id, why, link_lost=client is None)
                    break
                self._file(client.poll(timeout_ms=10))
            self._hand_back({j for j in job_ids if j in self._jobs})
            self._send_writes()

    def _hand_back(self, job_ids: set[int]) -> None:
        """vLLM reuses these jobs' GPU blocks once ``wait`` returns: jobs held (given up, a
        copy of their blocks may still run) are settled now, the device fence held until
        their ``not_after`` so that none can (``DeviceFence.hold_until``). A copy running this
        very moment leaves only the older remedy: scrub their host blocks (``_send_scrubs``)."""
        jobs = [job for job in self._held if job.job_id in job_ids]
        if not jobs:
            return
        # A scrub sent on the link a job went out on is read after it; one for a job whose
        # link dropped is not (its command may still wait in the daemon's socket): the fence.
        lost = [job.not_after for job in jobs if job.link_lost]
        fence = self._open_fence() if lost else None
        fenced = fence is not None and fence.hold_until(max(lost))
        for job in jobs:
            self._settle(job, scrub=not (job.link_lost and fenced))
        self._held = [job for job in self._held if job.job_id not in job_ids]

    def _file(self, completions: list[Completion]) -> None:
        for done in completions:
            part = self._parts.pop(done.req_id, None)
            if part is None:  # given up on already (or its job failed)
                if log.isEnabledFor(logging.DEBUG):
                    _log_timeline(done, 0, late=True)
                continue
            codes = {o.code for o in done.outcomes.values()}
            if not done.ok and codes & RESTART_ERRORS:
                self._parts[done.req_id] = part  # given up with the rest of its job (_give_up)
                self.conn.lose(done.describe())
                self._fail_all(f"connection lost: {done.describe()}")
                return
            if not done.ok and codes & OUTCOME_UNKNOWN and part.job is not None:
                # The daemon may still run it (its link dropped, or we stopped waiting): a
                # job given up, held until no copy of its blocks can run (_release_held).
                self._parts[done.req_id] = part
                self._give_up(part.job.job_id, done.describe(), link_lost=True)
                continue
            self._complete_part(part, done)  # a link error fails this command only

    def _complete_part(self, part: _Part, done: Completion) -> None:
        if log.isEnabledFor(logging.DEBUG):
            _log_timeline(done, len(part.host_ids))
        if part.job is None:  # a storage write (a failure only means a later storage miss), or a scrub
            if part.op is MsgType.STORE and (not done.ok or done.min_result("stored") < len(part.keys)):
                self.failures.note("storage write", done.describe())
            return
        delivered = len(part.host_ids) if done.ok else 0
        if done.ok and part.op is MsgType.LOAD:
            delivered = done.min_result("loaded")
        if delivered < len(part.host_ids):
            why = done.describe() if not done.ok else f"storage delivered {delivered}/{len(part.keys)}"
            self._fail_part(part, why, start=delivered)
        else:
            part.job.nbytes += int(done.result().get("bytes", 0))
            if part.then_store:
                self._writes.append(_Write(part.keys, part.host_ids, part.job.owner, part.parent))
        part.job.parts -= 1
        if part.job.parts == 0:
            self._finish(part.job)

    def _send_writes(self) -> None:
        """Write-through STOREs of host blocks whose SWAP_OUT succeeded (never of one that
        failed: the host block would hold something else under these keys)."""
        writes, self._writes = self._writes, []
        client = self.conn.client
        if client is None or not self.conn.usable:
            for write in writes:
                self.failures.note("storage write", f"{len(write.keys)} blocks not written: daemon unavailable")
            return
        with self.one_message():
            for write in writes:
                self._send_store(client, write.keys, write.host_ids, write.owner, write.parent)
            self._send_scrubs(client)

    def _send_scrubs(self, client: EngineClient) -> None:
        """A store given up may still run after vLLM has reused its GPU blocks (vLLM waits for
        it only ``max_stall_s``), and the daemon would then give its host blocks the identity
        keys of KV they may hold only in part; an instance adopting host blocks (a restart)
        would trust them. A SWAP_OUT naming no keys, sent after it, leaves those host blocks
        with none: whatever it copies is never read (the manager has forgotten the keys)."""
        scrubs, self._scrubs = self._scrubs, []
        for device_ids, host_ids in scrubs:
            fields = {"device_ids": device_ids, "host_ids": host_ids, "owner": self.owner}
            self._parts[client.submit(MsgType.SWAP_OUT, fields)] = _Part(None, MsgType.SWAP_OUT, [], host_ids, [])

    # Failures -------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for job in list(self._jobs.values()):
            silent = job.soft < now and not self.conn.heard_since(job.started)
            if job.deadline < now or (job.is_load and silent):
                self._give_up(job.job_id, f"not done after {now - job.started:.2f}s")

    def _give_up(self, job_id: int, why: str, link_lost: bool = False) -> None:
        """Stops waiting for a job's outcome. It stays in flight for vLLM (a load's request
        waits, a store's blocks stay allocated) until no copy of its GPU blocks can run any
        more (``_release_held``): vLLM then recomputes a load's blocks, and reuses the blocks
        of both. A store without a fence on device reads is settled at once: its host blocks
        are scrubbed instead (a late copy only reads its GPU blocks)."""
        job = self._jobs.get(job_id)
        if job is None or job.given_up:
            return
        job.given_up, job.link_lost = why, link_lost
        for rid, part in list(self._parts.items()):
            if part.job is job:
                del self._parts[rid]
                job.unsettled.append(part)
        if job.is_load or self.conn.device_fence_reads:
            self._held.append(job)
            self._release_held()
        else:
            self._settle(job, scrub=True)

    def _release_held(self, force: bool = False) -> None:
        """Settles the given-up jobs whose GPU blocks no copy can reach any more: their
        ``not_after`` has passed (the daemon starts no copy after it) and, with a daemon that
        copies inside the device fence, none is running now (client/fence.py). Without a fence
        (a cuda daemon, whose copies run on the GPU once issued; an older daemon) the first is
        all we know. Lets copies run again once the fence was held long enough (``_hand_back``)."""
        now = time.time()
        if self._fence is not None:
            self._fence.release_if_due(now)
        if not self._held:
            return
        due = list(self._held) if force else [job for job in self._held if now > job.not_after]
        if due and not (force or self._device_quiet()):
            due = []
        settled, gone = {id(job) for job in due}, _GoneDaemons()
        due += [job for job in self._held if id(job) not in settled and gone.all(job.daemons)]
        if not due:
            return
        settled = {id(job) for job in due}
        for job in due:
            self._settle(job)
        self._held = [job for job in self._held if id(job) not in settled]

    def _device_quiet(self) -> bool:
        fence = self._open_fence()
        return True if fence is None else fence.quiet()

    def _open_fence(self) -> DeviceFence | None:
        """Our side of the device fence; None when the daemon keeps none."""
        if not self.conn.device_fence:
            return None
        if self._fence is None:
            path = getattr(self.conn.cache, "fence_path", None)
            if path is None:
                return None
            self._fence = DeviceFence(path())
        return self._fence

    def _settle(self, job: _Job, scrub: bool = False) -> None:
        """Reports a given-up job failed; ``scrub``: a copy out of its blocks may still run."""
        for part in job.unsettled:
            self._fail_part(part, job.given_up)
            if scrub and part.op is MsgType.SWAP_OUT and speaks_keys(self.conn.hellos):
                self._scrubs.append((part.device_ids, part.host_ids))
        job.unsettled = []
        self.stats["given_up"] += 1
        self._finish(job)

    def _fail_part(self, part: _Part, why: str, start: int = 0) -> None:
        if part.job is None:
            return
        part.job.failed = True
        if part.job.is_load:
            self.invalid_block_ids.update(part.device_ids[start:])
        self.failed_keys.extend(part.keys[start:])
        self.failures.note(part.job.kind, f"{part.job.kind} job {part.job.job_id}: {why}")

    def _fail_now(self, job: _Job, why: str) -> bool:
        op = MsgType.SWAP_IN if job.is_load else MsgType.SWAP_OUT
        self._fail_part(_Part(job, op, job.device_ids, [], job.keys), why)
        self._finish(job)
        return True  # vLLM asserts on False; the failure travels on the side

    def _fail_all(self, why: str, force: bool = False) -> None:
        """Gives up every job (``force``: settles held ones too at once, when nothing will reuse their blocks)."""
        for job in list(self._jobs.values()):
            self._give_up(job.job_id, why, link_lost=True)
        self._parts.clear()  # storage writes nobody waits for
        self._writes.clear()
        self._scrubs.clear()  # for a daemon that may have restarted: its host blocks are another index's now
        if force:
            self._release_held(force=True)

    def _finish(self, job: _Job) -> None:
        if self._jobs.pop(job.job_id, None) is None:
            return
        kind = "loads" if job.is_load else "stores"
        self.stats[kind] += 1
        if job.failed:
            self.stats["failed_" + kind] += 1
            if job.is_load and job.req_id:
                self.failed_load_reqs.add(job.req_id)
        self.stats["bytes"] += job.nbytes
        self._finished.append(
            TransferResult(job.job_id, success=True, transfer_size=job.nbytes or None,
                           transfer_time=(time.monotonic() - job.started) if job.nbytes else None)
        )  # fmt: skip

    def _flush_failures(self) -> None:
        with self.conn.lock:
            self.failures.flush()

    # Side channel for the connector ----------------------------------------------------------

    def take_invalid_block_ids(self) -> set[int]:
        with self.conn.lock:
            out, self.invalid_block_ids = self.invalid_block_ids, set()
            return out

    @property
    def jobs_in_flight(self) -> int:
        """vLLM jobs submitted and not yet reported finished (write-through STOREs included)."""
        with self.conn.lock:
            return len(self._jobs)

    def take_failed_load_reqs(self) -> set[str]:
        """Requests with a failed load among the jobs reported finished so far."""
        with self.conn.lock:
            out, self.failed_load_reqs = self.failed_load_reqs, set()
            return out

    def take_failed_keys(self) -> list[OffloadKey]:
        with self.conn.lock:
            out, self.failed_keys = self.failed_keys, []
            return out

    def shutdown(self, drain_s: float = 3.0) -> None:
        """Lets stores in flight finish and their write-through STOREs reach the daemon
        (at most ``drain_s``: a stored block outlives this vLLM), then lets go."""
        with self.conn.lock:
            deadline = time.monotonic() + drain_s
            while self._parts and self.conn.client is not None and time.monotonic() < deadline:
                self._file(self.conn.client.poll(timeout_ms=20))
                self._send_writes()
            self._fail_all("shutting down", force=True)  # the daemon drains its copies at our detach
            self.failures.flush(force=True)
            if self._fence is not None:
                self._fence.close()
        self.conn.close()
        log.info("cachexferd: worker rank %d done: %s", self.rank, self.stats)


def _log_timeline(done: Completion, blocks: int, late: bool = False) -> None:
    """Where a command's time went: before the daemon started it (socket, queue, a daemon
    not scheduled), copying, and after it ended until this worker read its outcome (a
    worker thread not scheduled). The daemon's times are on its monotonic clock, which on
    one Linux host is the clock of every process, this one's included."""
    result = done.result() if done.ok else {}
    started, ended = float(result.get("started_at", 0.0)), float(result.get("finished_at", 0.0))
    what = "given up, its outcome came" if late else "done"
    if not started:
        log.debug("cachexferd: %s of %d blocks %s, %s after %.1f ms", done.op.name, blocks, done.describe(), what,
                  done.latency_s * 1000)  # fmt: skip
        return
    log.debug("cachexferd: %s of %d blocks %s after %.1f ms: %.1f ms until the daemon started it, %.1f ms copying, "
              "%.1f ms until the outcome was read", done.op.name, blocks, what, done.latency_s * 1000,
              (started - done.submitted) * 1000, (ended - started) * 1000, (done.finished - ended) * 1000)  # fmt: skip
