"""Small helpers shared by the benchmarks: timing, peak FLOP/s, MFU, spawning gloo ranks, and the
single JSON line every bench prints last (DESIGN.md: tools parse only that line)."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # benches run as scripts from anywhere; the repo is not installed
    sys.path.insert(0, str(REPO))


# The "1.1B Llama shape" of shared/REFERENCES.md (its HF baselines on the H200 were measured on it):
# hidden 2048, 16 layers, GQA 32/8 heads, vocab 32000; the intermediate size 8192 gives the 2.21 GB
# of bf16 weights that REFERENCES.md's bandwidth floor counts (1.104B parameters, lm_head untied).
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
                num_heads=32, num_kv_heads=8)


def hf_names(shape: dict) -> dict:
    """The same shape with transformers' config key names."""
    rename = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads"}
    return {rename.get(k, k): v for k, v in shape.items()}


def print_json(record: dict) -> None:
    """The machine-readable result: one line, printed last."""
    print(json.dumps(record, sort_keys=True), flush=True)


def _sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, iters: int, warmup: int, device=None, before=None) -> list[float]:
    """Wall time of each of `iters` calls of `step()` after `warmup` untimed ones (CUDA synced).
    `before()` runs untimed ahead of every call (e.g. a barrier so that ranks start together)."""
    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


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
from parallel.spawn import run_ranks  # noqa: E402,F401  (re-exported for the benches)
