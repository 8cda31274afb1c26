"""The cpu path never imports CUDA-only code: a fresh interpreter runs a cpu daemon, serves a
status and an attach, and must not have imported the cuda backend, any CUDA binding beyond
what ``import torch`` itself loads, or initialised CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PROBE = textwrap.dedent(
    """
    import asyncio, json, sys

    def cuda_modules():
        return {m for m in sys.modules if m == "cuda" or m.startswith(("cuda.", "cupy", "pycuda"))}

    import torch  # torch may import cuda.bindings itself when it is installed: that is the baseline
    baseline = cuda_modules()

    from cachexferd.client import RunnerClient, ShmKVCache
    from cachexferd.config import load_config
    from cachexferd.daemon.server import Daemon
    from cachexferd.protocol import KVLayout

    runtime = sys.argv[1]
    # 'auto' where no GPU is visible (it must resolve to cpu without importing the cuda
    # backend); an explicit 'cpu' on GPU machines.
    backend = "cpu" if torch.cuda.is_available() else "auto"
    settings = {"daemon.runtime_dir": runtime, "daemon.backend": backend, "metrics.port": 0,
                "host_cache.capacity": "8MiB"}
    config = load_config(overrides=settings, environ={})
    layout = KVLayout(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=8, dtype="float16")

    async def main():
        daemon = Daemon(config)
        await daemon.start()
        loop = asyncio.get_running_loop()

        def runner():
            with RunnerClient(config.endpoint, timeout_s=10) as client, ShmKVCache(layout) as cache:
                client.status()
                client.attach(cache)
                client.detach()

        await loop.run_in_executor(None, runner)
        daemon.request_stop("probe")
        await daemon.shutdown()
        return daemon.backend.name

    backend = asyncio.run(main())
    print(json.dumps({
        "backend": backend,
        "ours": sorted(m for m in sys.modules if m.startswith("cachexferd.backends.cuda")),
        "new_cuda": sorted(cuda_modules() - baseline),
        "cuda_initialized": torch.cuda.is_initialized(),
    }))
    """
)


def test_cpu_daemon_imports_no_cuda_code(short_tmp: Path) -> None:
    # This tree first, then whatever the caller's PYTHONPATH brings (a GPU host may provide
    # pyzmq and the like from a directory of wheels only through it).
    paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(short_tmp / "rt")], capture_output=True, text=True, timeout=90, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["backend"] == "cpu"
    assert report["ours"] == [], f"the cpu path imported {report['ours']}"
    assert report["new_cuda"] == [], f"the cpu path imported CUDA bindings {report['new_cuda']}"
    assert report["cuda_initialized"] is False
