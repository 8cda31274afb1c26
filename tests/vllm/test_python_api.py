"""vLLM's Python API with the plug-in, against the same engine without it, then the daemon's
faults with the same engine.

One engine without the plug-in gives the reference tokens, logprobs and request latencies.
One engine with it (a host tier of only 8 blocks, write-through to file storage) then serves
the same prompts after vLLM's own prefix cache was reset, so every cached token must come
back through the daemon: from its host cache, then, after other prompts pushed them out of
the host tier, from storage. A host cache changed under the plug-in (CLEAR_HOST, another
client's writes) must never be served. Then the daemon is stopped (SIGSTOP) and killed
(SIGKILL) while vLLM is idle: no request may take more than a second longer than vLLM
alone, failures are logged as one line per burst, and an idle engine attaches to a new
daemon by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.client import EngineClient  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402

from .engines import Output, generate, reset_gpu_cache, shutdown  # noqa: E402
from .rig import (  # noqa: E402
    BLOCK,
    attached_runner,
    clear_host,
    engine_args,
    metric,
    ops,
    prompt,
    start_daemon,
    transfer_config,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]

PROMPTS = [prompt(seed) for seed in range(40)]
FULL = len(PROMPTS[0]) // BLOCK * BLOCK  # tokens in full blocks: what can be cached
SLACK_S = 1.0  # the most a fault may add to a request


class Reference:
    def __init__(self, outputs: list[Output], latency_s: float) -> None:
        self.outputs = outputs
        self.latency_s = latency_s  # the slowest request of vLLM alone (cold prompts)


def timed(llm: Any, tokens: list[int]) -> tuple[Output, float]:
    start = time.monotonic()
    out = generate(llm, tokens)
    return out, time.monotonic() - start


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    """Outputs and latencies of vLLM without the plug-in."""
    from vllm import LLM

    llm = LLM(**engine_args(tiny_model))
    try:
        generate(llm, PROMPTS[-1])  # first-request set-up out of the latencies
        runs = [timed(llm, p) for p in PROMPTS]
    finally:
        shutdown(llm)
    return Reference([out for out, _ in runs], max(seconds for _, seconds in runs))


@pytest.fixture(scope="module")
def daemons(cx_root: Path) -> Iterator[list[DaemonProcess]]:
    """The daemons of rank 0 in start order: the fault tests kill one and start the next."""
    started = [start_daemon(cx_root, "rank0", cx_root / "storage")]
    yield started
    for d in started:
        d.stop()


@pytest.fixture(scope="module")
def llm(tiny_model: Path, daemons: list[DaemonProcess], reference: object) -> Iterator[Any]:
    from vllm import LLM

    config = transfer_config(daemons[0].endpoint, host_blocks=8, retry_interval_s=0.25)
    engine = LLM(**engine_args(tiny_model), kv_transfer_config=config)
    yield engine
    shutdown(engine)


def comes_back(llm: Any, i: int, reference: Reference) -> bool:
    """Prompt ``i``, then again after vLLM forgot it: True when its blocks came back cached."""
    assert generate(llm, PROMPTS[i])[:2] == reference.outputs[i][:2]
    reset_gpu_cache(llm)
    again = generate(llm, PROMPTS[i])
    assert again[:2] == reference.outputs[i][:2]
    return again[2] >= FULL - BLOCK


def daemon_usable(llm: Any) -> bool:
    """Whether the in-process engine's worker can give its daemon work now."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker.worker
    return bool(worker.conn.usable)


class LogLines(logging.Handler):
    """Records vLLM's log lines (the plug-in logs as vllm.cachexferd)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


@pytest.fixture
def vllm_log() -> Iterator[LogLines]:
    handler = LogLines()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_second_run_loads_through_the_daemon_and_matches_vllm_without_it(
    llm: Any, daemons: list[DaemonProcess], reference: Reference
) -> None:
    daemon = daemons[-1]
    swap_outs = ops(daemon, "swap_out")
    first = generate(llm, PROMPTS[0])
    assert first[2] == 0
    assert first[:2] == reference.outputs[0][:2]
    # vLLM submits a request's stores at a later step, and learns at a later one still that
    # they finished: drive steps (a one-block prompt) until the daemon has done prompt 0's,
    # then one more, so that the second run finds its blocks on the host.
    wait_for(lambda: bool(generate(llm, PROMPTS[39][:40])) and ops(daemon, "swap_out") > swap_outs, 30,
             "prompt 0's blocks to reach the host")  # fmt: skip
    generate(llm, PROMPTS[39][:40])
    reset_gpu_cache(llm)
    swap_ins = ops(daemon, "swap_in")
    again = generate(llm, PROMPTS[0])
    assert again[2] >= FULL - BLOCK, f"only {again[2]} cached tokens came back"
    assert ops(daemon, "swap_in") > swap_ins, "the cached tokens did not come through the daemon"
    assert again[:2] == reference.outputs[0][:2], "loaded KV changed greedy tokens or logprobs"


def stores_per_call(worker: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The stores submitted in each outermost ``one_message`` block (each vLLM call the
    connector wraps), recorded from now on."""
    calls: list[int] = []
    depth = 0
    block, submit = worker.one_message, worker.submit_store

    @contextlib.contextmanager
    def counted_block() -> Iterator[None]:
        nonlocal depth
        if depth == 0:
            calls.append(0)
        depth += 1
        try:
            with block():
                yield
        finally:
            depth -= 1

    def counted_submit(*args: Any) -> bool:
        if depth:
            calls[-1] += 1
        return bool(submit(*args))

    monkeypatch.setattr(worker, "one_message", counted_block)
    monkeypatch.setattr(worker, "submit_store", counted_submit)
    return calls


def test_the_stores_of_a_step_reach_the_daemon_as_one_batch(
    llm: Any, daemons: list[DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """New two-block prompts prefill in one step; vLLM submits their stores together at the
    next one (handle_preemptions), and the plug-in sends what one call submitted as one BATCH,
    whose swaps the daemon groups. (vLLM does not always submit the three in one call: one CI
    run saw them split over two; so the test counts what each call submitted.)"""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    daemon = daemons[-1]
    wait_for(lambda: daemon_usable(llm), 30, "the plug-in's link to its daemon")
    worker = get_kv_transfer_group().connector_worker.worker
    calls = stores_per_call(worker, monkeypatch)
    grouped = metric(daemon, "cachexferd_grouped_swaps_total")
    for attempt in range(3):
        prompts = [{"prompt_token_ids": prompt(100 + 3 * attempt + i, 2 * BLOCK + 8)} for i in range(3)]
        # Four tokens each: the prefill step's stores go out at the next step, inside this call.
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        if any(n >= 2 for n in calls):
            break
    together, submitted = sum(n for n in calls if n >= 2), [n for n in calls if n]
    assert together >= 2, f"no call the connector wraps submitted two stores (stores per call: {submitted})"
    # The daemon counts a BATCH's swaps as grouped when it reads the message.
    wait_for(lambda: metric(daemon, "cachexferd_grouped_swaps_total") - grouped >= together, 10,
             f"{together} swaps grouped (stores per call: {submitted}; worker: {worker.stats})")  # fmt: skip


def test_blocks_evicted_from_the_host_tier_come_back_from_storage(
    llm: Any, daemons: list[DaemonProcess], reference: Reference
) -> None:
    daemon = daemons[-1]
    for i in (1, 2):  # 12 new blocks push prompt 0 out of 8 host blocks
        assert generate(llm, PROMPTS[i])[:2] == reference.outputs[i][:2]
    reset_gpu_cache(llm)
    loads = ops(daemon, "load")
    again = generate(llm, PROMPTS[0])
    assert again[2] >= FULL - BLOCK
    assert ops(daemon, "load") > loads, "prompt 0 should have come back from storage"
    assert again[:2] == reference.outputs[0][:2]


def refused(daemon: DaemonProcess) -> float:
    return metric(daemon, "cachexferd_commands_total", op="swap_in", outcome="host_block_changed")


def test_a_host_cache_changed_under_vllm_is_never_served(
    llm: Any, daemons: list[DaemonProcess], reference: Reference, vllm_log: LogLines
) -> None:
    """CLEAR_HOST, and another client overwriting the plug-in's host blocks: vLLM's outputs
    stay those of vLLM alone (the daemon refuses the stale reads; vLLM recomputes). Served,
    the zeros or foreign bytes would change them."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    daemon = daemons[-1]
    assert generate(llm, PROMPTS[3])[:2] == reference.outputs[3][:2]  # its blocks are on the host
    reset_gpu_cache(llm)
    clear_host(daemon)
    assert generate(llm, PROMPTS[3])[:2] == reference.outputs[3][:2], "a cleared host block was served"
    # The scheduler side notices the new host-cache generation at a ping and starts its host
    # tier afresh; let that happen before the next case, so that prompt 4 lands in the new one.
    wait_for(lambda: bool(generate(llm, PROMPTS[38][:40])) and vllm_log.count("host cache was cleared") >= 1, 20,
             "the scheduler to notice the cleared host cache")  # fmt: skip
    generate(llm, PROMPTS[38][:40])  # a step for the store the loop's last request left

    swap_outs = ops(daemon, "swap_out")
    assert generate(llm, PROMPTS[4])[:2] == reference.outputs[4][:2]
    # Every store must be done before the other client writes (a store after it would
    # restore the plug-in's blocks): drive steps until prompt 4's is, and none is in flight
    # (the prompt that drives them may be recomputed and stored, or found in storage).
    worker = get_kv_transfer_group().connector_worker.worker
    wait_for(lambda: bool(generate(llm, PROMPTS[39][:40])) and ops(daemon, "swap_out") > swap_outs
             and worker.jobs_in_flight == 0, 30, "prompt 4's blocks to reach the host")  # fmt: skip
    reset_gpu_cache(llm)
    before = refused(daemon)
    with EngineClient([daemon.endpoint]) as other:  # another client writes every host block vLLM uses
        other.connect(timeout_s=10)
        done = other.wait([other.swap_out(list(range(8)), list(range(8)))], timeout_s=30)
        assert all(c.ok for c in done.values())
    again = generate(llm, PROMPTS[4])
    assert again[:2] == reference.outputs[4][:2], "a host block another client rewrote was served"
    assert refused(daemon) > before, "the daemon should have refused the plug-in's read"
    time.sleep(2.2)  # a burst of failures is reported once it is over, in one line with counts
    generate(llm, PROMPTS[4])
    bursts = [line for line in vllm_log.lines if "transfer(s) failed over" in line]
    assert 1 <= len(bursts) <= 2 and any("errors: HOST_BLOCK_CHANGED" in line for line in bursts), vllm_log.lines


def test_a_stopped_daemon_costs_a_request_at_most_a_second(
    llm: Any, daemons: list[DaemonProcess], reference: Reference
) -> None:
    """SIGSTOP with the prompt's blocks on the host: the plug-in sees the daemon stopped and
    sends it nothing (loads are recomputed, stores skipped), keeps its attachment, and uses
    it again once it runs. (A hang the plug-in cannot see is test_worker.py's.)"""
    daemon = daemons[-1]
    assert generate(llm, PROMPTS[5])[:2] == reference.outputs[5][:2]
    reset_gpu_cache(llm)
    daemon.signal(signal.SIGSTOP)
    try:
        for i in (5, 6, 7):  # a returning prompt (its load hangs), then new ones (their stores)
            out, seconds = timed(llm, PROMPTS[i])
            assert out[:2] == reference.outputs[i][:2]
            assert seconds <= reference.latency_s + SLACK_S, f"request took {seconds:.2f}s with a stopped daemon"
    finally:
        daemon.signal(signal.SIGCONT)
    swap_ins = ops(daemon, "swap_in")
    wait_for(lambda: daemon_usable(llm), 20, "the daemon to be usable again")
    assert comes_back(llm, 8, reference)
    assert ops(daemon, "swap_in") > swap_ins
    assert attached_runner(daemon) == os.getpid(), "a stopped daemon must keep its attachment"
    assert metric(daemon, "cachexferd_commands_total", op="attach", outcome="ok") == 1, "the link flapped"


def test_a_daemon_killed_while_idle_neither_stalls_nor_storms(
    llm: Any, daemons: list[DaemonProcess], reference: Reference, vllm_log: LogLines, cx_root: Path
) -> None:
    daemon = daemons[-1]
    for i in range(10, 14):  # blocks on the host, vLLM's pool full of cached blocks
        assert generate(llm, PROMPTS[i])[:2] == reference.outputs[i][:2]
    reset_gpu_cache(llm)
    time.sleep(0.5)  # idle
    daemon.kill()
    # Returning prompts (the scheduler still believes their blocks are on the host), and new
    # ones that make vLLM reuse blocks, the first of them maybe with stores in flight.
    for i in [*range(10, 14), *range(14, 26)]:
        out, seconds = timed(llm, PROMPTS[i])
        assert out[:2] == reference.outputs[i][:2]
        assert seconds <= reference.latency_s + SLACK_S, f"prompt {i} took {seconds:.2f}s after the daemon died"
    recovered = vllm_log.count("Recovered from KV load failure")
    assert recovered <= 4, f"{recovered} load-failure recoveries: failed loads are not forgotten"

    # A new daemon on the same endpoint: the idle engine attaches by itself, and uses it.
    new = start_daemon(cx_root, "rank0", cx_root / "storage")
    daemons.append(new)
    wait_for(lambda: attached_runner(new) == os.getpid(), 30, "the idle engine to attach to the new daemon")
    returning = iter(range(26, 36))
    wait_for(lambda: comes_back(llm, next(returning), reference), 20, "a prompt to come back through the new daemon")
    bursts = [line for line in vllm_log.lines if "transfer(s) failed over" in line]
    assert len(bursts) <= 2, bursts
