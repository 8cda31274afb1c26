"""1,000 release / re-attach cycles while an engine keeps swapping: every command gets
exactly one outcome, and no mapping or shared-memory segment is left behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cachexferd.client import EngineClient, RunnerClient, ShmKVCache
from cachexferd.protocol import ErrorCode

from ..helpers import SMALL

CYCLES = 1000
EXPECTED = {ErrorCode.OK, ErrorCode.NOT_ATTACHED, ErrorCode.DETACHED, ErrorCode.PAUSED}


def _segments_mapped(pid: int) -> list[str]:
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line]


def test_thousand_release_cycles_under_swap_load(spawn_daemon: Any) -> None:
    daemon = spawn_daemon(settings={"daemon.drain_timeout_s": 1.0})
    assert daemon.proc is not None
    shm_before = set(os.listdir("/dev/shm"))
    cache = ShmKVCache(SMALL)
    submitted: list[int] = []
    done: dict[int, Any] = {}
    with RunnerClient(daemon.endpoint, timeout_s=20) as runner, EngineClient([daemon.endpoint], timeout_s=60) as engine:
        engine.connect()
        runner.attach(cache)
        for cycle in range(CYCLES):
            block = cycle % SMALL.num_blocks
            submitted.append(engine.swap_out([block], [cycle % 64]))
            submitted.append(engine.swap_in([(block + 1) % SMALL.num_blocks], [cycle % 64]))
            if cycle % 2:
                with runner.weight_update(cache):
                    pass
            else:
                runner.detach()
                runner.attach(cache)
            done.update((c.req_id, c) for c in engine.poll())
        runner.detach()
        done.update(engine.wait([r for r in submitted if r not in done], timeout_s=60))
        assert _segments_mapped(daemon.proc.pid) == [], "the daemon still maps a segment after detach"
    cache.close()
    codes = [ErrorCode(done[r].outcomes[0].code) for r in submitted]
    assert len(done) == len(submitted) and set(codes) <= EXPECTED, set(codes) - EXPECTED
    assert codes.count(ErrorCode.OK) > 0  # the load really ran between the cycles
    ours = {name for name in set(os.listdir("/dev/shm")) - shm_before if f"-{os.getpid()}-" in name}
    assert ours == set(), f"segments left in /dev/shm: {ours}"
