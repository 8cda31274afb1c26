"""A small host tier under eviction pressure, seen through vLLM's KV events as a router sees
them: more prompts than the host tier holds. After every step, each block the router holds as
``CPU`` is loadable (a returning prompt over it comes back cached from the daemon), so the
evicted ones were announced removed; the router never holds more blocks than the tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.launch import DaemonProcess  # noqa: E402

from .engines import generate, reset_gpu_cache, shutdown  # noqa: E402
from .kv_events import Subscriber  # noqa: E402
from .rig import BLOCK, engine_args, ops, prompt, start_daemon, transfer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]
HOST_BLOCKS = 8  # the plug-in's host tier: a prompt and a third of another
PROMPTS = [prompt(1000 + seed) for seed in range(4)]  # six full blocks each


@pytest.fixture(scope="module")
def rig(tiny_model: Path, cx_root: Path) -> Iterator[tuple[Any, DaemonProcess, Subscriber]]:
    from vllm import LLM

    daemon = start_daemon(cx_root, "evict", cx_root / "storage-evict")
    endpoint = f"ipc://{cx_root}/kv-events-evict.sock"
    subscriber = Subscriber(endpoint)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}
    config = transfer_config(daemon.endpoint, storage="off", host_blocks=HOST_BLOCKS, retry_interval_s=0.25)
    config["kv_connector_extra_config"]["self_describing_kv_events"] = True  # token ids: which prompt a block is of
    llm = LLM(**engine_args(tiny_model), kv_transfer_config=config, kv_events_config=events)
    yield llm, daemon, subscriber
    shutdown(llm)
    subscriber.close()
    daemon.stop()


def held_prefix(sub: Subscriber, tokens: list[int]) -> int:
    """Full blocks at the start of ``tokens`` that the router holds as CPU-resident."""
    held = {sub.tokens.get(h) for h in sub.cpu()}
    count = 0
    while (count + 1) * BLOCK <= len(tokens) and tuple(tokens[count * BLOCK : (count + 1) * BLOCK]) in held:
        count += 1
    return count


def test_what_the_router_holds_under_eviction_is_loadable(rig: tuple[Any, DaemonProcess, Subscriber]) -> None:
    llm, daemon, sub = rig
    short = prompt(999)[:16]
    for _ in range(2):
        for p in PROMPTS:
            generate(llm, p)
            generate(llm, short)  # a step more: this prompt's stores complete
            sub.drain()
            assert len(sub.cpu()) <= HOST_BLOCKS, "the router holds more blocks than the host tier has"
    announced = len(sub.cpu() | sub.removed.get("CPU", set()))
    assert announced > HOST_BLOCKS, "the prompts did not overflow the host tier"
    assert all(h in sub.tokens for h in sub.cpu()), "vLLM sent no token ids"
    # Every prompt, returning with vLLM's own cache empty (the most recent first: what each
    # stores evicts the older ones): at least the blocks the router holds of it (from its
    # start) come back cached, loaded from the daemon.
    hits = 0
    for p in reversed(PROMPTS):
        sub.drain()
        expect = held_prefix(sub, p)
        reset_gpu_cache(llm)
        loads = ops(daemon, "swap_in")
        cached = generate(llm, p)[2]
        assert cached >= expect * BLOCK, f"the router held {expect} blocks of a prompt, {cached} tokens came back"
        if expect:
            hits += 1
            wait_for(lambda: ops(daemon, "swap_in") > loads, 10, "a load from the daemon")  # noqa: B023
        generate(llm, short)
    assert hits, "the router held no prompt's first block"
