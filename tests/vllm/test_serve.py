"""``vllm serve`` with the plug-in next to ``cachexferd serve`` daemons, all separate
processes, driven over HTTP (loopback) with token-id prompts.

Two instances of the same model share one storage directory, each with its own daemon:
the first is started before its daemon exists (and attaches, idle, when the daemon comes
up); the second gets the first one's prefixes from storage. Then each is killed the hard
way: the first by a SIGKILL of its worker (vLLM's engine process), the second by a SIGKILL
of its main process, which orphans its worker. Either way nothing of the plug-in is left in
/dev/shm and the daemon is free for the next vLLM. (A SIGTERM stop is test_tp.py's.)
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.client import RunnerClient  # noqa: E402
from cachexferd.client.runner import ShmKVCache  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402
from cachexferd.protocol import KVLayout  # noqa: E402

from .rig import (  # noqa: E402
    BLOCK,
    attached_runner,
    clear_host,
    device_state,
    ops,
    plugin_shm_files,
    prompt,
    start_daemon,
    transfer_config,
    wait_for,
)
from .server import VllmServer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
FULL = len(prompt(0)) // BLOCK * BLOCK
# How the plug-in describes the tiny model's KV cache to the daemon: one uint8 page per layer.
VLLM_PAGES = KVLayout(num_layers=2, kv_tensors=1, num_blocks=16, block_size=1, num_kv_heads=1, head_dim=8192,
                      dtype="uint8")  # fmt: skip


class Instance:
    def __init__(self, server: VllmServer, daemon: DaemonProcess | None) -> None:
        self.server = server
        self.daemon = daemon


@pytest.fixture(scope="module")
def instances(tiny_model: Path, cx_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Instance]]:
    """[first, second]: the first's daemon starts only in the first test."""
    logs = tmp_path_factory.mktemp("serve")
    storage = cx_root / "storage"
    second_daemon = start_daemon(cx_root, "second", storage)
    endpoints = [f"ipc://{cx_root / 'first' / 'cmd.sock'}", second_daemon.endpoint]
    servers = [
        VllmServer(tiny_model, logs / f"vllm-{i}.log", transfer_config(e, retry_interval_s=0.5))
        for i, e in enumerate(endpoints)
    ]
    started = [Instance(servers[0], None), Instance(servers[1], second_daemon)]
    try:
        for server in servers:  # one after the other: two engines starting at once thrash 2 cores
            server.start()
        yield started
    finally:
        for instance in started:
            instance.server.stop()
            if instance.daemon is not None:
                instance.daemon.stop()


def test_an_idle_server_attaches_to_a_daemon_started_after_it(instances: list[Instance], cx_root: Path) -> None:
    first = instances[0]
    first.daemon = start_daemon(cx_root, "first", cx_root / "storage")
    # No request: the plug-in's own thread finds the daemon and attaches vLLM's cache.
    wait_for(lambda: attached_runner(first.daemon) is not None, 30, "the idle server to attach")  # type: ignore[arg-type]


def comes_back(server: VllmServer, tokens: list[int]) -> bool:
    """The prompt, then again after vLLM forgot it: True when it came back cached (the
    first request after an attach may find the scheduler side not ready yet)."""
    first = server.complete(tokens)
    assert first[2] == 0
    server.reset()
    again = server.complete(tokens)
    assert again[:2] == first[:2], "loaded KV changed greedy tokens or logprobs"
    return again[2] >= FULL - BLOCK


def test_served_prompt_comes_back_through_the_daemon(instances: list[Instance]) -> None:
    server, daemon = instances[0].server, instances[0].daemon
    assert daemon is not None
    seeds = iter(range(10, 20))
    wait_for(lambda: comes_back(server, prompt(next(seeds))), 30, "a prompt to come back cached")
    assert ops(daemon, "swap_in") >= 1

    tokens = prompt(next(seeds))
    first = server.complete(tokens)
    server.reset()
    clear_host(daemon)  # the plug-in notices: the cleared blocks are recomputed, never served
    assert server.complete(tokens)[:2] == first[:2]


def test_a_second_instance_gets_the_first_ones_prefixes_from_storage(instances: list[Instance]) -> None:
    first, second = instances
    assert second.daemon is not None
    tokens = prompt(30)
    wrote = first.server.complete(tokens)
    wait_for(lambda: ops(first.daemon, "store") >= 1, 30, "the first instance's write-through")  # type: ignore[arg-type]
    loads = ops(second.daemon, "load")
    got = second.server.complete(tokens)
    assert got[2] >= FULL - BLOCK, f"the second instance got only {got[2]} cached tokens"
    assert ops(second.daemon, "load") > loads, "they should have come from storage"
    assert got[:2] == wrote[:2]


def daemon_is_free(daemon: DaemonProcess) -> None:
    """Detached, no file of the plug-in left, and a new runner can attach."""
    wait_for(lambda: device_state(daemon) == "detached", 30, "the daemon to detach the dead runner")
    cache = ShmKVCache(VLLM_PAGES)  # the layout the daemon's host cache is bound to
    try:
        with RunnerClient(daemon.endpoint, timeout_s=30) as runner:
            runner.attach(cache)
            runner.detach()
    finally:
        cache.close()


def test_sigkill_of_the_worker_leaves_nothing_behind(instances: list[Instance]) -> None:
    daemon = instances[0].daemon
    assert daemon is not None
    worker = attached_runner(daemon)
    assert worker is not None
    os.kill(worker, signal.SIGKILL)
    daemon_is_free(daemon)
    assert plugin_shm_files([worker]) == []


def test_sigkill_of_the_main_process_leaves_nothing_behind(instances: list[Instance]) -> None:
    """vLLM's engine process outlives its killed parent: the plug-in notices it is orphaned
    and lets go of the daemon by itself."""
    server, daemon = instances[1].server, instances[1].daemon
    assert daemon is not None
    worker = attached_runner(daemon)
    assert worker is not None and worker != server.process.pid
    server.process.signal(signal.SIGKILL)
    try:
        daemon_is_free(daemon)
        assert plugin_shm_files([worker]) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)  # the orphan itself is vLLM's to end, not ours
