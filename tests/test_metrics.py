"""The trainer's console output: the progress part of each step line and the heartbeat of a long
wait (logging.progress), against hand-computed values with a fake clock."""
import io
import json

import pytest

from trainer.metrics import CONTRACT_KEYS, Heartbeat, MetricsLogger, duration, progress


def test_progress_shows_the_step_of_the_total_and_the_time_left_at_the_recent_pace():
    assert progress(12, 800, [0.5, 1.5]) == "12/800 eta 13m08s"  # 788 steps x 1.0 s
    assert progress(800, 800, [2.0]) == "800/800 eta 0s"
    assert [duration(s) for s in (0.4, 59.6, 61, 3599, 3600, 7322)] == \
        ["0s", "1m00s", "1m01s", "59m59s", "1h00m", "2h02m"]


def test_logger_appends_progress_only_when_asked(tmp_path):
    rows = [dict.fromkeys(CONTRACT_KEYS, 0.0) | {"step": s, "policy_version": s, "staleness_max": 0,
                                                 "time_step_s": t} for s, t in ((1, 9.0), (2, 1.0))]
    # the first step's 9 s sets the pace until another step is in; then it is left out
    rows.append(rows[1] | {"step": 3, "policy_version": 3, "time_step_s": 3.0})
    for total, tail in ((None, None), (5, ["1/5 eta 36s", "2/5 eta 3s", "3/5 eta 4s"])):
        out = io.StringIO()
        logger = MetricsLogger(tmp_path / str(total), tensorboard=False, stream=out, total_steps=total)
        for r in rows:
            logger.log(r)
        logger.close()
        lines = out.getvalue().splitlines()
        assert [ln.split(" | ")[0] for ln in lines] == ["step    1", "step    2", "step    3"]
        if tail is None:
            assert "eta" not in out.getvalue()
        else:
            assert [ln.split(" | ")[-1] for ln in lines] == tail
        assert [json.loads(x)["step"] for x in (tmp_path / str(total) / "metrics.jsonl").open()] == [1, 2, 3]


def test_heartbeat_prints_once_per_interval_and_returns_the_time_to_the_next():
    now = [100.0]
    out = io.StringIO()
    calls = []
    beat = Heartbeat(lambda: calls.append(1) or f"waiting ({len(calls)})", every_s=10.0,
                     stream=out, clock=lambda: now[0])
    assert beat.beat() == 10.0 and out.getvalue() == ""  # nothing before the first interval
    now[0] = 107.5
    assert beat.beat() == 2.5 and out.getvalue() == ""
    now[0] = 112.0
    assert beat.beat() == 10.0
    now[0] = 125.0
    assert beat.beat() == 10.0  # due again: prints, the next one 10 s from now
    assert out.getvalue().splitlines() == ["waiting (1): 12s so far", "waiting (2): 25s so far"]
    off = Heartbeat(lambda: "x", stream=out, clock=lambda: now[0], enabled=False)
    now[0] = 1e6
    assert off.beat() == float("inf") and len(out.getvalue().splitlines()) == 2


def test_the_trainers_waiting_line_says_when_a_generator_is_evaluating():
    from trainer.worker import waiting_line
    assert waiting_line(0, 8, [2], 3, None) == ("step 1: waiting for 8 prompt groups from generator "
                                                "ranks [2] (3 buffered; the first batch includes the "
                                                "generators' start-up)")
    assert waiting_line(99, 8, [2, 3], 0, (2, 100, 50.0), now=125.0) == (
        "step 100: waiting for 8 prompt groups from generator ranks [2, 3] (0 buffered; generator "
        "rank 2 has been evaluating v100 for 1m15s (eval.every_steps))")


def test_a_start_drops_the_steps_an_earlier_attempt_logged_after_it(tmp_path):
    """A fresh start in a folder whose earlier run left metrics (and no checkpoint) appended its
    steps 1, 2 after the old 1, 2, 3; a resume from step 2 keeps steps 1-2 only."""
    from config import load_config
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}", "--logging.tensorboard=false"])
    old = [json.dumps({"step": s, "loss": 0.5}) for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    for start, kept in ((2, [1, 2]), (0, [])):
        path.write_text("\n".join(old) + "\n")
        MetricsLogger.from_config(cfg, start).close()
        assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == kept


def test_tensorboard_reads_every_number_of_each_row_back_as_a_scalar(tmp_path):
    """One event a step with all its numbers (add_scalar wrote one each, 1.4-3 ms a step):
    TensorBoard reads each back as a scalar series, by step, with the logged values; strings,
    lists and booleans stay out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logger = MetricsLogger(tmp_path, tensorboard=True, stream=io.StringIO())
    for s in (1, 2):
        logger.log(dict.fromkeys(CONTRACT_KEYS, 0.5 * s) | {
            "step": s, "policy_version": s, "staleness_max": s, "prompt_ids": [1, 2],
            "flag": True, "note": "x"})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    want = set(CONTRACT_KEYS) - {"step"}
    assert set(acc.Tags()["scalars"]) == want
    for key in want:
        assert [(e.step, e.value) for e in acc.Scalars(key)] == [
            (1, 1.0 if key in ("policy_version", "staleness_max") else 0.5),
            (2, 2.0 if key in ("policy_version", "staleness_max") else 1.0)]


def test_mismatch_kl_is_null_in_a_step_without_tokens_of_the_weights_trained(tmp_path):
    """mismatch_kl is per token sampled by the weights trained; a step of stale tokens only (an
    asynchronous run) has none and logged 0.0, a generator and trainer in perfect agreement. It
    is null there (TensorBoard leaves the step out), and the per-token mean otherwise."""
    from types import SimpleNamespace
    from trainer.batch import Group, Trajectory
    from trainer.metrics import step_metrics
    groups = [Group(0, [Trajectory(0, i, [1], [2, 3], [-1.0, -1.0], [4, 4], 1.0, "stop")
                        for i in range(2)])]
    stats = {"tokens": 4.0, "loss_sum": 2.0, "is_ratio_sum": 4.0, "is_ratio_max": 1.0,
             "truncated": 0.0, "clipped": 0.0, "entropy_sum": 1.0, "kl_sum": 0.0,
             "mismatch_kl_sum": 0.0, "onpolicy_tokens": 0.0}
    res = SimpleNamespace(grad_norm=1.0, lr=1e-3)
    assert step_metrics(6, 6, groups, stats, res, 1.0, 0.0, 0)["mismatch_kl"] is None
    on = stats | {"mismatch_kl_sum": 0.75, "onpolicy_tokens": 3.0}
    assert step_metrics(5, 5, groups, on, res, 1.0, 0.0, 0)["mismatch_kl"] == 0.25
    logger = MetricsLogger(tmp_path, tensorboard=False, stream=io.StringIO())
    logger.log(step_metrics(6, 6, groups, stats, res, 1.0, 0.0, 0))
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mismatch_kl"] is None


def test_generator_version_after_a_resume_is_the_restored_one_until_an_acknowledgement(monkeypatch):
    """A resumed run's generators hold the restored version before they generate again; its
    first rows logged generator_version 0 (no acknowledgement yet), as if they had gone back."""
    from types import SimpleNamespace
    from trainer import checkpointing
    from trainer.batch import Group, Trajectory
    from trainer.worker import TrainerWorker

    def load(worker, path):
        worker.step = worker.version = 4
    monkeypatch.setattr(checkpointing, "load", load)
    buffer = type("Buffer", (list,), {"stats": lambda self: {"dropped_stale": 0}})()
    w = SimpleNamespace(step=0, version=0, acks={}, acked_floor=0, nonfinite_total=0,
                        is_owner=False, _alone=lambda fn: None, _push_weights=None,
                        buffer=buffer)
    groups = [Group(0, [Trajectory(0, i, [1], [2], [-1.0], [4], 1.0, "stop") for i in range(2)])]
    stats = {"tokens": 2.0, "loss_sum": 1.0, "is_ratio_sum": 2.0, "is_ratio_max": 1.0,
             "truncated": 0.0, "clipped": 0.0, "entropy_sum": 1.0, "kl_sum": 0.0,
             "mismatch_kl_sum": 0.0, "onpolicy_tokens": 0.0}
    res = SimpleNamespace(grad_norm=1.0, lr=1e-3)
    assert TrainerWorker._metrics(w, groups, stats, res, 1.0, 0.0)["generator_version"] == 0
    TrainerWorker.resume(w, "ckpt")
    w.step = w.version = 5
    row = TrainerWorker._metrics(w, groups, stats, res, 1.0, 0.0)
    assert (row["generator_version"], row["generator_sync_s"]) == (4, None)
    w.acks[5] = 0.25  # an acknowledgement of a later version takes over
    assert TrainerWorker._metrics(w, groups, stats, res, 1.0, 0.0)["generator_version"] == 5


# -- the values of a row, against hand computation ---------------------------------------------
def _traj(pid, idx, n_completion, reward, version=0, finish="stop"):
    from trainer.batch import Trajectory
    return Trajectory(pid, idx, [1, 2], list(range(3, 3 + n_completion)), [-0.5] * n_completion,
                      [version] * n_completion, reward, finish)


def _stats(**kw):
    base = {"tokens": 8.0, "loss_sum": 2.0, "is_ratio_sum": 10.0, "is_ratio_max": 3.0,
            "truncated": 2.0, "clipped": 1.0, "entropy_sum": 4.0, "kl_sum": 0.8,
            "mismatch_kl_sum": 0.0, "onpolicy_tokens": 0.0}
    return base | kw


def test_a_rows_numbers_are_the_documented_means_by_hand():
    """Two groups of two (a step at version 5 -> 6): per-sample reward mean and population std,
    staleness against the version trained (5), per-token means of the token sums, completion
    lengths and the share cut at max_new_tokens ("length"), and the share of groups whose equal
    rewards give every advantage 0 (no learning signal)."""
    from types import SimpleNamespace
    from trainer.batch import Group
    from trainer.metrics import step_metrics
    groups = [Group(0, [_traj(0, 0, 1, 1.0, version=5), _traj(0, 1, 3, 0.0, version=4, finish="length")]),
              Group(1, [_traj(1, 0, 2, 0.5, version=3), _traj(1, 1, 2, 0.5, version=5)])]
    m = step_metrics(6, 6, groups, _stats(), SimpleNamespace(grad_norm=2.5, lr=1e-4), 2.0, 0.1, 0)
    # rewards [1, 0, .5, .5]: mean .5, population variance (.25 + .25 + 0 + 0) / 4
    assert m["reward_mean"] == 0.5 and m["reward_std"] == (0.5 / 4) ** 0.5
    assert m["samples"] == 4 and (m["staleness_mean"], m["staleness_max"]) == ((0 + 1 + 2 + 0) / 4, 2)
    assert (m["loss"], m["is_ratio_mean"], m["entropy"], m["kl"]) == (2 / 8, 10 / 8, 4 / 8, 0.8 / 8)
    assert (m["truncated_frac"], m["clipped_frac"], m["is_ratio_max"]) == (2 / 8, 1 / 8, 3.0)
    assert m["completion_tokens"] == 8 and m["tokens_per_s"] == 8 / 2.0
    assert (m["completion_len_mean"], m["completion_len_max"]) == (8 / 4, 3)
    assert m["finish_length_frac"] == 1 / 4 and m["reward_zero_std_frac"] == 1 / 2
    assert (m["grad_norm"], m["lr"], m["policy_version"]) == (2.5, 1e-4, 6)


def _embedding_policy():
    """A 'model' whose logits are rows of one matrix, picked by the input ids."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(40, 41, dtype=torch.float64))
    model.forward = lambda input_ids_N, seq_lens=None, seq_parents=None: model.w[input_ids_N]
    return model


def _train(groups, shard, **algo):
    """One train_step of `shard = (rank, ranks)`'s share of `groups`: its stats and result."""
    import torch
    from tests.test_losses import step_cfg
    from trainer.step import train_step
    model = _embedding_policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ref = _embedding_policy() if algo.get("kl_coef") else None
    if ref is not None:
        with torch.no_grad():
            ref.w.mul_(0.5)
    return train_step(model, opt, sched, groups, step_cfg(**algo), None, "cpu", 0, ref_model=ref,
                      shard=shard)


def _unequal_groups():
    """Group 0 with 1-token completions, group 1 with 12-token ones: 2 against 24 loss tokens."""
    from trainer.batch import Group, Trajectory
    return [Group(g, [Trajectory(g, i, [1, 2 + g], [3 + (i + k) % 30 for k in range(1 + 11 * g)],
                                 [-3.0 - 0.1 * k for k in range(1 + 11 * g)], [0] * (1 + 11 * g),
                                 float(i), "stop") for i in range(2)])
            for g in range(2)]


def test_per_token_metrics_over_two_data_parallel_ranks_equal_one_ranks(monkeypatch):
    """The step's groups on 2 data-parallel ranks with 2 and 24 loss tokens: the token sums summed
    over the ranks, then divided (reduce_stats, step_metrics), give one rank's numbers; a mean of
    the ranks' means would weight rank 0's 2 tokens as much as rank 1's 24."""
    import torch
    from types import SimpleNamespace
    import trainer.metrics as M
    groups = _unequal_groups()
    kw = dict(loss="aipo", rho=1.5, kl_coef=0.1)
    whole = _train(groups, (0, 1), **kw)
    parts = [_train(groups, (r, 2), **kw) for r in range(2)]
    assert [p.stats["tokens"] for p in parts] == [2.0, 24.0]
    keys = sorted(parts[0].stats)
    rows = torch.tensor([[p.stats[k] for k in keys] for p in parts], dtype=torch.float64)
    monkeypatch.setattr(M, "gather_rows", lambda row, group: rows)  # the all-gather's result
    reduced = M.reduce_stats(parts[0].stats, "dp group")
    res = SimpleNamespace(grad_norm=1.0, lr=0.1)
    got = M.step_metrics(1, 1, groups, reduced, res, 1.0, 0.0, 0)
    want = M.step_metrics(1, 1, groups, M.reduce_stats(whole.stats, None), res, 1.0, 0.0, 0)
    for key in ("loss", "entropy", "kl", "is_ratio_mean", "is_ratio_max", "truncated_frac"):
        assert got[key] == pytest.approx(want[key], rel=1e-12), key
        means = [M.step_metrics(1, 1, groups, p.stats, res, 1.0, 0.0, 0)[key] for p in parts]
        if key != "is_ratio_max" and abs(means[0] - means[1]) > 1e-6:
            assert sum(means) / 2 != pytest.approx(want[key], rel=1e-3), key  # the example tells


# -- values from outside this module -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_truncated_frac_counts_the_tokens_whose_token_is_weight_was_capped(mode):
    """loss='ppo' with token IS: pi/mu = 4 and 1.25 at cap 2. The first token's weight is capped
    (truncate: 2) or dropped (mask: 0), so truncated_frac is 1/2; it read 0 on every PPO+TIS step,
    as if no weight were ever capped."""
    import math
    import torch
    from types import SimpleNamespace
    from tests.test_losses import step_cfg
    from trainer.step import _loss
    acfg = step_cfg(loss="ppo", token_is=mode, token_is_cap=2.0).algo
    batch = SimpleNamespace(loss_mask_N=torch.tensor([True, True]),
                            logp_mu_N=torch.tensor([math.log(0.125), math.log(0.4)]),
                            adv_N=torch.tensor([1.0, -1.0]))
    out = _loss(acfg, torch.tensor([math.log(0.5), math.log(0.5)], requires_grad=True), batch)
    assert int(out.truncated_count) == 1 and int(out.tokens) == 2


def test_kl_is_null_in_a_run_without_a_kl_term():
    """With algo.kl_coef = 0 no KL to a reference is computed (there is no reference model); the
    row said kl 0.0, a policy equal to its reference. As mismatch_kl: null there."""
    from types import SimpleNamespace
    from trainer.metrics import reduce_stats, step_metrics
    groups = _unequal_groups()
    res = _train(groups, (0, 1), loss="aipo", kl_coef=0.0)
    m = step_metrics(1, 1, groups, reduce_stats(res.stats, None), SimpleNamespace(grad_norm=1.0, lr=0.1),
                     1.0, 0.0, 0)
    assert m["kl"] is None


def test_kl_is_the_mean_over_the_tokens_that_had_a_kl_term():
    """Where the step's stats say how many tokens had a KL term (kl_tokens): kl is per such token,
    null without any; stats without the count keep kl per loss token."""
    from types import SimpleNamespace
    from trainer.batch import Group
    from trainer.metrics import step_metrics
    groups = [Group(0, [_traj(0, i, 2, float(i)) for i in range(2)])]
    res = SimpleNamespace(grad_norm=1.0, lr=0.1)
    m = [step_metrics(1, 1, groups, _stats(**kw), res, 1.0, 0.0, 0)["kl"]
         for kw in ({}, {"kl_tokens": 4.0}, {"kl_sum": 0.0, "kl_tokens": 0.0})]
    assert m == [0.8 / 8, 0.8 / 4, None]


def test_generator_sync_s_is_null_before_the_generators_ack():
    """generator_sync_s of step v is the generators' swap time of version v - 1. Asynchronously
    its ack often comes after the row is written; the row said 0.0 s, an instant swap."""
    from types import SimpleNamespace
    from trainer.batch import Group
    from trainer.worker import TrainerWorker
    groups = [Group(0, [_traj(0, i, 2, float(i)) for i in range(2)])]
    buffer = type("Buffer", (), {"__len__": lambda b: 0, "stats": lambda b: {"dropped_stale": 0}})()
    fake = SimpleNamespace(step=3, version=3, nonfinite_total=0, acks={1: 0.25}, acked_floor=0,
                           buffer=buffer)
    m = TrainerWorker._metrics(fake, groups, _stats(), SimpleNamespace(grad_norm=1.0, lr=0.1), 1.0, 0.0)
    assert m["generator_sync_s"] is None  # the ack of v2 is not in (v1's is)


def test_a_fresh_start_drops_an_earlier_attempts_evaluations_from_tensorboard(tmp_path):
    """A fresh start in a folder with an earlier attempt's evaluations: eval.jsonl is emptied,
    but TensorBoard kept the old v0 and v10 next to the new v0: two points at step 0."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from config import load_config
    from rollout.evaluate import PeriodicEval
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}", "--eval.every_steps=10"])
    for values in ({0: 0.25, 10: 0.5}, {0: 0.75}):
        _next_second()
        ev = PeriodicEval(cfg, None, [], lambda it: [1], None, None, writer=True, start_version=0)
        for v, r in values.items():
            ev._record({"step": v, "reward_mean": r, "prompts": 1, "completion_tokens_mean": 1.0,
                        "time_s": 0.0})
        ev.close()
    assert [json.loads(ln)["step"] for ln in (tmp_path / "eval.jsonl").read_text().splitlines()] == [0]
    acc = EventAccumulator(str(tmp_path / "tb" / "eval"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/reward_mean")] == [(0, 0.75)]


# -- the logger: console, non-finite values, resumes ---------------------------------------------
def _row(step, **kw):
    return dict.fromkeys(CONTRACT_KEYS, 0.5) | {"step": step, "policy_version": step,
                                               "staleness_max": 0, "time_step_s": 1.0} | kw


def test_console_every_n_still_shows_the_first_and_the_last_step(tmp_path):
    """logging.console_every = 3 over steps 4-8 of a run of 8 (a resumed one): the first step of
    the process says the run is under way (with its ETA), and the last step's line is the run's
    final numbers; both were left out unless a multiple of 3 (here only step 6 printed)."""
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, tensorboard=False, console_every=3, stream=out,
                           total_steps=8, last_step=8)
    for s in range(4, 9):
        logger.log(_row(s))
    logger.close()
    *lines, summary = out.getvalue().splitlines()  # the run's summary line follows (below)
    assert [ln.split(" | ")[0] for ln in lines] == ["step    4", "step    6", "step    8"]
    assert lines[-1].endswith("| 8/8 eta 0s") and summary.startswith("trained steps 4-8 ")


def test_console_every_0_prints_only_the_summary(tmp_path):
    """logging.console_every = 0 (a sweep's quiet runs): no step line, the run's summary line
    at its last step, and metrics.jsonl has every step."""
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, tensorboard=False, console_every=0, stream=out,
                           total_steps=3, last_step=3)
    for s in (1, 2, 3):
        logger.log(_row(s))
    logger.close()
    assert out.getvalue().splitlines()[0].startswith("trained steps 1-3 ")
    assert len(out.getvalue().splitlines()) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_non_finite_value_is_null_in_the_jsonl_and_left_out_of_tensorboard(tmp_path):
    """A step with a NaN loss and an infinite IS max: metrics.jsonl stays strict JSON (null there,
    no NaN token that other JSON readers reject), TensorBoard leaves just those two out of that
    step (a NaN point there flattens every chart's smoothing), and the other steps are as logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def strict(text):
        raise ValueError(f"not JSON: {text}")
    logger = MetricsLogger(tmp_path, tensorboard=True, stream=io.StringIO(), total_steps=3)
    for s in (1, 2, 3):
        bad = {"loss": float("nan"), "is_ratio_max": float("inf")} if s == 2 else {}
        logger.log(_row(s, **({"loss": 0.25 * s, "is_ratio_max": 1.5} | bad)))
    logger.close()
    rows = [json.loads(ln, parse_constant=strict) for ln in (tmp_path / "metrics.jsonl").open()]
    assert [(r["loss"], r["is_ratio_max"]) for r in rows] == [(0.25, 1.5), (None, None), (0.75, 1.5)]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.25), (3, 0.75)]
    assert [e.step for e in acc.Scalars("reward_mean")] == [1, 2, 3]


def _next_second() -> None:
    """Sleep to the next whole second. TensorBoard reads a folder's event files in name order,
    "events.out.tfevents.<second>.<host>.<pid>.<writer count>": two attempts of one run are two
    processes, seconds apart; two writers of one test process in one second sorted by their
    counts as text, so writer 10 came before writer 9 (in the full suite) and the purge went
    the wrong way."""
    import time
    time.sleep(1 - time.time() % 1 + 0.01)


def test_a_resume_redoes_its_steps_once_in_the_jsonl_and_in_tensorboard(tmp_path):
    """An attempt logged steps 1-3 and its checkpoint is of step 2: the resumed run's steps 3-4
    replace the old 3 in both sinks, none doubled, none missing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from config import load_config
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}", "--logging.progress=false"])
    for start, steps in ((0, (1, 2, 3)), (2, (3, 4))):
        _next_second()
        logger = MetricsLogger.from_config(cfg, start)
        logger.stream = io.StringIO()
        for s in steps:
            logger.log(_row(s, loss=float(s + 10 * start)))
        logger.close()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").open()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 23.0), (4, 24.0)]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 23.0), (4, 24.0)]


def test_generator_sync_s_is_the_slowest_replicas_swap():
    """Each generator replica acks a version with its own swap time; the row reported the last
    ack to arrive, so a slow replica hid behind a fast one that acked after it."""
    from types import SimpleNamespace
    from trainer.link import Msg
    from trainer.worker import TrainerWorker
    fake = SimpleNamespace(acks={})
    for seconds in (0.5, 0.125):
        TrainerWorker._on_message(fake, SimpleNamespace(type=Msg.ACK, version=2,
                                                        payload={"seconds": seconds}))
    assert fake.acks == {2: 0.5}


def test_the_last_step_is_followed_by_one_summary_of_the_run(tmp_path):
    """A finished run ended on its last step line: no total time, no reward trend, and nothing
    said where its numbers are (with LOG_RANK=0 the generator's eval lines are not shown either).
    Rewards 0.1, 0.2, 0.6, 0.9 in steps of 1-4 s: 10 s in all, 0.15 over the first half, 0.75 over
    the second (up to 10 steps each)."""
    from config import load_config
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}", "--trainer.max_steps=4",
                                                "--logging.tensorboard=false"])
    logger = MetricsLogger.from_config(cfg)
    logger.stream = out = io.StringIO()
    for s, r in zip((1, 2, 3, 4), (0.1, 0.2, 0.6, 0.9)):
        logger.log(_row(s, reward_mean=r, time_step_s=float(s)))
        if s < 4:
            assert "trained" not in out.getvalue()  # only after the last step
    logger.close()
    *steps, last = out.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in steps] == ["step    1", "step    2", "step    3", "step    4"]
    assert last == (f"trained steps 1-4 in 10s | reward 0.150 (mean of steps 1-2) -> 0.750 (steps "
                    f"3-4) | every step in {tmp_path}/metrics.jsonl, held-out evaluations in "
                    f"{tmp_path}/eval.jsonl")


def test_the_summary_of_a_one_or_two_step_run_names_single_steps(tmp_path):
    """A run of one step said "trained steps 1-1 ... (mean of steps 1)"; of two, "(mean of steps
    1) -> ... (steps 2)"."""
    for n, want in ((1, "trained step 1 in 3s | reward 0.100 | "),  # not "(step 1) -> (step 1)"
                    (2, "trained steps 1-2 in 6s | reward 0.100 (step 1) -> 0.200 (step 2) | ")):
        logger = MetricsLogger(tmp_path / str(n), tensorboard=False, stream=io.StringIO(),
                               last_step=n)
        for s in range(1, n + 1):
            logger.log(_row(s, reward_mean=s / 10, time_step_s=3.0))
        logger.close()
        assert logger.stream.getvalue().splitlines()[-1].startswith(want)


def test_the_summary_of_a_resumed_run_counts_its_own_steps_and_names_tensorboard(tmp_path):
    """Steps 5-8 of 8 after a resume (rewards 0.5 and 0.7 on alternate steps): this attempt's
    steps and times; no eval.jsonl where evaluation is off; without step lines
    (console_every=0) the summary alone."""
    from config import load_config
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}", "--trainer.max_steps=8",
                                                "--eval.every_steps=0"])
    quiet = MetricsLogger(tmp_path / "quiet", tensorboard=False, console_every=0,
                          stream=io.StringIO(), last_step=8)
    logger = MetricsLogger.from_config(cfg, 4)
    logger.stream = out = io.StringIO()
    for s in range(5, 9):
        for lg in (logger, quiet):
            lg.log(_row(s, reward_mean=0.5 if s % 2 else 0.7, time_step_s=30.0))
    logger.close()
    quiet.close()
    assert out.getvalue().splitlines()[-1] == (
        f"trained steps 5-8 in 2m00s | reward 0.600 (mean of steps 5-6) -> 0.600 (steps 7-8) | "
        f"every step in {tmp_path}/metrics.jsonl and {tmp_path}/tb")
    assert out.getvalue().count("trained steps") == 1
    assert quiet.stream.getvalue() == out.getvalue().splitlines()[-1].replace(
        f" and {tmp_path}/tb", "").replace(f"{tmp_path}/", f"{tmp_path}/quiet/") + "\n"


def test_the_summary_of_a_long_run_averages_its_first_and_last_ten_steps(tmp_path):
    """25 steps, reward step/100: 0.055 over steps 1-10, 0.205 over steps 16-25 (the logger keeps
    those ends only, not every step of a long run)."""
    logger = MetricsLogger(tmp_path, tensorboard=False, stream=io.StringIO(), last_step=25,
                           console_every=100)
    for s in range(1, 26):
        logger.log(_row(s, reward_mean=s / 100, time_step_s=2.0))
    logger.close()
    assert logger.stream.getvalue().splitlines()[-1] == (
        f"trained steps 1-25 in 50s | reward 0.055 (mean of steps 1-10) -> 0.205 (steps 16-25) | "
        f"every step in {tmp_path}/metrics.jsonl")


def test_a_resume_writes_the_saved_steps_row_where_the_run_died_before_it(tmp_path):
    """Step 3 was saved, and the run died in the weights' push before its row: the resume went on
    after step 3, and metrics.jsonl read 1, 2, 4, ... for good. The checkpoint's copy of the row
    is written where the file lacks it (its sync time null), once, without a console line."""
    from config import load_config
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}", "--logging.tensorboard=false"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(_row(s)) + "\n" for s in (1, 2)))
    saved = _row(3, time_weights_sync_s=None)
    for _ in range(2):  # resumed twice from the same checkpoint: one row 3
        out = io.StringIO()
        logger = MetricsLogger.from_config(cfg, 3)
        logger.stream = out
        logger.restore(saved)
        logger.close()
        assert out.getvalue() == ""
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["time_weights_sync_s"] is None
    logger = MetricsLogger.from_config(cfg, 3)
    logger.restore(None)  # a checkpoint without a row (older, or not the owner's)
    logger.restore(_row(3, loss=9.0))  # the file has its own row 3: kept as logged
    logger.close()
    assert [json.loads(ln)["loss"] for ln in path.read_text().splitlines()] == [0.5] * 3
