"""docs/protocol.md §4: every limit at its boundary (the largest accepted value and the
smallest refused one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import Attached, ClientFactory
from .daemons import REPO, DaemonProc
from .shm import LAYOUT
from .spec import MAX_BLOCK_ID, MAX_BODY, MAX_KEY_CHARS, MAX_KEYS, MAX_MAP, MAX_REQ_ID, MAX_SOCKET_MESSAGE, E, T
from .wire import header, pack

pytestmark = pytest.mark.conformance


def padded_ping(req_id: int, size: int) -> bytes:
    """A PING body of exactly ``size`` bytes: req_id first, then an ignored padding key."""
    body = pack({"req_id": req_id, "pad": b""})
    pad = size - len(body)
    for extra in range(0, 6):  # the bin header grows with the payload: find the exact fit
        data = pack({"req_id": req_id, "pad": b"\0" * (pad - extra)})
        if len(data) == size:
            return data
    raise AssertionError(f"cannot build a body of {size} bytes")


def test_body_of_exactly_the_limit_is_served(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    req_id = client.next_id()
    client.send_frames([header(T.PING), padded_ping(req_id, MAX_BODY)])
    assert client.wait(req_id, channel="reply").ok


def test_body_over_the_limit_is_too_large_and_echoes_req_id(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    req_id = client.next_id()
    client.send_frames([header(T.PING), padded_ping(req_id, MAX_BODY + 1)])
    outcome = client.next_outcome(timeout_s=20)
    assert outcome.code == E.TOO_LARGE and outcome.body["op"] == T.PING, outcome
    assert (outcome.channel, outcome.req_id) == ("reply", req_id), f"the readable req_id is echoed: {outcome}"


def test_unreadable_body_over_the_limit_is_too_large_with_req_id_zero(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    client.send_frames([header(T.PING), b"\xc1" * (MAX_BODY + 1)])
    outcome = client.wait(0, channel="reply", timeout_s=20)
    assert outcome.code == E.TOO_LARGE


def test_message_over_the_socket_limit_gets_no_reply(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main, hello=False, events=False)
    client.send_frames([header(T.PING), b"\xc1" * (MAX_SOCKET_MESSAGE + 1)])
    assert client.collect(1.0) == [], "ZeroMQ drops such a connection without any reply"
    assert connect(main).call(T.PING).ok, "the daemon keeps serving"


def test_id_list_limit(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    at_limit = client.call(T.SWAP_OUT, device_ids=[0] * 65536, host_ids=list(range(65536)))
    assert at_limit.code not in (E.TOO_LARGE, E.BAD_FIELD), at_limit  # refused for other reasons
    over = client.call(T.SWAP_OUT, device_ids=[0] * 65537, host_ids=list(range(65537)))
    assert over.code == E.TOO_LARGE, over
    over_host = client.call(T.SWAP_IN, device_ids=[0], host_ids=[0] * 65537)
    assert over_host.code == E.TOO_LARGE, over_host


def test_huge_list_is_too_large_and_echoes_req_id(main: DaemonProc, connect: ClientFactory) -> None:
    """Four times the list limit: still a small body, and its req_id is readable."""
    client = connect(main)
    req_id = client.command(T.SWAP_OUT, device_ids=[0] * (4 * 65536 + 1), host_ids=[0])
    outcome = client.next_outcome()
    assert outcome.code == E.TOO_LARGE and outcome.body["op"] == T.SWAP_OUT, outcome
    assert (outcome.channel, outcome.req_id) == ("event", req_id), f"the readable req_id is echoed: {outcome}"


def test_key_list_limit(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    keys = [f"k{i}" for i in range(MAX_KEYS)]
    at_limit = client.call(T.LOOKUP, keys=keys)
    assert at_limit.ok and at_limit.result["prefix"] == 0, at_limit
    assert client.call(T.LOOKUP, keys=[*keys, "one-more"]).code == E.TOO_LARGE


@pytest.mark.parametrize(
    "key, ok",
    [
        ("k" * MAX_KEY_CHARS, True),
        ("!~" + "a" * 10, True),
        ("k" * (MAX_KEY_CHARS + 1), False),
        ("", False),
        ("has space", False),
        ("tab\tkey", False),
        ("del\x7fkey", False),
        ("caf\u00e9", False),
        (b"bytes-key", False),
        (7, False),
    ],
    ids=["256-chars", "punctuation", "257-chars", "empty", "space", "tab", "del", "non-ascii", "bin", "int"],
)
def test_one_key(main: DaemonProc, connect: ClientFactory, key: object, ok: bool) -> None:
    outcome = connect(main).call(T.LOOKUP, keys=[key])
    assert outcome.code == (E.OK if ok else E.BAD_FIELD), outcome


@pytest.mark.parametrize(
    "field, limit", [("client", 128), ("events", 512), ("boot_id", 64)], ids=["client", "events", "boot_id"]
)
def test_string_fields(main: DaemonProc, connect: ClientFactory, field: str, limit: int) -> None:
    client = connect(main, hello=False)
    body: dict[str, Any] = {"protocol": [1, 0], field: "x" * (limit + 1)}
    assert client.call(T.HELLO, **body).code == E.TOO_LARGE
    if field == "client":
        assert client.call(T.HELLO, protocol=[1, 0], client="x" * limit).ok


def test_map_field_limit(attached: Attached) -> None:
    client = attached.client
    for name in ("layout", "device"):
        fields = attached.cache.attach_fields()
        at_limit = {f"extra{i}": i for i in range(MAX_MAP - len(fields[name]))} | fields[name]
        over = {**at_limit, "one-more": 0}
        assert client.call(T.ATTACH, **{**fields, name: over}).code == E.TOO_LARGE
        assert client.call(T.ATTACH, **{**fields, name: at_limit}).code not in (E.TOO_LARGE,)


def test_block_id_range(attached: Attached) -> None:
    client = attached.client
    assert client.call(T.SWAP_OUT, device_ids=[MAX_BLOCK_ID], host_ids=[0]).code == E.ID_OUT_OF_RANGE
    assert client.call(T.SWAP_OUT, device_ids=[MAX_BLOCK_ID + 1], host_ids=[0]).code == E.BAD_FIELD
    assert client.call(T.SWAP_OUT, device_ids=[0], host_ids=[MAX_BLOCK_ID]).code == E.ID_OUT_OF_RANGE
    assert client.call(T.SWAP_OUT, device_ids=[0], host_ids=[-1]).code == E.BAD_FIELD
    last_device, last_host = LAYOUT["num_blocks"] - 1, (16 << 20) // 1024 - 1
    assert client.call(T.SWAP_OUT, device_ids=[last_device], host_ids=[last_host]).ok


def test_req_id_range(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    top = client.call(T.PING, req_id=MAX_REQ_ID)
    assert top.ok and top.req_id == MAX_REQ_ID
    assert client.call(T.PING, req_id=0).code == E.BAD_FIELD


def test_host_cache_capacity_minimum(tmp_path: Path) -> None:
    """host_cache.capacity below 1 MiB is a configuration error: the daemon exits before it
    binds anything."""
    runtime = tmp_path / "rt"
    command = [sys.executable, "-m", "cachexferd", "serve", "--runtime-dir", str(runtime), "--metrics-port", "0"]
    done = subprocess.run(
        [*command, "--capacity", str((1 << 20) - 1)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done
    assert "host_cache.capacity" in done.stderr
    assert not (runtime / "cmd.sock").exists()
