"""The HTTP probes of docs/operations.md ("Health probes and Kubernetes") over real HTTP:
/healthz follows the event loop (it fails while the loop is stuck, answered by the metrics
server's thread, and recovers), /readyz follows serving and, with daemon.expect_runner,
the runner's attach and detach."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachexferd.client import RunnerClient, ShmKVCache
from cachexferd.protocol import KVLayout

from ..helpers import InProcessDaemon, config_for

LAYOUT = KVLayout(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=16, dtype="float16")
WAIT_S = 15.0


def probe(base: str, path: str, method: str = "GET") -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(base + path, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            status, text = response.status, response.read().decode()
            assert response.headers["Content-Type"] == "application/json"
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    return status, json.loads(text) if text else {}


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def daemon(short_tmp: Path) -> Iterator[tuple[InProcessDaemon, str]]:
    config = config_for(short_tmp / "rt", **{"daemon.expect_runner": True, "daemon.loop_stall_s": 1.0})
    inproc = InProcessDaemon(config).start()
    assert inproc.daemon is not None
    try:
        yield inproc, f"http://127.0.0.1:{inproc.daemon.metrics.port}"
    finally:
        inproc.stop()


def test_healthz_fails_while_the_loop_is_stuck_and_recovers(daemon: tuple[InProcessDaemon, str]) -> None:
    inproc, base = daemon
    status, body = probe(base, "/healthz")
    assert status == 200 and body["live"] is True and body["state"] == "running", body
    assert inproc.loop is not None
    inproc.loop.call_soon_threadsafe(time.sleep, 3.0)  # the loop is stuck for 3 s; the probe thread is not
    wait_for(lambda: probe(base, "/healthz")[0] == 503, "/healthz to fail while the loop is stuck")
    status, body = probe(base, "/healthz")
    assert body["live"] is False and "event loop" in body["reason"], body
    assert probe(base, "/readyz")[0] == 503, "a stuck loop is not ready either"
    wait_for(lambda: probe(base, "/healthz")[0] == 200, "/healthz to pass again once the loop runs")


def test_readyz_follows_the_runner_where_one_is_expected(daemon: tuple[InProcessDaemon, str]) -> None:
    inproc, base = daemon
    status, body = probe(base, "/readyz")
    assert status == 503 and body["ready"] is False and body["device"] == "detached", body
    assert any("no runner attached" in reason for reason in body["reasons"]), body
    assert probe(base, "/healthz")[0] == 200, "a daemon waiting for its runner is alive"
    with ShmKVCache(LAYOUT) as cache, RunnerClient(inproc.endpoint) as runner:
        with runner.attached(cache):
            status, body = probe(base, "/readyz")
            assert status == 200 and body == {"ready": True, "state": "running", "device": "attached",
                                              "loop_lag_s": body["loop_lag_s"]}  # fmt: skip
            assert probe(base, "/readyz", "HEAD")[0] == 200
        status, body = probe(base, "/readyz")
        assert status == 503 and body["device"] == "detached", body
    with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
        assert b"cachexferd_attached_device_caches" in response.read(), "the metrics are still served"


def test_readyz_without_an_expected_runner_and_while_draining(short_tmp: Path) -> None:
    inproc = InProcessDaemon(config_for(short_tmp / "rt", **{"daemon.drain_timeout_s": 3.0})).start()
    try:
        assert inproc.daemon is not None and inproc.loop is not None
        base = f"http://127.0.0.1:{inproc.daemon.metrics.port}"
        status, body = probe(base, "/readyz")
        assert status == 200 and body["ready"] is True and body["device"] == "detached", body
        # Draining: work still running (a task of 2 s the daemon waits for) keeps it there.
        daemon = inproc.daemon
        inproc.loop.call_soon_threadsafe(lambda: daemon.spawn(asyncio.sleep(2.0)))
        inproc.loop.call_soon_threadsafe(daemon.request_stop, "test")
        wait_for(lambda: inproc.daemon is not None and inproc.daemon.state.value != "running", "the drain")
        status, body = probe(base, "/readyz")
        assert status == 503 and "the daemon is draining" in body["reasons"], body
    finally:
        inproc.stop()
