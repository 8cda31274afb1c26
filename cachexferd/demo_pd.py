"""The prefill -> decode handoff through the storage tier, end to end (part of ``cachexferd demo``).

Two daemons run as subprocesses with their own runtime dirs, as a prefill instance and a
decode instance on two machines would, sharing one storage pool: a directory (default), a
Redis/Valkey server or a Mooncake Store. Each side has a runner KV cache in shared memory.

1. Prefill: its cache holds the request's KV (random bytes standing in for the model's
   output) in the request's block table; the engine computes the storage keys of the prompt
   (cachexferd.storage.keys, including the trailing partial block) and stores the blocks.
2. Decode: another engine, with the same prompt, computes the same keys, looks them up and
   loads them into its own, different block table.
3. Every loaded block must equal the prefill block it came from, byte for byte, and every
   other decode block must be unchanged.

``url`` / ``master`` name a running Redis / Mooncake master; without them a local server is
started on loopback ports when its binary is installed (cachexferd.storage_servers).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .client import EngineClient, RunnerClient, ShmKVCache
from .launch import DaemonProcess
from .protocol import KVLayout
from .storage.keys import KeySpace
from .storage_servers import MooncakeCluster, RedisServer, ServerUnavailable, mooncake_binaries, redis_binary

LAYOUT = KVLayout(num_layers=8, num_blocks=128, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")
PROMPT_TOKENS = 1000  # 62 full blocks of 16 tokens + a partial block of 8
WAIT_S = 60.0


def storage_problem(backend: str, url: str | None, master: str | None) -> str:
    """Why the handoff cannot run with ``backend`` here ('' if it can), found before anything
    starts: the daemons' storage client library, and the server the demo would start."""
    from .config import ConfigError, load_config
    from .preflight import check_storage

    if backend in ("file", "none"):
        return ""
    try:
        check_storage(load_config(overrides={"storage.backend": backend}, environ={}))
        if backend == "redis" and url is None:
            redis_binary()
        elif backend == "mooncake" and master is None:
            mooncake_binaries()
    except ConfigError as exc:
        return str(exc).split(": ", 1)[-1]  # without the setting's name: the demo chose it
    except ServerUnavailable as exc:
        flag = "--storage-url" if backend == "redis" else "--storage-master"
        return f"{exc}; or name a running server with {flag}"
    return ""


@contextlib.contextmanager
def storage_settings(backend: str, workdir: Path, url: str | None, master: str | None) -> Iterator[dict[str, Any]]:
    """Daemon settings for the shared pool; starts a local server when none was named."""
    with contextlib.ExitStack() as stack:
        if backend == "file":
            settings: dict[str, Any] = {"storage.backend": "file", "storage.file.path": str(workdir / "pool")}
        elif backend == "redis":
            if url is None:
                server = RedisServer(workdir / "redis").start()
                stack.callback(server.stop)
                url = server.url
            settings = {"storage.backend": "redis", "storage.redis.url": url}
        elif backend == "mooncake":
            if master is None:
                cluster = MooncakeCluster(workdir / "mooncake").start()
                stack.callback(cluster.stop)
                master = cluster.master
            settings = {"storage.backend": "mooncake", "storage.mooncake.master": master}
        else:
            raise ValueError(f"unknown storage backend {backend!r}")
        yield {**settings, "storage.timeout_s": 20, "host_cache.capacity": "64MiB", "metrics.port": 0}


class Side:
    """One instance: a daemon subprocess, a runner cache attached to it, an engine client."""

    def __init__(self, stack: contextlib.ExitStack, workdir: Path, settings: dict[str, Any], seed: int) -> None:
        import torch

        self.daemon = DaemonProcess(workdir, settings=settings)
        self.daemon.start()
        stack.callback(self.daemon.stop)
        self.cache = ShmKVCache(LAYOUT)
        stack.callback(self.cache.close)
        gen = torch.Generator().manual_seed(seed)
        for tensor in self.cache.tensors:
            raw = tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        self.before = [t.view(torch.uint8).clone() for t in self.cache.tensors]
        runner = RunnerClient(self.daemon.endpoint)
        stack.callback(runner.close)
        runner.attach(self.cache)
        stack.callback(runner.detach)
        self.engine = EngineClient([self.daemon.endpoint], timeout_s=WAIT_S)
        stack.callback(self.engine.close)
        self.engine.connect()

    def call(self, op: str, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], float]:
        start = time.perf_counter()
        req = getattr(self.engine, op)(*args, **kwargs)
        done = self.engine.wait([req], WAIT_S)[req]
        if not done.ok:
            raise RuntimeError(done.describe())
        return done.result(), time.perf_counter() - start


def verify(decode: Side, prefill: Side, dst: list[int], src: list[int]) -> str:
    """'' when decode blocks ``dst`` equal prefill blocks ``src`` and nothing else changed."""
    import torch

    for t, tensor in enumerate(decode.cache.tensors):
        raw = tensor.view(torch.uint8)
        for d, s in zip(dst, src):
            if not torch.equal(raw[d], prefill.before[t][s]):
                return f"tensor {t}: decode block {d} differs from prefill block {s}"
        keep = torch.tensor(sorted(set(range(LAYOUT.num_blocks)) - set(dst)), dtype=torch.long)
        if not torch.equal(raw[keep], decode.before[t][keep]):
            return f"tensor {t}: a decode block outside the loaded ones changed"
    return ""


def handoff(prefill: Side, decode: Side) -> dict[str, Any]:
    space = KeySpace.for_layout("demo/model", LAYOUT, weights_version=f"demo-{uuid.uuid4().hex[:8]}")
    prompt = list(range(7, 7 + PROMPT_TOKENS))
    keys = space.token_keys(prompt)  # decode computes the very same keys from the same prompt
    n = len(keys)
    src = list(range(3, 3 + 2 * n, 2))  # the prefill request's block table (scattered)
    dst = list(reversed(range(LAYOUT.num_blocks - n, LAYOUT.num_blocks)))  # decode's own block table
    stored, store_s = prefill.call("store", keys, host_ids=list(range(n)), device_ids=src)
    found, _ = decode.call("lookup", keys)
    loaded, load_s = decode.call("load", keys, host_ids=list(range(n, 2 * n)), device_ids=dst)
    problem = verify(decode, prefill, dst[: loaded["loaded"]], src)
    if not problem and (stored["stored"], found["prefix"], loaded["loaded"]) != (n, n, n):
        problem = f"stored {stored['stored']}, found {found['prefix']}, loaded {loaded['loaded']} of {n} blocks"
    prefill.call("delete", keys)
    nbytes = n * LAYOUT.host_block_bytes
    return {
        "ok": not problem, "blocks": n, "partial_tokens": PROMPT_TOKENS % LAYOUT.block_size, "bytes": nbytes,
        "store_s": round(store_s, 4), "load_s": round(load_s, 4),
        "store_gbps": round(nbytes / store_s / 1e9, 3), "load_gbps": round(nbytes / load_s / 1e9, 3),
        "detail": problem or f"{n} blocks ({nbytes >> 20} MiB, last block {PROMPT_TOKENS % 16} tokens) exact",
    }  # fmt: skip


def run_pd_handoff(
    workdir: Path, backend: str = "file", url: str | None = None, master: str | None = None
) -> dict[str, Any]:
    """Runs the handoff and returns a summary: ok, blocks, bytes, timings, detail."""
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        with storage_settings(backend, workdir, url, master) as settings, contextlib.ExitStack() as stack:
            prefill = Side(stack, workdir / "prefill", settings, seed=101)
            decode = Side(stack, workdir / "decode", settings, seed=202)
            summary = handoff(prefill, decode)
    except ServerUnavailable as exc:
        return {"ok": False, "backend": backend, "detail": f"{backend} not available here: {exc}"}
    except Exception as exc:
        return {"ok": False, "backend": backend, "detail": f"{type(exc).__name__}: {exc}"}
    return {"backend": backend, **summary}
