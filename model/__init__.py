"""Single-device decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3) and its HF I/O.

This package never imports torch.distributed: parallelism is applied from outside (parallel/).
"""
from model.args import ModelArgs, SUPPORTED_ARCHITECTURES
from model.transformer import Transformer
from model.kv_cache import KVCache
from model.hf_io import load_pretrained, save_pretrained, load_model_args

__all__ = [
    "ModelArgs", "SUPPORTED_ARCHITECTURES", "Transformer", "KVCache",
    "load_pretrained", "save_pretrained", "load_model_args",
]
