"""The trainer's console output: the progress part of each step line and the heartbeat of a long
wait (logging.progress), against hand-computed values with a fake clock."""
import io
import json

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
