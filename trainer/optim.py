"""AdamW with warmup + cosine/constant schedule, and gradient clipping that works for any mix of
plain, FSDP2 and TP parameters."""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def build_optimizer(model: torch.nn.Module, tcfg) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=False: with TP, parameters live on different meshes (2-D and 1-D) and the fused
    # multi-tensor kernels refuse to mix them.
    return torch.optim.AdamW(params, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                             weight_decay=tcfg.weight_decay, foreach=False)


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based).

    >>> [round(lr_lambda(s, 2, 10, "cosine", 0.1), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.55, 0.1]
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, tcfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(
        s, tcfg.warmup_steps, tcfg.max_steps, tcfg.schedule, tcfg.min_lr_ratio))


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (a DTensor's norm is reduced over its mesh), then scale
    them so it is at most `max_norm` (0 = no clipping). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.stack([_full(g.detach().norm(2.0)).float() for g in grads]).norm(2.0)
    if max_norm > 0 and torch.isfinite(total):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype) if not isinstance(g, DTensor) else coef.item())
    return total
