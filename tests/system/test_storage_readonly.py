"""A storage directory that turns read-only under a running daemon: every storage command
gets an outcome with a clear detail, reads keep working, and the log holds no traceback."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.storage_rig import Node, key_space, prompt

KEYS = key_space().token_keys(prompt(4 * 3))


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def small_fs(short_tmp: Path) -> Iterator[Path]:
    """A tmpfs of its own (so it can be remounted read-only); unmounted afterwards."""
    mount_point = short_tmp / "pool"
    mount_point.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=8m", "cx-test", str(mount_point)):
        pytest.skip("needs root and permission to mount a tmpfs")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def test_read_only_storage_gives_outcomes_not_tracebacks(spawn_daemon: Any, small_fs: Path) -> None:
    daemon = spawn_daemon(settings={"storage.file.path": str(small_fs)})
    node = Node.subprocess(daemon, seed=4)
    try:
        assert node.ok("store", KEYS, host_ids=[0, 1, 2], device_ids=[1, 2, 3])["stored"] == 3
        assert _mount("-o", "remount,ro", str(small_fs))
        error, detail = node.error("delete", KEYS)
        assert error == "STORAGE_ERROR" and "3 of 3 objects not deleted" in detail and "Read-only" in detail
        error, detail = node.error("store", KEYS[:1], host_ids=[5])
        assert error == "STORAGE_ERROR" and "Read-only" in detail, detail
        assert node.ok("load", KEYS, host_ids=[10, 11, 12])["loaded"] == 3  # reads still work
        assert node.ok("lookup", KEYS)["prefix"] == 3  # nothing was deleted
        assert node.metric("cachexferd_storage_errors_total", kind="backend") >= 1
    finally:
        node.close()
    log = daemon.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
