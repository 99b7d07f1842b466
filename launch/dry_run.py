"""Dry run: check a config for a big job on a laptop, with no process group and no GPU.

    python train_rl.py --dry-run --config configs/example_1024.toml
    python -m launch.dry_run --config configs/example_1024.toml [--section.key=value ...]

What it does, in order (1024 ranks take a few seconds):
  1. world size: WORLD_SIZE when launched by torchrun, else derived from the config's explicit
     degrees: split = generator_ranks + trainer_fsdp * trainer_tp, colocated = trainer_fsdp *
     trainer_tp (trainer_fsdp must then be set: 0 means "derive from the world size", and there
     is none to derive from);
  2. Config.resolve(world) and ParallelDims: every degree checked, the rank map printed;
  3. the model shape: a Hugging Face folder (then launch.preflight checks weights, tokenizer, data,
     reward and run dir as a real launch would), or `model.path = "preset:<name>"` (shapes only,
     see launch.plan.PRESETS: llama3-8b, llama3-70b, llama3-405b, llama-1.1b, smollm2-135m,
     tiny), so a 1024-GPU config can be checked where the weights are not;
  4. both meshes' layouts (Layout.from_placements: TP colwise/rowwise + FSDP2 strided shards) and
     the real weight-sync plan between them (weights_sync.plan), with its traffic summary;
  5. memory per rank (launch.cost_model) for the trainer and the generator, against H100 and
     H200 memory.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # python launch/dry_run.py from anywhere
    sys.path.insert(0, str(ROOT))

from config import ConfigError  # noqa: E402

GB = 1e9
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def world_size_of(cfg) -> int:
    """The world size a config describes by its explicit degrees (see the module docstring)."""
    p = cfg.parallel
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if p.trainer_fsdp <= 0:
        world = (f"trainer_fsdp * trainer_tp = n * {p.trainer_tp}" if p.mode == "colocated" else
                 f"generator_ranks + trainer_fsdp * trainer_tp = {p.generator_ranks} + n * {p.trainer_tp}")
        raise ConfigError(
            f"cannot derive the world size for a dry run: parallel.trainer_fsdp={p.trainer_fsdp} is "
            f"derived from the world size, and no WORLD_SIZE is set. Set the degrees explicitly "
            f"(e.g. --parallel.trainer_fsdp=<n>; world = {world} in {p.mode} mode), or run with "
            f"WORLD_SIZE=<world size>")
    return p.described_world()


def model_shape(cfg):
    """(ModelArgs, is_preset) from model.path ('preset:<name>' or a Hugging Face folder)."""
    from launch.plan import resolve_model
    path = cfg.model.path
    if not path:
        raise ConfigError("model.path is empty; give a Hugging Face folder or a shape preset such as "
                          "model.path = \"preset:llama3-8b\"")
    if not path.startswith("preset:") and not os.path.isdir(path):
        raise ConfigError(f"model.path={path!r} does not exist here; to check the layouts, the weight "
                          f"sync plan and memory where the weights are not, dry-run with a shape "
                          f"preset instead: --model.path=preset:{_preset_like(path)}")
    return resolve_model(path), path.startswith("preset:")


def _preset_like(path: str) -> str:
    """The preset whose size a folder name such as 'Llama-3.1-8B-Instruct' names (llama3-8b), else
    the list of presets."""
    from launch.plan import PRESETS
    name = os.path.basename(os.path.normpath(path)).lower()
    sizes = {p: p.rpartition("-")[2] for p in PRESETS if "-" in p}
    like = [p for p, size in sizes.items() if re.search(rf"(?<![\d.]){re.escape(size)}(?![a-z])", name)]
    return like[0] if len(like) == 1 else "<" + "|".join(PRESETS) + ">"


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def dry_run(cfg) -> int:
    """Everything but training, for the config's world size; prints a report, returns 0 or raises."""
    from launch import cost_model as cm
    from parallel.dims import ParallelDims
    from weights_sync.plan import plan

    t0 = time.perf_counter()
    world = world_size_of(cfg)
    cfg = cfg.resolve(world)  # idempotent: train_rl may have resolved it already
    p = cfg.parallel
    dims = ParallelDims.from_config(p, world)
    args, preset = model_shape(cfg)
    dims.check_model(args.num_heads, args.num_kv_heads, args.tie_word_embeddings,
                     args.intermediate_size, args.vocab_size)
    print(f"dry run: world_size={world}, no process group created")
    print(dims.rank_map())
    print(f"model: {cfg.model.path}: {args.num_params() / 1e9:.3f}B params, {args.num_layers} layers, "
          f"heads {args.num_heads}/{args.num_kv_heads}")
    if not preset:
        from launch.preflight import preflight
        preflight(cfg, dims)
        print("preflight: model folder, tokenizer, data, reward and run dir ok")

    t1 = time.perf_counter()
    specs = cm.param_specs(args, cfg.model.gen_dtype)  # the sender casts to the generator dtype
    src = cm.trainer_layout(specs, dims.trainer_fsdp, dims.trainer_tp, dims.trainer_rank_list[0])
    dst = cm.generator_layout(specs, dims.gen_dp, dims.gen_tp, dims.generator_rank_list[0])
    t2 = time.perf_counter()
    pl = plan(src, dst, specs)
    t3 = time.perf_counter()
    send = pl.send_volume_by_rank()
    size = {s.name: s.itemsize for s in specs}
    first = dims.generator_rank_list[0]
    recv = sum(b.numel * size[n] for n, b in dst.boxes[first].items())
    peers = len(pl.recvs_to(first))
    print(f"layouts: trainer {dims.trainer_fsdp}x{dims.trainer_tp} and generator "
          f"{dims.gen_dp}x{dims.gen_tp}, {len(specs)} params ({t2 - t1:.2f}s)")
    print(f"weight sync plan: {pl.summary()} ({t3 - t2:.2f}s)")
    print(f"  generator rank {first} receives {_gb(recv)} from {peers} trainer ranks")
    # GPUs a node: torchrun's LOCAL_WORLD_SIZE where launched so, else 8 (the plan's default)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 8)
    for name in ("h100", "h200"):
        cl = cm.gpu_cluster(name, max(1, -(-world // per_node)), per_node)
        sb = cm.SyncBytes(max(send.values()), recv, peers, "plan")
        place = cm.Placement(world, p.mode, p.generator_ranks, p.gen_tp, p.trainer_tp)
        print(f"  predicted sync time on {name} links ({per_node} GPUs a node): "
              f"{cm.sync_time(sb, cl, place):.3f}s")
    fits = _print_memory(cfg, args, dims)
    print(f"dry run ok in {time.perf_counter() - t0:.1f}s" + (
        "" if fits else ": the config and its layouts hold, but its memory per rank fits neither "
        "card above (lower generator.num_slots or trainer.micro_batch_tokens, or spread the "
        "model over more ranks: launch/plan.py)"))
    return 0


def _print_memory(cfg, args, dims) -> list[str]:
    """Each rank's predicted memory and its verdict on each card; returns the cards it fits."""
    from launch import cost_model as cm
    from launch.plan import base_settings, compute_dtype_of
    g, t = cfg.generator, cfg.trainer
    wl = dry_run_workload(cfg)
    dt = compute_dtype_of(cfg, "cuda")
    cl_fields = base_settings(cfg, wl.prompt_len, "cuda")[1]  # FSDP units, compute bytes
    # the runtime packs whole sequences, at least one a micro-batch (cm.trainer_memory charges so)
    act_tokens = max(t.micro_batch_tokens, wl.longest_seq)
    print(f"memory per rank (launch/cost_model.py; {_SHORT[str(dt).removeprefix('torch.')]} compute):")
    fits = []
    for name in ("h100", "h200"):
        cl = cm.gpu_cluster(name, 1, **cl_fields)
        cap = cl.mem_headroom * cl.gpu_mem_gb * GB
        # with the KL reference's shard when kl_coef > 0 (frozen parameters, sharded like the trainer's)
        tr, _, why_t = cm.trainer_memory(args, cl, wl, dims.trainer_fsdp, dims.trainer_tp,
                                         cfg.parallel.activation_checkpointing, 0.0, t.micro_batch_tokens)
        ref = cm.reference_bytes(args, wl, dims.trainer_fsdp, dims.trainer_tp)
        gen, _, why_g = cm.generator_memory(args, cl, wl, dims.gen_tp, dims.gen_dp, 0.0, g.num_slots)
        state = cm.trainer_state_bytes(args, dims.trainer_fsdp, dims.trainer_tp,
                                       cm.dtype_bytes(cfg.model.dtype), cl.compute_bytes, cl.fsdp_units)
        kv = cm.generator_kv_bytes(args, dims.gen_tp, cm.kv_elem_bytes(cl, cfg.model.gen_dtype),
                                   g.num_slots, wl.slot_len)
        staging = cm.sync_staging_bytes(args, wl, dims.gen_tp)
        ev = _eval_kv_bytes(cfg, args, dims)  # replica 0's held-out evaluation engine, in `gen`
        send = cm.colocated_send_bytes(args, wl, dims.trainer_fsdp * dims.trainer_tp)
        total = tr + gen + send if dims.mode == "colocated" else max(tr, gen)
        if name == "h100":
            print(f"  trainer   rank: {_gb(tr)} = states+gathered {_gb(state)} + activations of "
                  f"{act_tokens} tokens"
                  + (f" (micro_batch_tokens={t.micro_batch_tokens} < one sequence of {wl.longest_seq})"
                     if act_tokens > t.micro_batch_tokens else "")
                  + f" (activation checkpointing {'on' if cfg.parallel.activation_checkpointing else 'off'})"
                  + (f" + KL reference shard {_gb(ref)}" if ref else ""))
            print(f"  generator rank: {_gb(gen)} = weights {_gb(gen - kv - ev - staging)} + KV cache "
                  f"{_gb(kv)} ({g.num_slots} slots x {wl.slot_len} positions)"
                  + (f" + weight-sync staging {_gb(staging)}" if staging else "")
                  + (f" + held-out eval KV cache {_gb(ev)} (replica 0)" if ev else ""))
            if dims.mode == "colocated":
                print(f"  colocated rank: both, + weight-sync send buffers of at most {_gb(send)}")
        if total <= cap:
            fits.append(name)
        verdict = "fits" if total <= cap else "DOES NOT FIT"
        # the cost model's reason where one mesh alone is over the cap (the colocated sum enters
        # only the total)
        whys = "; ".join(w for w in (why_t, why_g) if w)
        print(f"  {name} ({cl.gpu_mem_gb:.0f} GB, {cap / GB:.0f} GB usable): {verdict}"
              + (f" ({whys})" if whys else ""))
    return fits


def dry_run_workload(cfg):
    """The config's step as the cost model's Workload, the longest prompt as the prompt length
    (the rest as the planner's `base_settings` reads it from a config)."""
    from launch import cost_model as cm
    from launch.plan import base_settings
    g, t = cfg.generator, cfg.trainer
    fields = base_settings(cfg, cfg.data.max_prompt_len, "cuda")[0]
    return cm.Workload(t.prompts_per_step, g.n_samples, cfg.data.max_prompt_len, g.max_new_tokens,
                       cfg.algo.max_staleness, gen_dtype=cfg.model.gen_dtype, **fields)


def _eval_kv_bytes(cfg, args, dims) -> float:
    """The KV cache of `eval.every_steps`' engine on generator replica 0 (its shape for
    eval.num_prompts prompts, `rollout.evaluate.engine_shape`); 0 without it."""
    from launch import cost_model as cm
    from rollout.evaluate import engine_shape
    if not cfg.eval.every_steps:
        return 0.0
    slots, max_len = engine_shape(cfg, cfg.eval.num_prompts)
    return cm.generator_kv_bytes(args, dims.gen_tp, cm.dtype_bytes(cfg.model.gen_dtype), slots, max_len)


def main(argv=None) -> int:
    from config import load_config, parse_cli
    try:
        argv = sys.argv[1:] if argv is None else argv
        if {"--help", "-h"} & set(argv):
            print(__doc__.strip())
            return 0
        path, overrides, flags = parse_cli(argv)
        unknown = set(flags) - {"dry_run"}
        if unknown:
            raise ValueError(f"unknown flag(s) {sorted('--' + f.replace('_', '-') for f in unknown)}"
                             "; valid: --config FILE, --section.key=value, --help")
        return dry_run(load_config(path, overrides))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
