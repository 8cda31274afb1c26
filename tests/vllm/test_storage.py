"""File storage outlives both vLLM and the daemon: a new vLLM next to a new daemon (empty
host cache, same storage directory) gets the prompt's blocks back from storage."""

from __future__ import annotations

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from .engines import generate, shutdown  # noqa: E402
from .rig import BLOCK, engine_args, ops, prompt, start_daemon, transfer_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]


def test_restarted_vllm_and_daemon_get_hits_from_file_storage(tiny_model: Path, cx_root: Path) -> None:
    from vllm import LLM

    tokens = prompt(40)
    storage = cx_root / "storage"
    first_daemon = start_daemon(cx_root, "first", storage)
    try:
        llm = LLM(**engine_args(tiny_model), kv_transfer_config=transfer_config(first_daemon.endpoint))
        first = generate(llm, tokens)
        shutdown(llm)  # finishes the write-through stores before the engine goes
        assert ops(first_daemon, "store") >= 1
    finally:
        first_daemon.stop()

    daemon = start_daemon(cx_root, "second", storage)
    try:
        llm = LLM(**engine_args(tiny_model), kv_transfer_config=transfer_config(daemon.endpoint))
        again = generate(llm, tokens)
        shutdown(llm)
        assert again[2] >= len(tokens) // BLOCK * BLOCK - BLOCK, f"only {again[2]} tokens came from storage"
        assert ops(daemon, "load") >= 1 and ops(daemon, "swap_in") >= 1
        assert again[:2] == first[:2]
    finally:
        daemon.stop()
