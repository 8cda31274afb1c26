"""The cpu backend's two copy paths agree on every shape of id list: a batch copied on the
calling thread (``swap_now``, the fast path the daemon takes for small batches) and the same
batch on the copy workers (``swap_many``, which plans runs and shards) give the same outcome
per command and the same bytes, equal to a sequential model, for random single, empty,
repeated-source and maximal (every block) id lists, on both of the backend's copy methods."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from cachexferd.backends.base import CancelToken, Direction, SwapRequest
from cachexferd.backends.cpu import CpuBackend, CpuDeviceCache
from cachexferd.client import ShmKVCache
from cachexferd.host_cache import HostPool
from cachexferd.protocol import KVLayout
from cachexferd.security import Requester

from ..helpers import fill_random

# 512-byte host blocks (the gathered copy of small rows) and 64 KiB ones (per-block views).
LAYOUTS = {
    "gathered": KVLayout(num_layers=2, num_blocks=24, block_size=4, num_kv_heads=1, head_dim=16, dtype="float16"),
    "views": KVLayout(num_layers=2, num_blocks=12, block_size=64, num_kv_heads=2, head_dim=64, dtype="float16"),
}
HOST_BLOCKS = 20
KINDS = ("empty", "single", "repeated", "random", "maximal")
Command = tuple[list[int], list[int]]  # (device ids, host ids)


class Side:
    """A runner's cache attached to a cpu backend, with the host blocks it copies to and from."""

    def __init__(self, stack: ExitStack, backend: CpuBackend, layout: KVLayout) -> None:
        pool = HostPool(layout.host_block_bytes * HOST_BLOCKS)
        geometry = pool.geometry(layout.host_block_bytes)
        self.cache = stack.enter_context(ShmKVCache(layout))
        fill_random(self.cache, seed=11)
        device = backend.import_device_cache(layout, self.cache.device_handle(), pool, geometry, Requester())
        assert isinstance(device, CpuDeviceCache)
        stack.callback(device.close)
        self.device, self.host = device, pool.blocks(geometry, layout.num_tensors)

    def rows(self) -> list[torch.Tensor]:
        return [t.view(torch.uint8).reshape(t.shape[0], -1) for t in self.cache.tensors]

    def state(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [r.clone() for r in self.rows()], self.host.clone()

    def load(self, state: tuple[list[torch.Tensor], torch.Tensor]) -> None:
        for row, saved in zip(self.rows(), state[0]):
            row.copy_(saved)
        self.host.copy_(state[1])


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def sides(request: pytest.FixtureRequest) -> Iterator[tuple[Side, Side]]:
    layout = LAYOUTS[request.param]
    backend = CpuBackend(copy_threads=2)
    with ExitStack() as stack:
        stack.callback(backend.close)
        yield Side(stack, backend, layout), Side(stack, backend, layout)


def _batch(draw: st.DrawFn, direction: Direction, device_blocks: int) -> list[Command]:
    """Commands ready together: destinations unique across the batch, sources free."""
    to_host = direction is Direction.D2H
    dst_space, src_space = (HOST_BLOCKS, device_blocks) if to_host else (device_blocks, HOST_BLOCKS)
    free = draw(st.permutations(range(dst_space)))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=6))
    commands: list[Command] = []
    for kind in kinds:
        sizes = {"empty": 0, "single": 1, "maximal": len(free)}  # maximal: every destination still free
        n = sizes[kind] if kind in sizes else draw(st.integers(2, 5))
        if n > len(free):
            continue
        dst, free = list(free[:n]), free[n:]
        if kind == "repeated":
            src = [draw(st.integers(0, src_space - 1))] * n
        else:
            src = draw(st.lists(st.integers(0, src_space - 1), min_size=n, max_size=n))
        commands.append((src, dst) if to_host else (dst, src))
    return commands


@st.composite
def batches(draw: st.DrawFn, device_blocks: int) -> tuple[Direction, list[Command]]:
    direction = draw(st.sampled_from([Direction.D2H, Direction.H2D]))
    return direction, _batch(draw, direction, device_blocks)


def _model(state: tuple[list[torch.Tensor], torch.Tensor], direction: Direction, commands: list[Command]) -> None:
    device, host = state
    for device_ids, host_ids in commands:
        for d, h in zip(device_ids, host_ids):
            for t, rows in enumerate(device):
                if direction is Direction.D2H:
                    host[h, t] = rows[d]
                else:
                    rows[d] = host[h, t]


def _requests(commands: list[Command]) -> list[SwapRequest]:
    return [SwapRequest(d, h, CancelToken()) for d, h in commands]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_fast_and_the_checked_path_give_the_same_outcomes(sides: tuple[Side, Side], data: st.DataObject) -> None:
    fast, checked = sides
    direction, commands = data.draw(batches(fast.cache.layout.num_blocks))
    start = fast.state()
    checked.load(start)
    expected = (([r.clone() for r in start[0]]), start[1].clone())
    _model(expected, direction, commands)

    fast_errors = fast.device.swap_now(direction, _requests(commands))
    checked_errors = asyncio.run(checked.device.swap_many(direction, _requests(commands)))

    assert fast_errors == checked_errors == [None] * len(commands), (fast_errors, checked_errors)
    for side in (fast, checked):
        device, host = side.state()
        assert all(torch.equal(a, b) for a, b in zip(device, expected[0])), "device blocks differ from the model"
        assert torch.equal(host, expected[1]), "host blocks differ from the model"


def _has(kind: str, blocks: int) -> object:
    def check(batch: tuple[Direction, list[Command]]) -> bool:
        direction, commands = batch
        for device_ids, host_ids in commands:
            dst, src = (host_ids, device_ids) if direction is Direction.D2H else (device_ids, host_ids)
            space = HOST_BLOCKS if direction is Direction.D2H else blocks
            if {"empty": not dst, "single": len(dst) == 1, "maximal": len(dst) == space,
                "repeated": len(src) > 1 and len(set(src)) == 1}[kind]:  # fmt: skip
                return True
        return False

    return check


@pytest.mark.parametrize("kind", ["empty", "single", "repeated", "maximal"])
def test_the_generator_makes_every_kind_of_list(kind: str) -> None:
    """The property is only as good as its inputs: each kind of list occurs (find raises when not)."""
    blocks = LAYOUTS["views"].num_blocks
    find(batches(blocks), _has(kind, blocks), settings=settings(max_examples=2000, database=None))  # type: ignore[arg-type]
