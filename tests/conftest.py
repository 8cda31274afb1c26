from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Imported inside the fixtures: the conformance suite (tests/conformance) uses none of them
# and should not pay for torch's import.
if TYPE_CHECKING:
    from cachexferd.client.runner import ShmKVCache
    from cachexferd.launch import DaemonProcess

    from .helpers import InProcessDaemon


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir: ipc socket paths are limited to ~107 bytes."""
    with tempfile.TemporaryDirectory(prefix="cx-") as d:
        yield Path(d)


@pytest.fixture
def inproc(short_tmp: Path) -> Iterator[InProcessDaemon]:
    from .helpers import InProcessDaemon, config_for

    daemon = InProcessDaemon(config_for(short_tmp / "rt")).start()
    yield daemon
    daemon.stop()


@pytest.fixture
def shm_cache() -> Iterator[ShmKVCache]:
    from cachexferd.client.runner import ShmKVCache

    from .helpers import SMALL

    cache = ShmKVCache(SMALL)
    yield cache
    cache.close()


@pytest.fixture
def spawn_daemon(short_tmp: Path) -> Iterator[object]:
    """Factory: spawn_daemon(rank=0, **settings) -> started DaemonProcess (stopped at teardown)."""
    from cachexferd.launch import DaemonProcess

    started: list[DaemonProcess] = []

    def spawn(rank: int = 0, settings: dict[str, object] | None = None, start: bool = True) -> DaemonProcess:
        base = {"metrics.port": 0, "host_cache.capacity": "16MiB", "daemon.drain_timeout_s": 5.0}
        proc = DaemonProcess(short_tmp / f"rank{rank}-{len(started)}", rank=rank, settings={**base, **(settings or {})})
        started.append(proc)
        if start:
            proc.start()
        return proc

    yield spawn
    for proc in started:
        proc.stop(timeout_s=20)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("cuda" in item.keywords for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
