"""One trainer step over this data-parallel rank's prompt groups.

Loss normalisation: every micro-batch's token-summed loss is divided by the GLOBAL number of loss
tokens of its update (all micro-batches of all data-parallel ranks; one update per step unless
trainer.updates_per_step says more), and FSDP sums gradients, so gradient accumulation and data
parallelism give exactly the gradient of one big batch.
FSDP runs collectives in every forward/backward, so all data-parallel ranks run the same number of
micro-batches; a rank with fewer pads with a zero-weighted copy of one of its own micro-batches.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from trainer import losses
from trainer.advantages import group_advantages
from trainer.batch import (Group, PackedBatch, flatten_groups, pack, packed_tokens, prompt_units,
                           rewards_GN, token_budget_bins)
from trainer.metrics import gather_rows
from trainer.optim import clip_grad_norm


@dataclass
class StepResult:
    stats: dict  # summed over this rank's tokens (reduce across dp ranks before dividing)
    grad_norm: float
    skipped: bool  # non-finite loss or gradient norm: no update of the step was applied
    lr: float  # the learning rate of this step's update (read before the scheduler steps)


class NonFiniteGuard:
    """Counts skipped (non-finite) steps; K in a row abort the run with a clear message."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, 0

    def check(self, res: StepResult) -> None:
        if not res.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(
                f"{self.in_a_row} trainer steps in a row had a non-finite loss or gradient norm "
                f"(last grad norm {res.grad_norm}); lower trainer.lr, check the data, or raise "
                f"trainer.max_nonfinite_steps")


def micro_batches(groups: list[Group], adv_kind: str, max_tokens: int,
                  share_prompts: bool = False) -> list[PackedBatch]:
    """Advantages per group (group integrity), then packed micro-batches by token budget: the
    samples of a prompt stay together where they fit (`prompt_units`), so that they share it."""
    if not groups:
        return []
    adv_GN = group_advantages(rewards_GN(groups), adv_kind)  # [G, n]
    trajs = flatten_groups(groups)
    adv = adv_GN.flatten().tolist()
    units = prompt_units(trajs, share_prompts, max_tokens)
    bins = [[i for u in b for i in units[u]] for b in
            token_budget_bins([packed_tokens(trajs, u) for u in units], max_tokens)]
    return [pack([trajs[i] for i in b], [adv[i] for i in b], share_prompts) for b in bins]


def _logits(model, batch: PackedBatch) -> torch.Tensor:
    """The batch's logits [N, V]. A model compiled for static token counts (`model.token_bucket`,
    `parallel.sharding.apply_compile`) runs the batch with one more sequence of padding, up to
    the next multiple of the bucket, through the layers only (nothing attends across sequences;
    the LM head computes the batch's n tokens)."""
    ids, lens, parents = batch.input_ids_N, batch.seq_lens_S, batch.seq_parents_S
    n, bucket = ids.numel(), getattr(model, "token_bucket", None)
    pad = -n % bucket if bucket else 0
    cut = {}
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        lens = torch.cat([lens, lens.new_tensor([pad])])
        parents = torch.cat([parents, parents.new_tensor([-1])])
        cut = {"logits_tokens": n}
    with _autocast(model):
        return model(ids, seq_lens=lens, seq_parents=parents, **cut)


def policy_logp(model, batch: PackedBatch, temperature: float):
    """Token log-probs of a batch under the trainer's forward and its autocast rule: a reference
    or proximal forward, or the comparison with mu in bench/logprob_mismatch.py."""
    return losses.token_logprobs(_logits(model, batch), batch.targets_N, temperature)


@torch.no_grad()
def reference_logp(ref_model, batch: PackedBatch, temperature: float):
    """The frozen KL reference's token log-probs. One FSDP2 unit for the whole model
    (`parallel.fsdp_units` = "model") is not resharded after its forward (the trainer's backward
    does that), and the reference has no backward: it would keep a whole unsharded copy on every
    rank for the rest of the run, where the memory plan counts a 1/fsdp shard (an 8B fp32
    reference: 32 GB a GPU). Resharded after each forward instead: one gather per micro-batch."""
    logp = policy_logp(ref_model, batch, temperature)
    if getattr(ref_model, "fsdp_units", None) == "model":
        ref_model.reshard()
    return logp


def trainer_temperature(temperature: float) -> float:
    """The temperature of the trainer's log-probs: the generator's, and 1 where it samples
    greedily at temperature 0 (the T its mu was recorded at: rollout/sampling.py)."""
    return temperature if temperature > 0 else 1.0


def _autocast(model):
    """The forward's compute dtype when it differs from the parameters' and FSDP does not cast
    them (`parallel.sharding.parallelize_trainer`); token log-probs are taken in fp32 after it."""
    dtype = getattr(model, "autocast_dtype", None)
    if dtype is None:
        return nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


def _loss(acfg, logp, batch: PackedBatch, logp_prox=None) -> losses.LossOutput:
    """`logp_prox`: the policy before the step's first update (`_Update.prox`); None where this
    is the step's only update, whose forward gives those same values (`logp.detach()`)."""
    m, mu, adv = batch.loss_mask_N, batch.logp_mu_N, batch.adv_N
    prox = logp.detach() if logp_prox is None else logp_prox
    if acfg.loss == "aipo":
        return losses.aipo_loss(logp, mu, adv, m, rho=acfg.rho)
    dual = acfg.dual_clip_c
    if acfg.loss == "decoupled_ppo":
        return losses.decoupled_ppo_loss(logp, prox, mu, adv, m, eps=acfg.clip_eps,
                                         prox_cap=acfg.prox_cap, dual_clip_c=dual)
    if acfg.token_is == "none":  # naive PPO: the generator's mu is pi_old
        return losses.ppo_clip_loss(logp, mu, adv, m, eps=acfg.clip_eps, dual_clip_c=dual)
    # Token IS (verl's TIS): the weight pi_old/mu corrects the generator's samples to pi_old, the
    # policy before the step's updates, and the clip works on pi/pi_old. Clipping around mu as
    # well counted pi/mu twice: (pi/mu)^2 in the gradient.
    weight = losses.token_is(prox, mu, acfg.token_is, acfg.token_is_cap)
    capped = (prox.detach() - mu).exp() > acfg.token_is_cap  # truncated or masked
    return losses.ppo_clip_loss(logp, prox, adv, m, eps=acfg.clip_eps, is_weight_N=weight,
                                dual_clip_c=dual, truncated_N=capped)


def needs_prox(acfg) -> bool:
    """Whether `algo` section `acfg`'s loss reads pi_prox, the policy before a step's first
    update (`_loss`): decoupled PPO, and PPO with token IS."""
    return acfg.loss == "decoupled_ppo" or (acfg.loss == "ppo" and acfg.token_is != "none")


@dataclass
class _Update:
    """One optimizer update's micro-batches on this rank, and what all ranks agreed on."""

    batches: list[PackedBatch]
    n_micro: int  # the most micro-batches of any rank: the others pad (FSDP's collectives)
    global_tokens: int  # loss tokens of this update on all data-parallel ranks
    prox: list | None = None  # per micro-batch, pi_prox (`_loss`); None: not needed


def minibatches(groups: list[Group], updates: int, shard: tuple[int, int] = (0, 1)) -> list[list[Group]]:
    """The step's groups in `updates` contiguous parts, as even as whole groups allow, then each
    part dealt out over the `shard = (rank, ranks)` data-parallel ranks: the updates are the same
    whatever the layout (split per rank first, 6 groups on 2 ranks made updates of 2 and 4)."""
    n, (rank, ranks) = len(groups), shard
    return [groups[u * n // updates:(u + 1) * n // updates][rank::ranks] for u in range(updates)]


def _plan_updates(groups, cfg, dp_group, device, shard) -> list[_Update]:
    """Micro-batches per update (trainer.updates_per_step), and one gather of every rank's
    counts: each update runs as many micro-batches as the busiest rank's and is normalised by
    the tokens of all ranks."""
    tcfg, acfg = cfg.trainer, cfg.algo
    parts = [[b.to(device) for b in micro_batches(g, acfg.advantage, tcfg.micro_batch_tokens,
                                                  tcfg.share_prompts)]
             for g in minibatches(groups, tcfg.updates_per_step, shard)]
    counts = torch.tensor([x for bs in parts for x in (len(bs), sum(int(b.loss_mask_N.sum())
                                                                    for b in bs))])
    rows = gather_rows(counts, dp_group).view(-1, len(parts), 2)  # [ranks, updates, 2]
    empty = rows[:, :, 0].eq(0).any(1)
    if bool(empty.any()):  # on every rank: one that went on would wait in FSDP's gathers
        raise ValueError(f"trainer ranks {empty.nonzero().flatten().tolist()} of the data-parallel "
                         "group got no samples for an update; raise trainer.prompts_per_step to at "
                         "least parallel.trainer_fsdp x trainer.updates_per_step")
    return [_Update(bs, int(rows[:, u, 0].max()), int(rows[:, u, 1].sum()))
            for u, bs in enumerate(parts)]


def train_step(model, optimizer, scheduler, groups: list[Group], cfg, dp_group, device,
               version: int, ref_model=None, before_update=None,
               shard: tuple[int, int] = (0, 1)) -> StepResult:
    """Forward/backward over micro-batches, clip, and (if finite) an optimizer update, once per
    minibatch of the step's groups (`trainer.updates_per_step`, AReaL's PPO minibatches; 1 by
    default); the LR schedule moves once per step that applied an update (a skipped step leaves
    it where it was). `groups`: the step's, of which this rank trains its `shard = (rank,
    ranks)` share of each minibatch (`minibatches`); with the default (0, 1), all of them.
    `before_update()` runs just before the parameters first change (the weight sender waits
    there until the previous version has left, so it streams while we compute). `skipped`: no
    update was applied (every one non-finite)."""
    acfg, temp = cfg.algo, trainer_temperature(cfg.generator.temperature)
    if acfg.kl_coef > 0 and ref_model is None:
        raise ValueError(f"algo.kl_coef={acfg.kl_coef} but no reference model was given to the "
                         "trainer step (trainer.role.build_ref_model builds it)")
    updates = _plan_updates(groups, cfg, dp_group, device, shard)
    # pi_prox: the policy before the first update, for the losses that need it past that update
    if len(updates) > 1 and needs_prox(acfg):
        for up in updates:
            up.prox = _prox_logps(model, up, temp)
    stats, norms, applied = _zero_stats(), [], 0
    lr = optimizer.param_groups[0]["lr"]  # this step's: scheduler.step() sets the next one's
    for u, up in enumerate(updates):
        _backward(model, up, acfg, temp, ref_model, stats, version, first=u == 0)
        norms.append(float(clip_grad_norm(list(model.parameters()), cfg.trainer.grad_clip)))
        # The global gradient norm is the same on every rank (a non-finite loss makes it
        # non-finite too), so every rank takes the same skip decision.
        finite = bool(torch.isfinite(torch.tensor(norms[-1])))
        if u == 0 and before_update is not None:
            before_update()
        if finite:
            optimizer.step()
            applied += 1
        optimizer.zero_grad(set_to_none=True)
    if applied:
        scheduler.step()
    grad_norm = float(torch.tensor(norms).max())  # non-finite if any update's was
    # skipped only if the weights did not move: the guard aborts after K such steps in a row
    return StepResult(stats, grad_norm, skipped=applied == 0, lr=lr)


def _backward(model, up: _Update, acfg, temp, ref_model, stats: dict, version: int,
              first: bool) -> None:
    """One update's gradient, accumulated over its micro-batches (padded to `up.n_micro`);
    `first`: the step's first update, whose forward still runs the weights of `version`."""
    for i in range(up.n_micro):
        _sync_on_last(model, i == up.n_micro - 1)
        real = i < len(up.batches)
        batch = up.batches[i if real else 0]
        logp, entropy = losses.logprobs_and_entropy(_logits(model, batch), batch.targets_N,
                                                    batch.loss_mask_N, temp,
                                                    entropy_grad=acfg.entropy_coef > 0)
        out = _loss(acfg, logp, batch, None if up.prox is None else up.prox[i if real else 0])
        loss_sum = out.loss_sum
        if acfg.entropy_coef > 0:  # a bonus: maximising entropy lowers the loss
            loss_sum = loss_sum - acfg.entropy_coef * entropy
        if acfg.kl_coef > 0:
            ref_logp = reference_logp(ref_model, batch, temp)
            kl = losses.kl_penalty(logp, ref_logp, batch.loss_mask_N, acfg.kl_estimator)
            loss_sum = loss_sum + acfg.kl_coef * kl
            stats["kl_sum"] += float(kl.detach()) if real else 0.0
            stats["kl_tokens"] += float(batch.loss_mask_N.sum()) if real else 0.0
        scale = 1.0 if real else 0.0  # padding micro-batch: keeps FSDP collectives aligned
        (losses.normalize(loss_sum, max(up.global_tokens, 1)) * scale).backward()
        if real:
            # mismatch_kl wants the log-probs of the weights of `version`: pi_prox where there is
            # one; else this forward's in the first update only (later ones ran moved weights, and
            # counted the step's own updates as generator/trainer mismatch)
            logp_v = (up.prox[i] if up.prox is not None else
                      logp.detach() if first else None)
            _accumulate(stats, out, entropy, batch, version, logp_v)


def _sync_on_last(model, last: bool) -> None:
    """One FSDP2 unit for the whole model (parallel.fsdp_units = "model"): the parameters stay
    gathered and the gradients accumulate unsharded until the last micro-batch, whose backward
    reduce-scatters them once and reshards."""
    if getattr(model, "fsdp_units", None) == "model":
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


@torch.no_grad()
def _prox_logps(model, up: _Update, temp):
    """pi_prox: the policy before the step's first update, one extra forward (AReaL). A rank with
    fewer micro-batches than `up.n_micro` pads with forwards of its first, as `_backward` does:
    per-layer FSDP units all-gather in every forward, and one forward short left the ranks'
    gathers out of step (a hang in the next backward)."""
    logps = [policy_logp(model, b, temp) for b in up.batches]
    for _ in range(up.n_micro - len(up.batches)):
        policy_logp(model, up.batches[0], temp)
    return logps


def _zero_stats() -> dict:
    keys = ("loss_sum", "tokens", "is_ratio_sum", "is_ratio_max", "truncated", "clipped",
            "entropy_sum", "mismatch_kl_sum", "onpolicy_tokens", "kl_sum", "kl_tokens")
    return dict.fromkeys(keys, 0.0)


def _accumulate(stats, out: losses.LossOutput, entropy, batch: PackedBatch, version, logp_v):
    """Add a micro-batch's stats; `logp_v`: its log-probs under the weights of `version` (None:
    not known, this micro-batch then stays out of mismatch_kl)."""
    m = batch.loss_mask_N
    stats["loss_sum"] += float(out.loss_sum.detach())
    stats["tokens"] += float(out.tokens)
    stats["is_ratio_sum"] += float(out.is_ratio_sum)
    stats["is_ratio_max"] = max(stats["is_ratio_max"], float(out.is_ratio_max))
    stats["truncated"] += float(out.truncated_count)
    stats["clipped"] += float(out.clipped_count)
    stats["entropy_sum"] += float(entropy.detach())
    if logp_v is None:
        return
    # Mismatch between generator and trainer numerics: only tokens sampled by these very weights.
    same = m & (batch.versions_N == version)
    stats["mismatch_kl_sum"] += float(losses.mismatch_kl(logp_v, batch.logp_mu_N, same))
    stats["onpolicy_tokens"] += float(same.sum())
