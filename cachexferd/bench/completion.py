"""``cachexferd bench completion``: how fast completions reach a busy engine scheduler.

An engine's scheduler thread runs CPU-bound steps and, at every step boundary, takes the
completions that arrived and submits the commands that are due. Here a step is pure Python
work calibrated to about ``--step-ms``, and the commands are single-block swaps (swap-out
and swap-in alternating, each on its own block) sent at a fixed rate to TP real daemons
(``cachexferd serve`` subprocesses, cpu backend, each with a runner process attached).
Each configuration (TP, rate) measures, back to back:

- ``idle``: the scheduler alone, no traffic: its own step rate (first, and after each run);
- ``floor``: a bare ZeroMQ client against bare pyzmq servers that answer each command at
  once (``bare_engine``): the delivery latency this host gives any pair of processes;
- ``bare``: that bare client against the daemons: the least client time per command; the
  client engines' time is read against it;
- ``client``: EngineClient, ``poll()`` at every step boundary, no thread;
- ``async``: AsyncEngineClient; the scheduler is a coroutine that yields
  (``await asyncio.sleep(0)``) between steps so the client's pump can run;
- ``queue``: the polled manager queue of ``polled_queue``, fed at the same rate.

For each: delivered / expected, delivery latency (origin to the step boundary where the
scheduler sees it) in ms and in steps, scheduler loss (steps/s against idle), and the time
the scheduler thread spends inside the client per command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import platform
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from .completion_engines import (
    LAYOUT,
    AsyncClientEngine,
    ClientEngine,
    Engine,
    IdleEngine,
    calibrate,
    steps,
    swap_command,
)
from .completion_report import (
    HEADER,
    TARGETS_TEXT,
    StepLog,
    add_floor,
    add_loss,
    check_targets,
    format_row,
    plot,
    summarize,
)

ENGINES = ("floor", "bare", "client", "batched", "async", "queue")
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'cachexferd[plots]')"
WARM_UP = 16  # commands completed before each client run starts measuring


def add_completion_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", default="2,1", help="TP ranks per configuration, comma-separated (paired with --rates)")
    p.add_argument("--rates", default="1000,5000", help="commands/s per configuration; one value applies to all")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of traffic per run")
    p.add_argument("--drain", type=float, default=5.0, help="seconds to wait for outstanding completions afterwards")
    p.add_argument("--step-ms", type=float, default=1.0, help="CPU work per scheduler step")
    p.add_argument("--async-yields", type=int, default=1,
                   help="async: asyncio.sleep(0) calls between two scheduler steps")  # fmt: skip
    p.add_argument("--engines", default=",".join(ENGINES), help="which of floor,bare,client,batched,async,queue to run")
    p.add_argument("--client-option", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword passed to both client constructors (value parsed as JSON, else a string)")  # fmt: skip
    p.add_argument("--json", help="write every run's figures (and machine info) to this file")
    p.add_argument("--plot", help="draw latency against offered rate into this PNG (needs matplotlib)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (daemon logs) afterwards")
    p.set_defaults(func=run)


def configs(tp: str, rates: str) -> list[tuple[int, float]]:
    """(TP, rate) pairs: the lists pair up; a list of one value is repeated to match."""
    tps, rs = [int(t) for t in tp.split(",")], [float(r) for r in rates.split(",")]
    if len(tps) == 1:
        tps *= len(rs)
    if len(rs) == 1:
        rs *= len(tps)
    if len(tps) != len(rs) or min(tps) < 1 or min(rs) <= 0:
        raise ValueError(f"--tp {tp} and --rates {rates} must pair up (same length, or one value), all > 0")
    return list(zip(tps, rs))


def client_options(items: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--client-option {item!r} must look like key=value")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


# One run of each engine ----------------------------------------------------------------


RunResult = tuple[StepLog, Engine]


class Daemons(NamedTuple):
    endpoints: list[str]
    pids: list[int]


def run_idle(daemons: Daemons, rate: float, args: argparse.Namespace, work: Callable[[], Any]) -> RunResult:
    engine, log = IdleEngine(), StepLog()
    for _ in steps(engine, work, rate, args.duration, 0.0, log):
        pass
    return log, engine


def run_client(daemons: Daemons, rate: float, args: argparse.Namespace, work: Callable[[], Any],
               batched: bool = False) -> RunResult:  # fmt: skip
    from ..client import EngineClient

    with EngineClient(daemons.endpoints, name="bench-completion", **args.client_options) as client:
        client.connect()
        client.wait([client.submit(*swap_command(i)) for i in range(WARM_UP)], timeout_s=30)
        engine, log = ClientEngine(client, daemons.pids, batched=batched), StepLog()
        for _ in steps(engine, work, rate, args.duration, args.drain, log):
            pass
    return log, engine


def run_bare(daemons: Daemons, rate: float, args: argparse.Namespace, work: Callable[[], Any],
             floor: bool = False) -> RunResult:  # fmt: skip
    from .bare_engine import BareZmqEngine

    if floor:
        engine = BareZmqEngine(None, [], ranks=len(daemons.endpoints))
    else:
        engine = BareZmqEngine(daemons.endpoints, daemons.pids)
    return _run_then_close(engine, rate, args, work, functools.partial(engine.warm_up, WARM_UP))


def run_async(daemons: Daemons, rate: float, args: argparse.Namespace, work: Callable[[], Any]) -> RunResult:
    from ..client import AsyncEngineClient

    async def main() -> RunResult:
        async with AsyncEngineClient(daemons.endpoints, name="bench-completion", **args.client_options) as client:
            await client.connect()
            await asyncio.wait_for(asyncio.gather(*(client.submit(*swap_command(i)) for i in range(WARM_UP))), 30)
            engine, log = AsyncClientEngine(client, daemons.pids), StepLog()
            for _ in steps(engine, work, rate, args.duration, args.drain, log):
                started = engine.client_time.start()
                for _ in range(args.async_yields):
                    await asyncio.sleep(0)  # the pump runs here, between steps
                engine.client_time.stop("yield", started)
        return log, engine

    return asyncio.run(main())


def run_queue(daemons: Daemons, rate: float, args: argparse.Namespace, work: Callable[[], Any]) -> RunResult:
    from .polled_queue import PolledQueueEngine

    return _run_then_close(PolledQueueEngine(rate, args.duration), rate, args, work)


def _run_then_close(engine: Any, rate: float, args: argparse.Namespace, work: Callable[[], Any],
                    prepare: Callable[[], None] | None = None) -> RunResult:  # fmt: skip
    """Runs the scheduler against an engine that holds processes or sockets of its own."""
    try:
        if prepare is not None:
            prepare()
        log = StepLog()
        for _ in steps(engine, work, rate, args.duration, args.drain, log):
            pass
    finally:
        engine.close()
    return log, engine


RUNS: dict[str, Callable[[Daemons, float, argparse.Namespace, Callable[[], Any]], RunResult]] = {
    "floor": functools.partial(run_bare, floor=True),
    "bare": run_bare,
    "client": run_client,
    "batched": functools.partial(run_client, batched=True),
    "async": run_async,
    "queue": run_queue,
}


def run_config(
    cluster: Cluster, tp: int, rate: float, args: argparse.Namespace, work: Callable[[], Any]
) -> list[dict[str, Any]]:
    """Idle, then each engine followed by idle again: every traffic run sits between two
    idle runs, its loss baseline, so a drift in the CPU's speed hits both alike."""
    daemons, rows = cluster.first(tp), []
    for name in ["idle"] + [n for engine in args.engine_list for n in (engine, "idle")]:
        cluster.wait_quiet()  # a daemon still working off an overload would skew the next run
        log, engine = (run_idle if name == "idle" else RUNS[name])(daemons, rate, args, work)
        rows.append(summarize(name, tp, rate, log, engine.expected, engine.client_time))
        rows[-1]["errors"] = dict(getattr(engine, "errors", {}))  # what failed completions said
    add_loss(rows)
    add_floor(rows)
    for row in rows:
        print(format_row(row), flush=True)
    return rows


# Daemons and runners -------------------------------------------------------------------


class Cluster:
    """``tp`` daemon subprocesses (cpu backend), each with a runner process attached."""

    def __init__(self, workdir: Path, tp: int) -> None:
        self.workdir, self.tp = workdir, tp
        self.daemons: list[Any] = []
        self.runners: list[subprocess.Popen[str]] = []

    def start(self) -> Cluster:
        from ..launch import DaemonProcess

        capacity = LAYOUT.num_blocks * LAYOUT.host_block_bytes
        for rank in range(self.tp):
            settings = {"metrics.port": 0, "host_cache.capacity": max(capacity, 1 << 20), "daemon.log_level": "warning"}
            daemon = DaemonProcess(self.workdir / f"rank{rank}", rank=rank, settings=settings)
            self.daemons.append(daemon)
            daemon.start()
            self.runners.append(start_runner(daemon.endpoint))
        return self

    def first(self, tp: int) -> Daemons:
        return Daemons([d.endpoint for d in self.daemons[:tp]], [d.proc.pid for d in self.daemons[:tp]])

    def wait_quiet(self, timeout_s: float = 120.0) -> None:
        """Until no daemon has a command queued or running (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = 0
            for daemon in self.daemons:
                with contextlib.suppress(Exception):  # a reply stuck behind a backlog: ask again
                    commands = daemon.status(timeout_s=5.0)["commands"]
                    busy += int(commands["queued"]) + int(commands["running"])
                    continue
                busy += 1
            if not busy:
                return
            time.sleep(0.2)
        print(f"warning: daemons still busy after {timeout_s:g} s; the next run starts anyway", flush=True)

    def close(self) -> None:
        for proc in self.runners:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.write("detach\n")
                proc.stdin.flush()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for daemon in self.daemons:
            daemon.stop()


def start_runner(endpoint: str, timeout_s: float = 60.0) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "cachexferd.bench.completion", "runner", endpoint]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else ""
    if line != "attached":
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"runner for {endpoint} did not attach in {timeout_s}s: {line!r}")
    return proc


def runner_main(endpoint: str) -> int:
    """A model runner: a small shared-memory KV cache attached until a line on stdin."""
    from ..client import RunnerClient, ShmKVCache

    with ShmKVCache(LAYOUT) as cache, RunnerClient(endpoint, name="bench-runner") as runner:
        runner.attach(cache)
        print("attached", flush=True)
        sys.stdin.readline()
        runner.detach()
    return 0


# The command ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        pairs = configs(args.tp, args.rates)
        args.client_options = client_options(args.client_option)
        args.engine_list = [e for e in args.engines.split(",") if e]
        if not set(args.engine_list) <= set(ENGINES):
            raise ValueError(f"--engines takes a subset of {','.join(ENGINES)}, not {args.engines}")
    except ValueError as exc:
        print(f"cachexferd bench completion: {exc}", file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"warning: --plot: {NO_MATPLOTLIB}; measuring anyway", file=sys.stderr)
    work, iterations, measured = calibrate(args.step_ms / 1000)
    info = machine(args, iterations, measured)
    print(header(info, args), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="cx-bench-"))
    cluster = Cluster(workdir, max(tp for tp, _ in pairs))
    rows: list[dict[str, Any]] = []
    try:
        cluster.start()
        print(HEADER, flush=True)
        for tp, rate in pairs:
            rows += run_config(cluster, tp, rate, args, work)
    finally:
        cluster.close()
        if args.keep:
            print(f"daemon logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report(rows, info, args)
    return 0


def report(rows: list[dict[str, Any]], info: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"load average at start {info['loadavg_start']}, at end {info['loadavg_end']}")
    print(TARGETS_TEXT)
    for r in rows:
        if r["engine"] != "idle":
            print(f"  {r['engine']:6} TP={r['tp']} {r['rate']:.0f}/s: " + "; ".join(check_targets(r)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": info, "runs": rows}, out, indent=1)
    if args.plot:
        title = f"completion delivery, {info['step_ms']:.2f} ms CPU steps, {info['device']} ({info['cpus']} cpus)"
        if plot(rows, args.plot, title):
            print(f"plot written to {args.plot}")
        else:
            print(f"no plot: {NO_MATPLOTLIB}")


def machine(args: argparse.Namespace, iterations: int, measured_s: float) -> dict[str, Any]:
    return {
        "device": cpu_name(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["cachexferd", *sys.argv[1:]]),
        "step_ms": round(measured_s * 1000, 4),
        "step_iterations": iterations,
        "block_bytes": LAYOUT.host_block_bytes,
        "client_options": args.client_options,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown cpu"


def header(info: dict[str, Any], args: argparse.Namespace) -> str:
    return (
        f"cachexferd bench completion: scheduler steps of {info['step_ms']:.3f} ms CPU work, single-block swaps "
        f"({info['block_bytes'] >> 10} KiB) to cpu-backend daemons, {args.duration:g} s per run; "
        f"{info['device']} ({info['cpus']} cpus), load average {info['loadavg_start']}"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["runner"] and len(sys.argv) == 3:
        sys.exit(runner_main(sys.argv[2]))
    sys.exit("usage: python -m cachexferd.bench.completion runner ENDPOINT")
