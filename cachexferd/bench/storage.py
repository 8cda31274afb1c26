"""``cachexferd bench storage``: store / load GB/s through a daemon vs the backend's raw client.

For each backend a real daemon subprocess runs with that storage backend, a runner cache
is attached and swapped out so the host blocks hold random bytes, and then, alternating
round by round so machine noise hits both sides alike:

- raw put, daemon store (``--blocks`` host blocks -> objects, one command);
- raw get, daemon load (objects -> other host blocks, one command; every object must load);
- both sides' objects are deleted (untimed).

Daemon times are what the engine sees: submit to completion event. The raw side is the
backend's own client moving the same object sizes (block + 64-byte header) with as many
threads as the daemon's storage tier uses (storage_raw.py). Reported: best and median
GB/s per side and the ratio of the bests. Local servers are started on loopback ports
unless ``--redis-url`` / ``--mooncake-master`` name running ones. The file backend runs in
a tmpfs directory by default (``--path`` picks another): at memory speed the daemon's own
work (headers, checksums, rename, fan-out) is what the ratio measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..client import EngineClient, RunnerClient, ShmKVCache
from ..config import parse_size
from ..daemon.storage_tier import shards
from ..launch import DaemonProcess
from ..protocol import KVLayout
from ..storage.mooncake import quiet_logs
from ..storage.objects import HEADER_BYTES
from ..storage_servers import MooncakeCluster, RedisServer, ServerUnavailable
from ..units import human_bytes
from .storage_raw import RawClient, RawFile, RawMooncake, RawRedis

BACKENDS = ("file", "redis", "mooncake")
_LAYERS = 16
_SETTLE_S = 0.05


def add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: file, redis, mooncake")
    p.add_argument("--block-bytes", default="1MiB", help="host block (object payload) size")
    p.add_argument("--blocks", type=int, default=256, help="objects per store / load command")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    p.add_argument("--io-threads", type=int, default=4, help="storage.io_threads of the daemon")
    p.add_argument("--path", help="file backend directory (default: a temp dir in /dev/shm, see the module doc)")
    p.add_argument("--redis-url", help="use this Redis/Valkey instead of starting redis-server")
    p.add_argument("--mooncake-master", help="use this Mooncake master instead of starting master + node")
    p.add_argument("--json", help="write the rows (and machine info) to this file")
    p.set_defaults(func=run)


def layout_for(block_bytes: int, num_blocks: int) -> KVLayout:
    tensors = _LAYERS * 2
    if block_bytes % tensors:
        raise ValueError(f"--block-bytes {block_bytes} must be a multiple of {tensors}")
    return KVLayout(
        num_layers=_LAYERS, num_blocks=num_blocks, block_size=1, num_kv_heads=1,
        head_dim=block_bytes // tensors, dtype="uint8",
    )  # fmt: skip


@contextlib.contextmanager
def backend_setup(
    name: str, args: argparse.Namespace, workdir: Path, n: int, block: int
) -> Iterator[tuple[dict[str, Any], RawClient]]:
    """(daemon storage settings, raw client) for one backend; starts local servers if needed."""
    obj = block + HEADER_BYTES
    threads = len(shards(n, block, 1 if name == "mooncake" else args.io_threads))  # what the daemon's tier uses
    with contextlib.ExitStack() as stack:
        if name == "file":
            root = Path(args.path) if args.path else scratch_dir(stack)
            settings: dict[str, Any] = {"storage.backend": "file", "storage.file.path": str(root / "daemon")}
            raw: RawClient = RawFile(root / "raw", n, obj, threads)
        elif name == "redis":
            url = args.redis_url or _started(stack, RedisServer(workdir / "redis", maxmemory="4gb")).url
            settings, raw = {"storage.backend": "redis", "storage.redis.url": url}, RawRedis(url, n, obj, threads)
        else:
            segment = str(max(1 << 30, 4 * n * obj))
            master = args.mooncake_master or _started(stack, MooncakeCluster(workdir / "mc", segment=segment)).master
            settings = {"storage.backend": "mooncake", "storage.mooncake.master": master}
            with _stderr_to(workdir / "mooncake-client.log"):  # glog's start-up lines, even at ERROR
                raw = RawMooncake(master, n, obj, threads)
        stack.callback(raw.close)
        yield settings, raw


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Sends file descriptor 2 (where native libraries log) to ``path`` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def scratch_dir(stack: contextlib.ExitStack) -> Path:
    """A tmpfs dir when there is one: the file backend then runs at memory speed, which
    exposes the daemon's own overhead (on a disk both sides wait for the disk)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="cx-bench-file-", dir=base))
    stack.callback(shutil.rmtree, path, True)
    return path


def _started(stack: contextlib.ExitStack, server: Any) -> Any:
    server.start()
    stack.callback(server.stop)
    return server


class DaemonSide:
    """A daemon subprocess with storage, an attached runner cache, and an engine client."""

    def __init__(self, engine: EngineClient, n: int, daemon: DaemonProcess) -> None:
        self.engine, self.n = engine, n
        assert daemon.proc is not None, "started"
        self.endpoint, self.pid = daemon.endpoint, daemon.proc.pid
        self.work_s = 0.0

    def call(self, fn: Callable[..., int], *args: Any) -> dict[str, Any]:
        req = fn(*args)
        done = self.engine.wait([req], 300)[req]
        if not done.ok:
            raise RuntimeError(done.describe())
        result = done.result()
        if "finished_at" in result:  # daemon-clock time the command's work took
            self.work_s = result["finished_at"] - result["started_at"]
        return result


@contextlib.contextmanager
def daemon_side(workdir: Path, settings: dict[str, Any], layout: KVLayout, io_threads: int) -> Iterator[DaemonSide]:
    """Starts the daemon, attaches a random-filled cache and swaps it out into host blocks
    0..n-1 (the store source; n..2n-1 are the load target). Everything is undone on exit."""
    n = layout.num_blocks
    daemon = DaemonProcess(workdir / "rt", settings={
        **settings, "storage.io_threads": io_threads, "storage.timeout_s": 120, "metrics.port": 0,
        "host_cache.capacity": 2 * n * layout.host_block_bytes + (16 << 20), "daemon.log_level": "warning",
    })  # fmt: skip
    with contextlib.ExitStack() as stack:
        daemon.start()
        stack.callback(daemon.stop)
        cache = ShmKVCache(layout)
        stack.callback(cache.close)
        for tensor in cache.tensors:  # uint8 layout: random bytes, so checksums see real data
            tensor.random_(0, 256)
        runner = RunnerClient(daemon.endpoint)
        stack.callback(runner.close)
        runner.attach(cache)
        stack.callback(runner.detach)
        engine = EngineClient([daemon.endpoint], timeout_s=300)
        stack.callback(engine.close)
        engine.connect()
        side = DaemonSide(engine, n, daemon)
        side.call(engine.swap_out, list(range(n)), list(range(n)))
        yield side


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(side: DaemonSide, raw: RawClient, tag: str, daemon_first: bool) -> dict[str, float]:
    n = side.n
    keys = [f"bench:{tag}:{i}" for i in range(n)]

    def load() -> None:
        got = side.call(side.engine.load, keys, list(range(n, 2 * n)))
        if got["loaded"] != n:
            raise RuntimeError(f"load delivered {got['loaded']} of {n} objects")

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("store", lambda: side.call(side.engine.store, keys, list(range(n)))),
        ("raw_put", lambda: raw.put(tag)),
        ("load", load),
        ("raw_get", lambda: raw.get(tag)),
    ]
    if not daemon_first:  # alternate who goes first, so neither side always meets a colder cache
        steps[0], steps[1], steps[2], steps[3] = steps[1], steps[0], steps[3], steps[2]
    sample = {}
    for name, fn in steps:
        time.sleep(_SETTLE_S)  # let the other side's background work (writeback, lazy frees) settle
        sample[name] = timed(fn)
        if name in ("store", "load"):
            sample[f"{name}_work"] = side.work_s
    raw.drop(tag)
    side.call(side.engine.delete, keys)
    return sample


def measure(side: DaemonSide, raw: RawClient, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in ("store", "raw_put", "load", "raw_get", "store_work", "load_work")}
    for r in range(rounds + 1):
        sample = one_round(side, raw, f"{uuid.uuid4().hex[:8]}-{r}", daemon_first=r % 2 == 0)
        if r:  # round 0 warms up connections, page cache and allocators
            for key, value in sample.items():
                times[key].append(value)
    return times


def rows_for(name: str, times: dict[str, list[float]], nbytes: int, n: int, block: int) -> list[dict[str, Any]]:
    rows = []
    for op, base in (("store", "raw_put"), ("load", "raw_get")):
        ours, theirs = [nbytes / t / 1e9 for t in times[op]], [nbytes / t / 1e9 for t in times[base]]
        rows.append({
            "backend": name, "op": op, "objects": n, "object_bytes": block + HEADER_BYTES,
            "daemon_gbps": max(ours), "raw_gbps": max(theirs), "ratio": max(ours) / max(theirs),
            "daemon_median_gbps": statistics.median(ours), "raw_median_gbps": statistics.median(theirs),
            # inside the daemon (its own clock, from the job's start to its end): the rest of the
            # end-to-end time is the command's trip through the protocol and the event back
            "daemon_work_gbps": max(nbytes / t / 1e9 for t in times[f"{op}_work"]),
        })  # fmt: skip
    return rows


def run_backend(name: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    n, block = args.blocks, parse_size(args.block_bytes)
    layout = layout_for(block, n)
    with backend_setup(name, args, workdir, n, block) as (settings, raw):
        with daemon_side(workdir / f"daemon-{name}", settings, layout, args.io_threads) as side:
            times = measure(side, raw, args.rounds)
    return rows_for(name, times, n * block, n, block)


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'backend':9} {'op':6} {'objects':>7} {'object':>9} {'daemon GB/s':>12} {'raw GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['backend']:9} {r['op']:6} {r['objects']:7d} {human_bytes(r['object_bytes']):>9} "
            f"{r['daemon_gbps']:12.2f} {r['raw_gbps']:9.2f} {r['ratio']:6.0%}"
        )


def run(args: argparse.Namespace) -> int:
    quiet_logs("error")  # the raw client runs in this process, the daemons inherit it
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    workdir = Path(tempfile.mkdtemp(prefix="cx-bench-storage-"))
    try:
        for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
            if name not in BACKENDS:
                raise SystemExit(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
            try:
                rows += run_backend(name, args, workdir)
            except (ServerUnavailable, ImportError) as exc:
                skipped[name] = str(exc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_rows(rows)
    for name, reason in skipped.items():
        print(f"{name:9} skipped: {reason}")
    if args.json:
        machine = {"cpu": _cpu_name(), "cores": os.cpu_count(), "io_threads": args.io_threads}
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows, "skipped": skipped}, indent=2))
    return 0 if rows else 1


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown cpu"
