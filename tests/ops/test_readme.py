"""The README's Python snippets, run as written against real daemons.

One substitution, the only one: the snippets name the sockets of daemons started by root or
systemd (``ipc:///run/cachexferd/<rank>/cmd.sock``); here the daemons' runtime directories
are ``<tmp>/<rank>``, so ``ipc:///run/cachexferd/`` becomes ``ipc://<tmp>/``. Everything
else (layout, ids, calls) is the README's text.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cachexferd.client import RunnerClient, ShmKVCache
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import KVLayout

from .helpers import REPO, clean_env

README = REPO / "README.md"
SOCKETS = "ipc:///run/cachexferd/"
# The runner snippet's layout: 2 MiB host blocks, host ids up to 102 in the engine snippet.
LAYOUT = KVLayout(num_layers=32, num_blocks=4096, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def snippets() -> dict[str, str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    by_role = {
        "engine": [b for b in blocks if "EngineClient(" in b],
        "runner": [b for b in blocks if "RunnerClient(" in b],
    }
    assert all(len(found) == 1 for found in by_role.values()), "expected one engine and one runner snippet"
    return {role: found[0] for role, found in by_role.items()}


@pytest.fixture
def daemons(short_tmp: Path) -> Iterator[list[DaemonProcess]]:
    started = []
    try:
        for rank in (0, 1):
            daemon = DaemonProcess(short_tmp / str(rank), rank=rank, settings={
                "metrics.port": 0, "host_cache.capacity": "256MiB", "storage.path": str(short_tmp / "storage"),
            })  # fmt: skip
            started.append(daemon)
            daemon.start()
        yield started
    finally:
        for daemon in started:
            daemon.stop()


def run_snippet(code: str, tmp: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    """Runs a snippet in its own interpreter; returns the result and its pid."""
    assert SOCKETS in code
    argv = [sys.executable, "-c", code.replace(SOCKETS, f"ipc://{tmp}/")]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(tmp),
                          cwd=tmp) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), proc.pid


def test_runner_snippet_attaches_detaches_and_frees_its_segment(short_tmp: Path, daemons: list[DaemonProcess]) -> None:
    result, pid = run_snippet(snippets()["runner"], short_tmp)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    left = [p.name for p in Path("/dev/shm").glob(f"cachexferd-kv-{pid}-*")]  # ShmKVCache names carry the pid
    assert left == [], f"the runner snippet left {left} in /dev/shm"
    status = daemons[0].status()
    assert status["device"]["state"] == "detached" and status["commands"]["running"] == 0


def test_engine_snippet_swaps_on_both_ranks(short_tmp: Path, daemons: list[DaemonProcess]) -> None:
    caches = [ShmKVCache(LAYOUT) for _ in daemons]
    runners = [RunnerClient(d.endpoint) for d in daemons]
    try:
        for rank, (cache, runner) in enumerate(zip(caches, runners)):
            for t, tensor in enumerate(cache.tensors):  # touch only the blocks the snippet moves
                tensor.view(torch.uint8)[3:6].fill_(rank * 64 + t + 1)
            runner.attach(cache)
        result, _ = run_snippet(snippets()["engine"], short_tmp)
        assert result.returncode == 0 and result.stderr == "", result.stderr  # no failed command was logged
        for cache in caches:
            for tensor in cache.tensors:
                raw = tensor.view(torch.uint8)
                assert torch.equal(raw[9:12], raw[3:6]), "swap in did not bring back what swap out stored"
    finally:
        for runner, cache in zip(runners, caches):
            runner.detach()
            runner.close()
            cache.close()
