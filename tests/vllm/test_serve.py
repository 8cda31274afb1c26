"""``vllm serve`` with the plug-in next to a ``cachexferd serve`` daemon, both separate
processes, driven over HTTP (loopback) with token-id prompts; then the daemon's faults."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.launch import DaemonProcess  # noqa: E402

from .rig import BLOCK, attached_runner, clear_host, ops, prompt, start_daemon, transfer_config, wait_for  # noqa: E402
from .server import VllmServer, remove_kv_files  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]
FULL = len(prompt(0)) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def daemons(cx_root: Path) -> Iterator[list[DaemonProcess]]:
    """The daemons of rank 0, in start order (the fault test replaces the first)."""
    started = [start_daemon(cx_root, "rank0", cx_root / "storage")]
    yield started
    for d in started:
        d.stop()


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, daemons: list[DaemonProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    # A 1 s probe interval and a 5 s transfer timeout keep the fault test short.
    transfer = transfer_config(daemons[0].endpoint, retry_interval_s=0.5, transfer_timeout_s=5.0)
    srv = VllmServer(tiny_model, tmp_path_factory.mktemp("serve") / "vllm.log", transfer).start()
    runner = attached_runner(daemons[0])
    yield srv
    srv.stop()
    if runner is not None:
        remove_kv_files(runner)


def reset(server: VllmServer) -> None:
    wait_for(server.reset_prefix_cache, 30, "vLLM's prefix cache reset")


def test_served_prompt_comes_back_through_the_daemon(server: VllmServer, daemons: list[DaemonProcess]) -> None:
    daemon = daemons[0]
    tokens = prompt(10)
    first = server.complete(tokens)
    assert first[2] == 0
    reset(server)
    swap_ins = ops(daemon, "swap_in")
    again = server.complete(tokens)
    assert again[2] >= FULL - BLOCK, f"usage reports only {again[2]} cached tokens"
    assert ops(daemon, "swap_in") > swap_ins
    assert again[:2] == first[:2]

    reset(server)
    clear_host(daemon)  # negative control: the loaded bytes are now zeros
    assert server.complete(tokens)[:2] != first[:2]


def test_daemon_faults_fall_back_to_recompute(server: VllmServer, daemons: list[DaemonProcess], cx_root: Path) -> None:
    daemon = daemons[0]
    tokens, long_prompt = prompt(20), prompt(21)
    first = server.complete(tokens)
    reset(server)

    # Freeze the daemon, then ask for a prompt whose blocks it holds: the load can't finish.
    # Meanwhile a long generation runs; the daemon dies (SIGKILL) in the middle of it.
    daemon.signal(signal.SIGSTOP)
    results: dict[str, Any] = {}

    def ask(name: str, toks: list[int], n: int) -> None:
        try:
            results[name] = server.complete(toks, max_tokens=n)
        except Exception as exc:  # reported by the asserts below
            results[name] = exc

    threads = [threading.Thread(target=ask, args=a) for a in (("load", tokens, 8), ("long", long_prompt, 400))]
    for t in threads:
        t.start()
    wait_for(lambda: server.running_requests() >= 1, 20, "the requests to be under way", 0.1)
    daemon.kill()
    for t in threads:
        t.join(timeout=120)
    assert not isinstance(results.get("load"), Exception), results.get("load")
    assert results["load"][:2] == first[:2], "the recomputed output differs"
    assert len(results["long"][0]) == 400

    # Down: vLLM keeps serving, by recompute.
    assert len(server.complete(prompt(22))[0]) == 8

    # Back (a new daemon on the same endpoint): the worker attaches again and it is used.
    new = start_daemon(cx_root, "rank0", cx_root / "storage")
    daemons.append(new)
    # The worker checks its daemon at engine steps: requests drive it.
    wait_for(lambda: bool(server.complete(prompt(24), 1)) and attached_runner(new) is not None, 60,
             "vLLM's worker to attach to the new daemon", 0.5)  # fmt: skip
    tokens = prompt(23)
    fresh = server.complete(tokens)
    reset(server)
    again = server.complete(tokens)
    assert again[2] >= FULL - BLOCK
    assert ops(new, "swap_in") >= 1
    assert again[:2] == fresh[:2]
