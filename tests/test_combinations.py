"""Rarely combined training options: what each combination does, checked by hand, and one
end-to-end run of many of them at once. A matrix of ~75 short runs of such combinations found
two that could not train as asked: naive PPO with top-k/top-p sampling (now refused) and groups
that cannot differ, n_samples = 1 or greedy sampling (preflight warns: tests/test_bad_input.py).
"""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

import trainer.batch
from config import ConfigError, load_config
from rollout.sampling import process_logits
from tests.dist import run_captured
from tests.test_losses import _embedding_policy, step_cfg
from trainer.advantages import group_advantages
from trainer.batch import Group, Trajectory

ROOT = Path(__file__).resolve().parent.parent


# -- generator.n_samples = 1 -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["group_mean", "grpo", "rloo"])
def test_one_sample_a_prompt_gives_every_baseline_a_zero_advantage(kind):
    """Every algo.advantage is a group baseline: with n = 1 the sample is its group's mean, so its
    advantage is exactly 0 whatever the reward (rloo is refused for it; group_mean and grpo, which
    give the same zeros, are not)."""
    rewards = torch.tensor([[0.3], [-2.0], [7.5], [0.0]])
    assert torch.equal(group_advantages(rewards, kind), torch.zeros(4, 1))


@pytest.mark.parametrize("loss", ["aipo", "ppo", "decoupled_ppo"])
def test_one_sample_a_prompt_trains_nothing_without_kl_or_entropy(loss):
    """n_samples = 1, group_mean (accepted by the config today): the policy loss is 0 and its
    gradient too, so a step with no KL and no entropy term leaves the weights where they were,
    whatever the rewards. What a run with --generator.n_samples=1 silently does."""
    from trainer.step import train_step
    groups = [Group(g, [Trajectory(g, 0, [1, 2 + g], [3, 4, 5 - g], [-1.9, -0.4, -2.3],
                                   [0, 0, 0], float(3 * g + 1), "stop")]) for g in range(3)]
    model = _embedding_policy()
    before = model.w.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=10.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    res = train_step(model, opt, sched, groups, step_cfg(loss=loss), None, "cpu", 0)
    assert res.stats["loss_sum"] == 0.0 and res.grad_norm == 0.0
    assert torch.equal(model.w.detach(), before)


def test_the_rloo_refusal_does_not_suggest_another_baseline_that_is_zero_too():
    """It suggested --algo.advantage=group_mean, whose advantages are as zero at n_samples=1."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--generator.n_samples=1", "--algo.advantage=rloo"])
    assert "advantage=group_mean" not in str(e.value), str(e.value)
    assert "--generator.n_samples=4" in str(e.value)


# -- naive PPO with top-k / top-p sampling ---------------------------------------------------------
def _truncated_on_policy_token():
    """One on-policy token sampled under top_k=2 of 8: pi its untruncated probability at the
    weights that sampled it, mu the truncated (renormalised) one the generator records."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.8, 0.5, 0.2, 0.0, -0.5]])
    token = 1                                                   # inside the top 2
    logp_pi = torch.log_softmax(logits, -1)[0, token]
    logp_mu = process_logits(logits, top_k=2)[0, token]
    return logp_pi, logp_mu


def _one_token_batch(logp_mu, adv):
    batch = trainer.batch.PackedBatch.__new__(trainer.batch.PackedBatch)
    batch.loss_mask_N = torch.tensor([True])
    batch.logp_mu_N = logp_mu.reshape(1).detach()
    batch.adv_N = torch.tensor([adv])
    return batch


def test_top_k_sampling_clips_naive_ppos_negative_advantages_on_policy():
    """On policy (max_staleness=0, one update, fp32) naive PPO (token_is='none', pi_old = mu)
    clips around the truncated mu: pi/mu = top-k mass < 1 - clip_eps here, so every A < 0 token
    gets no gradient (the 3-rank run at top_k=5 logged clipped_frac 0.09 on policy), and only
    A > 0 tokens learn. PPO with token IS clips around pi_prox = pi instead: both keep it."""
    from trainer.step import _loss
    logp_pi, logp_mu = _truncated_on_policy_token()
    ratio = float((logp_pi - logp_mu).exp())
    assert ratio < 0.8  # the top-2 mass: the clip's lower edge at clip_eps 0.2
    grads = {}
    for token_is in ("none", "truncate"):
        acfg = step_cfg(loss="ppo", token_is=token_is).algo
        for adv in (1.0, -1.0):
            logp = logp_pi.clone().reshape(1).requires_grad_()
            out = _loss(acfg, logp, _one_token_batch(logp_mu, adv))
            out.loss_sum.backward()
            grads[token_is, adv] = (float(logp.grad), int(out.clipped_count))
    # token IS: weight min(pi/mu, cap) = ratio, u = 1: d loss / d logp = -ratio * A, nothing clipped
    assert grads["truncate", 1.0] == (pytest.approx(-ratio), 0)
    assert grads["truncate", -1.0] == (pytest.approx(ratio), 0)
    assert grads["none", 1.0] == (pytest.approx(-ratio), 0)
    assert grads["none", -1.0] == (0.0, 1)     # the signal the refusal below is about


@pytest.mark.parametrize("sampling", ["--generator.top_k=5", "--generator.top_p=0.5"])
def test_naive_ppo_with_truncated_sampling_is_refused(sampling):
    """Accepted, it clipped every A < 0 token on policy (above). top_p keeps a mass >= top_p, so
    pi/mu >= top_p on policy: top_p >= 1 - clip_eps never clips and stays accepted; top_k's kept
    mass has no floor. Greedy sampling records the untruncated mu: accepted too."""
    load_config(None, ["--algo.loss=ppo", "--algo.token_is=truncate", sampling])  # the fix: fine
    load_config(None, ["--algo.loss=ppo", "--generator.top_p=0.9"])  # >= 1 - clip_eps = 0.8
    load_config(None, ["--algo.loss=ppo", "--generator.greedy=true", sampling])
    with pytest.raises(ConfigError, match=r"algo.loss='ppo' with algo.token_is='none' clips pi/mu "
                                          r"around the generator's mu, .* set "
                                          r"--algo.token_is=truncate .* or --algo.loss=aipo"):
        load_config(None, ["--algo.loss=ppo", sampling])


# -- one run of many rare options at once -----------------------------------------------------------
@pytest.mark.slow
def test_rare_options_together_end_to_end(tmp_path):
    """Split mode, 3 ranks: max_staleness=3, PPO with token_is='mask' and the dual clip, two
    updates a step, 8-token micro-batches, per-layer FSDP units, grpo at n_samples=2, k2 KL and an
    entropy bonus, a checkpoint, an HF export and an evaluation every step. Every row finite, in
    range, and every artefact where the README says."""
    from tests.rl_model import make_rl_model
    from trainer.metrics import CONTRACT_KEYS
    model, run_dir, steps = make_rl_model(tmp_path / "model"), tmp_path / "run", 3
    args = ["--config", "configs/tiny_cpu.toml", f"--model.path={model}", f"--run.dir={run_dir}",
            "--trainer.prompts_per_step=4", "--generator.n_samples=2", "--generator.num_slots=16",
            "--generator.max_new_tokens=6", "--parallel.timeout_s=60",
            "--parallel.warmup_timeout_s=120", "--reward.fn=tests.rl_model:length_reward",
            "--trainer.warmup_steps=0", "--eval.num_prompts=8", f"--trainer.max_steps={steps}",
            "--algo.max_staleness=3", "--algo.loss=ppo", "--algo.token_is=mask",
            "--algo.dual_clip_c=3", "--trainer.updates_per_step=2", "--trainer.micro_batch_tokens=8",
            "--parallel.fsdp_units=layer", "--algo.kl_estimator=k2", "--algo.entropy_coef=0.02",
            "--algo.advantage=grpo", "--checkpoint.every_steps=1", "--checkpoint.hf_export_every=1",
            "--eval.every_steps=1", "--logging.tensorboard=false"]
    proc = run_captured([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "3", "train_rl.py", *args], 120, cwd=ROOT,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert set(CONTRACT_KEYS) <= set(r)
        for k, v in r.items():
            assert v is not None or k in ("kl", "mismatch_kl", "generator_sync_s"), (k, r)
            assert not isinstance(v, float) or math.isfinite(v), (k, r)
        for k in ("truncated_frac", "clipped_frac", "finish_length_frac", "reward_zero_std_frac"):
            assert 0 <= r[k] <= 1, (k, r)
        assert r["staleness_max"] <= 3 and r["samples"] == 8 and r["skipped_nonfinite"] == 0
        assert r["completion_len_max"] <= 6 and r["entropy"] > 0
        assert r["kl"] is not None and r["kl"] >= 0  # k2 = d^2 / 2
        assert r["reward_mean"] == pytest.approx(r["completion_len_mean"] / 8)  # length_reward
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == list(range(steps + 1))
    for s in range(1, steps + 1):
        assert (run_dir / "hf" / f"step_{s:06d}" / "config.json").exists()
    assert (run_dir / "checkpoints" / f"step_{steps:06d}").is_dir()
    assert (run_dir / "hf_final" / "config.json").exists()
