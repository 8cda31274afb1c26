"""Per-backend set-up for the swap benchmark: a host pool, a device cache, and the raw
contiguous copy of the same bytes that each measurement is compared with."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import Backend, DeviceCache
from ..host_cache import HostPool
from ..protocol import KVLayout
from ..security import Requester


@dataclass
class Kit:
    backend: Backend
    pool: HostPool
    device: DeviceCache
    raw_src: Any
    raw_dst: Any
    owned: list[Any] = field(default_factory=list)  # runner-side objects to close

    def set_method(self, method: str) -> None:
        """cuda: the copy method the next swaps use (cuda.copy_method, read at every swap)."""
        config = getattr(self.backend, "config", None)
        if config is not None and hasattr(config, "copy_method"):
            self.backend.config = dataclasses.replace(config, copy_method=method)  # type: ignore[attr-defined]

    def reset_stages(self) -> None:
        reset = getattr(self.device, "reset_stages", None)
        if reset is not None:
            reset()

    def stages(self) -> dict[str, float]:
        """cuda: the backend's stage times since reset_stages (µs, p50); cpu: none."""
        summary = getattr(self.device, "stage_summary", None)
        return summary() if summary is not None else {}

    def warm_raw(self, seconds: float = 0.3) -> None:
        """Runs the raw reference copies for a while first: a cold link (power states, clocks,
        first touches) reads several times slower than a warm one."""
        for direction in ("d2h", "h2d", "both"):
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                self.raw_copy(len(self.raw_src), direction)

    def raw_copy(self, nbytes: int, direction: str) -> None:
        import torch

        if self.backend.name == "cpu":
            # The baseline gets every core (torch's own threads); the daemon sets torch to 1
            # thread and uses its workers instead, so restore that afterwards.
            torch.set_num_threads(os.cpu_count() or 1)
            try:
                self.raw_dst[:nbytes].copy_(self.raw_src[:nbytes])
            finally:
                torch.set_num_threads(1)
            return
        _cuda_raw_copy(self, nbytes, direction)

    def close(self) -> None:
        self.device.close()
        for item in self.owned:
            item.close()
        self.backend.close()


def make(backend_name: str, layout: KVLayout, host_blocks: int, threads: int) -> Kit:
    if backend_name == "cpu":
        return _cpu_kit(layout, host_blocks, threads)
    return _cuda_kit(layout, host_blocks)


def _cpu_kit(layout: KVLayout, host_blocks: int, threads: int) -> Kit:
    import torch

    from ..backends.cpu import CpuBackend
    from ..client.runner import ShmKVCache

    backend = CpuBackend(threads)
    pool = backend.create_host_pool(host_blocks * layout.host_block_bytes)
    cache = ShmKVCache(layout)
    for tensor in cache.tensors:
        tensor.view(torch.uint8).fill_(7)  # fault the pages in outside the timed region
    geometry = pool.geometry(layout.host_block_bytes)
    device = backend.import_device_cache(layout, cache.device_handle(), pool, geometry, Requester())
    nbytes = host_blocks * layout.host_block_bytes
    src = torch.full((nbytes,), 3, dtype=torch.uint8)
    dst = torch.empty_like(src).fill_(0)
    return Kit(backend, pool, device, src, dst, [cache])


def _cuda_kit(layout: KVLayout, host_blocks: int) -> Kit:
    """Pinned pool and device cache of this process (no IPC); raw references warmed."""
    import torch

    from ..backends import load_backend
    from ..backends.cuda.backend import CudaBackend
    from ..backends.cuda.pool import PinnedHostPool
    from ..client.cuda_runner import CudaKVCache
    from ..config import load_config

    backend = load_backend("cuda", load_config(overrides={"daemon.backend": "cuda"}, environ={}))
    assert isinstance(backend, CudaBackend)
    pool = backend.create_host_pool(host_blocks * layout.host_block_bytes)
    if isinstance(pool, PinnedHostPool):
        pool.wait_all_pinned()
    # One allocation with evenly spaced tensors, as the runner helper allocates by default.
    cache = CudaKVCache(layout, device=backend.device)
    geometry = pool.geometry(layout.host_block_bytes)
    device = backend.local_device_cache(layout, cache.tensors, pool, geometry)
    nbytes = host_blocks * layout.host_block_bytes
    kit = Kit(
        backend,
        pool,
        device,
        pool.tensor[:nbytes],
        torch.empty(nbytes, dtype=torch.uint8, device=backend.device),
        [cache],
    )
    kit.warm_raw()
    return kit


def _cuda_raw_copy(kit: Kit, nbytes: int, direction: str) -> None:
    import torch

    host, dev = kit.raw_src[:nbytes], kit.raw_dst[:nbytes]
    if direction == "both":
        half = nbytes // 2
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s1):
            host[:half].copy_(dev[:half], non_blocking=True)
        with torch.cuda.stream(s2):
            dev[half : 2 * half].copy_(host[half : 2 * half], non_blocking=True)
    elif direction == "d2h":
        host.copy_(dev, non_blocking=True)
    else:
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()


def versions(backend_name: str) -> dict[str, Any]:
    """What a reader needs to compare runs: torch, and for cuda the CUDA and driver versions."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python_impl": platform.python_implementation()}
    if backend_name == "cuda":
        info["cuda"] = torch.version.cuda
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def device_name(backend_name: str) -> str:
    if backend_name == "cuda":
        import torch

        return str(torch.cuda.get_device_name())
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown cpu"
