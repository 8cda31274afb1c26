"""Models with several KV-cache groups at tensor parallelism 2 (sliding window beside full
attention, gated-delta-net state beside full attention): two vLLM workers bound one per
core, one daemon per rank.

Greedy tokens must be those of vLLM alone at TP=2 (TP=2 changes them even without the
plug-in), and each token's logprob that of vLLM alone within LOGPROB_TOLERANCE: with these
tiny random models a wrong block loaded on one rank may leave every greedy token as it was.
The prompts are ones where vLLM alone's greedy choice leads the runner-up by a margin at
every token (checked): many tokens of these models are near ties (one bf16 step apart), and
a prompt computed after a load (or after vLLM's own prefix cache) takes other kernels.

With vLLM's KV cache smaller than the prompts and its prefix cache reset between passes,
returning prompts (longer than the sliding window) must come back cached, loaded by both
ranks' daemons. A host cache cleared on one rank only must never be served: the
blocks only the other rank still holds are loaded on neither, and tokens stay vLLM's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.integrations.vllm.manager import CachexferdManager  # noqa: E402
from cachexferd.integrations.vllm.tiny_models import KINDS, Kind  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402

from .engines import generate, reset_gpu_cache, shutdown  # noqa: E402
from .rig import clear_host, ops, prompt, start_daemon, transfer_config, wait_for  # noqa: E402
from .test_models import HOST, LOGPROB_TOLERANCE, alone, args_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # a worker per core (vLLM needs a binding for TP=2)
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# vLLM splits the gated-delta-net key heads over the ranks: the TP=2 checkpoint has two.
BUILD: dict[str, dict[str, Any]] = {"sliding_window": {}, "gdn": {"key_heads": 2}}
# vLLM's KV cache per rank: less than the three prompts need together (936 tokens for three
# of 400 with the sliding window; 1,820 for three of 784 with gated delta nets).
KV_BYTES = {"sliding_window": KINDS["sliding_window"].kv_bytes, "gdn": 16 * 98304}
# Prompt seeds (rig.prompt) whose greedy tokens all lead the runner-up by at least MARGIN
# in vLLM alone at TP=2 (the fixture checks it).
SEEDS = {"sliding_window": (309, 320, 326), "gdn": (313, 327, 337)}
MARGIN = 0.125  # nats: several bf16 steps of these logits (1/64 to 1/32 apart)


@dataclass
class Case:
    kind: Kind
    prompts: list[list[int]]
    reference: list[list[int]]  # vLLM alone's greedy tokens per prompt, at TP=2
    logprobs: list[list[float]]  # vLLM alone's logprob of each of them
    daemons: list[DaemonProcess]  # by rank
    llm: Any


@pytest.fixture(scope="module")
def bound() -> Iterator[None]:
    """The workers' core binding, for every engine of this module (workers inherit it)."""
    saved = {k: os.environ.get(k) for k in BIND}
    os.environ.update(BIND)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module", params=["sliding_window", "gdn"])
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cx_root: Path, bound: None
) -> Iterator[Case]:
    from vllm import LLM

    name: str = request.param
    kind = KINDS[name]
    path = kind.build(tmp_path_factory.mktemp(f"{name}-tp2"), **BUILD[name])
    prompts = [prompt(s, length=kind.prompt_len) for s in SEEDS[name]]
    more = {**TP2, "kv_cache_memory_bytes": KV_BYTES[name]}
    reference, logprobs = alone(path, kind, prompts, MARGIN, **more)
    daemons = [start_daemon(cx_root, f"{name}-{r}", cx_root / f"storage-{name}", capacity=HOST, rank=r) for r in (0, 1)]
    try:
        # Both cores run a worker: a daemon may wait for one longer than the default 0.5 s a
        # load may stall, and a load given up is a miss (recomputed), which is not under test
        # here. That is longer than a link survives a daemon that answers nothing (ZeroMQ's
        # heartbeats, about 3 s): a load whose link drops is held until its late copy cannot
        # land (tests/vllm/test_worker.py), so tokens stay vLLM's when links drop too.
        endpoint = f"ipc://{cx_root}/{name}-{{rank}}/cmd.sock"
        config = transfer_config(endpoint, storage="off", retry_interval_s=0.25, max_stall_s=5.0)
        llm = LLM(**args_for(path, kind, **more), kv_transfer_config=config)
        try:
            yield Case(kind, prompts, reference, logprobs, daemons, llm)
        finally:
            shutdown(llm)
    finally:
        for d in daemons:
            d.stop()


def manager(case: Case) -> CachexferdManager:
    """The plug-in's scheduler side: in this process (the engine core runs in-process, only
    the workers are processes of their own)."""
    scheduler = case.llm.llm_engine.engine_core.engine_core.scheduler
    found = scheduler.connector.connector_scheduler.manager
    assert isinstance(found, CachexferdManager)
    return found


def step(case: Case) -> None:
    """A few engine steps on a prompt too short to store anything."""
    generate(case.llm, case.prompts[0][:16], max_tokens=2)


def run_all(case: Case) -> list[int]:
    """Every prompt once, tokens and their logprobs checked against vLLM alone: the cached
    prompt tokens of each."""
    outs = [generate(case.llm, p) for p in case.prompts]
    for i, ((tokens, logprobs, cached), want) in enumerate(zip(outs, case.reference)):
        assert tokens == want, f"prompt {i} ({cached} tokens cached): greedy tokens differ from vLLM alone at TP=2"
        off = max(abs(a - b) for a, b in zip(logprobs, case.logprobs[i]))
        assert off <= LOGPROB_TOLERANCE, f"prompt {i} ({cached} tokens cached): logprobs {off:.4f} from vLLM alone's"
    return [out[2] for out in outs]


def settle(case: Case) -> None:
    """Drives steps until vLLM has learned that every store finished on both ranks (the
    scheduler side has none in flight), so every block is loadable from the host tier."""
    m = manager(case)

    def stored() -> bool:
        step(case)
        index = m.index
        return index is not None and not index._storing

    wait_for(stored, 60, "the stores to finish on both ranks")


def store_and_forget(case: Case) -> None:
    run_all(case)
    settle(case)
    reset_gpu_cache(case.llm)


def loaded(case: Case) -> list[float]:
    """Each rank's daemon's successful SWAP_INs."""
    return [ops(d, "swap_in") for d in case.daemons]


def test_returning_prompts_come_back_cached_with_vllms_tokens(case: Case) -> None:
    m = manager(case)
    first: list[int] = []
    for _ in range(3):  # a link that drops (a loaded machine) fails transfers: recomputed, then tried again
        marks = (m.stats["failed"], m.stats["rebuilds"])
        stored = run_all(case)
        first = first or stored
        settle(case)
        reset_gpu_cache(case.llm)
        before = loaded(case)
        again = run_all(case)  # tokens are checked in every pass
        after = loaded(case)
        if (m.stats["failed"], m.stats["rebuilds"]) == marks:
            break
    assert all(cached == 0 for cached in first)
    # Most, not all: on a loaded 2-core machine one prompt's load may miss and be recomputed
    # (seen once in CI for the GDN model, [768, 768, 0]); tokens are checked on every prompt.
    hits = sum(cached >= case.kind.block for cached in again)
    assert hits >= len(again) - 1 and hits >= 2, f"cached tokens per prompt: {again}"
    assert all(a > b for a, b in zip(after, before)), f"SWAP_INs per rank before {before}, after {after}"


def test_a_host_cache_cleared_on_one_rank_is_never_served(case: Case) -> None:
    store_and_forget(case)
    m = manager(case)
    rebuilds = m.stats["rebuilds"]
    clear_host(case.daemons[1])

    def noticed() -> bool:
        step(case)  # the scheduler side looks at the daemons' pings once per step
        return m.stats["rebuilds"] > rebuilds and m.index is not None and m._adoption is None

    wait_for(noticed, 30, "the plug-in to notice the cleared host cache and read what the daemons hold")
    before = loaded(case)
    cached = run_all(case)
    after = loaded(case)
    assert after[1] == before[1], "rank 1 loaded a block of its cleared host cache"
    assert after[0] == before[0], "rank 0 loaded a block that rank 1 no longer holds"
    assert cached == [0] * len(cached), f"cached tokens per prompt: {cached}"
