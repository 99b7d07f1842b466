"""How far the generator's behaviour log-probs (mu) are from the trainer's log-probs of the same
tokens under the same weights, for each generator dtype and trainer precision: the floor under
the `mismatch_kl` and `is_ratio_*` metrics of a run with no staleness.

The Engine samples `--prompts` x `--n` completions of `--new-tokens` tokens (temperature
`--temperature`, EOS ignored) in each of `--gen-dtypes`; each trainer precision then takes them
exactly as the trainer does (`trainer.step.micro_batches` with shared prompts, the packed forward
under the trainer's autocast rule, `trainer.losses` for the log-probs and `mismatch_kl`):
  fp32            fp32 parameters, fp32 compute (the CPU default)
  bf16-autocast   fp32 parameters under bf16 autocast (one trainer rank, compute_dtype=bfloat16)
  bf16            bf16 parameters (FSDP's param_dtype across trainer ranks, or a bf16 model)
An fp32 generator against the fp32 trainer is the engine's log-prob parity (<= 1e-5 on the tests'
small models); every bf16 pair shows bf16's own rounding, which AIPO's truncated importance
weights then see as off-policyness.

    python bench/logprob_mismatch.py                # SmolLM2-135M-Instruct (converted once)
    python bench/logprob_mismatch.py --random       # a random tiny Llama (vs_trl's shape)
    python bench/logprob_mismatch.py --device cuda  # the same on a GPU (decode: --decode)

Prints one line per pair, then one JSON line last.
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from bench.common import print_json  # noqa: E402
from model import load_pretrained  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from rollout.engine import Engine, Request, SamplingParams, decode_mode  # noqa: E402
from trainer import losses  # noqa: E402
from trainer.batch import Group  # noqa: E402
from trainer.step import micro_batches, policy_logp  # noqa: E402

TEXTS = ["What is 17 + 25? Answer:", "Write a short poem about the sea.",
         "The capital of France is", "Explain why the sky is blue.",
         "def fibonacci(n):", "Once upon a time, in a small village,",
         "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?\nA:",
         "List three uses of copper:"]
TRAINERS = ("fp32", "bf16-autocast", "bf16")


def trainer_model(model32, kind: str):
    """The trainer's forward of one precision over the same weights."""
    if kind == "bf16":
        return copy.deepcopy(model32).to(torch.bfloat16)
    model = copy.deepcopy(model32)
    model.autocast_dtype = torch.bfloat16 if kind == "bf16-autocast" else None
    return model


def prompts(path: str | None, count: int, vocab: int, seed: int) -> list[list[int]]:
    if path is None:  # a random model: random ids past the special tokens
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab) for _ in range(7 + i % 9)] for i in range(count)]
    tok = load_tokenizer(path)
    return [tok.encode(TEXTS[i % len(TEXTS)]) for i in range(count)]


@torch.no_grad()
def sample(model32, gen_dtype: torch.dtype, ids: list[list[int]], a) -> list[Group]:
    model = copy.deepcopy(model32).to(gen_dtype)
    device = torch.device(a.device)
    engine = Engine(model, len(ids) * a.n, max(map(len, ids)) + a.new_tokens, device=device,
                    compile_decode=decode_mode(a.decode, device), seed=a.seed)
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=a.temperature, n=a.n,
                            ignore_eos=True, seed=a.seed)
    done = engine.generate([Request(i, p, params) for i, p in enumerate(ids)])
    return Group.of_completions(done, [0.0] * len(done))


@torch.no_grad()
def compare(model, groups: list[Group], temperature: float) -> dict:
    diffs, kl, tokens = [], 0.0, 0
    device = next(model.parameters()).device
    for b in micro_batches(groups, "group_mean", 1 << 20, share_prompts=True):
        b = b.to(device)
        logp = policy_logp(model, b, temperature)
        mask = b.loss_mask_N.bool()
        diffs.append((b.logp_mu_N - logp)[mask].double().cpu())
        kl += float(losses.mismatch_kl(logp, b.logp_mu_N, mask))
        tokens += int(mask.sum())
    d = torch.cat(diffs)
    return {"max_abs": float(d.abs().max()), "mean_abs": float(d.abs().mean()),
            "mean": float(d.mean()), "is_ratio_mean": float((-d).exp().mean()),
            "is_ratio_max": float((-d).exp().max()), "mismatch_kl": kl / tokens, "tokens": tokens}


def load(a):
    if a.random:
        from tools.make_tiny_model import make_random_model
        with tempfile.TemporaryDirectory() as tmp:  # loaded into memory, then removed
            folder = make_random_model(Path(tmp) / "model", hidden=256, layers=4)
            return load_pretrained(folder, device=a.device, dtype=torch.float32), None
    path = Path(a.model) if a.model else None
    if path is None:
        from tools.convert_smollm2 import convert
        path = convert()  # converted once into artifacts/, reused after
    if not (path / "config.json").exists():
        raise SystemExit(f"--model {path}: no config.json there; give a Hugging Face model folder")
    return load_pretrained(path, device=a.device, dtype=torch.float32), str(path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Hugging Face folder (default: SmolLM2-135M)")
    ap.add_argument("--random", action="store_true", help="a random tiny Llama instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--decode", default="auto", choices=("auto", "eager", "compile", "cudagraph"))
    ap.add_argument("--gen-dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    bad = [g for g in a.gen_dtypes.split(",") if g not in ("float32", "bfloat16", "float16")]
    if bad:
        ap.error(f"--gen-dtypes: {bad} not among float32, bfloat16, float16")
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: this machine has no CUDA device; use --device cpu")
    torch.set_num_threads(a.threads)
    model32, path = load(a)
    model32.requires_grad_(False)
    ids = prompts(path, a.prompts, model32.args.vocab_size, a.seed)
    trainers = {kind: trainer_model(model32, kind) for kind in TRAINERS}
    results = {}
    for gen in a.gen_dtypes.split(","):
        groups = sample(model32, getattr(torch, gen), ids, a)
        for kind, model in trainers.items():
            r = results[f"gen_{gen}/train_{kind}"] = compare(model, groups, a.temperature)
            print(f"  generator {gen:8s} trainer {kind:13s} |mu - logp| mean {r['mean_abs']:.2e} "
                  f"max {r['max_abs']:.2e}, mean(mu - logp) {r['mean']:+.1e}, IS ratio mean "
                  f"{r['is_ratio_mean']:.4f} max {r['is_ratio_max']:.3f}, mismatch_kl "
                  f"{r['mismatch_kl']:.2e} ({r['tokens']} tokens)", flush=True)
    record = {"bench": "logprob_mismatch", "model": path or "random tiny Llama",
              "device": a.device, "decode": a.decode, "temperature": a.temperature,
              "results": results}
    print_json(record)
    return record


if __name__ == "__main__":
    main()
