"""Random-weight models saved as Hugging Face checkpoints, built offline at run time (no hub):
the Llama the vLLM connector's tests and its TTFT benchmark serve, and the other attention
layouts of the connector's model matrix (a Mistral whose every layer slides, a Gemma 3 with
local and global layers, a DeepSeek-V3 with MLA). Needs torch and
transformers (the vLLM environment has both); nothing else of tpusync imports this module."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)


def build_random_llama(
    path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
    vocab: int, max_len: int, seed: int = 0, scale: float = 1.0,
) -> Path:  # fmt: skip
    """Saves (``save_pretrained``, bf16) a Llama of the given shape with weights drawn from
    ``seed`` and multiplied by ``scale`` (a tiny model's logits are near-ties without it, so
    greedy tokens would flip on rounding noise), and returns ``path``."""
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_len,
        torch_dtype="bfloat16",
    )
    return save_random(path, LlamaForCausalLM, config, seed=seed, scale=scale)


def build_random_mistral(
    path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
    vocab: int, max_len: int, sliding_window: int, seed: int = 0, scale: float = 1.0,
    dtype: str = "bfloat16",
) -> Path:  # fmt: skip
    """:func:`build_random_llama` for a Mistral whose every layer attends to the last
    ``sliding_window`` tokens only, saved in ``dtype``."""
    config = MistralConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_len,
        sliding_window=sliding_window,
        torch_dtype=dtype,
    )
    return save_random(path, MistralForCausalLM, config, seed=seed, scale=scale, dtype=dtype)


def build_random_gemma3(
    path: Path, *, hidden: int, heads: int, kv_heads: int, vocab: int, max_len: int,
    sliding_window: int, seed: int = 0, scale: float = 1.0,
) -> Path:  # fmt: skip
    """:func:`build_random_llama` for a Gemma 3 of two layers, the first local (a sliding
    window of ``sliding_window`` tokens), the second global: a hybrid model."""
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=max_len,
        torch_dtype="bfloat16",
    )
    return save_random(path, Gemma3ForCausalLM, config, seed=seed, scale=scale)


def build_random_deepseek_mla(
    path: Path, *, layers: int, hidden: int, heads: int, vocab: int, max_len: int,
    seed: int = 0, scale: float = 1.0,
) -> Path:  # fmt: skip
    """:func:`build_random_llama` for a DeepSeek-V3 shape with MLA (the KV compressed to a
    512-wide latent plus a 64-wide rotary part, the sizes vLLM's MLA kernels take) and dense
    MLPs only (no experts)."""
    config = DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=layers,  # every layer dense
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=max_len,
        rope_scaling=None,
        torch_dtype="bfloat16",
    )
    return save_random(path, DeepseekV3ForCausalLM, config, seed=seed, scale=scale)


def save_random(
    path: Path,
    model_class: type,
    config: object,
    *,
    seed: int = 0,
    scale: float = 1.0,
    dtype: str = "bfloat16",
) -> Path:
    """Saves ``model_class(config)`` with weights drawn from ``seed`` times ``scale``, in
    ``dtype``, and returns ``path``."""
    torch.manual_seed(seed)
    model = model_class(config)
    if scale != 1.0:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(scale)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path
