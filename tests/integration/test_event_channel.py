"""A client's new hello never loses the events of commands it sent before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachexferd.protocol import MsgType, decode_outcomes, encode_batch

from ..helpers import InProcessDaemon, RawClient


@pytest.mark.parametrize("batch_events", [True, False])
def test_events_decided_before_a_hello_without_events_are_delivered(
    inproc: InProcessDaemon, short_tmp: Path, batch_events: bool
) -> None:
    raw = RawClient(inproc.endpoint, short_tmp)
    assert raw.events is not None
    try:
        hello = {"req_id": 1, "protocol": [1, 1], "events": raw.events_endpoint, "batch_events": batch_events}
        raw.send(encode_batch([(MsgType.HELLO, hello)]))
        assert raw.reply().ok
        # In one envelope: asynchronous commands whose outcomes are events on the channel
        # named so far, then a hello that names no event channel any more.
        raw.send(encode_batch([
            (MsgType.SWAP_IN, {"req_id": 2, "device_ids": [1], "host_ids": "bad"}),
            (MsgType.LOOKUP, {"req_id": 3, "keys": ["k"]}),
            (MsgType.HELLO, {"req_id": 4, "protocol": [1, 1]}),
        ]))  # fmt: skip
        outcomes = {raw.reply().req_id: MsgType.REPLY}
        while len(outcomes) < 3 and raw.events.poll(5000):
            outcomes.update((o.req_id, MsgType.EVENT) for o in decode_outcomes(raw.events.recv_multipart()))
        while len(outcomes) < 3 and raw.sock.poll(1000):  # decided after the hello: a reply then
            outcomes[raw.reply().req_id] = MsgType.REPLY
        assert sorted(outcomes) == [2, 3, 4], outcomes
        assert outcomes[2] == MsgType.EVENT  # refused before the hello: on the channel it had
        assert raw.nothing_more()
    finally:
        raw.close()
