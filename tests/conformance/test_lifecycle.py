"""docs/protocol.md §10: device cache states, the detach promise ("when the reply arrives
the runner may free the memory"), a runner that dies while attached. (Daemon shutdown:
test_rules.py, SHUTDOWN pipelined; test_errors.py, SIGTERM while draining.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Attached, CacheFactory, ClientFactory
from .daemons import DaemonProc
from .helpers import burst
from .shm import LAYOUT, ShmCache
from .spec import E, T
from .wire import Client

pytestmark = pytest.mark.conformance


def mapped(daemon: DaemonProc, cache: ShmCache) -> bool:
    """Whether the daemon process still maps the runner's segment."""
    return cache.path in Path(f"/proc/{daemon.proc.pid}/maps").read_text()


def device_state(client: Client) -> str:
    state: str = client.call(T.STATUS).result["device"]["state"]
    return state


def test_attach_detach_cycle(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    client = connect(main)
    assert device_state(client) == "detached"
    first = shm(seed=10)
    assert client.call(T.ATTACH, **first.attach_fields()).ok
    assert device_state(client) == "attached" and mapped(main, first)
    assert client.call(T.SWAP_OUT, device_ids=[1], host_ids=[50]).ok
    detach = client.call(T.DETACH)
    assert detach.ok and detach.result["state"] == "detached"
    assert not mapped(main, first), "after the DETACH reply the daemon holds no mapping of the segment"
    assert client.call(T.SWAP_IN, device_ids=[1], host_ids=[50]).code == E.NOT_ATTACHED
    # Attach again, with another number of device blocks: host blocks survive the cycle.
    second = shm(layout={**LAYOUT, "num_blocks": 16}, seed=11)
    reply = client.call(T.ATTACH, **second.attach_fields())
    assert reply.ok and reply.result["device_blocks"] == 16, reply
    assert client.call(T.SWAP_IN, device_ids=[15], host_ids=[50]).ok
    assert second.block(15) == first.block(1)
    assert client.call(T.SWAP_OUT, device_ids=[16], host_ids=[0]).code == E.ID_OUT_OF_RANGE
    assert client.call(T.DETACH).ok and not mapped(main, second)


def test_detach_lets_in_flight_copies_finish(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    full = {"device_ids": list(range(64)), "host_ids": list(range(1000, 1064))}
    ids = burst(client, [(T.SWAP_OUT, full)] * 6 + [(T.DETACH, {})])
    *swaps, detach = client.wait_all(ids)
    assert all(o.ok for o in swaps), swaps
    assert detach.ok and detach.result["cancelled"] == 0, detach
    assert not mapped(attached.daemon, cache)


def test_runner_exit_detaches(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    runner = subprocess.Popen(["sleep", "60"])
    try:
        client = connect(main)
        cache = shm()
        assert client.call(T.ATTACH, **cache.attach_fields(pid=runner.pid)).ok
        status = client.call(T.STATUS).result["device"]
        assert status["state"] == "attached" and status["runner_pid"] == runner.pid
        runner.kill()
        runner.wait(10)
        deadline = time.monotonic() + 10
        while device_state(client) != "detached":
            assert time.monotonic() < deadline, "the daemon did not detach after its runner exited"
            time.sleep(0.05)
        assert not mapped(main, cache)
        assert client.call(T.SWAP_OUT, device_ids=[0], host_ids=[0]).code == E.NOT_ATTACHED
    finally:
        runner.kill()
        runner.wait(10)


def test_attach_naming_a_dead_pid_detaches_at_once(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    runner = subprocess.Popen(["true"])
    runner.wait(10)
    client = connect(main)
    reply = client.call(T.ATTACH, **shm().attach_fields(pid=runner.pid))
    deadline = time.monotonic() + 10
    while reply.ok and device_state(client) != "detached":
        assert time.monotonic() < deadline, "attached to a runner that had already exited"
        time.sleep(0.05)


def test_detach_while_detached_is_idempotent(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    for _ in range(2):
        reply = client.call(T.DETACH)
        assert reply.ok and reply.result == {"state": "detached", "drained": 0, "cancelled": 0}


def test_hello_reports_the_device_state(attached: Attached, main: DaemonProc, connect: ClientFactory) -> None:
    hello = connect(main, hello=False).hello()
    assert hello.result["state"] == "attached"
    assert hello.result["host_block_bytes"] == attached.cache.block_bytes
    assert hello.result["host_blocks"] == (16 << 20) // attached.cache.block_bytes
