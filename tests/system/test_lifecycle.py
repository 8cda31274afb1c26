"""Shutdown with work in flight, restarts, runner death, config errors, the status CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import ErrorCode, KVLayout, SwapIn, SwapOut

from ..helpers import SMALL, RawClient, fill_random

Spawn = Callable[..., DaemonProcess]
BIG = KVLayout(num_layers=8, num_blocks=512, block_size=32, num_kv_heads=4, head_dim=64, dtype="bfloat16")


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_shutdown_gives_every_accepted_command_one_outcome(spawn_daemon: Spawn, short_tmp: Path) -> None:
    daemon = spawn_daemon(settings={"host_cache.capacity": "160MiB", "daemon.drain_timeout_s": 0.0})
    with ShmKVCache(BIG) as cache, RunnerClient(daemon.endpoint) as runner:
        runner.attach(cache)
        raw = RawClient(daemon.endpoint, short_tmp)
        try:
            assert raw.hello().ok
            sent = 0
            for i in range(1, 121):  # conflicting chains keep many commands queued
                ids = list(range(0, 128))
                cmd = SwapOut if i % 2 else SwapIn
                raw.send_cmd(cmd(req_id=i, device_ids=ids if i % 2 else list(range(200, 328)), host_ids=ids))
                sent += 1
            daemon.signal(signal.SIGTERM)
            outcomes = {}
            deadline = time.monotonic() + 30
            while len(outcomes) < sent and time.monotonic() < deadline:
                event = raw.event(timeout_s=max(0.1, deadline - time.monotonic()))
                assert event.req_id not in outcomes, f"second outcome for req_id {event.req_id}"
                outcomes[event.req_id] = event
            assert sorted(outcomes) == list(range(1, sent + 1))
            codes = {ErrorCode(o.code) for o in outcomes.values()}
            assert codes <= {ErrorCode.OK, ErrorCode.SHUTTING_DOWN}, codes
            assert ErrorCode.SHUTTING_DOWN in codes  # drain timeout 0: queued work was failed
            assert raw.nothing_more(0.3)
        finally:
            raw.close()
    assert daemon.proc is not None and daemon.proc.wait(30) == 0
    assert not Path(daemon.endpoint[len("ipc://") :]).exists(), "ipc socket file left behind"


def test_sigint_drains_and_exits_zero(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon()
    daemon.signal(signal.SIGINT)
    assert daemon.proc is not None and daemon.proc.wait(20) == 0
    assert "stopped" in daemon.log_tail()


def test_daemon_death_fails_fast_and_the_next_command_after_restart_succeeds(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon()
    cache = ShmKVCache(SMALL)
    fill_random(cache, seed=2)
    try:
        with RunnerClient(daemon.endpoint) as runner:
            runner.attach(cache)
        with EngineClient([daemon.endpoint], timeout_s=30, heartbeat_s=0.2) as engine:
            engine.connect()
            daemon.kill()
            killed = time.monotonic()
            lost = engine.swap_out([1], [1])  # for a daemon that is gone (and stays down for now)
            done = engine.wait([lost], timeout_s=10)[lost]
            assert done.errors[0][0] in ("DAEMON_LOST", "SEND_FAILED"), done.describe()
            assert time.monotonic() - killed < 2.0, "noticed by the connection, not by the 30 s command timeout"
            daemon.start()  # same runtime dir and endpoint, new boot id
            with RunnerClient(daemon.endpoint) as runner:
                runner.attach(cache)
            again = engine.swap_out([1], [1])  # no waiting for a re-hello: the client holds it until then
            result = engine.wait([again], timeout_s=20)[again]
            assert result.ok, result.describe()
    finally:
        cache.close()


RUNNER = textwrap.dedent(
    """
    import sys, time
    from cachexferd.client import RunnerClient, ShmKVCache
    from cachexferd.protocol import KVLayout
    cache = ShmKVCache(KVLayout(**{layout!r}))
    RunnerClient(sys.argv[1]).attach(cache)
    print(cache.name, flush=True)
    time.sleep(120)
    """
)


def test_runner_death_detaches(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon()
    code = RUNNER.format(layout=SMALL.to_wire())
    runner = subprocess.Popen([sys.executable, "-c", code, daemon.endpoint], stdout=subprocess.PIPE)
    try:
        assert runner.stdout is not None
        name = runner.stdout.readline().decode().strip()
        assert name, "runner did not attach"
        status = RunnerClient(daemon.endpoint)
        try:
            assert status.status()["device"]["state"] == "attached"
            runner.kill()
            killed = time.monotonic()
            _wait_for(lambda: status.status()["device"]["state"] == "detached", 10, "auto-detach")
            assert time.monotonic() - killed < 2.0, "imports released within 2 s of the runner's death"
            assert status.status()["device"].get("mappings", 0) == 0
            assert not Path(f"/dev/shm/{name}").exists(), "the dead runner's segment was left in /dev/shm"
        finally:
            status.close()
    finally:
        runner.kill()
        runner.wait(10)
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)
    assert "exited; detaching" in daemon.log_tail(50)


def test_invalid_config_exits_before_binding(short_tmp: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachexferd",
            "serve",
            "--set",
            f"daemon.runtime_dir={short_tmp}",
            "--set",
            "host_cache.capacity=lots",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "host_cache.capacity" in proc.stderr and "expected a size" in proc.stderr
    assert not (short_tmp / "cmd.sock").exists()


def test_second_daemon_on_same_runtime_dir_is_refused(spawn_daemon: Spawn) -> None:
    first = spawn_daemon()
    second = DaemonProcess(first.runtime_dir, settings={"metrics.port": 0})
    with pytest.raises(Exception, match="another cachexferd is running"):
        second.start(timeout_s=30)
    assert RunnerClient(first.endpoint).status()["state"] == "running"


def test_status_cli(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon(rank=3)
    out = subprocess.run(
        [sys.executable, "-m", "cachexferd", "status", "--endpoint", daemon.endpoint],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "rank 3" in out.stdout and "device cache  detached" in out.stdout and "host cache" in out.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "cachexferd", "status", "--endpoint", "ipc:///nonexistent/x.sock", "--timeout", "0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 1 and "no status" in missing.stderr


def test_resident_memory_beyond_host_cache(spawn_daemon: Spawn) -> None:
    capacity = 64 << 20
    daemon = spawn_daemon(settings={"host_cache.capacity": capacity})
    with ShmKVCache(SMALL) as cache, RunnerClient(daemon.endpoint) as runner, runner.attached(cache) as info:
        with EngineClient([daemon.endpoint]) as engine:
            engine.connect()
            host_blocks = info["host_blocks"]
            reqs = [
                engine.swap_out(
                    [b % SMALL.num_blocks for b in range(start, start + 48)], list(range(start, start + 48))
                )
                for start in range(0, host_blocks - 48, 48)
            ]
            assert all(c.ok for c in engine.wait(reqs, timeout_s=60).values())
    assert daemon.proc is not None
    rss = _rss_bytes(daemon.proc.pid)
    beyond = rss - capacity
    print(
        f"daemon RSS {rss / 2**20:.0f} MiB with a {capacity >> 20} MiB host cache: {beyond / 2**20:.0f} MiB beyond it"
    )
    assert beyond < 300 << 20


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


os.environ.setdefault("PYTHONUNBUFFERED", "1")


ENGINE = textwrap.dedent(
    """
    import sys, time
    from cachexferd.client import EngineClient
    engine = EngineClient([sys.argv[1]])
    engine.connect()
    print(engine.core.events, flush=True)
    time.sleep(120)
    """
)


def test_engine_death_reclaims_its_session_and_files(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, daemon.endpoint], stdout=subprocess.PIPE)
    try:
        assert engine.stdout is not None
        events = engine.stdout.readline().decode().strip()
        assert events.startswith("ipc://"), "engine did not connect"
        events_dir = Path(events[len("ipc://") :]).parent
        assert events_dir.exists() and daemon.status()["clients"] >= 1
        engine.kill()
        _wait_for(lambda: daemon.status()["clients_reclaimed"] == 1, 10, "session reclaimed")
        _wait_for(lambda: not events_dir.exists(), 10, "events directory removed")
        with EngineClient([daemon.endpoint]) as other:  # a new engine takes over
            assert other.connect()[0]["rank"] == 0
    finally:
        engine.kill()
        engine.wait(10)


def test_async_client_fails_fast_and_recovers_after_a_restart(spawn_daemon: Spawn) -> None:
    import asyncio

    from cachexferd.client import AsyncEngineClient

    daemon = spawn_daemon()
    cache = ShmKVCache(SMALL)

    async def scenario() -> None:
        async with AsyncEngineClient([daemon.endpoint], timeout_s=30, heartbeat_s=0.2) as engine:
            await engine.connect()
            daemon.kill()
            killed = time.monotonic()
            lost = await asyncio.wait_for(engine.swap_out([1], [1]), 10)
            assert lost.errors[0][0] in ("DAEMON_LOST", "SEND_FAILED"), lost.describe()
            assert time.monotonic() - killed < 2.0
            daemon.start()
            with RunnerClient(daemon.endpoint) as runner:
                runner.attach(cache)  # blocks this loop: let the pump see the new daemon first
                boot = runner.status()["boot_id"]
                deadline = time.monotonic() + 15
                while engine.core.boot_ids[0] != boot and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                again = await asyncio.wait_for(engine.swap_out([1], [1]), 20)
                assert again.ok, again.describe()

    try:
        asyncio.run(scenario())
    finally:
        cache.close()


def test_runner_that_asked_for_it_attaches_again_after_a_daemon_restart(spawn_daemon: Spawn) -> None:
    daemon = spawn_daemon()
    cache = ShmKVCache(SMALL)
    try:
        with RunnerClient(daemon.endpoint, timeout_s=5) as runner, runner.attached(cache, reattach=True):
            daemon.kill()
            daemon.start()  # same endpoint, new boot id, nothing attached
            _wait_for(lambda: daemon.status()["device"]["state"] == "attached", 15, "re-attach")
            with EngineClient([daemon.endpoint], timeout_s=20) as engine:
                engine.connect()
                done = engine.wait([engine.swap_out([1], [1])], timeout_s=20)
                assert all(c.ok for c in done.values())
    finally:
        cache.close()
