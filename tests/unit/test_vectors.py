"""docs/vectors.json: the published test vectors for storage keys and layout fingerprints.

Checked both ways:
- the library (cachexferd.storage.keys and .objects, cachexferd.protocol.layout) reproduces the file;
- an independent implementation written here from the prose of docs/storage.md §2,
  docs/storage.md §4.1 / §3 and docs/protocol.md §8.1 alone (hashlib + struct, nothing
  from cachexferd) reproduces it too.

``python -m tests.unit.test_vectors --write`` regenerates the file from CASES with the
library; only do that for a deliberate change of the inputs, never to make a failure go away.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

VECTORS = Path(__file__).resolve().parents[2] / "docs" / "vectors.json"

# ---------------------------------------------------------------------------------------
# Inputs (the generator turns these into docs/vectors.json)

LAYOUTS: dict[str, dict[str, Any]] = {
    "small-bf16": dict(
        dtype="bfloat16", num_layers=2, kv_tensors=2, block_size=4, num_kv_heads=2, head_dim=8, num_blocks=64
    ),
    "small-bf16-more-blocks": dict(
        dtype="bfloat16", num_layers=2, kv_tensors=2, block_size=4, num_kv_heads=2, head_dim=8, num_blocks=4096
    ),
    "small-fp16": dict(
        dtype="float16", num_layers=2, kv_tensors=2, block_size=4, num_kv_heads=2, head_dim=8, num_blocks=64
    ),
    "mla-fp8": dict(
        dtype="float8_e4m3fn", num_layers=61, kv_tensors=1, block_size=16, num_kv_heads=1, head_dim=576, num_blocks=1
    ),
    "llama-8b-tp2": dict(
        dtype="bfloat16", num_layers=32, kv_tensors=2, block_size=16, num_kv_heads=4, head_dim=128, num_blocks=8192
    ),
}

NAMESPACES: dict[str, dict[str, Any]] = {
    "tp1": dict(model="org/model-7b", weights_version="v3", layout="small-bf16", tp_size=1),
    "tp2": dict(model="org/model-7b", weights_version="v3", layout="small-bf16", tp_size=2),
    "utf8-mla": dict(model="modèle/ü-1b", weights_version="step-1200", layout="mla-fp8", tp_size=1),
    "group-3": dict(model="org/model-7b", weights_version="v3", layout="small-bf16", tp_size=2, group=3),
    "mla-replicated": dict(model="org/mla-16b", weights_version="v3", layout="mla-fp8", tp_size=2, replicated=True),
    "group-2-replicated": dict(
        model="org/mla-16b", weights_version="v3", layout="mla-fp8", tp_size=2, group=2, replicated=True
    ),
}

_TOKENS = list(range(500, 514))  # 3 full blocks of 4 and a partial block of 2

CHAINS: list[dict[str, Any]] = [
    dict(name="full-blocks", namespace="tp1", tokens=_TOKENS[:8]),
    dict(name="empty-extra-keys", namespace="tp1", tokens=_TOKENS[:8], extra_keys=[[], []]),
    dict(name="extra-int", namespace="tp1", tokens=_TOKENS[:8], extra_keys=[[0, -42], [2**70]]),
    dict(name="extra-str", namespace="tp1", tokens=_TOKENS[:8], extra_keys=[["img:abc"], ["", "日本"]]),
    dict(name="extra-bytes", namespace="tp1", tokens=_TOKENS[:8], extra_keys=[[b"\x00\xff"], [b""]]),
    dict(name="extra-sparse-mixed", namespace="tp1", tokens=_TOKENS[:8], extra_keys=[None, ["lora", 3, b"\x03"]]),
    dict(name="partial-block", namespace="tp1", tokens=_TOKENS),
    dict(name="partial-block-dropped", namespace="tp1", tokens=_TOKENS, partial=False),
    dict(name="partial-block-with-extra-keys", namespace="tp1", tokens=_TOKENS, extra_keys=[None, None, None, [9]]),
    dict(name="only-a-partial-block", namespace="tp1", tokens=[1, 2, 3]),
    dict(name="parent-continuation", namespace="tp1", tokens=_TOKENS[8:], parent=("partial-block", 1)),
    dict(name="wide-token-ids", namespace="tp1", tokens=[0, 1, -1, 2**40 + 7]),
    dict(name="tp2", namespace="tp2", tokens=_TOKENS[:10]),
    dict(name="utf8-namespace-mla", namespace="utf8-mla", tokens=list(range(20))),
    dict(name="no-tokens", namespace="tp1", tokens=[]),
    dict(name="kv-cache-group-3", namespace="group-3", tokens=_TOKENS[:10]),
    dict(name="replicated-mla", namespace="mla-replicated", tokens=list(range(20))),
    dict(name="replicated-group-2", namespace="group-2-replicated", tokens=list(range(20))),
]

# vLLM plug-in names: (vLLM block hash, group) under one model's key spaces (docs/storage.md §2.8)
VLLM_LAYOUT = dict(layers=4, block_bytes=8192, tokens_per_block=64, kv_cache_layout="LBHNC", hash_algo="sha256",
                   groups=4)  # fmt: skip
VLLM_SPACES: dict[str, dict[str, Any]] = {
    "hybrid-tp2": dict(model="org/gemma-like", weights_version="0", dtype="bfloat16", tp_size=2, replicated=False,
                       tokens_per_block={0: 64, 1: 64, 2: 64, 3: 64}),
    "mla-tp2": dict(model="org/mla-16b", weights_version="0", dtype="bfloat16", tp_size=2, replicated=True,
                    tokens_per_block={0: 16}),
}  # fmt: skip
VLLM_KEYS: list[tuple[str, bytes, int]] = [
    ("hybrid-tp2", bytes(range(32)), 0),
    ("hybrid-tp2", bytes(range(32)), 3),
    ("mla-tp2", bytes(range(100, 132)), 0),
]

# (storage namespace, weights version, chain)
OBJECT_NAMES: list[tuple[str, int, str]] = [
    ("", 0, "full-blocks"),
    ("prod-eu", 0, "full-blocks"),
    ("", 27, "full-blocks"),
    ("prod-eu", 3, "tp2"),
]


# ---------------------------------------------------------------------------------------
# An independent implementation, from the prose only.


def _lp(data: bytes) -> bytes:
    """A length-prefixed field: signed 64-bit little-endian byte count, then the bytes."""
    return struct.pack("<q", len(data)) + data


def _dec(n: int) -> str:
    """Decimal text: a minus sign for negative numbers, digits without leading zeros."""
    return ("-" if n < 0 else "") + str(abs(n))


def _b2b(data: bytes, size: int) -> bytes:
    return hashlib.blake2b(data, digest_size=size).digest()


def prose_fingerprint(layout: dict[str, Any]) -> tuple[str, str]:
    text = "{dtype}:{num_layers}:{kv_tensors}:{block_size}:{num_kv_heads}:{head_dim}".format(**layout)
    return text, hashlib.blake2s(text.encode("ascii"), digest_size=8).hexdigest()


def prose_namespace(ns: dict[str, Any]) -> tuple[bytes, bytes]:
    """(preimage, 16-byte root)."""
    fields = [ns["model"], ns["weights_version"], ns["dtype"], ns["layout"], str(ns["block_size"]), str(ns["tp_size"])]
    if ns.get("group", 0):
        fields.append("g" + _dec(ns["group"]))
    if ns.get("replicated", False):
        fields.append("replicated")
    preimage = b"cx1" + b"".join(_lp(f.encode("utf-8")) for f in fields)
    return preimage, _b2b(preimage, 16)


def prose_extra(extra: list[Any] | None) -> bytes:
    out = b""
    for item in extra or []:
        kind, value = next(iter(item.items()))
        if kind == "int":
            out += b"i" + _lp(_dec(int(value)).encode("ascii"))
        elif kind == "str":
            out += b"s" + _lp(value.encode("utf-8"))
        else:
            out += b"b" + _lp(bytes.fromhex(value))
    return out


def prose_chain(root: bytes, case: dict[str, Any], block_size: int) -> list[tuple[bytes, int, bool]]:
    """[(preimage, tokens, partial)]; the digest of each is BLAKE2b-128 of its preimage."""
    tokens, extra_keys = case["tokens"], case.get("extra_keys")
    prev = bytes.fromhex(case["parent"]["hash"]) if case.get("parent") else root
    out = []
    for start in range(0, len(tokens), block_size):
        chunk = tokens[start : start + block_size]
        partial = len(chunk) < block_size
        if partial and not case.get("partial", True):
            break
        i = start // block_size
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        preimage = (
            prev
            + (b"P" if partial else b"F")
            + struct.pack("<q", len(chunk))
            + struct.pack(f"<{len(chunk)}q", *chunk)
            + _lp(prose_extra(extra))
        )
        out.append((preimage, len(chunk), partial))
        prev = _b2b(preimage, 16)
    return out


def prose_key(ns: dict[str, Any], rank: int, tokens: int, partial: bool, block_hex: str) -> str:
    kind = f"p{tokens}" if partial else "f"
    group = f":g{ns['group']}" if ns.get("group", 0) else ""
    ranks = f":ranks{ns['tp_size']}" if ns.get("replicated", False) else f":r{rank}of{ns['tp_size']}"
    return f"cx1:{ns['digest']}{group}{ranks}:{kind}:{block_hex}"


# ---------------------------------------------------------------------------------------
# The generator (library side)


def _wire_extra(item: Any) -> dict[str, str]:
    if isinstance(item, bytes):
        return {"bytes": item.hex()}
    if isinstance(item, int):
        return {"int": str(item)}
    return {"str": item}


def _wire_extra_keys(extra_keys: list[Any] | None) -> list[Any] | None:
    if extra_keys is None:
        return None
    return [None if e is None else [_wire_extra(x) for x in e] for e in extra_keys]


def build_vectors() -> dict[str, Any]:
    from cachexferd.protocol import KVLayout
    from cachexferd.storage.keys import BlockHash, KeySpace
    from cachexferd.storage.objects import object_name

    out: dict[str, Any] = {
        "about": "Test vectors for cachexferd storage keys (docs/storage.md §2), object names "
        "(docs/storage.md §1.9, §3, §4.1) and layout fingerprints (docs/protocol.md §8.1). "
        "Hex is lowercase. Extra keys are tagged: {'int': decimal text}, {'str': text}, {'bytes': hex}.",
        "version": 1,
    }
    layouts = {name: KVLayout(**spec) for name, spec in LAYOUTS.items()}
    out["layout_fingerprints"] = [
        {
            "name": name,
            "layout": LAYOUTS[name],
            "text": prose_fingerprint(LAYOUTS[name])[0],
            "fingerprint": lay.fingerprint(),
        }
        for name, lay in layouts.items()
    ]
    spaces: dict[str, KeySpace] = {}
    out["namespaces"] = []
    for name, ns in NAMESPACES.items():
        lay = layouts[ns["layout"]]
        space = KeySpace.for_layout(
            ns["model"], lay, weights_version=ns["weights_version"], tp_size=ns["tp_size"],
            group=ns.get("group", 0), replicated=ns.get("replicated", False),
        )  # fmt: skip
        spaces[name] = space
        inputs = dict(
            model=space.model,
            weights_version=space.weights_version,
            dtype=space.dtype,
            layout=space.layout,
            block_size=space.block_size,
            tp_size=space.tp_size,
            group=space.group,
            replicated=space.replicated,
        )
        out["namespaces"].append(
            {
                "name": name,
                "from_layout": ns["layout"],
                **inputs,
                "preimage": prose_namespace(inputs)[0].hex(),
                "root": space._root().hex(),
                "digest": space.digest,
            }
        )
    chains: dict[str, list[BlockHash]] = {}
    out["chains"] = []
    for case in CHAINS:
        space = spaces[case["namespace"]]
        parent = chains[case["parent"][0]][case["parent"][1]] if "parent" in case else None
        blocks = space.block_hashes(
            case["tokens"], case.get("extra_keys"), partial=case.get("partial", True), parent=parent
        )
        chains[case["name"]] = blocks
        # The preimages are the prose implementation's; each must hash to the library's digest.
        wire_case = {**case, "extra_keys": _wire_extra_keys(case.get("extra_keys"))}
        if parent is not None:
            wire_case["parent"] = {"hash": parent.hex}
        preimages = prose_chain(space._root(), wire_case, space.block_size)
        assert [_b2b(p, 16) for p, _, _ in preimages] == [b.digest for b in blocks], case["name"]
        rows = [
            {"tokens": b.tokens, "partial": b.partial, "preimage": p.hex(), "hash": b.hex}
            for b, (p, _, _) in zip(blocks, preimages)
        ]
        row: dict[str, Any] = {
            "name": case["name"],
            "namespace": case["namespace"],
            "tokens": case["tokens"],
            "extra_keys": _wire_extra_keys(case.get("extra_keys")),
            "partial": case.get("partial", True),
            "parent": None
            if parent is None
            else {"chain": case["parent"][0], "block": case["parent"][1], "hash": parent.hex, "tokens": parent.tokens},
            "blocks": rows,
            "keys": {str(rank): space.keys(blocks, rank) for rank in range(space.tp_size)},
        }
        out["chains"].append(row)
    out["vllm_offload_keys"] = build_vllm_keys()
    out["object_names"] = []
    for namespace, version, chain in OBJECT_NAMES:
        case = next(c for c in CHAINS if c["name"] == chain)
        key = spaces[case["namespace"]].keys(chains[chain])[0]
        name = object_name(key, version, namespace)
        path_hex = hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
        out["object_names"].append(
            {
                "storage_namespace": namespace,
                "weights_version": version,
                "key": key,
                "name": name,
                "file_path": f"{path_hex[:2]}/{path_hex[2:4]}/{path_hex}",
                "name_digest": hashlib.blake2b(name.encode(), digest_size=8).hexdigest(),
            }
        )
    return out


def build_vllm_keys() -> list[dict[str, Any]]:
    from cachexferd.integrations.vllm.keys import VllmKeyNames, layout_name

    layout = layout_name(**VLLM_LAYOUT)
    rows = []
    for space_name, block_hash, group in VLLM_KEYS:
        inputs = VLLM_SPACES[space_name]
        names = VllmKeyNames.create(layout=layout, **inputs)
        offload_key = block_hash + group.to_bytes(4, "big")
        space = names.spaces[group]
        rows.append(
            {
                "space": space_name,
                **{k: v for k, v in inputs.items() if k != "tokens_per_block"},
                "layout": layout,
                "block_size": space.block_size,
                "group": group,
                "offload_key": offload_key.hex(),
                "namespace_digest": space.digest,
                "digest": names.block_hash(offload_key).hex,
                "keys": {str(rank): names.key(offload_key, rank) for rank in range(space.tp_size)},
            }
        )
    return rows


def render(vectors: dict[str, Any]) -> str:
    """JSON, indented, with lists of scalars and small maps kept on one line."""

    def emit(value: Any, depth: int) -> str:
        flat = json.dumps(value, ensure_ascii=False)
        if not isinstance(value, (dict, list)) or len(flat) + 2 * depth <= 100 or _scalars(value):
            return flat
        pad, inner = "  " * depth, "  " * (depth + 1)
        if isinstance(value, dict):
            items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {emit(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        return "[\n" + ",\n".join(f"{inner}{emit(v, depth + 1)}" for v in value) + f"\n{pad}]"

    return emit(vectors, 0) + "\n"


def _scalars(value: Any) -> bool:
    return isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value)


# ---------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def vectors() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(VECTORS.read_text(encoding="utf-8"))
    return data


def test_the_library_reproduces_the_file() -> None:
    assert json.loads(render(build_vectors())) == json.loads(VECTORS.read_text(encoding="utf-8"))


def test_the_file_covers_every_case(vectors: dict[str, Any]) -> None:
    names = {c["name"] for c in vectors["chains"]}
    assert names == {c["name"] for c in CHAINS}
    kinds = {next(iter(x)) for c in vectors["chains"] for e in (c["extra_keys"] or []) if e for x in e}
    assert kinds == {"int", "str", "bytes"}
    assert any(b["partial"] for c in vectors["chains"] for b in c["blocks"])
    assert any(c["parent"] for c in vectors["chains"])
    assert any(len(c["keys"]) > 1 for c in vectors["chains"])


def test_prose_layout_fingerprints(vectors: dict[str, Any]) -> None:
    for row in vectors["layout_fingerprints"]:
        text, fingerprint = prose_fingerprint(row["layout"])
        assert (text, fingerprint) == (row["text"], row["fingerprint"]), row["name"]
        assert len(fingerprint) == 16


def test_prose_namespaces(vectors: dict[str, Any]) -> None:
    fingerprints = {row["name"]: row["fingerprint"] for row in vectors["layout_fingerprints"]}
    for row in vectors["namespaces"]:
        assert row["layout"] == fingerprints[row["from_layout"]]
        preimage, root = prose_namespace(row)
        assert preimage.hex() == row["preimage"], row["name"]
        assert root.hex() == row["root"], row["name"]
        assert root.hex()[:16] == row["digest"], row["name"]


def test_prose_block_hashes_and_keys(vectors: dict[str, Any]) -> None:
    namespaces = {row["name"]: row for row in vectors["namespaces"]}
    for case in vectors["chains"]:
        ns = namespaces[case["namespace"]]
        blocks = prose_chain(bytes.fromhex(ns["root"]), case, ns["block_size"])
        assert [(p.hex(), n, part) for p, n, part in blocks] == [
            (b["preimage"], b["tokens"], b["partial"]) for b in case["blocks"]
        ], case["name"]
        assert [_b2b(p, 16).hex() for p, _, _ in blocks] == [b["hash"] for b in case["blocks"]], case["name"]
        for rank, keys in case["keys"].items():
            want = [prose_key(ns, int(rank), b["tokens"], b["partial"], b["hash"]) for b in case["blocks"]]
            assert keys == want, case["name"]
            assert all(len(k) <= 80 and " " not in k and k.isascii() for k in keys)


def test_prose_object_names(vectors: dict[str, Any]) -> None:
    for row in vectors["object_names"]:
        scoped = "w" + str(row["weights_version"]) + "/" + row["key"]  # docs/storage.md §1.9
        name = f"{row['storage_namespace']}/{scoped}" if row["storage_namespace"] else scoped
        assert name == row["name"]
        digest = hashlib.blake2b(name.encode("utf-8"), digest_size=16).hexdigest()
        assert row["file_path"] == f"{digest[:2]}/{digest[2:4]}/{digest}"
        assert row["name_digest"] == hashlib.blake2b(name.encode("utf-8"), digest_size=8).hexdigest()


def test_prose_vllm_offload_keys(vectors: dict[str, Any]) -> None:
    for row in vectors["vllm_offload_keys"]:
        offload_key = bytes.fromhex(row["offload_key"])
        assert int.from_bytes(offload_key[-4:], "big") == row["group"]
        digest = hashlib.blake2b(offload_key, digest_size=16, person=b"cx-vllm").hexdigest()
        assert digest == row["digest"]
        _, root = prose_namespace(row)
        assert root.hex()[:16] == row["namespace_digest"]
        ns = {**row, "digest": row["namespace_digest"]}
        for rank, key in row["keys"].items():
            assert key == prose_key(ns, int(rank), row["block_size"], False, digest)
    layouts = {row["layout"] for row in vectors["vllm_offload_keys"]}
    assert layouts == {"vllm:LBHNC:4layers:8192B:64tok:sha256:4groups"}


def test_vectors_show_the_documented_equalities(vectors: dict[str, Any]) -> None:
    """Statements the prose makes, visible in the file itself."""
    chains = {c["name"]: c for c in vectors["chains"]}
    hashes = {name: [b["hash"] for b in c["blocks"]] for name, c in chains.items()}
    assert hashes["empty-extra-keys"] == hashes["full-blocks"]  # [] and null are the same
    assert hashes["partial-block-dropped"] == hashes["partial-block"][:3]
    assert hashes["parent-continuation"] == hashes["partial-block"][2:]
    assert hashes["partial-block-with-extra-keys"][:3] == hashes["partial-block"][:3]
    assert chains["tp2"]["keys"]["0"] != chains["tp2"]["keys"]["1"]
    assert [k.rsplit(":", 1)[1] for k in chains["tp2"]["keys"]["0"]] == hashes["tp2"]
    fps = {row["name"]: row["fingerprint"] for row in vectors["layout_fingerprints"]}
    assert fps["small-bf16"] == fps["small-bf16-more-blocks"]  # num_blocks is not part of it
    assert len(set(fps.values())) == len(fps) - 1
    replicated = chains["replicated-mla"]["keys"]
    assert replicated["0"] == replicated["1"]  # one object for every rank
    assert hashes["replicated-mla"] != hashes["utf8-namespace-mla"][:5]
    assert all(":g3:" in k for k in chains["kv-cache-group-3"]["keys"]["1"])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.unit.test_vectors --write")
    VECTORS.write_text(render(build_vectors()), encoding="utf-8")
    print(f"wrote {VECTORS}")
