"""A client's new hello never loses the events of commands it sent before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachexferd.protocol import ErrorCode, MsgType, decode_outcomes, encode_batch

from ..helpers import InProcessDaemon, RawClient


@pytest.mark.parametrize("batch_events", [True, False])
def test_events_decided_before_a_hello_without_events_are_delivered(
    inproc: InProcessDaemon, short_tmp: Path, batch_events: bool
) -> None:
    raw = RawClient(inproc.endpoint, short_tmp)
    try:
        hello = {"req_id": 1, "protocol": [1, 1], "events": raw.events_endpoint, "batch_events": batch_events}
        raw.send(encode_batch([(MsgType.HELLO, hello)]))
        assert raw.reply().ok
        # In one envelope: an asynchronous command refused at once (its outcome is an event
        # on the channel named so far), then a hello that names no event channel.
        raw.send(encode_batch([
            (MsgType.SWAP_IN, {"req_id": 2, "device_ids": [1], "host_ids": "bad"}),
            (MsgType.LOOKUP, {"req_id": 3, "keys": ["k"]}),
            (MsgType.HELLO, {"req_id": 4, "protocol": [1, 1]}),
        ]))  # fmt: skip
        assert raw.events is not None
        events = []
        while len(events) < 2 and raw.events.poll(5000):
            events += decode_outcomes(raw.events.recv_multipart())
        replies = [raw.reply() for _ in range(2)] if len(events) < 2 else [raw.reply()]
        outcomes = {o.req_id: o for o in [*events, *replies]}
        assert sorted(outcomes) == [2, 3, 4], outcomes
        assert outcomes[2].code == ErrorCode.BAD_FIELD and outcomes[4].ok
        assert raw.nothing_more()
    finally:
        raw.close()
