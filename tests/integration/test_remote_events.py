"""Events for an engine on another machine than its daemons: tcp with CURVE, both ways.

The daemons serve tcp with CURVE; the engine binds its event socket as a CURVE server on an
address the daemons reach and names its public key in the hello (``events_key``, protocol
1.2); each daemon connects with its own key pair, which the engine checks. Two set-ups, real
daemon subprocesses in both:

- two loopback addresses of this machine: daemons on 127.0.0.1, the engine's events on
  127.0.0.2 (always runs);
- two network namespaces joined by a veth pair (iproute2, root): the daemons in one with
  their own address, the engine in the other, so the events cross a real, non-loopback
  link as between two hosts (a scheduler on one node, the daemons of another).

Each runs the sync and the asyncio engine client: swap out, swap in, every moved byte exact
and the rest of the cache untouched.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from cachexferd.client import AsyncEngineClient, EngineClient, RunnerClient, ShmKVCache
from cachexferd.client.link import ClientError
from cachexferd.keys_cli import generate
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import ErrorCode
from cachexferd.security import load_client_keys

from ..helpers import SMALL, assert_moved, assert_untouched, fill_random, snapshot

RANKS = (0, 1)
SRC, HOST, DST = [1, 2, 3, 9], [4, 5, 6, 7], [20, 21, 30, 31]


@dataclass
class Site:
    """Where the daemons listen and where the engine's events go."""

    daemon_host: str
    engine_host: str
    prefix: list[str]  # runs a daemon in its place (ip netns exec NAME)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Key pairs: one per daemon, the engine's (allowed by both daemons), an intruder's."""
    directory = tmp_path_factory.mktemp("keys")
    for name in ("daemon0", "daemon1", "engine", "intruder"):
        generate(directory, name)
    (directory / "clients").mkdir()
    shutil.copy(directory / "engine.key", directory / "clients")
    return directory


def _ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def netns() -> Iterator[Site]:
    """A network namespace with a veth pair to this one: 10.x.y.1 here, 10.x.y.2 there."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) for two network namespaces")
    tag = uuid.uuid4().hex[:6]
    name, here, there = f"cx-{tag}", f"cxh{tag}", f"cxn{tag}"
    net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    if not _ip("netns", "add", name):
        pytest.skip("cannot create a network namespace here")
    try:
        steps = [
            ("link", "add", here, "type", "veth", "peer", "name", there),
            ("link", "set", there, "netns", name),
            ("addr", "add", f"{net}.1/30", "dev", here),
            ("link", "set", here, "up"),
            ("-n", name, "addr", "add", f"{net}.2/30", "dev", there),
            ("-n", name, "link", "set", there, "up"),
            ("-n", name, "link", "set", "lo", "up"),
        ]
        if not all(_ip(*step) for step in steps):
            pytest.skip("cannot set up a veth pair between network namespaces here")
        yield Site(f"{net}.2", f"{net}.1", ["ip", "netns", "exec", name])
    finally:
        _ip("link", "del", here)
        _ip("netns", "del", name)


SITES = ["loopback-pair", "netns"]


@pytest.fixture(scope="module", params=SITES)
def site(request: pytest.FixtureRequest) -> Site:
    if request.param == "netns":
        return request.getfixturevalue("netns")  # type: ignore[no-any-return]
    return Site("127.0.0.1", "127.0.0.2", [])


@pytest.fixture(scope="module")
def daemons(site: Site, keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    root = Path(tmp_path_factory.mktemp("rt", numbered=True))
    started: list[DaemonProcess] = []
    try:
        for rank in RANKS:
            # In a namespace of its own every port is free; here, ask for one.
            port = 15550 + rank if site.prefix else free_port(site.daemon_host)
            settings = {
                "daemon.endpoint": f"tcp://{site.daemon_host}:{port}",
                "access.curve_secret_key": str(keys / f"daemon{rank}.key_secret"),
                "access.curve_clients": str(keys / "clients"),
                "metrics.enabled": "false",
                "host_cache.capacity": "16MiB",
                "storage.backend": "none",
            }
            curve = load_client_keys(keys / f"daemon{rank}.key", keys / "engine.key_secret")
            daemon = DaemonProcess(root / f"r{rank}", rank=rank, settings=settings, curve=curve, prefix=site.prefix)
            started.append(daemon)
            daemon.start(timeout_s=90)
        yield started
    finally:
        for daemon in started:
            daemon.stop()


@pytest.fixture
def attached(daemons: list[DaemonProcess], keys: Path) -> Iterator[list[tuple[ShmKVCache, list[Any]]]]:
    """Each daemon with a runner cache of random bytes attached over its CURVE tcp endpoint."""
    out = []
    with_keys = {"client_key": keys / "engine.key_secret"}
    runners = []
    try:
        for rank, daemon in zip(RANKS, daemons):
            cache = ShmKVCache(SMALL)
            fill_random(cache, seed=40 + rank)
            runner = RunnerClient(daemon.endpoint, timeout_s=20, server_key=keys / f"daemon{rank}.key", **with_keys)
            runners.append((runner, cache))
            runner.attach(cache)
            out.append((cache, snapshot(cache)))
        yield out
    finally:
        for runner, cache in runners:
            runner.detach()
            runner.close()
            cache.close()


def engine_options(site: Site, keys: Path) -> dict[str, Any]:
    return {
        "events": f"tcp://{site.engine_host}:0",
        "server_key": [keys / f"daemon{rank}.key" for rank in RANKS],
        "client_key": keys / "engine.key_secret",
        "timeout_s": 30.0,
    }


def check_bytes(attached: list[tuple[ShmKVCache, list[Any]]]) -> None:
    for cache, before in attached:
        assert_moved(cache, DST, before, SRC)
        assert_untouched(cache, before, DST)


def test_sync_engine_gets_its_events_over_curve(
    site: Site, keys: Path, daemons: list[DaemonProcess], attached: list[tuple[ShmKVCache, list[Any]]]
) -> None:
    with EngineClient([d.endpoint for d in daemons], **engine_options(site, keys)) as engine:
        assert engine.core.events.startswith(f"tcp://{site.engine_host}:") and engine.core.events_key
        engine.connect()
        out = engine.swap_out(SRC, HOST)
        back = engine.swap_in(DST, HOST)
        done = engine.wait([out, back], timeout_s=60)
    assert all(c.ok for c in done.values()), [c.describe() for c in done.values()]
    assert {r for c in done.values() for r in c.outcomes} == set(RANKS)  # events from both daemons
    check_bytes(attached)


def test_asyncio_engine_gets_its_events_over_curve(
    site: Site, keys: Path, daemons: list[DaemonProcess], attached: list[tuple[ShmKVCache, list[Any]]]
) -> None:
    async def run() -> list[Any]:
        async with AsyncEngineClient([d.endpoint for d in daemons], **engine_options(site, keys)) as engine:
            await engine.connect()
            out = engine.swap_out(SRC, HOST)
            back = engine.swap_in(DST, HOST)
            return list(await asyncio.wait_for(asyncio.gather(out, back), 60))

    done = asyncio.run(run())
    assert all(c.ok for c in done), [c.describe() for c in done]
    check_bytes(attached)


def test_the_event_socket_refuses_keys_it_was_not_given(site: Site, keys: Path, daemons: list[DaemonProcess]) -> None:
    """Nobody but the daemons can push outcomes into the engine: another CURVE key is refused."""
    ctx: zmq.Context[Any] = zmq.Context()
    with EngineClient([d.endpoint for d in daemons], **engine_options(site, keys)) as engine:
        engine.connect()
        intruder = load_client_keys(keys / "engine.key", keys / "intruder.key_secret")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.curve_serverkey = intruder.server_public  # the engine's public key, as a daemon would use
        push.curve_publickey, push.curve_secretkey = intruder.public, intruder.secret
        monitor = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        push.connect(engine.core.events)
        seen = None
        for _ in range(200):  # the engine answers handshakes from its poll()
            engine.poll(timeout_ms=50)
            if monitor.poll(0):
                seen = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
                break
        push.disable_monitor()
        monitor.close(0)
        push.close(0)
    ctx.term()
    assert seen == zmq.EVENT_HANDSHAKE_FAILED_AUTH


def test_an_engine_elsewhere_is_not_watched_by_pid(
    site: Site,
    keys: Path,
    daemons: list[DaemonProcess],
    attached: list[tuple[ShmKVCache, list[Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its pid names a process of its own machine: the daemon must not reclaim its session
    because no process here has that pid (an engine on loopback is watched as before)."""
    if not site.prefix:
        pytest.skip("an engine on loopback is on the daemons' machine: its pid is watched")
    exited = subprocess.Popen(["true"])  # a pid no process here has now, like a remote engine's
    exited.wait(10)
    monkeypatch.setattr("cachexferd.client.core.os.getpid", lambda: exited.pid)
    with EngineClient([d.endpoint for d in daemons], **engine_options(site, keys)) as engine:
        engine.connect()
        before = [s["clients_reclaimed"] for s in engine.status()]
        engine.poll(timeout_ms=1500)  # a watch of a pid that does not exist fires at once
        assert [s["clients_reclaimed"] for s in engine.status()] == before
        out = engine.swap_out(SRC, HOST)
        back = engine.swap_in(DST, HOST)
        done = engine.wait([out, back], timeout_s=60)
    assert all(c.ok for c in done.values()), [c.describe() for c in done.values()]
    check_bytes(attached)


def test_a_client_of_protocol_1_1_gets_no_remote_events(site: Site, keys: Path, daemons: list[DaemonProcess]) -> None:
    """Without events_key, an event endpoint off loopback stays refused, as in 1.1."""
    if not site.prefix:
        pytest.skip("127.0.0.2 is loopback: plaintext events there are accepted")
    endpoint = f"tcp://{site.engine_host}:{free_port(site.engine_host)}"
    with pytest.raises(ClientError) as info:
        with EngineClient([daemons[0].endpoint], events=endpoint, server_key=keys / "daemon0.key",
                          client_key=keys / "engine.key_secret", timeout_s=20) as engine:  # fmt: skip
            engine.core.events_key = None  # what a 1.1 client sends
            engine.connect()
    assert info.value.code == ErrorCode.BAD_FIELD and "events_key" in info.value.detail
