"""The vLLM plug-in's storage names (no vLLM needed): a key space per KV-cache group, and one
name for all ranks when every rank holds the same bytes (an MLA latent)."""

from __future__ import annotations

import pytest

from cachexferd.integrations.vllm.keys import VllmKeyNames, group_of, layout_name

LAYOUT = layout_name(layers=4, block_bytes=8192, tokens_per_block=64, kv_cache_layout="LBHNC", hash_algo="sha256",
                     groups=2)  # fmt: skip


def names(replicated: bool = False, tokens: dict[int, int] | None = None) -> VllmKeyNames:
    return VllmKeyNames.create(model="m", weights_version="0", dtype="bfloat16", layout=LAYOUT,
                               tokens_per_block=tokens or {0: 64, 3: 16}, tp_size=2, replicated=replicated)  # fmt: skip


def offload_key(block_hash: bytes, group: int) -> bytes:
    return block_hash + group.to_bytes(4, "big")


def test_each_group_has_its_own_names() -> None:
    n = names()
    a, b = offload_key(b"\x01" * 32, 0), offload_key(b"\x01" * 32, 3)
    assert group_of(b) == 3
    assert n.block_hash(a).digest != n.block_hash(b).digest
    assert n.key(a, 0).split(":")[1] != n.key(b, 0).split(":")[1]  # namespaces differ
    assert ":g3:" in n.key(b, 1) and ":g" not in n.key(a, 1)
    assert n.block_hash(b).tokens == 16 and n.block_hash(a).tokens == 64


def test_ranks_get_their_own_keys_unless_replicated() -> None:
    key = offload_key(b"\x02" * 32, 0)
    per_rank = names()
    assert per_rank.key(key, 0) != per_rank.key(key, 1)
    shared = names(replicated=True)
    assert shared.key(key, 0) == shared.key(key, 1)
    assert ":ranks2:" in shared.key(key, 0)
    assert shared.key(key, 0) != per_rank.key(key, 0)  # never mistaken for rank 0's own object


def test_a_group_that_is_not_offloaded_has_no_name() -> None:
    with pytest.raises(KeyError, match="group 5"):
        names().key(offload_key(b"\x03" * 32, 5), 0)


def test_digest_keys_name_a_chain_parent_in_its_group() -> None:
    n = names()
    key = offload_key(b"\x04" * 32, 3)
    assert n.digest_key(n.block_hash(key).digest, 3, 1) == n.key(key, 1)


def test_adoptable_blocks_hold_our_names_at_one_id_on_every_rank() -> None:
    from cachexferd.integrations.vllm.adoption import adoptable

    n = names()
    a, b, c = (offload_key(bytes([i]) * 32, g) for i, g in ((1, 0), (2, 3), (3, 0)))
    other = VllmKeyNames.create(model="other", weights_version="0", dtype="bfloat16", layout=LAYOUT,
                                tokens_per_block={0: 64, 3: 16}, tp_size=2)  # fmt: skip
    by_rank = {
        0: {1: n.key(a, 0), 2: n.key(b, 0), 3: n.key(c, 0), 4: other.key(a, 0), 5: "junk"},
        1: {1: n.key(a, 1), 2: n.key(b, 1), 3: n.key(a, 1)},  # rank 1 holds another block at id 3
    }
    digests, host_ids = adoptable(n, by_rank)
    assert sorted(zip(host_ids, digests)) == [(1, n.block_hash(a).digest), (2, n.block_hash(b).digest)]
    assert adoptable(n, {1: by_rank[1]}) == ([], [])  # a rank missing: nothing
