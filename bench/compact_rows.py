"""The engine's row compaction (`Engine(compact=...)`): decode over the owned slots only, against
decode over every slot, same model, same requests, one run.

Workload: one RL step's batch on the generator, `--prompts` prompts x `--samples` samples in as
many slots, sampled at temperature 1 with EOS on, so that samples end at different lengths and
their slots fall idle before the batch is done (the tail of every RL step).
- `tiny` (always): the random Llama of bench/vs_trl.py (hidden 256, 4 layers, 2.4M parameters,
  the character tokenizer, whose EOS a random model draws about once in 17 tokens), synthetic
  addition prompts, +32 tokens at most;
- `--demo-model PATH`: the CPU demo's generator batch (configs/tiny_cpu.toml: 32 one-digit
  addition prompts x 8 samples in 256 slots, +8 tokens at most) on the warm-started model that
  `make demo` writes (runs/_models/tiny_addition), whose answers end after 2-3 tokens;
- `--smollm2`: SmolLM2-135M-Instruct (tools/convert_smollm2.py), the preset's task
  (configs/smollm2_135m_arith.toml, read from it: reasoning-gym's basic_arithmetic with its
  `data.task_options`, through the chat template; one-digit synthetic addition where
  reasoning-gym is not installed), +48 tokens at most, fp32.

Both engines get the same requests with the same seeds, so they draw the same samples; the sides
alternate batch by batch for `--pairs` pairs and the ratio is the median over pairs of
compact / every-slot time. Also printed: the share of slot rows the compact decode computed and
how many completions came out identical (a row count changes the matmuls' rounding, which may
flip a draw that sits on a boundary).

    .venv/bin/python bench/compact_rows.py [--pairs 8] [--demo-model PATH] [--smollm2]
                                           [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import REPO, pin_malloc, print_json  # also puts the repo on sys.path

import torch  # noqa: E402

from model import load_pretrained  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from rollout.data import load_prompts, render_prompt  # noqa: E402
from rollout.engine import Engine, Request, SamplingParams  # noqa: E402


def prompt_ids(folder: str, source: str, chat: bool, count: int, **options) -> list[list[int]]:
    tok = load_tokenizer(folder)
    items = load_prompts(source, num_prompts=count, seed=0, **options)
    return [render_prompt(it, tok, chat) for it in items]


def batch(prompts: list[list[int]], samples: int, new_tokens: int, seed: int) -> list[Request]:
    return [Request(i, p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=samples,
                                         seed=seed + i)) for i, p in enumerate(prompts)]


def compare(name: str, model, prompts: list[list[int]], samples: int, new_tokens: int,
            pairs: int) -> dict:
    """Alternate the two engines over `pairs` batches (each pair: the same requests)."""
    slots = len(prompts) * samples
    max_len = max(map(len, prompts)) + new_tokens
    engines = {c: Engine(model, num_slots=slots, max_len=max_len, compact=c) for c in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    same = total = tokens = 0
    for i in range(pairs + 1):  # pair 0 warms both up
        reqs = batch(prompts, samples, new_tokens, seed=1000 * i)
        outs = {}
        for c in (True, False) if i % 2 else (False, True):
            t = time.perf_counter()
            outs[c] = engines[c].generate(reqs)
            if i:
                times[c].append(time.perf_counter() - t)
        if i:
            pairs_out = zip(outs[True], outs[False])
            same += sum(a.completion_ids == b.completion_ids for a, b in pairs_out)
            total += len(outs[True])
            tokens += sum(len(c.completion_ids) for c in outs[False])
    st = {c: engines[c].stats for c in engines}
    ratio = statistics.median(a / b for a, b in zip(times[True], times[False]))
    res = {"slots": slots, "max_new_tokens": new_tokens, "pairs": pairs,
           "tokens_per_batch": tokens / pairs,
           "compact_s": statistics.median(times[True]),
           "all_rows_s": statistics.median(times[False]),
           "time_ratio": ratio, "speedup": 1 / ratio,
           "rows_share": st[True].decode_rows / st[False].decode_rows,
           "slot_moves_per_batch": st[True].slot_moves / (pairs + 1),
           "identical_completions": same / total}
    print(f"{name}: {slots} slots, {res['tokens_per_batch']:.0f} of {slots * new_tokens} tokens "
          f"a batch; compact {res['compact_s']:.3f} s, every slot {res['all_rows_s']:.3f} s a "
          f"batch: {res['speedup']:.2f}x (median of {pairs} pairs); rows computed "
          f"{res['rows_share']:.0%}, {res['slot_moves_per_batch']:.1f} moves a batch, "
          f"{res['identical_completions']:.0%} completions identical")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--demo-model", help="also the demo's batch on this model folder "
                                         "(runs/_models/tiny_addition after `make demo`)")
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (slow: minutes)")
    a = ap.parse_args()
    if min(a.pairs, a.prompts, a.samples) < 1:
        ap.error(f"--pairs {a.pairs}, --prompts {a.prompts}, --samples {a.samples}: each >= 1")
    torch.set_num_threads(1)  # as a generator rank (torchrun's OMP_NUM_THREADS=1)
    out = {"bench": "compact_rows", "fixed_malloc": pin_malloc(), "dtype": a.dtype}
    from tools.make_tiny_model import make_random_model
    with tempfile.TemporaryDirectory() as d:
        folder = make_random_model(Path(d) / "tiny", hidden=256, layers=4)
        model = load_pretrained(folder, dtype=a.dtype).eval()
        ps = prompt_ids(folder, "synthetic:addition", False, a.prompts, digits=2)
        out["tiny"] = compare("tiny", model, ps, a.samples, 32, a.pairs)
    if a.demo_model:
        model = load_pretrained(a.demo_model, dtype=a.dtype).eval()
        ps = prompt_ids(a.demo_model, "synthetic:addition", False, 32, digits=1)
        out["demo"] = compare("demo", model, ps, 8, 8, a.pairs)
    if a.smollm2:
        from config import load_config
        from tools.convert_smollm2 import convert
        folder = str(convert())
        data = load_config(str(REPO / "configs/smollm2_135m_arith.toml")).data  # its task
        source, options = data.source, data.task_options
        try:
            import reasoning_gym  # noqa: F401
        except ImportError:
            source, options = "synthetic:addition", {"digits": 1}
        model = load_pretrained(folder, dtype=a.dtype).eval()
        ps = prompt_ids(folder, source, data.chat_template, a.prompts, **options)
        out["smollm2"] = {"source": source, **compare(
            "SmolLM2-135M", model, ps, a.samples, 48, max(2, a.pairs // 2))}
    print_json(out)


if __name__ == "__main__":
    main()
