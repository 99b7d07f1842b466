"""Group baselines: each prompt's n samples are scored against each other (no value network)."""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvantageKind = Literal["group_mean", "grpo", "rloo"]


def group_advantages(rewards_GN: Tensor, kind: AdvantageKind = "group_mean",
                     eps: float = 1e-6) -> Tensor:
    """Advantages [G, n] from rewards [G, n] (G prompts, n samples each).

    - "group_mean" (LlamaRL / AIPO): `A = r - mean(r_group)`.
    - "grpo": `(r - mean) / (std + eps)` with the POPULATION std (divide by n). The sample std
      (n - 1) differs by the constant sqrt(n / (n-1)), i.e. only a learning-rate rescale, and the
      population std is defined for n = 1.
    - "rloo": `r_i - mean_{j != i} r_j`, which equals `n / (n-1) * (r_i - mean)`; 0 when n = 1.

    A group whose rewards are all equal carries no signal: its advantages are exactly 0 for every
    kind (never NaN, and no float residue such as 0.3 - mean([0.3] * 3) = 3e-8 leaking through
    the std division).

    >>> r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    >>> group_advantages(r, "group_mean")
    tensor([[ 0.5000, -0.5000, -0.5000,  0.5000],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    >>> group_advantages(r, "grpo")          # population std of [1, 0, 0, 1] is 0.5
    tensor([[ 1.0000, -1.0000, -1.0000,  1.0000],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    >>> group_advantages(r, "rloo")          # 1 - mean(0, 0, 1) = 2/3
    tensor([[ 0.6667, -0.6667, -0.6667,  0.6667],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    if rewards_GN.dim() != 2:
        raise ValueError(f"rewards_GN must be [G, n], got shape {tuple(rewards_GN.shape)}")
    if kind not in ("group_mean", "grpo", "rloo"):
        raise ValueError(f"unknown advantage kind {kind!r}; use 'group_mean', 'grpo' or 'rloo'")
    r_GN = rewards_GN.float()
    n = r_GN.shape[1]
    constant_G1 = (r_GN.amax(1, keepdim=True) == r_GN.amin(1, keepdim=True))   # no signal
    centered_GN = torch.where(constant_G1, 0.0, r_GN - r_GN.mean(1, keepdim=True))
    if kind == "group_mean":
        return centered_GN
    if kind == "grpo":
        std_G1 = r_GN.std(1, keepdim=True, correction=0)
        # a constant group's std is 0: with eps = 0 its zeros became 0 / 0 = NaN
        return torch.where(constant_G1, 0.0, centered_GN / (std_G1 + eps))
    if n == 1:
        return torch.zeros_like(r_GN)
    return centered_GN * (n / (n - 1))
