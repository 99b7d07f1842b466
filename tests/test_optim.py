"""trainer/optim.py on one process; the sharded gradient norm is checked against a single process
in tests/test_parallel.py (fsdp=2, tp=2, 2 x 2)."""
from __future__ import annotations

import doctest
import json
import math
import types

import pytest
import torch

import trainer.optim
from trainer.checkpointing import keep_config_hyperparameters
from trainer.optim import (build_optimizer, build_scheduler, clip_grad_norm, global_grad_norm,
                           lr_lambda)

TCFG = types.SimpleNamespace(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def test_docstring_examples():
    assert doctest.testmod(trainer.optim).failed == 0


def test_lr_schedule_hand_computed():
    assert [round(lr_lambda(s, 2, 10, "cosine", 0.1), 3) for s in (0, 1, 2, 6, 10)] == \
        [0.5, 1.0, 1.0, 0.55, 0.1]
    assert lr_lambda(5, 2, 10, "constant", 0.1) == 1.0


def test_plain_parameters_get_the_fused_adamw_and_its_update_is_adamw():
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    tcfg = types.SimpleNamespace(**{**vars(TCFG), "weight_decay": 0.1})
    opt = build_optimizer(model, tcfg)
    assert opt.defaults["fused"] is True and opt.defaults["lr"] == 1e-3
    # the weight matrix decays, the bias does not (torch's own AdamW with two groups)
    ref_opt = torch.optim.AdamW([{"params": [ref.weight]}, {"params": [ref.bias], "weight_decay": 0.0}],
                                lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                foreach=False)  # one tensor at a time
    for step in range(3):
        for m in (model, ref):
            m.weight.grad = torch.full((2, 3), 0.5 - step)
            m.bias.grad = torch.tensor([1.0, -2.0]) * (step + 1)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_weight_decay_leaves_norm_gains_and_biases_and_parameters_without_gradients():
    """With zero gradients AdamW's update is zero, so only the decay moves a parameter: a matrix
    by the factor (1 - lr wd) a step, hand computed; a 1-D norm gain or bias not at all; a matrix
    without a gradient (not updated this step) not either. One parameter group: the checkpoint
    layout of a run without weight decay."""
    emb, w, gain, frozen = (torch.nn.Parameter(torch.full(s, 2.0)) for s in ((4, 3), (3, 3), (3,), (2, 2)))
    model = torch.nn.ParameterList([emb, w, gain, frozen])
    opt = build_optimizer(model, types.SimpleNamespace(**{**vars(TCFG), "weight_decay": 0.5}))
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.0
    for _ in range(2):
        for p in (emb, w, gain):
            p.grad = torch.zeros_like(p)
        opt.step()
    decayed = 2.0 * (1 - 1e-3 * 0.5) ** 2
    assert emb.flatten().tolist() == pytest.approx([decayed] * 12, rel=1e-6)
    assert w.flatten().tolist() == pytest.approx([decayed] * 9, rel=1e-6)
    assert gain.tolist() == [2.0] * 3 and frozen.tolist() == [[2.0] * 2] * 2


def test_global_norm_and_clipping_hand_computed():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert global_grad_norm([a.grad, b.grad]).item() == pytest.approx(5.0)
    assert clip_grad_norm([a, b], 10.0).item() == pytest.approx(5.0)  # under the limit: unchanged
    assert a.grad.tolist() == [3.0, 0.0] and b.grad.tolist() == [4.0]
    assert clip_grad_norm([a, b], 1.0).item() == pytest.approx(5.0)  # returns the norm before
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-5)
    assert b.grad.tolist() == pytest.approx([0.8], rel=1e-5)
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0).item() == 0.0  # no grads


# ---- a resume with another trainer.max_steps -----------------------------------------------------
def _cosine(p: float) -> float:
    """The multiplier at cosine progress p with min_lr_ratio 0.1."""
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


def _run(max_steps: int, steps: int, state=None, lr: float = 1e-3, schedule: str = "cosine",
         warmup: int = 2):
    """A model, AdamW and the trainer's schedule (warm-up 2, cosine to 0.1 x at max_steps), resumed
    from `state` as trainer/checkpointing.load does (the state through JSON, as extra.json), then
    `steps` optimizer steps; the lr of each step and the scheduler state at the end."""
    tcfg = types.SimpleNamespace(**{**vars(TCFG), "lr": lr, "warmup_steps": warmup,
                                    "max_steps": max_steps, "schedule": schedule,
                                    "min_lr_ratio": 0.1})
    model = torch.nn.Linear(2, 1)
    opt = build_optimizer(model, tcfg)
    sched = build_scheduler(opt, tcfg)
    if state is not None:
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(json.loads(json.dumps(state["sched"])))
        keep_config_hyperparameters(opt, sched, fresh)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"] / lr)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return lrs, {"opt": opt.state_dict(), "sched": sched.state_dict()}, sched


def test_raising_max_steps_after_the_last_step_keeps_the_lr_at_the_floor():
    """A run of 10 steps ends at min_lr_ratio (0.1 x); resumed with max_steps 20 the cosine was
    recomputed for 20 steps: at step 10 progress 8/18, the lr back up to 0.628 x. It stays at
    the floor now, and the resume says so, naming both totals."""
    lrs, state, _ = _run(10, 10)
    assert lrs[9] == pytest.approx(_cosine(7 / 8))  # the last step's, before the floor
    more, _, sched = _run(20, 10, state)
    assert more == pytest.approx([0.1] * 10)
    assert _cosine(8 / 18) == pytest.approx(0.628, abs=1e-3)  # what it jumped to
    note = sched.resume_note
    assert "trainer.max_steps changed from 10 (the checkpoint's) to 20" in note
    assert "it had ended, so the lr stays at min_lr_ratio=0.1 x trainer.lr" in note
    assert "would have moved to 0.6281 x at once" in note


def test_changing_max_steps_mid_run_stretches_the_rest_of_the_cosine():
    """Stopped at step 6 of 10 (progress (6-2)/8 = 0.5, lr 0.55 x) and resumed for 14: the lr
    goes on from 0.55 x, through progress 0.5 + 0.5 * (s - 6) / 8, to 0.1 x at step 14 (step 10:
    progress 0.75); recomputed for 14 it jumped to 0.775 x (progress 4/12). Resumed again with 14
    the stretched curve is kept; so is a lowered total's squeezed one."""
    _, state, _ = _run(10, 6)
    lrs, state2, sched = _run(14, 4, state)
    assert lrs == pytest.approx([_cosine(0.5 + 0.5 * k / 8) for k in range(4)])
    assert lrs[0] == pytest.approx(0.55) and _cosine(4 / 12) == pytest.approx(0.775)
    assert "from 10 (the checkpoint's) to 14" in sched.resume_note
    assert ("continues where it was: from 0.55 x trainer.lr at optimizer step 6 down to "
            "min_lr_ratio=0.1 x at step 14 (recomputed for 14 steps it would have moved to "
            "0.775 x at once)") in sched.resume_note
    again, _, sched = _run(14, 5, state2)
    assert again == pytest.approx([_cosine(0.75 + 0.5 * k / 8) for k in range(5)])
    assert again[-1] == pytest.approx(0.1) and sched.resume_note is None
    fewer, _, _ = _run(8, 2, state)  # lowered to 8: 0.55 x at step 6, 0.1 x at step 8
    assert fewer == pytest.approx([0.55, _cosine(0.75)])


def test_a_resume_with_the_same_max_steps_is_the_uninterrupted_schedule():
    whole, _, _ = _run(10, 10)
    _, state, _ = _run(10, 4)
    rest, _, sched = _run(10, 6, state)
    assert rest == whole[4:] and sched.resume_note is None  # bitwise
    # a checkpoint of a plain LambdaLR (before the schedule was saved) takes the config's
    _, old, _ = _run(10, 4)
    old["sched"]["lr_lambdas"] = [None]
    assert _run(20, 1, old)[0] == pytest.approx([_cosine(2 / 18)])
    # the constant schedule and a resume inside the warm-up do not depend on the total
    _, early, _ = _run(10, 1)
    assert _run(20, 3, early)[0] == pytest.approx([1.0, _cosine(0), _cosine(1 / 18)])


def test_a_changed_kind_or_warm_up_continues_the_run_s_own_curve():
    """The old curve is the checkpoint's (its kind, warm-up and total), not the config's: a
    constant run resumed as cosine (10 -> 20 steps) fell from 1 x to the cosine's 0.55 x at step
    5 (the config's curve over the old total), and a run that had ended at the floor, resumed
    again with a warm-up of 12 (past its step 10), went back up to 0.99 x in the new warm-up."""
    _, const, _ = _run(10, 5, schedule="constant")
    lrs, _, sched = _run(20, 3, const)  # the decay starts at step 5: 1 x, down to 0.1 x at 20
    assert lrs == pytest.approx([1.0, _cosine(1 / 15), _cosine(2 / 15)])
    assert sched.resume_note.startswith("trainer.schedule changed from 'constant' (the "
                                        "checkpoint's) to 'cosine': the cosine lr schedule "
                                        "continues where it was: from 1 x trainer.lr at "
                                        "optimizer step 5 down to min_lr_ratio=0.1 x at step 20")
    _, ended, _ = _run(10, 10)
    _, again, _ = _run(20, 0, ended)  # resumed once (at the floor), checkpointed at once
    lrs, _, sched = _run(30, 3, again, warmup=12)
    assert lrs == pytest.approx([0.1] * 3) and "it had ended" in sched.resume_note


def test_a_changed_warm_up_alone_keeps_the_run_s_curve():
    """Stopped at step 10 of 20 (warm-up 2: cosine progress 8/18, 0.628 x) and resumed with the
    same max_steps but another warm-up: the cosine was recomputed from the new warm-up, the lr
    jumping to 0.94 x (warm-up 8) or back into a warm-up (12: 11/12 x, then 1 x), with no note.
    It now goes on as uninterrupted and the resume says why; a constant lr does not warm up
    again either."""
    whole, _, _ = _run(20, 13)
    _, state, _ = _run(20, 10)
    for warmup in (8, 12):
        lrs, _, sched = _run(20, 3, state, warmup=warmup)
        assert lrs == pytest.approx(whole[10:]) and lrs[0] == pytest.approx(_cosine(8 / 18))
        assert sched.resume_note.startswith(
            f"trainer.warmup_steps changed from 2 (the checkpoint's) to {warmup}: the cosine lr "
            "schedule continues where it was: from 0.6281 x trainer.lr at optimizer step 10")
    _, const, _ = _run(20, 10, schedule="constant")
    assert _run(20, 2, const, schedule="constant", warmup=12)[0] == pytest.approx([1.0, 1.0])
