"""Attention backends: flash-attn (varlen) on CUDA when importable, else PyTorch SDPA.

All entry points take q as [B, T, Hq, D] and k/v as [B, S, Hkv, D] (the projection layout) and
return [B, T, Hq, D]. Grouped-query attention is handled by the kernels (`enable_gqa`, or
flash-attn's native GQA), never by materialising repeated k/v heads.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_varlen_func = None

BACKENDS = ("auto", "sdpa", "flash")


def flash_missing(device_type: str, dtype: torch.dtype) -> list[str]:
    """What keeps flash-attn from running on this device at this compute dtype (empty: it runs)."""
    return [what for what, ok in (
        ("flash-attn is not installed", flash_attn_varlen_func is not None),
        ("no CUDA device", device_type == "cuda"),
        (f"compute dtype {str(dtype).removeprefix('torch.')}, not fp16/bf16",
         dtype in (torch.float16, torch.bfloat16))) if not ok]


def check_backend(backend: str, device_type: str, dtype: torch.dtype) -> None:
    """At start-up (preflight) and in every packed forward: 'flash' must be able to run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    missing = flash_missing(device_type, dtype)
    if backend == "flash" and missing:
        raise ValueError(f"model.attn_backend='flash' cannot run here ({', '.join(missing)}); set "
                         "--model.attn_backend=auto (flash-attn where it runs, else SDPA) or sdpa")


def use_flash(x: torch.Tensor, backend: str) -> bool:
    """flash-attn runs only on CUDA in half precision; "auto" falls back to SDPA elsewhere. The
    compute dtype is autocast's where it is on (the projections then give q/k/v in it), as
    preflight assumes, else the activations'."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    check_backend(backend, device, dtype)
    return backend != "sdpa" and not flash_missing(device, dtype)


def sdpa(q_BTHD, k_BSHD, v_BSHD, mask_BTS: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA over [B, H, T, D] views. `mask_BTS` is a boolean keep-mask (True = attend).
    On CPU see `_sdpa_cpu`."""
    if not q_BTHD.is_cuda:
        return _sdpa_cpu(q_BTHD, k_BSHD, v_BSHD, mask_BTS, causal)
    return _sdpa_call(q_BTHD, k_BSHD, v_BSHD, mask_BTS, causal)


def _sdpa_call(q_BTHD, k_BSHD, v_BSHD, mask_BTS, causal: bool) -> torch.Tensor:
    """PyTorch's SDPA on the [B, T, H, D] layout, grouped-query heads by `enable_gqa`."""
    q, k, v = (x.transpose(1, 2) for x in (q_BTHD, k_BSHD, v_BSHD))
    mask = None if mask_BTS is None else mask_BTS[:, None]  # broadcast over heads
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _sdpa_cpu(q_BTHD, k_BSHD, v_BSHD, mask_BTS, causal: bool) -> torch.Tensor:
    """CPU attention, returned in v's dtype. Under bf16 autocast (the one-rank trainer's
    `compute_dtype`): two batched bf16 matmuls over grouped heads (`sdpa_grouped`'s "matmul"
    kernel; probabilities rounded to bf16 as in flash attention), because CPU SDPA's own bf16
    backward took 6x its fp32 time (970 vs 160 us at [1, 4, 45, 64] on an AMX Xeon, BENCHMARKS.md);
    the vs_trl trainer's step took 0.94x the time of SDPA in fp32. That forward differs from the
    bf16 generator's anyway (fp32 residual stream): this moved mu - logp by 7% (mean 3.4e-2 ->
    3.6e-2). Otherwise SDPA in fp32, bf16 inputs too: a bf16 forward's attention then matches the
    generator's over its fp32 cache (`kv_cache.cache_dtype`)."""
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
        with torch.autocast("cpu", enabled=False):
            T, S = q_BTHD.shape[1], k_BSHD.shape[1]
            mask = mask_BTS
            if mask is None:
                mask = torch.ones(1, T, S, dtype=torch.bool, device=q_BTHD.device)
                mask = mask.tril() if causal else mask
            q, k, v = (x.to(torch.bfloat16) for x in (q_BTHD, k_BSHD, v_BSHD))
            return sdpa_grouped(q, k, v, mask, None, "matmul").to(v_BSHD.dtype)
    q, k, v = (x.float() for x in (q_BTHD, k_BSHD, v_BSHD))  # no copy where already fp32
    return _sdpa_call(q, k, v, mask_BTS, causal).to(v_BSHD.dtype)


def additive_mask(mask_BTS: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The keep-mask as 0 / -inf to add to scores: made once per forward, it replaces an
    inversion and a masked fill in every layer (`sdpa_grouped` on CPU)."""
    return torch.zeros(mask_BTS.shape, dtype=dtype, device=mask_BTS.device).masked_fill_(
        ~mask_BTS, float("-inf"))


# How a KV-cache forward (decode) attends over the cache (`KVCache.kernel`): "sdpa" (one SDPA
# call over grouped heads with a folded keep-mask), "matmul" (two batched matmuls and a softmax
# with an additive mask), "flex" (FlexAttention with a block mask that skips the cache blocks past
# each row's last query; fast only under torch.compile, which generates its decoding kernel).
# "auto": "sdpa" on CUDA, "matmul" on CPU (BENCHMARKS.md, "Generation" and "GPU").
DECODE_KERNELS = ("auto", "sdpa", "matmul", "flex")
# keys per block of the flex block mask: a row reads its length rounded up to this. FlexAttention's
# default, 128, reads ~25% more keys than live at the 1.1B bench's lengths (128-384): on the H200
# its kernel took 17.7 us a layer there, 16.3 with 64 (BENCHMARKS.md "GPU"); the decoding kernel
# takes blocks as small as its own key tile (it caps the tile at the block)
FLEX_BLOCK = 64


def decode_kernel(kernel: str, device_type: str) -> str:
    """`kernel` with "auto" resolved for this device; an unknown name is refused."""
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"unknown decode attention kernel {kernel!r}; choose one of "
                         f"{DECODE_KERNELS}")
    if kernel == "auto":
        return "sdpa" if device_type == "cuda" else "matmul"
    return kernel


def sdpa_grouped(q_BTHD, k_BSHD, v_BSHD, mask_BTS: torch.Tensor,
                 bias_BTS: torch.Tensor | None = None, kernel: str = "auto") -> torch.Tensor:
    """Masked attention for grouped-query heads without repeating k/v: the G query heads that
    share a kv head are folded into the query axis ([B, Hkv, T*G, D]), so every backend sees
    plain multi-head attention with Hkv heads. For decode (T = 1) the fold is a free view; SDPA's
    `enable_gqa` would instead fall back to kernels that copy k/v G times or ignore the mask.
    `kernel` is "sdpa" or "matmul" (`DECODE_KERNELS`; "auto" by device). `bias_BTS`
    (`additive_mask` of the mask) spares the matmul path making it in every layer.
    A cache kept in another dtype than q (fp32 for a bf16 model on CPU, `kv_cache.cache_dtype`)
    sets the dtype of the computation; the output comes back in q's."""
    B, T, Hq, D = q_BTHD.shape
    S, Hkv = k_BSHD.shape[1], k_BSHD.shape[2]
    G = Hq // Hkv
    q = q_BTHD.to(k_BSHD.dtype)
    # decode: [B, 1, Hkv*G, D] is already [B, Hkv, G, D] in memory (two ops fewer per layer)
    q = q.view(B, Hkv, G, D) if T == 1 else q.view(B, T, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, T * G, D)
    k, v = k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2)
    if decode_kernel(kernel, q.device.type) == "sdpa":  # [B, T, S] -> [B, 1, T*G, S]
        fold = mask_BTS[:, None, :, None, :].expand(B, 1, T, G, S).reshape(B, 1, T * G, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=fold)
    else:  # CPU: two batched matmuls beat SDPA's CPU kernel ~2x at decode sizes (BENCHMARKS.md)
        bias = bias_BTS if bias_BTS is not None else additive_mask(mask_BTS, q.dtype)
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(D ** -0.5)
        # the bias broadcasts over kv heads and the G query heads of each (no folded copy)
        scores.view(B, Hkv, T, G, S).add_(bias[:, None, :, None, :])
        out = torch.matmul(scores.softmax(-1), v)
    out = out.to(q_BTHD.dtype)
    if T == 1:  # reshape: CUDA SDPA's output may follow the strides of a stacked projection's q
        return out.reshape(B, 1, Hq, D)
    return out.view(B, Hkv, T, G, D).transpose(1, 2).reshape(B, T, Hq, D)


def flex_block_mask(positions_BT: torch.Tensor, S: int, window: int | None):
    """FlexAttention's block mask for queries at `positions_BT` over cache keys [0, S): a key at
    or before the query's position (and inside the sliding window). Per row and block of
    FLEX_BLOCK queries, only the key blocks up to its last query's position are listed, so the
    kernel reads no block past a row's length. Pure tensor code (compiled and graph-captured)."""
    from torch.nn.attention.flex_attention import BlockMask
    B, T = positions_BT.shape
    nq, nk = -(-T // FLEX_BLOCK), -(-S // FLEX_BLOCK)
    padded_BT = F.pad(positions_BT, (0, nq * FLEX_BLOCK - T), value=0)
    last_BQ = padded_BT.view(B, nq, FLEX_BLOCK).amax(-1)
    num_B1Q = (last_BQ // FLEX_BLOCK + 1).clamp(max=nk).to(torch.int32)[:, None]
    idx = torch.arange(nk, dtype=torch.int32, device=positions_BT.device).expand(B, 1, nq, nk)

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = positions_BT[b, q_idx]
        keep = kv_idx <= q_pos
        return keep if window is None else keep & (kv_idx > q_pos - window)

    return BlockMask.from_kv_blocks(num_B1Q, idx.contiguous(), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(T, S))


def flex_grouped(q_BTHD, k_BSHD, v_BSHD, block_mask) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] over the cache's k/v [B, S, Hkv, D] with FlexAttention
    (native grouped-query heads; `flex_block_mask`). Computes in the cache's dtype, returns q's."""
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v = (x.transpose(1, 2) for x in (q_BTHD.to(k_BSHD.dtype), k_BSHD, v_BSHD))
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).to(q_BTHD.dtype)


def varlen_flash(q_NHD, k_NHD, v_NHD, cu_seqlens: torch.Tensor, max_len: int,
                 window: int | None, keys: tuple | None = None) -> torch.Tensor:
    """Packed causal attention with flash-attn: no padding, no N x N mask. `keys` (from
    `prefix_keys`) gives sequences that continue a parent their own key sequences, the parent's
    rows then their own; flash-attn aligns a causal mask to the end when keys outnumber queries."""
    win = (-1, -1) if window is None else (window - 1, 0)
    cu_k, max_k = cu_seqlens, max_len
    if keys is not None:
        index_K, cu_k, max_k = keys
        k_NHD, v_NHD = k_NHD[index_K], v_NHD[index_K]
    return flash_attn_varlen_func(q_NHD, k_NHD, v_NHD, cu_seqlens, cu_k, max_len, max_k,
                                  causal=True, window_size=win)


@dataclass
class PackedGroup:
    """Packed sequences attended in one batched SDPA call (`packed_groups`)."""

    rows: torch.Tensor  # [B, n]: the packed index of each row's n tokens (a parent's, then its own)
    keep: torch.Tensor | None  # indices into the B * n output rows that are kept (None: all)
    mask: torch.Tensor | None  # keep-mask [1, n, n] where a sliding window cuts in, else None


def packed_groups(seq_lens: list[int], parents: list[int] | None, window: int | None,
                  device) -> tuple[list[PackedGroup], torch.Tensor]:
    """How packed attention runs without flash-attn: causal SDPA per sequence, O(sum n_i^2)
    work instead of the O(N^2) of a block-diagonal mask over all N tokens. A sequence with a
    parent is attended as parent + itself, and the parent's rows are kept from its first child's
    (a shared prompt costs no call of its own). Sequences of equal total length share a call,
    gathered by one index per tensor: a GRPO group's fixed-length samples have equal lengths, so
    16 samples of 4 prompts take 4 calls. Returns the groups and `order`, the permutation that
    puts their kept rows, concatenated, back in packed order. Made once per forward."""
    parents, starts = parents or [-1] * len(seq_lens), _starts(seq_lens)
    has_child, first_child = set(parents), {}
    by_len: dict[int, list[int]] = {}  # sequences without children, by total length
    for i, (n, p) in enumerate(zip(seq_lens, parents)):
        if i not in has_child:
            first_child.setdefault(p, i)
            by_len.setdefault(n + (seq_lens[p] if p >= 0 else 0), []).append(i)
    groups, dest = [], []
    for n, idx in by_len.items():
        m = torch.tensor([seq_lens[parents[i]] if parents[i] >= 0 else 0 for i in idx])[:, None]
        own = torch.tensor([starts[i] for i in idx])[:, None]
        par = torch.tensor([starts[parents[i]] for i in idx])[:, None]
        c = torch.arange(n)[None]
        rows = torch.where(c < m, par + c, own + c - m)  # [parent's m tokens, own n - m]
        first = torch.tensor([parents[i] >= 0 and first_child[parents[i]] == i for i in idx])
        kept = ((c >= m) | first[:, None]).flatten()
        keep = None if bool(kept.all()) else kept.nonzero().flatten()
        dest.append(rows.flatten() if keep is None else rows.flatten()[keep])
        mask = None
        if window is not None and n > window:
            pos = torch.arange(n)[None]
            mask = causal_mask(pos, pos, window).to(device)  # [1, n, n]: alike for all rows
        groups.append(PackedGroup(rows.to(device), None if keep is None else keep.to(device), mask))
    return groups, torch.argsort(torch.cat(dest)).to(device)


def prefix_keys(seq_lens: list[int], parents: list[int], device) -> tuple:
    """Key layout of packed sequences with parents (`Transformer` mode (b)): for each sequence
    its parent's token rows then its own, as one gather index [K]; their int32 cumulative
    lengths [S + 1]; and the longest key sequence."""
    starts, rows, lens = _starts(seq_lens), [], []
    for i, (n, p) in enumerate(zip(seq_lens, parents)):
        if p >= 0:
            rows.append(torch.arange(starts[p], starts[p] + seq_lens[p]))
        rows.append(torch.arange(starts[i], starts[i] + n))
        lens.append(n + (seq_lens[p] if p >= 0 else 0))
    cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)
    return torch.cat(rows).to(device), cu.to(device), max(lens)


def _starts(seq_lens: list[int]) -> list[int]:
    """Where each packed sequence begins."""
    return list(itertools.accumulate(seq_lens[:-1], initial=0))


def causal_mask(q_pos_BT: torch.Tensor, k_pos_BS: torch.Tensor, window: int | None,
                q_seq_BT: torch.Tensor | None = None, k_seq_BS: torch.Tensor | None = None):
    """Keep-mask [B, T, S]: key position <= query position (and inside the sliding window,
    and in the same packed sequence when sequence ids are given)."""
    qp, kp = q_pos_BT[:, :, None], k_pos_BS[:, None, :]
    keep = kp <= qp
    if window is not None:
        keep &= kp > qp - window
    if q_seq_BT is not None:
        keep &= q_seq_BT[:, :, None] == k_seq_BS[:, None, :]
    return keep
