"""MLA through the plug-in: vLLM turns prefix caching off for MLA on CPUs (its attention
cannot start from a loaded prefix), so the plug-in stores and never loads, with vLLM's own
greedy tokens; at TP=2 it writes each latent block to storage once, as at TP=1 (the same
objects, the same bytes), since every rank holds the same latent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.integrations.vllm.tiny_models import KINDS, Kind  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402

from .engines import generate, shutdown  # noqa: E402
from .rig import ops, start_daemon, transfer_config, wait_for  # noqa: E402
from .test_models import HOST, args_for, prompts_for, tokens_alone  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def stored_objects(root: Path) -> tuple[int, int]:
    """(objects, bytes) of a file storage directory."""
    files = [p for p in root.rglob("*") if p.is_file() and len(p.name) == 32]
    return len(files), sum(p.stat().st_size for p in files)


def idle(daemons: list[DaemonProcess]) -> bool:
    return all(not sum(d.status()["commands"].values()) for d in daemons)


def run_mla(
    path: Path, kind: Kind, root: Path, tp: int, prompts: list[list[int]]
) -> tuple[list[list[int]], Any, list[float]]:
    """The prompts through vLLM with the plug-in at TP=``tp`` (one daemon per rank, one
    storage directory): (greedy tokens, (objects, bytes) stored, STOREs per rank's daemon)."""
    from vllm import LLM

    storage = root / f"storage-tp{tp}"
    daemons = [start_daemon(root, f"mla{tp}-{r}", storage, capacity=HOST, rank=r) for r in range(tp)]
    try:
        config = transfer_config(f"ipc://{root}/mla{tp}-{{rank}}/cmd.sock")
        more = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
        llm = LLM(**args_for(path, kind, **more), kv_transfer_config=config)
        try:
            tokens = [generate(llm, p)[0] for p in prompts]
            swapped = lambda: all(ops(d, "swap_out") > 0 for d in daemons)  # noqa: E731
            wait_for(lambda: bool(generate(llm, prompts[0][:8])) and swapped(), 30, "the stores to start")
        finally:
            shutdown(llm)  # its workers let their stores finish first
        wait_for(lambda: idle(daemons), 30, "the daemons to finish every write")
        return tokens, stored_objects(storage), [ops(d, "store") for d in daemons]
    finally:
        for d in daemons:
            d.stop()


def test_mla_latents_are_stored_once_whatever_the_tp_size(
    tmp_path_factory: pytest.TempPathFactory, cx_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = KINDS["mla"]
    path = kind.build(tmp_path_factory.mktemp("mla"))
    prompts = prompts_for(kind, count=2)
    reference = tokens_alone(path, kind, prompts)
    tokens1, stored1, _ = run_mla(path, kind, cx_root, 1, prompts)
    assert tokens1 == reference, "greedy tokens differ from vLLM alone (TP=1)"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a worker per core (vLLM needs a binding for TP=2)
    reference2 = tokens_alone(path, kind, prompts, tensor_parallel_size=2, distributed_executor_backend="mp")
    tokens2, stored2, stores = run_mla(path, kind, cx_root, 2, prompts)
    assert stored1[0] >= len(prompts) * 2, f"too few objects at TP=1: {stored1}"
    assert stored2 == stored1, f"TP=2 stored (objects, bytes) {stored2}, TP=1 {stored1}"
    # Written once, not once per rank: rank 1 stores nothing (the same names written twice
    # would leave the same files, at twice the write bandwidth).
    assert stores[0] > 0 and stores[1] == 0, f"STOREs per rank: {stores}"
    assert tokens2 == reference2, "greedy tokens differ from vLLM alone (TP=2)"
