"""Shared pieces of the vLLM tests: a tiny random checkpoint, daemons, metrics, prompts.

The checkpoint is a 2-layer Llama (hidden 64, two heads of 32, vocabulary 512) with random
weights large enough that every output depends on the whole context, and a word-level
tokenizer (``w3 w4 ...``), made with transformers at test time (a few hundred KB).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachexferd.client import EngineClient
from cachexferd.launch import DaemonProcess

BLOCK = 32  # tokens per vLLM block (CPU attention needs a multiple of 32)
CONNECTOR = "CachexferdConnector"
MODULE = "cachexferd.integrations.vllm"


def make_tiny_model(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path


def prompt(seed: int, length: int = 6 * BLOCK + 8) -> list[int]:
    """Token ids 3..510, different for every seed; ``length`` spans full blocks plus a tail."""
    return [3 + (seed * 131 + i * 7 + (i * i) % 13) % 507 for i in range(length)]


def transfer_config(endpoint: str, **options: Any) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cachexferd": {"endpoint": endpoint, **options}},
    }  # fmt: skip


BLOCK_BYTES = 16 << 10  # one vLLM block of the tiny model, all layers: 2 layers x K,V x 32 tokens x 64 x bf16


def engine_args(model: Path, kv_blocks: int = 64) -> dict[str, Any]:
    """A small CPU engine: ``kv_blocks`` blocks of 32 tokens of KV cache (few, so that vLLM
    reuses blocks soon: its own prefix cache forgets and blocks with stores in flight are
    waited for), eager, seeded."""
    return {
        "model": str(model), "dtype": "bfloat16", "block_size": BLOCK, "kv_cache_memory_bytes": kv_blocks * BLOCK_BYTES,
        "max_model_len": 1024, "enforce_eager": True, "seed": 0, "max_num_seqs": 4,
        "distributed_executor_backend": "uni",
    }  # fmt: skip


def start_daemon(
    root: Path, name: str, storage: Path, capacity: str = "16MiB", rank: int = 0, **settings: Any
) -> DaemonProcess:
    daemon = DaemonProcess(
        root / name,
        rank=rank,
        settings={
            "metrics.port": 0, "host_cache.capacity": capacity, "storage.backend": "file",
            "storage.file.path": str(storage), "daemon.drain_timeout_s": 5.0, **settings,
        },
    )  # fmt: skip
    daemon.start(timeout_s=60)
    return daemon


def metric(daemon: DaemonProcess, name: str, **labels: str) -> float:
    """One sample of the daemon's Prometheus metrics (0 when absent)."""
    text = urllib.request.urlopen(daemon.status()["metrics_url"], timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and ",".join(sorted((m.group(2) or "").split(","))) == want:
            return float(m.group(3))
    return 0.0


def ops(daemon: DaemonProcess, op: str) -> float:
    return metric(daemon, "cachexferd_commands_total", op=op, outcome="ok")


def clear_host(daemon: DaemonProcess) -> None:
    with EngineClient([daemon.endpoint]) as client:
        client.connect(timeout_s=10)
        req = client.clear_host()
        assert client.wait([req], timeout_s=30)[req].ok


def wait_for(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def attached_runner(daemon: DaemonProcess) -> int | None:
    try:
        device = daemon.status(timeout_s=2)["device"]
    except Exception:
        return None
    return device.get("runner_pid") if device.get("state") == "attached" else None


def plugin_shm_files(pids: list[int] | None = None) -> list[str]:
    """Files of the plug-in in /dev/shm: its segments (named only during an attach), and
    torch's ``torch_<pid>_*`` files of the given processes (what the plug-in left before)."""
    out = [p.name for p in Path("/dev/shm").glob("cachexferd-vllm-*")]
    for pid in pids or []:
        out += [p.name for p in Path("/dev/shm").glob(f"torch_{pid}_*")]
    return sorted(out)


def device_state(daemon: DaemonProcess) -> str:
    return str(daemon.status(timeout_s=5)["device"]["state"])


class BusyLoops:
    """CPU-bound processes beside the engine (each ends by itself after ``limit_s``)."""

    def __init__(self, count: int, limit_s: float = 300.0) -> None:
        code = f"import time\nend = time.time() + {limit_s}\nwhile time.time() < end:\n    pass\n"
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(10)

    def __enter__(self) -> BusyLoops:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
