"""The plug-in's parts that need no vLLM: options, storage key names, and the connection
that must never block an engine step on a daemon that is down, paused or restarted."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachexferd.client.runner import ShmKVCache
from cachexferd.integrations.engine import liveness
from cachexferd.integrations.engine.connection import DaemonConnection
from cachexferd.integrations.engine.liveness import Verdict
from cachexferd.integrations.engine.options import PluginOptions
from cachexferd.integrations.vllm.keys import VllmKeyNames, layout_name
from cachexferd.launch import DaemonProcess

from ..helpers import SMALL
from .rig import attached_runner, metric, start_daemon

INTERVAL = 0.2


def test_options_parse_check_and_name_endpoints() -> None:
    opts = PluginOptions.from_extra_config({"spec_name": "x", "cachexferd": {"endpoint": "ipc:///r/{rank}/c.sock"}})
    assert opts.endpoint_for(2) == "ipc:///r/2/c.sock"
    assert PluginOptions.from_extra_config({}).storage == "write_through"
    for bad in ({"storage": "evict"}, {"host_blocks": -1}, {"transfer_timeout_s": 0}, {"endpoint": "http://x"},
                {"no_such_option": 1}):  # fmt: skip
        with pytest.raises(ValueError):
            PluginOptions.from_extra_config({"cachexferd": bad})


def names(model: str = "m", layers: int = 2, tp: int = 1) -> VllmKeyNames:
    layout = layout_name(layers=layers, block_bytes=16384, tokens_per_block=32, kv_cache_layout="LBHNC",
                         hash_algo="sha256")  # fmt: skip
    return VllmKeyNames.create(model=model, weights_version="0", dtype="bfloat16", layout=layout,
                               tokens_per_block={0: 32, 1: 32}, tp_size=tp)  # fmt: skip


def test_storage_keys_match_only_the_same_model_and_layout() -> None:
    key = b"\x01" * 32 + (0).to_bytes(4, "big")
    assert names().key(key, 0) == names().key(key, 0)  # another instance, same model: shared
    assert len({names().key(key, 0), names(model="other").key(key, 0), names(layers=3).key(key, 0)}) == 3
    assert names(tp=2).key(key, 0) != names(tp=2).key(key, 1)
    assert names().key(key, 0) != names().key(b"\x01" * 32 + (1).to_bytes(4, "big"), 0)  # group index
    assert len(names().key(key, 0)) <= 80


@pytest.fixture
def cache() -> Iterator[ShmKVCache]:
    c = ShmKVCache(SMALL)
    yield c
    c.close()


def connection(endpoint: str, cache: ShmKVCache | None = None) -> DaemonConnection:
    return DaemonConnection(
        [endpoint], name="test", transfer_timeout_s=5, connect_timeout_s=5, retry_interval_s=INTERVAL,
        lost_after_s=30, slow_after_s=0.3, cache=cache,
    )  # fmt: skip


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.02)


def tick_until(conn: DaemonConnection, check: Callable[[], bool], timeout_s: float) -> list[str]:
    """Ticks like an engine step loop; asserts no tick blocks; returns the loss reasons seen."""
    reasons: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        start = time.monotonic()
        reason = conn.tick()
        assert time.monotonic() - start < 0.25, "a tick blocked on the daemon"  # its waits are 0.3-5 s
        if reason:
            reasons.append(reason)
        if check():
            return reasons
        time.sleep(0.02)
    raise AssertionError(f"condition not reached in {timeout_s}s (reasons: {reasons})")


def test_daemon_down_at_start_is_picked_up_without_engine_steps(short_tmp: Path, cache: ShmKVCache) -> None:
    """An idle engine (no step, no tick) attaches once its daemon comes up."""
    daemon = DaemonProcess(short_tmp / "d", settings={"metrics.port": 0, "host_cache.capacity": "16MiB"})
    conn = connection(daemon.endpoint, cache)
    try:
        start = time.monotonic()
        assert not conn.start()
        assert time.monotonic() - start < 1, "start() waited for a daemon whose socket does not exist"
        daemon.start()
        wait_until(lambda: conn.up and attached_runner(daemon) == os.getpid(), 15, "attached by the keeper")
    finally:
        conn.close()
        daemon.stop()
    assert cache.tensors, "closing the connection must leave the runner's cache alone"


def test_hung_daemon_keeps_its_link_and_a_killed_one_is_replaced(short_tmp: Path, cache: ShmKVCache) -> None:
    daemon = start_daemon(short_tmp, "d", short_tmp / "storage")
    conn = connection(daemon.endpoint, cache)
    try:
        assert conn.start()
        first_boot = conn.boot_ids[0]

        daemon.signal(signal.SIGSTOP)  # hung (or starved): unresponsive, never lost
        reasons = tick_until(conn, lambda: conn.verdict is Verdict.UNRESPONSIVE, 5)
        assert not reasons and conn.up and not conn.usable
        hung_for = time.monotonic() + 2.0
        tick_until(conn, lambda: time.monotonic() > hung_for, 5)
        assert conn.up and conn.boot_ids[0] == first_boot
        daemon.signal(signal.SIGCONT)
        reasons = tick_until(conn, lambda: conn.usable, 5)
        assert not reasons and conn.boot_ids[0] == first_boot
        assert metric(daemon, "cachexferd_commands_total", op="attach", outcome="ok") == 1, "re-attached"
        assert "reply dropped" not in daemon.log_tail(200)

        daemon.kill()  # SIGKILL while attached: lost at once (its process is gone), not after silence
        killed = time.monotonic()
        tick_until(conn, lambda: not conn.up, 5)  # the engine's tick or the keeper's sees it first
        assert time.monotonic() - killed < 1.5

        daemon = start_daemon(short_tmp, "d", short_tmp / "storage")  # same endpoint, new boot
        wait_until(lambda: conn.up and attached_runner(daemon) == os.getpid(), 15, "re-attached by the keeper")
        assert conn.boot_ids[0] != first_boot
    finally:
        conn.close()
        daemon.stop()


def test_a_daemon_whose_pid_is_hidden_is_lost_when_its_socket_is_gone(
    short_tmp: Path, cache: ShmKVCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon in another pid namespace (a sidecar container sharing the ipc directory):
    its pid means nothing here. Stopped, it still accepts connections (unresponsive, kept);
    killed, its socket refuses them (lost at once, not after ``lost_after_s``)."""
    monkeypatch.setattr(liveness, "_is_daemon", lambda pid: False)
    daemon = start_daemon(short_tmp, "d", short_tmp / "storage")
    conn = connection(daemon.endpoint, cache)
    try:
        assert conn.start()
        daemon.signal(signal.SIGSTOP)
        try:
            tick_until(conn, lambda: conn.verdict is Verdict.UNRESPONSIVE, 5)
            hung_for = time.monotonic() + 1.0
            assert not tick_until(conn, lambda: time.monotonic() > hung_for, 5), "a stopped daemon was lost"
        finally:
            daemon.signal(signal.SIGCONT)
        assert not tick_until(conn, lambda: conn.usable, 5)
        daemon.kill()
        killed = time.monotonic()
        reasons = tick_until(conn, lambda: not conn.up, 5)
        assert time.monotonic() - killed < 1.5, reasons
    finally:
        conn.close()
        daemon.stop()


def test_refusing_daemon_is_retried_once_per_interval(short_tmp: Path, cache: ShmKVCache) -> None:
    """A daemon whose host blocks have another size refuses the attach (LAYOUT_MISMATCH):
    the connection stays down without raising, and asks again only once per interval."""
    daemon = start_daemon(short_tmp, "d", short_tmp / "storage", **{"host_cache.block_bytes": 4096})
    conn = connection(daemon.endpoint, cache)
    try:
        assert not conn.start()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert conn.tick() is None and not conn.up
            time.sleep(0.01)
        refused = metric(daemon, "cachexferd_commands_total", op="attach", outcome="layout_mismatch")
        assert 1 <= refused <= 1 + 1.0 / INTERVAL + 1, f"{refused} attach attempts in 1 s"
    finally:
        conn.close()
        daemon.stop()


def _lineage_in_child(queue: Any) -> None:
    from cachexferd.integrations.vllm.processes import vllm_lineage

    queue.put(vllm_lineage())


def test_a_spawned_process_watches_the_process_that_started_it() -> None:
    """What an orphaned vLLM worker uses to notice that vLLM's main process is gone."""
    import multiprocessing
    import subprocess
    import sys

    from cachexferd.integrations.engine.liveness import orphaned
    from cachexferd.integrations.vllm.processes import vllm_lineage

    assert vllm_lineage() == [], "a process the user started watches nothing above it"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_lineage_in_child, args=(queue,))
    child.start()
    lineage = queue.get(timeout=60)
    child.join(60)
    assert [pid for pid, _ in lineage] == [os.getpid()], lineage
    assert orphaned(lineage) is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    assert orphaned([(gone.pid, 1)]) == gone.pid


def test_failures_are_logged_once_per_burst_with_counts(caplog: pytest.LogCaptureFixture) -> None:
    from cachexferd.integrations.engine.failures import FailureLog

    failures = FailureLog(gap_s=0.2)
    with caplog.at_level("WARNING", logger="vllm.cachexferd"):
        for i in range(500):
            failures.note("load" if i % 5 else "store", f"job {i}: daemon lost")
            failures.flush()  # within the burst: nothing yet
        assert failures.lines == 0
        time.sleep(0.25)
        failures.flush()
        failures.flush()
    assert failures.lines == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "500 transfer(s) failed" in line and "load: 400, store: 100" in line and "job 0" in line


def test_a_burst_names_every_daemon_error_it_carried(caplog: pytest.LogCaptureFixture) -> None:
    from cachexferd.integrations.engine.failures import FailureLog

    failures = FailureLog(gap_s=0.05)
    with caplog.at_level("WARNING", logger="vllm.cachexferd"):
        failures.note("load", "load job 6: the manager could not place every block")
        failures.note("load", "load job 7: swap_in #12 failed: rank 0: HOST_BLOCK_CHANGED (host block 3 ...)")
        failures.note("store", "store job 8: swap_out #13 failed: rank 1: DAEMON_LOST (gone)")
        time.sleep(0.1)
        failures.flush()
        failures.note("load", "load job 9: not done after 5.00s")  # the next burst starts afresh
        failures.flush(force=True)
    first, second = [r.getMessage() for r in caplog.records]
    assert "errors: DAEMON_LOST, HOST_BLOCK_CHANGED;" in first and "first: load: load job 6" in first
    assert "errors" not in second and "load: 1;" in second


def test_a_runner_attaching_after_the_connection_is_seen_within_a_step_or_two(
    short_tmp: Path, cache: ShmKVCache
) -> None:
    """The scheduler's connection learns the host cache's geometry (known once the worker's
    runner attached) by polling, not at the next once-per-interval ping: with an interval of
    30 s it still knows within a few keeper periods."""
    daemon = start_daemon(short_tmp, "d", short_tmp / "storage")
    scheduler = DaemonConnection(
        [daemon.endpoint], name="scheduler", transfer_timeout_s=5, connect_timeout_s=5, retry_interval_s=30,
    )  # fmt: skip
    worker = connection(daemon.endpoint, cache)
    try:
        assert scheduler.start(), "the scheduler connects to a running daemon"
        time.sleep(0.3)  # its first STATUS has come back, from a daemon with no runner yet
        assert not scheduler.statuses()[0].get("host_cache", {}).get("num_blocks")
        assert worker.start(), "the worker attaches"
        wait_until(lambda: bool(scheduler.statuses()[0].get("host_cache", {}).get("num_blocks")), 5,
                   "the scheduler to learn the host cache's geometry")  # fmt: skip
    finally:
        worker.close()
        scheduler.close()
        daemon.stop()
