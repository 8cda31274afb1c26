"""Weights versions end to end, over real daemon processes: a command's version is fixed when
the daemon reads it, object names are scoped by version (0 included), the version survives a
daemon restart through the runner's re-attach, and a weight update whose re-attach fails
leaves a state the runner can recover from."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachexferd.client import ClientError, EngineClient, RunnerClient, ShmKVCache
from cachexferd.launch import DaemonProcess
from cachexferd.protocol import KVLayout, Load, Lookup, Pause, Resume, SetWeights, Store, SwapOut

from ..helpers import SMALL, RawClient, fill_random

Spawn = Callable[..., DaemonProcess]
# Big enough blocks that a 128-block swap is still running when the commands behind it arrive.
BIG = KVLayout(num_layers=8, num_blocks=160, block_size=32, num_kv_heads=4, head_dim=64, dtype="bfloat16")
SWAP = list(range(128))


def _storage_daemon(spawn: Spawn, root: Path, **settings: Any) -> DaemonProcess:
    base = {"host_cache.capacity": "160MiB", "storage.backend": "file", "storage.file.path": str(root / "store")}
    return spawn(settings={**base, **settings})


def _collect(raw: RawClient, replies: set[int], events: set[int], timeout_s: float = 30.0) -> dict[int, Any]:
    """Every outcome of the given req_ids: replies on the command socket, events on the other."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while (replies | events) - set(got):
        left = max(0.05, deadline - time.monotonic())
        assert time.monotonic() < deadline, f"missing outcomes: {sorted((replies | events) - set(got))}"
        for sock, wanted in ((raw.sock, replies), (raw.events, events)):
            if set(wanted) - set(got) and sock is not None and sock.poll(int(min(left, 0.1) * 1000)):
                outcome = raw._recv(sock, 1.0)
                got[outcome.req_id] = outcome
    return got


def _load_one(raw: RawClient, req_id: int, key: str, host_id: int = 150) -> int:
    raw.send_cmd(Load(req_id=req_id, keys=[key], host_ids=[host_id]))
    done = raw.event(timeout_s=30)
    assert done.req_id == req_id and done.ok, done
    return int(done.result["loaded"])


def _set_weights(raw: RawClient, req_id: int, version: int) -> None:
    reply = raw.call(SetWeights(req_id=req_id, version=version), timeout_s=10)
    assert reply.ok, reply


@pytest.mark.parametrize("with_pause", [False, True], ids=["set-weights", "pause-set-weights-resume"])
def test_a_store_read_before_set_weights_keeps_the_old_version(
    spawn_daemon: Spawn, short_tmp: Path, with_pause: bool
) -> None:
    """SWAP_OUT, STORE of the swapped host block and SET_WEIGHTS (optionally inside PAUSE ...
    RESUME) sent back to back on one connection: the STORE was read under the old version, so
    its object is not found under the new one, however late the STORE ran."""
    daemon = _storage_daemon(spawn_daemon, short_tmp)
    with ShmKVCache(BIG) as cache, RunnerClient(daemon.endpoint) as runner:
        fill_random(cache, seed=1)
        runner.attach(cache)
        raw = RawClient(daemon.endpoint, short_tmp)
        try:
            assert raw.hello().ok
            req = iter(range(1, 1000))
            for version in (0, 1, 2):  # three rounds: 0 -> 1 -> 2 -> 3
                key = f"chain-{version}"
                swap, store = next(req), next(req)
                raw.send_cmd(SwapOut(req_id=swap, device_ids=SWAP, host_ids=SWAP))
                raw.send_cmd(Store(req_id=store, keys=[key], host_ids=[SWAP[-1]]))
                sync = [next(req) for _ in range(3 if with_pause else 1)]
                if with_pause:
                    raw.send_cmd(Pause(req_id=sync[0]))
                    raw.send_cmd(SetWeights(req_id=sync[1], version=version + 1))
                    raw.send_cmd(Resume(req_id=sync[2]))
                else:
                    raw.send_cmd(SetWeights(req_id=sync[0], version=version + 1))
                got = _collect(raw, set(sync), {swap, store})
                assert all(got[r].ok for r in (swap, store, *sync)), got
                assert got[store].result["stored"] == 1
                assert _load_one(raw, next(req), key) == 0, f"round {version}: STORE read under v{version} landed later"
                raw.send_cmd(Lookup(req_id=(lookup := next(req)), keys=[key]))
                assert raw.event(timeout_s=30).result["prefix"] == 0 and lookup
                _set_weights(raw, next(req), version)  # back to the version the STORE was read under
                assert _load_one(raw, next(req), key) == 1
                _set_weights(raw, next(req), version + 1)
        finally:
            raw.close()
            runner.detach()


def test_names_under_version_zero_cannot_alias_another_version(spawn_daemon: Spawn, short_tmp: Path) -> None:
    daemon = _storage_daemon(spawn_daemon, short_tmp)
    with ShmKVCache(SMALL) as cache, RunnerClient(daemon.endpoint) as runner:
        runner.attach(cache)
        raw = RawClient(daemon.endpoint, short_tmp)
        try:
            assert raw.hello().ok
            raw.send_cmd(Store(req_id=2, keys=["w27/x", "w0/y"], host_ids=[5, 6]))  # at version 0
            assert raw.event(timeout_s=30).result["stored"] == 2
            _set_weights(raw, 3, 27)
            assert _load_one(raw, 4, "x") == 0, "a key stored at version 0 was found as another key at 27"
            raw.send_cmd(Store(req_id=5, keys=["y"], host_ids=[7], device_ids=[1]))  # at version 27
            assert raw.event(timeout_s=30).result["stored"] == 1
            _set_weights(raw, 6, 0)
            assert _load_one(raw, 7, "y") == 0
            assert _load_one(raw, 8, "w27/x") == 1  # its own key still finds it
        finally:
            raw.close()
            runner.detach()


def test_the_weights_version_survives_a_daemon_restart_through_reattach(spawn_daemon: Spawn, short_tmp: Path) -> None:
    """Store k at version 0, move to version 3, SIGKILL and restart the daemon: the runner's
    re-attach restores version 3 before any copy can run, so the object of version 0 is not
    loaded into a model that runs weights 3."""
    daemon = _storage_daemon(spawn_daemon, short_tmp)
    with ShmKVCache(SMALL) as cache, RunnerClient(daemon.endpoint, timeout_s=5) as runner:
        with runner.attached(cache, reattach=True):
            with EngineClient([daemon.endpoint], timeout_s=20) as engine:
                engine.connect()
                done = engine.wait([engine.store(["k"], host_ids=[1], device_ids=[1])], timeout_s=20)
                assert all(c.ok for c in done.values())
            runner.set_weights(3)
            daemon.kill()
            daemon.start()  # same endpoint and storage, new boot id, version 0, nothing attached
            _wait_for(lambda: daemon.status()["device"]["state"] == "attached", 20, "re-attach")
            assert daemon.status()["host_cache"]["weights_version"] == 3
            with EngineClient([daemon.endpoint], timeout_s=20) as engine:
                engine.connect()
                done = engine.wait([engine.load(["k"], host_ids=[2], device_ids=[2])], timeout_s=20)
                assert [c.result()["loaded"] for c in done.values()] == [0]


def test_a_weight_update_whose_attach_fails_is_left_recoverable(spawn_daemon: Spawn) -> None:
    from cachexferd.client.runner import WeightUpdateError

    daemon = spawn_daemon()
    other = KVLayout.from_wire(SMALL.to_wire() | {"head_dim": SMALL.head_dim * 2})  # another model's blocks
    with ShmKVCache(SMALL) as cache, ShmKVCache(other) as wrong, RunnerClient(daemon.endpoint) as runner:
        runner.attach(cache)
        with pytest.raises(WeightUpdateError) as info, runner.weight_update(cache, version=5) as update:
            update.cache = wrong
        error = info.value
        assert isinstance(error, ClientError) and "LAYOUT_MISMATCH" in str(error)
        assert "paused" in str(error) and "detached" in str(error) and "resume" in str(error)
        status = runner.status()
        assert status["paused"] is True and status["device"]["state"] == "detached"
        assert status["host_cache"]["weights_version"] == 5  # the new weights are in force regardless
        runner.attach(cache)  # the documented way out
        runner.resume()
        with EngineClient([daemon.endpoint], timeout_s=20) as engine:
            engine.connect()
            done = engine.wait([engine.swap_out([1], [1])], timeout_s=20)
            assert all(c.ok for c in done.values())
        runner.detach()


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:  # the daemon may still be starting
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
