"""docs/protocol.md "Worked example (bytes)": the listed bytes are exactly what encoding the
described messages gives, and a daemon answers the listed commands as listed."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import pytest

from .conftest import Attached
from .spec import T
from .test_spec_tables import section
from .wire import header, pack

pytestmark = pytest.mark.conformance

BOOT = "9f1c4e2a7b3d4c5e8f6a0b1c2d3e4f50"
# The messages as the example describes them, in its order (and the order of their keys).
MESSAGES: list[tuple[str, int, dict[str, Any]]] = [
    (
        "HELLO",
        T.HELLO,
        {
            "req_id": 1,
            "boot_id": None,
            "protocol": [1, 0],
            "client": "eng",
            "role": "engine",
            "events": "ipc:///tmp/ev.sock",
            "pid": 42,
        },
    ),
    ("SWAP_OUT", T.SWAP_OUT, {"req_id": 7, "boot_id": None, "device_ids": [3, 4], "host_ids": [10, 11]}),
    (
        "EVENT",
        T.EVENT,
        {
            "req_id": 7,
            "boot_id": BOOT,
            "rank": 0,
            "op": 16,
            "code": 0,
            "error": "OK",
            "detail": "",
            "result": {"blocks": 2, "bytes": 2048, "started_at": 1234.5, "finished_at": 1234.75},
        },
    ),
    ("SWAP_IN", T.SWAP_IN, {"req_id": 8, "device_ids": [5, 6], "host_ids": [10]}),
    (
        "EVENT",
        T.EVENT,
        {
            "req_id": 8,
            "boot_id": BOOT,
            "rank": 0,
            "op": 17,
            "code": 12,
            "error": "LENGTH_MISMATCH",
            "detail": "device_ids has 2 entries, host_ids 1",
            "result": {},
        },
    ),
]


def listed_messages() -> list[tuple[str, bytes, bytes]]:
    """(name, header bytes, body bytes) of every message in the example's listing."""
    block = re.search(r"```\n(.*?)```", section("Worked example"), re.S)
    assert block, "the worked example has no listing"
    messages: list[tuple[str, bytearray, bytearray]] = []
    target = bytearray()
    for line in block.group(1).splitlines():
        name = re.match(r"^([A-Z_]+)\s", line)
        if name:
            messages.append((name.group(1), bytearray(), bytearray()))
        for token in re.findall(r'"[^"]*"|\b[a-z]+\b|\b[0-9a-f]{2}\b', line[len(name.group(0)) if name else 0 :]):
            if token in ("header", "body"):
                target = messages[-1][1] if token == "header" else messages[-1][2]
            elif token.startswith('"'):
                target += token[1:-1].encode("ascii")
            else:
                target += bytes.fromhex(token)
    return [(n, bytes(h), bytes(b)) for n, h, b in messages]


def test_listing_is_the_encoding_of_the_described_messages() -> None:
    listed = listed_messages()
    assert [name for name, _, _ in listed] == [name for name, _, _ in MESSAGES]
    for (name, head, body), (_, msg_type, fields) in zip(listed, MESSAGES):
        assert head == header(msg_type), name
        assert body == pack(fields), f"{name}: listed {body.hex(' ')}\n encoded {pack(fields).hex(' ')}"
        assert msgpack.unpackb(body, raw=False) == fields


def test_a_daemon_answers_the_listed_commands_as_listed(attached: Attached) -> None:
    client = attached.client
    by_name: dict[str, list[tuple[bytes, bytes]]] = {}
    for name, head, body in listed_messages():
        by_name.setdefault(name, []).append((head, body))
    for (head, body), expected in zip(
        by_name["SWAP_OUT"] + by_name["SWAP_IN"], [MESSAGES[2][2], MESSAGES[4][2]], strict=True
    ):
        client.send_frames([head, body])
        event = client.wait(expected["req_id"], channel="event")
        got = dict(event.body)
        assert got.pop("boot_id") == client.boot_id
        want = {k: v for k, v in expected.items() if k not in ("boot_id", "detail")}
        got.pop("detail")
        if want["code"] == 0:
            result = got.pop("result")
            assert isinstance(result.pop("started_at"), float) and isinstance(result.pop("finished_at"), float)
            want_result = {k: v for k, v in want.pop("result").items() if not k.endswith("_at")}
            assert result == want_result
        assert got == want
