"""Tensor parallelism 2 on a 2-core machine: two vLLM workers bound one per core
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``), two daemons, with and without a CPU-bound process
beside them. Greedy tokens must be vLLM's own (TP=2 without the plug-in), returning prompts
must come back cached (without the busy process), and the link to a daemon starved of CPU
must not flap (no re-attach). Then ``vllm serve`` is stopped with SIGTERM: nothing of the plug-in stays in
/dev/shm and both daemons are free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.launch import DaemonProcess  # noqa: E402

from .engines import generate, shutdown  # noqa: E402
from .rig import (  # noqa: E402
    BLOCK,
    BusyLoops,
    attached_runner,
    device_state,
    engine_args,
    metric,
    plugin_shm_files,
    prompt,
    start_daemon,
    transfer_config,
    wait_for,
)
from .server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PROMPTS = [prompt(100 + seed) for seed in range(12)]
FULL = len(PROMPTS[0]) // BLOCK * BLOCK
ROUNDS = 10


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    """Greedy tokens of vLLM alone with the same TP=2 layout and binding."""
    from vllm import LLM

    saved = {k: os.environ.get(k) for k in BIND}
    os.environ.update(BIND)
    try:
        llm = LLM(**{**engine_args(tiny_model), "tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
        try:
            return [generate(llm, p)[0] for p in PROMPTS]
        finally:
            shutdown(llm)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def daemons(cx_root: Path) -> Iterator[list[DaemonProcess]]:
    started = [start_daemon(cx_root, f"tp{rank}", cx_root / "storage", rank=rank) for rank in (0, 1)]
    yield started
    for d in started:
        d.stop()


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, daemons: list[DaemonProcess], cx_root: Path, reference: object,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:  # fmt: skip
    # Every core runs a worker (and, in the second test, a busy loop besides): the daemons
    # share them. The plug-in's defaults (max_stall_s 0.5) hold: the daemons run at their
    # default CPU priority (daemon.nice, -10 as root), which lets them run when a command comes.
    transfer = transfer_config(f"ipc://{cx_root}/tp{{rank}}/cmd.sock")
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("tp") / "vllm.log", transfer, tp=2, env=BIND)
    srv.start()
    yield srv
    srv.stop()


def attaches(daemon: DaemonProcess) -> float:
    return metric(daemon, "cachexferd_commands_total", op="attach", outcome="ok")


# What the plug-in logs when a daemon did not answer within max_stall_s for a moment (not
# lost): its socket connection dropped, a load was given up, or a copy came too late. A
# 2-core machine that stalls for seconds under the other jobs of a shared host is enough.
TRANSIENT = ("no new transfers until it answers", "DAEMON_LOST", "not done after", "EXPIRED")


def returning_prompts_come_back(
    server: VllmServer, reference: list[list[int]], rounds: list[list[int]], require_hits: bool = True
) -> None:
    """Greedy tokens are vLLM's own, every time. A returning prompt comes back cached unless
    the plug-in logged, since the prompt was first sent, that a daemon was out of reach;
    the rounds (fresh prompts each) go on until one prompt has come back cached.
    ``require_hits=False`` (a daemon starved of CPU): only the tokens are checked, every
    round runs; a store that ends after its prompt returned is a miss vLLM recomputes."""
    first = len(server.log_text())
    for indices in rounds:
        start = len(server.log_text())
        for i in indices:
            tokens, _, cached = server.complete(PROMPTS[i])
            assert server.tokens_of(tokens) == reference[i], f"prompt {i}: greedy tokens differ from vLLM alone"
            assert cached == 0
        server.reset()
        hits = 0
        for i in indices:
            tokens, _, cached = server.complete(PROMPTS[i])
            assert server.tokens_of(tokens) == reference[i], f"prompt {i}: loaded KV changed the greedy tokens"
            news = server.log_text()[start:]
            if require_hits:
                assert cached > 0 or any(t in news for t in TRANSIENT), f"prompt {i} came back with no cached tokens"
            hits += cached > 0
        if hits and require_hits:
            return
    if not require_hits:
        return
    stalls = [line for line in server.log_text()[first:].splitlines() if any(t in line for t in TRANSIENT)]
    shown = "\n".join(stalls[:20])
    raise AssertionError(f"no returning prompt came back cached in {len(rounds)} rounds (each miss a stall):\n{shown}")


def test_two_workers_two_daemons_match_vllm_and_hit(
    server: VllmServer, daemons: list[DaemonProcess], reference: list[list[int]]
) -> None:
    wait_for(lambda: all(attached_runner(d) is not None for d in daemons), 60, "both workers to attach")
    assert len({attached_runner(d) for d in daemons}) == 2, "one worker per daemon"
    returning_prompts_come_back(server, reference, [[0, 1], [2, 3], [4, 5]])


def test_busy_cores_keep_the_cache_on_the_defaults(server: VllmServer, reference: list[list[int]]) -> None:
    """Ten rounds (a fresh prompt each, vLLM's prefix cache reset before it returns), on the
    plug-in's defaults while every core runs a worker: the returning prompt comes back
    cached in at least 9 of 10, and never with other tokens."""
    hits = []
    for r in range(ROUNDS):
        tokens = prompt(500 + r)
        first, _, _ = server.complete(tokens)
        server.reset()
        again, _, cached = server.complete(tokens)
        assert server.tokens_of(again) == server.tokens_of(first), f"round {r}: loaded KV changed the greedy tokens"
        hits.append(cached >= FULL)
    stalls = [line for line in server.log_text().splitlines() if any(t in line for t in TRANSIENT)]
    assert sum(hits) >= ROUNDS - 1, f"cached in {sum(hits)} of {ROUNDS} rounds; the plug-in logged:\n" + "\n".join(
        stalls[-10:]
    )


def test_cpu_load_beside_them_does_not_make_the_link_flap(
    server: VllmServer, daemons: list[DaemonProcess], reference: list[list[int]]
) -> None:
    before = [attaches(d) for d in daemons]
    with BusyLoops(1):  # a CPU-bound process beside the workers and daemons, which have no core to spare
        # Tokens exact and the link kept; hits are not required here (see require_hits).
        returning_prompts_come_back(server, reference, [[6, 7], [8, 9], [10, 11]], require_hits=False)
    assert [attaches(d) for d in daemons] == before, "a starved daemon was taken for a dead one"
    # A daemon answering a connection the plug-in closed (a reconnect) logs "reply dropped";
    # one whose connection ZeroMQ closed during a stall of several seconds may too.
    stalled = "dropped; no new transfers" in server.log_text()
    for d in daemons:
        assert stalled or "reply dropped" not in d.log_tail(400), d.log_tail(40)


def test_sigterm_stop_leaves_nothing_behind(server: VllmServer, daemons: list[DaemonProcess]) -> None:
    workers = [attached_runner(d) for d in daemons]
    assert all(workers)
    server.stop()
    for d in daemons:
        wait_for(lambda d=d: device_state(d) == "detached", 30, "the daemon to be free")  # type: ignore[misc]
    assert plugin_shm_files([w for w in workers if w]) == []
