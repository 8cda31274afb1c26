"""Real subprocess daemons, two TP ranks, driven by the engine clients."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from cachexferd.client import AsyncEngineClient, EngineClient, RunnerClient, ShmKVCache
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import KVLayout

from ..helpers import SMALL, assert_moved, assert_untouched, fill_random, snapshot

Spawn = Callable[..., DaemonProcess]


@pytest.fixture
def two_ranks(spawn_daemon: Spawn) -> Iterator[tuple[list[DaemonProcess], list[ShmKVCache], list[RunnerClient]]]:
    daemons = [spawn_daemon(rank=r) for r in (0, 1)]
    caches = [ShmKVCache(SMALL) for _ in daemons]
    runners = [RunnerClient(d.endpoint) for d in daemons]
    for rank, (cache, runner) in enumerate(zip(caches, runners)):
        fill_random(cache, seed=100 + rank)
        runner.attach(cache)
    yield daemons, caches, runners
    for cache, runner in zip(caches, runners):
        runner.detach()
        runner.close()
        cache.close()


def test_fan_out_exact_bytes_on_every_rank(
    two_ranks: tuple[list[DaemonProcess], list[ShmKVCache], list[RunnerClient]],
) -> None:
    daemons, caches, _ = two_ranks
    before = [snapshot(c) for c in caches]
    with EngineClient([d.endpoint for d in daemons]) as engine:
        engine.connect()
        assert engine.ranks == [0, 1]
        src, dst, host = [1, 2, 3, 17, 30], [40, 41, 42, 43, 44], [9, 10, 11, 50, 2]
        reqs = [engine.swap_out(src, host), engine.swap_in(dst, host)]
        done = engine.wait(reqs, timeout_s=20)
        assert all(c.ok for c in done.values()), [c.describe() for c in done.values()]
        assert set(done[reqs[0]].outcomes) == {0, 1}
    for cache, snap in zip(caches, before):
        assert_moved(cache, dst, snap, src)
        assert_untouched(cache, snap, dst)


def test_one_rank_failing_fails_the_command_with_detail(spawn_daemon: Spawn) -> None:
    daemons = [spawn_daemon(rank=r) for r in (0, 1)]
    small = KVLayout(**{**SMALL.to_wire(), "num_blocks": 8})  # rank 1's cache is smaller
    caches = [ShmKVCache(SMALL), ShmKVCache(small)]
    runners = [RunnerClient(d.endpoint) for d in daemons]
    try:
        for cache, runner in zip(caches, runners):
            runner.attach(cache)
        with EngineClient([d.endpoint for d in daemons]) as engine:
            engine.connect()
            req = engine.swap_out([20], [0])
            done = engine.wait([req], timeout_s=20)[req]
        assert not done.ok
        assert done.outcomes[0].ok
        assert done.errors == {1: ("ID_OUT_OF_RANGE", "device_ids holds 20, outside [0, 8)")}
    finally:
        for cache, runner in zip(caches, runners):
            runner.close()
            cache.close()


def test_async_client(two_ranks: tuple[list[DaemonProcess], list[ShmKVCache], list[RunnerClient]]) -> None:
    daemons, caches, _ = two_ranks
    before = [snapshot(c) for c in caches]

    async def scenario() -> None:
        async with AsyncEngineClient([d.endpoint for d in daemons]) as engine:
            await engine.connect()
            out, back = await asyncio.wait_for(
                asyncio.gather(engine.swap_out([5, 6], [70, 71]), engine.swap_in([45, 46], [70, 71])), 20
            )
            assert out.ok and back.ok, (out.describe(), back.describe())
            statuses = await engine.status()
            assert [s["rank"] for s in statuses] == [0, 1]

    asyncio.run(scenario())
    for cache, snap in zip(caches, before):
        assert_moved(cache, [45, 46], snap, [5, 6])


def test_poll_and_fileno(two_ranks: tuple[list[DaemonProcess], list[ShmKVCache], list[RunnerClient]]) -> None:
    import selectors

    daemons, _, _ = two_ranks
    with EngineClient([d.endpoint for d in daemons]) as engine:
        engine.connect()
        req = engine.swap_out([1], [1])
        sel = selectors.DefaultSelector()
        sel.register(engine.fileno(), selectors.EVENT_READ)
        got = []
        for _ in range(200):  # bounded: at most ~10 s
            sel.select(timeout=0.05)
            got += engine.poll()  # drains everything available, never blocks
            if got:
                break
        assert [c.req_id for c in got] == [req] and got[0].ok


def test_metrics_endpoint(two_ranks: tuple[list[DaemonProcess], list[ShmKVCache], list[RunnerClient]]) -> None:
    daemons, _, runners = two_ranks
    url = runners[0].status()["metrics_url"]
    assert url.startswith("http://127.0.0.1:")
    with EngineClient([daemons[0].endpoint]) as engine:
        engine.connect()
        engine.wait([engine.swap_out([1, 2], [3, 4])], timeout_s=20)
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    check_with_promtool(text)
    for name in (
        'cachexferd_commands_total{op="swap_out",outcome="ok"} 1.0',
        'cachexferd_transfer_bytes_total{direction="d2h"}',
        "cachexferd_command_duration_seconds_bucket",
        "cachexferd_queue_depth",
        "cachexferd_inflight_commands",
        "cachexferd_host_cache_capacity_bytes",
        "cachexferd_attached_device_caches 1.0",
        "cachexferd_imported_mappings 1.0",
        "cachexferd_build_info{",
        "process_resident_memory_bytes",
    ):
        assert name in text, f"{name!r} missing from /metrics"


def check_with_promtool(text: str) -> None:
    """`promtool check metrics` must be clean (Prometheus naming conventions)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            raise AssertionError("promtool missing in CI (scripts/install-test-tools.sh installs it)")
        print("promtool not installed: exposition lint skipped")
        return
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr
