"""The README's main job: `cachexferd demo` end to end, and its verifier catching a bad byte."""

from __future__ import annotations

import subprocess
import sys

import torch

from cachexferd.client.runner import ShmKVCache
from cachexferd.demo_runner import known_data, verify_segment
from cachexferd.protocol import KVLayout


def test_demo_runs_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cachexferd", "demo", "--rounds", "2", "--storage", "none"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo swap: OK" in proc.stdout
    assert proc.stdout.count("all 512 blocks exact") == 2
    assert "metrics http://127.0.0.1:" in proc.stdout


def test_verifier_catches_a_wrong_block() -> None:
    layout = KVLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=16, dtype="float16")
    with ShmKVCache(layout) as cache:
        for t, tensor in enumerate(cache.tensors):
            tensor.view(torch.uint8).view(layout.num_blocks, -1).copy_(known_data(layout, 5, t))
        assert verify_segment(cache.name, layout, 5, {}) == ""
        # Pretend block 3 received block 1: the data does not say so.
        assert "blocks differ" in verify_segment(cache.name, layout, 5, {3: 1})
        cache.tensors[2].view(torch.uint8)[6, 0, 0, 0] ^= 0xFF
        assert "tensor 2: 1 blocks differ (first [6])" in verify_segment(cache.name, layout, 5, {})
