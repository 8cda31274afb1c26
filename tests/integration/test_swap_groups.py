"""A BATCH of swaps on disjoint blocks is handled as groups (daemon/groups.py): each command
keeps its own outcome, the bytes are exact and every other block is unchanged; a BATCH that
cannot be grouped is judged command by command, with the same outcomes as ever."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.daemon.groups import SwapGroup, SwapGroups
from cachexferd.protocol import ErrorCode, Hello, MsgType, Outcome, decode_outcomes, encode_batch, encode_command

from ..helpers import (
    SMALL,
    InProcessDaemon,
    SwapModel,
    assert_matches_model,
    assert_moved,
    assert_untouched,
    config_for,
    fill_random,
    snapshot,
)


class PlanRecorder:
    """The daemon's own SwapGroups, noting what each BATCH became: the sizes of its groups,
    or None when it went command by command."""

    def __init__(self, real: SwapGroups) -> None:
        self.real = real
        self.planned: list[list[int] | None] = []

    def plan(self, identity: bytes, cmds: list[Any], received: float) -> list[SwapGroup] | None:
        groups = self.real.plan(identity, cmds, received)
        self.planned.append(None if groups is None else [len(g.cmds) for g in groups])
        return groups


@pytest.fixture
def recorder(inproc: InProcessDaemon) -> PlanRecorder:
    assert inproc.daemon is not None
    dispatcher = inproc.daemon.dispatcher
    recorder = PlanRecorder(dispatcher.groups)
    dispatcher.groups = recorder  # type: ignore[assignment]
    return recorder


def _batch_counts(inproc: InProcessDaemon) -> tuple[float, float, float]:
    """(BATCH envelopes, commands they carried, swaps grouped), as a scrape shows them."""
    assert inproc.daemon is not None
    text = generate_latest(inproc.daemon.metrics.registry).decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    names = ("cachexferd_batches_total", "cachexferd_batched_commands_total", "cachexferd_grouped_swaps_total")
    return samples[names[0]], samples[names[1]], samples[names[2]]


def _since(before: tuple[float, ...], after: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(a - b for a, b in zip(after, before))


def _done(engine: EngineClient, req_ids: list[int]) -> dict[int, Any]:
    return engine.wait(req_ids, timeout_s=20)


def _code(done: dict[int, Any], req_id: int) -> int:
    (outcome,) = done[req_id].outcomes.values()  # one daemon
    return int(outcome.code)


def _ok(engine: EngineClient, req_ids: list[int]) -> list[dict[str, Any]]:
    done = _done(engine, req_ids)
    for req_id in req_ids:
        assert done[req_id].ok, done[req_id].describe()
    return [done[r].result() for r in req_ids]


def test_disjoint_swaps_of_both_directions_are_grouped_and_exact(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache, recorder: PlanRecorder
) -> None:
    fill_random(shm_cache, seed=21)
    before = snapshot(shm_cache)
    rng = random.Random(21)
    src, host = rng.sample(range(0, 20), 8), rng.sample(range(0, 100), 8)
    block_bytes = shm_cache.layout.host_block_bytes
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        _ok(engine, [engine.swap_out([30, 31, 32, 33, 34, 35], [200, 201, 202, 203, 204, 205])])
        counts = _batch_counts(inproc)
        with engine.batch():
            outs = [engine.swap_out([s], [h]) for s, h in zip(src, host)]
            outs.append(engine.swap_out([20, 21, 22], [150, 151, 152]))
            ins = [engine.swap_in([40, 41], [200, 201]), engine.swap_in([42], [202]),
                   engine.swap_in([43, 44, 45], [203, 204, 205])]  # fmt: skip
        results = _ok(engine, outs + ins)
        assert recorder.planned == [[9, 3]]  # one group per direction
        assert _since(counts, _batch_counts(inproc)) == (1, 12, 12)
        sizes = [1] * 8 + [3] + [2, 1, 3]
        assert [r["blocks"] for r in results] == sizes
        assert [r["bytes"] for r in results] == [n * block_bytes for n in sizes]
        assert all(r["finished_at"] >= r["started_at"] for r in results)
        back = [46, 47, 23, 24, 25, 26, 27, 28, 29, 36, 37]  # read what the group of SWAP_OUTs wrote
        _ok(engine, [engine.swap_in(back, [*host, 150, 151, 152])])
    assert_moved(shm_cache, [40, 41, 42, 43, 44, 45], before, [30, 31, 32, 33, 34, 35])
    assert_moved(shm_cache, back, before, [*src, 20, 21, 22])
    assert_untouched(shm_cache, before, [40, 41, 42, 43, 44, 45, *back])


def test_a_command_behind_a_group_waits_for_it(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache, recorder: PlanRecorder
) -> None:
    """Pipelined right behind the group, a SWAP_IN of one of its host blocks reads what the
    group wrote, and a SWAP_OUT over another of them lands after it."""
    fill_random(shm_cache, seed=22)
    before = snapshot(shm_cache)
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        for round_ in range(20):  # fresh host blocks every round: a read too early finds zeros
            base = 300 + 10 * round_
            with engine.batch():
                group = [engine.swap_out([b], [base + b]) for b in range(8)]
            read = engine.swap_in([40], [base + 3])
            overwrite = engine.swap_out([9], [base + 5])
            last = engine.swap_in([41, 42], [base + 5, base + 6])
            _ok(engine, [*group, read, overwrite, last])
            assert_moved(shm_cache, [40, 41, 42], before, [3, 9, 6])
    assert recorder.planned == [[8]] * 20
    assert_untouched(shm_cache, before, [40, 41, 42])


def test_nested_batch_blocks_send_one_batch_at_the_outer_end(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache
) -> None:
    fill_random(shm_cache, seed=24)
    before = snapshot(shm_cache)
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        counts = _batch_counts(inproc)
        with engine.batch():
            first = engine.swap_out([1], [11])
            with engine.batch():
                second = engine.swap_out([2], [12])
            third = engine.swap_out([3], [13])
        _ok(engine, [first, second, third])
        assert _since(counts, _batch_counts(inproc)) == (1, 3, 3), "envelopes, commands, grouped"
        _ok(engine, [engine.swap_in([40, 41, 42], [11, 12, 13])])
    assert_moved(shm_cache, [40, 41, 42], before, [1, 2, 3])
    assert_untouched(shm_cache, before, [40, 41, 42])


def test_a_client_closed_inside_a_batch_block_sends_nothing(inproc: InProcessDaemon) -> None:
    client = EngineClient([inproc.endpoint])
    client.connect(timeout_s=10)
    counts = _batch_counts(inproc)
    with client.batch():
        client.swap_out([1], [1])
        client.swap_out([2], [2])
        client.close()  # as when a connection is given up in the middle of a step
    assert _since(counts, _batch_counts(inproc)) == (0, 0, 0)


def test_a_batch_that_cannot_be_grouped_is_judged_command_by_command(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache, recorder: PlanRecorder
) -> None:
    fill_random(shm_cache, seed=23)
    before = snapshot(shm_cache)
    counts = _batch_counts(inproc)
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        with engine.batch():  # one id out of range: only that command is refused
            bad = [engine.swap_out([1], [1]), engine.swap_out([999], [2]), engine.swap_out([3], [3])]
        with engine.batch():  # the SWAP_IN reads what the SWAP_OUT before it in the batch writes
            chained = [engine.swap_out([5], [7]), engine.swap_in([44], [7])]
        with engine.batch():  # mismatched lengths in one command
            uneven = [engine.swap_out([6, 8], [9]), engine.swap_out([10], [11])]
        done = _done(engine, bad + chained + uneven)
    assert recorder.planned == [None, None, None]
    assert _since(counts, _batch_counts(inproc)) == (3, 7, 0)  # counted, none grouped
    assert [_code(done, r) for r in bad] == [ErrorCode.OK, ErrorCode.ID_OUT_OF_RANGE, ErrorCode.OK]
    assert [_code(done, r) for r in chained] == [ErrorCode.OK, ErrorCode.OK]
    assert [_code(done, r) for r in uneven] == [ErrorCode.LENGTH_MISMATCH, ErrorCode.OK]
    assert_moved(shm_cache, [44], before, [5])
    assert_untouched(shm_cache, before, [44])


def test_random_batches_match_the_sequential_model(
    inproc: InProcessDaemon, engine: EngineClient, shm_cache: ShmKVCache, recorder: PlanRecorder
) -> None:
    """Batches of random swaps, some disjoint (grouped), some conflicting (command by command),
    pipelined without waiting: the end state is that of running them one by one."""
    fill_random(shm_cache, seed=24)
    original = snapshot(shm_cache)
    rng = random.Random(24)
    model = SwapModel(shm_cache.layout.num_blocks, 64)
    req_ids: list[int] = []
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        for _ in range(120):
            with engine.batch():
                submitted = [model.submit_random(engine, rng, max_blocks=3) for _ in range(rng.randint(2, 6))]
            req_ids += [r for r in submitted if r is not None]
        _ok(engine, req_ids)
    assert_matches_model(shm_cache, original, model.device)
    grouped = sum(1 for p in recorder.planned if p is not None)
    assert 0 < grouped < len(recorder.planned), recorder.planned  # both paths were taken


def _batch_hello(events: str) -> list[bytes]:
    return encode_command(Hello(req_id=1, protocol=[1, 1], role="engine", events=events, batch_events=True))


def test_duplicate_req_ids_in_a_batch_are_refused_as_ever(
    inproc: InProcessDaemon, shm_cache: ShmKVCache, recorder: PlanRecorder, short_tmp: Path
) -> None:
    """The second command with a req_id already in flight gets DUPLICATE_REQ_ID as a REPLY;
    the first keeps its own outcome, as an event."""
    ctx = zmq.Context()
    dealer, pull = ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)
    events = f"ipc://{short_tmp / 'ev.sock'}"
    pull.bind(events)
    dealer.connect(inproc.endpoint)
    try:
        with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
            dealer.send_multipart(_batch_hello(events))
            assert dealer.poll(5000) and decode_outcomes(dealer.recv_multipart())[0].ok
            swap = {"device_ids": [1], "host_ids": [1]}
            dealer.send_multipart(encode_batch([
                (MsgType.SWAP_OUT, {"req_id": 5, **swap}), (MsgType.SWAP_OUT, {"req_id": 5, "device_ids": [2],
                 "host_ids": [2]}), (MsgType.SWAP_OUT, {"req_id": 6, "device_ids": [3], "host_ids": [3]}),
            ]))  # fmt: skip
            assert dealer.poll(5000)
            replies = decode_outcomes(dealer.recv_multipart())
            got: list[Outcome] = []
            while len(got) < 2 and pull.poll(5000):
                got += decode_outcomes(pull.recv_multipart())
    finally:
        dealer.close(0)
        pull.close(0)
        ctx.term()
    assert [(o.req_id, o.code) for o in replies] == [(5, ErrorCode.DUPLICATE_REQ_ID)]
    assert sorted((o.req_id, o.code) for o in got) == [(5, ErrorCode.OK), (6, ErrorCode.OK)]
    assert recorder.planned == []  # refused before any group was planned


class PerCommandOnly:
    """A planner that never groups: the daemon judges every command on its own."""

    def plan(self, identity: bytes, cmds: list[Any], received: float) -> None:
        return None


class Side:
    """A daemon, its runner's cache (same bytes on both sides) and an engine client."""

    def __init__(self, tmp: Path, grouped: bool, stack: contextlib.ExitStack) -> None:
        self.daemon = InProcessDaemon(config_for(tmp / "rt")).start()
        stack.callback(self.daemon.stop)
        assert self.daemon.daemon is not None
        dispatcher = self.daemon.daemon.dispatcher
        self.planner = PlanRecorder(dispatcher.groups)
        dispatcher.groups = self.planner if grouped else PerCommandOnly()  # type: ignore[assignment]
        self.cache = stack.enter_context(ShmKVCache(SMALL))
        fill_random(self.cache, seed=25)
        runner = stack.enter_context(RunnerClient(self.daemon.endpoint))
        stack.enter_context(runner.attached(self.cache))
        self.engine = EngineClient([self.daemon.endpoint], timeout_s=20)
        self.engine.connect()
        stack.callback(self.engine.close)

    def host_bytes(self, host_blocks: int) -> list[torch.Tensor]:
        """Every host block's bytes, read back through the device cache (which it overwrites)."""
        out: list[torch.Tensor] = []
        blocks = self.cache.layout.num_blocks
        for first in range(0, host_blocks, blocks):
            hosts = list(range(first, min(first + blocks, host_blocks)))
            assert self.run([(MsgType.SWAP_IN, {"device_ids": list(range(len(hosts))), "host_ids": hosts})]) == [0]
            out += [t[: len(hosts)].clone() for t in snapshot(self.cache)]
        return out

    def run(self, batch: list[tuple[MsgType, dict[str, Any]]]) -> list[int]:
        with self.engine.batch():
            req_ids = [self.engine.submit(op, fields) for op, fields in batch]
        done = _done(self.engine, req_ids)
        return [_code(done, r) for r in req_ids]


def _random_swap(rng: random.Random, device_blocks: int, host_blocks: int) -> tuple[MsgType, dict[str, Any]]:
    """A swap that is valid most of the time, else wrong in one of the ways a daemon refuses."""
    n = rng.randint(1, 3)
    device, host = rng.sample(range(device_blocks), n), rng.sample(range(host_blocks), n)
    fault = rng.random()
    if fault < 0.04:
        device[0] = device_blocks + rng.randint(0, 5)  # ID_OUT_OF_RANGE
    elif fault < 0.08 and n > 1:
        host.pop()  # LENGTH_MISMATCH
    op = MsgType.SWAP_OUT if rng.random() < 0.5 else MsgType.SWAP_IN
    fields: dict[str, Any] = {"device_ids": device, "host_ids": host}
    owner = rng.choice([None, None, "a", "b"])  # a SWAP_IN naming the wrong one: HOST_BLOCK_CHANGED
    if owner is not None:
        fields["owner"] = owner
    keys = rng.choice([None, None, "x", "y"])  # (1.3) a SWAP_IN naming keys other than those written: refused
    if keys is not None:
        fields["keys"] = [f"{keys}{h}" for h in host][: len(host) - (rng.random() < 0.05)]  # LENGTH_MISMATCH
    if rng.random() < 0.04:
        fields["not_after"] = time.time() - 60  # EXPIRED
    return op, fields


def test_grouped_and_per_command_daemons_give_the_same_outcomes(short_tmp: Path) -> None:
    """The same random batches (some valid and disjoint, some conflicting, some with refusals)
    to a daemon that groups and to one that never does: the same code for every command, the
    same device bytes and the same host bytes at the end."""
    rng = random.Random(25)
    with contextlib.ExitStack() as stack:
        grouped = Side(short_tmp / "grouped", True, stack)
        single = Side(short_tmp / "single", False, stack)
        device_blocks, host_blocks = SMALL.num_blocks, 64
        codes: set[int] = set()
        for _ in range(80):
            batch = [_random_swap(rng, device_blocks, host_blocks) for _ in range(rng.randint(2, 6))]
            got = grouped.run(batch)
            assert got == single.run(batch), batch
            codes.update(got)
        for a, b in zip(snapshot(grouped.cache), snapshot(single.cache)):
            assert torch.equal(a, b)
        for a, b in zip(grouped.host_bytes(host_blocks), single.host_bytes(host_blocks)):
            assert torch.equal(a, b)
        planned = grouped.planner.planned
        assert 0 < sum(1 for p in planned if p is not None) < len(planned), planned  # both paths taken
    assert {ErrorCode.OK, ErrorCode.ID_OUT_OF_RANGE, ErrorCode.HOST_BLOCK_CHANGED, ErrorCode.EXPIRED} <= codes
