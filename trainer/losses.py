"""Policy-gradient losses over packed tokens, as pure functions.

Conventions (all tensors are [N] over the packed tokens of one micro-batch, see batch.PackedBatch):
- `logp_N`      log pi(target) under the policy being trained; carries grad.
- `logp_mu_N`   log mu(target) recorded by the generator (behaviour policy), no grad.
- `adv_N`       the sequence's advantage broadcast over its tokens.
- `mask_N`      bool, True on loss tokens (targets that are completion tokens).

Every loss returns a `LossOutput` whose `loss_sum` is a SUM over loss tokens. The caller divides
by the GLOBAL number of loss tokens of the whole step (all micro-batches, all data-parallel ranks)
with `normalize`, so accumulating micro-batch gradients equals one big batch. A per-micro-batch
mean would weight short micro-batches' tokens more: the classic gradient-accumulation bug.

Stats are detached tensors (no host sync); add outputs with `+` to accumulate and call
`.metrics()` once per step for logging.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class LossOutput:
    loss_sum: Tensor          # scalar; carries grad
    tokens: Tensor            # int64 scalar: loss tokens (the denominator's share)
    is_ratio_sum: Tensor      # sum of the importance ratio used to correct staleness
    is_ratio_max: Tensor
    truncated_count: Tensor   # tokens whose IS weight was capped (AIPO) or masked (decoupled)
    clipped_count: Tensor     # tokens with zero gradient from the PPO clip

    def __add__(self, other: LossOutput) -> LossOutput:
        """Accumulate micro-batches: sums add, the max takes the max."""
        return LossOutput(**{
            f.name: (torch.maximum if f.name == "is_ratio_max" else torch.add)(
                getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)})

    def detach(self) -> LossOutput:
        return LossOutput(**{f.name: getattr(self, f.name).detach() for f in fields(self)})

    def metrics(self) -> dict[str, float]:
        """Per-token means for logging (one host sync). Sum across DP ranks before this for
        global numbers."""
        t = max(int(self.tokens), 1)
        return {"loss": self.loss_sum.item() / t, "tokens": int(self.tokens),
                "is_ratio_mean": float(self.is_ratio_sum) / t,
                "is_ratio_max": float(self.is_ratio_max),
                "truncated_frac": float(self.truncated_count) / t,
                "clipped_frac": float(self.clipped_count) / t}


def normalize(loss_sum: Tensor, global_tokens: int | Tensor) -> Tensor:
    """The loss to backprop: token sum over the GLOBAL loss-token count of the step.

    >>> normalize(torch.tensor(6.0), 4)
    tensor(1.5000)
    """
    if isinstance(global_tokens, Tensor):
        return loss_sum / global_tokens.clamp(min=1)
    return loss_sum / max(int(global_tokens), 1)


def _masked_sum(x_N: Tensor, mask_N: Tensor) -> Tensor:
    # where, not multiply: a masked inf/NaN must not leak into the sum.
    return torch.where(mask_N, x_N, 0.0).sum()


def _masked_max(x_N: Tensor, mask_N: Tensor) -> Tensor:
    if x_N.numel() == 0:
        return x_N.new_zeros(())
    return torch.where(mask_N, x_N, 0.0).max()


# exp(20) = 4.9e8, as verl's and TRL's clamp of the log-ratio: far past any clip or cap, and its
# square (a gradient norm's) stays far inside float32, whose exp overflows at 88.7.
LOG_RATIO_MAX = 20.0


def _ratio(log_ratio_N: Tensor) -> Tensor:
    """exp(log-ratio), the log-ratio capped at LOG_RATIO_MAX. With pi/mu past float32's range
    (mu < ~1e-38 where pi is not) the ratio was inf: a PPO token with A < 0 made the loss inf
    and the whole step was skipped. Above the cap the clamp cuts the gradient (as the clip does
    for A > 0, and the dual clip for A < 0); below it every value and gradient is exp's own.

    >>> _ratio(torch.tensor([0.0, 100.0]))       # 1 and e^20
    tensor([1.0000e+00, 4.8517e+08])
    """
    return log_ratio_N.clamp(max=LOG_RATIO_MAX).exp()


def _exp_linear_above_cap(d_N: Tensor) -> Tensor:
    """exp(d) up to LOG_RATIO_MAX, and its tangent line there above it: k3's exp(d) was inf past
    float32's range (a token the policy gives e^-89 of the reference's probability) and the step
    was skipped. The tangent keeps the gradient's sign and the KL pull toward the reference
    (a plain cap left k3's `-d` alone, pushing the token further down).

    >>> # e^1 itself; at 21, e^20 (1 + 21 - 20): the tangent at 20
    >>> _exp_linear_above_cap(torch.tensor([1.0, 21.0])) / torch.tensor([1.0, 20.0]).exp()
    tensor([1., 2.])
    """
    capped_N = d_N.clamp(max=LOG_RATIO_MAX)
    return capped_N.exp() * (1 + d_N - capped_N)


def _clipped_surrogate(u_N: Tensor, adv_N: Tensor, eps: float,
                       dual_clip_c: float) -> tuple[Tensor, Tensor]:
    """PPO's `min(u*A, clip(u, 1-eps, 1+eps)*A)`; with a dual clip c > 1+eps (Ye et al. 2020,
    verl's clip_ratio_c), `max(that, c*A)` where A < 0. Also the tokens it gives zero gradient:
    u > 1+eps with A > 0, u < 1-eps with A < 0, and (dual clip) u > c with A < 0.

    Worked example, eps 0.2, c 3, A = -1: u = 2 -> -2 (gradient as u); u = 4 -> -3, no gradient
    (without the dual clip -4, the gradient growing with u).
    """
    surrogate_N = torch.minimum(u_N * adv_N, u_N.clamp(1 - eps, 1 + eps) * adv_N)
    u_N = u_N.detach()
    clipped_N = ((u_N > 1 + eps) & (adv_N > 0)) | ((u_N < 1 - eps) & (adv_N < 0))
    if not dual_clip_c:
        return surrogate_N, clipped_N
    if not dual_clip_c > 1 + eps:
        raise ValueError(f"dual clip c={dual_clip_c} must exceed 1 + eps = {1 + eps} (verl uses "
                         "3), or be 0 for none: at or below it, tokens inside the clip range lose "
                         "their gradient")
    dual_N = (adv_N < 0) & (u_N > dual_clip_c)  # there max(u*A, c*A) = c*A: a constant
    return torch.where(dual_N, dual_clip_c * adv_N, surrogate_N), clipped_N | dual_N


def _output(loss_N: Tensor, mask_N: Tensor, ratio_N: Tensor, truncated_N: Tensor,
            clipped_N: Tensor) -> LossOutput:
    ratio_N = ratio_N.detach()
    return LossOutput(
        loss_sum=_masked_sum(loss_N, mask_N),
        tokens=mask_N.sum(),
        is_ratio_sum=_masked_sum(ratio_N, mask_N),
        is_ratio_max=_masked_max(ratio_N, mask_N),
        truncated_count=(truncated_N & mask_N).sum(),
        clipped_count=(clipped_N & mask_N).sum(),
    )


def aipo_loss(logp_N: Tensor, logp_mu_N: Tensor, adv_N: Tensor, mask_N: Tensor,
              rho: float) -> LossOutput:
    """AIPO (LlamaRL): `loss_t = -min(pi/mu, rho).detach() * A * log pi(y_t)`, no PPO clip.

    Its gradient is `-min(pi/mu, rho) * A * grad log pi`: the truncated-IS policy gradient of
    the paper, for every token. Tokens with ratio above rho still learn, with weight exactly rho.

    The port that writes `-(ratio.clamp(max=rho)) * A` with a grad-carrying ratio has the same
    gradient below rho (d ratio = ratio * d log pi) but ZERO gradient above rho, because clamp
    cuts the graph there: those tokens silently stop learning. We keep the faithful form.

    Worked example: pi = 0.5, mu = 0.1 (ratio 5), rho = 2, A = 1:
    loss = -2 * 1 * log 0.5 = 1.386, d loss / d logp = -2 (the port: 0).

    >>> logp = torch.tensor([0.5, 0.5]).log().requires_grad_()
    >>> out = aipo_loss(logp, torch.tensor([0.1, 0.5]).log(), torch.tensor([1.0, 1.0]),
    ...                 torch.tensor([True, True]), rho=2.0)
    >>> out.loss_sum.backward(); logp.grad          # ratio 5 -> weight 2; ratio 1 -> weight 1
    tensor([-2., -1.])
    >>> int(out.truncated_count), float(out.is_ratio_max)
    (1, 5.0)
    """
    if not rho > 0:
        raise ValueError(f"AIPO rho must be positive (typically 2-10), got {rho}")
    mask_N = mask_N.bool()
    # Masked positions get log-ratio 0 so their (unused) weight stays finite.
    log_ratio_N = torch.where(mask_N, logp_N.detach() - logp_mu_N, 0.0)
    ratio_N = _ratio(log_ratio_N)  # capped: the ratio metrics were inf past float32's range
    weight_N = ratio_N.clamp(max=rho)
    loss_N = -weight_N * adv_N * logp_N
    return _output(loss_N, mask_N, ratio_N, ratio_N > rho, torch.zeros_like(mask_N))


def ppo_clip_loss(logp_N: Tensor, logp_old_N: Tensor, adv_N: Tensor, mask_N: Tensor,
                  eps: float, is_weight_N: Tensor | None = None,
                  dual_clip_c: float = 0.0, truncated_N: Tensor | None = None) -> LossOutput:
    """PPO-clip: `loss_t = -w_t * min(u*A, clip(u, 1-eps, 1+eps)*A)`, `u = pi/pi_old`.

    `is_weight_N` (default 1) is an optional detached per-token weight, e.g. from `token_is`
    to correct pi_old against the generator's mu. `dual_clip_c` (0: none) bounds the surrogate
    of A < 0 tokens below by c*A (`_clipped_surrogate`). `clipped_count` counts tokens where a
    clip is active (zero gradient): u > 1+eps with A > 0, or u < 1-eps with A < 0, or u > c with
    A < 0. u is `_ratio`'s: capped at e^20 (no gradient above). The `is_ratio_*` stats report u,
    or `is_weight_N` when it is given; `truncated_N` (default none) marks the tokens whose
    `is_weight_N` was capped or dropped (`token_is`), counted in `truncated_count`.

    Worked example, eps = 0.2: u = 1.5, A = 1 -> min(1.5, 1.2) = 1.2, loss -1.2, grad 0;
    u = 0.5, A = 1 -> min(0.5, 0.8) = 0.5, loss -0.5, d loss / d logp = -u = -0.5.

    >>> logp = torch.tensor([1.5, 0.5]).log().requires_grad_()
    >>> out = ppo_clip_loss(logp, torch.zeros(2), torch.ones(2), torch.ones(2, dtype=torch.bool),
    ...                     eps=0.2)
    >>> out.loss_sum.backward(); round(out.loss_sum.item(), 4), logp.grad.tolist()
    (-1.7, [0.0, -0.5])
    >>> int(out.clipped_count)
    1
    """
    mask_N = mask_N.bool()
    weight_N = torch.ones_like(logp_N) if is_weight_N is None else is_weight_N.detach()
    # a token weighted 0 (token_is="mask") gets ratio 1, as a masked position: its surrogate
    # overflowed where pi/mu passed float32's range, and 0 * inf made the step's loss NaN
    u_N = _ratio(torch.where(mask_N & (weight_N != 0), logp_N - logp_old_N, 0.0))
    surrogate_N, clipped_N = _clipped_surrogate(u_N, adv_N, eps, dual_clip_c)
    loss_N = -weight_N * surrogate_N
    ratio_N = u_N if is_weight_N is None else weight_N
    truncated_N = torch.zeros_like(mask_N) if truncated_N is None else truncated_N.bool()
    return _output(loss_N, mask_N, ratio_N, truncated_N, clipped_N)


def decoupled_ppo_loss(logp_N: Tensor, logp_prox_N: Tensor, logp_mu_N: Tensor, adv_N: Tensor,
                       mask_N: Tensor, eps: float, prox_cap: float | None = 5.0,
                       dual_clip_c: float = 0.0) -> LossOutput:
    """Decoupled PPO (AReaL): `-(pi_prox/pi_behav) * min(u*A, clip(u, 1-eps, 1+eps)*A)`,
    `u = pi/pi_prox`, where pi_prox is the policy before this update (one extra forward pass)
    and pi_behav = mu the generator's. The trust region is around pi_prox, not the stale mu.

    Tokens with `pi_prox/pi_behav > prox_cap` (None: no cap) are dropped (counted in `truncated_count`); they
    still count in `tokens`, so dropping never up-weights the rest. With pi_prox == mu this is
    exactly `ppo_clip_loss` (weight 1), `dual_clip_c` included. Both ratios are `_ratio`'s.

    The trust region acts only when a batch is trained in several optimizer updates (AReaL's PPO
    minibatches, `trainer.updates_per_step`): in a step's first update pi_prox equals pi, u = 1
    and nothing is clipped, so with one update a step the loss is the behaviour-weighted policy
    gradient with the prox_cap mask (trainer.step passes the forward's own log-probs then).

    Worked example: pi = pi_prox = 0.5, mu = 0.25 (behaviour weight 2), A = 1: loss = -2 * 1,
    d loss / d logp = -2. With mu = 0.05 (weight 10 > cap 5) the token is dropped: loss 0.

    >>> logp = torch.tensor([0.5, 0.5]).log().requires_grad_()
    >>> out = decoupled_ppo_loss(logp, logp.detach(), torch.tensor([0.25, 0.05]).log(),
    ...                          torch.ones(2), torch.ones(2, dtype=torch.bool), 0.2, 5.0)
    >>> out.loss_sum.backward(); out.loss_sum.item(), logp.grad.tolist(), int(out.truncated_count)
    (-2.0, [-2.0, 0.0], 1)
    """
    mask_N = mask_N.bool()
    behav_w_N = _ratio(torch.where(mask_N, logp_prox_N.detach() - logp_mu_N, 0.0))
    capped_N = (behav_w_N > prox_cap) if prox_cap is not None else torch.zeros_like(mask_N)
    keep_N = mask_N & ~capped_N
    u_N = _ratio(torch.where(keep_N, logp_N - logp_prox_N.detach(), 0.0))
    surrogate_N, clipped_N = _clipped_surrogate(u_N, adv_N, eps, dual_clip_c)
    loss_N = torch.where(keep_N, -behav_w_N * surrogate_N, 0.0)
    return _output(loss_N, mask_N, behav_w_N, capped_N, keep_N & clipped_N)


def token_is(logp_N: Tensor, logp_mu_N: Tensor, mode: Literal["none", "truncate", "mask"],
             cap: float) -> Tensor:
    """Detached per-token IS weights pi/mu for `ppo_clip_loss(is_weight_N=...)`.

    - "none":     1 everywhere (trust the generator's samples as on-policy).
    - "truncate": min(pi/mu, cap)        (truncated IS, as verl's token TIS).
    - "mask":     pi/mu where pi/mu <= cap, else 0   (masked IS, as TRL's token_mask).

    >>> token_is(torch.tensor([0.0, 0.0]), torch.tensor([1.0, 3.0]).log().neg(), "truncate", 2.0)
    tensor([1., 2.])
    >>> token_is(torch.tensor([0.0, 0.0]), torch.tensor([1.0, 3.0]).log().neg(), "mask", 2.0)
    tensor([1., 0.])
    """
    if mode == "none":
        return torch.ones_like(logp_N, dtype=torch.float32).detach()
    ratio_N = (logp_N.detach() - logp_mu_N).exp()
    if mode == "truncate":
        return ratio_N.clamp(max=cap)
    if mode == "mask":
        return torch.where(ratio_N <= cap, ratio_N, 0.0)
    raise ValueError(f"unknown token IS mode {mode!r}; use 'none', 'truncate' or 'mask'")


def kl_penalty(logp_N: Tensor, logp_ref_N: Tensor, mask_N: Tensor,
               estimator: Literal["k1", "k2", "k3"] = "k3") -> Tensor:
    """Token-summed estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL"),
    as a loss term: add `beta * kl_penalty(...)` to `loss_sum` before `normalize`.

    With `d = logp_ref - logp`:  k1 = -d (unbiased, can be negative);
    k2 = d^2 / 2 (biased, low variance); k3 = exp(d) - d - 1 (unbiased, always >= 0).
    Their values estimate KL(pi || ref); as losses their gradients differ (in expectation over
    samples of pi, exact enumeration in tests/test_losses.py):
    - k1's own gradient is -grad log pi, zero in expectation (E_pi[grad log pi] = 0): no penalty
      at all. Its value is kept, its gradient replaced by the score-function one,
      (logp - logp_ref) * grad logp, which is grad KL(pi || ref) in expectation (as PPO-RLHF's
      per-token KL reward gives);
    - k2's gradient is that same (logp - logp_ref) * grad logp: grad KL(pi || ref);
    - k3's, (1 - ref/pi) * grad logp, is grad KL(ref || pi) in expectation (the reverse KL):
      GRPO's (DeepSeekMath) KL loss, tandem's default.

    The trainer's tokens are samples of the generator's mu, not of pi, and this term is not
    importance weighted by pi/mu, as in verl and OpenRLHF; TRL's GRPO weights its policy loss by
    its pi_old/mu ratio before adding the KL, which it weights by pi/pi_old only (its
    use_bias_correction_kl: with pi_old = pi that turns k3's gradient into k2's, tandem's k2).
    Under mu each estimator's gradient is still exactly that of a penalty >= 0 that is 0 only at
    pi = ref: E_mu[k2] (k1's and k2's gradients) or E_mu[k3], the same per-token divergence
    averaged over mu's tokens instead of pi's. So it pulls pi toward ref as on policy, the two
    differing by the off-policy gap (max_staleness versions, numerics), and the statements above
    hold exactly at mu = pi. A pi/mu weight would make them exact off policy only untruncated
    (unbounded variance); truncated at rho it is biased again.

    >>> kl_penalty(torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([True]), "k1")
    tensor(1.)
    >>> round(float(kl_penalty(torch.tensor([0.0]), torch.tensor([-1.0]),
    ...                        torch.tensor([True]), "k3")), 4)         # e^-1 + 1 - 1
    0.3679
    """
    mask_N = mask_N.bool()
    d_N = torch.where(mask_N, logp_ref_N - logp_N, 0.0)
    if estimator == "k1":  # the value -d, the gradient -d * grad logp (docstring)
        return _masked_sum(-d_N.detach() * (1 + logp_N - logp_N.detach()), mask_N)
    if estimator == "k2":
        return _masked_sum(0.5 * d_N * d_N, mask_N)
    if estimator == "k3":
        return _masked_sum(_exp_linear_above_cap(d_N) - d_N - 1, mask_N)
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")


def mismatch_kl(logp_N: Tensor, logp_mu_N: Tensor, mask_N: Tensor) -> Tensor:
    """Detached token sum of the k3 estimate of KL(mu || pi) from the generator's samples.

    With `r = pi/mu`, `k3 = r - 1 - log r` (E_mu[r] = 1, so it is unbiased and >= 0). This is
    prime-rl's `mismatch_kl`: it rises before a run collapses, from staleness or from
    generator/trainer numeric drift. Divide by the token count for the per-token value.

    >>> round(float(mismatch_kl(torch.tensor([0.0]), torch.tensor([1.0]).log() - 1,
    ...                         torch.tensor([True]))), 4)              # r = e: e - 1 - 1
    0.7183
    """
    mask_N = mask_N.bool()
    log_r_N = torch.where(mask_N, logp_N.detach() - logp_mu_N, 0.0)
    # r past e^20 as exp's tangent there (`_ratio`'s cap made k3 fall as log r rose above it)
    return _masked_sum(_exp_linear_above_cap(log_r_N) - 1 - log_r_N, mask_N)


def token_logprobs(logits_NV: Tensor, targets_N: Tensor, temperature: float = 1.0,
                   chunk_size: int = 4096) -> Tensor:
    """log softmax(logits / temperature)[target], in float32, `chunk_size` rows at a time.

    The generator records log-probs of the temperature-scaled distribution it sampled from, so
    the trainer must use the same temperature or every IS ratio is off. Computed per chunk as
    `-cross_entropy(z, target)`: PyTorch's fused log-softmax and pick, whose backward is fused too
    (at SmolLM2's 49152-token vocabulary 1.6x faster, forward and backward, than
    `z[target] - logsumexp(z)`, and within 2e-6 of it). The peak extra memory is two [chunk, V]
    float32 blocks (z and its log-softmax), never a full [N, V] one. Leading dims are free:
    logits [..., V] with targets [...].

    >>> token_logprobs(torch.tensor([[0.0, 0.0], [2.0, 0.0]]), torch.tensor([0, 1]),
    ...                temperature=2.0)                   # [log 1/2, log 1/(1+e)]
    tensor([-0.6931, -1.3133])
    """
    flat_NV, flat_N = _flat_logits(logits_NV, targets_N, temperature)
    out = []
    for s in range(0, flat_N.numel(), chunk_size):
        z_CV = _tempered(flat_NV[s:s + chunk_size], temperature)
        out.append(-F.cross_entropy(z_CV, flat_N[s:s + chunk_size], reduction="none"))
    return _joined(out, flat_NV, targets_N)


def logprobs_and_entropy(logits_NV: Tensor, targets_N: Tensor, mask_N: Tensor,
                         temperature: float = 1.0, chunk_size: int = 4096,
                         entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """(`token_logprobs`, `entropy_from_logits` over `mask_N`) of the same finite logits, both
    from one fused log-softmax per chunk: the picked log-probs keep their gradient, the entropy
    -sum_v p_v log p_v is a logged metric (no gradient) unless `entropy_grad` (an entropy bonus,
    `algo.entropy_coef`). At SmolLM2's 49152-token vocabulary, 800
    bf16 rows on one core: 0.58 s for the log-probs' forward and backward and the entropy, against
    0.79 s for the two functions apart (BENCHMARKS.md, "Against TRL").

    >>> lp, h = logprobs_and_entropy(torch.zeros(2, 4), torch.tensor([0, 3]), torch.tensor([True, False]))
    >>> [round(x, 4) for x in lp.tolist()], round(float(h), 4)   # log 1/4 each, one row of log 4
    ([-1.3863, -1.3863], 1.3863)
    """
    flat_NV, flat_N = _flat_logits(logits_NV, targets_N, temperature)
    flat_mask_N = mask_N.reshape(-1).bool()
    out, entropy = [], flat_NV.new_zeros((), dtype=torch.float32)
    for s in range(0, flat_N.numel(), chunk_size):
        logp_CV = torch.log_softmax(_tempered(flat_NV[s:s + chunk_size], temperature), -1)
        out.append(logp_CV.gather(1, flat_N[s:s + chunk_size, None])[:, 0])
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # every row, then the mask: cheaper than copying the masked rows
            entropy = entropy + _row_entropy(logp_CV)[flat_mask_N[s:s + chunk_size]].sum()
    return _joined(out, flat_NV, targets_N), entropy


def _flat_logits(logits_NV: Tensor, targets_N: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if logits_NV.shape[:-1] != targets_N.shape:
        raise ValueError(f"logits {tuple(logits_NV.shape)} and targets "
                         f"{tuple(targets_N.shape)} disagree on the leading dims")
    return logits_NV.reshape(-1, logits_NV.shape[-1]), targets_N.reshape(-1)


def _joined(chunks: list[Tensor], flat_NV: Tensor, targets_N: Tensor) -> Tensor:
    if not chunks:
        return flat_NV.new_zeros(targets_N.shape, dtype=torch.float32)
    return torch.cat(chunks).reshape(targets_N.shape)


def entropy_from_logits(logits_NV: Tensor, mask_N: Tensor, temperature: float = 1.0,
                        chunk_size: int = 4096) -> Tensor:
    """Token-summed entropy of softmax(logits / temperature) over masked rows, chunked.

    H = -sum_v p_v log p_v from log_softmax(z) (`_row_entropy`, as in `logprobs_and_entropy`).
    Only masked rows are computed. Usually logged (wrap in torch.no_grad); it keeps grad for an
    entropy bonus.

    >>> round(float(entropy_from_logits(torch.zeros(2, 4), torch.tensor([True, False]))), 4)
    1.3863
    """
    rows_MV = logits_NV.reshape(-1, logits_NV.shape[-1])[mask_N.reshape(-1).bool()]
    total = logits_NV.new_zeros((), dtype=torch.float32)
    for s in range(0, rows_MV.shape[0], chunk_size):
        logp_CV = torch.log_softmax(_tempered(rows_MV[s:s + chunk_size], temperature), -1)
        total = total + _row_entropy(logp_CV).sum()
    return total


def _row_entropy(logp_CV: Tensor) -> Tensor:
    """-sum_v p_v log p_v of each row of finite log-probs; in place (one [C, V] buffer) unless a
    gradient must flow."""
    p_CV = logp_CV.exp()
    return -(p_CV * logp_CV if p_CV.requires_grad else p_CV.mul_(logp_CV)).sum(-1)


def _tempered(x_CV: Tensor, temperature: float) -> Tensor:
    """x / temperature in float32. At temperature 1 no pass at all (x / 1 is x exactly): on
    SmolLM2's 49152-token vocabulary the division was a fifth of the log-prob forward."""
    z_CV = x_CV.float()
    return z_CV if temperature == 1.0 else z_CV / temperature
