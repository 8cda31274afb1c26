"""ShmSegment: a runner's KV cache that has a name in /dev/shm only during ATTACH, so no
kill can leave a file behind; and what the daemon does with it (a real in-process daemon)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cachexferd.client import EngineClient, RunnerClient
from cachexferd.client.shm_segment import ShmSegment, ShmSpaceError
from cachexferd.protocol import KVLayout

from ..helpers import SMALL, InProcessDaemon

SHM = Path("/dev/shm")


class SegmentCache:
    """SMALL's tensors laid back to back in a ShmSegment (what the vLLM plug-in attaches)."""

    def __init__(self, layout: KVLayout, seed: int = 0) -> None:
        self.layout = layout
        self.segment = ShmSegment(layout.num_tensors * layout.tensor_bytes, prefix="cxtest-seg")
        self.flat = torch.empty(0, dtype=torch.uint8).set_(self.segment.storage())
        gen = torch.Generator().manual_seed(seed)
        self.flat.copy_(torch.randint(0, 256, self.flat.shape, dtype=torch.uint8, generator=gen))
        self.names_seen: list[str] = []
        self.by_name_only = False  # what a 1.1 daemon would see

    def exposed(self) -> Any:
        return self.segment.exposed()

    def device_handle(self) -> dict[str, Any]:
        offsets = [t * self.layout.tensor_bytes for t in range(self.layout.num_tensors)]
        handle = self.segment.device_map(offsets)
        if self.by_name_only:
            del handle["fd"]
        if "name" in handle:
            self.names_seen.append(handle["name"])
            assert (SHM / handle["name"]).exists(), "the name exists while the daemon opens it"
        return handle

    def block(self, block: int) -> bytes:
        chunk = self.layout.chunk_bytes
        return b"".join(
            self.flat[t * self.layout.tensor_bytes + block * chunk :][:chunk].numpy().tobytes()
            for t in range(self.layout.num_tensors)
        )


def ours() -> set[str]:
    return {p.name for p in SHM.glob(f"cxtest-seg-{os.getpid()}-*")}


def test_attached_segment_has_no_name_and_copies_both_ways(inproc: InProcessDaemon) -> None:
    cache = SegmentCache(SMALL, seed=3)
    try:
        with RunnerClient(inproc.endpoint) as runner, EngineClient([inproc.endpoint]) as engine:
            engine.connect()
            runner.attach(cache)
            assert cache.names_seen and not ours(), "the name must be gone once the daemon mapped it"
            want, untouched = cache.block(5), cache.block(7)
            done = engine.wait([engine.swap_out([5], [0])], timeout_s=30)
            assert all(c.ok for c in done.values())
            done = engine.wait([engine.swap_in([6], [0])], timeout_s=30)
            assert all(c.ok for c in done.values())
            assert cache.block(6) == want and cache.block(7) == untouched
            runner.detach()
            runner.attach(cache)  # a re-attach (a daemon restart) goes by descriptor alone
            assert len(cache.names_seen) == 1 and not ours()
            done = engine.wait([engine.swap_in([8], [0])], timeout_s=30)
            assert all(c.ok for c in done.values()) and cache.block(8) == want
            runner.detach()
    finally:
        cache.segment.close()
    assert not ours()


def test_a_killed_runner_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    script = (
        "import os,signal,sys;from cachexferd.client.shm_segment import ShmSegment;"
        "s=ShmSegment(1<<20,prefix='cxtest-kill');m=s.storage();"
        "c=s.exposed();name=c.__enter__();print(name,flush=True);"
        "sys.stdin.readline();c.__exit__(None,None,None);print('unlinked',flush=True);sys.stdin.readline()"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        name = proc.stdout.readline().strip()
        assert (SHM / name).exists()  # inside the attach window
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "unlinked"
        assert not (SHM / name).exists()
        proc.kill()
        proc.wait(10)
        assert not list(SHM.glob(f"cxtest-kill-{proc.pid}-*"))
    finally:
        proc.kill()
        proc.wait(10)


def test_too_small_dev_shm_is_a_clear_error() -> None:
    free = os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize
    with pytest.raises(ShmSpaceError, match="enlarge /dev/shm"):
        ShmSegment(free + (1 << 40))


def test_a_name_alone_is_mapped_too(inproc: InProcessDaemon) -> None:
    """What a daemon that cannot open the descriptor (or a 1.1 daemon) does: the name."""
    cache = SegmentCache(SMALL, seed=4)
    cache.by_name_only = True
    try:
        with RunnerClient(inproc.endpoint) as runner:
            runner.attach(cache)
            assert cache.names_seen and not ours()
            runner.detach()
    finally:
        cache.segment.close()
