"""The plug-in's host tier in vLLM's own KV event stream, read the way a router reads it:
vLLM's ``KVEventBatch`` decoded from a ZeroMQ SUB socket. Blocks that reach the daemon's
host tier are announced ``BlockStored`` with medium ``CPU``, and are loadable then; when the
host cache is cleared under vLLM, the daemon's weights version changes or the daemon is
killed, every one of them is announced ``BlockRemoved`` within a step of the plug-in noticing
(at its next ping), and none is claimed again unless stored anew."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.client import EngineClient  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402
from cachexferd.protocol import SetWeights  # noqa: E402

from .engines import generate, reset_gpu_cache, shutdown  # noqa: E402
from .kv_events import Subscriber  # noqa: E402
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
PROMPTS = [prompt(500 + seed) for seed in range(3)]


@pytest.fixture(scope="module")
def rig(tiny_model: Path, cx_root: Path) -> Iterator[tuple[Any, DaemonProcess, Subscriber]]:
    from vllm import LLM

    daemon = start_daemon(cx_root, "events", cx_root / "storage-events")
    endpoint = f"ipc://{cx_root}/kv-events.sock"  # vLLM's publisher binds ipc endpoints, connects to tcp hosts
    subscriber = Subscriber(endpoint)
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}
    config = transfer_config(daemon.endpoint, storage="off", retry_interval_s=0.25)
    llm = LLM(**engine_args(tiny_model), kv_transfer_config=config, kv_events_config=events)
    yield llm, daemon, subscriber
    shutdown(llm)
    subscriber.close()
    daemon.stop()


def test_host_blocks_are_announced_when_loadable_and_removed_when_cleared(
    rig: tuple[Any, DaemonProcess, Subscriber],
) -> None:
    llm, daemon, sub = rig
    for p in PROMPTS:
        generate(llm, p)
    short = PROMPTS[0][:16]
    # vLLM completes stores a step or two later: step until the router holds every prompt's full blocks.
    want = len(PROMPTS) * (len(PROMPTS[0]) // BLOCK)
    wait_for(lambda: bool(generate(llm, short)) and (sub.drain() or len(sub.held.get("CPU", ())) >= want), 30,
             "the CPU BlockStored events")  # fmt: skip
    held = set(sub.held["CPU"])
    # What the router holds as CPU-resident is loadable: the prompts come back cached.
    reset_gpu_cache(llm)
    loads = ops(daemon, "swap_in")
    assert all(generate(llm, p)[2] >= len(p) // BLOCK * BLOCK - BLOCK for p in PROMPTS)
    assert ops(daemon, "swap_in") > loads
    # A cleared host cache: every announced block is removed within a few steps.
    clear_host(daemon)
    wait_for(lambda: bool(generate(llm, short)) and (sub.drain() or held <= sub.removed.get("CPU", set())), 20,
             "BlockRemoved for every CPU block after CLEAR_HOST")  # fmt: skip
    assert not (held & sub.held.get("CPU", set())), "the router still holds blocks of the cleared host cache"


def test_a_new_weights_version_removes_every_host_block_and_none_is_claimed_again(
    rig: tuple[Any, DaemonProcess, Subscriber],
) -> None:
    llm, daemon, sub = rig
    prompts = [prompt(600 + seed) for seed in range(3)]
    held = store(llm, sub, prompts)
    # A trainer puts new weights in force (SET_WEIGHTS): host blocks of the old ones are never
    # read again, so the router must stop holding them (at the plug-in's next ping).
    with EngineClient([daemon.endpoint]) as trainer:
        trainer.connect(timeout_s=10)
        trainer.call_all(SetWeights, version=int(daemon.status()["host_cache"]["weights_version"]) + 1)
    removed(llm, sub, held, "BlockRemoved for every CPU block after SET_WEIGHTS")
    # The same prompts are stored anew under the new weights; what the router then holds loads.
    stale = metric(daemon, "cachexferd_commands_total", op="swap_in", outcome="stale_weights")
    reset_gpu_cache(llm)
    store(llm, sub, prompts)
    comes_back(llm, daemon, prompts)
    assert metric(daemon, "cachexferd_commands_total", op="swap_in", outcome="stale_weights") == stale


def test_a_killed_daemon_removes_every_host_block_and_its_successor_announces_only_loadable_ones(
    rig: tuple[Any, DaemonProcess, Subscriber], cx_root: Path, request: pytest.FixtureRequest
) -> None:
    llm, daemon, sub = rig
    store(llm, sub, [prompt(700 + seed) for seed in range(2)])
    lost = set(sub.cpu())
    daemon.kill()
    removed(llm, sub, lost, "BlockRemoved for every CPU block after the daemon's SIGKILL")
    new = start_daemon(cx_root, "events", cx_root / "storage-events")
    request.addfinalizer(new.stop)
    wait_for(lambda: attached_runner(new) == os.getpid(), 30, "the engine to attach to the new daemon")
    before = set(sub.cpu())
    wait_for(lambda: bool(generate(llm, prompt(800))) and (sub.drain() or bool(sub.cpu() - before)), 30,
             "the plug-in to announce blocks of the new daemon")  # fmt: skip
    prompts = [prompt(900 + seed) for seed in range(2)]
    store(llm, sub, prompts)
    assert not (sub.cpu() & lost), "blocks of the killed daemon's host tier are claimed again"
    comes_back(llm, new, prompts)


SHORT = PROMPTS[0][:16]  # one step of a request: stores and events complete meanwhile


def store(llm: Any, sub: Subscriber, prompts: list[list[int]]) -> set[Any]:
    """Runs ``prompts`` and steps until the router holds every one of their full blocks as CPU; returns those."""
    sub.drain()
    before = set(sub.cpu())
    for p in prompts:
        generate(llm, p)
    want = sum(len(p) // BLOCK for p in prompts)
    wait_for(lambda: bool(generate(llm, SHORT)) and (sub.drain() or len(sub.cpu() - before) >= want), 30,
             "the CPU BlockStored events")  # fmt: skip
    return sub.cpu() - before


def removed(llm: Any, sub: Subscriber, held: set[Any], what: str) -> None:
    """Steps until every block of ``held`` is announced removed (the plug-in notices at a ping)."""
    wait_for(lambda: bool(generate(llm, SHORT)) and (sub.drain() or not (held & sub.cpu())), 20, what)
    assert held <= sub.removed.get("CPU", set())


def comes_back(llm: Any, daemon: DaemonProcess, prompts: list[list[int]]) -> None:
    """What the router holds is loadable: with vLLM's own cache empty, the prompts come back cached from the daemon."""
    reset_gpu_cache(llm)
    loads = ops(daemon, "swap_in")
    assert all(generate(llm, p)[2] >= len(p) // BLOCK * BLOCK - BLOCK for p in prompts)
    assert ops(daemon, "swap_in") > loads
