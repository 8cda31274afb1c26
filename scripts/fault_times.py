#!/usr/bin/env python3
"""Exact times of the daemon's reactions to peer faults and backlogs (the tests bound them
generously; this prints them). Each case starts its own daemon (cpu backend) on loopback ipc.

  PING / STATUS answered, SIGTERM acted on, with 4,000 same-block commands queued
  runner killed (SIGKILL) while attached -> imports released (device state detached)
  daemon killed (SIGKILL) -> the engine client fails the in-flight command

    scripts/fault_times.py
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import PROTOCOL_MAJOR, PROTOCOL_MINOR, KVLayout, MsgType, encode_batch, encode_body

LAYOUT = KVLayout(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=32, dtype="float16")
BACKLOG = 4000


def _daemon(tmp: Path, name: str) -> DaemonProcess:
    daemon = DaemonProcess(tmp / name, settings={"metrics.port": 0, "host_cache.capacity": "16MiB",
                                                 "daemon.max_inflight": 2 * BACKLOG})  # fmt: skip
    daemon.start()
    return daemon


def _call(dealer: zmq.Socket[Any], op: MsgType, req_id: int) -> float:
    sent = time.monotonic()
    dealer.send_multipart(encode_body(op, {"req_id": req_id}))
    if not dealer.poll(30_000):
        raise RuntimeError(f"no reply to {op.name}")
    while msgpack.unpackb(dealer.recv_multipart()[1])["req_id"] != req_id:
        pass
    return time.monotonic() - sent


def backlog(tmp: Path) -> None:
    daemon = _daemon(tmp, "backlog")
    cache = ShmKVCache(LAYOUT)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        RunnerClient(daemon.endpoint).attach(cache)  # the runner's client stays open: attached
        dealer, pull = ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{tmp}/ev.sock")
        dealer.connect(daemon.endpoint)
        hello = {"req_id": 1 << 40, "protocol": [PROTOCOL_MAJOR, PROTOCOL_MINOR], "events": f"ipc://{tmp}/ev.sock"}
        dealer.send_multipart(encode_body(MsgType.HELLO, hello))
        dealer.poll(10_000) and dealer.recv_multipart()
        chain = [(MsgType.SWAP_OUT, {"req_id": r, "device_ids": [1], "host_ids": [7]}) for r in range(1, BACKLOG + 1)]
        for start in range(0, BACKLOG, 500):
            dealer.send_multipart(encode_batch(chain[start : start + 500]))
        print(f"with {BACKLOG} same-block commands queued:")
        print(f"  PING answered in   {_call(dealer, MsgType.PING, 1 << 41) * 1e3:8.1f} ms")
        print(f"  STATUS answered in {_call(dealer, MsgType.STATUS, 1 << 42) * 1e3:8.1f} ms")
        sent = time.monotonic()
        daemon.signal(signal.SIGTERM)
        refusal = {"req_id": 1 << 43, "device_ids": [2], "host_ids": [8]}
        while True:  # the first command refused with SHUTTING_DOWN marks the stop taking effect
            dealer.send_multipart(encode_body(MsgType.SWAP_OUT, refusal))
            if pull.poll(1000) or dealer.poll(0):
                events = _drain(pull) + _drain(dealer)
                if any(e.get("req_id") == refusal["req_id"] and e.get("code") == 14 for e in events):
                    break
            refusal = {**refusal, "req_id": refusal["req_id"] + 1}
        print(f"  SIGTERM acted on in {(time.monotonic() - sent) * 1e3:7.1f} ms (first SHUTTING_DOWN refusal)")
    finally:
        daemon.stop(60)
        cache.close()
        ctx.destroy(0)


def _drain(sock: zmq.Socket[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while sock.poll(0):
        header, body = sock.recv_multipart()
        decoded = msgpack.unpackb(body, raw=False)
        out += [{"req_id": e[0], "code": e[2]} for e in decoded["events"]] if header[3] == 130 else [decoded]
    return out


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


def runner_death(tmp: Path) -> None:
    daemon = _daemon(tmp, "runner")
    proc = subprocess.Popen([sys.executable, "-c", RUNNER.format(layout=LAYOUT.to_wire()), daemon.endpoint],
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().decode().strip()
        with RunnerClient(daemon.endpoint) as probe:
            proc.kill()
            killed = time.monotonic()
            while probe.status()["device"]["state"] != "detached":
                time.sleep(0.005)
            released = time.monotonic() - killed
        gone = not Path(f"/dev/shm/{name}").exists()
        print(f"runner SIGKILL -> imports released in {released * 1e3:.1f} ms; segment removed: {gone}")
    finally:
        proc.kill()
        proc.wait(10)
        daemon.stop()


def daemon_death(tmp: Path) -> None:
    daemon = _daemon(tmp, "daemon")
    cache = ShmKVCache(LAYOUT)
    try:
        RunnerClient(daemon.endpoint).attach(cache)
        with EngineClient([daemon.endpoint], timeout_s=30) as engine:
            engine.connect()
            daemon.kill()
            killed = time.monotonic()
            lost = engine.swap_out([1], [1])
            done = engine.wait([lost], timeout_s=30)[lost]
            print(f"daemon SIGKILL -> in-flight command failed after {(time.monotonic() - killed) * 1e3:.1f} ms "
                  f"({done.errors[0][0]})")  # fmt: skip
    finally:
        cache.close()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="cx-faults-") as tmp:
        backlog(Path(tmp))
        runner_death(Path(tmp))
        daemon_death(Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
