"""AdamW with warmup + cosine/constant schedule, and gradient clipping that works for any mix of
plain, FSDP2 and TP parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
    opt = torch.optim.AdamW(params, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                            weight_decay=0.0, **({"fused": True} if multi else {"foreach": False}))
    matrices, wd = [p for p in params if p.ndim >= 2], tcfg.weight_decay
    if wd and matrices:
        opt.register_step_pre_hook(lambda o, args, kwargs: decay_weights(o, matrices, wd))
    return opt


def decay_weights(opt: torch.optim.Optimizer, matrices: list, weight_decay: float) -> None:
    """AdamW's decoupled weight decay, p <- p (1 - lr wd), on the weight matrices only (embeddings
    and the head included), as HF Trainer and TRL do: norm gains and biases are not decayed (a
    decayed RMSNorm gain pulls its layer's output towards zero). Applied before the step, as
    AdamW applies it, to the parameters the step updates (those with a gradient); one parameter
    group, so checkpoints keep their layout."""
    lr = opt.param_groups[0]["lr"]
    with torch.no_grad():
        for p in matrices:
            if p.grad is not None:
                p.mul_(1 - lr * weight_decay)


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float,
              resumed_at: tuple[int, float] | None = None) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based); `resumed_at`: see
    `cosine_progress`.

    >>> [round(lr_lambda(s, 2, 10, "cosine", 0.1), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.55, 0.1]
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = cosine_progress(step, warmup, total, resumed_at)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def cosine_progress(step: int, warmup: int, total: int,
                    resumed_at: tuple[int, float] | None = None) -> float:
    """How far the cosine decay is at `step`, in [0, 1]: from 0 at the end of the warm-up to 1 at
    `total`. A schedule resumed with another total (`continue_schedule`) goes on from where it
    was, `resumed_at = (step s0, progress p0)`, to 1 at the new total: the rest of the same curve,
    stretched or squeezed, so the lr neither jumps nor changes the way it falls.

    >>> cosine_progress(6, 2, 10), cosine_progress(10, 2, 14, resumed_at=(6, 0.5))
    (0.5, 0.75)
    """
    if resumed_at is None:
        return min(1.0, (step - warmup) / max(1, total - warmup))
    s0, p0 = resumed_at
    return min(1.0, p0 + (1 - p0) * ((step - s0) / max(1, total - s0)))


@dataclass
class Schedule:
    """The trainer's lr multiplier as a function of the optimizer step (`lr_lambda`). A callable
    object, not a lambda, so that LambdaLR saves its fields in its state: a resume then knows the
    total the checkpoint's schedule ran to."""
    warmup: int
    total: int
    kind: str  # trainer.schedule
    min_ratio: float
    resumed_at: tuple[int, float] | None = None  # see cosine_progress

    def __post_init__(self):
        if self.resumed_at is not None:  # a list after a JSON checkpoint
            self.resumed_at = (int(self.resumed_at[0]), float(self.resumed_at[1]))

    def __call__(self, step: int) -> float:
        return lr_lambda(step, self.warmup, self.total, self.kind, self.min_ratio, self.resumed_at)


def continue_schedule(saved: Schedule, now: Schedule, step: int) -> tuple[Schedule, str | None]:
    """The schedule a run resumed at optimizer step `step` goes on with, and a line saying what
    changed (None: nothing). `now` is the config's, `saved` the checkpoint's; only the total
    (trainer.max_steps) is taken from the checkpoint, and only to go on from there.

    A cosine recomputed for a raised max_steps put a run that had ended at min_lr_ratio back
    near the peak (as HF Trainer and torchtitan do; torchtitan's scheduler notes it is safe only
    with the steps unchanged): an RL policy that converged at a small lr then takes large steps
    again. Here the decay goes on from its point to the new end instead (`cosine_progress`); a
    run that had ended stays at the floor, as a schedule that runs past its end does.

    >>> s, _ = continue_schedule(Schedule(0, 10, "cosine", 0.1), Schedule(0, 20, "cosine", 0.1),
    ...                          step=10)
    >>> [round(s(k), 3) for k in (10, 15, 20)]    # recomputed: 0.55 at step 10, then down again
    [0.1, 0.1, 0.1]
    """
    if (saved.total, saved.kind, saved.warmup) == (now.total, now.kind, now.warmup):
        return replace(now, resumed_at=saved.resumed_at), None
    if step <= saved.warmup:
        return now, None  # nothing decayed yet: the config's schedule as it is
    # A longer warm-up in the config does not start again (nor does a changed one, with the same
    # total, move the cosine: it went back up from 0.63 x to 0.94 x, or into a new warm-up).
    warmup = min(now.warmup, saved.warmup)
    if now.kind == "constant":
        return replace(now, warmup=warmup), None  # nothing to decay
    # where the run's own curve (the checkpoint's kind, warm-up and total) was; a constant lr
    # starts its decay here
    progress = (0.0 if saved.kind == "constant" else
                cosine_progress(step, saved.warmup, saved.total, saved.resumed_at))
    new = replace(now, warmup=warmup, resumed_at=(step, progress))
    return new, _resume_line(saved, new, now, step)


def _resume_line(old: Schedule, new: Schedule, now: Schedule, step: int) -> str:
    """What `continue_schedule` did (`new`), against what the config's schedule (`now`),
    recomputed, would have done."""
    how = (f"it had ended, so the lr stays at min_lr_ratio={new.min_ratio} x trainer.lr"
           if new.resumed_at[1] >= 1 else
           f"from {old(step):.4g} x trainer.lr at optimizer step {step} down to "
           f"min_lr_ratio={new.min_ratio} x at step {new.total}")
    what = (f"trainer.schedule changed from {old.kind!r} (the checkpoint's) to {new.kind!r}"
            if old.kind != new.kind else
            f"trainer.max_steps changed from {old.total} (the checkpoint's) to {new.total}"
            if old.total != new.total else
            f"trainer.warmup_steps changed from {old.warmup} (the checkpoint's) to {now.warmup}")
    return (f"{what}: the cosine lr schedule continues where it was: {how} (recomputed for "
            f"{new.total} steps it would have moved to {now(step):.4g} x at once); for a new "
            "schedule, start a new --run.dir from an HF export of this run")


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR over a `Schedule`; loading a checkpoint's state with another trainer.max_steps
    goes on smoothly (`continue_schedule`) and leaves the line to print in `resume_note`."""

    def __init__(self, opt: torch.optim.Optimizer, schedule: Schedule):
        super().__init__(opt, schedule)
        self.resume_note: str | None = None

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("resume_note", None)  # this process's, not the run's
        return state

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state; one saved by a plain LambdaLR (no schedule in it) takes the
        config's schedule as it is, as before."""
        saved = state["lr_lambdas"]
        super().load_state_dict({**state, "lr_lambdas": [None] * len(saved)})
        self.resume_note = None
        for i, fn in enumerate(saved):  # one per parameter group, all alike
            if fn is not None:
                self.lr_lambdas[i], note = continue_schedule(Schedule(**fn), self.lr_lambdas[i],
                                                             self.last_epoch)
                self.resume_note = note or self.resume_note


def build_scheduler(opt: torch.optim.Optimizer, tcfg) -> LRSchedule:
    return LRSchedule(opt, Schedule(tcfg.warmup_steps, tcfg.max_steps, tcfg.schedule,
                                    tcfg.min_lr_ratio))


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
