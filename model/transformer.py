"""One decoder-only transformer for Llama 2/3, Mistral, Qwen2/2.5 and Qwen3.

Module names mirror Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`, ...), so a
state dict maps 1:1 onto safetensors keys and tensor-parallel plans can be keyed by the same names.

Three forward modes share every weight and every line of layer code; only the attention context
(`_Context`) differs:
  (a) plain causal:  model(input_ids[B, T]) -> logits[B, T, V]
  (b) packed varlen: model(input_ids[N], seq_lens=[S]) -> logits[N, V]; sequences are concatenated
      without padding and attend only within themselves (padding-free training). With
      `seq_parents=[S]` a sequence may continue another one packed before it (a shared prompt,
      computed once for a GRPO group): it attends to its parent's tokens, then its own, and its
      positions go on from the parent's length, exactly as if the parent were written before it
  (c) static KV cache: model(input_ids[B, T], positions=[B, T], kv_cache=cache, slots=[B]) writes
      the new keys/values of row b into cache slot slots[b] at positions[b] and attends to every
      cached key at a position <= the query's (generation; rows may be at different lengths)
Tensor parallelism is applied from outside (parallel/): heads are inferred from the local weight
sizes with `view(b, t, -1, head_dim)`, so a sharded q_proj simply yields fewer local heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model import attention as attn
from model.args import ModelArgs
from model.kv_cache import KVCache
from model.rope import apply_rope, inv_frequencies, rope_cos_sin, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, cast back before the weight, as the HF reference does. `F.rms_norm`
        # gives the reference's bits (x * rsqrt(mean(x^2) + eps)) in one call instead of six: a
        # decode step makes nine of these (tests/test_model.py checks the bits).
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


@dataclass
class _Context:
    """Everything attention needs besides q/k/v, computed once per forward."""

    cos: torch.Tensor  # rope_tables: [B, T, 1, head_dim]
    sin: torch.Tensor  # the same, first half negated
    mask: torch.Tensor | None = None  # keep-mask [B, T, S] or None for plain causal
    bias: torch.Tensor | None = None  # the KV-cache mask as 0 / -inf, for the matmul kernel
    kernel: str = "auto"  # KV-cache attention: attn.DECODE_KERNELS, resolved for the device
    block_mask: object = None  # the flex kernel's attn.flex_block_mask
    qkv: list | None = None  # KVCache.qkv: per layer (stacked q|k|v weight, bias, sizes)
    gate_up: list | None = None  # KVCache.gate_up: the same for the MLP's gate|up
    kv_cache: KVCache | None = None
    slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None  # set only for the flash-attn varlen path
    max_len: int = 0
    groups: list | None = None  # packed without flash-attn: attn.packed_groups's calls
    order: torch.Tensor | None = None  # and the permutation back to packed order
    keys: tuple | None = None  # with `cu_seqlens` and parents: attn.prefix_keys's key layout
    window: int | None = None
    backend: str = "auto"

    def attend(self, layer: int | None, q, k, v) -> torch.Tensor:
        if self.kv_cache is not None:
            self.kv_cache.write(layer, self._slots(q), self.positions, k, v)
            k, v = self.kv_cache.read(layer, self.slots)
            if self.block_mask is not None:
                return attn.flex_grouped(q, k, v, self.block_mask)
            return attn.sdpa_grouped(q, k, v, self.mask, self.bias, self.kernel)
        if self.cu_seqlens is not None or self.groups is not None:
            return self._packed(q, k, v)
        return attn.sdpa(q, k, v, self.mask, causal=True)

    # Left out of compiled code (`parallel.compile`): the sequence lengths are Python ints, so a
    # compiled layer would specialise on every batch's packing and recompile each step, until
    # dynamo's recompile limit silently sent it back to eager. The compiled regions before and
    # after this call see only the token count, which becomes a symbolic size.
    @torch.compiler.disable
    def _packed(self, q, k, v) -> torch.Tensor:
        if self.cu_seqlens is not None:
            out = attn.varlen_flash(q[0], k[0], v[0], self.cu_seqlens, self.max_len, self.window,
                                    self.keys)
            return out[None]
        return self._per_sequence(q, k, v)

    def _per_sequence(self, q, k, v) -> torch.Tensor:
        """Packed attention without flash-attn, as `attn.packed_groups` laid it out."""
        outs = []
        for g in self.groups:  # index_select, not x[rows]: its backward is an index_add, not an
            # accumulating index_put (one gather's forward and backward 0.45x the time)
            q_, k_, v_ = (x[0].index_select(0, g.rows.flatten()).unflatten(0, g.rows.shape)
                          for x in (q, k, v))  # [B, n, H, D]
            out = attn.sdpa(q_, k_, v_, g.mask, causal=True).flatten(0, 1)
            outs.append(out if g.keep is None else out.index_select(0, g.keep))
        return _batch(outs).index_select(0, self.order)[None]

    def _slots(self, q):
        if self.slots is not None:
            return self.slots
        return torch.arange(q.shape[0], device=q.device)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        h, d, b = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=b)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=b)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=b)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=args.o_proj_bias)
        if args.qk_norm:  # Qwen3: RMSNorm over head_dim, before rope
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.head_dim, self.layer, self.qk_norm = d, layer, args.qk_norm

    def forward(self, x_BTC: torch.Tensor, ctx: _Context) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        # -1: the number of *local* heads, so a TP-sharded projection just works.
        if ctx.qkv is None:
            q, k, v = (p(x_BTC).view(B, T, -1, self.head_dim)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
        else:  # one matmul over the three weights stacked (KVCache.qkv), split as views
            w, b, sizes = ctx.qkv[self.layer]
            qkv = F.linear(x_BTC, w, b).split(sizes, -1)
            q, k, v = (y.view(B, T, -1, self.head_dim) for y in qkv)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        # The layer index picks a KV cache's layer only. Read in every forward, it made dynamo
        # specialise a compiled attention block on it (`parallel.compile`): one graph a layer,
        # and past its recompile limit (8) the other layers' attention blocks ran eager.
        layer = self.layer if ctx.kv_cache is not None else None
        out = ctx.attend(layer, q, k, v)  # [B, T, H_local, D]
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: SiLU only (ModelArgs.from_hf_config refuses any other hidden_act)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x, gate_up: tuple | None = None):
        """`gate_up`: (gate|up weights stacked, None, sizes) for one matmul instead of two."""
        if gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        w, _, sizes = gate_up
        gate, up = F.linear(x, w).split(sizes, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: _Context) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        gate_up = None if ctx.gate_up is None else ctx.gate_up[self.self_attn.layer]
        return x + self.mlp(self.post_attention_layernorm(x), gate_up)


class Backbone(nn.Module):
    """Named `model` inside `Transformer`, as in HF checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.attn_backend = "auto"
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head (also needed again after `to_empty`)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init after meta-device construction + `to_empty` (normal weights, unit norms)."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.model.embed_tokens.weight.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                seq_lens: torch.Tensor | None = None, seq_parents: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, slots: torch.Tensor | None = None,
                logits_tokens: int | None = None) -> torch.Tensor:
        """Logits for every input token; see the module docstring for the three modes. Packed,
        `logits_tokens` = n: for the first n tokens only (the rest are padding nobody reads)."""
        h = self.hidden_states(input_ids, positions=positions, seq_lens=seq_lens,
                               seq_parents=seq_parents, kv_cache=kv_cache, slots=slots)
        return self.lm_head(h if logits_tokens is None else h[:logits_tokens])

    def hidden_states(self, input_ids, *, positions=None, seq_lens=None, seq_parents=None,
                      kv_cache=None, slots=None) -> torch.Tensor:
        """Final-norm hidden states, same shape convention as `forward` without the vocab dim."""
        packed = seq_lens is not None
        ids_BT = input_ids.reshape(1, -1) if packed else input_ids
        x = self.model.embed_tokens(ids_BT)
        ctx = self._context(ids_BT, x, positions, seq_lens, kv_cache, slots, seq_parents)
        for layer in self.model.layers:
            x = layer(x, ctx)
        x = self.model.norm(x)
        return x.reshape(*input_ids.shape, -1) if packed else x

    def _context(self, ids_BT, x, positions, seq_lens, kv_cache, slots, seq_parents) -> _Context:
        B, T = ids_BT.shape
        dev, window = ids_BT.device, self.args.sliding_window
        seq_ids, default_positions, parents = None, positions is None, None
        if seq_lens is not None:
            parents = check_parents(seq_parents, len(seq_lens))
            seq_ids, positions = packed_positions(seq_lens.to(dev), T, parents)
        elif positions is None:
            if kv_cache is not None:
                raise ValueError("a KV-cache forward needs explicit `positions` [B, T]")
            positions = torch.arange(T, device=dev).expand(B, T)
        if kv_cache is not None and kv_cache.rope is not None and kv_cache.rope[0].dtype == x.dtype:
            cos, sin = (table[positions] for table in kv_cache.rope)  # [B, T, 1, D]
        else:
            cos, sin = rope_tables(*rope_cos_sin(positions, inv_frequencies(self.args, dev), x.dtype))
        ctx = _Context(cos, sin, window=window, backend=self.attn_backend)
        if kv_cache is not None:
            ctx.kv_cache, ctx.slots, ctx.positions = kv_cache, slots, positions
            ctx.kernel = attn.decode_kernel(kv_cache.kernel, dev.type)
            ctx.qkv, ctx.gate_up = kv_cache.qkv, kv_cache.gate_up
            if ctx.kernel == "flex":
                ctx.block_mask = attn.flex_block_mask(positions, kv_cache.max_len, window)
            else:
                keys = torch.arange(kv_cache.max_len, device=dev).expand(B, -1)
                ctx.mask = attn.causal_mask(positions, keys, window)
                if ctx.kernel == "matmul":
                    ctx.bias = attn.additive_mask(ctx.mask, kv_cache.k.dtype)
        elif seq_ids is not None and attn.use_flash(x, self.attn_backend):
            ctx.cu_seqlens = F.pad(seq_lens.to(dev).cumsum(0), (1, 0)).to(torch.int32)
            ctx.max_len = int(seq_lens.max())
            if parents is not None:
                ctx.keys = attn.prefix_keys(seq_lens.tolist(), parents, dev)
        elif seq_ids is not None:
            ctx.groups, ctx.order = attn.packed_groups(seq_lens.tolist(), parents, window, dev)
        elif not default_positions or (window is not None and T > window):
            ctx.mask = attn.causal_mask(positions, positions, window)
        return ctx


def _batch(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def check_parents(seq_parents, num_seqs: int) -> list[int] | None:
    """`seq_parents` as a list, or None where no sequence has a parent. A parent comes earlier
    in the pack and has no parent itself (one shared prefix deep)."""
    if seq_parents is None:
        return None
    parents = seq_parents.tolist() if torch.is_tensor(seq_parents) else list(seq_parents)
    if len(parents) != num_seqs:
        raise ValueError(f"seq_parents has {len(parents)} entries for {num_seqs} sequences; "
                         "give one per sequence (-1: no parent)")
    for i, p in enumerate(parents):
        if not -1 <= p < i or (p >= 0 and parents[p] != -1):
            raise ValueError(f"seq_parents[{i}] = {p}: a parent must be -1 or an earlier "
                             "sequence that has no parent itself")
    return parents if any(p >= 0 for p in parents) else None


def packed_positions(seq_lens_S: torch.Tensor, total: int, parents: list[int] | None = None):
    """Sequence id and position-within-sequence of every packed token, both [1, N]; a sequence
    with a parent goes on from the parent's length."""
    if int(seq_lens_S.sum()) != total:
        raise ValueError(f"seq_lens sum to {int(seq_lens_S.sum())} but {total} tokens were given")
    seq_N = torch.repeat_interleave(torch.arange(len(seq_lens_S), device=seq_lens_S.device), seq_lens_S)
    starts_S = seq_lens_S.cumsum(0) - seq_lens_S
    pos_N = torch.arange(total, device=seq_lens_S.device) - starts_S[seq_N]
    if parents is not None:
        lens = seq_lens_S.tolist()
        offset_S = torch.tensor([lens[p] if p >= 0 else 0 for p in parents], device=pos_N.device)
        pos_N = pos_N + offset_S[seq_N]
    return seq_N, pos_N[None]

