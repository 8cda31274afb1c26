"""Multi-turn benchmark: vLLM on CPU with and without the plug-in, in the same run.

    python -m cachexferd.integrations.vllm.bench [--kind dense|sliding_window|gdn|mla]
                                                 [--conversations 6 --turns 3 ...] [--json FILE]

A random-weight model (made here with transformers; no download) serves ``conversations``
chats round-robin: a Llama of ``--layers``/``--hidden``/... for ``--kind dense`` (the
default), else the tiny model of that kind (tiny_models.py: Gemma 3 with sliding windows,
Qwen3-Next with gated-delta-net state, DeepSeek-V2 with MLA). Each turn sends the whole
history plus ``user_tokens`` new tokens and asks for one token, so the request's latency
is its time to first token (TTFT); the reply is appended as ``reply_tokens`` synthetic
tokens. vLLM's KV cache holds about two
histories, so a returning conversation has been evicted from vLLM's own prefix cache:
without the plug-in vLLM recomputes it, with it the blocks come back from the daemon's
host cache. Both engines (separate processes) get the same turns, interleaved, and each
turn's TTFT and prefill rate (prompt tokens / TTFT) are reported for returning turns (first
turns, which no cache can help, show whether the two engines run alike on this machine),
with the blocks and bytes the daemon moved. A third engine, vLLM alone with a KV cache that
holds every conversation (``roomy``), shows what a hit in vLLM's own cache costs: the
plug-in's returning turns are compared with it too.

``--kv-events``: instead, what publishing the plug-in's tiers in vLLM's KV events costs, with
events on and off in the same run (bench_events.py).

Also measured, each with vLLM alone in the same run:
- memory: one engine of each kind with a larger KV cache (``--memory-kv-mib``), each in a
  process of its own: start-up time and the worker's peak RSS (VmHWM);
- stalls: the daemon killed while the engines are idle, then stopped (SIGSTOP): the
  latency of the requests that follow, against vLLM alone's for the same requests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ...launch import DaemonProcess as DaemonProcess  # also for bench_events (the launcher is a command)
from .tiny_models import KINDS

BLOCK = 32


def make_model(path: Path, layers: int, hidden: int, heads: int, kv_heads: int) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model: Any = LlamaForCausalLM(config)  # transformers' stubs mistype .to(dtype)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1024)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


def page_bytes_per_block(args: argparse.Namespace) -> int:
    return int(2 * args.kv_heads * (args.hidden // args.heads) * 2 * BLOCK * args.layers)


def engine(
    args: argparse.Namespace, model: Path, endpoint: str | None, kv_blocks: int | None = None, scale: int = 1,
    **more: Any,
) -> Any:  # fmt: skip
    from .vllm_api import offline_engine

    LLM, _ = offline_engine()
    kv_blocks = kv_blocks or args.gpu_blocks
    extra: dict[str, Any] = dict(more)  # more of vLLM's engine arguments (kv_events_config)
    if endpoint is not None:
        extra["kv_transfer_config"] = transfer_config(endpoint, args.storage)
    if args.kind != "dense":
        kind = KINDS[args.kind]
        return LLM(
            model=str(model), dtype="bfloat16", enforce_eager=True, seed=0, max_num_seqs=2, enable_prefix_caching=True,
            **{**kind.engine, "max_model_len": 896}, kv_cache_memory_bytes=kind.kv_bytes * args.kv_scale * scale,
            **extra,
        )  # fmt: skip
    return LLM(
        model=str(model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True, seed=0, max_num_seqs=2,
        max_model_len=min(kv_blocks * scale - 2, 8192 // BLOCK) * BLOCK, enable_prefix_caching=True, **extra,
        kv_cache_memory_bytes=kv_blocks * scale * page_bytes_per_block(args),
    )  # fmt: skip


def ttft(llm: Any, tokens: list[int]) -> tuple[float, int]:
    from .vllm_api import offline_engine

    _, SamplingParams = offline_engine()
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - start, int(out[0].num_cached_tokens or 0)


_COUNTED = ("cachexferd_transfer_bytes_total", "cachexferd_batches_total ", "cachexferd_batched_commands_total ",
            "cachexferd_grouped_swaps_total ")  # fmt: skip


def daemon_counters(daemon: DaemonProcess) -> dict[str, float]:
    text = urllib.request.urlopen(daemon.status()["metrics_url"], timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        ok_command = line.startswith("cachexferd_commands_total") and 'outcome="ok"' in line
        if ok_command or line.startswith(_COUNTED):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def conversation_turns(args: argparse.Namespace) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, prompt tokens) in the order they are sent."""
    import random

    rng = random.Random(1)
    vocab = 1024 if args.kind == "dense" else 512
    history = [[rng.randrange(3, vocab) for _ in range(args.history_tokens)] for _ in range(args.conversations)]
    out = []
    for turn in range(args.turns):
        for conv in range(args.conversations):
            history[conv] += [rng.randrange(3, vocab) for _ in range(args.user_tokens)]
            out.append((conv, turn, list(history[conv])))
            history[conv] += [rng.randrange(3, vocab) for _ in range(args.reply_tokens)]
    return out


def transfer_config(endpoint: str, storage: str) -> dict[str, Any]:
    return {
        "kv_connector": "CachexferdConnector", "kv_connector_module_path": "cachexferd.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cachexferd": {"endpoint": endpoint, "storage": storage}},
    }  # fmt: skip


def peak_rss(pid: int) -> dict[str, int]:
    """VmHWM (peak RSS) and VmRSS of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def new_engine(
    args: argparse.Namespace, model: Path, endpoint: str | None, scale: int = 1
) -> tuple[Any, float, int | None]:
    """(engine, start-up seconds, pid of its worker process)."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    start = time.perf_counter()
    llm = engine(args, model, endpoint, scale=scale)
    seconds = time.perf_counter() - start
    born = [p for p in me.children(recursive=True) if p.pid not in before]
    # vLLM names its processes: VLLM::EngineCore, and under it VLLM::Worker (CPU: always a process).
    workers = [p.pid for p in born if "Worker" in " ".join(p.cmdline())]
    return llm, seconds, (workers[0] if workers else None)


def measure_one(args: argparse.Namespace) -> dict[str, Any]:
    """In a process of its own, vLLM in-process (this process is the worker): start-up and
    peak RSS with a KV cache of --memory-kv-mib."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    blocks = args.memory_kv_mib * 2**20 // page_bytes_per_block(args)
    start = time.perf_counter()
    llm = engine(args, Path(args.model), args.endpoint or None, kv_blocks=blocks)
    seconds = time.perf_counter() - start
    ttft(llm, list(range(3, 3 + 8 * BLOCK)))
    return {"startup_s": seconds, "kv_bytes": blocks * page_bytes_per_block(args), **peak_rss(os.getpid())}


def memory_phase(args: argparse.Namespace, model: Path, endpoint: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, target in (("recompute", ""), ("cachexferd", endpoint)):
        result = model.parent / f"memory-{name}.json"
        argv = [sys.executable, "-m", "cachexferd.integrations.vllm.bench", "--measure-one", "--model", str(model),
                "--endpoint", target, "--json", str(result), *_shape_args(args)]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"memory run of {name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        out[name] = json.loads(result.read_text())
    return out


def _shape_args(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
            "--kv-heads", str(args.kv_heads), "--memory-kv-mib", str(args.memory_kv_mib),
            "--storage", args.storage]  # fmt: skip


def wait_attached(daemon: DaemonProcess, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if daemon.status(timeout_s=2)["device"]["state"] == "attached":
                return
        except Exception:  # still starting
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the engine did not attach to the daemon within {timeout_s}s")


def fault_phase(args: argparse.Namespace, engines: dict[str, Any], daemon: DaemonProcess) -> list[dict[str, Any]]:
    """Requests right after the daemon was killed while idle, then while it is stopped."""
    rows: list[dict[str, Any]] = []
    turns = conversation_turns(argparse.Namespace(**{**vars(args), "turns": args.turns + 2}))
    later = [t for t in turns if t[1] >= args.turns]  # returning conversations' next turns
    for fault, requests in (("killed", later[: args.conversations]), ("stopped", later[args.conversations :])):
        time.sleep(1.0)  # idle
        daemon.signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        try:
            for i, (conv, _, tokens) in enumerate(requests):
                pair = list(engines.items())
                for name, llm in pair if i % 2 == 0 else pair[::-1]:
                    seconds, cached = ttft(llm, tokens)
                    rows.append({"fault": fault, "engine": name, "conversation": conv, "ttft_s": seconds,
                                 "cached_tokens": cached})  # fmt: skip
        finally:
            if fault == "stopped":
                daemon.signal(signal.SIGCONT)
        if fault == "killed":
            daemon.kill()
            daemon.start(timeout_s=60)  # a new daemon on the same endpoint: the engine attaches again
            wait_attached(daemon)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cxb-"))
    if args.kind == "dense":
        model = make_model(root / "model", args.layers, args.hidden, args.heads, args.kv_heads)
    else:
        model = KINDS[args.kind].build(root / "model", hidden=args.hidden)
    settings = {"metrics.port": 0, "host_cache.capacity": args.host_capacity, "storage.backend": "file",
                "storage.file.path": str(root / "store")}  # fmt: skip
    # vLLM reserves a core more for an engine with a KV connector: on a small machine that
    # can leave it every core while the plain engine gets one. The same binding for both
    # keeps the comparison fair (and, by default, the other cores to the daemon).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    daemon = DaemonProcess(root / "rt", settings=settings)
    daemon.start(timeout_s=60)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "args": vars(args),
        "block_bytes": page_bytes_per_block(args),
        "load_avg": os.getloadavg(),
    }
    try:
        if args.memory_kv_mib and args.kind == "dense":
            result["memory"] = memory_phase(args, model, daemon.endpoint)
        plain, plain_s, plain_pid = new_engine(args, model, None)
        plugged, plugged_s, plugged_pid = new_engine(args, model, daemon.endpoint)
        engines = [("recompute", plain), ("cachexferd", plugged)]
        if args.roomy:  # vLLM alone, its KV cache big enough for every conversation
            engines.append(("roomy", new_engine(args, model, None, scale=args.conversations + 1)[0]))
        result["startup_s"] = {"recompute": plain_s, "cachexferd": plugged_s}
        warm = conversation_turns(argparse.Namespace(**{**vars(args), "conversations": 1, "turns": 1}))[0][2]
        for _, llm in engines:
            ttft(llm, warm[:64])  # first-request set-up out of the figures
        before = daemon_counters(daemon)
        for i, (conv, turn, tokens) in enumerate(conversation_turns(args)):
            for name, llm in engines[i % len(engines) :] + engines[: i % len(engines)]:  # none always goes first
                seconds, cached = ttft(llm, tokens)
                rows.append({"engine": name, "conversation": conv, "turn": turn, "prompt_tokens": len(tokens),
                             "cached_tokens": cached, "ttft_s": seconds})  # fmt: skip
        after = daemon_counters(daemon)
        result["block_bytes"] = int(daemon.status()["host_cache"]["block_bytes"]) or result["block_bytes"]
        result["worker_rss"] = {name: peak_rss(pid) if pid else {} for name, pid in
                                (("recompute", plain_pid), ("cachexferd", plugged_pid))}  # fmt: skip
        if args.faults:
            result["faults"] = fault_phase(args, {"recompute": plain, "cachexferd": plugged}, daemon)
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)  # the model and the store: tens of MB per run
    result["rows"] = rows
    result["daemon"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return result


def summarize(result: dict[str, Any]) -> str:
    lines = ["engine      first turns: median TTFT  returning turns  median TTFT  mean TTFT  prefill tok/s (median)"
             "  cached tokens (mean)"]  # fmt: skip
    medians: dict[str, float] = {}
    for name in ("recompute", "cachexferd", "roomy"):
        if not any(r["engine"] == name for r in result["rows"]):
            continue
        first = statistics.median(r["ttft_s"] for r in result["rows"] if r["engine"] == name and r["turn"] == 0)
        rows = [r for r in result["rows"] if r["engine"] == name and r["turn"] > 0]
        ttfts = [r["ttft_s"] for r in rows]
        rates = [r["prompt_tokens"] / r["ttft_s"] for r in rows]
        median_ms, mean_ms = statistics.median(ttfts) * 1000, statistics.mean(ttfts) * 1000
        medians[name] = median_ms
        cached = statistics.mean(r["cached_tokens"] for r in rows)
        lines.append(
            f"{name:<11} {first * 1000:>22.0f}ms  {len(rows):>15}  {median_ms:>9.0f}ms  {mean_ms:>7.0f}ms"
            f"  {statistics.median(rates):>22.0f}  {cached:>20.0f}"
        )
    ratios = [f"recompute / cachexferd {medians['recompute'] / medians['cachexferd']:.2f}x"]
    if "roomy" in medians:
        ratios.append(f"cachexferd / roomy {medians['cachexferd'] / medians['roomy']:.2f}x")
    lines.append(f"{result['args']['kind']}: returning turns' median TTFT, " + ", ".join(ratios))
    d, bb = result["daemon"], result["block_bytes"]
    d2h = d.get('cachexferd_transfer_bytes_total{direction="d2h"}', 0)
    h2d = d.get('cachexferd_transfer_bytes_total{direction="h2d"}', 0)
    lines.append(f"daemon moved: d2h {d2h / 2**20:.1f} MiB ({d2h / bb:.0f} blocks), h2d {h2d / 2**20:.1f} MiB "
                 f"({h2d / bb:.0f} blocks), block {bb // 1024} KiB")  # fmt: skip
    commands = sum(v for k, v in d.items() if k.startswith("cachexferd_commands_total"))
    lines.append(f"daemon commands: {commands:.0f} ok, {d.get('cachexferd_batched_commands_total', 0):.0f} of them "
                 f"in {d.get('cachexferd_batches_total', 0):.0f} BATCH messages, "
                 f"{d.get('cachexferd_grouped_swaps_total', 0):.0f} swaps copied as groups")  # fmt: skip
    lines += _summarize_memory(result) + _summarize_faults(result)
    lines.append("load average at start: " + " ".join(f"{x:.2f}" for x in result["load_avg"]))
    return "\n".join(lines)


def _summarize_memory(result: dict[str, Any]) -> list[str]:
    lines = []
    startup, rss = result.get("startup_s", {}), result.get("worker_rss", {})
    if startup:
        lines.append("engines above: start-up " + ", ".join(f"{k} {v:.1f}s" for k, v in startup.items())
                     + "; worker peak RSS " + ", ".join(f"{k} {v.get('VmHWM', 0) / 2**20:.0f} MiB"
                                                        for k, v in rss.items()))  # fmt: skip
    memory = result.get("memory")
    if memory:
        plain, plug = memory["recompute"], memory["cachexferd"]
        lines.append(
            f"memory, KV cache {plain['kv_bytes'] / 2**20:.0f} MiB: worker peak RSS recompute "
            f"{plain['VmHWM'] / 2**20:.0f} MiB, cachexferd {plug['VmHWM'] / 2**20:.0f} MiB "
            f"(ratio {plug['VmHWM'] / plain['VmHWM']:.2f}); start-up {plain['startup_s']:.1f}s vs "
            f"{plug['startup_s']:.1f}s (ratio {plug['startup_s'] / plain['startup_s']:.2f})"
        )
    return lines


def _summarize_faults(result: dict[str, Any]) -> list[str]:
    lines = []
    for fault in ("killed", "stopped"):
        rows = [r for r in result.get("faults", []) if r["fault"] == fault]
        if not rows:
            continue
        by = {name: [r["ttft_s"] for r in rows if r["engine"] == name] for name in ("recompute", "cachexferd")}
        extra = max(p - r for p, r in zip(by["cachexferd"], by["recompute"]))
        lines.append(
            f"daemon {fault:<7} requests after: max TTFT recompute {max(by['recompute']) * 1000:.0f} ms, "
            f"cachexferd {max(by['cachexferd']) * 1000:.0f} ms; the most a request took longer: {extra * 1000:.0f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="dense", choices=sorted(KINDS), help="the model kind (tiny_models.py)")
    p.add_argument("--kv-scale", type=int, default=1,
                   help="other kinds than dense: vLLM's KV cache, in units of the kind's small cache")  # fmt: skip
    p.add_argument("--no-roomy", dest="roomy", action="store_false", help="skip vLLM alone with a large KV cache")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--history-tokens", type=int, default=512, help="tokens of each conversation before turn 0")
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--gpu-blocks", type=int, default=48, help="vLLM's KV cache, in blocks of 32 tokens")
    p.add_argument("--host-capacity", default="1GiB", help="the daemon's host cache")
    p.add_argument("--storage", default="off", choices=("off", "write_through"))
    p.add_argument("--cpu-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND for both engines ('auto': vLLM's)")
    p.add_argument("--memory-kv-mib", type=int, default=512, help="KV cache of the memory runs (0: skip them)")
    p.add_argument("--no-faults", dest="faults", action="store_false", help="skip the daemon-fault requests")
    p.add_argument("--kv-events", action="store_true", help="instead: plug-in engines with vLLM's KV events on and off")
    p.add_argument("--micro-blocks", type=int, default=200_000, help="--kv-events: blocks stored per engine-side round")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--measure-one", action="store_true", help=argparse.SUPPRESS)  # one memory run (internal)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure_one:  # vLLM logs to stdout too: the figures go to the --json file
        Path(args.json).write_text(json.dumps(measure_one(args)))
        return 0
    if args.kv_events:
        return kv_events(args)
    result = run(args)
    print(summarize(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def kv_events(args: argparse.Namespace) -> int:
    from . import bench_events

    root = Path(tempfile.mkdtemp(prefix="cxb-"))
    try:
        model = make_model(root / "model", args.layers, args.hidden, args.heads, args.kv_heads)
        result = bench_events.run(args, model, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(bench_events.summarize(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
