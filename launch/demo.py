"""`make demo`: the embedded CPU demo, end to end, on a fresh machine with no GPU and no network.

1. warm start: a tiny Llama learns the answer format by a short supervised run
   (tools/make_tiny_model.py; reused if it already exists);
2. greedy exact match of that policy on held-out prompts (before);
3. asynchronous AIPO in split mode on 3 ranks (1 generator, 2 FSDP trainers) via torchrun,
   preset configs/tiny_cpu.toml;
4. greedy exact match of the exported final policy on the same held-out prompts (after).
Extra arguments are passed to train_rl.py as overrides, e.g. `--trainer.max_steps=50`. Each
invocation trains in a new run directory, runs/demo-<UTC time>, unless `--run.dir=...` is given
(then an unfinished run there resumes, and a finished one is only evaluated again).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = "configs/tiny_cpu.toml"
HELD_OUT = 400  # sums scored before and after; the run's evaluation takes its first eval.num_prompts
# A line every 10 steps (the first and the last always): 800 a line each scrolled the before/after
# figures and the eval lines off the screen; metrics.jsonl keeps every step.
CONSOLE_EVERY = 10


def held_out_accuracy(model_dir: Path, cfg) -> float:
    """Greedy exact match on HELD_OUT held-out sums: the items the in-run evaluation (eval.jsonl)
    takes its first eval.num_prompts from."""
    import dataclasses
    from model import load_pretrained
    from model.tokenizer import load_tokenizer
    from rollout.data import load_held_out
    from rollout.evaluate import accuracy
    from rollout.rewards import resolve_reward
    from rollout.worker import stop_token_ids

    items = load_held_out(cfg.data, dataclasses.replace(cfg.eval, source="", num_prompts=HELD_OUT))
    model = load_pretrained(model_dir, dtype="float32").eval()
    tok = load_tokenizer(model_dir)
    return accuracy(model, tok, items, resolve_reward(cfg.reward.fn), cfg.generator.max_new_tokens,
                    chat_template=cfg.data.chat_template, stop_token_ids=stop_token_ids(cfg, tok))


USAGE = f"""usage: python launch/demo.py [--section.key=value ...]   (what `make demo` runs)

{__doc__.strip()}"""


def main(argv: list[str]) -> int:
    from config import ConfigError, load_config, parse_cli
    from launch.preflight import tiny_model_flags
    from rollout.rewards import resolve_reward
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    os.chdir(ROOT)
    if not any(a.startswith("--run.dir") for a in argv):  # a fresh run, not a resumed one
        argv = [*argv, f"--run.dir=runs/demo-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"]
    try:  # the overrides as train_rl.py reads them ("--a.b=v" or "--a.b v"), checked here first
        path, overrides, flags = parse_cli(argv)
        if path or flags:
            raise ConfigError(f"the demo runs {CONFIG} and takes --section.key=value overrides "
                              f"only; got {'--config ' + path if path else sorted(flags)}")
        cfg = load_config(CONFIG, overrides).resolve(3)
        resolve_reward(cfg.reward.fn, cfg.reward.format_weight)  # before the warm start's minutes
        if not cfg.data.source.startswith("synthetic:"):
            raise ConfigError(f"the demo warm-starts a tiny model for a synthetic task, and "
                              f"data.source={cfg.data.source!r} is not one; run train_rl.py "
                              "(README) for other prompts")
    except ValueError as e:  # ConfigError, and a reward.fn that cannot be imported
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():  # for the task trained (its alphabet, digits)
        print(f"== warm start: making {model_dir}", flush=True)
        subprocess.run([sys.executable, "tools/make_tiny_model.py",
                        *tiny_model_flags(cfg, model_dir)], check=True)
    before = held_out_accuracy(model_dir, cfg)
    evals = (f"; the run's eval lines score the first {cfg.eval.num_prompts}"
             if cfg.eval.every_steps else "")
    print(f"== held-out greedy exact match before RL: {before:.3f} ({HELD_OUT} held-out sums{evals})",
          flush=True)
    quiet = [] if any(a.startswith("--logging.console_every") for a in argv) else \
        [f"--logging.console_every={CONSOLE_EVERY}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "train_rl.py", "--config", CONFIG, *quiet, *argv]
    print("== " + " ".join(cmd), flush=True)
    # torchrun sets OMP_NUM_THREADS=1 where it is unset, with a 4-line banner saying so on stderr:
    # the same setting, without the banner
    rc = subprocess.run(cmd, env={"OMP_NUM_THREADS": "1", **os.environ}).returncode
    if rc:  # train_rl.py has said why above; a traceback of this process would only bury it
        again = [f"--{o}" for o in overrides if not o.startswith("run.dir=")]
        print(f"error: the RL run exited with {rc} (its output is above); to resume it: "
              f"{shlex.join(['python', 'launch/demo.py', *again, f'--run.dir={cfg.run.dir}'])}",
              file=sys.stderr, flush=True)
        return rc
    after = held_out_accuracy(Path(cfg.run.dir) / "hf_final", cfg)
    minutes = (time.time() - t0) / 60
    print(f"== held-out greedy exact match on {HELD_OUT} sums: before {before:.3f} -> after "
          f"{after:.3f} ({minutes:.1f} min in all)")
    print(f"== outputs in {cfg.run.dir}: hf_final/ (the final policy), metrics.jsonl (every step), "
          + ("eval.jsonl (held-out evaluations), " if cfg.eval.every_steps else "")
          + f"tb/ (tensorboard --logdir {cfg.run.dir}/tb), config.toml")
    print(json.dumps({"demo": "tiny_cpu", "before": before, "after": after, "minutes": minutes}))
    return 0 if after > before else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
