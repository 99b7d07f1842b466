"""Metrics sink for the trainer: `<run_dir>/metrics.jsonl` (one JSON object per step), TensorBoard
events under `<run_dir>/tb/`, and one console line per step."""
from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

# DESIGN.md's contract: every line of metrics.jsonl has at least these keys.
CONTRACT_KEYS = ("step", "policy_version", "reward_mean", "samples", "staleness_mean",
                 "staleness_max", "is_ratio_mean", "loss", "time_step_s", "time_weights_sync_s",
                 "tokens_per_s")


class MetricsLogger:
    """`total_steps` (logging.progress): each console line also shows the step out of the run's
    steps and the time left at the pace of the last 20 steps (`progress`), the first step (which
    waits for the generators' start-up) left out once there is another. A line every
    `console_every` steps (0: none but the summary), and always for this process's first step
    (the run is under way) and the run's `last_step` (its final numbers), then one line summing
    the run up (`summary_line`): the last step line was all a finished run said, and with
    LOG_RANK=0 (the generator's eval lines filtered) nothing named the files that hold the
    numbers. `eval_file`: where the generator writes its held-out evaluations, named in that line
    (None: evaluation is off)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, console_every: int = 1,
                 stream=None, purge_step: int | None = None, total_steps: int | None = None,
                 last_step: int | None = None, eval_file: str | Path | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: after a resume, TensorBoard drops the events of the steps being redone
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=purge_step)
        self.console_every, self.stream = console_every, stream or sys.stdout
        self.total_steps, self._step_times = total_steps, deque(maxlen=20)
        self.last_step = last_step
        self._first_s: float | None = None  # the first step's time: it waits for the start-up
        self.eval_file = eval_file
        # this process's steps for `summary_line`: (step, reward) of its first and last 10, and
        # the sum of their times (bounded: a run may take 10^5 steps)
        self._head: list[tuple[int, float]] = []
        self._tail: deque[tuple[int, float]] = deque(maxlen=10)
        self._run_s = 0.0

    @classmethod
    def from_config(cls, cfg, start_step: int = 0) -> "MetricsLogger":
        """The run's logger, starting after `start_step` (a resumed checkpoint's, else 0): the
        steps logged after it by an earlier attempt in this folder are dropped from
        metrics.jsonl and TensorBoard, since they are done again (a fresh start over a run
        without a checkpoint used to append its steps 1, 2, ... after the old ones)."""
        from trainer.checkpointing import truncate_steps
        lg = cfg.logging
        truncate_steps(Path(cfg.run.dir) / "metrics.jsonl", start_step)
        evals = Path(cfg.run.dir) / "eval.jsonl" if cfg.eval.every_steps else None
        return cls(cfg.run.dir, lg.tensorboard, lg.console_every, purge_step=start_step + 1,
                   total_steps=cfg.trainer.max_steps if lg.progress else None,
                   last_step=cfg.trainer.max_steps, eval_file=evals)

    def restore(self, row: dict | None) -> None:
        """Write a checkpoint's row of its step where metrics.jsonl lacks it: the run saved the
        step and died before it logged it (in the weights' push), and the resume goes on after
        it. Its time_weights_sync_s is null (the push never ended); no console line."""
        from trainer.checkpointing import logged_steps
        if row is None or int(row["step"]) in logged_steps(Path(self._file.name)):
            return
        clean = {k: _jsonable(v) for k, v in row.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb_write(clean, int(row["step"]))

    def log(self, metrics: dict) -> None:
        missing = [k for k in CONTRACT_KEYS if k not in metrics]
        assert not missing, f"metrics missing contract keys {missing}"  # internal invariant
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step = int(metrics["step"])
        if self._tb is not None:
            self._tb_write(clean, step)
        first = self._first_s is None
        if first:
            self._first_s = float(metrics["time_step_s"])
        else:
            self._step_times.append(float(metrics["time_step_s"]))
        if len(self._head) < 10:
            self._head.append((step, float(metrics["reward_mean"])))
        self._tail.append((step, float(metrics["reward_mean"])))
        self._run_s += float(metrics["time_step_s"])
        every = self.console_every  # 0: no step lines, the summary line only
        if not every and step == self.last_step:
            print(self.summary_line(), file=self.stream, flush=True)
        elif every and (step % every == 0 or first or step == self.last_step):
            line = console_line(metrics)
            if self.total_steps:
                line += " | " + progress(step, self.total_steps, self._step_times or [self._first_s])
            if step == self.last_step:
                line += "\n" + self.summary_line()
            print(line, file=self.stream, flush=True)

    def summary_line(self) -> str:
        """'trained steps 1-800 in 1m35s | reward 0.136 (mean of steps 1-10) -> 0.771 (steps
        791-800) | every step in <run>/metrics.jsonl and <run>/tb, ...': this process's steps
        (a resumed run's own), their summed step times (the run's wall time, the start-up wait
        in the first), and the sampled reward's trend over up to 10 steps at each end."""
        n = self._tail[-1][0] - self._head[0][0] + 1  # steps of this process (consecutive)
        k = max(1, min(10, n // 2))
        head, tail = self._head[:k], list(self._tail)[-k:]
        first, last = (sum(r for _, r in part) / k for part in (head, tail))
        where = f"every step in {self.path}" + (f" and {self.path.parent / 'tb'}" if self._tb else "")
        if self.eval_file is not None:
            where += f", held-out evaluations in {self.eval_file}"
        mean = "mean of " if k > 1 else ""
        trend = (f"{first:.3f} ({mean}{_steps([st for st, _ in head])}) -> {last:.3f} "
                 f"({_steps([st for st, _ in tail])})" if n > 1 else f"{first:.3f}")
        return (f"trained {_steps([head[0][0], tail[-1][0]])} in {duration(self._run_s)} | reward "
                f"{trend} | {where}")

    def _tb_write(self, clean: dict, step: int) -> None:
        """A step's numbers as one TensorBoard event of scalar values (read back as scalars, as
        `add_scalar`'s): one protobuf event a step instead of one per number. `add_scalar` took
        40-100 us each, 1.4-3 ms a step on the trainer's loop between two steps; this 0.09 ms."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in clean.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"]
        self._tb._get_file_writer().add_summary(Summary(value=values), step)
        self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def gather_rows(row, group):
    """Every rank's 1-D `row`, stacked in rank order ([ranks, n]), in one collective; a group of
    one (or None) gives [1, n]. Several reductions of small values (a sum and a max) then cost
    one wait for the slowest rank instead of one each: at 3 gloo ranks on 2 cores two tiny
    all-reduces took ~5 ms, one all-gather 2.0-2.6 ms."""
    import torch
    import torch.distributed as dist
    from parallel.mesh import all_gather_flat

    if group is None or dist.get_world_size(group) == 1:
        return row.view(1, -1)
    rows = torch.empty(dist.get_world_size(group) * row.numel(), dtype=row.dtype)
    all_gather_flat(rows, row, group)
    return rows.view(-1, row.numel())


def reduce_stats(stats: dict, dp_group) -> dict:
    """Sum a rank's token-summed step stats over the data-parallel ranks (max for the IS max)."""
    import torch

    keys = sorted(stats)
    rows = gather_rows(torch.tensor([stats[k] for k in keys], dtype=torch.float64), dp_group)
    out = dict(zip(keys, rows.sum(0).tolist()))
    out["is_ratio_max"] = float(rows[:, keys.index("is_ratio_max")].max())
    return out


def step_metrics(step, version, groups, s, res, dt, t_sync, nonfinite_total) -> dict:
    """One metrics.jsonl row from the step's groups and the dp-reduced stats `s`. `version` is
    the policy version after the step; staleness counts against the version trained (v - 1).
    The token stats are sums over every data-parallel rank's loss tokens, divided once here: a
    mean of the ranks' means weighted a rank of few tokens as much as one of many.
    "lr" is the one the step's update used (`res.lr`), not the scheduler's next one.
    "mismatch_kl" is per token sampled by the weights trained (trainer.step._accumulate), None
    (null) in a step without one, as in an asynchronous run's steps on stale data only: 0 there
    read as a generator and trainer in perfect agreement. "kl" likewise, per token with a KL
    term, where the stats count them (`kl_tokens`): null in a run without a reference.
    "loss" is the policy loss per token, without the KL and entropy terms (logged apart).
    "tokens_per_s": the step's completion tokens over its wall time `dt` (from the previous
    row's stamp, the wait for the batch included): the run's throughput, prompts not counted."""
    tok = max(s["tokens"], 1.0)
    kl_tokens = s.get("kl_tokens", tok)
    comp_tokens = sum(len(t.completion_ids) for g in groups for t in g.trajectories)
    return {
        "step": step, "policy_version": version, **sample_metrics(groups, version),
        "is_ratio_mean": s["is_ratio_sum"] / tok, "is_ratio_max": s["is_ratio_max"],
        "truncated_frac": s["truncated"] / tok, "clipped_frac": s["clipped"] / tok,
        "loss": s["loss_sum"] / tok, "entropy": s["entropy_sum"] / tok,
        "mismatch_kl": (s["mismatch_kl_sum"] / s["onpolicy_tokens"]
                        if s["onpolicy_tokens"] else None),
        "kl": s["kl_sum"] / kl_tokens if kl_tokens else None,
        "grad_norm": res.grad_norm, "lr": res.lr,
        "skipped_nonfinite": nonfinite_total, "completion_tokens": comp_tokens,
        "time_step_s": dt, "time_weights_sync_s": t_sync, "tokens_per_s": comp_tokens / dt,
        "prompt_ids": [g.prompt_id for g in groups],
    }


def sample_metrics(groups, version: int) -> dict:
    """The step's numbers per sample (each completion counts once, whatever its length): reward
    mean and population std, staleness (by a sample's oldest token) against the version trained
    (`version` - 1), completion lengths, the share cut at max_new_tokens (finish "length"), and
    the share of groups whose rewards are all equal: their advantages are 0, no learning signal
    (trainer.advantages)."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / len(rewards)
    stale = [version - 1 - t.version for t in trajs]
    lens = [len(t.completion_ids) for t in trajs]
    flat = [g for g in groups if len({t.reward for t in g.trajectories}) == 1]
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    return {
        "reward_mean": mean, "reward_std": var ** 0.5, "samples": len(trajs),
        "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
        "completion_len_mean": sum(lens) / len(lens), "completion_len_max": max(lens),
        "finish_length_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
        "reward_zero_std_frac": len(flat) / len(groups),
    }


def console_line(m: dict) -> str:
    return (f"step {m['step']:>4} | v{m['policy_version']} | reward {m['reward_mean']:.3f} | "
            f"stale {m['staleness_mean']:.2f}/{m['staleness_max']} | IS {m['is_ratio_mean']:.3f} | "
            f"loss {m['loss']:+.4f} | {m['tokens_per_s']:.0f} tok/s | step {m['time_step_s']:.2f}s | "
            f"sync {m['time_weights_sync_s'] * 1000:.0f}ms")


def _steps(steps) -> str:
    """"steps 1-10" from the first and last of `steps`, "step 1" where they are one."""
    return f"steps {steps[0]}-{steps[-1]}" if steps[0] != steps[-1] else f"step {steps[0]}"


def progress(step: int, total: int, recent_s) -> str:
    """"12/800 eta 2m31s": the steps left at the mean of the recent step times."""
    times = list(recent_s)
    left = max(total - step, 0) * sum(times) / max(len(times), 1)
    return f"{step}/{total} eta {duration(left)}"


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Heartbeat:
    """A console line every `every_s` seconds of a long wait (logging.progress): `beat()` prints
    when one is due and returns the seconds until the next, for the caller's wait slice."""

    def __init__(self, what: Callable[[], str], every_s: float = 10.0, enabled: bool = True,
                 stream=None, clock=time.monotonic):
        self.what, self.every_s, self.enabled = what, every_s, enabled
        self.stream, self.clock = stream or sys.stdout, clock
        self.start = self.clock()
        self.next = self.start + every_s

    def beat(self) -> float:
        if not self.enabled:
            return math.inf
        now = self.clock()
        if now >= self.next:
            print(f"{self.what()}: {duration(now - self.start)} so far", file=self.stream, flush=True)
            self.next = now + self.every_s
        return max(self.next - now, 0.0)


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/Inf; the non-finite counter says what happened
    return v
