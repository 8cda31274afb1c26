"""A random workload through PrefixIndex against the in-memory daemons, with every invariant
checked after every step: requests with shared prefixes arrive, compute, finish; evictions,
completions (some failed, some partial, some held back) and weight updates interleave."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cachexferd.index import Lease, PrefixIndex, StoragePolicy, Tier
from cachexferd.index.tree import STORED
from cachexferd.storage.keys import BlockHash, KeySpace

from .index_fakes import FakeEngine

BLOCK = 2
GPU, HOST = 10, 8
POLICIES: list[StoragePolicy] = ["none", "write_through", "on_eviction"]
SYSTEM_PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]  # shared prefixes: 3 and 2 blocks


class Request:
    def __init__(self, lease: Lease, hashes: list[BlockHash]) -> None:
        self.lease, self.hashes = lease, hashes
        self.computed = False
        self.verified = False


class IndexMachine(RuleBasedStateMachine):
    @initialize(
        storage=st.sampled_from(POLICIES),
        seed=st.integers(0, 2**16),
        fail_rate=st.sampled_from([0.0, 0.15, 0.4]),
    )
    def setup(self, storage: StoragePolicy, seed: int, fail_rate: float) -> None:
        self.rng = random.Random(seed)
        self.fail_rate = fail_rate
        self.engine = FakeEngine(GPU, HOST, policy=self.policy)
        self.space = KeySpace("m", "float16", "layout", BLOCK, tp_size=2)
        self.index = PrefixIndex(self.engine, self.space, gpu_blocks=GPU, host_blocks=HOST, storage=storage, debug=True)
        self.live: list[Request] = []
        self.generation = 0

    def policy(self, op: str, n: int) -> tuple[bool, int]:
        roll = self.rng.random()
        if roll < self.fail_rate / 2:
            return False, 0
        if roll < self.fail_rate:
            return True, self.rng.randrange(n)  # a partial result (or, for swaps, read as all-or-nothing)
        return True, n

    @rule(system=st.integers(0, len(SYSTEM_PROMPTS)), user=st.lists(st.integers(0, 3), max_size=4))
    def arrive(self, system: int, user: list[int]) -> None:
        if len(self.live) >= 4:
            return
        tokens = (SYSTEM_PROMPTS[system] if system < len(SYSTEM_PROMPTS) else []) + [50 + u for u in user]
        hashes = self.index.space.block_hashes(tokens, partial=False)
        match = self.index.match_hashes(hashes)
        assert match.gpu + match.host + match.storage == match.blocks <= len(hashes)
        self.live.append(Request(self.index.acquire(match), hashes))

    @rule(hold=st.booleans(), finish=st.integers(0, 15))
    def tick(self, hold: bool, finish: int) -> None:
        """One scheduler step: completions and commands, then every ready request computes
        its missing blocks; the ones picked by ``finish`` (a bit each) that did, finish."""
        self.engine.hold = hold
        assert self.index.step() == []  # every completion is the index's own
        for i, request in enumerate(list(self.live)):
            self._compute(request)
            if finish >> i & 1 and request.computed:
                self.index.release(request.lease)
                self.index.release(request.lease)  # a second release is a no-op, never a double free
                self.live.remove(request)

    @rule(ops=st.integers(1, 40))
    def burst(self, ops: int) -> None:
        """Many steps of traffic drawn from the seeded generator: returning conversations and
        shared system prompts under GPU and host pressure, with the invariants after each."""
        rng = self.rng
        for _ in range(ops):
            action = rng.random()
            if action < 0.4:
                self.arrive(rng.randrange(len(SYSTEM_PROMPTS) + 1), [rng.randrange(4) for _ in range(rng.randrange(5))])
            elif action < 0.9:
                self.tick(rng.random() < 0.3, rng.randrange(16))
            else:
                self.evict(rng.randint(1, 6), rng.choice([Tier.GPU, Tier.HOST]))
            self.consistent()

    def _compute(self, request: Request) -> None:
        lease = request.lease
        if not lease.ready or request.computed:
            return
        self._verify(request)
        ids = self.index.allocate(lease, len(request.hashes) - lease.hit)
        if ids is None:
            return  # no room yet: evictions in flight
        for i in range(lease.hit, len(request.hashes)):
            self.engine.device[lease.block_ids[i]] = request.hashes[i].digest
        added = self.index.insert(lease, request.hashes)
        assert added == (len(request.hashes) - lease.hit if lease.generation == self.generation else 0)
        request.computed = True

    @rule(n=st.integers(1, 6), tier=st.sampled_from([Tier.GPU, Tier.HOST]))
    def evict(self, n: int, tier: Tier) -> None:
        assert 0 <= self.index.evict(n, tier) <= n

    @rule()
    def new_weights(self) -> None:
        before = len(self.index.tree)
        dropped = self.index.new_weights(f"v{self.rng.random()}")
        self.generation += 1
        assert dropped.nodes == before and len(self.index.tree) == 0

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "index"):
            self.index.check()
            self._stored_blocks_exist()
            for request in self.live:
                if request.lease.ready and not request.verified:
                    self._verify(request)

    def _stored_blocks_exist(self) -> None:
        """The index counts a block as stored only once its object was written."""
        space = self.index.space
        for node in self.index.tree:
            if node.flags & STORED:
                key = space.key(BlockHash(node.digest, BLOCK, False))
                assert self.engine.storage.get(key) == node.digest, f"{node} is not in storage"

    def _verify(self, request: Request) -> None:
        """Every block the index handed over as cached holds exactly what was computed for it."""
        lease = request.lease
        for i in range(lease.hit):
            assert self.engine.device[lease.block_ids[i]] == request.hashes[i].digest, f"block {i} of {lease}"
        request.verified = True

    def teardown(self) -> None:
        if not hasattr(self, "index"):
            return
        for request in list(self.live):
            self.index.release(request.lease)
        self.engine.hold = False
        for _ in range(5):  # everything completes: the index ends with all ids free or cached
            self.index.step()
        self.index.check()
        assert not self.index.busy
        stats = self.index.stats()
        assert stats.quarantined == 0


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
