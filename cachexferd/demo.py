"""``cachexferd demo``: the whole system end to end on this machine.

Two daemons (TP=2, cpu backend) and two model-runner processes run as subprocesses; each
runner owns a shared-memory KV cache filled with known data and attaches it to its daemon.
The engine (this process) swaps a few hundred blocks out and back in, in mixed pipelined
orders, then verifies every byte on both ranks and that untouched blocks are unchanged,
prints a summary, and cleans up every process it started. Exit status 0 only if all is exact.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .client import EngineClient
from .client.pending import Completion
from .launch import DaemonProcess
from .protocol import KVLayout
from .units import human_bytes

TP = 2
LAYOUT = KVLayout(num_layers=8, num_blocks=512, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")


def add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the whole system end to end on this machine")
    p.add_argument("--blocks", type=int, default=256, help="blocks swapped out and back in per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the temp dir (daemon logs) afterwards")
    p.add_argument("--storage", default="file", choices=("file", "redis", "mooncake", "none"),
                   help="storage backend for the prefill->decode handoff part ('none' skips it)")  # fmt: skip
    p.add_argument("--storage-url", help="redis: URL of a running server (default: start one on loopback)")
    p.add_argument("--storage-master", help="mooncake: master host:port (default: start a master + node on loopback)")
    from .demo_chat import add_chat_args

    add_chat_args(p)
    p.set_defaults(func=run)


@dataclass
class Plan:
    """What the engine did, so the expected final contents can be computed."""

    moves: dict[int, int] = field(default_factory=dict)  # device block -> original block it must hold now
    completions: list[Completion] = field(default_factory=list)


def run(args: argparse.Namespace) -> int:
    if args.chat:
        from .demo_chat import run_chat

        return run_chat(args)
    if args.blocks * 2 > LAYOUT.num_blocks:
        print(f"--blocks must be at most {LAYOUT.num_blocks // 2}", file=sys.stderr)
        return 2
    problem = storage_problem_of(args)
    if problem:
        print(f"cachexferd: demo --storage {args.storage}: {problem}", file=sys.stderr)
        return 2
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens, also through a pipe
    print_header()
    workdir = Path(tempfile.mkdtemp(prefix="cachexferd-demo-"))
    daemons: list[DaemonProcess] = []
    runners: list[subprocess.Popen[str]] = []
    try:
        daemons = start_daemons(workdir)
        runners, segments = start_runners(daemons, args.seed)
        ok = drive_engine(daemons, segments, args)
        ok = run_storage_part(args, workdir) and ok
        return 0 if ok else 1
    except Exception as exc:
        return report_failure(exc, daemons)
    finally:
        clean_up(daemons, runners, workdir, args.keep)


def storage_problem_of(args: argparse.Namespace) -> str:
    """Why the storage part cannot run here ('' if it can): checked before anything starts."""
    if args.storage == "none":
        return ""
    try:
        from .demo_pd import storage_problem
    except ImportError:
        return ""  # the storage part says it is skipped
    return storage_problem(args.storage, args.storage_url, args.storage_master)


def report_failure(exc: Exception, daemons: list[DaemonProcess]) -> int:
    """Says what failed, with each daemon's last log lines; the demo's exit status (1)."""
    print(f"demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    for daemon in daemons:
        print(f"--- rank {daemon.rank} log ---\n{daemon.log_tail(15)}", file=sys.stderr)
    return 1


def clean_up(daemons: list[DaemonProcess], runners: list[subprocess.Popen[str]], workdir: Path, keep: bool) -> None:
    stop_all(daemons, runners)
    if keep:
        print(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def start_daemons(workdir: Path) -> list[DaemonProcess]:
    daemons = []
    capacity = 2 * LAYOUT.num_blocks * LAYOUT.host_block_bytes
    print(f"  starting   {TP} daemons (python -m cachexferd serve, a few seconds each: torch loads)")
    for rank in range(TP):
        daemon = DaemonProcess(
            workdir / f"rank{rank}", rank=rank, settings={"metrics.port": 0, "host_cache.capacity": capacity}
        )
        daemons.append(daemon)
        started = time.perf_counter()
        status = daemon.start()
        print(
            f"  rank {rank}     ready in {time.perf_counter() - started:.1f} s: {status['endpoint']}   "
            f"metrics {status['metrics_url']} (until the demo ends)"
        )
    return daemons


def start_runners(daemons: list[DaemonProcess], seed: int) -> tuple[list[subprocess.Popen[str]], list[str]]:
    runners, segments = [], []
    print(f"  starting   {TP} runner processes: shared-memory KV caches of known data, attached to their daemons")
    for daemon in daemons:
        argv = [
            sys.executable,
            "-m",
            "cachexferd.demo_runner",
            daemon.endpoint,
            json.dumps(LAYOUT.to_wire()),
            str(seed + daemon.rank),
        ]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        runners.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("attached "):
            raise RuntimeError(f"runner for rank {daemon.rank} did not attach: {line!r}")
        segments.append(line.split()[1])
        print(f"  rank {daemon.rank}     runner pid {proc.pid} attached {line.split()[1]}")
    return runners, segments


def drive_engine(daemons: list[DaemonProcess], segments: list[str], args: argparse.Namespace) -> bool:
    from .demo_runner import verify_segment

    rng = random.Random(args.seed)
    print(f"  swapping   {args.rounds} rounds of {args.blocks} blocks out and back in, pipelined, on both ranks")
    plan = Plan()
    started = time.perf_counter()
    with EngineClient([d.endpoint for d in daemons], name="demo-engine") as engine:
        engine.connect()
        for _ in range(args.rounds):
            swap_round(engine, plan, rng, args.blocks)
        elapsed = time.perf_counter() - started
    errors = [c.describe() for c in plan.completions if not c.ok]
    print("  verifying  every block of both device caches against the expected bytes")
    bad = [verify_segment(name, LAYOUT, args.seed + rank, plan.moves) for rank, name in enumerate(segments)]
    print_summary(plan, elapsed, errors, bad)
    return not errors and not any(bad)


def swap_round(engine: EngineClient, plan: Plan, rng: random.Random, blocks: int) -> None:
    """Swap ``blocks`` device blocks out, then in to other device blocks, pipelined.

    Commands mix contiguous runs and scattered ids; each swap-in is sent right after the
    swap-out that fills its host blocks, so the daemon's ordering is what makes it exact.
    """
    half = LAYOUT.num_blocks // 2
    sources = rng.sample(range(half), blocks)
    targets = rng.sample(range(half, LAYOUT.num_blocks), blocks)
    host = list(range(blocks)) if rng.random() < 0.5 else rng.sample(range(2 * blocks), blocks)
    pending = []
    at = 0
    while at < blocks:
        n = min(blocks - at, rng.choice((1, 4, 16, 32)))
        chunk = slice(at, at + n)
        if rng.random() < 0.5:  # a contiguous run on both sides
            sources[chunk] = list(range(sources[at], sources[at] + n)) if sources[at] + n <= half else sources[chunk]
        pending.append(engine.swap_out(sources[chunk], host[chunk]))
        pending.append(engine.swap_in(targets[chunk], host[chunk]))
        at += n
    done = engine.wait(pending, timeout_s=120)
    plan.completions += done.values()
    for src, dst in zip(sources, targets):
        plan.moves[dst] = plan.moves.get(src, src)


def print_header() -> None:
    print(
        f"cachexferd demo: {TP} daemons (TP={TP}, cpu backend), {TP} runner processes; KV cache "
        f"{LAYOUT.num_layers} layers x {LAYOUT.kv_tensors} tensors x {LAYOUT.num_blocks} blocks, "
        f"{human_bytes(LAYOUT.host_block_bytes)} per block ({LAYOUT.dtype})"
    )


def print_summary(plan: Plan, elapsed: float, errors: list[str], bad: list[str]) -> None:
    swaps = [c for c in plan.completions if c.ok]
    blocks = sum(int(c.result().get("blocks", 0)) for c in swaps)
    moved = sum(int(o.result.get("bytes", 0)) for c in swaps for o in c.outcomes.values())
    lat = sorted(c.latency_s * 1000 for c in plan.completions)
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
    print(f"  commands   {len(plan.completions)} swaps ({len(errors)} failed), {blocks} blocks per rank")
    print(f"  moved      {human_bytes(moved)} over {TP} ranks in {elapsed:.2f} s = {moved / elapsed / 1e9:.2f} GB/s")
    p50 = statistics.median(lat) if lat else 0.0
    print(f"  latency    p50 {p50:.2f} ms, p99 {p99:.2f} ms (submit -> all ranks done; a round is sent at once)")
    for line in errors[:10]:
        print(f"  ERROR {line}")
    for rank, problem in enumerate(bad):
        print(f"  verify rank {rank}: {problem or f'all {LAYOUT.num_blocks} blocks exact (moved and untouched)'}")
    print("demo swap: OK" if not errors and not any(bad) else "demo swap: FAILED")


def run_storage_part(args: argparse.Namespace, workdir: Path) -> bool:
    if args.storage == "none":
        return True
    try:
        from .demo_pd import run_pd_handoff
    except ImportError:
        print("prefill->decode handoff: skipped (storage tier not installed)")
        return True
    print(f"prefill->decode handoff via {args.storage}: starting a prefill and a decode daemon that share it ...")
    summary = run_pd_handoff(workdir / "pd", backend=args.storage, url=args.storage_url, master=args.storage_master)
    ok = bool(summary.get("ok"))
    print(f"prefill->decode handoff via {args.storage}: {'OK' if ok else 'FAILED'} {summary.get('detail', '')}")
    return ok


def stop_all(daemons: list[DaemonProcess], runners: list[subprocess.Popen[str]]) -> None:
    for proc in runners:
        if proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.write("detach\n")
                proc.stdin.flush()
                proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait(10)
    for daemon in daemons:
        daemon.stop()
