"""tandem against TRL's GRPOTrainer: the same model, prompts, group size, batch, completion length
and reward, on this machine's CPU, measured back to back in one run.

    python bench/vs_trl.py [--rounds 2] [--hidden 256 --layers 4] [--worlds 2,3]
                           [--precisions fp32,bf16] [--smollm2]

Workload, identical on both sides (checked from each side's own logs, not assumed):
- model: a random tiny Llama (default hidden 256, 4 layers, 2.4M parameters, about the size of
  REFERENCES.md's tiny Llama for TRL's 0.27-0.35 s/step) saved as a Hugging Face folder with
  the project's character tokenizer (`tools.make_tiny_model.make_random_model`), which
  `AutoTokenizer` loads as well; `--smollm2` repeats on SmolLM2-135M-Instruct
  (`tools.convert_smollm2.convert`);
- prompts: the synthetic addition prompts of `DIGITS`-digit numbers
  (`rollout.data.load_prompts("synthetic:addition", digits=DIGITS)`; tandem:
  `--data.synthetic_digits`), handed to TRL as a `datasets.Dataset` of {"prompt": ...} (until
  2026-12-05 tandem ran configs/tiny_cpu.toml's 1-digit sums, 5 tokens, TRL 2-digit ones, 6.8);
- `--prompts` prompt groups per optimizer step, `--samples` completions each (TRL:
  per_device_train_batch_size = prompts * samples, num_generations = samples, one generation
  per optimizer step, one pass over it);
- exactly `--new-tokens` completion tokens: tandem ignores EOS (`generator.ignore_eos`), TRL
  gets `min_new_tokens = max_completion_length` so EOS cannot be sampled early;
- the reward: `trivial_reward` below (fraction of "1" characters; cheap, but not constant, so
  advantages are non-zero and every step really updates the weights); no KL, no reference model;
- no activation checkpointing on either side (TRL's GRPOConfig turns it on by default; it cost
  TRL's step 5-10% here; until 2026-12-05 this bench left it on).

tandem runs train_rl.py under torchrun, asynchronous (eta = 1), split mode with 1 generator rank
and 1 trainer rank (world 2), then 1 generator and 2 FSDP trainer ranks (world 3; 3 ranks on a
2-core machine are oversubscribed), one thread per rank. TRL runs in one process, once per thread
count in `--trl-threads` (default 1 and all cores); its best is the baseline. Both sides discard
`--warmup` steps; throughput = completion tokens (or samples) of the remaining steps over their
summed step times (tandem: `time_step_s` of metrics.jsonl, which since 2026-12-05 runs from the
previous step's stamp and so includes that row's logging; here only the metrics.jsonl line, ~10
us, since these runs write no TensorBoard events; TRL: a callback's clock between step ends),
and the ratio from median step times is printed beside it.

Beside each ratio the bench prints its ceiling on this machine (`ceiling_w2` in the JSON): one
step's matmul FLOPs on each side of tandem's split (`step_work`) over one core's measured matmul
peak (`core_peak`, each rank runs one thread), as if every matmul ran at that peak and nothing else
took time (`step_floor`). No code change can take the ratio past it; the goal's 3x needs the
ceiling well above 3x and most of it reached.

A tighter ceiling comes from tandem's own work (`overlap_ceiling_w2`): after each of its runs the
same ranks run synchronously (eta = 0), where generator and trainer take turns, so each side's time
per step is measured with the other one idle (T_gen: the trainer's wait for its batch; T_train:
train + weight push). Overlap cannot make a step shorter than max(T_gen, T_train), LlamaRL's
T_async (`overlap_step`), so TRL's step over that is the most this code reaches with perfect
overlap and no contention between the cores: below it the gap is overlap and contention, past it
each side must get faster on its core. `async_vs_sync_w2` is the async step against that sync run.
`--no-overlap-bound` skips the sync runs.

This machine is shared with other jobs, and contention only ever slows a run down: the sides run
interleaved for `--rounds` rounds and each side's best round counts. The load average is printed
after every run: read it before trusting a ratio.

Precision: every side runs once per `--precisions` entry. fp32 is fp32 throughout. bf16 is each
side's CPU mixed precision, fp32 weights and optimizer state with bf16 matmuls: TRL's `bf16=True`
(autocast over its whole step, generation included) and tandem's `--model.compute_dtype=bfloat16`
(the trainer's forward under autocast; the generator holds bf16 weights, `model.gen_dtype`, or
stays fp32 with `--gen-fp32`: bf16 was the faster generator for both models on the Zen 4 and
Zen 5 machines of BENCHMARKS.md, and on an AMX Xeon for SmolLM2-135M only). The TRL baseline
is TRL's best run of any thread count and precision; ratios are also printed against TRL at the
same precision.

TRL is a benchmark-only extra (requirements-bench.txt). Without it the bench says so and still
reports tandem's side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `common` sits beside this file; the generator imports this module by name for the reward
# ("bench.vs_trl:trivial_reward"), and then this folder is not on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (print_json, read_metrics, rl_args, root_cause,  # noqa: E402
                    run_in_group, run_train_rl)

RESULT_TAG = "VS_TRL_RESULT "  # the TRL child prints its result on a line starting with this


# ----- the shared reward ------------------------------------------------------------------------
def _ones_fraction(text: str) -> float:
    return text.count("1") / max(len(text), 1)


def trivial_reward(item, completion_text: str, completion_ids=None) -> float:
    """tandem's signature (reward.fn = "bench.vs_trl:trivial_reward")."""
    return _ones_fraction(completion_text)


def trl_trivial_reward(completions, **kwargs) -> list[float]:
    """TRL's signature: a batch of completion strings in, one float each out."""
    return [_ones_fraction(c) for c in completions]


DIGITS = 2  # the addition prompts' operands, on both sides: "30+98=" is 6 characters + BOS


# ----- tandem ---------------------------------------------------------------------------------
def run_tandem(model: str, run_dir: Path, world: int, bf16: bool, a, eta: int = 1) -> dict:
    args = [*rl_args(model, run_dir, steps=a.steps, prompts=a.prompts, samples=a.samples,
                     new_tokens=a.new_tokens, eta=eta),
            "--parallel.gen_tp=1", f"--logging.console_every={a.steps}", f"--trainer.lr={a.lr}",
            "--reward.fn=bench.vs_trl:trivial_reward", f"--data.num_prompts={a.num_prompts}",
            f"--data.synthetic_digits={DIGITS}",
            "--data.max_prompt_len=256", f"--model.compute_dtype={'bfloat16' if bf16 else 'auto'}",
            f"--model.gen_dtype={'bfloat16' if bf16 and not a.gen_fp32 else 'float32'}",
            f"--generator.decode={a.gen_decode}"]
    t0 = time.perf_counter()
    proc = run_train_rl(world, args, a.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"tandem world={world} eta={eta} failed (rc {proc.returncode}): "
                           f"{root_cause(proc.stderr)}")
    rows = read_metrics(run_dir)
    timed = rows[a.warmup:]
    if not timed:
        raise RuntimeError(f"tandem world={world}: {len(rows)} steps logged, none after "
                           f"--warmup {a.warmup}; raise --steps")
    secs = sum(r["time_step_s"] for r in timed)
    samples = sum(r["samples"] for r in timed)
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    tokens = sum(r["completion_tokens"] for r in timed)
    return {"steps_timed": len(timed), "step_s": secs / len(timed),
            "step_s_median": statistics.median(r["time_step_s"] for r in timed),
            "samples_per_s": samples / secs, "tokens_per_s": tokens / secs,
            "tokens_per_sample": tokens / samples, "samples_per_step": samples / len(timed),
            "staleness_mean": mean("staleness_mean"),
            # what bounds the pipeline: the trainer waiting for batches (generator-bound) or
            # training and pushing weights (trainer-bound)
            "wait_batch_s": mean("time_wait_batch_s"),
            "train_push_s": mean("time_train_s") + mean("time_weights_sync_s"),
            "launch_wall_s": wall}


# ----- TRL (a child process: its own threads, and a crash cannot take the bench down) ----------
def trl_child(spec: dict) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    from rollout.data import load_prompts

    torch.set_num_threads(spec["threads"])
    items = load_prompts("synthetic:addition", num_prompts=spec["num_prompts"], seed=0, digits=DIGITS)
    dataset = datasets.Dataset.from_dict({"prompt": [it.prompt for it in items]})
    step_ends: list[float] = []
    step_logs: list[dict] = []

    class Clock(transformers.TrainerCallback):
        """Wall time between step ends (generation, reward, loss, update: all of TRL's step)."""

        def on_step_begin(self, args, state, control, **kw):
            if not step_ends:
                step_ends.append(time.perf_counter())  # the first step's start

        def on_step_end(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:  # one per step (logging_steps=1)
                step_logs.append(dict(logs))

    n, p, t = spec["samples"], spec["prompts"], spec["new_tokens"]
    config = trl.GRPOConfig(
        output_dir=spec["out"], use_cpu=True, bf16=spec["bf16"], fp16=False, seed=0,
        # p prompts x n completions per optimizer step, generated once and used once
        per_device_train_batch_size=p * n, num_generations=n, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1,
        # exactly t completion tokens: EOS is masked until t tokens exist
        max_completion_length=t, generation_kwargs={"min_new_tokens": t},
        temperature=1.0, top_p=1.0, beta=0.0, learning_rate=spec["lr"],
        lr_scheduler_type="constant", max_steps=spec["steps"], logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False, gradient_checkpointing=spec["gradient_checkpointing"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    trainer = trl.GRPOTrainer(model=spec["model"], reward_funcs=trl_trivial_reward, args=config,
                              train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[Clock()])
    trainer.train()
    step_s = [b - a for a, b in zip(step_ends, step_ends[1:])]
    timed, timed_logs = step_s[spec["warmup"]:], step_logs[spec["warmup"]:]
    if not timed or not timed_logs:
        raise RuntimeError(f"TRL logged {len(step_s)} steps, none after --warmup {spec['warmup']}")
    secs = sum(timed)
    per_step = p * n
    tokens_per_sample = sum(r["completions/mean_length"] for r in timed_logs) / len(timed_logs)
    return {"steps_timed": len(timed), "step_s": secs / len(timed),
            "step_s_median": statistics.median(timed),
            "samples_per_s": per_step * len(timed) / secs,
            "tokens_per_s": tokens_per_sample * per_step * len(timed) / secs,
            "tokens_per_sample": tokens_per_sample, "samples_per_step": per_step,
            "min_length": min(r["completions/min_length"] for r in timed_logs),
            "gradient_checkpointing": config.gradient_checkpointing,
            "trl_version": trl.__version__}


def run_trl(model: str, out: Path, threads: int, bf16: bool, a) -> dict:
    spec = {"model": model, "out": str(out), "threads": threads, "bf16": bf16, "steps": a.trl_steps,
            "warmup": a.warmup, "prompts": a.prompts, "samples": a.samples,
            "new_tokens": a.new_tokens, "lr": a.lr, "num_prompts": a.num_prompts,
            "gradient_checkpointing": a.trl_gradient_checkpointing}
    cmd = [sys.executable, __file__, "--trl-child", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = run_in_group(cmd, env, a.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL run failed (rc {proc.returncode}): {root_cause(proc.stderr)}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def trl_missing() -> str | None:
    """Why TRL cannot run here, or None."""
    import importlib.util

    for name in ("trl", "datasets"):
        if importlib.util.find_spec(name) is None:
            return (f"{name} is not installed (pip install -r requirements-bench.txt; it must keep "
                    f"the pinned torch)")
    return None


# ----- what the hardware allows ---------------------------------------------------------------
def step_work(model: str, a) -> dict:
    """Matmul FLOPs of one optimizer step on each side of tandem's split (both TRL's work too):
    the trainer's forward + backward over every prompt + completion token (6 x linear weights x
    tokens; attention scores are negligible at these lengths), and the generator's forward over
    each group's prompt once and every sample's completion tokens (2 x weights x tokens)."""
    import torch

    from model import Transformer, load_model_args
    from model.tokenizer import load_tokenizer
    from rollout.data import load_prompts, render_prompt

    with torch.device("meta"):
        net = Transformer(load_model_args(model))
    weights = sum(m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear))
    tok = load_tokenizer(model)
    items = load_prompts("synthetic:addition", num_prompts=a.num_prompts, seed=0, digits=DIGITS)
    prompt = statistics.mean(len(render_prompt(it, tok, False)) for it in items)
    samples = a.prompts * a.samples
    return {"linear_weights": weights, "prompt_tokens_mean": prompt,
            "train_flops": 6.0 * weights * samples * (prompt + a.new_tokens),
            "gen_flops": 2.0 * weights * (a.prompts * prompt + samples * a.new_tokens)}


def core_peak(bf16: bool) -> float:
    """Best fp32 (or bf16) matmul FLOP/s of ONE core here: each tandem rank runs one thread."""
    import torch

    from common import matmul_peak_flops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_peak_flops("cpu", torch.bfloat16 if bf16 else torch.float32, n=1024)
    finally:
        torch.set_num_threads(threads)


def step_floor(work: dict, peak: float, world: int, cores: int) -> float:
    """The shortest step tandem's split can take with every matmul at the one-core peak: one
    generator rank, world - 1 trainer ranks (FSDP splits the trainer's work), the ranks sharing
    `cores` cores. Overheads, the hand-off and the weight push all count as zero."""
    gen, train = work["gen_flops"], work["train_flops"]
    return max(gen, train / (world - 1), (gen + train) / min(world, cores)) / peak


# ----- one comparison -----------------------------------------------------------------------
def load() -> float:
    return os.getloadavg()[0]


def fmt(side: str, r: dict) -> str:
    return (f"{side:<22} {r['tokens_per_s']:8.0f} completion tok/s  {r['samples_per_s']:7.2f} "
            f"samples/s  step {r['step_s']:.3f}s  ({r['samples_per_step']:.0f} samples x "
            f"{r['tokens_per_sample']:.1f} tokens, {r['steps_timed']} steps timed)")


def _best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["tokens_per_s"])


def _run_side(name: str, n: int, bf16: bool, key: str, model: str, tmp: Path, i: int,
              a) -> tuple[dict, str]:
    """One run of one side: (result, description). `n` = TRL threads or tandem world size."""
    precision = "bf16" if bf16 else "fp32"
    if name.startswith("trl"):
        r = run_trl(model, tmp / f"{key}_{name}_{i}", n, bf16, a)
        return r, f"TRL {r['trl_version']}, {n} thread(s), {precision}"
    r = run_tandem(model, tmp / f"{key}_{name}_{i}", n, bf16, a)
    if a.overlap_bound:  # the same ranks in lockstep: each side's work per step, not overlapped
        try:
            s = run_tandem(model, tmp / f"{key}_{name}_{i}_sync", n, bf16, a, eta=0)
            r["sync"] = {"step_s": s["step_s"], "t_gen_s": s["wait_batch_s"],
                         "t_train_s": s["train_push_s"]}
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # keep the async result
            r["sync_error"] = str(e).splitlines()[0]
            print(f"  round {i}  {name} sync run (for the overlap ceiling): FAILED: "
                  f"{r['sync_error']}", flush=True)
    return r, f"tandem 1 gen + {n - 1} train, {precision}"


def side_names(a, trl: bool) -> list[tuple[str, int, bool]]:
    """(name, threads or world size, bf16) of every side, TRL's first: trl_t2, trl_t2_bf16,
    tandem_w2, tandem_w2_bf16, ..."""
    def suffix(bf16):
        return "_bf16" if bf16 else ""
    precisions = [p == "bf16" for p in a.precisions]
    trl_sides = [(f"trl_t{t}{suffix(b)}", t, b) for t in a.trl_threads for b in precisions]
    return (trl_sides if trl else []) + \
        [(f"tandem_w{w}{suffix(b)}", w, b) for w in a.worlds for b in precisions]


def compare(key: str, label: str, model: str, tmp: Path, a) -> dict:
    """`--rounds` rounds of (TRL at each thread count, tandem at each world size), back to back;
    each side's best round counts. Other jobs share this machine: contention only ever slows a
    run down, so the best of a few interleaved rounds is the fairest estimate for all sides."""
    runs: dict[str, list[dict]] = {}
    errors: dict[str, str] = {}
    print(f"== {label}: {a.prompts} prompts x {a.samples} samples x {a.new_tokens} tokens per "
          f"step; load average {load():.2f} on {os.cpu_count()} cores", flush=True)
    why = trl_missing() if not a.skip_trl else "skipped (--skip-trl)"
    if why is not None:
        errors["trl"] = why
        print(f"TRL: NOT MEASURED: {why}", flush=True)
    sides = side_names(a, trl=why is None)
    floors = compute_floors(model, a, sides)
    for i in range(1, a.rounds + 1):
        for name, n, bf16 in sides:
            if name in errors:
                continue  # failed or timed out in an earlier round: do not pay for it again
            try:
                r, desc = _run_side(name, n, bf16, key, model, tmp, i, a)
            except subprocess.TimeoutExpired:
                # Typically TRL with 2+ threads on an overloaded machine (OpenMP barriers stall
                # whenever one of its threads is descheduled): later rounds would only time out too.
                errors[name] = f"over --timeout {a.timeout:.0f}s in round {i}"
                print(f"  round {i}  {name}: over --timeout {a.timeout:.0f}s (contention?); "
                      "not run again", flush=True)
                continue
            except RuntimeError as e:
                errors[name] = str(e)
                print(f"  round {i}  {name}: FAILED: {errors[name].splitlines()[0]}", flush=True)
                continue
            runs.setdefault(name, []).append(r)
            extra = (f"  wait {r['wait_batch_s']:.3f}s + train {r['train_push_s']:.3f}s"
                     if "wait_batch_s" in r else "")
            if "sync" in r:
                s = r["sync"]
                extra += (f"; sync step {s['step_s']:.3f}s = gen {s['t_gen_s']:.3f}s + train "
                          f"{s['t_train_s']:.3f}s")
            print(f"  round {i}  " + fmt(desc, r) + extra + f"  [load {load():.2f}]", flush=True)
    out = summarise(runs, errors, a, [name for name, _, _ in sides], floors)
    out["floor_s"] = floors
    return out


def compute_floors(model: str, a, sides) -> dict[str, float]:
    """Each tandem side's `step_floor` (printed): what its ratio to TRL could at most become on
    this machine, measured before the runs while it is quiet."""
    work = step_work(model, a)
    peaks = {bf16: core_peak(bf16) for bf16 in {b for _, _, b in sides}}
    print(f"  compute per step: trainer {work['train_flops'] / 1e9:.2f} GFLOP, generator "
          f"{work['gen_flops'] / 1e9:.2f} GFLOP (prompts {work['prompt_tokens_mean']:.1f} tokens); "
          "one-core matmul peak " + ", ".join(f"{'bf16' if b else 'fp32'} {p / 1e9:.0f} GFLOP/s"
                                               for b, p in sorted(peaks.items())), flush=True)
    return {name: step_floor(work, peaks[bf16], n, os.cpu_count() or 1)
            for name, n, bf16 in sides if name.startswith("tandem")}


def summarise(runs: dict[str, list[dict]], errors: dict[str, str], a, order: list[str],
              floors: dict[str, float]) -> dict:
    """Best run per side, the TRL baseline (its best thread count and precision), and each tandem
    side's ratios against it and against TRL's best at the same precision, printed."""
    mismatched = sorted({f"{name}: {r['tokens_per_sample']:.1f} tokens/sample, "
                         f"{r['samples_per_step']:.0f} samples/step"
                         for name, rs in runs.items() for r in rs
                         if abs(r["tokens_per_sample"] - a.new_tokens) > 1e-6
                         or r["samples_per_step"] != a.prompts * a.samples})
    if mismatched:  # the comparison is only fair at equal work per step
        print(f"WARNING: workload differs from {a.prompts * a.samples} samples x {a.new_tokens} "
              f"tokens: {mismatched}", flush=True)
    out: dict = {"runs": runs, "errors": errors, "workload_matched": not mismatched}
    out.update({name: _best(rs) for name, rs in runs.items()})
    trl_names = [n for n in runs if n.startswith("trl_t")]
    if trl_names:
        out["trl_best"] = max(trl_names, key=lambda n: out[n]["tokens_per_s"])
        out["trl"] = out[out["trl_best"]]
    print(f"best of {a.rounds} round(s):")
    for name in (n for n in order if n in out):
        r = out[name]
        line = (f"  {name:<15} {r['tokens_per_s']:8.0f} completion tok/s  "
                f"{r['samples_per_s']:7.2f} samples/s  step {r['step_s']:.3f}s")
        if name == out.get("trl_best"):
            line += "  (the TRL baseline)"
        if name.startswith("tandem") and "trl" in out:
            line += _ratios(out, name, r, trl_names, floors[name])
        print(line, flush=True)
    return out


def overlap_step(syncs: list[dict]) -> float:
    """LlamaRL's idealised asynchronous step, T_async = max(T_gen, T_train) (REFERENCES.md), from
    the synchronous (eta = 0) runs of one tandem side. There the meshes take turns, so T_gen (the
    trainer's wait for its batch: weight receive, generation, hand-off) and T_train (train +
    weight push) are each side's work per step with the other one idle. Overlapping the two
    cannot make the step shorter than the longer of them, and on shared cores it makes each
    longer. The best round counts (contention only slows a run down)."""
    return min(max(s["t_gen_s"], s["t_train_s"]) for s in syncs)


def _ratios(out: dict, name: str, r: dict, trl_names: list[str], floor_s: float) -> str:
    """Sets out["ratio_{tokens,samples,median}_w{w}"] against the TRL baseline,
    out["ratio_same_precision_w{w}"] against TRL's best run at this side's precision,
    out["ceiling_w{w}"], the ratio at `step_floor` (no run can beat it here), and with the sync
    runs out["overlap_ceiling_w{w}"], the ratio at `overlap_step` (no overlap of this code's two
    sides can beat it here) and out["async_vs_sync_w{w}"]; w is the world size, with "_bf16" for
    bf16 (e.g. ratio_tokens_w2_bf16)."""
    w, trl = name[len("tandem_w"):], out["trl"]
    out[f"ratio_tokens_w{w}"] = r["tokens_per_s"] / trl["tokens_per_s"]
    out[f"ratio_samples_w{w}"] = r["samples_per_s"] / trl["samples_per_s"]
    # the same from median step times (less sensitive to bursts of contention)
    out[f"ratio_median_w{w}"] = (trl["step_s_median"] / trl["samples_per_step"]
                                 * r["samples_per_step"] / r["step_s_median"])
    text = (f"  -> {out[f'ratio_tokens_w{w}']:.2f}x TRL tok/s, "
            f"{out[f'ratio_samples_w{w}']:.2f}x samples/s, "
            f"{out[f'ratio_median_w{w}']:.2f}x by median step (goal >= 3x)")
    per_step = trl["step_s"] / trl["samples_per_step"] * r["samples_per_step"]  # TRL's time
    out[f"ceiling_w{w}"] = per_step / floor_s
    text += (f"; ceiling {out[f'ceiling_w{w}']:.2f}x (step >= {floor_s:.3f}s with every matmul "
             "at the one-core peak)")
    syncs = [run["sync"] for run in out["runs"][name] if "sync" in run]
    if syncs:
        t_async = overlap_step(syncs)
        out[f"overlap_ceiling_w{w}"] = per_step / t_async
        out[f"async_vs_sync_w{w}"] = min(s["step_s"] for s in syncs) / r["step_s"]
        text += (f"; overlap ceiling {out[f'overlap_ceiling_w{w}']:.2f}x (step >= "
                 f"{t_async:.3f}s, the longer side of its sync run); async "
                 f"{out[f'async_vs_sync_w{w}']:.2f}x its sync run")
    same = [n for n in trl_names if n.endswith("_bf16") == name.endswith("_bf16")]
    if same:
        best = max(same, key=lambda n: out[n]["tokens_per_s"])
        out[f"ratio_same_precision_w{w}"] = r["tokens_per_s"] / out[best]["tokens_per_s"]
        text += f"; {out[f'ratio_same_precision_w{w}']:.2f}x {best}"
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="tandem optimizer steps per run")
    ap.add_argument("--trl-steps", type=int, default=12, help="TRL optimizer steps")
    ap.add_argument("--warmup", type=int, default=4, help="steps discarded on both sides")
    ap.add_argument("--worlds", default="2,3", help="tandem world sizes (1 generator rank each)")
    ap.add_argument("--precisions", default="fp32,bf16",
                    help="fp32 and/or bf16 (CPU mixed precision, see above), for every side")
    ap.add_argument("--gen-fp32", action="store_true",
                    help="bf16 runs of tandem keep an fp32 generator (default: bf16 weights)")
    ap.add_argument("--gen-bf16", action="store_true",
                    help="accepted for older command lines: a bf16 generator is the default now")
    ap.add_argument("--gen-decode", default="auto", choices=("auto", "eager", "compile"),
                    help="tandem's generator.decode: 'compile' = torch.compile of the decode step "
                         "(its compilation, ~30 s on one core, falls in the warm-up steps)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help="prompt groups per optimizer step")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt (group size)")
    ap.add_argument("--new-tokens", type=int, default=32, help="completion tokens, fixed")
    ap.add_argument("--num-prompts", type=int, default=1024, help="size of the prompt pool")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--trl-threads", default=f"1,{os.cpu_count() or 1}",
                    help="TRL thread counts to try; its best one is the baseline (on a loaded "
                         "machine 1 thread can beat 2 by far: OpenMP barriers stall)")
    ap.add_argument("--timeout", type=float, default=90.0, help="per run, seconds")
    ap.add_argument("--rounds", type=int, default=2,
                    help="interleaved rounds of every side; each side's best round counts")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="TRL as GRPOConfig defaults it: recomputing activations in backward "
                         "(tandem's runs do not: not like for like; the baseline before 2026-12-05)")
    ap.add_argument("--no-overlap-bound", dest="overlap_bound", action="store_false",
                    help="skip tandem's synchronous (eta = 0) run after each of its runs, which "
                         "measures each side's work alone for the overlap ceiling")
    ap.add_argument("--smollm2", action="store_true",
                    help="also compare on SmolLM2-135M-Instruct (slow on CPU: few steps)")
    ap.add_argument("--smollm2-steps", type=int, default=5)
    ap.add_argument("--smollm2-timeout", type=float, default=400.0, help="per run, seconds")
    ap.add_argument("--trl-child", help=argparse.SUPPRESS)
    return ap


def checked(ap: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """The comma lists as lists; impossible settings as argparse errors."""
    a.worlds = [int(w) for w in a.worlds.split(",") if w]
    if not a.worlds or min(a.worlds) < 2:
        ap.error(f"--worlds {a.worlds}: each world needs 2 ranks at least (1 generator + trainers)")
    if a.warmup >= min(a.steps, a.trl_steps):
        ap.error(f"--warmup {a.warmup} leaves no timed step of --steps {a.steps} / --trl-steps "
                 f"{a.trl_steps}")
    a.trl_threads = sorted({int(t) for t in a.trl_threads.split(",") if t})
    a.precisions = [p for p in a.precisions.split(",") if p]
    if not a.precisions or set(a.precisions) - {"fp32", "bf16"}:
        ap.error(f"--precisions {','.join(a.precisions)!r}: give fp32, bf16 or fp32,bf16")
    return a


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.trl_child:
        print(RESULT_TAG + json.dumps(trl_child(json.loads(a.trl_child))), flush=True)
        return 0
    a = checked(ap, a)
    from tools.make_tiny_model import make_random_model

    t0 = time.perf_counter()
    record = {"bench": "vs_trl", "prompts": a.prompts, "samples": a.samples,
              "new_tokens": a.new_tokens, "cores": os.cpu_count(), "load_start": load()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_random_model(tmp / "model", hidden=a.hidden, layers=a.layers)
        label = f"tiny Llama (hidden {a.hidden}, {a.layers} layers)"
        record["tiny"] = compare("tiny", label, model, tmp, a)
        record["tiny_s"] = time.perf_counter() - t0
        if a.smollm2:
            from tools.convert_smollm2 import convert

            # ~6 s/step for TRL on an idle machine (REFERENCES.md): few steps, one round,
            # and a time limit per run that fits them
            a.steps = a.trl_steps = a.smollm2_steps
            a.warmup, a.rounds, a.timeout = 2, 1, a.smollm2_timeout
            record["smollm2"] = compare("smollm2", "SmolLM2-135M-Instruct", str(convert()), tmp, a)
    record["load_end"] = load()
    record["wall_s"] = time.perf_counter() - t0
    for key in [k for k in record["tiny"]
                if k.startswith(("ratio_", "ceiling_", "overlap_ceiling_", "async_vs_sync_"))]:
        record[key] = record["tiny"][key]
    print(f"done in {record['wall_s']:.0f}s; load average {record['load_start']:.2f} -> "
          f"{record['load_end']:.2f} on {os.cpu_count()} cores (other jobs share this machine)")
    print_json(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
