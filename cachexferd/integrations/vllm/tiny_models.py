"""Tiny random-weight checkpoints of the model kinds the plug-in serves, made on the spot
with transformers (nothing is downloaded), for the tests and the benchmark.

Each has a word-level tokenizer (``w3 w4 ...``) and weights large enough that greedy tokens
depend on the whole context. The kinds and what vLLM 0.32's CPU build makes of them:
- ``dense``: Llama, one KV-cache group, blocks of 32 tokens;
- ``sliding_window``: Gemma 3 text, three sliding-window layers of 128 tokens and one
  full-attention layer: four KV-cache groups (one per layer), blocks of 64 tokens;
- ``gdn``: Qwen3-Next, three gated-delta-net (linear attention) layers and one full-attention
  layer: four groups, Mamba-style state cached per block in vLLM's "align" mode, blocks of
  384 tokens (vLLM sizes the attention block to the state's page); one gated-delta-net key
  head unless asked for more (``key_heads``: vLLM splits them over tensor-parallel ranks);
- ``mla``: DeepSeek-V2 with a 512 + 64 latent (the shape vLLM's CPU MLA kernel takes): one
  group of latent pages; vLLM turns prefix caching off for MLA on CPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 512


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def _save(model_cls: Any, config: Any, path: Path) -> Path:
    import torch

    torch.manual_seed(0)
    model_cls(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    return path


COMMON = dict(vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)  # fmt: skip


def _sizes(hidden: int) -> dict[str, int]:
    """Width of the model: the benchmark makes its models wider than the tests do, so that
    recomputing a prefix costs what it does for a real model, relative to moving its KV."""
    return {"hidden_size": hidden, "intermediate_size": 2 * hidden}


def dense(path: Path, hidden: int = 64) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **COMMON, **_sizes(hidden), num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        initializer_range=0.2,
    )  # fmt: skip
    return _save(LlamaForCausalLM, config, path)


def sliding_window(path: Path, hidden: int = 64) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **COMMON, **_sizes(hidden), num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        sliding_window=128, layer_types=["sliding_attention"] * 3 + ["full_attention"], initializer_range=0.5,
        pad_token_id=0,
    )  # fmt: skip
    return _save(Gemma3ForCausalLM, config, path)


def gdn(path: Path, hidden: int = 64, key_heads: int = 1) -> Path:
    """``key_heads``: the gated-delta-net key heads (value heads: twice as many); vLLM splits
    them over the tensor-parallel ranks, so TP=2 takes at least 2."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **COMMON, **_sizes(hidden), num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_value_heads=2 * key_heads, linear_num_key_heads=key_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1, initializer_range=0.2,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )  # fmt: skip
    return _save(Qwen3NextForCausalLM, config, path)


def mla(path: Path, hidden: int = 64) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **COMMON, **_sizes(hidden), num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=2, initializer_range=0.2,
    )  # fmt: skip
    return _save(DeepseekV2ForCausalLM, config, path)


@dataclass(frozen=True)
class Kind:
    build: Callable[..., Path]  # (directory, hidden=64) -> the checkpoint's directory
    block: int  # tokens per vLLM block of its full-attention group
    prompt_len: int  # tokens of the test prompts: full blocks and a tail (beyond the window)
    kv_bytes: int  # vLLM's KV cache: a few prompts' worth, so that vLLM forgets them soon
    engine: dict[str, Any]  # engine arguments beyond rig.engine_args


KINDS = {
    "dense": Kind(dense, 32, 6 * 32 + 8, 64 * 16384, {"block_size": 32, "max_model_len": 1024}),
    "sliding_window": Kind(sliding_window, 64, 6 * 64 + 16, 64 * 8192, {"block_size": 64, "max_model_len": 512}),
    "gdn": Kind(gdn, 384, 2 * 384 + 16, 40 * 98304, {"block_size": None, "max_model_len": 1024}),
    "mla": Kind(mla, 16, 12 * 16 + 8, 192 * 18432, {"block_size": 16, "max_model_len": 1024}),
}


def main(argv: list[str] | None = None) -> int:
    """``python -m cachexferd.integrations.vllm.tiny_models KIND DIR``: makes the checkpoint
    (once; an existing one is kept) and prints its directory, for trying the plug-in with
    nothing downloaded."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m cachexferd.integrations.vllm.tiny_models", description=main.__doc__
    )
    parser.add_argument("kind", choices=sorted(KINDS), help="the model kind")
    parser.add_argument("directory", type=Path, help="where the checkpoint goes")
    args = parser.parse_args(argv)
    if not (args.directory / "config.json").exists():
        KINDS[args.kind].build(args.directory)
    print(args.directory.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
