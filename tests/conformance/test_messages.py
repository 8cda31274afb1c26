"""Every message type of docs/protocol.md §3 and §7, on the wire, with the result shapes the
spec gives (storage commands: test_storage.py; SHUTDOWN: test_lifecycle.py)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from .conftest import Attached, CacheFactory, ClientFactory
from .daemons import REPO, DaemonProc
from .helpers import fingerprint
from .shm import LAYOUT, geometry
from .spec import MAJOR, MAX_BATCH, MAX_BODY, MAX_IDS, MAX_KEYS, MINOR, E, T

pytestmark = pytest.mark.conformance

HOST_CAPACITY = 16 << 20  # every daemon of the suite runs with --capacity 16MiB


def kinds(value: Any) -> Any:
    """The msgpack type of every leaf: 'int', 'float', 'str', 'bin', 'bool', 'nil'."""
    if isinstance(value, dict):
        return {k: kinds(v) for k, v in value.items()}
    if isinstance(value, list):
        return [kinds(v) for v in value]
    names = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bin", type(None): "nil"}
    return names[type(value)]


def test_hello_reply(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main, hello=False)
    reply = client.hello(pid=4242)
    assert reply.channel == "reply" and reply.body["op"] == T.HELLO and reply.body["rank"] == 0
    result = reply.result
    assert result["protocol"] == [MAJOR, MINOR]
    assert kinds(result) == {
        "protocol": ["int", "int"],
        "version": "str",
        "backend": "str",
        "rank": "int",
        "state": "str",
        "host_blocks": "int",
        "host_block_bytes": "int",
        "limits": {"max_ids": "int", "max_keys": "int", "max_body_bytes": "int", "max_batch": "int"},
        "batch": "bool",
        "pid": "int",
        "host_generation": "int",
    }
    assert result["backend"] == "cpu" and result["rank"] == 0
    assert result["state"] in ("detached", "attaching", "attached", "detaching")
    assert result["limits"] == {"max_ids": MAX_IDS, "max_keys": MAX_KEYS, "max_body_bytes": MAX_BODY,
                                "max_batch": MAX_BATCH}  # fmt: skip
    assert result["batch"] is True
    assert result["pid"] == main.proc.pid


def test_a_second_hello_wins_for_that_dealer(attached: Attached, connect: ClientFactory, main: DaemonProc) -> None:
    """Events follow the endpoint named by the DEALER's latest hello."""
    first = attached.client
    other = connect(main, hello=False)  # only its event socket is used
    assert other.events_endpoint is not None
    first.hello(events=other.events_endpoint)
    req_id = first.command(T.SWAP_OUT, device_ids=[1], host_ids=[1])
    event = other.wait(req_id, channel="event")
    assert event.ok, event
    first.hello()  # back to its own endpoint for the fixture's teardown
    assert first.call(T.SWAP_OUT, device_ids=[1], host_ids=[1]).channel == "event"


def test_ping(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main)
    reply = client.call(T.PING)
    assert reply.ok and reply.body["op"] == T.PING
    assert kinds(reply.result) == {"time": "float", "host_generation": "int", "weights_version": "int"}
    assert abs(reply.result["time"] - time.time()) < 60, "PING time is the daemon's wall clock (epoch seconds)"
    assert reply.body["boot_id"] == client.boot_id


def test_ping_works_without_hello(main: DaemonProc, connect: ClientFactory) -> None:
    client = connect(main, hello=False, events=False)
    assert client.call(T.PING).ok
    assert client.call(T.STATUS).ok


STATUS_KINDS_DETACHED = {
    "boot_id": "str",
    "rank": "int",
    "version": "str",
    "protocol": ["int", "int"],
    "pid": "int",
    "state": "str",
    "uptime_s": "float",
    "endpoint": "str",
    "metrics_url": "str",
    "host_cache": {
        "capacity_bytes": "int",
        "ready_bytes": "int",
        "pinned": "bool",
        "block_bytes": "int",
        "num_blocks": "int",
        "generation": "int",
    },
    "device": {"state": "str", "runner_pid": "nil"},
    "commands": {"queued": "int", "running": "int"},
    "clients": "int",
}


def check_status(result: dict[str, Any], daemon: DaemonProc) -> dict[str, Any]:
    """docs/protocol.md §7.3: the stable keys with their msgpack types."""
    got = kinds(result)
    for key, kind in STATUS_KINDS_DETACHED.items():
        if isinstance(kind, dict):
            assert isinstance(got[key], dict), key
            for sub, sub_kind in kind.items():
                if key == "device" and sub == "runner_pid":
                    assert got[key][sub] in ("int", "nil")
                else:
                    assert got[key][sub] == sub_kind, (key, sub, got[key])
        else:
            assert got[key] == kind, (key, got[key])
    assert re.fullmatch(r"[0-9a-f]{32}", result["boot_id"])
    assert result["state"] in ("starting", "running", "draining", "stopped")
    assert result["endpoint"] == daemon.endpoint
    assert result["metrics_url"] == "" or re.fullmatch(r"http://[^/]+:\d+/metrics", result["metrics_url"])
    assert result["pid"] == daemon.proc.pid
    assert got["host_cache"]["fingerprint"] in ("str", "nil")
    assert got["backend"]["name"] == "str" and result["backend"]["name"] == "cpu"
    assert got["storage"]["backend"] == "str"
    host = result["host_cache"]
    assert host["capacity_bytes"] == HOST_CAPACITY and 0 <= host["ready_bytes"] <= HOST_CAPACITY
    return result


def test_status_of_a_detached_daemon(pristine: DaemonProc, connect: ClientFactory) -> None:
    client = connect(pristine)
    reply = client.call(T.STATUS)
    assert reply.ok and reply.body["op"] == T.STATUS
    result = check_status(reply.result, pristine)
    assert result["boot_id"] == reply.body["boot_id"] and result["state"] == "running"
    assert result["host_cache"]["fingerprint"] is None
    assert (result["host_cache"]["block_bytes"], result["host_cache"]["num_blocks"]) == (0, 0)
    assert result["device"] == {"state": "detached", "runner_pid": None}
    assert result["storage"]["backend"] == "file" and kinds(result["storage"])["path"] == "str"
    assert result["clients"] >= 1


def test_status_of_an_attached_daemon(attached: Attached, main: DaemonProc) -> None:
    result = check_status(attached.client.call(T.STATUS).result, main)
    _, _, block_bytes, _ = geometry(LAYOUT)
    assert result["host_cache"]["fingerprint"] == fingerprint(LAYOUT)
    assert result["host_cache"]["block_bytes"] == block_bytes
    assert result["host_cache"]["num_blocks"] == HOST_CAPACITY // block_bytes
    device = result["device"]
    assert device["state"] == "attached"
    assert device["layout"] == LAYOUT and kinds(device["mappings"]) == "int" and device["mappings"] >= 1
    storage = result["storage"]
    assert kinds(storage)["timeout_s"] == "float" and kinds(storage)["io_threads"] == "int"
    assert storage["backend"] == "file" and kinds(storage)["state"] == "str"


def _status_table() -> dict[str, str]:
    """§7.3's table: key -> its type and meaning cells, as written."""
    text = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    match = re.search(r"^### 7\.3 STATUS.*?\n(.*?)(?=^### )", text, re.S | re.M)
    assert match, "docs/protocol.md has no §7.3"
    rows = [line.strip().strip("|").split("|") for line in match.group(1).splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): "|".join(cells[1:]) for cells in rows}


def _storage_status_text() -> str:
    text = (REPO / "docs" / "storage.md").read_text(encoding="utf-8")
    match = re.search(r"^Status \(the `storage` map.*?(?=\n\n)", text, re.S | re.M)
    assert match, "docs/storage.md §6 has no Status paragraph"
    return match.group(0)


def test_every_status_key_is_in_the_spec(attached: Attached, paused_status: dict[str, Any]) -> None:
    """Every key STATUS sends, nested ones included, is in §7.3 (storage backends' own keys:
    docs/storage.md §6), with the type the table gives for the top-level ones."""
    table = _status_table()
    storage_text = _storage_status_text()
    for result in (attached.client.call(T.STATUS).result, paused_status):
        assert set(result) <= set(table), sorted(set(result) - set(table))
        for key, value in result.items():
            kind = {"protocol": "[int, int]", "uptime_s": "float"}.get(key) or kinds(value)
            kind = "map" if isinstance(value, dict) else kind
            assert table[key].split("|")[0].strip() == kind, (key, table[key], kind)
        for key in ("host_cache", "commands", "device", "backend"):
            missing = [sub for sub in result[key] if f"`{sub}`" not in table[key]]
            assert not missing, f"§7.3 does not name {key}.{missing}"
        missing = [sub for sub in result["storage"] if f"`{sub}`" not in table["storage"] + storage_text]
        assert not missing, f"neither §7.3 nor docs/storage.md §6 names storage.{missing}"


@pytest.fixture
def paused_status(fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> dict[str, Any]:
    """STATUS of a daemon that is paused, at another weights version, with a storage namespace
    unset (a fresh daemon of the suite), detached after an attach."""
    client = connect(fresh_daemon)
    assert client.call(T.ATTACH, **shm(seed=9).attach_fields(), weights_version=3).ok
    assert client.call(T.DETACH).ok and client.call(T.PAUSE).ok
    result: dict[str, Any] = client.call(T.STATUS).result
    assert result["paused"] is True and result["host_cache"]["weights_version"] == 3
    assert client.call(T.RESUME).ok
    return result


def test_status_without_storage(nostorage: DaemonProc, connect: ClientFactory) -> None:
    result = connect(nostorage).call(T.STATUS).result
    assert result["storage"] == {"backend": "none"}


def test_attach_and_detach(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    client = connect(main)
    cache = shm(seed=2)
    reply = client.call(T.ATTACH, **cache.attach_fields())
    assert reply.ok and reply.channel == "reply" and reply.body["op"] == T.ATTACH, reply
    _, _, block_bytes, _ = geometry(LAYOUT)
    assert reply.result == {
        "state": "attached",
        "device_blocks": LAYOUT["num_blocks"],
        "host_blocks": HOST_CAPACITY // block_bytes,
        "host_block_bytes": block_bytes,
        "fingerprint": fingerprint(LAYOUT),
        "weights_version": 0,  # (1.2)
        "device_fence": "flock",  # (1.5, the cpu backend)
        "device_fence_reads": True,  # (1.6)
    }
    done = client.call(T.DETACH)
    assert done.ok and done.body["op"] == T.DETACH
    assert kinds(done.result) == {"state": "str", "drained": "int", "cancelled": "int"}
    assert done.result["state"] == "detached" and done.result["cancelled"] == 0
    again = client.call(T.DETACH)  # idempotent
    assert again.ok and again.result == {"state": "detached", "drained": 0, "cancelled": 0}


def test_kv_tensors_defaults_to_two(main: DaemonProc, connect: ClientFactory, shm: CacheFactory) -> None:
    client = connect(main)
    layout = {k: v for k, v in LAYOUT.items() if k != "kv_tensors"}
    cache = shm(layout=layout)
    reply = client.call(T.ATTACH, layout=layout, device=cache.device_map())
    assert reply.ok and reply.result["fingerprint"] == fingerprint(LAYOUT), reply
    assert client.call(T.DETACH).ok


def test_swap_out_and_in_move_exact_bytes(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    before = {b: cache.block(b) for b in range(cache.layout["num_blocks"])}
    out = client.call(T.SWAP_OUT, device_ids=[3, 4, 10], host_ids=[100, 101, 7])
    assert out.ok and out.channel == "event" and out.body["op"] == T.SWAP_OUT, out
    assert out.result["blocks"] == 3 and out.result["bytes"] == 3 * cache.block_bytes
    assert isinstance(out.result["started_at"], float) and isinstance(out.result["finished_at"], float)
    assert out.result["started_at"] <= out.result["finished_at"]
    into = client.call(T.SWAP_IN, device_ids=[20, 21, 22], host_ids=[7, 100, 101])
    assert into.ok and into.body["op"] == T.SWAP_IN and into.result["bytes"] == 3 * cache.block_bytes
    assert [cache.block(b) for b in (20, 21, 22)] == [before[10], before[3], before[4]]
    unchanged = [b for b in before if b not in (20, 21, 22)]
    assert all(cache.block(b) == before[b] for b in unchanged), "a block outside the command changed"


def test_swap_sources_may_repeat_and_empty_lists_succeed(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    want = cache.block(5)
    assert client.call(T.SWAP_OUT, device_ids=[5, 5], host_ids=[30, 31]).ok
    assert client.call(T.SWAP_IN, device_ids=[40, 41], host_ids=[30, 30]).ok
    assert cache.block(40) == want and cache.block(41) == want
    empty = client.call(T.SWAP_IN, device_ids=[], host_ids=[])
    assert empty.ok and empty.result["blocks"] == 0 and empty.result["bytes"] == 0


# Chunks of 16 KiB: 64 KiB host blocks, a layout whose blocks a backend copies differently
# from the 1 KiB blocks of LAYOUT.
WIDE_LAYOUT = {**LAYOUT, "num_blocks": 16, "block_size": 64, "num_kv_heads": 2, "head_dim": 64}


@pytest.mark.parametrize("layout", [LAYOUT, WIDE_LAYOUT], ids=["narrow", "wide"])
def test_empty_swaps_succeed_alone_and_in_a_batch(
    fresh_daemon: DaemonProc, connect: ClientFactory, shm: CacheFactory, layout: dict[str, Any]
) -> None:
    """§7.7: empty lists succeed and move nothing, in both directions, sent alone, in a BATCH
    beside a swap that moves blocks, and in a BATCH of empty swaps only."""
    client = connect(fresh_daemon, batch_events=True)
    cache = shm(layout=layout, seed=4)
    assert client.call(T.ATTACH, **cache.attach_fields()).ok
    before = {b: cache.block(b) for b in range(layout["num_blocks"])}
    for op in (T.SWAP_OUT, T.SWAP_IN):
        alone = client.call(op, device_ids=[], host_ids=[])
        assert alone.ok and alone.result["blocks"] == 0 and alone.result["bytes"] == 0, alone
    empties = [client.next_id() for _ in range(4)]
    moving = client.next_id()
    items = [[T.SWAP_OUT, {"req_id": r, "device_ids": [], "host_ids": []}] for r in empties[:2]]
    items += [[T.SWAP_OUT, {"req_id": moving, "device_ids": [2], "host_ids": [5]}]]
    items += [[T.SWAP_IN, {"req_id": r, "device_ids": [], "host_ids": []}] for r in empties[2:]]
    client.send(T.BATCH, {"items": items})
    outcomes = {o.req_id: o for o in client.wait_all([*empties, moving])}
    assert all(outcomes[r].ok and outcomes[r].result["blocks"] == 0 for r in empties), outcomes
    assert outcomes[moving].ok and outcomes[moving].result["blocks"] == 1, outcomes[moving]
    only_empty = [client.next_id() for _ in range(3)]
    client.send(T.BATCH, {"items": [[T.SWAP_IN, {"req_id": r, "device_ids": [], "host_ids": []}] for r in only_empty]})
    assert all(o.ok and o.result["bytes"] == 0 for o in client.wait_all(only_empty))
    assert all(cache.block(b) == before[b] for b in before), "an empty swap changed a device block"


def test_clear_host(attached: Attached) -> None:
    client, cache = attached.client, attached.cache
    assert client.call(T.SWAP_OUT, device_ids=[1], host_ids=[9]).ok
    cleared = client.call(T.CLEAR_HOST)
    assert cleared.ok and cleared.channel == "event" and cleared.body["op"] == T.CLEAR_HOST
    assert cleared.result["capacity_bytes"] == HOST_CAPACITY
    assert client.call(T.SWAP_IN, device_ids=[2], host_ids=[9]).ok
    assert cache.block(2) == bytes(cache.block_bytes), "the cpu backend reads a cleared host block as zeros"


def test_clear_host_before_any_attach(pristine: DaemonProc, connect: ClientFactory) -> None:
    cleared = connect(pristine).call(T.CLEAR_HOST)
    assert cleared.ok and cleared.result["capacity_bytes"] == HOST_CAPACITY, cleared


def test_outcomes_carry_rank_op_and_one_boot_id(attached: Attached) -> None:
    client = attached.client
    outcomes = [
        client.call(T.PING),
        client.call(T.STATUS),
        client.call(T.SWAP_OUT, device_ids=[0], host_ids=[0]),
        client.call(T.SWAP_IN, device_ids=[0], host_ids=[0]),
    ]
    assert {o.body["boot_id"] for o in outcomes} == {client.boot_id}
    assert [o.body["op"] for o in outcomes] == [T.PING, T.STATUS, T.SWAP_OUT, T.SWAP_IN]
    assert all(o.body["rank"] == 0 for o in outcomes)
    assert all(o.code == E.OK and o.body["error"] == "OK" for o in outcomes)
