"""PrefixIndex driving the in-memory daemons: hits per tier, batching per step, deferred
recycling, failures, write-through / on-eviction storage, weight updates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cachexferd.client.pending import Completion
from cachexferd.index import Lease, PrefixIndex, Tier
from cachexferd.protocol import ErrorCode, Outcome
from cachexferd.storage.keys import BlockHash, KeySpace

from .index_fakes import FailPolicy, FakeEngine, all_ok

SPACE = KeySpace("m", "float16", "layout", 4, tp_size=2)


def tokens(name: int, blocks: int) -> list[int]:
    return [name * 1000 + i for i in range(blocks * SPACE.block_size)]


class Engine:
    """A scheduler around the index: requests run to completion one at a time."""

    def __init__(self, gpu: int, host: int, storage: str = "none", policy: FailPolicy = all_ok) -> None:
        self.fake = FakeEngine(gpu, host, policy=policy)
        self.index = PrefixIndex(self.fake, SPACE, gpu_blocks=gpu, host_blocks=host, storage=storage, debug=True)  # type: ignore[arg-type]

    def steps(self, n: int = 3, until: Callable[[], bool] = lambda: False) -> None:
        for _ in range(n):
            self.index.step()
            if until():
                return

    def start(self, prompt: list[int]) -> tuple[Lease, list[BlockHash]]:
        hashes = SPACE.block_hashes(prompt, partial=False)
        lease = self.index.acquire(self.index.match_hashes(hashes))
        self.steps(until=lambda: lease.ready)
        assert lease.ready
        for i in range(lease.hit):  # whatever the index served carries the right bytes
            assert self.fake.device[lease.block_ids[i]] == hashes[i].digest, f"block {i}"
        return lease, hashes

    def run(self, prompt: list[int]) -> int:
        """Serves a prompt fully: fetch the cached prefix, compute the rest, cache it, finish.
        Returns how many blocks came from the cache (``truncated``: whether a fetch failed)."""
        lease, hashes = self.start(prompt)
        hit, self.truncated = lease.hit, lease.truncated
        for _ in range(5):
            if self.index.allocate(lease, len(hashes) - lease.hit) is not None:
                break
            self.steps(1)  # evicted blocks are still being swapped out
        else:
            raise AssertionError("no GPU room")
        for i in range(lease.hit, len(hashes)):
            self.fake.device[lease.block_ids[i]] = hashes[i].digest
        self.index.insert(lease, hashes)
        self.index.release(lease)
        self.steps(2)
        self.index.check()
        return hit


def test_match_by_tokens_and_by_hashes_agree_and_ignore_the_partial_block() -> None:
    e = Engine(gpu=16, host=0)
    e.run(tokens(1, 3))
    prompt = [*tokens(1, 3), 7, 7]  # a partial fourth block
    by_tokens = e.index.match(prompt)
    by_hashes = e.index.match_hashes(SPACE.block_hashes(prompt))
    assert (by_tokens.gpu, by_tokens.blocks) == (by_hashes.gpu, by_hashes.blocks) == (3, 3)
    assert e.index.match_hashes([h.digest for h in SPACE.block_hashes(prompt)]).blocks == 3


def test_a_returning_prompt_is_swapped_back_in_from_host() -> None:
    e = Engine(gpu=8, host=16)
    e.run(tokens(1, 6))
    e.run(tokens(2, 6))  # evicts most of the first to host
    match = e.index.match(tokens(1, 6))
    assert match.blocks == 6 and match.host >= 4 and match.gpu + match.host == 6
    assert len(match.swap_in) == match.host
    assert e.run(tokens(1, 6)) == 6 and not e.truncated
    stats = e.index.stats()
    assert stats.hit_blocks["host"] >= 4 and stats.moved_blocks["swap_in"] >= 4


def test_every_block_a_step_moves_goes_in_one_command() -> None:
    e = Engine(gpu=12, host=24)
    for name in range(3):
        e.run(tokens(name, 3))
    e.fake.sent.clear()
    assert e.index.evict(9) == 9
    e.index.flush()
    assert e.fake.sent == [("swap_out", 9)]


def test_blocks_being_swapped_out_are_not_reused_before_their_completion() -> None:
    e = Engine(gpu=4, host=8)
    e.run(tokens(1, 4))
    e.fake.hold = True  # completions do not arrive
    lease = e.index.acquire(e.index.match_hashes([]))
    assert e.index.allocate(lease, 4) is None  # evicted, but the swap-out has not completed
    e.steps(2)
    assert e.index.allocate(lease, 4) is None and len(e.index.tree.gpu_free) == 0
    e.fake.hold = False
    e.steps(1)
    assert e.index.allocate(lease, 4) is not None
    e.index.release(lease)
    e.index.check()


def test_a_failed_swap_out_leaves_the_block_on_the_gpu() -> None:
    fail_swaps = {"swap_out": True}
    e = Engine(gpu=6, host=8, policy=lambda op, n: (not fail_swaps.get(op), n))
    e.run(tokens(1, 3))
    assert e.index.evict(3) == 3
    e.steps(2)
    match = e.index.match(tokens(1, 3))
    assert match.gpu == 3 and e.index.stats().failed_blocks["swap_out"] == 3
    assert e.run(tokens(1, 3)) == 3  # still served, bytes checked by run()
    fail_swaps.clear()
    assert e.index.evict(3) == 3
    e.steps(2)
    assert e.index.match(tokens(1, 3)).host == 3


def test_a_failed_swap_in_turns_the_hit_into_a_miss_for_that_request() -> None:
    fail = {"swap_in": True}
    e = Engine(gpu=6, host=8, policy=lambda op, n: (not fail.get(op), n))
    e.run(tokens(1, 3))
    e.index.evict(3)
    e.steps(2)
    lease, _ = e.start(tokens(1, 3))
    assert lease.hit == 0 and lease.truncated and lease.block_ids == []
    e.index.release(lease)
    e.index.check()
    assert e.index.match(tokens(1, 3)).host == 3  # the host copies are untouched
    fail.clear()
    assert e.run(tokens(1, 3)) == 3


def test_write_through_stores_blocks_as_they_reach_host_and_loads_them_back() -> None:
    e = Engine(gpu=4, host=4, storage="write_through")
    e.run(tokens(1, 4))
    e.run(tokens(2, 4))  # tokens(1) -> host, stored
    e.run(tokens(3, 4))  # tokens(2) -> host; tokens(1) dropped from host, still in storage
    assert sum(n for op, n in e.fake.sent if op == "store") >= 8
    match = e.index.match(tokens(1, 4))
    assert match.storage == 4 and len(match.load) == 4
    assert e.run(tokens(1, 4)) == 4 and e.index.stats().moved_blocks["load"] == 4
    assert any(op == "load" for op, _ in e.fake.sent)


def test_on_eviction_stores_only_what_leaves_the_host_tier() -> None:
    e = Engine(gpu=4, host=4, storage="on_eviction")
    e.run(tokens(1, 4))
    e.run(tokens(2, 4))
    assert not any(op == "store" for op, _ in e.fake.sent)
    e.run(tokens(3, 4))  # tokens(1) leaves the host tier: stored first, then freed
    assert sum(n for op, n in e.fake.sent if op == "store") == 4
    assert e.index.match(tokens(1, 4)).storage == 4


def test_a_failed_store_keeps_the_host_copy() -> None:
    e = Engine(gpu=4, host=4, storage="on_eviction", policy=lambda op, n: (op != "store", n))
    e.run(tokens(1, 4))
    e.run(tokens(2, 4))
    e.index.evict(4, Tier.HOST)
    e.steps(2)
    assert e.index.match(tokens(1, 4)).host == 4  # still on host, not lost
    e.index.check()


def test_a_load_that_misses_shortens_the_hit() -> None:
    e = Engine(gpu=4, host=4, storage="write_through")
    e.run(tokens(1, 4))
    e.run(tokens(2, 4))
    e.run(tokens(3, 4))
    key = SPACE.key(SPACE.block_hashes(tokens(1, 4))[2], 0)
    del e.fake.storage[key]  # evicted by the storage backend
    assert e.run(tokens(1, 4)) == 2 and e.truncated
    assert e.index.match(tokens(1, 4)).blocks == 4  # recomputed and cached again


def test_timed_out_destinations_are_held_back() -> None:
    e = Engine(gpu=6, host=8)
    e.run(tokens(1, 3))
    e.index.evict(3)
    e.steps(2)
    e.fake.policy = lambda op, n: (False, 0)

    run = e.fake._run

    def timed_out(*args: Any) -> Completion:
        """The client's deadline passed: CLIENT_TIMEOUT on every rank."""
        completion = run(*args)
        for rank, outcome in completion.outcomes.items():
            completion.outcomes[rank] = Outcome(outcome.req_id, "boot", rank, int(ErrorCode.CLIENT_TIMEOUT), "late")
        return completion

    e.fake._run = timed_out  # type: ignore[method-assign,assignment]
    lease, _ = e.start(tokens(1, 3))
    assert lease.hit == 0
    assert e.index.stats().quarantined == 3  # the daemon may still write them: never reused
    e.index.release(lease)
    e.index.check()


def test_new_weights_drop_every_block_and_change_the_storage_keys() -> None:
    e = Engine(gpu=4, host=4, storage="write_through")
    e.run(tokens(1, 4))
    e.run(tokens(2, 4))
    running, _ = e.start(tokens(2, 2))
    old_keys = set(e.fake.storage)
    dropped = e.index.new_weights("step-2")
    assert (dropped.old_version, dropped.new_version) == ("0", "step-2")
    assert dropped.nodes == 8 and dropped.gpu_blocks == 4 and dropped.host_blocks == 4 and dropped.storage_blocks == 4
    assert e.index.match(tokens(1, 4)).blocks == 0 and len(e.index.tree) == 0
    e.index.release(running)  # its blocks are freed now
    e.index.check()
    assert len(e.index.tree.gpu_free) == 4 and len(e.index.tree.host_free) == 4
    e.run(tokens(1, 4))
    e.run(tokens(2, 4))
    assert not (set(e.fake.storage) - old_keys) & old_keys
    assert all(e.index.space.digest in k for k in set(e.fake.storage) - old_keys)


@pytest.mark.parametrize("storage", ["bogus"])
def test_bad_storage_policy_is_refused(storage: str) -> None:
    with pytest.raises(ValueError, match="write_through"):
        PrefixIndex(None, SPACE, gpu_blocks=1, storage=storage)  # type: ignore[arg-type]
