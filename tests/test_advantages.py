"""Group advantages against hand-computed values."""
import doctest
import math

import pytest
import torch

import trainer.advantages
from trainer.advantages import group_advantages

KINDS = ["group_mean", "grpo", "rloo"]


def test_docstring_examples():
    assert doctest.testmod(trainer.advantages).failed == 0


def test_group_mean_by_hand():
    r_GN = torch.tensor([[1.0, 2.0, 6.0]])                  # mean 3
    assert group_advantages(r_GN, "group_mean").tolist() == [[-2.0, -1.0, 3.0]]


def test_grpo_uses_population_std():
    r_GN = torch.tensor([[1.0, 2.0, 6.0]])                  # var = (4 + 1 + 9) / 3
    std = math.sqrt(14 / 3)
    expect = [-2 / std, -1 / std, 3 / std]
    assert group_advantages(r_GN, "grpo", eps=0.0)[0].tolist() == pytest.approx(expect, rel=1e-6)


def test_rloo_leave_one_out_by_hand():
    r_GN = torch.tensor([[1.0, 2.0, 6.0]])
    # 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5
    assert group_advantages(r_GN, "rloo")[0].tolist() == pytest.approx([-3.0, -1.5, 4.5])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.3, -7.1])
def test_equal_rewards_give_exact_zero(kind, value):
    r_GN = torch.full((2, 3), value)
    a_GN = group_advantages(r_GN, kind)
    assert not a_GN.isnan().any()
    assert (a_GN == 0).all(), a_GN


@pytest.mark.parametrize("kind", KINDS)
def test_single_sample_groups_give_zero(kind):
    a_GN = group_advantages(torch.tensor([[1.0], [0.0]]), kind)
    assert a_GN.tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize("kind", KINDS)
def test_groups_are_independent_and_zero_mean(kind):
    r_GN = torch.tensor([[1.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 2.0, 4.0, 6.0]])
    a_GN = group_advantages(r_GN, kind)
    assert a_GN.shape == (3, 4)
    assert a_GN.sum(1).abs().max() < 1e-5
    assert (a_GN[1] == 0).all()


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="unknown advantage kind 'ppo'"):
        group_advantages(torch.zeros(1, 2), "ppo")
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        group_advantages(torch.zeros(4), "grpo")


@pytest.mark.parametrize("value", [0.0, 0.3, -7.1])
def test_grpo_without_eps_still_gives_constant_groups_exact_zero(value):
    """eps only pads the std; with eps = 0 (as test_grpo_uses_population_std passes) a constant
    or single-sample group (std 0) gave 0 / 0 = NaN, not the documented exact 0."""
    r_GN = torch.tensor([[value, value, value], [0.0, 1.0, 2.0]])   # row 1: mean 1, var 2/3
    a_GN = group_advantages(r_GN, "grpo", eps=0.0)
    assert a_GN[0].tolist() == [0.0, 0.0, 0.0]
    std = math.sqrt(2 / 3)
    assert a_GN[1].tolist() == pytest.approx([-1 / std, 0.0, 1 / std], rel=1e-6)
    single = group_advantages(torch.tensor([[value], [1.0]]), "grpo", eps=0.0)
    assert single.tolist() == [[0.0], [0.0]]
