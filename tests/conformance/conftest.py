"""Fixtures of the wire-level conformance suite (`pytest tests/conformance`).

Daemons run as subprocesses and are reached only through their command socket; the test
logic imports nothing from cachexferd. The shared daemons a session needs are started
together before the first test, so their start-up costs overlap; the daemons for tests that
stop one (function-scoped) start as soon as the first shared daemon is up.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .daemons import DaemonProc
from .helpers import ensure_detached
from .shm import SHM_DIR, ShmCache
from .spec import T
from .wire import Client, context

# Session daemons: name -> extra `cachexferd serve` arguments ({scratch} is the session's dir).
SESSION_DAEMONS: dict[str, list[str]] = {
    # Most tests: file storage, a small in-flight limit so BUSY is reachable, and a short
    # storage deadline for the tests that hang a read on purpose (a FIFO as an object).
    "main": [
        "--storage", "file", "--storage-path", "{scratch}/main-store",
        "--set", "daemon.max_inflight=64", "--set", "storage.timeout_s=1", "--set", "daemon.drain_timeout_s=5",
    ],
    # Never attached; its storage directory cannot be created: once it serves, a regular file
    # takes the place of its parent (a storage path under a file refuses the start).
    "pristine": ["--storage", "file", "--storage-path", "{scratch}/not-a-dir/store"],
    "nostorage": ["--storage", "none"],
}  # fmt: skip
FRESH = "fresh_daemon"  # function-scoped: one new daemon per test (shutdown, signals)
# Fresh daemons started ahead of the tests that take them: each start imports torch, and more
# than a couple at once on a small machine can take one past its start-up deadline.
_SPARES_AHEAD = 2
_NEEDED = pytest.StashKey[Counter[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: wire-level conformance suite (subprocess daemons, raw frames)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needed: Counter[str] = Counter()
    for item in items:
        names = list(getattr(item, "fixturenames", ()))
        # Table-driven tests name their daemon in a parameter (``case.daemon``).
        params = getattr(getattr(item, "callspec", None), "params", {})
        names += [p.daemon for p in params.values() if isinstance(getattr(p, "daemon", None), str)]
        for name in names:
            if name in SESSION_DAEMONS or name == FRESH:
                needed[name] += 1
    config.stash[_NEEDED] = needed


class DaemonPool:
    def __init__(self, scratch: Path, needed: Counter[str]) -> None:
        self.scratch = scratch
        self.started: dict[str, DaemonProc] = {}
        self.spares: list[DaemonProc] = []
        self._fresh = 0
        self._spares_wanted = needed[FRESH]
        for name in SESSION_DAEMONS:
            if needed[name]:
                self._start(name)
        if not self.started:
            self._start_spares()

    def _start_spares(self) -> None:
        """Fresh daemons start once the first session daemon is up (tests can begin sooner),
        at most _SPARES_AHEAD ahead of the tests that take them."""
        while self._spares_wanted and len(self.spares) < _SPARES_AHEAD:
            self._spares_wanted -= 1
            self.spares.append(self._spawn_fresh())

    def _start(self, name: str) -> DaemonProc:
        args = [a.format(scratch=self.scratch) for a in SESSION_DAEMONS[name]]
        self.started[name] = DaemonProc(name, self.scratch, args)
        self.started[name].shared = True
        return self.started[name]

    def _spawn_fresh(self) -> DaemonProc:
        self._fresh += 1
        name = f"fresh{self._fresh}"
        args = ["--storage", "file", "--storage-path", f"{self.scratch}/{name}-store", "--set", "storage.timeout_s=5"]
        return DaemonProc(name, self.scratch, args)

    def get(self, name: str) -> DaemonProc:
        proc = (self.started.get(name) or self._start(name)).wait_ready()
        blocker = self.scratch / "not-a-dir"
        if name == "pristine" and not blocker.exists():
            blocker.write_text("a regular file where a directory should be\n")
        self._start_spares()
        return proc

    def take_fresh(self) -> DaemonProc:
        self._start_spares()
        proc = self.spares.pop(0) if self.spares else self._spawn_fresh()
        self._start_spares()  # the next one starts while this test runs
        return proc.wait_ready()

    def close(self) -> list[str]:
        """Stops everything; returns the names of session daemons that had died on their own."""
        died = [name for name, proc in self.started.items() if not proc.alive()]
        procs = [*self.started.values(), *self.spares]
        for proc in procs:  # all at once: their shutdowns overlap
            proc.terminate()
        for proc in procs:
            proc.stop()
        return died


@pytest.fixture(scope="session")
def scratch() -> Iterator[Path]:
    """Short paths: ipc socket paths are limited to about 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cxc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
    for leftover in Path(SHM_DIR).glob(f"cxconf-{os.getpid()}-*"):  # caches of interrupted tests
        leftover.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def daemon_pool(request: pytest.FixtureRequest, scratch: Path) -> Iterator[DaemonPool]:
    pool = DaemonPool(scratch, request.config.stash.get(_NEEDED, Counter()))
    yield pool
    died = pool.close()
    context().destroy(linger=0)  # closes any socket a failed test left open; never blocks
    assert not died, f"session daemons died during the tests: {died}"


@pytest.fixture(scope="session")
def main(daemon_pool: DaemonPool) -> DaemonProc:
    return daemon_pool.get("main")


@pytest.fixture(scope="session")
def pristine(daemon_pool: DaemonPool) -> DaemonProc:
    return daemon_pool.get("pristine")


@pytest.fixture(scope="session")
def nostorage(daemon_pool: DaemonPool) -> DaemonProc:
    return daemon_pool.get("nostorage")


@pytest.fixture
def fresh_daemon(daemon_pool: DaemonPool) -> Iterator[DaemonProc]:
    proc = daemon_pool.take_fresh()
    yield proc
    proc.stop()


ClientFactory = Callable[..., Client]
CacheFactory = Callable[..., ShmCache]


@pytest.fixture
def shm() -> Iterator[CacheFactory]:
    """shm(layout=None, offsets=None, size=None, seed=0) -> ShmCache; unlinked at teardown."""
    caches: list[ShmCache] = []

    def make(**kwargs: Any) -> ShmCache:
        caches.append(ShmCache(**kwargs))
        return caches[-1]

    yield make
    for cache in caches:
        cache.close()


@pytest.fixture
def connect(scratch: Path, shm: CacheFactory) -> Iterator[ClientFactory]:
    """connect(daemon, hello=True, events=True) -> Client; closed at teardown. (It depends on
    ``shm`` so that its teardown, which detaches, runs before the caches are unlinked.)"""
    clients: list[tuple[Client, DaemonProc]] = []

    def make(daemon: DaemonProc, hello: bool = True, events: bool = True, **hello_fields: Any) -> Client:
        client = Client(daemon.endpoint, scratch, events=events)
        clients.append((client, daemon))
        if hello:
            client.hello(**hello_fields)
        return client

    yield make
    try:  # shared daemons must not stay attached after a test that failed half way
        for client, daemon in clients:
            if client.sent_attach and daemon.shared and daemon.alive():
                ensure_detached(client)
    finally:
        for client, _ in clients:
            client.close()


class Attached:
    """A client of `main` with an attached cache; detached again at teardown."""

    def __init__(self, daemon: DaemonProc, client: Client, cache: ShmCache, reply: dict[str, Any]) -> None:
        self.daemon = daemon
        self.client = client
        self.cache = cache
        self.reply = reply


@pytest.fixture
def attached(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> Iterator[Attached]:
    client = connect(main)
    cache = shm(seed=1)
    reply = client.call(T.ATTACH, **cache.attach_fields())
    assert reply.ok, reply
    yield Attached(main, client, cache, reply.result)
