"""Multi-turn benchmark: vLLM on CPU with and without the plug-in, in the same run.

    python -m cachexferd.integrations.vllm.bench [--conversations 6 --turns 3 ...] [--json FILE]

A random-weight Llama (made here with transformers; no download) serves ``conversations``
chats round-robin. Each turn sends the whole history plus ``user_tokens`` new tokens and
asks for one token, so the request's latency is its time to first token (TTFT); the reply
is appended as ``reply_tokens`` synthetic tokens. vLLM's KV cache holds about two
histories, so a returning conversation has been evicted from vLLM's own prefix cache:
without the plug-in vLLM recomputes it, with it the blocks come back from the daemon's
host cache. Both engines (separate processes) get the same turns, interleaved, and each
turn's TTFT and prefill rate (prompt tokens / TTFT) are reported for returning turns (first
turns, which no cache can help, show whether the two engines run alike on this machine),
with the blocks and bytes the daemon moved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ...launch import DaemonProcess

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


def engine(args: argparse.Namespace, model: Path, endpoint: str | None) -> Any:
    from vllm import LLM

    kv_blocks = args.gpu_blocks
    extra: dict[str, Any] = {}
    if endpoint is not None:
        extra["kv_transfer_config"] = {
            "kv_connector": "CachexferdConnector", "kv_connector_module_path": "cachexferd.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cachexferd": {"endpoint": endpoint, "storage": args.storage}},
        }  # fmt: skip
    return LLM(
        model=str(model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True, seed=0, max_num_seqs=2,
        kv_cache_memory_bytes=kv_blocks * page_bytes_per_block(args), max_model_len=(kv_blocks - 2) * BLOCK,
        enable_prefix_caching=True, **extra,
    )  # fmt: skip


def ttft(llm: Any, tokens: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - start, int(out[0].num_cached_tokens or 0)


def daemon_counters(daemon: DaemonProcess) -> dict[str, float]:
    text = urllib.request.urlopen(daemon.status()["metrics_url"], timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        ok_command = line.startswith("cachexferd_commands_total") and 'outcome="ok"' in line
        if ok_command or line.startswith("cachexferd_transfer_bytes_total"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def conversation_turns(args: argparse.Namespace) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, prompt tokens) in the order they are sent."""
    import random

    rng = random.Random(1)
    history = [[rng.randrange(3, 1024) for _ in range(args.history_tokens)] for _ in range(args.conversations)]
    out = []
    for turn in range(args.turns):
        for conv in range(args.conversations):
            history[conv] += [rng.randrange(3, 1024) for _ in range(args.user_tokens)]
            out.append((conv, turn, list(history[conv])))
            history[conv] += [rng.randrange(3, 1024) for _ in range(args.reply_tokens)]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cxb-"))
    model = make_model(root / "model", args.layers, args.hidden, args.heads, args.kv_heads)
    settings = {"metrics.port": 0, "host_cache.capacity": args.host_capacity, "storage.backend": "file",
                "storage.path": str(root / "store")}  # fmt: skip
    # vLLM reserves a core more for an engine with a KV connector: on a small machine that
    # can leave it every core while the plain engine gets one. The same binding for both
    # keeps the comparison fair (and, by default, the other cores to the daemon).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    daemon = DaemonProcess(root / "rt", settings=settings)
    daemon.start(timeout_s=60)
    rows: list[dict[str, Any]] = []
    try:
        plain, plugged = engine(args, model, None), engine(args, model, daemon.endpoint)
        warm = conversation_turns(argparse.Namespace(**{**vars(args), "conversations": 1, "turns": 1}))[0][2]
        ttft(plain, warm[:64]), ttft(plugged, warm[:64])  # first-request set-up out of the figures
        before = daemon_counters(daemon)
        for i, (conv, turn, tokens) in enumerate(conversation_turns(args)):
            pair = [("recompute", plain), ("cachexferd", plugged)]
            for name, llm in pair if i % 2 == 0 else pair[::-1]:  # neither engine always goes first
                seconds, cached = ttft(llm, tokens)
                rows.append({"engine": name, "conversation": conv, "turn": turn, "prompt_tokens": len(tokens),
                             "cached_tokens": cached, "ttft_s": seconds})  # fmt: skip
        after = daemon_counters(daemon)
    finally:
        daemon.stop()
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {"args": vars(args), "rows": rows, "daemon": moved, "block_bytes": page_bytes_per_block(args)}


def summarize(result: dict[str, Any]) -> str:
    lines = ["engine      first turns: median TTFT  returning turns  median TTFT  mean TTFT  prefill tok/s (median)"
             "  cached tokens (mean)"]  # fmt: skip
    for name in ("recompute", "cachexferd"):
        first = statistics.median(r["ttft_s"] for r in result["rows"] if r["engine"] == name and r["turn"] == 0)
        rows = [r for r in result["rows"] if r["engine"] == name and r["turn"] > 0]
        ttfts = [r["ttft_s"] for r in rows]
        rates = [r["prompt_tokens"] / r["ttft_s"] for r in rows]
        median_ms, mean_ms = statistics.median(ttfts) * 1000, statistics.mean(ttfts) * 1000
        cached = statistics.mean(r["cached_tokens"] for r in rows)
        lines.append(
            f"{name:<11} {first * 1000:>22.0f}ms  {len(rows):>15}  {median_ms:>9.0f}ms  {mean_ms:>7.0f}ms"
            f"  {statistics.median(rates):>22.0f}  {cached:>20.0f}"
        )
    d, bb = result["daemon"], result["block_bytes"]
    d2h = d.get('cachexferd_transfer_bytes_total{direction="d2h"}', 0)
    h2d = d.get('cachexferd_transfer_bytes_total{direction="h2d"}', 0)
    lines.append(f"daemon moved: d2h {d2h / 2**20:.1f} MiB ({d2h / bb:.0f} blocks), h2d {h2d / 2**20:.1f} MiB "
                 f"({h2d / bb:.0f} blocks), block {bb // 1024} KiB")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--json", help="write every measurement here")
    args = p.parse_args(argv)
    result = run(args)
    print(summarize(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
