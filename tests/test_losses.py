"""Losses, log-prob helpers and packing, against hand-computed values."""
import dataclasses
import doctest
import math
import random

import pytest
import torch

import trainer.batch
import trainer.losses
from trainer.advantages import group_advantages
from trainer.batch import (Group, Trajectory, count_loss_tokens, flatten_groups, pack,
                           rewards_GN, split_by_token_budget, token_budget_bins)
from trainer.losses import (aipo_loss, decoupled_ppo_loss, entropy_from_logits, kl_penalty,
                            logprobs_and_entropy, mismatch_kl, normalize, ppo_clip_loss,
                            token_is, token_logprobs)

LN = math.log


@pytest.mark.parametrize("module", [trainer.losses, trainer.batch])
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0


# -- AIPO ------------------------------------------------------------------------------------------
def test_aipo_gradient_coefficients_above_and_below_rho():
    # ratios pi/mu: 0.5/0.1 = 5 (> rho=3, truncated), 0.5/0.4 = 1.25, 0.2/0.2 = 1; 4th masked.
    logp_N = torch.tensor([LN(0.5), LN(0.5), LN(0.2), -30.0], dtype=torch.float64,
                          requires_grad=True)
    logp_mu_N = torch.tensor([LN(0.1), LN(0.4), LN(0.2), 0.0], dtype=torch.float64)
    adv_N = torch.tensor([2.0, -1.0, 3.0, 100.0], dtype=torch.float64)
    mask_N = torch.tensor([True, True, True, False])
    out = aipo_loss(logp_N, logp_mu_N, adv_N, mask_N, rho=3.0)
    out.loss_sum.backward()
    # d loss / d logp_t = -min(ratio, rho) * A: -3*2, -1.25*(-1), -1*3, masked 0.
    assert logp_N.grad.tolist() == pytest.approx([-6.0, 1.25, -3.0, 0.0])
    expect = -(3 * 2 * LN(0.5) + 1.25 * -1 * LN(0.5) + 1 * 3 * LN(0.2))
    assert out.loss_sum.item() == pytest.approx(expect)
    assert int(out.tokens) == 3 and int(out.truncated_count) == 1
    assert out.is_ratio_sum.item() == pytest.approx(5 + 1.25 + 1)
    assert out.is_ratio_max.item() == pytest.approx(5.0)


def test_aipo_differs_from_the_clamp_port_only_on_truncated_tokens():
    logp_N = torch.tensor([LN(0.5), LN(0.5)], dtype=torch.float64, requires_grad=True)
    logp_mu_N = torch.tensor([LN(0.1), LN(0.4)], dtype=torch.float64)   # ratios 5, 1.25
    adv_N = torch.tensor([1.0, 1.0], dtype=torch.float64)
    port = -(torch.exp(logp_N - logp_mu_N).clamp(max=2.0) * adv_N).sum()
    (port_grad_N,) = torch.autograd.grad(port, logp_N)
    aipo_loss(logp_N, logp_mu_N, adv_N, torch.ones(2, dtype=torch.bool), 2.0).loss_sum.backward()
    assert port_grad_N.tolist() == pytest.approx([0.0, -1.25])   # truncated token: no gradient
    assert logp_N.grad.tolist() == pytest.approx([-2.0, -1.25])  # faithful: weight rho


def test_aipo_on_policy_is_reinforce():
    logp_N = torch.tensor([-0.3, -1.2, -2.0], requires_grad=True)
    adv_N = torch.tensor([0.5, -0.5, 2.0])
    mask_N = torch.tensor([True, True, True])
    out = aipo_loss(logp_N, logp_N.detach(), adv_N, mask_N, rho=2.0)
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-(0.5 * -0.3 + -0.5 * -1.2 + 2.0 * -2.0))
    assert logp_N.grad.tolist() == pytest.approx([-0.5, 0.5, -2.0])
    assert int(out.truncated_count) == 0 and out.is_ratio_sum.item() == pytest.approx(3.0)


def test_aipo_rejects_bad_rho():
    with pytest.raises(ValueError, match="rho must be positive"):
        aipo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=bool), 0.0)


# -- PPO and decoupled PPO -------------------------------------------------------------------------
def test_ppo_clip_known_numbers():
    # u = pi/pi_old, eps 0.2: rows (u, A) -> surrogate, d loss / d logp
    # (1.5, +1) -> 1.2 clipped, 0 | (0.5, -1) -> -0.8 clipped, 0 | (1.5, -1) -> -1.5, +1.5
    # (1.1, +1) -> 1.1, -1.1
    u = [1.5, 0.5, 1.5, 1.1]
    logp_N = torch.tensor([LN(x) for x in u], dtype=torch.float64, requires_grad=True)
    adv_N = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    out = ppo_clip_loss(logp_N, torch.zeros(4, dtype=torch.float64), adv_N,
                        torch.ones(4, dtype=torch.bool), eps=0.2)
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-(1.2 - 0.8 - 1.5 + 1.1))
    assert logp_N.grad.tolist() == pytest.approx([0.0, 0.0, 1.5, -1.1])
    assert int(out.clipped_count) == 2


def test_ppo_with_token_is_weights():
    logp_N = torch.tensor([0.0, 0.0], requires_grad=True)          # u = 1 (pi == pi_old)
    logp_mu_N = torch.tensor([LN(0.25), LN(0.8)])                   # pi/mu = 4, 1.25
    mask_N = torch.ones(2, dtype=torch.bool)
    w_N = token_is(logp_N, logp_mu_N, "truncate", cap=2.0)
    assert w_N.tolist() == pytest.approx([2.0, 1.25]) and not w_N.requires_grad
    assert token_is(logp_N, logp_mu_N, "mask", cap=2.0).tolist() == pytest.approx([0.0, 1.25])
    assert token_is(logp_N, logp_mu_N, "none", cap=2.0).tolist() == [1.0, 1.0]
    out = ppo_clip_loss(logp_N, logp_N.detach(), torch.ones(2), mask_N, 0.2, is_weight_N=w_N)
    out.loss_sum.backward()
    assert logp_N.grad.tolist() == pytest.approx([-2.0, -1.25])
    # the IS stats report the weights given (u is 1 on both tokens here)
    assert out.is_ratio_sum.item() == pytest.approx(3.25) and out.is_ratio_max.item() == 2.0
    with pytest.raises(ValueError, match="unknown token IS mode"):
        token_is(logp_N, logp_mu_N, "sequence", 2.0)


def test_decoupled_reduces_to_ppo_when_prox_equals_behaviour():
    g = torch.Generator().manual_seed(0)
    logp_prox_N = -torch.rand(32, generator=g, dtype=torch.float64) * 3
    logp_N = (logp_prox_N + torch.randn(32, generator=g, dtype=torch.float64) * 0.4)
    adv_N = torch.randn(32, generator=g, dtype=torch.float64)
    mask_N = torch.rand(32, generator=g) > 0.2
    a = logp_N.clone().requires_grad_()
    b = logp_N.clone().requires_grad_()
    dec = decoupled_ppo_loss(a, logp_prox_N, logp_prox_N, adv_N, mask_N, 0.2, prox_cap=5.0)
    ppo = ppo_clip_loss(b, logp_prox_N, adv_N, mask_N, 0.2)
    dec.loss_sum.backward(); ppo.loss_sum.backward()
    assert dec.loss_sum.item() == pytest.approx(ppo.loss_sum.item())
    torch.testing.assert_close(a.grad, b.grad)
    assert int(dec.clipped_count) == int(ppo.clipped_count) > 0
    assert int(dec.truncated_count) == 0


def test_decoupled_behaviour_weight_and_cap():
    # pi = pi_prox = 0.5; mu = 0.25 (weight 2), 0.05 (weight 10 > cap, dropped), 0.5 (weight 1)
    logp_N = torch.full((3,), LN(0.5), dtype=torch.float64, requires_grad=True)
    logp_mu_N = torch.tensor([LN(0.25), LN(0.05), LN(0.5)], dtype=torch.float64)
    adv_N = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)
    out = decoupled_ppo_loss(logp_N, logp_N.detach(), logp_mu_N, adv_N,
                             torch.ones(3, dtype=torch.bool), eps=0.2, prox_cap=5.0)
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-(2 * 1 + 1 * -2))
    assert logp_N.grad.tolist() == pytest.approx([-2.0, 0.0, 2.0])
    assert int(out.truncated_count) == 1 and int(out.tokens) == 3


# -- KL, entropy, log-probs ------------------------------------------------------------------------
def test_kl_estimators_known_numbers():
    logp_N = torch.tensor([0.0, LN(0.5), 5.0])
    logp_ref_N = torch.tensor([LN(0.5), 0.0, -5.0])
    mask_N = torch.tensor([True, True, False])
    # d = ref - logp = [-ln2, +ln2]
    assert kl_penalty(logp_N, logp_ref_N, mask_N, "k1").item() == pytest.approx(0.0, abs=1e-7)
    assert kl_penalty(logp_N, logp_ref_N, mask_N, "k2").item() == pytest.approx(LN(2) ** 2)
    # k3: (0.5 + ln2 - 1) + (2 - ln2 - 1) = 0.5
    assert kl_penalty(logp_N, logp_ref_N, mask_N, "k3").item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp_N, logp_ref_N, mask_N, "k4")


def test_k3_gradient_flows_and_vanishes_at_ref():
    logp_N = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl_penalty(logp_N, logp_N.detach(), torch.ones(2, dtype=torch.bool), "k3").backward()
    assert logp_N.grad.tolist() == [0.0, 0.0]


def test_mismatch_kl_known_numbers():
    # log r = logp - logp_mu = [ln2, -ln2]: (2 - 1 - ln2) + (0.5 - 1 + ln2) = 0.5
    logp_N = torch.tensor([0.0, 0.0, 3.0], requires_grad=True)
    logp_mu_N = torch.tensor([-LN(2), LN(2), 0.0])
    out = mismatch_kl(logp_N, logp_mu_N, torch.tensor([True, True, False]))
    assert out.item() == pytest.approx(0.5) and not out.requires_grad
    assert mismatch_kl(logp_N, logp_N.detach(), torch.ones(3, dtype=torch.bool)).item() == 0.0


def _manual_logp(logits_NV, targets_N, temperature):
    p_NV = [[math.exp(z / temperature) for z in row] for row in logits_NV.tolist()]
    return [math.log(row[t] / sum(row)) for row, t in zip(p_NV, targets_N.tolist())]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_token_logprobs_vs_manual_softmax(temperature):
    g = torch.Generator().manual_seed(1)
    logits_NV = torch.randn(7, 5, generator=g)
    targets_N = torch.randint(0, 5, (7,), generator=g)
    got = token_logprobs(logits_NV, targets_N, temperature, chunk_size=3)
    assert got.tolist() == pytest.approx(_manual_logp(logits_NV, targets_N, temperature), abs=1e-5)


def test_token_logprobs_chunked_equals_unchunked_with_grads_and_bf16():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    la = token_logprobs(a, targets, 0.9, chunk_size=3)
    lb = token_logprobs(b, targets, 0.9, chunk_size=1000)
    assert la.shape == (2, 5)
    torch.testing.assert_close(la, lb)
    (la * torch.arange(10.0).view(2, 5)).sum().backward()
    (lb * torch.arange(10.0).view(2, 5)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    lbf = token_logprobs(logits.bfloat16(), targets, 0.9)
    assert lbf.dtype == torch.float32
    torch.testing.assert_close(lbf, la.detach(), atol=0.05, rtol=0)
    with pytest.raises(ValueError, match="temperature must be positive"):
        token_logprobs(logits, targets, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_in_one_pass_equal_the_two_functions(temperature):
    """The trainer's one-pass form: the same log-probs (and gradients) as token_logprobs, the
    same masked entropy as entropy_from_logits, over chunks and leading dims."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    mask = torch.rand(2, 5, generator=g) < 0.6
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lp, h = logprobs_and_entropy(a, targets, mask, temperature, chunk_size=3)
    ref = token_logprobs(b, targets, temperature)
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    assert h.requires_grad is False
    assert h.item() == pytest.approx(entropy_from_logits(logits, mask, temperature).item(), rel=1e-6)
    weights = torch.arange(10.0).view(2, 5)
    (lp * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="disagree on the leading dims"):
        logprobs_and_entropy(logits, targets[:1], mask, temperature)


def test_entropy_gradient_by_hand_for_the_bonus():
    """dH/dz_i = -p_i (log p_i + H) for H of softmax(z): with entropy_grad the one-pass entropy
    carries exactly that gradient (and none without it); the log-probs are unchanged."""
    z = torch.tensor([[LN(0.5), LN(0.3), LN(0.2)], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([True, True, False])
    logits = z.clone().requires_grad_()
    lp, h = logprobs_and_entropy(logits, torch.tensor([0, 1, 2]), mask, entropy_grad=True)
    p = torch.tensor([0.5, 0.3, 0.2])
    h0 = -(p * p.log()).sum()
    assert h.item() == pytest.approx(h0.item() + LN(3), rel=1e-6)
    h.backward()
    expect = torch.zeros(3, 3)
    expect[0] = -p * (p.log() + h0)              # the uniform row's gradient is 0, the masked row's 0
    torch.testing.assert_close(logits.grad, expect, atol=1e-6, rtol=0)
    assert [round(x, 4) for x in lp.tolist()] == [round(LN(0.5), 4), round(-LN(3), 4),
                                                  round(-LN(math.exp(2) + 2), 4)]
    _, h_plain = logprobs_and_entropy(z.clone().requires_grad_(), torch.tensor([0, 1, 2]), mask)
    assert not h_plain.requires_grad


def test_entropy_known_numbers_and_chunking():
    logits_NV = torch.stack([torch.zeros(3), torch.tensor([LN(0.5), LN(0.25), LN(0.25)]),
                             torch.tensor([9.0, 0.0, 0.0])])
    mask_N = torch.tensor([True, True, False])
    # log 3 + (0.5 ln2 + 2 * 0.25 ln4) = ln3 + 1.5 ln2
    expect = LN(3) + 1.5 * LN(2)
    assert entropy_from_logits(logits_NV, mask_N).item() == pytest.approx(expect, rel=1e-6)
    assert entropy_from_logits(logits_NV, mask_N, chunk_size=1).item() == pytest.approx(expect,
                                                                                         rel=1e-6)
    # temperature 2 on [ln .5, ln .25, ln .25] gives probs proportional to sqrt: [.5**.5, .5, .5]
    p = [0.5 ** 0.5, 0.5, 0.5]
    p = [x / sum(p) for x in p]
    h_t2 = -sum(x * LN(x) for x in p)
    got = entropy_from_logits(logits_NV[1:2], torch.tensor([True]), temperature=2.0)
    assert got.item() == pytest.approx(h_t2, rel=1e-6)


def test_normalize_and_accumulate_outputs():
    assert normalize(torch.tensor(6.0), torch.tensor(4)).item() == 1.5
    assert normalize(torch.tensor(0.0), 0).item() == 0.0
    m = torch.ones(2, dtype=torch.bool)
    a = aipo_loss(torch.zeros(2), torch.tensor([0.0, -LN(3)]), torch.ones(2), m, 2.0)
    b = aipo_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), m[:1], 2.0)
    s = (a + b).metrics()
    assert s["tokens"] == 3 and s["is_ratio_max"] == pytest.approx(3.0)
    assert s["is_ratio_mean"] == pytest.approx(5 / 3)
    assert s["truncated_frac"] == pytest.approx(1 / 3) and s["clipped_frac"] == 0.0  # AIPO: no clip


# -- packing ---------------------------------------------------------------------------------------
def _traj(pid, idx, p, c, version=0, reward=0.0):
    return Trajectory(prompt_id=pid, sample_idx=idx, prompt_ids=list(range(1, p + 1)),
                      completion_ids=[10 + k for k in range(c)],
                      logp_mu=[-0.1 * (k + 1) for k in range(c)],
                      token_versions=[version + (k % 2) for k in range(c)],
                      reward=reward, finish_reason="stop")


def test_pack_alignment_by_hand():
    a = Trajectory(0, 0, [5, 6], [7, 8], [-0.1, -0.2], [3, 4], 1.0, "stop")
    b = Trajectory(1, 0, [9], [4, 2, 3], [-1.0, -2.0, -3.0], [5, 5, 5], 0.0, "length")
    pb = pack([a, b], [0.5, -2.0])
    assert pb.input_ids_N.tolist() == [5, 6, 7, 8, 9, 4, 2, 3]
    assert pb.seq_lens_S.tolist() == [4, 4]
    assert pb.targets_N.tolist() == [6, 7, 8, 0, 4, 2, 3, 0]
    assert pb.loss_mask_N.tolist() == [False, True, True, False, True, True, True, False]
    assert pb.logp_mu_N.tolist() == pytest.approx([0, -0.1, -0.2, 0, -1, -2, -3, 0])
    assert pb.adv_N.tolist() == [0, 0.5, 0.5, 0, -2, -2, -2, 0]
    assert pb.versions_N.tolist() == [-1, 3, 4, -1, 5, 5, 5, -1]
    assert pb.position_ids_N.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert count_loss_tokens([pb, pb]) == 10
    assert a.version == 3 and Group(0, [a]).min_version == 3


def test_pack_shared_prompts_by_hand():
    """share_prompts: [5, 6] once (its first token alone), then each of its samples as a child:
    the prompt's last token and the completion but its last. A 1-token prompt and a prompt seen
    once are packed whole, in order of first appearance."""
    a = Trajectory(0, 0, [5, 6], [7, 8], [-0.1, -0.2], [3, 4], 1.0, "stop")
    b = Trajectory(0, 1, [5, 6], [9, 4, 2], [-1.0, -2.0, -3.0], [4, 4, 5], 0.0, "length")
    alone = Trajectory(1, 0, [9], [4, 2], [-0.5, -0.6], [5, 5], 0.0, "stop")
    once = Trajectory(2, 0, [3, 3], [1], [-0.7], [6], 0.0, "stop")
    pb = pack([a, alone, b, once], [0.5, 1.5, -2.0, 3.0], share_prompts=True)
    assert pb.input_ids_N.tolist() == [5, 6, 7, 6, 9, 4, 9, 4, 2, 3, 3, 1]
    assert pb.seq_lens_S.tolist() == [1, 2, 3, 3, 3]
    assert pb.seq_parents_S.tolist() == [-1, 0, 0, -1, -1]
    assert pb.position_ids_N.tolist() == [0, 1, 2, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert pb.targets_N.tolist() == [6, 7, 8, 9, 4, 2, 4, 2, 0, 3, 1, 0]
    T, F = True, False
    assert pb.loss_mask_N.tolist() == [F, T, T, T, T, T, T, T, F, F, T, F]
    assert pb.logp_mu_N.tolist() == pytest.approx([0, -.1, -.2, -1, -2, -3, -.5, -.6, 0, 0, -.7, 0])
    assert pb.adv_N.tolist() == [0, .5, .5, -2, -2, -2, 1.5, 1.5, 0, 0, 3, 0]
    assert pb.versions_N.tolist() == [-1, 3, 4, 4, 4, 5, 5, 5, -1, -1, 6, -1]
    # every completion token is a loss target once, as without sharing
    whole = pack([a, alone, b, once], [0.5, 1.5, -2.0, 3.0])
    assert count_loss_tokens([pb]) == count_loss_tokens([whole]) == 8
    assert pb.num_tokens == whole.num_tokens - 3


def test_trajectory_and_group_validation():
    with pytest.raises(ValueError, match="one entry per completion token"):
        Trajectory(0, 0, [1], [2, 3], [-0.1], [0, 0], 0.0, "stop")
    with pytest.raises(ValueError, match="non-empty"):
        Trajectory(0, 0, [1], [], [], [], 0.0, "stop")
    with pytest.raises(ValueError, match=r"prompt ids \[7\]"):
        Group(0, [_traj(0, 0, 2, 2), _traj(7, 1, 2, 2)])
    with pytest.raises(ValueError, match="2 trajectories but 1 advantages"):
        pack([_traj(0, 0, 2, 2), _traj(0, 1, 2, 2)], [1.0])


def test_split_by_token_budget():
    trajs = [_traj(i, 0, p, c) for i, (p, c) in enumerate([(2, 1), (3, 5), (1, 4), (1, 1), (9, 3)])]
    # lengths 3, 8, 5, 2, 12; the 12-token sequence exceeds the budget and sits alone
    bins = split_by_token_budget(trajs, max_tokens=10)
    assert [[t.prompt_id for t in b] for b in bins] == [[4], [1, 3], [0, 2]]
    assert all(sum(t.num_tokens for t in b) <= 10 for b in bins if len(b) > 1)
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(200)]
    bins = token_budget_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        token_budget_bins([1], 0)


def test_prompt_units_keep_a_prompts_samples_together_within_the_budget():
    """Shared prompts: a prompt's samples form one unit while they pack to <= max_tokens (the
    prompt but its last token, then each completion and one token), else runs of them; a
    1-token prompt's samples stay alone."""
    from trainer.batch import packed_tokens, prompt_units
    from trainer.step import micro_batches
    a = [Trajectory(0, j, [1, 2, 3], [4] * n, [-1.0] * n, [0] * n, 0.0, "stop")
         for j, n in enumerate((4, 5, 6))]
    b = [Trajectory(1, j, [7], [4, 4], [-1.0] * 2, [0] * 2, 0.0, "stop") for j in range(2)]
    c = [Trajectory(2, 0, [5, 5, 5, 5], [4] * 3, [-1.0] * 3, [0] * 3, 0.0, "stop")]
    trajs = a + b + c
    units = prompt_units(trajs, True, max_tokens=12)
    assert units == [[0, 1], [2], [3], [4], [5]]
    assert [packed_tokens(trajs, u) for u in units] == [2 + 4 + 5, 9, 3, 3, 7]
    assert prompt_units(trajs, False, 12) == [[i] for i in range(6)]
    # two groups of 3 samples of 3 + 4 tokens: with sharing each group is one micro-batch of 14
    rng = random.Random(0)
    groups = [Group(g, [Trajectory(g, j, [g + 1] * 3, [rng.randrange(9) for _ in range(4)], [-1.0] * 4,
                                   [0] * 4, float(j), "stop") for j in range(3)]) for g in range(2)]
    shared = micro_batches(groups, "group_mean", 16, share_prompts=True)
    assert [b.num_tokens for b in shared] == [14, 14]
    assert [b.seq_parents_S.tolist() for b in shared] == [[-1, 0, 0, 0]] * 2
    whole = micro_batches(groups, "group_mean", 16)
    assert [b.num_tokens for b in whole] == [14, 14, 14]
    assert count_loss_tokens(shared) == count_loss_tokens(whole) == 24


# -- micro-batch invariance ------------------------------------------------------------------------
def _groups(seed, n_groups=4, n=3, vocab=13):
    rng = random.Random(seed)
    groups = []
    for pid in range(n_groups):
        trajs = []
        for j in range(n):
            p, c = rng.randint(1, 6), rng.randint(1, 9)
            trajs.append(Trajectory(pid, j, [rng.randrange(vocab) for _ in range(p)],
                                    [rng.randrange(vocab) for _ in range(c)],
                                    [-rng.uniform(0.5, 4.0) for _ in range(c)], [0] * c,
                                    float(rng.randint(0, 2)), "stop"))
        groups.append(Group(pid, trajs))
    return groups


LOSSES = {
    "aipo": lambda lp, pb: aipo_loss(lp, pb.logp_mu_N.double(), pb.adv_N.double(),
                                     pb.loss_mask_N, rho=2.0),
    "ppo": lambda lp, pb: ppo_clip_loss(lp, pb.logp_mu_N.double(), pb.adv_N.double(),
                                        pb.loss_mask_N, eps=0.2),
    "decoupled": lambda lp, pb: decoupled_ppo_loss(lp, lp.detach() - 0.3, pb.logp_mu_N.double(),
                                                   pb.adv_N.double(), pb.loss_mask_N, 0.2, 5.0),
}


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_loss_and_grad_invariant_to_micro_batch_split(loss_name):
    vocab = 13
    groups = _groups(seed=3, vocab=vocab)
    trajs = flatten_groups(groups)
    adv_S = group_advantages(rewards_GN(groups), "group_mean").flatten()
    torch.manual_seed(0)
    policy = torch.nn.Embedding(vocab, vocab).double()       # tiny "policy": bigram logits

    def run(bins):
        policy.zero_grad()
        micro = [pack([trajs[i] for i in b], adv_S[b]) for b in bins]
        global_tokens = count_loss_tokens(micro)               # all micro-batches of the step
        total, acc = 0.0, None
        for pb in micro:
            logp_N = token_logprobs(policy(pb.input_ids_N), pb.targets_N)
            out = LOSSES[loss_name](logp_N.double(), pb)
            loss = normalize(out.loss_sum, global_tokens)
            loss.backward()
            total += loss.item()
            acc = out.detach() if acc is None else acc + out.detach()
        return total, policy.weight.grad.clone(), acc

    full_loss, full_grad, full_out = run([list(range(len(trajs)))])
    bins = token_budget_bins([t.num_tokens for t in trajs], max_tokens=12)
    assert len(bins) > 3
    micro_loss, micro_grad, micro_out = run(bins)
    assert micro_loss == pytest.approx(full_loss, rel=1e-10)
    torch.testing.assert_close(micro_grad, full_grad, rtol=1e-10, atol=1e-12)
    assert full_grad.abs().sum() > 0
    assert int(micro_out.tokens) == int(full_out.tokens)
    assert micro_out.is_ratio_max.item() == pytest.approx(full_out.is_ratio_max.item())


def test_nonfinite_steps_are_skipped_counted_and_abort_after_k_in_a_row():
    from trainer.step import NonFiniteGuard, StepResult
    guard = NonFiniteGuard(max_in_a_row=3)
    ok, bad = StepResult({}, 1.0, False, 1e-3), StepResult({}, float("nan"), True, 1e-3)
    for r in (bad, bad, ok, bad, bad):  # never 3 in a row: counted, not fatal
        guard.check(r)
    assert guard.total == 4 and guard.in_a_row == 2
    with pytest.raises(FloatingPointError, match="3 trainer steps in a row.*max_nonfinite_steps"):
        guard.check(bad)


def test_train_step_skips_a_nonfinite_update():
    """A NaN loss leaves the parameters untouched and reports the step as skipped."""
    import torch
    from trainer.batch import Group, Trajectory
    from trainer.step import train_step
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(5, 7))

    def forward(input_ids_N, seq_lens=None, seq_parents=None):
        return model.w[input_ids_N] * float("nan")  # [N, 7] logits, all NaN
    model.forward = forward
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = step_cfg(trainer={"grad_clip": 1.0})
    trajs = [Trajectory(0, i, [1, 2], [3, 4], [-1.0, -1.0], [0, 0], float(i), "stop") for i in range(2)]
    res = train_step(model, opt, sched, [Group(0, trajs)], cfg, None, "cpu", 0)
    assert res.skipped and torch.equal(model.w, torch.zeros(5, 7))


def test_train_step_entropy_bonus_adds_coef_times_entropy_gradient():
    """algo.entropy_coef: the step's gradient is the policy loss's minus coef * grad(sum of token
    entropies) / global tokens, checked against the entropy gradient computed by hand."""
    from trainer.batch import Group, Trajectory
    from trainer.step import train_step
    trajs = [Trajectory(0, i, [1, 2], [3, 4, 0], [-1.2, -0.7, -2.0], [0, 0, 0], float(i), "stop")
             for i in range(2)]

    def grad_after_step(coef):
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.randn(5, 7, dtype=torch.float64))
        model.forward = lambda input_ids_N, seq_lens=None, seq_parents=None: model.w[input_ids_N]
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        cfg = step_cfg(entropy_coef=coef)
        grads = []
        opt.register_step_pre_hook(lambda *_: grads.append(model.w.grad.clone()))  # at the update
        res = train_step(model, opt, sched, [Group(0, trajs)], cfg, None, "cpu", 0)
        return model.w.detach(), grads[0], res

    w, g0, res0 = grad_after_step(0.0)
    _, g1, res1 = grad_after_step(0.3)
    # Hand entropy gradient: each loss token's input id i (inputs 2, 3, 4 predict 3, 4, 0) has a row
    # of logits w[i]; dH/dw[i] = -p (log p + H) per occurrence; 6 loss tokens in the step.
    expect = torch.zeros_like(w)
    for i in (2, 3, 4):
        p = torch.softmax(w[i], -1)
        h = -(p * p.log()).sum()
        expect[i] += 2 * (-p * (p.log() + h))        # two trajectories, the same tokens
    torch.testing.assert_close(g1 - g0, -0.3 * expect / 6, atol=1e-7, rtol=1e-5)  # fp32 log-softmax
    assert res0.stats["entropy_sum"] == pytest.approx(res1.stats["entropy_sum"])
    assert res0.stats["loss_sum"] == pytest.approx(res1.stats["loss_sum"])


def test_train_step_same_with_shared_prompts(family, tmp_path):
    """trainer.share_prompts changes how much is computed, not what: a real tiny model's step
    stats and updated parameters match the step with every sample packed whole (groups of 3
    samples of different lengths; Mistral's window of 8 crossed)."""
    from config import load_config
    from model import load_pretrained
    from tests import tiny
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.step import micro_batches, train_step
    tiny.save_hf(family, tmp_path)
    rng = random.Random(1)
    groups = []
    for pid in range(3):
        prompt = [rng.randrange(tiny.VOCAB) for _ in range(4 + 3 * pid)]
        trajs = [Trajectory(pid, j, prompt, [rng.randrange(tiny.VOCAB) for _ in range(c)],
                            [-rng.uniform(0.5, 3.0) for _ in range(c)], [0] * c, float(j), "stop")
                 for j, c in enumerate((3, 7, 7))]
        groups.append(Group(pid, trajs))

    def step(share):
        cfg = load_config(None, [f"--trainer.share_prompts={str(share).lower()}",
                                 "--trainer.lr=1e-2", "--trainer.eps=1e-2", "--algo.rho=1.5"])
        torch.manual_seed(0)
        model = load_pretrained(tmp_path, dtype="float32")
        opt = build_optimizer(model, cfg.trainer)
        res = train_step(model, opt, build_scheduler(opt, cfg.trainer), groups, cfg, None, "cpu", 0)
        tokens = sum(b.num_tokens for b in micro_batches(groups, "group_mean", 4096, share))
        return res, dict(model.named_parameters()), tokens

    (shared, p_shared, n_shared), (whole, p_whole, n_whole) = step(True), step(False)
    # per group: the prompt once, not 3 times, less its last token (in each sample instead of
    # each sample's last, which predicts nothing): 2 * (4 + 7 + 10) + 3 tokens fewer
    assert n_shared == n_whole - 45
    for key, value in whole.stats.items():
        assert shared.stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert shared.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    for name, p in p_whole.items():
        torch.testing.assert_close(p_shared[name], p, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in
               zip(p_whole.values(), load_pretrained(tmp_path, dtype="float32").parameters()))


@pytest.mark.parametrize("estimator,direction", [("k1", "forward"), ("k2", "forward"),
                                                 ("k3", "reverse")])
def test_kl_penalty_gradient_in_expectation(estimator, direction):
    """The KL term's gradient over the logits z of a categorical pi, in expectation over a token
    y ~ pi (exact enumeration, float64): k1 and k2 give grad KL(pi || ref), k3 grad KL(ref || pi).
    k1's own gradient, -grad log pi(y), is zero in expectation: it regularised nothing."""
    z = torch.tensor([0.3, -1.2, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.2, 1.0], dtype=torch.float64), -1)
    logp = torch.log_softmax(z, -1)
    pi = logp.exp().detach()
    expected = torch.zeros_like(z)
    for y in range(4):
        term = kl_penalty(logp[y:y + 1], ref[y:y + 1], torch.tensor([True]), estimator)
        expected += pi[y] * torch.autograd.grad(term, z, retain_graph=True)[0]
    p, r = logp.exp(), ref.exp()
    kl = (p * (logp - ref)).sum() if direction == "forward" else (r * (ref - logp)).sum()
    torch.testing.assert_close(expected, torch.autograd.grad(kl, z)[0])
    # the value is still the estimator's: k1 = logp - ref
    assert kl_penalty(logp[:1], ref[:1], torch.tensor([True]), estimator).item() == pytest.approx(
        {"k1": (logp[0] - ref[0]).item(), "k2": 0.5 * (logp[0] - ref[0]).item() ** 2,
         "k3": math.expm1((ref[0] - logp[0]).item()) - (ref[0] - logp[0]).item()}[estimator])


def step_cfg(temperature: float = 1.0, trainer: dict | None = None, **algo):
    """A train_step config: config.Config's defaults (as a run's), with micro-batches of 64
    tokens and no gradient clipping unless `trainer` says otherwise; `algo` overrides its keys."""
    import dataclasses
    import types
    from config import Config
    c = Config()
    return types.SimpleNamespace(
        algo=dataclasses.replace(c.algo, **algo),
        generator=dataclasses.replace(c.generator, temperature=temperature),
        trainer=dataclasses.replace(c.trainer, **{"micro_batch_tokens": 64, "grad_clip": 1e9,
                                                  **(trainer or {})}))


def _one_token_step_cfg(**algo):
    return step_cfg(**{"loss": "ppo", **algo})


@pytest.mark.parametrize("token_is,coef", [("none", -1.25), ("truncate", -1.25), ("mask", -1.25),
                                           ("truncate@1.1", -1.1), ("mask@1.1", 0.0)])
def test_ppo_token_is_weights_the_gradient_once(token_is, coef):
    """loss='ppo' with token IS (verl's TIS): d loss / d logp = -min(pi/mu, cap) * A (mask: 0 above
    the cap). It clipped around mu and multiplied by pi/mu again: (pi/mu)^2 = -1.5625 here."""
    from trainer.step import _loss
    mode, _, cap = token_is.partition("@")
    acfg = _one_token_step_cfg(token_is=mode, token_is_cap=float(cap or 5.0), clip_eps=0.5).algo
    logp = torch.tensor([LN(0.5)], requires_grad=True)  # pi = 0.5, mu = 0.4: pi/mu = 1.25
    batch = trainer.batch.PackedBatch.__new__(trainer.batch.PackedBatch)
    batch.loss_mask_N, batch.logp_mu_N, batch.adv_N = (torch.tensor([True]),
                                                       torch.tensor([LN(0.4)]), torch.tensor([1.0]))
    _loss(acfg, logp, batch).loss_sum.backward()
    assert logp.grad.item() == pytest.approx(coef)


def test_train_step_at_temperature_zero_uses_the_generators_recorded_temperature():
    """generator.temperature = 0 samples greedily and records mu at T = 1 (rollout/sampling.py);
    the trainer raised 'temperature must be positive' at its first step. It now takes T = 1."""
    from trainer.step import train_step
    trajs = [Trajectory(0, i, [1, 2], [3, 4], [-1.2, -0.7], [0, 0], float(i), "stop")
             for i in range(2)]
    results = {}
    for temperature in (0.0, 1.0):
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.randn(5, 7))
        model.forward = lambda input_ids_N, seq_lens=None, seq_parents=None: model.w[input_ids_N]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        cfg = step_cfg(temperature=temperature)
        train_step(model, opt, sched, [Group(0, trajs)], cfg, None, "cpu", 0)
        results[temperature] = model.w.detach()
    assert torch.equal(results[0.0], results[1.0])


def _embedding_policy(seed=0):
    """A 'model' whose logits are rows of one matrix, picked by the input ids (float64)."""
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(6, 7, dtype=torch.float64))
    model.forward = lambda input_ids_N, seq_lens=None, seq_parents=None: model.w[input_ids_N]
    return model


def _step_cfg(loss, updates, **algo):
    return step_cfg(trainer={"updates_per_step": updates}, loss=loss, clip_eps=0.05, **algo)


def _two_groups():
    return [Group(g, [Trajectory(g, i, [1, 2 + g], [3, 4 - i, 5 - g], [-1.9, -0.4, -2.3],
                                 [0, 0, 0], float(i + g * i), "stop") for i in range(3)])
            for g in range(2)]


def test_updates_per_step_trains_the_step_in_minibatches():
    """trainer.updates_per_step = 2: one update per half of the groups, each normalised by its own
    tokens; for AIPO exactly two one-update steps in a row, for decoupled PPO the second update's
    pi_prox is the policy before the first (its trust region acts: u != 1 there)."""
    import trainer.step as S
    groups = _two_groups()

    def run(loss, updates, parts):
        model = _embedding_policy()
        opt = torch.optim.SGD(model.parameters(), lr=4.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        res = [S.train_step(model, opt, sched, p, _step_cfg(loss, updates), None, "cpu", 0)
               for p in parts]
        return model.w.detach(), res
    two, _ = run("aipo", 2, [groups])
    seq, _ = run("aipo", 1, [groups[:1], groups[1:]])
    assert torch.equal(two, seq)
    assert not torch.equal(two, run("aipo", 1, [groups])[0])
    # decoupled PPO by hand: update 1 as a one-update step, update 2 against the first policy
    w, res = run("decoupled_ppo", 2, [groups])
    model = _embedding_policy()
    batch = S.micro_batches(groups[1:], "group_mean", 64)[0]
    with torch.no_grad():
        prox = S.policy_logp(model, batch, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=4.0)
    S.train_step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), groups[:1],
                 _step_cfg("decoupled_ppo", 1), None, "cpu", 0)
    logp = S.policy_logp(model, batch, 1.0)
    out = trainer.losses.decoupled_ppo_loss(logp, prox, batch.logp_mu_N, batch.adv_N,
                                            batch.loss_mask_N, 0.05, 5.0)
    (out.loss_sum / batch.loss_mask_N.sum()).backward()
    with torch.no_grad():
        model.w -= 4.0 * model.w.grad
    torch.testing.assert_close(w, model.w.detach(), rtol=0, atol=1e-12)
    assert res[0].stats["clipped"] > 0  # u moved past 1 +- clip_eps after the first update


def test_a_step_with_a_nonfinite_update_among_others_is_not_skipped():
    """updates_per_step = 2, the first update's loss NaN (a NaN behaviour log-prob), the second
    finite: the second moves the weights, so the step is not 'skipped' (the non-finite guard
    counted such steps and could abort a run whose weights still moved); its grad_norm is NaN."""
    import trainer.step as S
    groups = _two_groups()
    t = groups[0].trajectories[0]
    groups[0].trajectories[0] = dataclasses.replace(t, logp_mu=[float("nan")] + t.logp_mu[1:])
    model = _embedding_policy()
    before = model.w.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    res = S.train_step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), groups,
                       _step_cfg("aipo", 2), None, "cpu", 0)
    assert not res.skipped and math.isnan(res.grad_norm)
    assert not torch.equal(model.w.detach(), before)
    everything_bad = _two_groups()
    for g in everything_bad:
        g.trajectories[0] = dataclasses.replace(g.trajectories[0], logp_mu=[float("nan")] * 3)
    res = S.train_step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       everything_bad, _step_cfg("aipo", 2), None, "cpu", 0)
    assert res.skipped


def test_a_masked_token_adds_nothing_even_where_its_ratio_overflows():
    """token_is='mask' drops a token by weight 0; with A < 0 and pi/mu past float32's range its
    surrogate is inf, and 0 * inf made the whole loss NaN (the step skipped)."""
    logp = torch.tensor([0.0, -0.6], requires_grad=True)
    mu = torch.tensor([-100.0, -0.6])  # pi/mu = e^100 on the first token
    mask = torch.tensor([True, True])
    weight = trainer.losses.token_is(logp, mu, "mask", 5.0)
    out = ppo_clip_loss(logp, mu, torch.tensor([-1.0, -1.0]), mask, 0.2, is_weight_N=weight)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and out.loss_sum.item() == pytest.approx(1.0)
    assert logp.grad.tolist() == [0.0, pytest.approx(1.0)]


# -- extreme ratios and the dual clip --------------------------------------------------------------
E20 = math.exp(20.0)  # losses.LOG_RATIO_MAX: the ratio's cap


def test_naive_ppo_with_a_negative_advantage_stays_finite_where_pi_over_mu_overflows():
    """Naive PPO (pi_old = mu), A < 0 and pi/mu = e^100, past float32's range: u was inf, the
    loss inf and the step skipped. The ratio is capped at e^20 (no gradient above); the other
    token's value and gradient are as before: u = 1.1, loss 1.1, d loss / d logp = u = 1.1."""
    logp = torch.tensor([0.0, LN(1.1)], requires_grad=True)
    out = ppo_clip_loss(logp, torch.tensor([-100.0, 0.0]), torch.tensor([-1.0, -1.0]),
                        torch.ones(2, dtype=torch.bool), eps=0.2)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and out.loss_sum.item() == pytest.approx(E20 + 1.1)
    assert logp.grad.tolist() == [0.0, pytest.approx(1.1)]
    assert out.is_ratio_max.item() == pytest.approx(E20) and int(out.clipped_count) == 0
    # decoupled PPO: pi/pi_prox = e^100 after an update (behaviour weight 1: mu = pi_prox)
    logp = torch.tensor([0.0, LN(1.1)], requires_grad=True)
    prox = torch.tensor([-100.0, 0.0])
    out = decoupled_ppo_loss(logp, prox, prox, torch.tensor([-1.0, -1.0]),
                             torch.ones(2, dtype=torch.bool), eps=0.2, prox_cap=None)
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(E20 + 1.1)
    assert logp.grad.tolist() == [0.0, pytest.approx(1.1)]


def test_a_train_step_with_an_overflowing_ratio_is_not_skipped():
    """The same through train_step (naive PPO): one token's mu of e^-100 made the step's loss inf,
    so no update at all (`skipped`, and K such steps in a row abort the run)."""
    import trainer.step as S
    groups = _two_groups()
    t = groups[0].trajectories[0]  # reward 0 of [0, 1, 2]: A = -1
    groups[0].trajectories[0] = dataclasses.replace(t, logp_mu=[-100.0] + t.logp_mu[1:])
    model = _embedding_policy()
    before = model.w.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    res = S.train_step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), groups,
                       _step_cfg("ppo", 1), None, "cpu", 0)
    assert not res.skipped and math.isfinite(res.grad_norm)
    assert not torch.equal(model.w.detach(), before)


def test_aipo_and_mismatch_kl_metrics_stay_finite_where_pi_over_mu_overflows():
    """AIPO's ratio metrics (is_ratio_sum/max) and mismatch_kl took exp of pi/mu = e^100: inf in
    metrics.jsonl and TensorBoard, where PPO's read e^20 (and mismatch_kl goes on as k3 does, on
    exp's tangent). The weight (rho) and gradient as before."""
    logp = torch.tensor([0.0, LN(1.5)], requires_grad=True)
    mu, mask = torch.tensor([-100.0, 0.0]), torch.ones(2, dtype=torch.bool)
    out = aipo_loss(logp, mu, torch.tensor([1.0, 1.0]), mask, rho=2.0)
    out.loss_sum.backward()
    assert logp.grad.tolist() == [-2.0, -1.5]  # weight min(ratio, rho): 2 and 1.5
    assert out.is_ratio_max.item() == pytest.approx(E20)
    assert out.is_ratio_sum.item() == pytest.approx(E20 + 1.5) and int(out.truncated_count) == 1
    # k3 = r - 1 - log r, r past e^20 as exp's tangent there: it keeps rising with log r
    assert mismatch_kl(logp, mu, mask).item() == pytest.approx(E20 * 81 - 101 + 0.5 - LN(1.5))
    assert mismatch_kl(logp, mu - 10, mask) > mismatch_kl(logp, mu, mask)


def test_k3_past_float32s_range_stays_finite_and_pulls_toward_the_reference():
    """k3 = e^d - d - 1, d = log ref - log pi: a token the policy gives e^-100 of the reference's
    probability made it inf and the step skipped. Above d = 20 it goes on as its tangent there:
    finite, and its gradient in logp still negative (minimising raises logp toward the reference;
    a cap on d alone left -d's +1). Below 20, value and gradient are exp's own."""
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, 0.0])
    kl = kl_penalty(logp, ref, torch.ones(2, dtype=torch.bool), "k3")
    kl.backward()
    assert kl.item() == pytest.approx(E20 * (1 + 80) - 100 - 1 + (math.e - 1 - 1))
    assert logp.grad.tolist() == [pytest.approx(-E20 + 1), pytest.approx(-math.e + 1)]


def test_dual_clip_known_numbers():
    """eps 0.2, c 3; rows (u, A) -> surrogate, d loss / d logp (loss = -surrogate):
    (4, -1) -> max(-4, -3) = -3, 0 | (2, -1) -> -2, +2 | (4, +1) -> 1.2, 0 (the clip) |
    (0.5, -1) -> -0.8, 0 (the clip) | (e^100, -1) -> -3, 0. Without the dual clip the first is
    -4 with gradient +4 and the last -e^20 (the cap)."""
    u = [4.0, 2.0, 4.0, 0.5]
    logp_old = torch.tensor([0.0, 0.0, 0.0, 0.0, -100.0], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(5, dtype=torch.bool)

    def run(**kw):
        logp = torch.tensor([LN(x) for x in u] + [0.0], dtype=torch.float64, requires_grad=True)
        out = ppo_clip_loss(logp, logp_old, adv, mask, eps=0.2, **kw)
        out.loss_sum.backward()
        return out, logp.grad.tolist()
    out, grad = run(dual_clip_c=3.0)
    assert out.loss_sum.item() == pytest.approx(3 + 2 - 1.2 + 0.8 + 3)
    assert grad == pytest.approx([0.0, 2.0, 0.0, 0.0, 0.0])
    assert int(out.clipped_count) == 4
    out, grad = run()
    assert out.loss_sum.item() == pytest.approx(4 + 2 - 1.2 + 0.8 + E20)
    assert grad == pytest.approx([4.0, 2.0, 0.0, 0.0, 0.0]) and int(out.clipped_count) == 2
    with pytest.raises(ValueError, match=r"dual clip c=1.1 must exceed 1 \+ eps = 1.2"):
        run(dual_clip_c=1.1)


def test_decoupled_dual_clip_is_ppos_when_prox_equals_behaviour():
    g = torch.Generator().manual_seed(1)
    logp_prox_N = -torch.rand(64, generator=g, dtype=torch.float64) * 3
    logp_N = logp_prox_N + torch.randn(64, generator=g, dtype=torch.float64) * 1.5  # u up to ~e^4
    adv_N = torch.randn(64, generator=g, dtype=torch.float64)
    mask_N = torch.rand(64, generator=g) > 0.2
    a, b = logp_N.clone().requires_grad_(), logp_N.clone().requires_grad_()
    dec = decoupled_ppo_loss(a, logp_prox_N, logp_prox_N, adv_N, mask_N, 0.2, 5.0, dual_clip_c=3.0)
    ppo = ppo_clip_loss(b, logp_prox_N, adv_N, mask_N, 0.2, dual_clip_c=3.0)
    dec.loss_sum.backward(); ppo.loss_sum.backward()
    assert dec.loss_sum.item() == pytest.approx(ppo.loss_sum.item())
    torch.testing.assert_close(a.grad, b.grad)
    dual = mask_N & (adv_N < 0) & ((logp_N - logp_prox_N).exp() > 3)
    assert dual.any() and int(dec.clipped_count) == int(ppo.clipped_count)
    assert (a.grad[dual] == 0).all()


@pytest.mark.parametrize("dual,coef", [(0.0, 4.0), (3.0, 0.0)])
def test_step_passes_algo_dual_clip_c_to_the_ppo_loss(dual, coef):
    """algo.dual_clip_c reaches the loss: naive PPO, pi/mu = 0.8/0.2 = 4, A = -1: d loss / d logp
    = u = 4 without the dual clip, 0 with c = 3."""
    from trainer.step import _loss
    acfg = _one_token_step_cfg(dual_clip_c=dual).algo
    logp = torch.tensor([LN(0.8)], requires_grad=True)
    batch = trainer.batch.PackedBatch.__new__(trainer.batch.PackedBatch)
    batch.loss_mask_N, batch.logp_mu_N, batch.adv_N = (
        torch.tensor([True]), torch.tensor([LN(0.2)]), torch.tensor([-1.0]))
    _loss(acfg, logp, batch).loss_sum.backward()
    assert logp.grad.item() == pytest.approx(coef)


def test_the_kl_term_is_not_importance_weighted_off_policy():
    """The decision in losses.kl_penalty's docstring: off policy (mu != pi, AIPO weights up to
    rho) the step's gradient is AIPO's plus kl_coef times the unweighted k3 term's."""
    import trainer.step as S
    groups = _two_groups()  # logp_mu far from the random policy's log-probs: weights != 1
    cfg = _step_cfg("aipo", 1, kl_coef=0.5, kl_estimator="k3")
    model, ref = _embedding_policy(0), _embedding_policy(1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    S.train_step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), groups, cfg,
                 None, "cpu", 0, ref_model=ref)
    hand = _embedding_policy(0)
    batch = S.micro_batches(groups, "group_mean", 64, True)[0]
    logp = S.policy_logp(hand, batch, 1.0)
    m = batch.loss_mask_N
    out = aipo_loss(logp, batch.logp_mu_N, batch.adv_N, m, rho=4.0)
    weights = (logp.detach() - batch.logp_mu_N)[m].exp()
    assert (weights - 1).abs().max() > 0.5  # off policy indeed
    kl = kl_penalty(logp, S.policy_logp(ref, batch, 1.0).detach(), m, "k3")
    ((out.loss_sum + 0.5 * kl) / m.sum()).backward()
    with torch.no_grad():
        hand.w -= hand.w.grad
    torch.testing.assert_close(model.w.detach(), hand.w.detach(), rtol=0, atol=1e-12)


# -- pi_prox on data-parallel ranks ----------------------------------------------------------------
def _uneven_groups():
    """4 groups of 2 samples; groups 0 and 2 (data-parallel rank 0's, one per update) pack to 2
    micro-batches of 20 tokens, groups 1 and 3 (rank 1's) to 1."""
    from tests import tiny
    g = torch.Generator().manual_seed(0)
    groups = []
    for pid, c in enumerate([15, 7, 15, 7]):
        prompt = torch.randint(3, tiny.VOCAB, (6,), generator=g).tolist()
        groups.append(Group(pid, [Trajectory(pid, s, prompt,
                                             torch.randint(3, tiny.VOCAB, (c,), generator=g).tolist(),
                                             [-1.0] * c, [0] * c, float(s), "stop")
                                  for s in range(2)]))
    return groups


def _prox_step(folder, parallelize=None, group=None, shard=(0, 1)):
    from config import load_config
    from model.hf_io import load_model_args
    from parallel.sharding import build_model
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.step import train_step
    cfg = load_config(None, ["--trainer.micro_batch_tokens=20", "--trainer.lr=1e-2",
                             "--trainer.eps=1e-2", "--algo.loss=decoupled_ppo",
                             "--trainer.updates_per_step=2"])
    model = build_model(load_model_args(folder), torch.device("cpu"), torch.float32,
                        parallelize=parallelize, path=folder)
    opt = build_optimizer(model, cfg.trainer)
    res = train_step(model, opt, build_scheduler(opt, cfg.trainer), _uneven_groups(), cfg, group,
                     "cpu", 0, shard=shard)
    return model, res


def _prox_fsdp_worker(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    import parallel.sharding as sh
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    model, res = _prox_step(folder, lambda m: sh.parallelize_trainer(m, mesh, units="layer"),
                            mesh["fsdp"].get_group(), (rank, world))
    return {"norm": res.grad_norm, **{n: p.detach().full_tensor() if isinstance(p, DTensor)
                                      else p.detach() for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_prox_forwards_pad_to_the_busiest_ranks_micro_batches(tmp_path):
    """decoupled PPO with trainer.updates_per_step = 2 on 2 FSDP ranks (per-layer units, the GPU
    default), rank 0 with 2 micro-batches an update and rank 1 with 1: the pi_prox forwards ran
    once per real micro-batch, so rank 1 did one forward (one round of all-gathers) fewer and
    both hung in the next backward. The step now equals one process's."""
    from tests import tiny
    from tests.dist import run_ranks
    from trainer.step import micro_batches, minibatches
    tiny.save_hf("llama3", tmp_path)
    counts = [[len(micro_batches(p, "group_mean", 20, True))
               for p in minibatches(_uneven_groups(), 2, (r, 2))] for r in range(2)]
    assert counts == [[2, 2], [1, 1]]
    ref, ref_res = _prox_step(str(tmp_path))
    for res in run_ranks(_prox_fsdp_worker, 2, str(tmp_path), timeout=120):
        assert res["norm"] == pytest.approx(ref_res.grad_norm, rel=1e-5)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(res[name], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss,onpolicy", [("aipo", 9), ("decoupled_ppo", 18)])
def test_mismatch_kl_reads_the_weights_that_sampled_the_tokens(loss, onpolicy):
    """mismatch_kl compares mu with the trainer's log-probs of the same weights. mu here is the
    policy's own (no mismatch at all); with trainer.updates_per_step = 2 the second update's
    forward ran the weights the first had moved, and mismatch_kl read 0.016 a token. Now it reads
    pi_prox (decoupled PPO: every token) or the first update only (AIPO: its 9 tokens)."""
    import trainer.step as S
    model = _embedding_policy()
    groups = []
    for g in _two_groups():
        batch = S.micro_batches([g], "group_mean", 64, share_prompts=False)[0]
        with torch.no_grad():
            lp = S.policy_logp(model, batch, 1.0)[batch.loss_mask_N].view(3, 3).tolist()
        groups.append(Group(g.prompt_id, [dataclasses.replace(t, logp_mu=m)
                                          for t, m in zip(g.trajectories, lp)]))
    opt = torch.optim.SGD(model.parameters(), lr=4.0)
    res = S.train_step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), groups,
                       _step_cfg(loss, 2), None, "cpu", 0)
    assert res.stats["tokens"] == 18  # both updates' tokens trained
    assert res.stats["onpolicy_tokens"] == onpolicy
    assert res.stats["mismatch_kl_sum"] == pytest.approx(0.0, abs=1e-12)
