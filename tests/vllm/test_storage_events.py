"""Instances of vLLM that share a storage tier report one view of it in their KV events, read
the way routers read them. Two engines, each with a daemon of its own, both daemons on one
storage directory (write-through storage): what one engine stores is announced
``BlockStored`` with medium ``STORAGE`` by the other too (from the daemons' storage
journal), an object deleted through the other engine's daemon is announced ``BlockRemoved``
by both, a router that restarts recovers the current state from vLLM's replay, and an
object deleted while a daemon was down is removed once its successor restates the store."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup-vllm.sh makes a venv with it)")

import zmq  # noqa: E402

from cachexferd.client import EngineClient  # noqa: E402
from cachexferd.client.link import Link, check_ok  # noqa: E402
from cachexferd.launch import DaemonProcess  # noqa: E402
from cachexferd.protocol import StorageEvents  # noqa: E402

from .engine_child import EngineChild  # noqa: E402
from .engines import generate, shutdown  # noqa: E402
from .kv_events import Subscriber  # noqa: E402
from .rig import BLOCK, engine_args, prompt, start_daemon, transfer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]
PROMPTS = [prompt(1100 + seed) for seed in range(3)]
SHORT = PROMPTS[0][:16]  # one step and no full block: stores and events complete meanwhile


@dataclass
class Rig:
    a: Any  # engine A, in this process
    b: EngineChild  # engine B, in a process of its own
    daemon_a: DaemonProcess
    daemon_b: DaemonProcess
    sub_a: Subscriber
    sub_b: Subscriber
    endpoint_b: str  # B's KV events
    replay_b: str  # B's replay endpoint
    stored: set[Any]  # A's blocks the router of B holds as STORAGE (the first test)

    def step(self) -> bool:
        """A step of each engine (events are published at steps); then both routers read."""
        generate(self.a, SHORT)
        self.b.generate(SHORT)
        self.sub_a.drain()
        self.sub_b.drain()
        return True


@pytest.fixture(scope="module")
def rig(tiny_model: Path, cx_root: Path) -> Iterator[Rig]:
    from vllm import LLM

    storage = cx_root / "shared-storage"
    daemons = [start_daemon(cx_root, name, storage) for name in ("share-a", "share-b")]
    # vLLM's publisher binds ipc endpoints; routers connect.
    endpoints = [f"ipc://{cx_root}/{name}.sock" for name in ("events-a", "events-b", "replay-b")]
    subs = [Subscriber(e) for e in endpoints[:2]]
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": ""}
    b = EngineChild(tiny_model, cx_root / "engine-b.log", kv_transfer_config=transfer_config(
        daemons[1].endpoint, retry_interval_s=0.25), kv_events_config={**events, "endpoint": endpoints[1],
        "replay_endpoint": endpoints[2]})  # fmt: skip
    a = LLM(**engine_args(tiny_model), kv_transfer_config=transfer_config(daemons[0].endpoint, retry_interval_s=0.25),
            kv_events_config={**events, "endpoint": endpoints[0]})  # fmt: skip
    rig = Rig(a, b, daemons[0], daemons[1], subs[0], subs[1], endpoints[1], endpoints[2], set())
    try:
        b.generate(SHORT, timeout_s=240)  # started
        yield rig
    finally:
        shutdown(a)
        b.close()
        for sub in (*subs, rig.sub_b):
            sub.close()
        for daemon in (*daemons, rig.daemon_b):
            daemon.stop()


def test_blocks_one_engine_stores_are_announced_by_the_other(rig: Rig) -> None:
    for p in PROMPTS:
        generate(rig.a, p)
    want = len(PROMPTS) * (len(PROMPTS[0]) // BLOCK)
    wait_for(lambda: rig.step() and len(rig.sub_a.storage()) >= want, 30, "A's STORAGE BlockStored events")
    mine = set(rig.sub_a.storage())
    wait_for(lambda: rig.step() and mine <= rig.sub_b.storage(), 30, "B's STORAGE BlockStored for A's blocks")
    assert not (mine & rig.sub_b.cpu()), "B never held these blocks itself"
    rig.stored = mine


def test_an_object_deleted_through_the_other_daemon_is_removed_at_both_routers(rig: Rig) -> None:
    assert rig.stored, "needs the blocks of the first test"
    keys = journal_keys(rig.daemon_b)
    victims = sorted(rig.stored)[:2]
    with EngineClient([rig.daemon_b.endpoint]) as client:
        client.connect(timeout_s=10)
        req = client.delete([keys[h] for h in victims])
        assert client.wait([req], timeout_s=30)[req].ok
    gone = set(victims)

    def removed_at_both() -> bool:
        subs = (rig.sub_a, rig.sub_b)
        return rig.step() and all(gone <= s.removed.get("STORAGE", set()) and not (gone & s.storage()) for s in subs)

    wait_for(removed_at_both, 20, "BlockRemoved STORAGE for the deleted objects at both routers")
    assert rig.stored - gone <= rig.sub_a.storage() & rig.sub_b.storage(), "only the deleted blocks are removed"
    rig.stored -= gone


def test_a_restarted_router_recovers_the_current_state(rig: Rig) -> None:
    assert rig.stored, "needs the blocks of the first tests"
    rig.sub_b.close()
    rig.sub_b = Subscriber(rig.endpoint_b)
    assert rig.sub_b.replay(rig.replay_b) > 0
    assert rig.stored <= rig.sub_b.storage()
    assert not (rig.sub_b.removed.get("STORAGE", set()) & rig.sub_b.storage())
    # And it follows from there: another of A's prompts is announced by B.
    before = set(rig.sub_b.storage())
    generate(rig.a, prompt(1200))
    wait_for(lambda: rig.step() and len(rig.sub_b.storage() - before) >= len(prompt(1200)) // BLOCK, 30,
             "B's STORAGE BlockStored for A's new blocks after the restart")  # fmt: skip


def test_an_object_deleted_while_a_daemon_was_down_is_removed_when_its_successor_restates_the_store(
    rig: Rig, cx_root: Path
) -> None:
    assert rig.stored, "needs the blocks of the first tests"
    rig.daemon_b.kill()
    victim = sorted(rig.stored)[0]
    with EngineClient([rig.daemon_a.endpoint]) as client:  # deleted through A's daemon meanwhile
        client.connect(timeout_s=10)
        req = client.delete([journal_keys(rig.daemon_a)[victim]])
        assert client.wait([req], timeout_s=30)[req].ok
    rig.daemon_b = start_daemon(cx_root, "share-b", cx_root / "shared-storage")

    def removed_at_both() -> bool:
        subs = (rig.sub_a, rig.sub_b)
        return rig.step() and all(victim in s.removed.get("STORAGE", set()) and victim not in s.storage() for s in subs)

    wait_for(removed_at_both, 60, "BlockRemoved STORAGE for the object deleted while B's daemon was down")
    assert rig.stored - {victim} <= rig.sub_b.storage(), "what is still stored is still announced"


def journal_keys(daemon: DaemonProcess) -> dict[Any, str]:
    """vLLM's block hash -> the object's key, from the daemon's storage journal (tags are
    vLLM's offload keys: a block hash and 4 bytes of KV-cache group)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    ctx: zmq.Context[Any] = zmq.Context()
    link = Link(ctx, daemon.endpoint)
    keys: dict[Any, str] = {}
    try:
        cursor, more, req_id = 0, True, 0
        while more:
            req_id += 1
            answer = check_ok(link.call(StorageEvents(req_id=req_id, after=cursor), 10.0))
            assert answer["journal"], "the file backend keeps a journal"
            for _pos, op, _version, key, tag in answer["events"]:
                if op == "stored":
                    keys[maybe_convert_block_hash(bytes(tag)[:-4])] = key
            cursor, more = answer["next"], answer["more"]
    finally:
        link.close()
        ctx.term()
    return keys
