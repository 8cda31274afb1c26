"""Helpers shared by the test tiers: an in-process daemon on its own thread, cache filling
and byte-exact block checks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from cachexferd.client.runner import ShmKVCache
from cachexferd.config import Config, load_config
from cachexferd.daemon.server import Daemon
from cachexferd.protocol import KVLayout

SMALL = KVLayout(num_layers=3, num_blocks=48, block_size=4, num_kv_heads=2, head_dim=32, dtype="float16")


def config_for(runtime_dir: Path, **settings: Any) -> Config:
    base = {
        "daemon.runtime_dir": str(runtime_dir),
        "daemon.backend": "cpu",
        "metrics.port": 0,
        "host_cache.capacity": "16MiB",
        "daemon.drain_timeout_s": 5.0,
    }
    base.update({k.replace("__", "."): v for k, v in settings.items()})
    return load_config(overrides=base, environ={})


class InProcessDaemon:
    """A Daemon serving from a background thread with its own event loop."""

    def __init__(self, config: Config, backend: Callable[[], Any] | None = None) -> None:
        """``backend``: makes the Backend instance to serve with (default: by config)."""
        self.config = config
        self.make_backend = backend
        self.endpoint = config.endpoint
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.daemon: Daemon | None = None
        self.thread = threading.Thread(target=self._main, name="inproc-daemon", daemon=True)

    def _main(self) -> None:
        async def run() -> None:
            self.loop = asyncio.get_running_loop()
            self.daemon = Daemon(self.config, self.make_backend() if self.make_backend is not None else None)
            try:
                await self.daemon.start()
            except BaseException as exc:
                self._error = exc  # before _ready: start() must see it
                raise
            finally:
                self._ready.set()
            await self.daemon.wait_stop_requested()
            await self.daemon.shutdown()

        try:
            asyncio.run(run())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def start(self, timeout_s: float = 20.0) -> InProcessDaemon:
        self.thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("in-process daemon did not start")
        if self._error is not None:
            raise self._error
        return self

    def run(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Runs fn on the daemon's loop thread and returns its result."""
        assert self.loop is not None

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.loop is not None and self.daemon is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.daemon.request_stop, "test teardown")
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError("in-process daemon did not stop")


def fill_random(cache: ShmKVCache, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensor in cache.tensors:
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def snapshot(cache: ShmKVCache) -> list[torch.Tensor]:
    """Byte copies of every tensor (compare bytes, never floats: random bits hold NaNs)."""
    return [t.view(torch.uint8).clone() for t in cache.tensors]


def assert_moved(dst: ShmKVCache, dst_ids: Sequence[int], src: Sequence[torch.Tensor], src_ids: Sequence[int]) -> None:
    for t, tensor in enumerate(dst.tensors):
        raw = tensor.view(torch.uint8)
        for d, s in zip(dst_ids, src_ids):
            assert torch.equal(raw[d], src[t][s]), f"tensor {t}: device block {d} != source block {s}"


def assert_untouched(cache: ShmKVCache, before: Sequence[torch.Tensor], changed: Sequence[int]) -> None:
    keep = sorted(set(range(cache.layout.num_blocks)) - set(changed))
    index = torch.tensor(keep, dtype=torch.long)
    for t, tensor in enumerate(cache.tensors):
        raw = tensor.view(torch.uint8)
        assert torch.equal(raw[index], before[t][index]), f"tensor {t}: a block outside {sorted(changed)} changed"


class RawClient:
    """A bare DEALER (+ optional PULL) that sends arbitrary frames: for bad-input tests."""

    def __init__(self, endpoint: str, events_dir: Path | None = None) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.events = None
        self.events_endpoint = ""
        if events_dir is not None:
            self.events = self.ctx.socket(zmq.PULL)
            self.events.setsockopt(zmq.LINGER, 0)
            self.events_endpoint = f"ipc://{events_dir / 'ev.sock'}"
            self.events.bind(self.events_endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def send_cmd(self, cmd: Any) -> None:
        from cachexferd.protocol import encode_command

        self.send(encode_command(cmd))

    def _recv(self, sock: Any, timeout_s: float) -> Any:
        from cachexferd.protocol import decode_outcome

        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message within timeout")
        return decode_outcome(sock.recv_multipart())[1]

    def reply(self, timeout_s: float = 5.0) -> Any:
        return self._recv(self.sock, timeout_s)

    def event(self, timeout_s: float = 5.0) -> Any:
        assert self.events is not None
        return self._recv(self.events, timeout_s)

    def nothing_more(self, wait_s: float = 0.2) -> bool:
        socks = [self.sock] + ([self.events] if self.events is not None else [])
        return not any(s.poll(int(wait_s * 1000)) for s in socks)

    def call(self, cmd: Any, timeout_s: float = 5.0) -> Any:
        self.send_cmd(cmd)
        return self.reply(timeout_s)

    def hello(self, role: str = "engine") -> Any:
        from cachexferd.protocol import Hello

        return self.call(Hello(req_id=1, protocol=[1, 0], role=role, events=self.events_endpoint or None))

    def close(self) -> None:
        self.sock.close(0)
        if self.events is not None:
            self.events.close(0)
        self.ctx.term()


class SwapModel:
    """The sequential model of random swaps: for each device block, the original block it
    must hold once every swap submitted so far completed (as if run one by one)."""

    def __init__(self, device_blocks: int, host_blocks: int) -> None:
        self.device = list(range(device_blocks))
        self.host: list[int | None] = [None] * host_blocks

    def submit_random(self, engine: Any, rng: Any, max_blocks: int = 6) -> int | None:
        """Submits one random swap of 1..max_blocks blocks (None: a swap-in with nothing to read)."""
        n = rng.randint(1, max_blocks)
        dev_ids, host_ids = rng.sample(range(len(self.device)), n), rng.sample(range(len(self.host)), n)
        if rng.random() < 0.5:
            for d, h in zip(dev_ids, host_ids):
                self.host[h] = self.device[d]
            return int(engine.swap_out(dev_ids, host_ids))
        pairs = [(d, h) for d, h in zip(dev_ids, host_ids) if self.host[h] is not None]
        if not pairs:
            return None
        for d, h in pairs:
            self.device[d] = self.host[h]  # type: ignore[assignment]
        return int(engine.swap_in([d for d, _ in pairs], [h for _, h in pairs]))


def submit_random_pipeline(
    engine: Any, rng: Any, device_blocks: int, host_blocks: int, commands: int = 300
) -> tuple[list[int], list[int]]:
    """Sends ``commands`` random, conflicting swaps without waiting. Returns their req_ids and
    the sequential model's answer (SwapModel.device)."""
    model = SwapModel(device_blocks, host_blocks)
    submitted = (model.submit_random(engine, rng) for _ in range(commands))
    return [r for r in submitted if r is not None], model.device


def assert_matches_model(cache: Any, original: Sequence[torch.Tensor], expected: Sequence[int]) -> None:
    for t, tensor in enumerate(cache.tensors):
        raw = tensor.view(torch.uint8)
        for b, source in enumerate(expected):
            assert torch.equal(raw[b], original[t][source]), f"tensor {t} block {b} should hold original block {source}"
