"""Every command is judged against the state the commands before it leave, whatever the
timing: bursts sent before any reply arrives behave exactly like commands sent one by one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachexferd.client.runner import ShmKVCache
from cachexferd.protocol import (
    Attach,
    Detach,
    ErrorCode,
    Hello,
    MsgType,
    Outcome,
    Ping,
    Shutdown,
    Status,
    SwapIn,
    SwapOut,
    encode_batch,
)

from ..helpers import SMALL, InProcessDaemon, RawClient, config_for


@pytest.fixture
def raw(inproc: InProcessDaemon, short_tmp: Path) -> Iterator[RawClient]:
    client = RawClient(inproc.endpoint, short_tmp)
    client.hello()
    yield client
    client.close()


def _attach(cache: ShmKVCache, req_id: int) -> Attach:
    return Attach(req_id=req_id, layout=SMALL.to_wire(), device=cache.device_handle())


def _outcomes(raw: RawClient, replies: int, events: int) -> dict[int, Outcome]:
    got = [raw.reply(timeout_s=20) for _ in range(replies)] + [raw.event(timeout_s=20) for _ in range(events)]
    return {o.req_id: o for o in got}


def test_swaps_pipelined_behind_detach_are_not_attached(raw: RawClient, shm_cache: ShmKVCache) -> None:
    for _ in range(3):  # deterministic, not a race that sometimes passes
        assert raw.call(_attach(shm_cache, 10)).ok
        raw.send_cmd(SwapOut(req_id=11, device_ids=[1], host_ids=[1]))  # before the detach: runs
        raw.send_cmd(Detach(req_id=12))
        raw.send_cmd(SwapOut(req_id=13, device_ids=[2], host_ids=[2]))  # behind it: refused
        raw.send_cmd(Ping(req_id=14))
        got = _outcomes(raw, replies=2, events=2)
        assert got[11].code == ErrorCode.OK and got[12].code == ErrorCode.OK and got[14].ok
        assert got[13].code == ErrorCode.NOT_ATTACHED, got[13]
        assert raw.nothing_more()


def test_swap_pipelined_behind_attach_runs(raw: RawClient, shm_cache: ShmKVCache) -> None:
    raw.send_cmd(_attach(shm_cache, 20))
    raw.send_cmd(SwapOut(req_id=21, device_ids=[3], host_ids=[4]))
    raw.send_cmd(SwapIn(req_id=22, device_ids=[5], host_ids=[4]))
    got = _outcomes(raw, replies=1, events=2)
    assert [got[r].code for r in (20, 21, 22)] == [ErrorCode.OK] * 3
    assert raw.call(Detach(req_id=23)).ok


def test_a_failed_attach_binds_nothing(raw: RawClient, shm_cache: ShmKVCache) -> None:
    wrong = SMALL.to_wire() | {"block_size": SMALL.block_size * 2}  # another host block size
    bad = Attach(req_id=30, layout=wrong, device={**shm_cache.device_handle(), "name": "no-such-segment"})
    assert raw.call(bad).code == ErrorCode.ATTACH_FAILED
    assert raw.call(_attach(shm_cache, 31)).code == ErrorCode.OK  # the host cache was not bound by the failure
    assert raw.call(Detach(req_id=32)).ok


def test_commands_behind_shutdown_are_refused(short_tmp: Path) -> None:
    daemon = InProcessDaemon(config_for(short_tmp / "rt")).start()
    raw = RawClient(daemon.endpoint, short_tmp)
    try:
        raw.hello()
        raw.send_cmd(Shutdown(req_id=40))
        raw.send_cmd(SwapOut(req_id=41, device_ids=[1], host_ids=[1]))
        raw.send_cmd(Status(req_id=42))
        got = _outcomes(raw, replies=1, events=1) | _outcomes(raw, replies=1, events=0)
        assert got[40].ok and got[42].ok and got[42].result["state"] == "draining"
        assert got[41].code == ErrorCode.SHUTTING_DOWN
    finally:
        raw.close()
        daemon.stop()


def test_hello_ping_and_status_ignore_a_stale_boot_id(raw: RawClient) -> None:
    old = "0" * 32
    assert raw.call(Ping(req_id=50, boot_id=old)).ok
    assert raw.call(Status(req_id=51, boot_id=old)).ok
    assert raw.call(Hello(req_id=52, protocol=[1, 1], boot_id=old, events=raw.events_endpoint)).ok
    assert raw.call(Detach(req_id=53, boot_id=old)).code == ErrorCode.STALE_BOOT


def test_duplicate_ping_req_id_while_a_command_runs(raw: RawClient, shm_cache: ShmKVCache) -> None:
    assert raw.call(_attach(shm_cache, 60)).ok
    swap = {"req_id": 61, "device_ids": list(range(40)), "host_ids": list(range(40))}
    raw.send(encode_batch([(MsgType.SWAP_OUT, swap), (MsgType.PING, {"req_id": 61})]))  # judged back to back
    refusal = raw.reply(timeout_s=20)
    assert (refusal.req_id, refusal.code, refusal.op) == (61, ErrorCode.DUPLICATE_REQ_ID, MsgType.PING)
    assert raw.event(timeout_s=20).code == ErrorCode.OK
    assert raw.call(Detach(req_id=62)).ok
