"""The worker's bounds with a real daemon and no engine: a hang the liveness checks cannot
see (a daemon that is running but never answers), and a killed daemon. vLLM's engine is not
needed; its offloading types are (the worker speaks them)."""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.client import EngineClient
from cachexferd.client.runner import ShmKVCache
from cachexferd.integrations.engine import liveness
from cachexferd.integrations.engine.connection import DaemonConnection
from cachexferd.integrations.vllm.keys import VllmKeyNames
from cachexferd.integrations.vllm.transfer_specs import HostLoadSpec, HostStoreSpec
from cachexferd.integrations.vllm.vllm_api import GPULoadStoreSpec
from cachexferd.integrations.vllm.worker import CachexferdWorker, WorkerTimes
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import HostKeys
from cachexferd.storage.objects import HEADER_BYTES

from ..helpers import SMALL, assert_moved, assert_untouched, fill_random, snapshot
from .rig import metric, ops, start_daemon, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
STALL = 0.4
TRANSFER_TIMEOUT = 5.0  # the rig's, a store's not_after
PATIENT_STALL = 6.0  # longer than a link survives a daemon that answers nothing
NAMES = VllmKeyNames.create(model="m", weights_version="0", dtype="float16", layout="test", tokens_per_block={0: 4},
                            tp_size=1)  # fmt: skip


@pytest.fixture(scope="module")
def rig(cx_root: Path) -> Iterator[tuple[DaemonProcess, ShmKVCache, CachexferdWorker]]:
    """One daemon for the module (its start is most of the cost): the last test kills it."""
    daemon = start_daemon(cx_root, "d", cx_root / "storage")
    cache = ShmKVCache(SMALL)
    conn = DaemonConnection([daemon.endpoint], name="t", transfer_timeout_s=5, connect_timeout_s=5,
                            retry_interval_s=0.2, lost_after_s=30, slow_after_s=30, cache=cache)  # fmt: skip
    worker = CachexferdWorker(conn, NAMES, 0, WorkerTimes(STALL, TRANSFER_TIMEOUT), owner="test-owner")
    assert conn.start()
    yield daemon, cache, worker
    worker.shutdown()
    daemon.stop()
    cache.close()


def key(i: int) -> bytes:
    return bytes([i]) * 32 + (0).to_bytes(4, "big")


def gpu(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])


def finished(worker: CachexferdWorker, job_id: int, timeout_s: float, start: float | None = None) -> float:
    """Seconds from ``start`` (default: now) until vLLM would see ``job_id`` finished (polled
    like engine steps)."""
    start = time.monotonic() if start is None else start
    while time.monotonic() - start < timeout_s:
        if any(r.job_id == job_id for r in worker.get_finished()):
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} not finished in {timeout_s}s")


def test_a_hang_it_cannot_see_is_given_up_and_the_late_copy_refused(
    rig: tuple[DaemonProcess, ShmKVCache, CachexferdWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon, cache, worker = rig
    assert worker.submit_store(1, gpu([3]), HostStoreSpec([key(1)], [5]))
    finished(worker, 1, 10)
    assert not worker.take_failed_keys()
    monkeypatch.setattr(liveness, "process_state", lambda pid: "alive")  # a hang that looks alive
    target = cache.block_bytes(0, 9).clone()
    daemon.signal(signal.SIGSTOP)
    try:
        submitted = time.monotonic()  # the worker's stall clock starts inside submit_load
        assert worker.submit_load(2, HostLoadSpec("r", [key(1)], [5], [False]), gpu([9]))
        seconds = finished(worker, 2, 5, start=submitted)
        assert STALL <= seconds < STALL + 0.5, f"the load was given up after {seconds:.2f}s"
        assert worker.take_invalid_block_ids() == {9}, "vLLM must recompute the block"
        assert worker.take_failed_keys() == [key(1)], "the manager must forget the key"
        assert worker.submit_store(3, gpu([4]), HostStoreSpec([key(3)], [6], write_through=True))
        start = time.monotonic()
        worker.wait({3})
        assert time.monotonic() - start < STALL + 0.3, "wait() must give up after max_stall_s"
    finally:
        daemon.signal(signal.SIGCONT)
    wait_for(lambda: metric(daemon, "cachexferd_commands_total", op="swap_in", outcome="expired") == 1, 20,
             "the late SWAP_IN to be refused")  # fmt: skip
    assert bool((cache.block_bytes(0, 9) == target).all()), "a copy vLLM gave up on reached its block"
    # The store vLLM stopped waiting for may still copy into its host block (which the manager
    # frees), but its blocks are never written to storage under its keys.
    for _ in range(5):
        worker.get_finished()
        time.sleep(0.1)
    assert metric(daemon, "cachexferd_commands_total", op="store", outcome="ok") == 0


def test_a_load_given_up_is_held_while_a_copy_may_still_reach_its_blocks(
    rig: tuple[DaemonProcess, ShmKVCache, CachexferdWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that stops in the middle of a copy into the device blocks (it holds the device
    fence: here this test holds it for it). The load is given up, but vLLM is not told (its GPU
    blocks are not handed back for recompute and reuse) until no copy can reach them."""
    daemon, cache, worker = rig
    worker.get_finished(), worker.take_failed_keys(), worker.take_invalid_block_ids()  # earlier tests' leftovers
    assert worker.submit_store(41, gpu([7]), HostStoreSpec([key(41)], [41]))
    finished(worker, 41, 10)
    assert worker.conn.device_fence, "the daemon should say it copies into device blocks inside the fence"
    expired = metric(daemon, "cachexferd_commands_total", op="swap_in", outcome="expired")
    monkeypatch.setattr(liveness, "process_state", lambda pid: "alive")  # a hang that looks alive
    copying = os.open(cache.path, os.O_RDONLY)
    fcntl.flock(copying, fcntl.LOCK_SH)  # as the daemon's copy threads hold it
    daemon.signal(signal.SIGSTOP)
    try:
        assert worker.submit_load(42, HostLoadSpec("r", [key(41)], [41], [False]), gpu([12]))
        held_until = time.monotonic() + STALL + 0.6
        while time.monotonic() < held_until:
            done = [r.job_id for r in worker.get_finished()]
            assert 42 not in done, "a load was handed back while a copy could still reach its blocks"
            time.sleep(0.01)
        assert worker.jobs_in_flight == 1 and not worker.take_invalid_block_ids()
        fcntl.flock(copying, fcntl.LOCK_UN)  # the copy is over
        finished(worker, 42, 2)
        assert worker.take_invalid_block_ids() == {12}, "vLLM must recompute the block"
        assert worker.take_failed_keys() == [key(41)]
    finally:
        os.close(copying)
        daemon.signal(signal.SIGCONT)
    wait_for(lambda: metric(daemon, "cachexferd_commands_total", op="swap_in", outcome="expired") == expired + 1, 20,
             "the late SWAP_IN to be refused")  # fmt: skip


def keyed_host_blocks(daemon: DaemonProcess) -> dict[int, str]:
    """The daemon's host blocks that carry an identity key (protocol 1.3): host id -> key."""
    with EngineClient([daemon.endpoint]) as other:
        other.connect(timeout_s=10)
        (page,) = other.call_all(HostKeys, count=64)
    return dict(zip(page["host_ids"], page["keys"]))


def test_a_store_given_up_leaves_its_host_block_without_identity_keys(
    rig: tuple[DaemonProcess, ShmKVCache, CachexferdWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM waits for a store (it reuses the GPU blocks next) no longer than max_stall_s; a
    daemon that was hung runs the SWAP_OUT later, reading blocks vLLM may have rewritten. Its
    host block must not keep the block's identity key: an instance adopting host blocks
    after a restart would load KV that may be only partly the block's."""
    daemon, _, worker = rig
    worker.get_finished(), worker.take_failed_keys(), worker.take_invalid_block_ids()  # earlier tests' leftovers
    swap_outs = ops(daemon, "swap_out")
    monkeypatch.setattr(liveness, "process_state", lambda pid: "alive")  # a hang that looks alive
    daemon.signal(signal.SIGSTOP)
    try:
        assert worker.submit_store(51, gpu([8]), HostStoreSpec([key(51)], [51]))
        worker.wait({51})
        assert worker.take_failed_keys() == [key(51)], "the manager must forget the key"
    finally:
        daemon.signal(signal.SIGCONT)
    wait_for(lambda: ops(daemon, "swap_out") > swap_outs, 10, "the late SWAP_OUT to run")
    for _ in range(20):  # engine steps: the worker sends what it queued
        worker.get_finished()
        time.sleep(0.05)
    assert 51 not in keyed_host_blocks(daemon), "a host block a given-up store wrote kept its identity key"


def expired(daemon: DaemonProcess, op: str) -> float:
    return metric(daemon, "cachexferd_commands_total", op=op, outcome="expired")


def test_a_store_given_up_with_its_link_is_never_copied_from_blocks_vllm_reuses(
    rig: tuple[DaemonProcess, ShmKVCache, CachexferdWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon starved of CPU: its link drops (heartbeats unanswered) with a SWAP_OUT still
    queued, whose outcome is unknown. vLLM reuses the GPU block once the store is reported.
    When the daemon runs again, the SWAP_OUT must not copy the block's new contents into the
    host block under the old block's identity key: an index rebuilt after the reconnection
    (or a restarted engine) would adopt and load it. So the store is reported only once no
    copy of its block can run: after its ``not_after``, the fence free."""
    daemon, cache, worker = rig
    worker.get_finished(), worker.take_failed_keys(), worker.take_invalid_block_ids()  # earlier tests' leftovers
    wait_for(lambda: worker.conn.usable, 10, "the worker to be connected")
    late = expired(daemon, "swap_out")
    monkeypatch.setattr(liveness, "process_state", lambda pid: "alive")  # starved, not stopped
    daemon.signal(signal.SIGSTOP)
    try:
        submitted = time.monotonic()
        assert worker.submit_store(61, gpu([10]), HostStoreSpec([key(61)], [61]))
        seconds = finished(worker, 61, 20, start=submitted)
        assert seconds >= TRANSFER_TIMEOUT, f"the store was reported after {seconds:.2f}s, before its not_after"
        assert worker.take_failed_keys() == [key(61)], "the manager must forget the key"
        cache.block_bytes(0, 10).fill_(0x5A)  # vLLM reuses the block for another request
    finally:
        daemon.signal(signal.SIGCONT)
    wait_for(lambda: expired(daemon, "swap_out") == late + 1, 20, "the late SWAP_OUT to be refused")
    assert 61 not in keyed_host_blocks(daemon), "a store given up with its link copied a reused block under its key"


@pytest.fixture
def patient(cx_root: Path) -> Iterator[tuple[DaemonProcess, ShmKVCache, CachexferdWorker]]:
    """A worker that waits longer for a load (PATIENT_STALL) than its link survives a daemon
    that answers nothing (heartbeats), as the plug-in on a loaded machine is configured."""
    daemon = start_daemon(cx_root, "patient", cx_root / "patient-storage")
    cache = ShmKVCache(SMALL)
    conn = DaemonConnection([daemon.endpoint], name="p", transfer_timeout_s=PATIENT_STALL + 2, connect_timeout_s=5,
                            retry_interval_s=0.2, lost_after_s=60, slow_after_s=60, cache=cache)  # fmt: skip
    worker = CachexferdWorker(conn, NAMES, 0, WorkerTimes(PATIENT_STALL, PATIENT_STALL + 2), owner="patient")
    assert conn.start()
    try:
        yield daemon, cache, worker
    finally:
        worker.shutdown()
        daemon.stop()
        cache.close()


def test_a_load_whose_link_drops_is_held_until_its_late_copy_cannot_land(
    patient: tuple[DaemonProcess, ShmKVCache, CachexferdWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link drops before the load's ``not_after``: the daemon may still copy into the
    GPU block when it runs again. vLLM must not get the block back (and recompute into it)
    before no copy can land."""
    daemon, cache, worker = patient
    assert worker.submit_store(1, gpu([3]), HostStoreSpec([key(1)], [5]))
    finished(worker, 1, 10)
    late = expired(daemon, "swap_in")
    monkeypatch.setattr(liveness, "process_state", lambda pid: "alive")
    daemon.signal(signal.SIGSTOP)
    try:
        submitted = time.monotonic()
        assert worker.submit_load(2, HostLoadSpec("r", [key(1)], [5], [False]), gpu([9]))
        seconds = finished(worker, 2, 30, start=submitted)
        assert seconds >= PATIENT_STALL, f"the load was handed back after {seconds:.2f}s, before its not_after"
        assert worker.take_invalid_block_ids() == {9}, "vLLM must recompute the block"
        cache.block_bytes(0, 9).fill_(0x5A)  # what vLLM computed into it
    finally:
        daemon.signal(signal.SIGCONT)
    wait_for(lambda: expired(daemon, "swap_in") == late + 1, 20, "the late SWAP_IN to be refused")
    assert bool((cache.block_bytes(0, 9) == 0x5A).all()), "a late copy landed in a block vLLM recomputed"


def test_a_store_waited_for_after_its_link_dropped_is_handed_back_with_the_fence_held(
    patient: tuple[DaemonProcess, ShmKVCache, CachexferdWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM waits for a store (it reuses the block right after) whose link has dropped: the
    worker cannot wait for its ``not_after``, so it holds the device fence until then: no
    copy of the block starts meanwhile, and the SWAP_OUT is too late once it may."""
    daemon, cache, worker = patient
    late = expired(daemon, "swap_out")
    monkeypatch.setattr(liveness, "process_state", lambda pid: "alive")
    daemon.signal(signal.SIGSTOP)
    try:
        assert worker.submit_store(3, gpu([10]), HostStoreSpec([key(3)], [7]))
        wait_for(lambda: not worker.get_finished() and worker.stats["given_up"] == 0 and _link_dropped(worker), 20,
                 "the link to drop")  # fmt: skip
        start = time.monotonic()
        worker.wait({3})
        assert time.monotonic() - start < 1.0, "wait() must hand the blocks back at once"
        assert worker.take_failed_keys() == [key(3)], "the manager must forget the key"
        cache.block_bytes(0, 10).fill_(0x5A)  # vLLM reuses the block
    finally:
        daemon.signal(signal.SIGCONT)
    wait_for(lambda: (worker.get_finished() or True) and expired(daemon, "swap_out") == late + 1, 30,
             "the late SWAP_OUT to be refused once the fence is free")  # fmt: skip
    assert 7 not in keyed_host_blocks(daemon), "the late SWAP_OUT set the identity key of a reused block"


@pytest.mark.parametrize("idle_s", [0.0, 1.0], ids=["busy", "idle"])
def test_jobs_in_flight_when_the_daemon_dies_are_handed_back_at_once(
    patient: tuple[DaemonProcess, ShmKVCache, CachexferdWorker], monkeypatch: pytest.MonkeyPatch, idle_s: float
) -> None:
    """A daemon killed with a store and a load in flight (sent, not yet run: it was stopped):
    once its process is gone none of their copies can run, so vLLM gets the blocks back
    within a step or two (the load recomputed, the store's keys forgotten), not after their
    ``not_after`` (PATIENT_STALL for the load, longer for the store). ``idle``: no engine
    step for a second after the kill, so the connection's keeper thread notices first."""
    daemon, _, worker = patient
    assert worker.submit_store(1, gpu([3]), HostStoreSpec([key(1)], [5]))
    finished(worker, 1, 10)
    worker.get_finished(), worker.take_failed_keys(), worker.take_invalid_block_ids()
    state = liveness.process_state
    monkeypatch.setattr(liveness, "process_state", lambda pid: "alive" if state(pid) == "stopped" else state(pid))
    daemon.signal(signal.SIGSTOP)  # a hang that looks alive, until the process is gone
    assert worker.submit_store(2, gpu([4]), HostStoreSpec([key(2)], [6]))
    assert worker.submit_load(3, HostLoadSpec("r", [key(1)], [5], [False]), gpu([9]))
    for _ in range(5):  # steps while the daemon is stopped: both stay in flight
        assert not worker.get_finished()
        time.sleep(0.02)
    killed = time.monotonic()
    daemon.kill()
    time.sleep(idle_s)
    left, seconds = {2, 3}, 0.0
    while left and seconds < PATIENT_STALL:
        left -= {r.job_id for r in worker.get_finished()}
        time.sleep(0.01)
        seconds = time.monotonic() - killed
    assert not left, f"jobs {sorted(left)} of a dead daemon still held after {seconds:.1f}s"
    assert seconds < idle_s + 2.0, f"handed back {seconds:.2f}s after the daemon died"
    assert worker.take_invalid_block_ids() == {9}, "vLLM must recompute the load's block"
    assert sorted(worker.take_failed_keys()) == sorted([key(2), key(1)]), "the manager must forget both jobs' keys"


def _link_dropped(worker: CachexferdWorker) -> bool:
    """Whether the store's outcome is known to be lost with its link (it is held)."""
    return any(job.link_lost for job in worker._held)


BATCH_METRICS = ("cachexferd_batches_total", "cachexferd_batched_commands_total", "cachexferd_grouped_swaps_total")


def all_finished(worker: CachexferdWorker, job_ids: set[int], timeout_s: float) -> None:
    left, deadline = set(job_ids), time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        left -= {r.job_id for r in worker.get_finished()}
        time.sleep(0.01)
    assert not left, f"jobs {sorted(left)} not finished in {timeout_s}s"


def test_a_steps_jobs_reach_the_daemon_as_one_batch(rig: tuple[DaemonProcess, ShmKVCache, CachexferdWorker]) -> None:
    """What vLLM submits at the start of a step (the connector wraps it in one_message) is
    one BATCH: two stores, then a store and a load; the daemon groups each batch's swaps."""
    daemon, cache, worker = rig
    worker.get_finished(), worker.take_failed_keys(), worker.take_invalid_block_ids()  # earlier tests' leftovers
    fill_random(cache, seed=31)
    before = snapshot(cache)
    counts = [metric(daemon, name) for name in BATCH_METRICS]
    with worker.one_message():
        assert worker.submit_store(31, gpu([20]), HostStoreSpec([key(31)], [31]))
        assert worker.submit_store(32, gpu([21, 22]), HostStoreSpec([key(32), key(33)], [32, 33]))
    all_finished(worker, {31, 32}, 10)
    with worker.one_message():
        with worker.one_message():  # nested (a wait inside a step's submissions): the outer one sends
            assert worker.submit_store(34, gpu([26]), HostStoreSpec([key(34)], [34]))
        assert worker.submit_load(33, HostLoadSpec("r", [key(31), key(32), key(33)], [31, 32, 33], [False] * 3),
                                  gpu([23, 24, 25]))  # fmt: skip
    all_finished(worker, {33, 34}, 10)
    assert not worker.take_failed_keys() and not worker.take_invalid_block_ids()
    assert_moved(cache, [23, 24, 25], before, [20, 21, 22])
    assert_untouched(cache, before, [23, 24, 25])
    now = [metric(daemon, name) for name in BATCH_METRICS]
    assert [b - a for a, b in zip(counts, now)] == [2, 4, 4], "envelopes, commands in them, swaps grouped"


def stored(worker: CachexferdWorker, daemon: DaemonProcess, count: int) -> bool:
    worker.get_finished()  # engine steps: they send the write-through STOREs and take outcomes
    return ops(daemon, "store") == count


def test_write_through_names_the_chain_it_extends_so_storage_keeps_the_head(cx_root: Path) -> None:
    """Storage room for two objects: a request's two stores (the second naming the first
    block as its parent) and then another request's store. Eviction must take the chain's
    tail, not its head: a head kept is a prefix vLLM can load, a tail alone is not."""
    cache = ShmKVCache(SMALL)
    # 2.5 objects: the third store evicts one object (down to 90% of the capacity), not two.
    room = 5 * (HEADER_BYTES + SMALL.host_block_bytes) // 2
    daemon = start_daemon(cx_root, "evict", cx_root / "evict-storage", **{"storage.file.capacity": room})
    conn = DaemonConnection([daemon.endpoint], name="t", transfer_timeout_s=5, connect_timeout_s=5,
                            retry_interval_s=0.2, lost_after_s=30, slow_after_s=30, cache=cache)  # fmt: skip
    worker = CachexferdWorker(conn, NAMES, 0, WorkerTimes(5.0, 5.0), owner="test-owner")
    try:
        assert conn.start()
        head = NAMES.block_hash(key(1)).digest
        for job, parent in ((1, None), (2, head), (3, None)):
            spec = HostStoreSpec([key(job)], [job], write_through=True, parent=parent)
            assert worker.submit_store(job, gpu([job]), spec)
            finished(worker, job, 10)
            wait_for(functools.partial(stored, worker, daemon, job), 20, f"STORE {job}")
        with EngineClient([daemon.endpoint]) as client:
            client.connect(timeout_s=10)
            reqs = [client.lookup([NAMES.key(key(k), 0)]) for k in (1, 2, 3)]
            done = client.wait(reqs, timeout_s=30)
            found = [done[r].result()["prefix"] == 1 for r in reqs]
        assert found == [True, False, True], f"present after eviction (head, tail, other): {found}"
    finally:
        worker.shutdown()
        daemon.stop()
        cache.close()


def test_nothing_is_held_for_a_killed_daemon(rig: tuple[DaemonProcess, ShmKVCache, CachexferdWorker]) -> None:
    daemon, _, worker = rig
    assert worker.submit_store(1, gpu([3]), HostStoreSpec([key(1)], [5]))
    finished(worker, 1, 10)
    daemon.kill()
    time.sleep(0.3)
    for job in range(2, 6):  # every job fails at once: none waits for a reconnect
        assert worker.submit_store(job, gpu([job]), HostStoreSpec([key(job)], [job]))
        assert finished(worker, job, 1) < 0.2
    assert worker.submit_load(9, HostLoadSpec("r", [key(1)], [5], [False]), gpu([9]))
    assert finished(worker, 9, 1) < 0.2
    assert worker.take_invalid_block_ids() == {9}


def test_an_unsupported_vllm_is_refused_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from cachexferd.integrations.vllm.vllm_api import VLLM_VERSION, UnsupportedVllmError, check_version

    check_version(VLLM_VERSION)  # the running one is supported (the plug-in imported)
    check_version("0.32.7")
    check_version("0.33.1")
    with pytest.raises(UnsupportedVllmError) as refused:
        check_version("0.34.0")
    message = str(refused.value)
    assert "\n" not in message and "0.32.x, 0.33.x" in message and "0.34.0" in message
    monkeypatch.setenv("CACHEXFERD_VLLM_ANY_VERSION", "1")
    check_version("0.34.0")
