"""Storage keys: deterministic across processes, chained, partial blocks distinct."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cachexferd.protocol import KVLayout
from cachexferd.protocol.fields import key_list
from cachexferd.storage.keys import KeySpace

LAYOUT = KVLayout(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
SPACE = KeySpace.for_layout("org/model-7b", LAYOUT, weights_version="v3", tp_size=2)
TOKENS = list(range(500, 514))  # 3 full blocks of 4 + a partial block of 2


def test_blocks_and_partial_tail() -> None:
    blocks = SPACE.block_hashes(TOKENS)
    assert [(b.tokens, b.partial) for b in blocks] == [(4, False), (4, False), (4, False), (2, True)]
    keys = SPACE.keys(blocks, rank=1)
    assert [k.split(":")[3] for k in keys] == ["f", "f", "f", "p2"]
    assert all(k.startswith(f"cx1:{SPACE.digest}:r1of2:") for k in keys)
    assert len(SPACE.block_hashes(TOKENS, partial=False)) == 3


def test_keys_are_valid_protocol_keys() -> None:
    keys = SPACE.token_keys(TOKENS, rank=0)
    assert key_list()("keys", keys) == keys  # printable ASCII, no spaces, <= 256 bytes
    assert max(len(k) for k in keys) <= 80


def test_same_tokens_same_keys_in_another_process() -> None:
    code = (
        "import json, sys; sys.path.insert(0, '.');"
        "from cachexferd.storage.keys import KeySpace;"
        f"s = KeySpace('org/model-7b', 'bfloat16', {LAYOUT.fingerprint()!r}, 4, 'v3', 2);"
        f"print(json.dumps(s.token_keys({TOKENS!r}, rank=1)));"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('torch', 'cachexferd.daemon', 'zmq')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    keys_line, modules_line = out.stdout.strip().splitlines()
    assert json.loads(keys_line) == SPACE.token_keys(TOKENS, rank=1)
    assert json.loads(modules_line) == [], "keys must import neither torch, zmq nor the daemon"


def test_a_changed_token_changes_its_block_and_every_later_one() -> None:
    base = SPACE.token_keys(TOKENS)
    for pos in (0, 5, 13):
        changed = list(TOKENS)
        changed[pos] += 1
        keys = SPACE.token_keys(changed)
        block = pos // LAYOUT.block_size
        assert keys[:block] == base[:block]
        assert all(a != b for a, b in zip(keys[block:], base[block:]))


def test_partial_block_differs_from_full_block_and_other_counts() -> None:
    full = SPACE.block_hashes(TOKENS[:4])[0]
    part3 = SPACE.block_hashes(TOKENS[:3])[0]
    part2 = SPACE.block_hashes(TOKENS[:2])[0]
    assert len({full.digest, part3.digest, part2.digest}) == 3
    assert SPACE.key(part3) != SPACE.key(part2) != SPACE.key(full)
    # A prompt that grows past the partial block: the full block's key is new, the earlier ones stay.
    grown = SPACE.token_keys([*TOKENS, 9, 9])
    assert grown[:3] == SPACE.token_keys(TOKENS)[:3]
    assert grown[3] not in SPACE.token_keys(TOKENS)


@pytest.mark.parametrize(
    "other",
    [
        KeySpace.for_layout("org/model-8b", LAYOUT, weights_version="v3", tp_size=2),
        KeySpace.for_layout("org/model-7b", LAYOUT, weights_version="v4", tp_size=2),
        KeySpace.for_layout("org/model-7b", LAYOUT, weights_version="v3", tp_size=4),
        KeySpace("org/model-7b", "float16", LAYOUT.fingerprint(), 4, "v3", 2),
        KeySpace("org/model-7b", "bfloat16", "00" * 8, 4, "v3", 2),
    ],
)
def test_every_namespace_field_changes_every_key(other: KeySpace) -> None:
    mine, theirs = SPACE.token_keys(TOKENS), other.token_keys(TOKENS)
    assert not set(mine) & set(theirs)


def test_ranks_get_their_own_keys_from_one_hash_chain() -> None:
    blocks = SPACE.block_hashes(TOKENS)
    per_rank = SPACE.keys_by_rank(blocks)
    r0, r1 = per_rank(0)["keys"], per_rank(1)["keys"]
    assert not set(r0) & set(r1)
    assert [k.rsplit(":", 1)[1] for k in r0] == [k.rsplit(":", 1)[1] for k in r1]
    with pytest.raises(ValueError):
        SPACE.key(blocks[0], rank=2)


def test_an_extension_names_its_parent_per_rank() -> None:
    blocks = SPACE.block_hashes(TOKENS)
    head, tail = blocks[:2], blocks[2:]
    per_rank = SPACE.keys_by_rank(tail, parent=head[-1])
    assert per_rank(1) == {"keys": SPACE.keys(tail, 1), "parent": SPACE.key(head[-1], 1)}
    assert "parent" not in SPACE.keys_by_rank(head)(0)


def test_extra_keys_join_only_their_block_and_later() -> None:
    plain = SPACE.token_keys(TOKENS)
    extra = SPACE.token_keys(TOKENS, extra_keys=[None, ["img:abc", 7], None, None])
    assert extra[0] == plain[0]
    assert all(a != b for a, b in zip(extra[1:], plain[1:]))
    assert SPACE.token_keys(TOKENS, extra_keys=[None, ["img:abc", 7]]) == extra
    assert SPACE.token_keys(TOKENS, extra_keys=[None, [b"img:abc", 7]]) != extra  # bytes != str
    with pytest.raises(TypeError):
        SPACE.token_keys(TOKENS, extra_keys=[[1.5]])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        SPACE.token_keys(TOKENS, extra_keys=[None] * 5)


def test_chain_continues_from_a_parent() -> None:
    whole = SPACE.block_hashes(TOKENS)
    head = SPACE.block_hashes(TOKENS[:8])
    tail = SPACE.block_hashes(TOKENS[8:], parent=head[-1])
    assert head + tail == whole
    with pytest.raises(ValueError):
        SPACE.block_hashes(TOKENS, parent=whole[-1])  # cannot continue after a partial block


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        KeySpace("m", "bfloat16", "ab", 0)
    with pytest.raises(ValueError):
        KeySpace("m", "bfloat16", "ab", 4, tp_size=0)
    with pytest.raises(TypeError):
        SPACE.token_keys(["a", "b"])  # type: ignore[list-item]
    assert SPACE.token_keys([]) == []
