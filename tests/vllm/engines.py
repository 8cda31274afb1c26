"""Running prompts through vLLM's Python API (imported only by tests that found vLLM)."""

from __future__ import annotations

import gc
from typing import Any

from .rig import wait_for

Output = tuple[list[int], list[float], int]  # greedy tokens, their logprobs, cached prompt tokens


def generate(llm: Any, tokens: list[int], max_tokens: int = 8) -> Output:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)]
    return list(completion.token_ids), logprobs, int(out.num_cached_tokens or 0)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def reset_gpu_cache(llm: Any) -> None:
    """Empties vLLM's own prefix cache (refused while offload transfers still hold blocks)."""
    wait_for(llm.reset_prefix_cache, 30, "vLLM's prefix cache reset")
