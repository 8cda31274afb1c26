"""Admission limits, detach with copies in flight, tcp loopback, sd_notify, light imports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.protocol import ErrorCode, KVLayout, Ping, SwapIn, SwapOut

from ..helpers import InProcessDaemon, RawClient, config_for, fill_random

BIG = KVLayout(
    num_layers=8, num_blocks=512, block_size=32, num_kv_heads=4, head_dim=64, dtype="bfloat16"
)  # 256 KiB blocks


@pytest.fixture
def big_daemon(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[tuple[InProcessDaemon, ShmKVCache]]:
    settings = {"host_cache.capacity": "160MiB", **getattr(request, "param", {})}
    daemon = InProcessDaemon(config_for(short_tmp / "rt", **settings)).start()
    cache = ShmKVCache(BIG)
    fill_random(cache, seed=1)
    runner = RunnerClient(daemon.endpoint)
    runner.attach(cache)
    yield daemon, cache
    runner.detach()
    runner.close()
    cache.close()
    daemon.stop()


def _events(raw: RawClient, count: int) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for _ in range(count):
        event = raw.event(timeout_s=20)
        got.setdefault(event.req_id, []).append(event.code)
    return got


@pytest.mark.parametrize("big_daemon", [{"daemon.max_inflight": 2}], indirect=True)
def test_busy_beyond_max_inflight(big_daemon: tuple[InProcessDaemon, ShmKVCache], short_tmp: Path) -> None:
    daemon, _ = big_daemon
    raw = RawClient(daemon.endpoint, short_tmp)
    try:
        raw.hello()
        ids = list(range(256))  # 64 MiB: still copying when the third command arrives
        raw.send_cmd(SwapOut(req_id=1, device_ids=ids, host_ids=ids))
        raw.send_cmd(SwapIn(req_id=2, device_ids=list(range(256, 512)), host_ids=ids))  # waits for 1
        raw.send_cmd(SwapOut(req_id=3, device_ids=[0], host_ids=[600]))
        got = _events(raw, 3)
        assert got == {1: [0], 2: [0], 3: [ErrorCode.BUSY]}, got
    finally:
        raw.close()


def test_duplicate_req_id_in_flight(big_daemon: tuple[InProcessDaemon, ShmKVCache], short_tmp: Path) -> None:
    daemon, _ = big_daemon
    raw = RawClient(daemon.endpoint, short_tmp)
    try:
        raw.hello()
        ids = list(range(256))
        raw.send_cmd(SwapOut(req_id=7, device_ids=ids, host_ids=ids))
        raw.send_cmd(SwapOut(req_id=7, device_ids=[1], host_ids=[600]))
        refusal = raw.reply(timeout_s=20)  # always a reply: never confused with the command's event
        assert (refusal.req_id, refusal.code) == (7, ErrorCode.DUPLICATE_REQ_ID)
        assert _events(raw, 1) == {7: [ErrorCode.OK]}
        assert raw.nothing_more()
    finally:
        raw.close()


def test_detach_cancels_queued_copies_and_unmaps(short_tmp: Path) -> None:
    daemon = InProcessDaemon(config_for(short_tmp / "rt", **{"host_cache.capacity": "160MiB"})).start()
    raw = RawClient(daemon.endpoint, short_tmp)
    try:
        with ShmKVCache(BIG) as cache, RunnerClient(daemon.endpoint) as runner:
            runner.attach(cache)
            assert _mapped(cache.name) == 2  # the runner's mapping and the daemon's (same process here)
            raw.hello()
            ids = list(range(256))
            for req_id in range(1, 41):  # a chain of conflicting copies: most are queued
                cmd = SwapOut if req_id % 2 else SwapIn
                raw.send_cmd(cmd(req_id=req_id, device_ids=ids if req_id % 2 else list(range(256, 512)), host_ids=ids))
            # The detach travels on another socket: make sure the daemon has read all 40 first
            # (a DEALER's messages arrive in order, so the ping's reply proves it).
            assert raw.call(Ping(req_id=500)).ok
            reply = runner.detach(drain_timeout_s=0.0)
            got = _events(raw, 40)
            codes = [c for codes in got.values() for c in codes]
            assert sorted(got) == list(range(1, 41)) and len(codes) == 40
            assert set(codes) <= {ErrorCode.OK, ErrorCode.DETACHED}
            assert codes.count(ErrorCode.DETACHED) == reply["cancelled"] > 0
            assert reply["drained"] + reply["cancelled"] == 40
            status = runner.status()
            assert status["device"]["state"] == "detached"
            assert _mapped(cache.name) == 1, "the daemon kept the segment mapped after detach"
            raw.send_cmd(SwapOut(req_id=99, device_ids=[1], host_ids=[1]))
            assert raw.event().code == ErrorCode.NOT_ATTACHED
    finally:
        raw.close()
        daemon.stop()


def _mapped(name: str) -> int:
    """Mappings of the segment in this process (the in-process daemon shares it)."""
    return sum(name in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_detach_with_time_drains_everything(big_daemon: tuple[InProcessDaemon, ShmKVCache]) -> None:
    daemon, _ = big_daemon
    with EngineClient([daemon.endpoint]) as engine, RunnerClient(daemon.endpoint) as runner:
        engine.connect()
        reqs = [
            engine.swap_out(list(range(64)), list(range(64))),
            engine.swap_in(list(range(300, 364)), list(range(64))),
        ]
        engine.status()  # same socket as the swaps: once answered, the daemon has read them
        reply = runner.detach(drain_timeout_s=30)
        done = engine.wait(reqs, timeout_s=30)
        assert all(c.ok for c in done.values()), [c.describe() for c in done.values()]
        assert reply["cancelled"] == 0 and reply["drained"] >= 1


def test_tcp_loopback_endpoint(short_tmp: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = InProcessDaemon(config_for(short_tmp / "rt", **{"daemon.endpoint": f"tcp://127.0.0.1:{port}"})).start()
    try:
        with EngineClient([f"tcp://127.0.0.1:{port}"]) as engine:
            assert engine.connect()[0]["rank"] == 0
            assert engine.status()[0]["endpoint"] == f"tcp://127.0.0.1:{port}"
    finally:
        daemon.stop()


def test_systemd_ready_notification(short_tmp: Path) -> None:
    sock_path = short_tmp / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(sock_path))
    listener.settimeout(30)
    env_cmd = [
        sys.executable, "-m", "cachexferd", "serve", "--backend", "cpu", "--runtime-dir", str(short_tmp / "rt"),
        "--metrics-port", "0", "--capacity", "16MiB",
    ]  # fmt: skip
    proc = subprocess.Popen(env_cmd, env={**os.environ, "NOTIFY_SOCKET": str(sock_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        message = listener.recv(4096).decode()
        assert "READY=1" in message and "MAINPID" in message
        assert (short_tmp / "rt" / "cmd.sock").exists(), "READY before the socket was bound"
        proc.terminate()
        assert "STOPPING=1" in listener.recv(4096).decode()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        listener.close()


def test_engine_side_imports_stay_light() -> None:
    code = (
        "import sys, cachexferd.client, cachexferd.protocol; "
        "heavy = [m for m in ('torch', 'cachexferd.daemon', 'cachexferd.backends') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bench_swap_runs(short_tmp: Path) -> None:
    out = short_tmp / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cachexferd", "bench", "swap", "--sizes", "64KiB", "--counts", "4", "--layers", "2",
         "--min-time", "0.01", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["direction"], r["pattern"]) for r in rows} == {
        (d, p) for d in ("d2h", "h2d", "both") for p in ("contiguous", "scattered")
    }
    assert all(r["swap_gbps"] > 0 and r["raw_gbps"] > 0 for r in rows)
