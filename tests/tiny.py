"""Tiny random Hugging Face models of every supported family, built in-process (no downloads)."""
from __future__ import annotations

import torch
import transformers

VOCAB = 97
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=256)

FAMILIES = {
    # Llama 3 with its long-context rope scaling, GQA 4/2
    "llama3": lambda: transformers.LlamaConfig(
        **_COMMON, num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # Mistral: a sliding window shorter than the test sequences, multi-query attention
    "mistral": lambda: transformers.MistralConfig(**_COMMON, num_key_value_heads=1, sliding_window=8),
    # Qwen2: q/k/v bias
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, num_key_value_heads=2),
    # Qwen3: q/k RMSNorm and a head_dim that is not hidden/heads
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=24),
    # tied input/output embeddings
    "tied": lambda: transformers.LlamaConfig(**_COMMON, num_key_value_heads=4, tie_word_embeddings=True),
}


def hf_model(family: str, seed: int = 0):
    """A random fp32 HF model; biases and norms are perturbed so that every weight matters."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        FAMILIES[family](), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def save_hf(family: str, folder, seed: int = 0, **save_kwargs):
    model = hf_model(family, seed)
    model.save_pretrained(str(folder), **save_kwargs)
    return model


CONFIG_CLASSES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}


def save_variant(model_type: str, folder, seed: int = 0, **config):
    """`save_hf` for a family's variant that a test spells out (activation, window, biases):
    the tiny shapes with 2 kv heads, plus `config`."""
    cfg = CONFIG_CLASSES[model_type](**{**_COMMON, "num_key_value_heads": 2, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(folder))
    return model
