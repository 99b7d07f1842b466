"""Asynchronous (eta = 1, eta = 4) against synchronous (eta = 0) RL: same ranks, same workload.

    python bench/async_vs_sync.py [--steps 24] [--world 2]

Each mode is a real train_rl.py run under torchrun on a random tiny policy with fixed-length
completions (EOS ignored), so every mode does identical work per step. Throughput is samples per
second over the steps after warm-up. The bound comes from the synchronous run itself:
T_gen = the trainer's wait for a batch (it waits while the generator generates), T_train = its
train + weight-push time, bound = (T_gen + T_train) / max(T_gen, T_train) (REFERENCES.md).

World size 2 (1 generator, 1 trainer) by default: this machine has 2 cores, and overlap needs one
core per mesh; with 3 ranks on 2 cores async can only win what the scheduler leaves over.
The workload is tuned so T_gen ~ T_train (a balanced workload, where async gains most): hidden 128
since 2026-12-04, when the trainer's packed attention got cheaper and hidden 64 left it at half the
generator's time (T_gen 0.061, T_train 0.032 s: a bound of 1.51x); hidden 128 gave 0.072 and 0.062.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import print_json, read_metrics, rl_args, run_train_rl  # (the repo on sys.path)

from tools.make_tiny_model import make_random_model


def run_mode(model: str, run_dir: Path, eta: int, a) -> list[dict]:
    args = rl_args(model, run_dir, steps=a.steps, prompts=a.prompts, samples=a.samples,
                   new_tokens=a.new_tokens, eta=eta)
    proc = run_train_rl(a.world, args, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"eta={eta} run failed:\n{proc.stderr[-4000:]}")
    return read_metrics(run_dir)


def summarise(rows: list[dict], warmup: int) -> dict:
    rows = rows[warmup:]
    wall = sum(r["time_step_s"] for r in rows)
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {"samples_per_s": sum(r["samples"] for r in rows) / wall, "step_s": wall / len(rows),
            "t_wait_s": mean("time_wait_batch_s"),
            "t_train_s": mean("time_train_s") + mean("time_weights_sync_s"),
            "staleness_mean": mean("staleness_mean"), "is_ratio_mean": mean("is_ratio_mean")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    a = ap.parse_args(argv)
    if not 0 <= a.warmup < a.steps:
        ap.error(f"--warmup {a.warmup} must leave timed steps of --steps {a.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_random_model(Path(tmp) / "model", hidden=a.hidden, layers=a.layers)
        res = {}
        for eta in (0, 1, 4):
            res[eta] = summarise(run_mode(model, Path(tmp) / f"eta{eta}", eta, a), a.warmup)
            r = res[eta]
            print(f"eta={eta}: {r['samples_per_s']:.1f} samples/s, step {r['step_s']:.3f}s "
                  f"(wait for batch {r['t_wait_s']:.3f}s, train+push {r['t_train_s']:.3f}s), "
                  f"staleness {r['staleness_mean']:.2f}", flush=True)
    t_gen, t_train = res[0]["t_wait_s"], res[0]["t_train_s"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    out = {"bench": "async_vs_sync", "world": a.world, "T_gen_s": t_gen, "T_train_s": t_train,
           "bound": bound}
    for eta in (1, 4):
        speedup = res[eta]["samples_per_s"] / res[0]["samples_per_s"]
        out[f"speedup_eta{eta}"] = speedup
        out[f"fraction_of_bound_eta{eta}"] = speedup / bound
        print(f"async eta={eta}: {speedup:.2f}x sync (bound {bound:.2f}x, {speedup / bound:.0%} of it)")
    out.update({f"samples_per_s_eta{k}": v["samples_per_s"] for k, v in res.items()})
    print_json(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
