"""vLLM's processes, as the engine-side liveness checks see them: whose parents a worker watches."""

from __future__ import annotations

from ..engine.liveness import engine_lineage

# vLLM titles the processes it starts (engine core, workers) "VLLM::...".
VLLM_TITLES = (b"VLLM::",)


def vllm_lineage() -> list[tuple[int, int]]:
    """(pid, start time) of vLLM's processes above this one, up to vLLM's main process (empty
    in a process the user started, e.g. vLLM's in-process engine). vLLM leaves its engine and
    worker processes running when its main process dies: a worker that finds one of these
    gone is orphaned and lets go of its daemon."""
    return engine_lineage(VLLM_TITLES)
