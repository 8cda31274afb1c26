"""What publishing the plug-in's tiers in vLLM's KV events costs (``bench --kv-events``).

Two parts, each with events on and off in the same run:

- per block stored, engine-side: the index's event records and ``TierEvents`` (the keys it
  remembers, the events it builds), measured alone over stores of ``--micro-blocks`` blocks
  into a host tier that evicts;
- two plug-in engines, one with vLLM's ``kv_events_config`` on (a router subscribed from
  another process), one without, each with a daemon of its own, served the same turns
  interleaved (none always goes first): the time the plug-in's scheduler side (the
  manager's calls) takes per engine step, TTFT, and the CPU time each daemon spent per
  block it stored. The engines run in this process (vLLM's in-process engine core) so that
  the manager's calls can be timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...index import OffloadIndex
from ..engine.index_calls import Chains, prepare_stores
from .bench import DaemonProcess  # the vLLM benchmark starts daemons with the launcher
from .child import LineChild, answer_lines
from .events import TierEvents

TIMED = ("lookup", "on_schedule_end", "prepare_load", "touch", "complete_load", "prepare_store", "complete_store",
         "mark_failed", "take_events")  # fmt: skip
_ROUTER = """import select, sys, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(sys.argv[1])
count = 0
while not select.select([sys.stdin], [], [], 0)[0]:  # until stdin closes
    while sock.poll(100):
        sock.recv_multipart()
        count += 1
print(count)
"""  # a router in a process of its own: counts the event batches it receives


def micro(blocks: int, chain: int = 16, host_blocks: int = 2048, rounds: int = 7) -> dict[str, Any]:
    """CPU µs per block stored (know, place, complete, events taken), events off and on,
    alternated; the fastest round of each (the least disturbed on a shared machine)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    rng = random.Random(0)
    for _ in range(rounds):
        for on in (False, True):
            digests = [rng.randbytes(16) for _ in range(blocks)]
            index, events = OffloadIndex(host_blocks, events=on), TierEvents(enabled=on)
            start = time.process_time()
            for i in range(0, blocks, chain):
                run = digests[i : i + chain]
                events.know([d + b"\0\0\0\0" for d in run], run)  # vLLM's keys: hash and group
                if prepare_stores(index, run, chains=Chains()) is not None:
                    index.complete_store(run)
                events.add(index.take_events())
                events.take()
            times[on].append((time.process_time() - start) / blocks * 1e6)
    off, on_ = min(times[False]), min(times[True])
    return {"off_us": off, "on_us": on_, "events_us": on_ - off, "rounds_off_us": times[False],
            "rounds_on_us": times[True]}  # fmt: skip


_PUBLISHING = ("events_s", "events_calls", "take_events_s", "take_events_calls", "connector_take_s",
               "connector_take_calls", "publish_s", "publish_calls", "publisher_thread_s", "wall_s")  # fmt: skip
_EVENT_CALLS = ("know", "add", "gone", "host_gone", "take")  # TierEvents: all of the plug-in's event work


def timer_cost_s(rounds: int = 5000) -> float:
    """What timing one call adds to the time measured: the same wrapper (``timed``) around a
    call that does nothing, per call; taken off each timed call's figure."""
    totals: dict[str, float] = {}
    nothing = timed(_nothing, totals, "nothing")
    for _ in range(rounds):
        nothing()
    return totals["nothing_s"] / rounds


def _nothing() -> None:
    return None


def timed(call: Any, totals: dict[str, float], key: str) -> Any:
    """``call`` adding its thread CPU time to ``totals[key + "_s"]`` and its calls to
    ``totals[key + "_calls"]``; a generator's work is done inside (vLLM lists it anyway)."""
    seconds, calls = f"{key}_s", f"{key}_calls"  # made once: inside the clock reads they would count
    totals.setdefault(seconds, 0.0)
    totals.setdefault(calls, 0.0)
    listed = key == "connector_take"

    def wrapper(*args: Any) -> Any:
        start = time.thread_time()
        try:
            out = call(*args)
            return list(out) if listed else out
        finally:
            totals[seconds] += time.thread_time() - start
            totals[calls] += 1

    return wrapper


def time_event_work(totals: dict[str, float]) -> None:
    """Times every ``TierEvents`` call (the plug-in's event work, inside the manager's calls)
    as ``events``; before the engine is made, so that callbacks bound at its start count too."""
    for name in _EVENT_CALLS:
        setattr(TierEvents, name, timed(getattr(TierEvents, name), totals, "events"))


def time_vllm_publishing(llm: Any, totals: dict[str, float]) -> None:
    """vLLM's side of the events, in the same totals: turning the connector's events into
    its KV events (``connector_take``, the manager's ``take_events`` included) and handing
    each batch to its publisher (``publish``); the publisher thread's own CPU is read at
    each answer (``publisher_thread_s``)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    connector, publisher = scheduler.connector, scheduler.kv_event_publisher
    connector.take_events = timed(connector.take_events, totals, "connector_take")
    publisher.publish = timed(publisher.publish, totals, "publish")


def thread_cpu_s(name: str) -> float:
    """The CPU time of this process's thread ``name`` (0 when there is none)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            return int(Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()[0]) / 1e9
    return 0.0


def timed_manager(llm: Any) -> dict[str, float]:
    """Wraps the plug-in manager's calls of an in-process engine; returns the running totals:
    the CPU time of the engine's thread in them (not the wall time: on a shared machine, a
    call preempted by another process would count that process's time)."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    totals = {"seconds": 0.0, "steps": 0.0, "take_events_s": 0.0, "take_events_calls": 0.0}

    def wrap(name: str) -> None:
        call = getattr(manager, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                totals["seconds"] += spent
                totals["steps"] += name == "on_schedule_end"
                if name == "take_events":
                    totals["take_events_s"] += spent
                    totals["take_events_calls"] += 1

        setattr(manager, name, timed)

    for name in TIMED:
        wrap(name)
    return totals


def daemon_cpu_s(daemon: DaemonProcess) -> float:
    assert daemon.proc is not None
    fields = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def journal_cpu_s(daemon: DaemonProcess) -> float:
    """The CPU seconds the daemon's storage journal has cost it (writes, and reading what was
    appended), from its STATUS; 0 without a journal."""
    journal = (daemon.status().get("storage") or {}).get("journal") or {}
    return float(journal.get("write_cpu_s", 0.0)) + float(journal.get("read_cpu_s", 0.0))


class EngineChild(LineChild):
    """A plug-in engine in a process of its own (vLLM keeps one KV connector per process),
    its engine core in-process so that the manager's calls are timed there. Each prompt's
    answer: the TTFT and the manager's running totals."""

    def __init__(self, args: argparse.Namespace, model: Path, daemon: str, events: str | None) -> None:
        super().__init__(__name__, {"args": vars(args), "model": str(model), "daemon": daemon, "events": events})

    def ask(self, tokens: list[int], timeout_s: float = 300.0) -> dict[str, Any]:
        return dict(super().ask(tokens, timeout_s))


def serve_engine(config: dict[str, Any]) -> None:
    """The child's side of ``EngineChild``."""
    from .bench import engine, ttft

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args = argparse.Namespace(**config["args"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    more: dict[str, Any] = {}
    if config["events"]:
        more["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                    "endpoint": config["events"], "topic": ""}  # fmt: skip
    events: dict[str, float] = {"timer_s": timer_cost_s()}
    time_event_work(events)
    llm = engine(args, Path(config["model"]), config["daemon"], **more)
    totals = timed_manager(llm)
    if config["events"]:
        time_vllm_publishing(llm, events)
        idle = thread_cpu_s("zmq-publisher")
        time.sleep(2.0)  # the publisher thread with nothing to publish
        events["publisher_idle_rate"] = (thread_cpu_s("zmq-publisher") - idle) / 2.0

    def handle(tokens: list[int]) -> dict[str, Any]:
        seconds, cached = ttft(llm, tokens)
        return {"ttft_s": seconds, "cached_tokens": cached, **totals, **events,
                "publisher_thread_s": thread_cpu_s("zmq-publisher"), "wall_s": time.monotonic()}  # fmt: skip

    answer_lines(config["fd"], handle)


def engines_phase(args: argparse.Namespace, model: Path, root: Path) -> dict[str, Any]:
    from .bench import conversation_turns, daemon_counters

    endpoint = f"ipc://{root}/kv-events.sock"
    router = subprocess.Popen([sys.executable, "-c", _ROUTER, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    daemons: dict[str, DaemonProcess] = {}
    engines: dict[str, EngineChild] = {}
    out: dict[str, Any] = {"rows": [], "steps": {}, "daemon": {}}
    try:
        for name, events in (("events off", None), ("events on", endpoint)):
            home = root / name.replace(" ", "-")
            daemons[name] = DaemonProcess(home, settings={
                "metrics.port": 0, "host_cache.capacity": args.host_capacity,
                "storage.file.path": str(home / "storage")})  # fmt: skip
            daemons[name].start(timeout_s=60)
            engines[name] = EngineChild(args, model, daemons[name].endpoint, events)
        warm = conversation_turns(argparse.Namespace(**{**vars(args), "conversations": 1, "turns": 1}))[0][2]
        first = {name: child.ask(warm[:64]) for name, child in engines.items()}  # set-up out of the figures
        before = {n: (daemon_cpu_s(d), daemon_counters(d), journal_cpu_s(d)) for n, d in daemons.items()}
        last = dict(first)
        pair = list(engines.items())
        for i, (_conv, turn, tokens) in enumerate(conversation_turns(args)):
            for name, child in pair if i % 2 == 0 else pair[::-1]:
                last[name] = child.ask(tokens)
                out["rows"].append({"engine": name, "turn": turn, "ttft_s": last[name]["ttft_s"],
                                    "cached_tokens": last[name]["cached_tokens"]})  # fmt: skip
        for name, daemon in daemons.items():
            cpu, counters, journal = before[name]
            d2h = 'cachexferd_transfer_bytes_total{direction="d2h"}'
            stored = daemon_counters(daemon).get(d2h, 0.0) - counters.get(d2h, 0.0)
            written = 'cachexferd_transfer_bytes_total{direction="store"}'
            objects = daemon_counters(daemon).get(written, 0.0) - counters.get(written, 0.0)
            block_bytes = int(daemon.status()["host_cache"]["block_bytes"]) or 1
            out["daemon"][name] = {"cpu_s": daemon_cpu_s(daemon) - cpu, "blocks_stored": stored / block_bytes,
                                   "objects_stored": objects / block_bytes,
                                   "journal_cpu_s": journal_cpu_s(daemon) - journal}  # fmt: skip
            spent = {k: last[name].get(k, 0.0) - first[name].get(k, 0.0) for k in _PUBLISHING}
            spent.update({k: last[name].get(k, 0.0) for k in ("timer_s", "publisher_idle_rate")})
            out["steps"][name] = {"steps": last[name]["steps"] - first[name]["steps"],
                                  "manager_s": last[name]["seconds"] - first[name]["seconds"], **spent}  # fmt: skip
    finally:
        for child in engines.values():
            child.close()
        for daemon in daemons.values():
            daemon.stop()
        out["router_batches"] = int(router.communicate("", timeout=30)[0] or 0)
    return out


def summarize(result: dict[str, Any]) -> str:
    m = result["micro"]
    lines = [f"engine-side, per block stored: events off {m['off_us']:.2f} µs, on {m['on_us']:.2f} µs: "
             f"events {m['events_us']:.2f} µs per block"]  # fmt: skip
    e = result["engines"]
    per_step = {}
    for name in ("events off", "events on"):
        s, d = e["steps"][name], e["daemon"][name]
        per_step[name] = s["manager_s"] / max(s["steps"], 1) * 1e6
        ttfts = [r["ttft_s"] for r in e["rows"] if r["engine"] == name and r["turn"] > 0]
        cpu_block = d["cpu_s"] / max(d["blocks_stored"], 1) * 1e6
        lines.append(f"{name:<10}: plug-in scheduler side {per_step[name]:.0f} µs/step over {s['steps']:.0f} steps; "
                     f"returning turns' TTFT median {statistics.median(ttfts) * 1000:.0f} ms; daemon CPU "
                     f"{cpu_block:.0f} µs per block stored ({d['blocks_stored']:.0f} blocks)")  # fmt: skip
        if d.get("objects_stored"):
            rate = d["journal_cpu_s"] / max(s["wall_s"], 1e-9) * 1e6
            lines.append(f"{'':<10}  its storage journal: {d['journal_cpu_s'] * 1e3:.1f} ms of CPU over the "
                         f"{s['wall_s']:.0f} s measured ({rate:.0f} µs/s), "
                         f"{d['journal_cpu_s'] / d['objects_stored'] * 1e6:.1f} µs per object stored "
                         f"({d['objects_stored']:.0f} objects)")  # fmt: skip
    on, off = per_step["events on"], per_step["events off"]
    count = {n: max(sum(r["engine"] == n for r in e["rows"]), 1) for n in per_step}
    requests = {n: e["steps"][n]["manager_s"] / count[n] * 1e6 for n in per_step}
    lines.append(f"plug-in scheduler side per request: events off {requests['events off']:.0f} µs, on "
                 f"{requests['events on']:.0f} µs ({requests['events on'] / requests['events off']:.3f}x)")  # fmt: skip
    lines.append(f"events on / off, plug-in time per step: {on / off:.3f}x ({on - off:+.0f} µs); "
                 f"{e['router_batches']} event batches reached the router")  # fmt: skip
    lines.append(publishing_share(e["steps"]["events on"]))
    lines.append("load average at start: " + " ".join(f"{x:.2f}" for x in result["load_avg"]))
    return "\n".join(lines)


def publishing_share(on: dict[str, float]) -> str:
    """The events' share of the events-on engine's plug-in step time, measured in that engine:
    the plug-in's event work, then vLLM's translation of the plug-in's events and its hand-off
    to the publisher, over the manager's time without the event work. Each timed call's
    figure has the timer's own cost taken off. vLLM's publisher thread runs beside the step
    (it also publishes vLLM's own device-tier events, and polls when idle): reported apart."""
    steps, timer = max(on["steps"], 1), on["timer_s"]

    def net(key: str) -> float:
        return max(on[f"{key}_s"] - on[f"{key}_calls"] * timer, 0.0)

    work = net("events")
    translate = max(net("connector_take") - net("take_events"), 0.0)  # vLLM's part of take_events
    publish = net("publish")
    base = on["manager_s"] - on["events_s"]
    idle = on["publisher_idle_rate"] * on["wall_s"]
    per = {k: v / steps * 1e6 for k, v in (("work", work), ("translate", translate), ("publish", publish),
                                          ("thread", on["publisher_thread_s"]), ("idle", idle),
                                          ("base", base))}  # fmt: skip
    return (
        f"events on, per step: the plug-in without events {per['base']:.0f} µs; its event work {per['work']:.1f} µs "
        f"({work / max(base, 1e-9) * 100:.2f}%), vLLM's translation {per['translate']:.1f} µs and hand-off "
        f"{per['publish']:.1f} µs (together {(work + translate + publish) / max(base, 1e-9) * 100:.2f}% of the "
        f"plug-in's time); vLLM's publisher thread {per['thread']:.1f} µs beside the step, of which "
        f"{per['idle']:.1f} µs its polling while idle ({on['publisher_idle_rate'] * 1e6:.0f} µs/s)"
    )


def run(args: argparse.Namespace, model: Path, root: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"load_avg": os.getloadavg(), "micro": micro(args.micro_blocks)}
    result["engines"] = engines_phase(args, model, root)
    return result


if __name__ == "__main__":  # an engine process of EngineChild
    serve_engine(json.loads(sys.argv[1]))
