"""The plug-in's host tier in vLLM's own KV event stream, read the way a router reads it:
vLLM's ``KVEventBatch`` decoded from a ZeroMQ SUB socket. Blocks that reach the daemon's
host tier are announced ``BlockStored`` with medium ``CPU``, and are loadable then; when the
host cache is cleared under vLLM, every one of them is announced ``BlockRemoved``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

from cachexferd.launch import DaemonProcess  # noqa: E402

from .engines import generate, reset_gpu_cache, shutdown  # noqa: E402
from .rig import BLOCK, clear_host, engine_args, ops, prompt, start_daemon, transfer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]
PROMPTS = [prompt(500 + seed) for seed in range(3)]


class Subscriber:
    """A router's view: the hashes it holds per medium, from vLLM's KV events."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.held: dict[str, set[Any]] = {}
        self.removed: dict[str, set[Any]] = {}

    def drain(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        while self.sock.poll(50):
            _topic, _seq, payload = self.sock.recv_multipart()
            for event in self.decoder.decode(payload).events:
                medium = str(getattr(event, "medium", None))
                if isinstance(event, BlockStored):
                    self.held.setdefault(medium, set()).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self.held.setdefault(medium, set()).difference_update(event.block_hashes)
                    self.removed.setdefault(medium, set()).update(event.block_hashes)

    def close(self) -> None:
        self.sock.close(linger=0)


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
