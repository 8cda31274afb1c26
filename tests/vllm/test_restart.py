"""A vLLM restarted beside a running daemon, storage off: the blocks its predecessor left in
the daemon's host cache come back as hits (protocol 1.3: the daemon keeps each host block's
identity key, the new instance lists them and reads them by key), with the tokens of vLLM
alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

import zmq  # noqa: E402

from cachexferd.client.link import Link, check_ok  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402
from cachexferd.protocol import HostKeys  # noqa: E402

from .engines import Output, generate, shutdown  # noqa: E402
from .rig import BLOCK, engine_args, ops, prompt, start_daemon, transfer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [prompt(700 + seed) for seed in range(4)]  # four conversations that come back
FULL = len(PROMPTS[0]) // BLOCK * BLOCK  # tokens in full blocks: what can be cached


def host_keys(daemon: DaemonProcess) -> dict[int, str]:
    """The daemon's keyed host blocks, read as any client would (HOST_KEYS, page by page)."""
    ctx: zmq.Context[Any] = zmq.Context()
    link = Link(ctx, daemon.endpoint)
    found: dict[int, str] = {}
    try:
        start: int | None = 0
        while start is not None:
            page = check_ok(link.call(HostKeys(req_id=start + 1, start=start), 10.0))
            found.update(zip(page["host_ids"], page["keys"]))
            start = page["next"]
    finally:
        link.close()
        ctx.term()
    return found


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[Output]:
    """vLLM alone."""
    from vllm import LLM

    llm = LLM(**engine_args(tiny_model))
    try:
        return [generate(llm, p) for p in PROMPTS]
    finally:
        shutdown(llm)


def test_a_restarted_vllm_hits_the_host_blocks_its_predecessor_left(
    tiny_model: Path, cx_root: Path, reference: list[Output]
) -> None:
    from vllm import LLM

    daemon = start_daemon(cx_root, "restart", cx_root / "unused", **{"storage.backend": "none"})
    # max_stall_s: a busy 2-core machine must not turn a late load into a recompute here.
    config = transfer_config(daemon.endpoint, storage="off", retry_interval_s=0.25, max_stall_s=5.0)
    try:
        first = LLM(**engine_args(tiny_model), kv_transfer_config=config)
        try:
            assert [generate(first, p)[0] for p in PROMPTS] == [tokens for tokens, _, _ in reference]
            # vLLM completes stores a step or two later: step until the host tier holds them all.
            want = len(PROMPTS) * (FULL // BLOCK)
            wait_for(lambda: bool(generate(first, [5, 6, 7])) and len(host_keys(daemon)) >= want, 30,
                     "every prompt's full blocks in the host tier")  # fmt: skip
        finally:
            shutdown(first)
        assert daemon.status()["storage"]["backend"] == "none"

        second = LLM(**engine_args(tiny_model), kv_transfer_config=config)
        try:
            # Its connection and index come up in the first steps, and the host keys are read
            # beside them: a short unrelated prompt lets that happen.
            generate(second, [9, 10, 11])
            loads = ops(daemon, "swap_in")
            returning = [generate(second, p) for p in PROMPTS]
        finally:
            shutdown(second)
        for (tokens, _, cached), (want_tokens, _, _) in zip(returning, reference):
            assert cached >= FULL - BLOCK, f"a returning prompt got {cached} cached tokens"
            assert tokens == want_tokens
        assert ops(daemon, "swap_in") > loads
    finally:
        daemon.stop()
