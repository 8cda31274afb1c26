"""Environment variables: CACHEXFERD_* are settings; the test servers' overrides use CXTEST_*."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachexferd.storage_servers import find_binary


def serve_check_config(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cachexferd", "serve", "--check-config", "--runtime-dir", str(tmp_path / "rt")]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CACHEXFERD_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**clean, **env})


def test_serve_works_with_the_test_server_overrides_set(tmp_path: Path) -> None:
    overrides = {"CXTEST_REDIS_SERVER": "/bin/true", "CXTEST_MOONCAKE_MASTER": "/bin/true",
                 "CXTEST_MOONCAKE_CLIENT": "/bin/true", "CACHEXFERD_STORAGE_CHECKSUM": "sum64"}  # fmt: skip
    done = serve_check_config(tmp_path, **overrides)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["storage"]["checksum"] == "sum64"


def test_a_cachexferd_variable_that_is_no_setting_is_a_clear_error(tmp_path: Path) -> None:
    done = serve_check_config(tmp_path, CACHEXFERD_REDIS_SERVER="/bin/true")
    assert done.returncode == 2
    assert "unknown table 'redis' in env CACHEXFERD_REDIS_SERVER (CACHEXFERD_<TABLE>_<KEY>)" in done.stderr


def test_server_binaries_honour_the_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXTEST_REDIS_SERVER", "/bin/true")
    assert find_binary(("redis-server",), "CXTEST_REDIS_SERVER") == "/bin/true"
    monkeypatch.setenv("CXTEST_REDIS_SERVER", str(tmp_path / "missing"))
    assert find_binary(("redis-server",), "CXTEST_REDIS_SERVER") is None
