"""Attention backends: flash-attn (varlen) on CUDA when importable, else PyTorch SDPA.

All entry points take q as [B, T, Hq, D] and k/v as [B, S, Hkv, D] (the projection layout) and
return [B, T, Hq, D]. Grouped-query attention is handled by the kernels (`enable_gqa`, or
flash-attn's native GQA), never by materialising repeated k/v heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func  # type: ignore
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_varlen_func = None

BACKENDS = ("auto", "sdpa", "flash")


def use_flash(x: torch.Tensor, backend: str) -> bool:
    """flash-attn runs only on CUDA in half precision; "auto" falls back to SDPA elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    ok = flash_attn_varlen_func is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
    if backend == "flash" and not ok:
        raise ValueError("attn_backend='flash' needs flash-attn installed and CUDA fp16/bf16 tensors; "
                         "use attn_backend='auto' to fall back to SDPA")
    return ok and backend != "sdpa"


def sdpa(q_BTHD, k_BSHD, v_BSHD, mask_BTS: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA over [B, H, T, D] views. `mask_BTS` is a boolean keep-mask (True = attend)."""
    q, k, v = (x.transpose(1, 2) for x in (q_BTHD, k_BSHD, v_BSHD))
    mask = None if mask_BTS is None else mask_BTS[:, None]  # broadcast over heads
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def varlen_flash(q_NHD, k_NHD, v_NHD, cu_seqlens: torch.Tensor, max_len: int,
                 window: int | None) -> torch.Tensor:
    """Packed causal attention with flash-attn: no padding, no N x N mask."""
    win = (-1, -1) if window is None else (window - 1, 0)
    return flash_attn_varlen_func(q_NHD, k_NHD, v_NHD, cu_seqlens, cu_seqlens, max_len, max_len,
                                  causal=True, window_size=win)


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
