"""Aggregation of per-rank outcomes, deadlines and restart detection (client core)."""

from __future__ import annotations

import time

from cachexferd.client.core import EngineCore
from cachexferd.client.pending import PendingTable
from cachexferd.protocol import ErrorCode, MsgType, Outcome


def _ok(req_id: int, rank: int, boot: str = "b", **result: int) -> Outcome:
    return Outcome(req_id, boot, rank, 0, "", dict(result), int(MsgType.SWAP_OUT))


def test_done_when_every_rank_reported() -> None:
    table = PendingTable([0, 1])
    table.add(1, MsgType.SWAP_OUT, 10)
    assert table.record(_ok(1, 0)) is None
    assert table.record(_ok(1, 0)) is None  # duplicate ignored
    done = table.record(_ok(1, 1))
    assert done is not None and done.ok and len(table) == 0


def test_one_failed_rank_fails_the_command_with_detail() -> None:
    table = PendingTable([0, 1])
    table.add(1, MsgType.LOAD, 10)
    table.record(Outcome(1, "b", 0, 0, "", {"loaded": 4}, int(MsgType.LOAD)))
    done = table.record(Outcome(1, "b", 1, int(ErrorCode.ID_OUT_OF_RANGE), "host 99", {}, int(MsgType.LOAD)))
    assert done is not None and not done.ok
    assert done.errors == {1: ("ID_OUT_OF_RANGE", "host 99")}
    assert "rank 1: ID_OUT_OF_RANGE" in done.describe()


def test_deadline_fails_missing_ranks_only() -> None:
    table = PendingTable([0, 1])
    table.add(1, MsgType.SWAP_OUT, 0.5)
    table.record(_ok(1, 0))
    assert table.expire(now=0) == []
    (done,) = table.expire(now=1e12)
    assert done.outcomes[0].ok and done.errors[1][0] == "CLIENT_TIMEOUT"
    assert table.record(_ok(1, 1)) is None  # late outcome ignored


def test_min_result() -> None:
    table = PendingTable([0, 1])
    table.add(1, MsgType.LOAD, 10)
    table.record(Outcome(1, "b", 0, 0, "", {"loaded": 4}, int(MsgType.LOAD)))
    done = table.record(Outcome(1, "b", 1, 0, "", {"loaded": 2}, int(MsgType.LOAD)))
    assert done is not None and done.min_result("loaded") == 2


def test_core_detects_restart_and_queues_hello() -> None:
    core = EngineCore(2, "t", "ipc:///tmp/e", timeout_s=10, heartbeat_s=1)
    core.accept_hellos([_ok(1, 0, "boot0"), _ok(2, 1, "boot1")])
    req_id, cmds = core.build(MsgType.SWAP_OUT, {"device_ids": [1], "host_ids": [2]}, None)
    assert [c["boot_id"] for c in cmds] == ["boot0", "boot1"] and cmds[0]["req_id"] == req_id
    done, resend = core.on_outcome(_ok(req_id, 0, "boot0"))
    assert done == [] and resend == []
    # Rank 1 answers a ping with a new boot id: its in-flight command fails at once.
    done, resend = core.on_outcome(Outcome(99, "boot1-new", 1, 0, "", {}, int(MsgType.PING)), index=1)
    assert len(done) == 1 and done[0].errors[1][0] == "DAEMON_RESTARTED"
    assert resend and resend[0][0] == 1 and resend[0][1].TYPE == MsgType.HELLO
    assert core.boot_ids[1] is None  # until the new hello is answered


def test_core_refuses_duplicate_ranks() -> None:
    core = EngineCore(2, "t", "ipc:///tmp/e", timeout_s=10, heartbeat_s=1)
    try:
        core.accept_hellos([_ok(1, 0), _ok(2, 0)])
    except ValueError as exc:
        assert "duplicate ranks" in str(exc)
    else:
        raise AssertionError("duplicate ranks accepted")


def test_heartbeat_pings_each_link_per_interval() -> None:
    core = EngineCore(2, "t", "ipc:///tmp/e", timeout_s=10, heartbeat_s=1)
    core.accept_hellos([_ok(1, 0, "a"), _ok(2, 1, "b")])
    assert core.heartbeat(now=core._last_beat + 0.1) == []
    beats = core.heartbeat(now=core._last_beat + 2)
    assert [(i, c.TYPE) for i, c in beats] == [(0, MsgType.PING), (1, MsgType.PING)]


def test_expire_costs_nothing_before_the_first_deadline_and_skips_finished() -> None:
    table = PendingTable([0])
    for req_id in range(1, 10_001):
        table.add(req_id, MsgType.SWAP_OUT, 1000)
    table.add(20_000, MsgType.SWAP_OUT, 0.0)  # already due
    table.add(20_001, MsgType.SWAP_OUT, 0.0)
    table.record(_ok(20_001, 0))  # finished before its deadline
    expired = table.expire()
    assert [c.req_id for c in expired] == [20_000] and expired[0].errors[0][0] == "CLIENT_TIMEOUT"
    assert len(table) == 10_000 and table.expire() == []
    deadline = table.next_deadline()
    assert deadline is not None and deadline > time.monotonic() + 900
