"""launch/pipeline.py: the generator/trainer recurrence by hand, and its mean step against the
closed forms and against the expected maximum of normal phases."""
from __future__ import annotations

import dataclasses
import math

import pytest

from launch import cost_model as cm
from launch.pipeline import mean_step_s, train_ends


def test_recurrence_by_hand():
    """Generator 1 s per batch, trainer 2 s per step.
    eta = 1: batch 0 ends at 1, step 0 runs 1-3; batch 1 needs no weights (1 - 1 <= 0): 1-2,
    step 1 runs 3-5; batch 2 waits for version 1 (end of step 0, t = 3): 3-4, step 2 runs 5-7.
    eta = 0: every batch waits for the step before it: steps end at 3, 6, 9."""
    gen, train = [[1.0]] * 3, [2.0] * 3
    assert train_ends(gen, train, eta=1) == [3.0, 5.0, 7.0]
    assert train_ends(gen, train, eta=0) == [3.0, 6.0, 9.0]


def test_step_waits_for_the_slowest_replica():
    """Two replicas, 1 s and 3 s for batch 0: the trainer (0.5 s) starts at 3. Batch 1 (1 s
    each, eta = 1, no gate) ends at 2 and 4: step 1 runs 4-4.5."""
    assert train_ends([[1.0, 3.0], [1.0, 1.0]], [0.5, 0.5], eta=1) == [3.5, 4.5]


def test_negative_eta_is_refused():
    with pytest.raises(ValueError, match="eta=-1"):
        train_ends([[1.0]], [1.0], eta=-1)


def test_constant_phases_give_the_closed_forms():
    assert mean_step_s(0.3, 0.2, eta=0, replicas=2) == pytest.approx(0.5)
    assert mean_step_s(0.3, 0.2, eta=1, replicas=2) == 0.3
    assert mean_step_s(0.1, 0.2, eta=4) == 0.2


def test_synchronous_step_is_the_expected_maximum_of_the_replicas():
    """eta = 0, constant trainer: step = E[max of 2 N(mu, sigma)] + T = mu + sigma/sqrt(pi) + T.
    mu = 1, sigma = 0.2, T = 0.5: 1.6128; sampling error of 1900 steps ~ 0.2 * 0.8/sqrt(1900)."""
    got = mean_step_s(1.0, 0.5, eta=0, replicas=2, gen_cv=0.2)
    assert got == pytest.approx(1.0 + 0.2 / math.sqrt(math.pi) + 0.5, abs=0.012)


def test_jitter_costs_most_where_phases_balance_and_eta_absorbs_it():
    balanced = mean_step_s(1.0, 1.0, 1, 2, 0.15, 0.15)
    lopsided = mean_step_s(1.0, 0.6, 1, 2, 0.15, 0.15)
    assert balanced > 1.05  # above max(T_gen, T_train) = 1
    assert lopsided - 1.0 < (balanced - 1.0) / 2
    assert mean_step_s(1.0, 1.0, 4, 2, 0.15, 0.15) < balanced  # slack in the buffer
    assert mean_step_s(1.0, 1.0, 1, 1, 0.15, 0.15) < balanced  # one replica fewer to wait for
    assert mean_step_s(1.0, 1.0, 1, 2, 0.15, 0.15) == balanced  # deterministic


def test_profile_phase_cv_and_the_step():
    """The profile's third concurrency column is the phase cv: interpolated, held beyond its
    ends, 0 for old two-column profiles. A balanced CPU split layout then costs more than the
    processor-sharing closed form; on GPUs (no profile) nothing changes."""
    prof = cm.Profile("toy", "float32", 1, {}, [], [], [], [], [], [], 0.0, [], [], [],
                      concurrency=[[1, 1.0, 0.0], [2, 1.0, 0.1], [4, 2.0, 0.3]])
    assert prof.phase_cv(3) == pytest.approx(0.2) and prof.phase_cv(8) == pytest.approx(0.3)
    assert prof.slowdown(3) == 1.5
    old = cm.Profile("toy", "float32", 1, {}, [], [], [], [], [], [], 0.0, [], [], [],
                     concurrency=[[1, 1.0], [4, 2.0]])
    assert old.phase_cv(4) == 0.0
    cpu, p = cm.cpu_cluster(4, 2), cm.Placement(4, "split", 2, 1, 1)
    closed = cm.step_time(0.1, 0.1, 0.0, 1, p, cpu, old)  # 0.1 * s(4)
    assert closed == pytest.approx(0.2)
    assert cm.step_time(0.1, 0.1, 0.0, 1, p, cpu, prof) > closed * 1.1
    assert cm.step_time(0.1, 0.1, 0.0, 1, p, cm.gpu_cluster("h100", 1)) == 0.1
    # a CPU profile's core sharing does not reach GPUs, a device per rank (an 8B plan on H100s
    # given one ran 8x slower, another placement winning)
    gpu, tp2 = cm.gpu_cluster("h100", 1), cm.Placement(4, "split", 2, 2, 1)
    tp_prof = dataclasses.replace(prof, tp_concurrency=[[2, 1.0], [4, 3.0]])
    assert cm.step_time(0.1, 0.1, 0.0, 1, p, gpu, prof) == 0.1
    assert cm.slowdown(4, gpu, prof) == cm.gen_slowdown(4, 2, gpu, tp_prof) == 1.0
    assert cm.gen_slowdown(4, 2, cpu, tp_prof) == 3.0
    assert cm.step_time(0.1, 0.1, 0.0, 0, tp2, gpu, tp_prof) == pytest.approx(
        cm.step_time(0.1, 0.1, 0.0, 0, tp2, gpu))
