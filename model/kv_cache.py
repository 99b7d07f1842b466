"""A static, preallocated KV cache written by position (gpt-fast style).

Shapes never change, so a decode step can be captured by CUDA graphs. Every slot is one sequence;
position p of a slot holds the key/value of that sequence's token at position p. Because keys sit at
their own position, the attention mask for a query at position p is simply "key index <= p", and
stale entries beyond a row's length are never read before they are overwritten.
"""
from __future__ import annotations

import torch
from torch import nn

from model.rope import inv_frequencies, rope_cos_sin, rope_tables


def cache_dtype(model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The cache's default dtype: the model's, except fp32 for a bf16/fp16 model on CPU, where
    attention then computes in fp32 over it (model/attention.py, as the CPU attention of a bf16
    forward does; a forward under bf16 autocast attends in bf16). The keys/values stay the
    model's values (a bf16 number is exact in fp32); what changes is that the scores, softmax
    and weighted sum are no longer rounded to bf16, and that CPU bf16 matmuls copy a strided
    view of the cache before they start (a decode step's q @ k^T over 64 of 288 positions: 64 vs
    22 us, against 24 us in fp32; BENCHMARKS.md "Against TRL")."""
    reduced = model_dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if reduced and torch.device(device).type == "cpu" else model_dtype


def scatter_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots_B: torch.Tensor,
               pos_BT: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> None:
    """One layer's write: caches [slots, H, max_len, D], new keys/values [B, T, H, D] of rows
    `slots_B` at positions `pos_BT`. Each (row, position) pair indexes one [H, D] block of the
    cache seen as [slots, max_len, H, D], which takes half the time of indexing slot, head and
    position apart (17 vs 31 us at a decode step's 64 slots x 4 heads on CPU)."""
    idx = (slots_B[:, None], pos_BT)  # -> [B, T]
    k_cache.transpose(1, 2).index_put_(idx, k_BTHD.to(k_cache.dtype))
    v_cache.transpose(1, 2).index_put_(idx, v_BTHD.to(v_cache.dtype))


def _write_compiled(kv_all: torch.Tensor, layer: int, slots_B: torch.Tensor, pos_BT: torch.Tensor,
                    k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> None:
    """`scatter_kv` of one layer in compiled code: one index_put on the whole cache tensor
    [layers, 2, slots, kv_heads, max_len, head_dim], never on a view of it. Traced on views
    (`k[layer]`), inductor copied the whole cache of every layer before each layer's write, and
    with the cache's sizes symbolic torch 2.13 dropped a mutated view's storage offset (every
    layer's keys landed in layer 0; tests/test_engine.py). On the tensor itself inductor writes in
    place, fused into the kernel that makes the keys and values: vs_trl's generator batch took
    0.86-0.93x the time of an opaque write operator's (its Python dispatch cost ~20 us a layer).
    The layer is a [1, 1] tensor index: an int would select a view, a 0-d tensor is read back as
    an int (a graph break)."""
    layer_11 = torch.full((1, 1), layer, dtype=torch.long, device=kv_all.device)
    kv_BT2HD = torch.stack((k_BTHD, v_BTHD), 2).to(kv_all.dtype)
    kv_all[layer_11, :, slots_B[:, None], :, pos_BT] = kv_BT2HD


class KVCache:
    """k, v: [layers, slots, kv_heads, max_len, head_dim], views of one tensor `kv` [layers, 2,
    slots, kv_heads, max_len, head_dim] (one kernel writes both in compiled code). How a forward
    through the cache computes (set on the instance, or on a view of it, by its owner; read once
    per forward):
    `kernel`, the attention over it (`model.attention.DECODE_KERNELS`); `qkv`, None or per
    layer (q|k|v weights stacked, their biases stacked or None, the three row counts) for one
    projection matmul instead of three, and `gate_up` the same for the MLP's gate|up (one
    matmul instead of two); the owner keeps them equal to the parameters."""

    kernel: str = "auto"
    qkv: list | None = None
    gate_up: list | None = None

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, 2, num_slots, num_kv_heads, max_len, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        # RoPE tables (model.rope.rope_tables) of every position 0..max_len-1, [max_len, 1, D]
        # each, set by `for_model`: a forward through this cache gathers its rows instead of
        # computing them (the same values: each is cos/sin of the same fp32 product)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_model(cls, model: nn.Module, num_slots: int, max_len: int,
                  dtype: torch.dtype | None = None, device=None) -> "KVCache":
        """Sized from the model's *local* k_proj, so a tensor-parallel shard gets its own heads;
        `dtype` None = `cache_dtype` of the model's. The RoPE tables are in the model's dtype
        (that of the activations they rotate), whatever the cache's."""
        args = model.args
        k_proj = model.model.layers[0].self_attn.k_proj.weight
        local = k_proj.to_local() if hasattr(k_proj, "to_local") else k_proj
        kv_heads = local.shape[0] // args.head_dim
        device = torch.device(device or local.device)
        cache = cls(args.num_layers, num_slots, max_len, kv_heads, args.head_dim,
                    dtype or cache_dtype(local.dtype, device), device)
        positions = torch.arange(max_len, device=device)
        cos, sin = rope_tables(*rope_cos_sin(positions, inv_frequencies(args, device), local.dtype))
        cache.rope = (cos, sin)  # [max_len, 1, D]
        return cache

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, slots_B, pos_BT, k_BTHD, v_BTHD) -> None:
        """Scatter new keys/values of rows `slots_B` at positions `pos_BT` (`scatter_kv`; under
        torch.compile `_write_compiled`)."""
        if torch.compiler.is_compiling():
            _write_compiled(self.whole().kv, layer, slots_B, pos_BT, k_BTHD, v_BTHD)
        else:
            scatter_kv(self.k[layer], self.v[layer], slots_B, pos_BT, k_BTHD, v_BTHD)

    def whole(self) -> "KVCache":
        """The cache whose tensors are not views (a view of a cache returns the cache)."""
        return self

    def read(self, layer: int, slots_B=None):
        """Keys/values [B, max_len, H, D] (a view when all slots are read, as in decode)."""
        k, v = self.k[layer], self.v[layer]
        if slots_B is not None:
            k, v = k[slots_B], v[slots_B]
        return k.transpose(1, 2), v.transpose(1, 2)

    def move(self, src_R: torch.Tensor, dst_R: torch.Tensor, length: int) -> None:
        """Copy the keys/values at positions [0, length) of slots `src_R` into slots `dst_R`
        (a source may repeat: one prompt's prefix into several slots)."""
        self.kv[:, :, dst_R, :, :length] = self.kv[:, :, src_R, :, :length]

    def reset(self) -> None:
        self.kv.zero_()
