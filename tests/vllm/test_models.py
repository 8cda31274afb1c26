"""Models with several KV-cache groups through the plug-in: sliding window beside full
attention, and gated-delta-net state beside full attention (MLA: test_mla.py).

With vLLM's KV cache smaller than the prompts and its prefix cache reset
between passes, returning prompts must come back cached through the daemon with vLLM's own
greedy tokens; a host cache cleared, a host block rewritten by another client and a new
weights version must never be served (the daemon's SWAP_IN successes do not move, tokens
stay vLLM's).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.client import EngineClient  # noqa: E402
from cachexferd.integrations.vllm.tiny_models import KINDS, Kind  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402
from cachexferd.protocol import SetWeights  # noqa: E402

from .engines import generate, reset_gpu_cache, shutdown  # noqa: E402
from .rig import clear_host, engine_args, metric, ops, prompt, start_daemon, transfer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
HOST = "16MiB"  # the daemon's host cache: every prompt's blocks fit
# nats: a greedy token's logprob against vLLM alone's. A correct load gives vLLM alone's
# logprobs exactly (as does vLLM's own prefix cache); at TP=2, blocks loaded into the wrong
# slots on one rank moved them by 0.06 to 0.14 per prompt without changing a greedy token.
LOGPROB_TOLERANCE = 0.01


@dataclass
class Case:
    kind: Kind
    prompts: list[list[int]]
    reference: list[list[int]]  # vLLM alone's greedy tokens per prompt
    logprobs: list[list[float]]  # vLLM alone's logprob of each of them
    daemon: DaemonProcess
    llm: Any


def prompts_for(kind: Kind, count: int = 3) -> list[list[int]]:
    return [prompt(300 + seed, length=kind.prompt_len) for seed in range(count)]


def args_for(path: Path, kind: Kind, **more: Any) -> dict[str, Any]:
    return {**engine_args(path), **kind.engine, "kv_cache_memory_bytes": kind.kv_bytes, **more}


def tokens_alone(path: Path, kind: Kind, prompts: list[list[int]], **more: Any) -> list[list[int]]:
    return alone(path, kind, prompts, 0.0, **more)[0]


def alone(
    path: Path, kind: Kind, prompts: list[list[int]], margin: float, **more: Any
) -> tuple[list[list[int]], list[list[float]]]:
    """vLLM alone's greedy tokens and their logprobs per prompt (a fresh engine, each prompt
    once), every token checked to lead the runner-up by ``margin``."""
    from vllm import LLM, SamplingParams

    llm = LLM(**args_for(path, kind, **more))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    finally:
        shutdown(llm)
    tokens, logprobs = [], []
    for i, out in enumerate(outs):
        tokens.append(list(out.token_ids))
        logprobs.append([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
        top2 = [sorted((x.logprob for x in lp.values()), reverse=True)[:2] for lp in out.logprobs]
        margins = [a - b for a, b in top2]
        assert min(margins) >= margin, (
            f"prompt {i}: vLLM alone's greedy tokens lead the runner-up by {margins}: pick prompts without near ties"
        )
    return tokens, logprobs


@pytest.fixture(scope="module", params=["sliding_window", "gdn"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cx_root: Path) -> Iterator[Case]:
    from vllm import LLM

    kind = KINDS[request.param]
    path = kind.build(tmp_path_factory.mktemp(request.param))
    prompts = prompts_for(kind)
    reference, logprobs = alone(path, kind, prompts, 0.0)
    daemon = start_daemon(cx_root, request.param, cx_root / f"storage-{request.param}", capacity=HOST)
    config = transfer_config(daemon.endpoint, storage="off", retry_interval_s=0.25)
    llm = LLM(**args_for(path, kind), kv_transfer_config=config)
    yield Case(kind, prompts, reference, logprobs, daemon, llm)
    shutdown(llm)
    daemon.stop()


def run_all(case: Case) -> list[tuple[list[int], int]]:
    """Every prompt once: (greedy tokens, cached prompt tokens), tokens and their logprobs
    checked against vLLM alone."""
    outs = [generate(case.llm, p) for p in case.prompts]
    for i, ((tokens, logprobs, cached), want) in enumerate(zip(outs, case.reference)):
        assert tokens == want, f"prompt {i} ({cached} tokens cached): greedy tokens differ from vLLM alone"
        off = max(abs(a - b) for a, b in zip(logprobs, case.logprobs[i]))
        assert off <= LOGPROB_TOLERANCE, f"prompt {i} ({cached} tokens cached): logprobs {off:.4f} from vLLM alone's"
    return [(out[0], out[2]) for out in outs]


def settle(case: Case) -> None:
    """Drives steps until the plug-in has no store in flight, so every block is on the host."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker.worker
    short = case.prompts[0][:16]
    wait_for(lambda: bool(generate(case.llm, short)) and worker.jobs_in_flight == 0, 30, "the stores to finish")
    generate(case.llm, short)  # one more step: vLLM learns that the last stores finished


def loaded(case: Case) -> float:
    return ops(case.daemon, "swap_in")


def refused(case: Case, outcome: str) -> float:
    return metric(case.daemon, "cachexferd_commands_total", op="swap_in", outcome=outcome)


def store_and_forget(case: Case) -> None:
    run_all(case)
    settle(case)
    reset_gpu_cache(case.llm)


def test_returning_prompts_come_back_cached_with_vllms_tokens(case: Case) -> None:
    first = run_all(case)
    assert all(cached == 0 for _, cached in first)
    settle(case)
    reset_gpu_cache(case.llm)
    before = loaded(case)
    again = run_all(case)
    assert all(cached >= case.kind.block for _, cached in again), f"cached tokens per prompt: {again}"
    assert loaded(case) > before, "the cached tokens did not come through the daemon"


def test_a_cleared_host_cache_is_never_served(case: Case) -> None:
    store_and_forget(case)
    clear_host(case.daemon)
    before = loaded(case)
    run_all(case)
    assert loaded(case) == before, "a block of the cleared host cache was loaded"


def test_a_host_block_rewritten_by_another_client_is_never_served(case: Case) -> None:
    time.sleep(0.6)  # the scheduler side notices the cleared cache of the previous test at a ping
    store_and_forget(case)
    host_blocks = int(case.daemon.status()["host_cache"]["num_blocks"])
    before, refusals = loaded(case), refused(case, "host_block_changed")
    with EngineClient([case.daemon.endpoint]) as other:
        other.connect(timeout_s=10)
        devices = int(other.status()[0]["device"]["layout"]["num_blocks"])
        req = other.swap_out([h % devices for h in range(host_blocks)], list(range(host_blocks)))
        assert other.wait([req], timeout_s=30)[req].ok
    run_all(case)
    assert loaded(case) == before, "a host block another client rewrote was loaded"
    assert refused(case, "host_block_changed") > refusals, "the plug-in's reads should have been refused"


def test_blocks_of_older_weights_are_never_served(case: Case) -> None:
    store_and_forget(case)
    before, refusals = loaded(case), refused(case, "stale_weights")
    with EngineClient([case.daemon.endpoint]) as other:
        other.connect(timeout_s=10)
        other.call_all(SetWeights, version=7)
    run_all(case)
    assert loaded(case) == before, "a block of the previous weights was loaded"
    # Either the daemon refused the plug-in's reads, or the plug-in saw the new version at a
    # ping first and dropped its host tier (then it planned no read): never a stale load.
    assert refused(case, "stale_weights") >= refusals
