"""trainer/optim.py on one process; the sharded gradient norm is checked against a single process
in tests/test_parallel.py (fsdp=2, tp=2, 2 x 2)."""
from __future__ import annotations

import types

import pytest
import torch

from trainer.optim import build_optimizer, clip_grad_norm, global_grad_norm, lr_lambda

TCFG = types.SimpleNamespace(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


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
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1, foreach=False)  # one tensor at a time
    for step in range(3):
        for m in (model, ref):
            m.weight.grad = torch.full((2, 3), 0.5 - step)
            m.bias.grad = torch.tensor([1.0, -2.0]) * (step + 1)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


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
