"""Storage servers for tests: pytest fixtures around cachexferd.storage_servers.

``redis_server`` and ``mooncake_cluster`` start a real redis-server (or valkey-server) and a
real mooncake_master + mooncake_client storage node on free loopback ports, once per test
module, and stop them by PID afterwards. Import the fixtures into a test module to use them.

Where a binary is missing the tests skip with the reason; in CI (``CI=true``) the servers
are part of the contract (.ci/run installs them), so a missing one fails instead. Binary
lookup and the CXTEST_REDIS_SERVER / CXTEST_MOONCAKE_MASTER /
CXTEST_MOONCAKE_CLIENT overrides: see cachexferd/storage_servers.py.

``python -m tests.servers redis|mooncake`` starts one and prints its address until Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from cachexferd.storage_servers import MooncakeCluster, RedisServer, ServerUnavailable

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip outside CI; in CI the servers must be there, so fail."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: .ci/run must install the storage servers)", pytrace=False)
    pytest.skip(reason)


def start_redis(workdir: Path, **kwargs: Any) -> RedisServer:
    try:
        return RedisServer(workdir, **kwargs).start()
    except ServerUnavailable as exc:
        unavailable(str(exc))


def start_mooncake(workdir: Path, **kwargs: object) -> MooncakeCluster:
    try:
        return MooncakeCluster(workdir, **kwargs).start()  # type: ignore[arg-type]
    except ServerUnavailable as exc:
        unavailable(str(exc))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="cx-redis-") as d:
        server = start_redis(Path(d))
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def mooncake_cluster() -> Iterator[MooncakeCluster]:
    with tempfile.TemporaryDirectory(prefix="cx-mc-") as d:
        cluster = start_mooncake(Path(d))
        try:
            yield cluster
        finally:
            cluster.stop()


def _main(kind: str) -> None:  # pragma: no cover - manual use
    workdir = Path(tempfile.mkdtemp(prefix=f"cx-{kind}-"))
    server: RedisServer | MooncakeCluster
    if kind == "redis":
        server = RedisServer(workdir).start()
        print(f"redis at {server.url} (logs in {workdir}); Ctrl-C stops it", flush=True)
    else:
        server = MooncakeCluster(workdir, segment="2GB").start()
        print(f"mooncake master at {server.master} (logs in {workdir}); Ctrl-C stops it", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":  # pragma: no cover
    _main(sys.argv[1] if len(sys.argv) > 1 else "redis")
