"""The vLLM benchmark end to end at a tiny size: it runs, reports every turn of both
engines, and the plug-in's engine stored blocks through the daemon; and its memory runs:
with a KV cache large enough to dominate the worker's memory, the worker with the plug-in
peaks at no more than 1.1x the memory of vLLM alone (moving the KV cache into shared memory
after vLLM allocated it peaked at twice the KV cache). Nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


def test_tiny_benchmark_reports_every_engine(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "cachexferd.integrations.vllm.bench", "--conversations", "2", "--turns", "2",
            "--history-tokens", "128", "--user-tokens", "32", "--reply-tokens", "32", "--gpu-blocks", "16",
            "--memory-kv-mib", "768", "--no-faults", "--json", str(out)]  # fmt: skip
    # The benchmark's two engines need vLLM's default engine-core processes (conftest.py
    # turns them off for the in-process tests): two in-process engines would share the
    # connector's per-process state.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    scratch = set(Path(tempfile.gettempdir()).glob("cxb-*"))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    engines = ("recompute", "cachexferd", "roomy")
    want = sorted((engine, conv, turn) for engine in engines for conv in range(2) for turn in range(2))
    assert sorted((r["engine"], r["conversation"], r["turn"]) for r in rows) == want
    assert all(r["ttft_s"] > 0 and r["prompt_tokens"] >= 160 for r in rows), rows
    assert data["daemon"]['cachexferd_transfer_bytes_total{direction="d2h"}'] > 0, data["daemon"]
    assert "first turns" in proc.stdout and "cachexferd" in proc.stdout and "cachexferd / roomy" in proc.stdout
    assert "cachexferd_batches_total" in data["daemon"] and "daemon commands:" in proc.stdout
    assert set(Path(tempfile.gettempdir()).glob("cxb-*")) == scratch, "the benchmark left its scratch behind"
    memory = data["memory"]
    plain, plugged = memory["recompute"]["VmHWM"], memory["cachexferd"]["VmHWM"]
    assert memory["recompute"]["kv_bytes"] == 768 << 20 and plain > 768 << 20, memory
    assert plugged <= 1.1 * plain, f"worker peak RSS {plugged / 2**20:.0f} MiB vs vLLM alone {plain / 2**20:.0f} MiB"
    assert "worker peak RSS" in proc.stdout and "start-up" in proc.stdout


def test_tiny_kv_events_benchmark_measures_what_publishing_adds(tmp_path: Path) -> None:
    """``--kv-events`` at a tiny size: both engines answer every turn, the router receives
    batches, and the events-on engine's publishing work is measured (not zero) beside the
    plug-in's own time."""
    out = tmp_path / "events.json"
    argv = [sys.executable, "-m", "cachexferd.integrations.vllm.bench", "--kv-events", "--conversations", "2",
            "--turns", "2", "--history-tokens", "128", "--user-tokens", "32", "--reply-tokens", "16",
            "--micro-blocks", "2000", "--json", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    engines = json.loads(out.read_text())["engines"]
    assert len(engines["rows"]) == 2 * 2 * 2 and engines["router_batches"] > 0, engines
    on, off = engines["steps"]["events on"], engines["steps"]["events off"]
    assert on["events_s"] > 0 and on["connector_take_s"] >= on["take_events_s"] > 0 and on["publish_s"] > 0, on
    assert on["events_calls"] > 0 and on["timer_s"] > 0 and on["publisher_thread_s"] > 0, on
    assert off["publish_s"] == 0 and off["connector_take_s"] == 0, off
    assert "of the plug-in's time" in proc.stdout
