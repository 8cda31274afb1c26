"""Fixtures of the vLLM tests. Every test module skips itself when vLLM is not importable."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .rig import make_tiny_model

# The Python-API tests run vLLM's engine core in the test process (with the "uni" executor,
# its worker too): no process spawns, which saves most of a minute per engine on 2 cores.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's own ipc sockets (engine core, API server) go to a directory removed at exit, not /tmp.
_VLLM_SOCKETS = tempfile.TemporaryDirectory(prefix="cxv-rpc-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_SOCKETS.name)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def cx_root() -> Iterator[Path]:
    """A short directory for daemon sockets (ipc paths are limited to ~107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="cxv-") as d:
        yield Path(d)
