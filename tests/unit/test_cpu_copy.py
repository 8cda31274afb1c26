"""The cpu backend's batched copies against a sequential model: exact bytes on both sides,
every block outside the copies unchanged, for the gathered (small blocks) and the per-view
(large blocks) paths, on the loop thread (swap_now) and on the workers (swap_many)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from cachexferd.backends.base import CancelToken, Direction, SwapRequest
from cachexferd.backends.cpu import _GATHER_MAX_BYTES, CpuBackend, CpuDeviceCache, plan_item
from cachexferd.client import ShmKVCache
from cachexferd.host_cache import HostPool
from cachexferd.protocol import ErrorCode, KVLayout
from cachexferd.security import Requester

from ..helpers import fill_random

# 4 tensors of 128-byte chunks (512 B per block and group: the gathered copy), and 4 tensors
# of 16 KiB chunks (64 KiB per block and group: per-block views).
SMALL_BLOCKS = KVLayout(num_layers=2, num_blocks=64, block_size=4, num_kv_heads=1, head_dim=16, dtype="float16")
LARGE_BLOCKS = KVLayout(num_layers=2, num_blocks=24, block_size=64, num_kv_heads=2, head_dim=64, dtype="float16")


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)


class Rig:
    """A runner's cache attached to a cpu backend, and a model of both sides' bytes."""

    def __init__(self, cache: ShmKVCache, device: CpuDeviceCache, host: torch.Tensor) -> None:
        self.cache, self.device, self.host = cache, device, host
        self.model_device = [_rows(t).clone() for t in cache.tensors]  # [num_blocks, chunk] each
        gen = torch.Generator().manual_seed(5)
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=gen))
        self.model_host = host.clone()  # [host_blocks, tensors, chunk]

    def apply(self, direction: Direction, device_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        """The model: one command's pairs, in order (destinations are unique per command)."""
        for d, h in zip(device_ids, host_ids):
            for t, tensor in enumerate(self.model_device):
                if direction is Direction.D2H:
                    self.model_host[h, t] = tensor[d]
                else:
                    tensor[d] = self.model_host[h, t]

    def check(self) -> None:
        for t, tensor in enumerate(self.cache.tensors):
            assert torch.equal(_rows(tensor), self.model_device[t]), f"device tensor {t} differs"
        assert torch.equal(self.host, self.model_host), "host cache differs"


@pytest.fixture(params=[SMALL_BLOCKS, LARGE_BLOCKS], ids=["gathered", "views"])
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    layout: KVLayout = request.param
    backend = CpuBackend(copy_threads=2)
    pool = HostPool(layout.host_block_bytes * 40)
    geometry = pool.geometry(layout.host_block_bytes)
    try:
        with ShmKVCache(layout) as cache:
            fill_random(cache, seed=3)
            device = backend.import_device_cache(layout, cache.device_handle(), pool, geometry, Requester())
            assert isinstance(device, CpuDeviceCache)
            gathered = layout.num_tensors * layout.chunk_bytes <= _GATHER_MAX_BYTES
            assert (device.groups[0].device_rows is not None) is gathered
            yield Rig(cache, device, pool.blocks(geometry, layout.num_tensors))
            device.close()
    finally:
        backend.close()


def _commands(rng: random.Random, rig: Rig, direction: Direction, count: int) -> list[tuple[list[int], list[int]]]:
    """Commands whose destinations never repeat across the batch (as when they are ready
    together), sources drawn freely (repeats included), of 1 to 5 blocks, some of them runs."""
    device_blocks, host_blocks = rig.cache.layout.num_blocks, rig.host.shape[0]
    dst_space = device_blocks if direction is Direction.H2D else host_blocks
    src_space = host_blocks if direction is Direction.H2D else device_blocks
    free = list(range(dst_space))
    rng.shuffle(free)
    commands = []
    for _ in range(count):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        if len(free) < n:
            break
        if rng.random() < 0.3:  # a run: consecutive on both sides where it fits
            start = rng.randrange(0, src_space - n)
            src = list(range(start, start + n))
        else:
            src = [rng.randrange(src_space) for _ in range(n)]
        dst, free = free[:n], free[n:]
        commands.append((src, dst) if direction is Direction.D2H else (dst, src))
    return commands


def _requests(commands: list[tuple[list[int], list[int]]]) -> list[SwapRequest]:
    return [SwapRequest(d, h, CancelToken()) for d, h in commands]


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_swap_now_many_commands_match_the_model(rig: Rig, direction: Direction) -> None:
    rng = random.Random(int(direction is Direction.D2H))
    for _ in range(4):
        commands = _commands(rng, rig, direction, 16)
        assert rig.device.swap_now(direction, _requests(commands)) == [None] * len(commands)
        for d, h in commands:
            rig.apply(direction, d, h)
        rig.check()


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_swap_many_on_the_workers_matches_the_model(rig: Rig, direction: Direction) -> None:
    rng = random.Random(7)
    commands = _commands(rng, rig, direction, 20)
    errors = asyncio.run(rig.device.swap_many(direction, _requests(commands)))
    assert errors == [None] * len(commands)
    for d, h in commands:
        rig.apply(direction, d, h)
    rig.check()


def test_scattered_single_blocks_and_repeated_sources(rig: Rig) -> None:
    """One block read by several commands, scattered destinations, both directions in turn."""
    out = [([3], [30]), ([3], [1]), ([9], [17]), ([0], [2]), ([3], [25])]
    back = [([10], [30]), ([4], [1]), ([20], [17]), ([11], [30])]
    for direction, commands in ((Direction.D2H, out), (Direction.H2D, back)):
        assert rig.device.swap_now(direction, _requests(commands)) == [None] * len(commands)
        for d, h in commands:
            rig.apply(direction, d, h)
        rig.check()


@pytest.mark.parametrize("count", [3, 20])  # row by row, and one indexed copy
@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_swap_now_single_block_commands(rig: Rig, direction: Direction, count: int) -> None:
    """Every command one block (the batch that skips the per-command plan), sources repeated."""
    rng = random.Random(count)
    device_blocks, host_blocks = rig.cache.layout.num_blocks, rig.host.shape[0]
    if direction is Direction.D2H:
        commands = [([rng.randrange(device_blocks)], [h]) for h in rng.sample(range(host_blocks), count)]
    else:
        commands = [([d], [rng.randrange(host_blocks)]) for d in rng.sample(range(device_blocks), count)]
    assert rig.device.swap_now(direction, _requests(commands)) == [None] * count
    for d, h in commands:
        rig.apply(direction, d, h)
    rig.check()


@pytest.mark.parametrize(
    "commands",
    [
        [([b], [16 + b]) for b in range(4, 24)],  # consecutive on both sides: one slice copy
        [([4], [30]), ([6], [31]), ([5], [32]), ([7], [33])],  # the ends match, the middle does not
        [([4], [30]), ([5], [32]), ([6], [31]), ([7], [33])],
        [([2, 3, 4], [10, 11, 12]), ([5], [13]), ([6, 7], [14, 15])],  # multi-block commands forming one run
    ],
    ids=["one-run", "device-out-of-order", "host-out-of-order", "multi-block-run"],
)
@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_swap_now_consecutive_and_nearly_consecutive_blocks(
    rig: Rig, direction: Direction, commands: list[tuple[list[int], list[int]]]
) -> None:
    assert rig.device.swap_now(direction, _requests(commands)) == [None] * len(commands)
    for d, h in commands:
        rig.apply(direction, d, h)
    rig.check()


def test_a_cancelled_command_copies_nothing(rig: Rig) -> None:
    requests = _requests([([1], [5]), ([2, 3, 4], [6, 7, 8]), ([6], [9]), ([7, 9], [10, 12]), ([11], [13])])
    requests[1].cancel.cancel(ErrorCode.DETACHED, "gone")
    requests[3].cancel.cancel(ErrorCode.SHUTTING_DOWN, "stopping")
    errors = rig.device.swap_now(Direction.D2H, requests)
    assert errors[0] is None and errors[2] is None
    assert errors[1] is not None and errors[1].code == ErrorCode.DETACHED  # type: ignore[attr-defined]
    assert errors[3] is not None and errors[3].code == ErrorCode.SHUTTING_DOWN  # type: ignore[attr-defined]
    rig.apply(Direction.D2H, [1], [5])
    rig.apply(Direction.D2H, [6], [9])
    rig.apply(Direction.D2H, [11], [13])
    rig.check()


def test_a_cancelled_single_block_command_copies_nothing(rig: Rig) -> None:
    requests = _requests([([1], [5]), ([2], [6]), ([3], [7])])
    requests[1].cancel.cancel(ErrorCode.DETACHED, "gone")
    errors = rig.device.swap_now(Direction.D2H, requests)
    assert errors[0] is None and errors[2] is None
    assert errors[1] is not None and errors[1].code == ErrorCode.DETACHED  # type: ignore[attr-defined]
    rig.apply(Direction.D2H, [1], [5])
    rig.apply(Direction.D2H, [3], [7])
    rig.check()


def test_plan_item_splits_single_blocks_from_runs() -> None:
    assert plan_item(4, [7], [9]) == (4, [7], [9], [])
    index, devices, hosts, runs = plan_item(1, [1, 2, 3, 8, 5], [4, 5, 6, 0, 9])
    assert (index, devices, hosts) == (1, [8, 5], [0, 9])
    assert [(r.device, r.host, r.length) for r in runs] == [(1, 4, 3)]
