"""A random-weight Llama saved as a Hugging Face checkpoint, built offline at run time (no hub):
the model the vLLM connector's tests and its TTFT benchmark serve. Needs torch and transformers
(the vLLM environment has both); nothing else of tpusync imports this module."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_random_llama(
    path: Path,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_len: int,
    seed: int = 0,
    scale: float = 1.0,
) -> Path:
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
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if scale != 1.0:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(scale)
    model.to(torch.bfloat16).save_pretrained(path)
    return path
