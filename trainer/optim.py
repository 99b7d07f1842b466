"""AdamW with warmup + cosine/constant schedule, and gradient clipping that works for any mix of
plain, FSDP2 and TP parameters."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def build_optimizer(model: torch.nn.Module, tcfg) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel (one pass over each parameter's state) where every parameter is plain or
    # all share one mesh (FSDP): on CPU 3.7x faster than the multi-tensor (foreach) one for
    # SmolLM2-135M, 0.19 against 0.72 s a step (BENCHMARKS.md, "Against TRL"). With TP,
    # parameters live on different meshes (2-D and 1-D) or are plain beside DTensors, and the
    # multi-tensor kernels refuse to mix them: one parameter at a time there.
    meshes = {id(p.device_mesh) for p in params if isinstance(p, DTensor)}
    plain = any(not isinstance(p, DTensor) for p in params)
    multi = len(meshes) == 0 or (len(meshes) == 1 and not plain)
    return torch.optim.AdamW(params, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                             weight_decay=tcfg.weight_decay,
                             **({"fused": True} if multi else {"foreach": False}))


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


@torch.no_grad()
def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients with every element counted once, in one reduction per mesh
    dimension instead of one per tensor: per DTensor mesh, the local shards' sums of squares,
    each divided by the product of the mesh dims that replicate it, are summed over the mesh.
    Plain tensors (and Partial DTensors, made whole first) count as they are on every rank."""
    meshes: dict[int, tuple] = {}
    whole = []
    for g in grads:
        if isinstance(g, DTensor) and not any(p.is_partial() for p in g.placements):
            meshes.setdefault(id(g.device_mesh), (g.device_mesh, []))[1].append(g)
        else:
            whole.append(g.full_tensor() if isinstance(g, DTensor) else g)
    device = (whole[0] if whole else grads[0].to_local()).device
    total = _sum_of_squares(whole, [1] * len(whole), device)
    for mesh, gs in meshes.values():
        reps = [math.prod(mesh.size(i) for i, p in enumerate(g.placements) if p.is_replicate())
                for g in gs]
        sq = _sum_of_squares([g.to_local() for g in gs], reps, device)
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq
    return total.sqrt()


def _sum_of_squares(tensors: list[torch.Tensor], reps: list[int], device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors, 2.0)])
    weights = torch.tensor([1.0 / r for r in reps], device=norms.device)
    return (norms.square() * weights).sum()


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (see global_grad_norm), then scale them so it is at most
    `max_norm` (0 = no clipping). Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = global_grad_norm(grads)
    if max_norm > 0 and torch.isfinite(total):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:  # the local shard in place: the same scaling of every element
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.dtype))
    return total
