"""``cachexferd bench commands``: how many commands per second the daemon serves, against
the least a Python command server can do, measured in the same run.

Parts:
  (a) the ceiling: a bare pyzmq + msgpack loop in its own process (bare_loop.py);
  (b) a real daemon (cpu backend, a runner's cache attached) serving single-block SWAP_OUT
      commands on distinct blocks, a fixed number in flight;
  (c) chains of same-block commands (each depends on the one before), sent at once, drained;
  (d) as (b), with the commands carried in BATCH envelopes and the outcomes in EVENT_BATCH.
(a) and (b) alternate for ``--rounds`` rounds; medians are reported. One load generator
serves every part: a raw DEALER + PULL sending pre-encoded messages, so its own cost is the
same for the ceiling and for the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ..launch import DaemonProcess
from ..protocol import PROTOCOL_MAJOR, PROTOCOL_MINOR, KVLayout, MsgType, encode_batch, encode_body
from .bare_loop import start_bare_loop

LAYOUT = KVLayout(num_layers=2, num_blocks=1024, block_size=16, num_kv_heads=1, head_dim=64, dtype="float16")
_HELLO_REQ_ID = 1 << 62  # outside the range the parts use


@dataclass
class Part:
    name: str
    commands: int
    seconds: float
    p50_ms: float
    p99_ms: float
    failed: int  # outcomes with an error code, plus outcomes that never came
    server_cpu_us: float = 0.0  # CPU time of the serving process per command (robust to a busy machine)

    @property
    def rate(self) -> float:
        return self.commands / self.seconds if self.seconds else 0.0


def add_commands_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=20_000, help="commands per part (b) round")
    p.add_argument("--batch-count", type=int, default=100_000, help="commands in part (d)")
    p.add_argument("--window", type=int, default=128, help="commands in flight in (a), (b) and (d)")
    p.add_argument("--batch", type=int, default=64, help="commands per BATCH envelope in (d)")
    p.add_argument("--chains", default="1000,10000", help="same-block chain lengths for (c)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of (a) and (b)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one part may take")
    p.add_argument("--json", help="write the parts and ratios to this file")
    p.set_defaults(func=run)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Generator:
    """A raw DEALER (commands) + PULL (events) keeping ``window`` commands in flight;
    ``server_pid`` is the process whose CPU time each part reports."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, events: str, server_pid: int) -> None:
        self.server_pid = server_pid
        self.dealer = ctx.socket(zmq.DEALER)
        self.pull = ctx.socket(zmq.PULL)
        for sock in (self.dealer, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(events)
        self.dealer.connect(endpoint)
        self.events = events

    def hello(self, batch_events: bool) -> None:
        body = {"req_id": _HELLO_REQ_ID, "protocol": [PROTOCOL_MAJOR, PROTOCOL_MINOR], "client": "bench",
                "events": self.events, "batch_events": batch_events}  # fmt: skip
        self.dealer.send_multipart(encode_body(MsgType.HELLO, body))
        if not self.dealer.poll(10_000):
            raise RuntimeError("no hello reply within 10 s")
        self.dealer.recv_multipart()

    def run(self, name: str, messages: list[tuple[list[bytes], list[int]]], window: int, timeout_s: float) -> Part:
        """Sends ``messages`` (frames, req_ids inside) keeping ``window`` commands in flight."""
        sent_at: dict[int, float] = {}
        latencies: list[float] = []
        total = sum(len(ids) for _, ids in messages)
        failed = inflight = done = i = 0
        cpu_start = cpu_seconds(self.server_pid)
        start = time.perf_counter()
        deadline = start + timeout_s
        while done < total and time.perf_counter() < deadline:
            while i < len(messages) and (inflight == 0 or inflight + len(messages[i][1]) <= window):
                frames, ids = messages[i]
                self.dealer.send_multipart(frames)
                now = time.perf_counter()
                for req_id in ids:
                    sent_at[req_id] = now
                inflight, i = inflight + len(ids), i + 1
            if not self.pull.poll(100):
                continue
            now = time.perf_counter()
            for req_id, code in self._drain():
                latencies.append(now - sent_at.pop(req_id, now))
                failed += code != 0
                done, inflight = done + 1, inflight - 1
        seconds = time.perf_counter() - start
        cpu_us = (cpu_seconds(self.server_pid) - cpu_start) / max(1, total) * 1e6
        latencies.sort()
        p50 = latencies[len(latencies) // 2] if latencies else 0.0
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0
        return Part(name, total, seconds, p50 * 1e3, p99 * 1e3, failed + total - done, cpu_us)

    def _drain(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while True:
            try:
                header, body = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            decoded = msgpack.unpackb(body, raw=False)
            if header[3] == MsgType.EVENT_BATCH:
                out += [(e[0], e[2]) for e in decoded["events"]]
            else:
                out.append((decoded["req_id"], decoded["code"]))

    def close(self) -> None:
        self.dealer.close(0)
        self.pull.close(0)


def single_swaps(first_req: int, count: int, host_blocks: int) -> list[tuple[list[bytes], list[int]]]:
    """One SWAP_OUT per message, each on its own device and host block (ids cycle)."""
    out = []
    for req_id in range(first_req, first_req + count):
        body = {"req_id": req_id, "device_ids": [req_id % LAYOUT.num_blocks], "host_ids": [req_id % host_blocks]}
        out.append((encode_body(MsgType.SWAP_OUT, body), [req_id]))
    return out


def batched_swaps(first_req: int, count: int, host_blocks: int, per_batch: int) -> list[tuple[list[bytes], list[int]]]:
    out = []
    for start in range(first_req, first_req + count, per_batch):
        ids = list(range(start, min(start + per_batch, first_req + count)))
        items = [(MsgType.SWAP_OUT, {"req_id": r, "device_ids": [r % LAYOUT.num_blocks], "host_ids": [r % host_blocks]})
                 for r in ids]  # fmt: skip
        out.append((encode_batch(items), ids))
    return out


def chain(first_req: int, count: int) -> list[tuple[list[bytes], list[int]]]:
    """Alternating swap-out to host block 7 and swap-in from it: each waits for the last."""
    out = []
    for req_id in range(first_req, first_req + count):
        op, device = (MsgType.SWAP_OUT, 1) if req_id % 2 else (MsgType.SWAP_IN, 2)
        out.append((encode_body(op, {"req_id": req_id, "device_ids": [device], "host_ids": [7]}), [req_id]))
    return out


def _start_daemon(tmp: Path) -> DaemonProcess:
    settings = {"metrics.port": 0, "host_cache.capacity": "32MiB", "daemon.max_inflight": 50_000,
                "daemon.log_level": "warning", "storage.backend": "none"}  # fmt: skip
    daemon = DaemonProcess(tmp / "daemon", settings=settings)
    daemon.start()
    return daemon


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from ..client.runner import RunnerClient, ShmKVCache

    ctx: zmq.Context[Any] = zmq.Context()
    bare = start_bare_loop(f"ipc://{tmp}/bare.sock", f"ipc://{tmp}/bare-ev.sock")
    bare_gen = Generator(ctx, f"ipc://{tmp}/bare.sock", f"ipc://{tmp}/bare-ev.sock", bare.pid)
    daemon = _start_daemon(tmp)
    cache = ShmKVCache(LAYOUT)
    runner = RunnerClient(daemon.endpoint)
    try:
        host_blocks = int(runner.attach(cache)["host_blocks"])
        assert daemon.proc is not None
        plain = Generator(ctx, daemon.endpoint, f"ipc://{tmp}/ev-plain.sock", daemon.proc.pid)
        plain.hello(batch_events=False)
        batched = Generator(ctx, daemon.endpoint, f"ipc://{tmp}/ev-batch.sock", daemon.proc.pid)
        batched.hello(batch_events=True)
        return _parts(args, bare_gen, plain, batched, host_blocks)
    finally:
        runner.detach()
        runner.close()
        cache.close()
        daemon.stop()
        assert bare.stdin is not None
        bare.stdin.close()
        bare.wait(10)
        ctx.destroy(0)


def _parts(args: argparse.Namespace, bare: Generator, plain: Generator, batched: Generator,
           host_blocks: int) -> dict[str, Any]:  # fmt: skip
    req = iter(range(1, 1 << 40, 1 << 24))  # a fresh block of req_ids per part
    warm = min(args.count, 2000)
    bare.run("warm-up", single_swaps(next(req), warm, host_blocks), args.window, args.timeout)
    plain.run("warm-up", single_swaps(next(req), warm, host_blocks), args.window, args.timeout)
    ceilings, daemons = [], []
    for _ in range(args.rounds):
        ceilings.append(bare.run("(a) bare loop", single_swaps(next(req), args.count, host_blocks), args.window,
                                 args.timeout))  # fmt: skip
        daemons.append(plain.run("(b) daemon", single_swaps(next(req), args.count, host_blocks), args.window,
                                 args.timeout))  # fmt: skip
    parts = [_median(ceilings), _median(daemons)]
    for length in [int(n) for n in args.chains.split(",") if n]:
        msgs = chain(next(req), length)
        parts.append(plain.run(f"(c) chain of {length}", msgs, length, args.timeout))
    per_batch = batched_swaps(next(req), args.batch_count, host_blocks, args.batch)
    parts.append(batched.run(f"(d) daemon, batches of {args.batch}", per_batch, args.window, args.timeout))
    return {"parts": [asdict(p) | {"rate": p.rate} for p in parts], "ratios": _ratios(parts)}


def _median(parts: list[Part]) -> Part:
    ordered = sorted(parts, key=lambda p: p.rate)
    return ordered[len(ordered) // 2]


def _ratios(parts: list[Part]) -> dict[str, float]:
    by = {p.name: p for p in parts}
    bare = by["(a) bare loop"].rate
    ratios = {"b_over_a": by["(b) daemon"].rate / bare}
    batched = [p for p in parts if p.name.startswith("(d)")]
    if batched:
        ratios["d_over_a"] = batched[0].rate / bare
    chains = [p for p in parts if p.name.startswith("(c)")]
    if len(chains) >= 2:
        ratios["longest_chain_over_shortest"] = chains[-1].rate / chains[0].rate
    return ratios


def run(args: argparse.Namespace) -> int:
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cx-bench-") as tmp:
        report = measure(args, Path(tmp))
    # The machine's load beside the figures: on a shared machine the rates move with it.
    report["loadavg"] = {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]}
    _print(report, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    failed = sum(p["failed"] for p in report["parts"])
    return 1 if failed else 0


def _print(report: dict[str, Any], args: argparse.Namespace) -> None:
    from .harness import device_name

    print(f"cachexferd bench commands: {device_name('cpu')}, window {args.window}, median of {args.rounds} rounds")
    print(f"{'part':30} {'commands':>9} {'cmds/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu us/cmd':>10} {'failed':>7}")
    for p in report["parts"]:
        print(f"{p['name']:30} {p['commands']:9d} {p['rate']:9.0f} {p['p50_ms']:8.2f} {p['p99_ms']:8.2f} "
              f"{p['server_cpu_us']:10.1f} {p['failed']:7d}")  # fmt: skip
    ratios = report["ratios"]
    print(f"load average {report['loadavg']['start']} at start, {report['loadavg']['end']} at end")
    print(f"(b) / (a) = {ratios['b_over_a']:.0%} (target >= 50%)", end="")
    if "longest_chain_over_shortest" in ratios:
        print(f"; longest chain / shortest = {ratios['longest_chain_over_shortest']:.0%} (target >= 90%)", end="")
    if "d_over_a" in ratios:
        print(f"; (d) / (a) = {ratios['d_over_a']:.0%}", end="")
    print("; (d) target >= 50,000 commands/s")
