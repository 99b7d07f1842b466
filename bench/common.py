"""Small helpers shared by the benchmarks: timing, peak FLOP/s, MFU, spawning gloo ranks, and the
single JSON line every bench prints last (DESIGN.md: tools parse only that line)."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # benches run as scripts from anywhere; the repo is not installed
    sys.path.insert(0, str(REPO))

from launch.plan import PRESETS  # noqa: E402
from parallel.mesh import pin_malloc  # noqa: E402,F401  (the benches pin it as the ranks do)


# The "1.1B Llama shape" of shared/REFERENCES.md (its HF baselines on the H200 were measured on it):
# hidden 2048, 16 layers, GQA 32/8 heads, vocab 32000; the intermediate size 8192 gives the 2.21 GB
# of bf16 weights that REFERENCES.md's bandwidth floor counts (1.104B parameters, lm_head untied).
LLAMA_1B = dict(PRESETS["llama-1.1b"])  # one definition: the planner's preset


def hf_names(shape: dict) -> dict:
    """The same shape with transformers' config key names."""
    rename = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads"}
    return {rename.get(k, k): v for k, v in shape.items()}


def root_cause(stderr: str) -> str:
    """The first exception line of a failed run (not torchrun's own summary), then the tail."""
    pattern = re.compile(r"\s*(\w+(Error|Exception)\b|error\b)")
    causes = [ln.strip() for ln in stderr.splitlines()
              if pattern.match(ln) and "ChildFailedError" not in ln]
    return (causes[0] + "\n" if causes else "") + stderr[-1500:]


def print_json(record: dict) -> None:
    """The machine-readable result: one line, printed last."""
    print(json.dumps(record, sort_keys=True), flush=True)


def time_steps(step, iters: int, warmup: int, device=None, before=None) -> list[float]:
    """Wall time of each of `iters` calls of `step()` after `warmup` untimed ones (CUDA synced);
    launch.calibrate.wall_times, the profiler's timing loop."""
    return wall_times(step, iters, warmup, device, before)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def train_flops(num_params: int, tokens: int) -> float:
    """The usual 6 * N * D estimate of one training step (forward 2ND + backward 4ND), attention
    score FLOPs not included; the same convention as the HF reference figure in REFERENCES.md."""
    return 6.0 * num_params * tokens


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    return flops / seconds / peak_flops


def matmul_peak_flops(device="cpu", dtype=torch.float32, n: int = 2048, iters: int = 10) -> float:
    """Best achieved FLOP/s of an n x n x n matmul on this device, with the current thread count:
    the denominator of MFU where no datasheet peak applies (CPU) or to check one (GPU)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    best = min(time_steps(lambda: a @ b, iters, warmup=0, device=device))
    return 2.0 * n ** 3 / best


# ----- N ranks on one machine: parallel/spawn.py (gloo, spawn, timeout) ----------------------
from launch.calibrate import wall_times  # noqa: E402
from parallel.spawn import run_captured, run_ranks  # noqa: E402,F401  (run_ranks re-exported)


# ----- train_rl.py runs -------------------------------------------------------------------------
def rl_args(model: str, run_dir: Path, *, steps: int, prompts: int, samples: int,
            new_tokens: int, eta: int) -> list[str]:
    """train_rl.py arguments of a benchmark run (configs/tiny_cpu.toml): fixed-length completions
    (EOS ignored) so that every mode does the same work per step, every sample of a step in its
    own slot, one generator rank, and nothing written besides metrics.jsonl. Callers append their
    own overrides (the last one of a key wins)."""
    return ["--config", "configs/tiny_cpu.toml", f"--model.path={model}", f"--run.dir={run_dir}",
            f"--algo.max_staleness={eta}", f"--trainer.max_steps={steps}",
            f"--trainer.prompts_per_step={prompts}", f"--generator.n_samples={samples}",
            f"--generator.num_slots={prompts * samples}",
            f"--generator.max_new_tokens={new_tokens}",
            "--generator.ignore_eos=true", "--parallel.generator_ranks=1",
            "--checkpoint.every_steps=0", "--checkpoint.hf_export_final=false",
            "--logging.tensorboard=false", "--logging.progress=false",
            "--logging.console_every=1000", "--trainer.micro_batch_tokens=100000",
            "--algo.kl_coef=0",  # no reference forward: the workloads recorded so far had none
            "--eval.every_steps=0"]  # nor held-out evaluations


def run_train_rl(world: int, args: list[str], timeout: float,
                 threads: int | None = 1) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node world train_rl.py args` with `threads` threads per
    rank (None: the caller's OMP_NUM_THREADS, else 1), in its own process group so that a
    time-out (subprocess.TimeoutExpired) also ends the workers."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), "train_rl.py", *args]
    omp = str(threads) if threads is not None else os.environ.get("OMP_NUM_THREADS", "1")
    return run_in_group(cmd, {**os.environ, "OMP_NUM_THREADS": omp}, timeout)


def run_in_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run from the repository root in its own process group, so that a time-out
    (re-raised as subprocess.TimeoutExpired) also ends the command's children; the output is
    captured in files (parallel.spawn.Captured: a pipe's reader waited 2 s more a run)."""
    return run_captured(cmd, timeout, cwd=REPO, env=env, start_new_session=True)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
