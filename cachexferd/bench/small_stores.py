"""``cachexferd bench small-stores``: the daemon's CPU and latency per small STORE.

An engine that writes its KV through to storage stores what each step completed: STOREs of
one or a few blocks, often one at a time. For those the daemon's fixed cost per STORE (the
command, handing the write to an I/O thread and back, the journal record, the outcome)
outweighs the bytes. A real daemon (file backend on tmpfs, journal on, a runner's cache
attached and swapped out into its host blocks) serves STOREs of ``--blocks`` host blocks under
new keys, one in flight and ``--window`` in flight; its CPU time per STORE comes from /proc
(user + system, every thread).

The floor, measured in the same run and alternating with it round by round: the bare pyzmq
loop of ``bench commands`` answering the same messages (the least a Python command server
does per command; it writes nothing), plus the same objects written by the raw file client
in this process (``open``, ``write``, ``close`` per object: no header, checksum, rename,
journal). Reported: median CPU µs per STORE of each side, the daemon's over the floor, and
median / p99 latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from ..config import parse_size
from ..protocol import MsgType, encode_body
from ..storage.objects import HEADER_BYTES
from .bare_loop import start_bare_loop
from .commands import Generator, Part
from .storage import daemon_side, layout_for, scratch_dir
from .storage_raw import RawFile

_HOST_BLOCKS = 64  # swapped out once; STOREs read them again and again under new keys


def add_small_stores_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=1, help="host blocks (objects) per STORE")
    p.add_argument("--block-bytes", default="32KiB", help="host block (object payload) size")
    p.add_argument("--stores", type=int, default=1000, help="STOREs per measurement")
    p.add_argument("--window", type=int, default=8, help="STOREs in flight in the second part")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    p.add_argument("--path", help="storage directory (default: a temp dir in /dev/shm)")
    p.add_argument("--json", help="write the rows to this file")
    p.set_defaults(func=run)


def store_messages(first_req: int, count: int, blocks: int, label: str) -> list[tuple[list[bytes], list[int]]]:
    """One STORE per message, of ``blocks`` host blocks under new keys."""
    out = []
    for req_id in range(first_req, first_req + count):
        host_ids = [(req_id * blocks + j) % _HOST_BLOCKS for j in range(blocks)]
        keys = [f"bench:small:{label}:{req_id}:{j}" for j in range(blocks)]
        out.append((encode_body(MsgType.STORE, {"req_id": req_id, "keys": keys, "host_ids": host_ids}), [req_id]))
    return out


def raw_cpu_us(raw: RawFile, label: str) -> float:
    """CPU µs per STORE's objects written by the raw file client (this process)."""
    start = time.process_time()
    raw.put(label)
    spent = time.process_time() - start
    raw.drop(label)
    return spent / raw.count * 1e6


@contextlib.contextmanager
def servers(args: argparse.Namespace, work: Path) -> Iterator[tuple[Generator, Generator, RawFile]]:
    """(the daemon's generator, the bare loop's, the raw file client), all started."""
    block = parse_size(args.block_bytes)
    root = Path(args.path) if args.path else None
    with contextlib.ExitStack() as stack:
        root = root or scratch_dir(stack)
        settings = {"storage.backend": "file", "storage.file.path": str(root / "daemon"), "storage.journal": True}
        side = stack.enter_context(daemon_side(work / "daemon", settings, layout_for(block, _HOST_BLOCKS), 4))
        ctx: zmq.Context[Any] = zmq.Context()
        stack.callback(ctx.destroy, 0)
        bare = start_bare_loop(f"ipc://{work}/bare.sock", f"ipc://{work}/bare-ev.sock")
        stack.callback(_stop, bare)
        ours = Generator(ctx, side.endpoint, f"ipc://{work}/ev.sock", side.pid)
        ours.hello(batch_events=False)
        floor = Generator(ctx, f"ipc://{work}/bare.sock", f"ipc://{work}/bare-ev.sock", bare.pid)
        raw = RawFile(root / "raw", args.blocks * args.stores, block + HEADER_BYTES, 1)
        stack.callback(raw.close)
        yield ours, floor, raw


def _stop(proc: Any) -> None:
    proc.stdin.close()
    proc.wait(10)


def measure(args: argparse.Namespace, ours: Generator, floor: Generator, raw: RawFile, window: int) -> dict[str, Any]:
    """One row: ``--rounds`` rounds of the daemon, the bare loop and the raw writes (who goes
    first rotates) at ``window`` STOREs in flight, after one warm-up round."""
    req = iter(range(1 << 20, 1 << 40, 1 << 20))  # a fresh block of req_ids per part
    daemon: list[Part] = []
    bare: list[Part] = []
    raw_us: list[float] = []
    for r in range(args.rounds + 1):
        label = f"w{window}r{r}"
        kinds = ["daemon", "bare", "raw"]
        for kind in kinds[r % 3 :] + kinds[: r % 3]:
            if kind == "raw":
                spent = raw_cpu_us(raw, label)
                if r:
                    raw_us.append(spent)
                continue
            gen, parts = (ours, daemon) if kind == "daemon" else (floor, bare)
            part = gen.run(kind, store_messages(next(req), args.stores, args.blocks, label), window, 120)
            if r:
                parts.append(part)
    med = statistics.median
    cpu, bare_cpu, raw_cpu = med(p.server_cpu_us for p in daemon), med(p.server_cpu_us for p in bare), med(raw_us)
    return {"blocks": args.blocks, "window": window, "stores": args.stores,
            "failed": sum(p.failed for p in daemon),
            "daemon_cpu_us": cpu, "bare_loop_cpu_us": bare_cpu, "raw_put_cpu_us": raw_cpu,
            "over_floor": cpu / (bare_cpu + raw_cpu) if bare_cpu + raw_cpu else 0.0,
            "daemon_p50_ms": med(p.p50_ms for p in daemon), "daemon_p99_ms": med(p.p99_ms for p in daemon),
            "bare_p50_ms": med(p.p50_ms for p in bare)}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="cx-bench-small-"))
    load_start = os.getloadavg()
    rows = []
    try:
        with servers(args, work) as (ours, floor, raw):
            for window in (1, args.window):
                rows.append(measure(args, ours, floor, raw, window))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"CPU µs per STORE of {args.blocks} x {args.block_bytes} (median of {args.rounds} rounds); "
          "floor: bare loop + raw file writes")  # fmt: skip
    print("in flight  daemon   bare loop  raw put  daemon/floor  daemon p50 / p99 ms  bare p50 ms")
    for row in rows:
        print(f"{row['window']:>9}  {row['daemon_cpu_us']:>6.0f}  {row['bare_loop_cpu_us']:>9.0f}  "
              f"{row['raw_put_cpu_us']:>7.1f}  {row['over_floor']:>11.2f}x  "
              f"{row['daemon_p50_ms']:>8.2f} / {row['daemon_p99_ms']:<8.2f}  {row['bare_p50_ms']:>11.3f}")  # fmt: skip
    if args.json:
        report = {"rows": rows, "load_average": {"start": load_start, "end": os.getloadavg()}}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if any(row["failed"] for row in rows) else 0
