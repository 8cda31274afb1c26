"""A prompt that comes back while the stores of its first turn are still in flight waits for
them (vLLM hears of a store's completion a step or two after it was sent) and comes back
cached, as with vLLM's own offloading, instead of computing its prefix again; a store that
does not complete holds the request at most ``max_stall_s``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.client.runner import ShmKVCache  # noqa: E402
from cachexferd.integrations.engine.connection import DaemonConnection  # noqa: E402
from cachexferd.integrations.engine.options import PluginOptions  # noqa: E402
from cachexferd.integrations.vllm.keys import VllmKeyNames  # noqa: E402
from cachexferd.integrations.vllm.manager import CachexferdManager  # noqa: E402
from cachexferd.integrations.vllm.vllm_api import LookupResult, OffloadKey, ReqContext  # noqa: E402

from ..helpers import SMALL  # noqa: E402
from .engines import generate, reset_gpu_cache, shutdown  # noqa: E402
from .rig import BLOCK, engine_args, prompt, start_daemon, transfer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
STALL = 0.5
NAMES = VllmKeyNames.create(model="m", weights_version="0", dtype="float16", layout="test", tokens_per_block={0: 4},
                            tp_size=1)  # fmt: skip


@pytest.mark.slow
def test_a_prompt_back_at_the_next_step_comes_back_cached(tiny_model: Path, cx_root: Path) -> None:
    """One-token requests (a prefill node's, a classifier's) end at the step that computed
    their prompt: the stores of its blocks are sent at the next step, so the same prompt sent
    right after finds every one of them in flight."""
    from vllm import LLM

    daemon = start_daemon(cx_root, "inflight", cx_root / "storage")
    config = transfer_config(daemon.endpoint, storage="off", retry_interval_s=0.25)
    llm = LLM(**engine_args(tiny_model), kv_transfer_config=config)
    try:
        generate(llm, prompt(1000))  # the host tier is open
        for seed in range(3):
            tokens = prompt(seed)
            first = generate(llm, tokens, max_tokens=1)
            reset_gpu_cache(llm)
            again = generate(llm, tokens, max_tokens=1)
            assert again[0] == first[0], "the loaded KV changed the greedy token"
            assert again[2] >= len(tokens) // BLOCK * BLOCK, f"prompt {seed} came back with {again[2]} cached tokens"
    finally:
        shutdown(llm)
        daemon.stop()


@pytest.fixture
def manager(short_tmp: Path) -> Iterator[CachexferdManager]:
    """The scheduler side on a real daemon whose host cache a runner attached; no engine."""
    daemon = start_daemon(short_tmp, "d", short_tmp / "storage")
    cache = ShmKVCache(SMALL)
    runner = DaemonConnection([daemon.endpoint], name="runner", transfer_timeout_s=5, connect_timeout_s=5,
                              retry_interval_s=0.2, cache=cache)  # fmt: skip
    conn = DaemonConnection([daemon.endpoint], name="scheduler", transfer_timeout_s=5, connect_timeout_s=5,
                            retry_interval_s=0.2)  # fmt: skip
    try:
        assert runner.start(), "the runner attaches"
        made = CachexferdManager(PluginOptions(endpoint=daemon.endpoint, storage="off", max_stall_s=STALL), NAMES, conn)
        unknown = OffloadKey(key(99))
        wait_for(lambda: made.lookup(unknown, ReqContext("probe")) is LookupResult.MISS, 15, "the host tier to open")
        yield made
    finally:
        conn.close()
        runner.close()
        daemon.stop()
        cache.close()


def key(i: int) -> bytes:
    return bytes([i]) * 32 + (0).to_bytes(4, "big")


def pending_for(manager: CachexferdManager, k: OffloadKey, req_id: str) -> float:
    """Seconds the request's lookups of ``k`` answered HIT_PENDING before a MISS."""
    start = time.monotonic()
    while (answer := manager.lookup(k, ReqContext(req_id))) is LookupResult.HIT_PENDING:
        assert time.monotonic() - start < 5 * STALL, "still waiting for the store after 5 x max_stall_s"
        time.sleep(0.02)
    assert answer is LookupResult.MISS
    return time.monotonic() - start


def test_a_request_waits_for_a_store_in_flight_at_most_max_stall_s(manager: CachexferdManager) -> None:
    ks = [OffloadKey(key(i)) for i in (1, 2, 3)]
    out = manager.prepare_store(ks, ReqContext("writer"))
    assert out is not None and list(out.keys_to_store) == ks
    assert manager.lookup(OffloadKey(key(4)), ReqContext("a")) is LookupResult.MISS  # never stored
    waited = pending_for(manager, ks[0], "a")
    assert STALL <= waited < STALL + 1.0, f"waited {waited:.2f} s for a store that did not complete"
    assert manager.lookup(ks[1], ReqContext("a")) is LookupResult.MISS  # its wait is over, for every block
    assert manager.lookup(ks[1], ReqContext("b")) is LookupResult.HIT_PENDING  # another request waits anew
    manager.complete_store(ks[:2], ReqContext("writer"))
    manager.complete_store(ks[2:], ReqContext("writer"), success=False)
    assert [manager.lookup(k, ReqContext("b")) for k in ks] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    assert manager.stats["waited_for_stores"] == 2  # requests, not lookups
    assert manager.prepare_store([OffloadKey(key(5))], ReqContext("writer")) is not None
    assert manager.lookup(OffloadKey(key(5)), ReqContext("a")) is LookupResult.MISS  # "a" waited its time
    manager.on_request_finished(ReqContext("a"))  # forgotten: the same id later is another request
    assert manager.lookup(OffloadKey(key(5)), ReqContext("a")) is LookupResult.HIT_PENDING
