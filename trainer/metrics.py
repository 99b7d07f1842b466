"""Metrics sink for the trainer: `<run_dir>/metrics.jsonl` (one JSON object per step), TensorBoard
events under `<run_dir>/tb/`, and one console line per step."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

# DESIGN.md's contract: every line of metrics.jsonl has at least these keys.
CONTRACT_KEYS = ("step", "policy_version", "reward_mean", "samples", "staleness_mean",
                 "staleness_max", "is_ratio_mean", "loss", "time_step_s", "time_weights_sync_s",
                 "tokens_per_s")


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, console_every: int = 1,
                 stream=None, purge_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step: after a resume, TensorBoard drops the events of the steps being redone
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=purge_step)
        self.console_every, self.stream = console_every, stream or sys.stdout

    def log(self, metrics: dict) -> None:
        missing = [k for k in CONTRACT_KEYS if k not in metrics]
        assert not missing, f"metrics missing contract keys {missing}"  # internal invariant
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step = int(metrics["step"])
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self.console_every and step % self.console_every == 0:
            print(console_line(metrics), file=self.stream, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def console_line(m: dict) -> str:
    return (f"step {m['step']:>4} | v{m['policy_version']} | reward {m['reward_mean']:.3f} | "
            f"stale {m['staleness_mean']:.2f}/{m['staleness_max']} | IS {m['is_ratio_mean']:.3f} | "
            f"loss {m['loss']:+.4f} | {m['tokens_per_s']:.0f} tok/s | step {m['time_step_s']:.2f}s | "
            f"sync {m['time_weights_sync_s'] * 1000:.0f}ms")


def _jsonable(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/Inf; the non-finite counter says what happened
    return v
