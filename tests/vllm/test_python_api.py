"""vLLM's Python API with the plug-in, against the same engine without it.

One engine without the plug-in gives the reference tokens and logprobs. One engine with
it (a host tier of only 8 blocks, write-through to file storage) then serves the same
prompts after vLLM's own prefix cache was reset, so every cached token must come back
through the daemon: from its host cache, then, after other prompts pushed them out of the
host tier, from storage. Clearing the daemon's host cache must change the output.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.launch import DaemonProcess  # noqa: E402

from .engines import Output, generate, reset_gpu_cache, shutdown  # noqa: E402
from .rig import BLOCK, clear_host, engine_args, ops, prompt, start_daemon, transfer_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [prompt(seed) for seed in range(4)]
FULL = len(PROMPTS[0]) // BLOCK * BLOCK  # tokens in full blocks: what can be cached


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[Output]:
    """Outputs of vLLM without the plug-in."""
    from vllm import LLM

    llm = LLM(**engine_args(tiny_model))
    try:
        return [generate(llm, p) for p in PROMPTS]
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def daemon(cx_root: Path) -> Iterator[DaemonProcess]:
    d = start_daemon(cx_root, "rank0", cx_root / "storage")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def llm(tiny_model: Path, daemon: DaemonProcess, reference: object) -> Iterator[Any]:
    from vllm import LLM

    engine = LLM(**engine_args(tiny_model), kv_transfer_config=transfer_config(daemon.endpoint, host_blocks=8))
    yield engine
    shutdown(engine)


def test_second_run_loads_through_the_daemon_and_matches_vllm_without_it(
    llm: Any, daemon: DaemonProcess, reference: list[Output]
) -> None:
    first = generate(llm, PROMPTS[0])
    assert first[2] == 0
    assert first[:2] == reference[0][:2]
    reset_gpu_cache(llm)
    swap_ins = ops(daemon, "swap_in")
    again = generate(llm, PROMPTS[0])
    assert again[2] >= FULL - BLOCK, f"only {again[2]} cached tokens came back"
    assert ops(daemon, "swap_in") > swap_ins, "the cached tokens did not come through the daemon"
    assert again[:2] == reference[0][:2], "loaded KV changed greedy tokens or logprobs"


def test_blocks_evicted_from_the_host_tier_come_back_from_storage(
    llm: Any, daemon: DaemonProcess, reference: list[Output]
) -> None:
    for p, ref in zip(PROMPTS[1:3], reference[1:3]):  # 12 new blocks push prompt 0 out of 8 host blocks
        assert generate(llm, p)[:2] == ref[:2]
    reset_gpu_cache(llm)
    loads = ops(daemon, "load")
    again = generate(llm, PROMPTS[0])
    assert again[2] >= FULL - BLOCK
    assert ops(daemon, "load") > loads, "prompt 0 should have come back from storage"
    assert again[:2] == reference[0][:2]


def test_clearing_the_host_cache_changes_the_output(llm: Any, daemon: DaemonProcess, reference: list[Output]) -> None:
    """Negative control: the manager still believes the blocks are on the host, so vLLM loads
    the zeros CLEAR_HOST left there. If the bytes did not come through the daemon, nothing
    would change."""
    assert generate(llm, PROMPTS[3])[:2] == reference[3][:2]  # a fresh prompt: its blocks are on the host
    reset_gpu_cache(llm)
    clear_host(daemon)
    swap_ins = ops(daemon, "swap_in")
    cleared = generate(llm, PROMPTS[3])
    assert ops(daemon, "swap_in") > swap_ins
    assert cleared[2] >= FULL - BLOCK
    assert cleared[:2] != reference[3][:2], "output did not depend on the bytes the daemon delivered"
