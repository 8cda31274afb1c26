"""Every kind of bad input gets an error outcome with its stable code; the daemon keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from cachexferd.client.runner import RunnerClient, ShmKVCache
from cachexferd.protocol import (
    Attach,
    ErrorCode,
    Hello,
    Limits,
    MsgType,
    Ping,
    SwapIn,
    SwapOut,
    encode_header,
)
from cachexferd.protocol.codec import pack

from ..helpers import SMALL, InProcessDaemon, RawClient, config_for


@pytest.fixture
def raw(inproc: InProcessDaemon, short_tmp: Path) -> Iterator[RawClient]:
    client = RawClient(inproc.endpoint, short_tmp)
    assert client.hello().ok
    yield client
    client.close()


@pytest.fixture
def attached(inproc: InProcessDaemon, shm_cache: ShmKVCache) -> Iterator[ShmKVCache]:
    with RunnerClient(inproc.endpoint) as runner, runner.attached(shm_cache):
        yield shm_cache


def _still_serving(raw: RawClient) -> None:
    reply = raw.call(Ping(req_id=999))
    assert reply.ok and reply.req_id == 999


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"just one frame"], ErrorCode.BAD_FRAME),
        ([b"ZZ\x01\x02", pack({"req_id": 1})], ErrorCode.BAD_FRAME),
        ([encode_header(MsgType.PING), b"\xc1\xff\x00"], ErrorCode.BAD_FRAME),
        ([encode_header(MsgType.PING), msgpack.packb("a string")], ErrorCode.BAD_FRAME),
        ([b"CX\x01\x63", pack({"req_id": 5})], ErrorCode.UNKNOWN_TYPE),
        ([b"CX\x07\x02", pack({"req_id": 5})], ErrorCode.WRONG_VERSION),
        ([encode_header(MsgType.PING), pack({"req_id": "x"})], ErrorCode.BAD_FIELD),
        ([encode_header(MsgType.PING), b"\x00" * (Limits.MAX_BODY_BYTES + 10)], ErrorCode.TOO_LARGE),
    ],
)
def test_garbage_gets_a_reply(raw: RawClient, frames: list[bytes], code: ErrorCode) -> None:
    raw.send(frames)
    reply = raw.reply()
    assert reply.code == code, reply
    assert reply.boot_id and reply.detail
    _still_serving(raw)


def test_hello_with_other_major_is_refused(raw: RawClient) -> None:
    reply = raw.call(Hello(req_id=3, protocol=[2, 0]))
    assert reply.code == ErrorCode.WRONG_VERSION and "protocol 2" in reply.detail


def test_async_without_event_channel(inproc: InProcessDaemon) -> None:
    client = RawClient(inproc.endpoint)
    try:
        reply = client.call(SwapOut(req_id=4, device_ids=[1], host_ids=[1]))
        assert reply.code == ErrorCode.NO_EVENT_CHANNEL and reply.req_id == 4
    finally:
        client.close()


def test_swap_before_attach(raw: RawClient) -> None:
    raw.send_cmd(SwapOut(req_id=5, device_ids=[1], host_ids=[1]))
    event = raw.event()
    assert event.code == ErrorCode.NOT_ATTACHED and event.req_id == 5 and event.op == MsgType.SWAP_OUT


def test_bad_event_endpoint(inproc: InProcessDaemon) -> None:
    client = RawClient(inproc.endpoint)
    try:
        reply = client.call(Hello(req_id=1, protocol=[1, 0], events="tcp://8.8.8.8:9"))
        assert reply.code == ErrorCode.BAD_FIELD and "events endpoint" in reply.detail
    finally:
        client.close()


@pytest.mark.parametrize(
    ("cmd", "code"),
    [
        (SwapOut(req_id=10, device_ids=[SMALL.num_blocks], host_ids=[0]), ErrorCode.ID_OUT_OF_RANGE),
        (SwapOut(req_id=11, device_ids=[0], host_ids=[10**6]), ErrorCode.ID_OUT_OF_RANGE),
        (SwapOut(req_id=12, device_ids=[0, 1], host_ids=[3, 3]), ErrorCode.DUPLICATE_ID),
        (SwapIn(req_id=13, device_ids=[4, 4], host_ids=[0, 1]), ErrorCode.DUPLICATE_ID),
        (SwapIn(req_id=14, device_ids=[0, 1], host_ids=[2]), ErrorCode.LENGTH_MISMATCH),
        (SwapOut(req_id=15, boot_id="0" * 32, device_ids=[0], host_ids=[0]), ErrorCode.STALE_BOOT),
    ],
)
def test_bad_swaps_get_error_events(raw: RawClient, attached: ShmKVCache, cmd: SwapOut, code: ErrorCode) -> None:
    raw.send_cmd(cmd)
    event = raw.event()
    assert (event.req_id, event.code) == (cmd.req_id, code), event
    assert raw.nothing_more(), "exactly one outcome per command"
    _still_serving(raw)


def test_duplicate_source_ids_are_allowed(raw: RawClient, attached: ShmKVCache) -> None:
    raw.send_cmd(SwapOut(req_id=20, device_ids=[2, 2], host_ids=[0, 1]))
    assert raw.event().ok


def test_oversized_list(raw: RawClient) -> None:
    body = pack({"req_id": 21, "device_ids": list(range(Limits.MAX_IDS + 1)), "host_ids": []})
    raw.send([encode_header(MsgType.SWAP_OUT), body])
    event = raw.event()
    assert event.code == ErrorCode.TOO_LARGE and event.req_id == 21


def _attach(raw: RawClient, layout: dict[str, object], device: dict[str, object]) -> ErrorCode:
    return ErrorCode(raw.call(Attach(req_id=30, layout=layout, device=device)).code)


def test_bad_attaches(raw: RawClient, shm_cache: ShmKVCache) -> None:
    good_layout, good_device = SMALL.to_wire(), shm_cache.device_handle()
    assert _attach(raw, {**good_layout, "dtype": "float64"}, good_device) == ErrorCode.BAD_FIELD
    assert _attach(raw, good_layout, {**good_device, "name": "../etc/passwd"}) == ErrorCode.BAD_FIELD
    assert _attach(raw, good_layout, {**good_device, "name": "no-such-segment"}) == ErrorCode.ATTACH_FAILED
    assert _attach(raw, good_layout, {**good_device, "kind": "cuda_ipc"}) == ErrorCode.BAD_FIELD
    assert _attach(raw, good_layout, {**good_device, "offsets": [0] * SMALL.num_tensors}) == ErrorCode.LAYOUT_MISMATCH
    assert _attach(raw, good_layout, {**good_device, "offsets": [1]}) == ErrorCode.BAD_FIELD
    bigger = {**good_layout, "num_blocks": SMALL.num_blocks * 2}  # the segment is too small for it
    spaced = [t * SMALL.tensor_bytes * 2 for t in range(SMALL.num_tensors)]
    assert _attach(raw, bigger, {**good_device, "offsets": spaced}) == ErrorCode.LAYOUT_MISMATCH
    assert _attach(raw, good_layout, good_device) == ErrorCode.OK
    assert _attach(raw, good_layout, good_device) == ErrorCode.ALREADY_ATTACHED
    _still_serving(raw)


def test_attach_must_match_host_geometry(short_tmp: Path, shm_cache: ShmKVCache) -> None:
    config = config_for(short_tmp / "rt", **{"host_cache.block_bytes": SMALL.host_block_bytes * 2})
    daemon = InProcessDaemon(config).start()
    try:
        with RunnerClient(daemon.endpoint) as runner, pytest.raises(Exception, match="LAYOUT_MISMATCH"):
            runner.attach(shm_cache)
    finally:
        daemon.stop()


def test_other_layout_after_detach_is_refused(raw: RawClient, inproc: InProcessDaemon) -> None:
    with RunnerClient(inproc.endpoint) as runner:
        first = ShmKVCache(SMALL)
        runner.attach(first)
        runner.detach()
        first.close()
        # Same bytes per block, different shape: host blocks would be misread.
        other = ShmKVCache(SMALL.__class__(**{**SMALL.to_wire(), "num_kv_heads": 1, "head_dim": 64}))
        try:
            with pytest.raises(Exception, match="LAYOUT_MISMATCH"):
                runner.attach(other)
        finally:
            other.close()
