"""The placement planner: choose the generator/trainer split and both meshes' layouts with the
cost model (launch/cost_model.py), ReaL-style (arXiv 2406.14088), and write the best as a config.

    python launch/plan.py --preset llama3-8b --nodes 64 --gpus-per-node 8 --gpu h100 \\
        --prompts 512 --group 16 --prompt-len 512 --response-len 2048 --eta 4 --top 10 \\
        --out best.toml
    python launch/plan.py --model HF_FOLDER --nodes 1 --gpus-per-node 4 --gpu cpu \\
        --profile profile.json ...            # measured numbers instead of the datasheet
    python launch/plan.py --cluster-table     # 8B/70B/405B async-vs-sync vs LlamaRL's figures

Search. Every placement is enumerated: mode (split or colocated), generator ranks G = 1..N-1,
gen_tp and trainer_tp among the divisors of gpus_per_node that divide both head counts (TP stays
inside a node), gen_dp = G/gen_tp and trainer_fsdp = (N-G)/trainer_tp (gen_dp and
trainer_fsdp * updates_per_step <= prompts_per_step, as the runtime requires; generator TP 1
only where the base config refuses TP there: generator.stack_weights='all'), activation
checkpointing off/on. For each, memory picks the most KV
slots and the largest power-of-two micro-batch that fit; memory and phase times are cached per
mesh (the generator's depend only on (gen_tp, gen_dp), the trainer's on (fsdp, tp, ac)), so
1024 GPUs (~5600 placements for Llama-3-8B) take 1-4 s here. Weight sync is first costed in
closed form (even shards), then the best `--refine` split placements are re-costed with the real
weights_sync.plan (one layer x L, exact for sharded matrices) and re-ranked. Nothing is pruned.
Ties in step time (the generator's time is flat over many splits) go to the least total phase
time, which leaves the most slack in the phase that is not the bottleneck.

Async vs sync at cluster scale (`--cluster-table`; LlamaRL, arXiv 2505.24034, reports 2.52x /
3.98x / 10.7x for 8B / 70B / 405B against a DeepSpeed-Chat-like synchronous system). The model
predicts much less, and the gap is expected, not a bug of either:
  * Our baseline is the *best* synchronous placement under the same cost model (colocated or
    split, the same engine, the same DDMA weight sync, a tuned layout). LlamaRL's baseline pays
    costs we do not model: rank-0 gather/broadcast weight sync (111 s vs 1.15 s for 70B in their
    paper), a generator inside the training framework (no fast inference layout), memory
    offloading, and smaller batches forced by colocation.
  * With ideal linear scaling, splitting the GPUs buys nothing over time-sharing them:
    T_gen(N) + T_train(N) = max(T_gen(N_g), T_train(N_t)) when both phases scale perfectly.
    Async gains only where a phase scales badly: decode is bound by reading the weights once per
    step, so its time per step barely drops with more replicas, and the best split gives the
    generator just enough GPUs to keep up. The predicted gain is therefore 1.1-2x, and it grows
    with R (longer decode) and shrinks with more prompts per step.
  * Idealised phases: fixed lengths (no long tail), perfect overlap of FSDP traffic, no
    stragglers. A long-tailed length distribution makes synchronous steps wait for the slowest
    sample, which async hides: the 10.7x at 405B includes that.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from config import int_at_least  # noqa: E402
from launch import cost_model as cm  # noqa: E402
from model.args import ModelArgs  # noqa: E402
from parallel.dims import vocab_checkpointable  # noqa: E402

PRESETS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8),
    "llama3-405b": dict(vocab_size=128256, hidden_size=16384, intermediate_size=53248,
                        num_layers=126, num_heads=128, num_kv_heads=8),
    # the "1.1B Llama shape" of shared/REFERENCES.md, which the GPU benches use (bench/common.py)
    "llama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
                       num_heads=32, num_kv_heads=8),
    # SmolLM2-135M(-Instruct): tied embeddings, so 135M parameters with its 28M-entry embedding
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, tie_word_embeddings=True),
    # the shape of tools/make_tiny_model.make_random_model(hidden=64) (addition-task vocabulary)
    "tiny": dict(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2),
}
ALIASES = {"8b": "llama3-8b", "70b": "llama3-70b", "405b": "llama3-405b"}


def preset_args(name: str) -> ModelArgs:
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    big = key.startswith("llama3")
    return ModelArgs(**PRESETS[key], rope_theta=500000.0 if big else 10000.0,
                     max_position_embeddings=8192 if big else 2048,
                     torch_dtype="bfloat16" if big else "float32")


def resolve_model(spec: str) -> ModelArgs:
    """`preset:<name>` (or a bare preset name that is no folder here) -> its shape; otherwise a
    Hugging Face folder (one named like a preset, ./70b, is the folder: it was planned as the
    preset's 70B, the dry run's memory and sync plan too, while preflight checked the folder)."""
    name = spec.removeprefix("preset:")
    if spec.startswith("preset:") or (ALIASES.get(name, name) in PRESETS
                                      and not os.path.isdir(spec)):
        return preset_args(name)
    from model.hf_io import load_model_args
    return load_model_args(spec)


# ----- search ---------------------------------------------------------------------------------------
def tp_degrees(args: ModelArgs, gpus_per_node: int, one_host: bool = False) -> list[int]:
    """TP degrees that shard whole heads and the intermediate size evenly and keep a TP group
    inside a node (on a single host, e.g. CPU ranks, any degree up to the rank count does): the
    ones `ParallelDims.check_model` accepts."""
    return [d for d in range(1, gpus_per_node + 1) if (one_host or gpus_per_node % d == 0)
            and args.num_heads % d == 0 and args.num_kv_heads % d == 0
            and args.intermediate_size % d == 0
            and (d == 1 or not args.tie_word_embeddings)]


def placements(args: ModelArgs, world: int, gpus_per_node: int, prompts_per_step: int,
               modes=("split", "colocated"), one_host: bool = False, updates: int = 1,
               gen_tp: bool = True):
    """Every placement the runtime accepts (see the module docstring); `gen_tp` False: the
    generator at TP 1 only (generator.stack_weights='all', which config.py refuses with TP); no
    trainer layout whose vocabulary shards DCP cannot checkpoint
    (`parallel.dims.vocab_checkpointable`); `updates`: trainer.updates_per_step, each of which
    deals every trainer data-parallel rank a prompt group (config.py: trainer_fsdp * updates <=
    prompts_per_step)."""
    unknown = set(modes) - {"split", "colocated"}
    if unknown:
        raise ValueError(f"unknown placement mode(s) {sorted(unknown)}; choose from 'split', 'colocated'")
    tps = tp_degrees(args, gpus_per_node, one_host)
    for mode in modes:
        gens = range(1, world) if mode == "split" else [world]
        for g in gens:
            t = world - g if mode == "split" else world
            for gtp in tps if gen_tp else [1]:
                aligned = one_host or (world - g) % gtp == 0  # TP groups must not straddle nodes
                if g % gtp or not aligned or g // gtp > prompts_per_step:
                    continue
                for ttp in tps:
                    if (t % ttp or t // ttp * updates > prompts_per_step
                            or not vocab_checkpointable(args.vocab_size, ttp, t // ttp)):
                        continue
                    for ac in (False, True):
                        yield cm.Placement(world, mode, g, gtp, ttp, ac)


def no_placement_reason(args: ModelArgs, world: int, gpus_per_node: int, prompts_per_step: int,
                        modes=("split", "colocated"), one_host: bool = False, updates: int = 1,
                        gen_tp: bool = True) -> str:
    """Why `placements` (same arguments) yields nothing, and the fix: split mode needs two ranks;
    every generator replica and every trainer data-parallel rank needs a prompt group (one per
    update), so gen_dp and trainer_fsdp * updates are <= --prompts, and the TP degrees that
    shrink them are few (e.g. only 1 for tied embeddings)."""
    if world < 2 and "colocated" not in modes:
        return (f"split mode needs at least 2 ranks (a generator and a trainer), the job has "
                f"{world}; add --modes colocated (every rank does both) or use more ranks")
    tps = tp_degrees(args, gpus_per_node, one_host)
    gen_tps = tps if gen_tp else [1]
    enough = next((b for b in range(prompts_per_step + 1, world * updates + 1)
                   if next(placements(args, world, gpus_per_node, b, modes, one_host, updates,
                                      gen_tp), None)), None)
    fix = (f"raise --prompts to at least {enough}, or use fewer ranks" if enough
           else "use fewer ranks")
    trainer = (f"trainer_fsdp * trainer.updates_per_step = trainer ranks / trainer_tp * {updates}"
               if updates > 1 else "trainer_fsdp = trainer ranks / trainer_tp")
    return (f"no placement of {world} ranks ({'/'.join(modes)}) is valid for --prompts "
            f"{prompts_per_step}: gen_dp = G / gen_tp and {trainer} must each be <= --prompts "
            f"(one prompt group at least per generator replica, and per trainer data-parallel rank "
            f"and update), and this model and config allow generator TP degrees {gen_tps} and "
            f"trainer TP degrees {tps} only; {fix}")


@dataclass
class PlanResult:
    ranked: list            # feasible Estimates, best first (at the workload's eta)
    best: cm.Estimate | None
    best_sync: cm.Estimate | None  # the best placement when run synchronously (eta = 0)
    searched: int
    feasible: int
    seconds: float
    infeasible_why: dict = field(default_factory=dict)  # reason -> count
    # reason -> (bytes, label, why) of the infeasible placement that needs the least memory on
    # that mesh: the nearest miss, which says by how much a model does not fit
    nearest_miss: dict = field(default_factory=dict)

    def speedup(self, e: cm.Estimate) -> float:
        return self.best_sync.step_sync / e.step if self.best_sync else math.nan


def best_plan(args: ModelArgs, cluster: cm.Cluster, wl: cm.Workload, profile=None,
              modes=("split", "colocated"), refine: int = 8, keep: int = 50) -> PlanResult:
    """Exhaustive search; returns the `keep` best feasible placements and the best sync one."""
    t0 = time.perf_counter()
    world = cluster.world
    gen_time = functools.lru_cache(maxsize=None)(
        lambda gtp, gdp, slots, poll: cm.generation_time(args, cluster, wl, gtp, gdp, slots, profile,
                                                         poll))
    train_time = functools.lru_cache(maxsize=None)(
        lambda f, tp, ac, mbt: cm.train_time(args, cluster, wl, f, tp, ac, mbt, profile))
    gen_mem = functools.lru_cache(maxsize=None)(
        lambda gtp, gdp: cm.generator_memory(args, cluster, wl, gtp, gdp))
    train_mem = functools.lru_cache(maxsize=None)(
        lambda f, tp, ac: cm.trainer_memory(args, cluster, wl, f, tp, ac))
    ests, why, nearest, searched = [], {}, {}, 0
    for p in placements(args, world, cluster.gpus_per_node, wl.prompts_per_step, modes,
                        cluster.one_cpu_host, wl.updates, gen_tp_allowed(wl)):
        searched += 1
        # memory is separable in split mode: key it on the mesh, not the whole placement
        m = (cm.plan_memory(args, cluster, wl, p) if p.mode == "colocated"
             else _split_memory(gen_mem, train_mem, p))
        if m.why:
            key = m.why.split(":")[0]
            why[key] = why.get(key, 0) + 1
            # colocated ranks hold both meshes: their sum is what did not fit
            need = (m.per_rank if p.mode == "colocated" else
                    m.generator if key == "generator" else m.trainer)
            if key not in nearest or need < nearest[key][0]:
                nearest[key] = (need, p.label(), m.why)
            continue
        g = gen_time(p.gen_tp, p.gen_dp, m.slots, p.mode == "split")
        tr = train_time(p.trainer_fsdp, p.trainer_tp, p.activation_checkpointing, m.micro_batch_tokens)
        ests.append(cm.assemble(args, cluster, wl, p, m, g, tr, None, profile))
    refined = _refine(args, cluster, wl, ests, refine, profile)
    ranked = sorted(refined, key=rank_key)
    best_sync = min(refined, key=lambda e: e.step_sync, default=None)
    return PlanResult(ranked[:keep], ranked[0] if ranked else None, best_sync, searched, len(ests),
                      time.perf_counter() - t0, why, nearest)


def gen_tp_allowed(wl: cm.Workload) -> bool:
    """Whether the generator may use TP: config.py refuses generator.stack_weights='all' with
    parallel.gen_tp > 1 (the engine cannot stack TP shards)."""
    return wl.stack_weights != "all"


def _split_memory(gen_mem, train_mem, p: cm.Placement) -> cm.Memory:
    """Split-mode memory from the two cached halves (each depends on its own mesh only)."""
    g_bytes, slots, why_g = gen_mem(p.gen_tp, p.gen_dp)
    t_bytes, mbt, why_t = train_mem(p.trainer_fsdp, p.trainer_tp, p.activation_checkpointing)
    return cm.Memory(t_bytes, g_bytes, max(t_bytes, g_bytes), slots, mbt, why_g or why_t)


def rank_key(e: cm.Estimate) -> tuple[float, float]:
    """The search's order: step time; ties (the generator's time is flat over many splits) go to
    the least total phase time: the most slack in the phase that is not the bottleneck, so
    model errors hurt least."""
    return round(e.step, 9), e.times.gen + e.times.train + e.times.sync


def _refine(args, cluster, wl, ests, k: int, profile) -> list:
    """Re-cost the best k split placements' weight sync with the real plan."""
    if k <= 0:
        return ests
    out = list(ests)
    # the final ranking's order (`rank_key`): among plans of one step time (generation-bound
    # ones tie), by step alone the ones re-costed were any of them, not the chosen
    order = sorted(range(len(out)), key=lambda i: rank_key(out[i]))
    done = 0
    for i in order:
        e = out[i]
        if e.placement.mode != "split":
            continue
        sb = cm.sync_bytes_from_plan(args, e.placement, wl.gen_dtype, reduced=True)
        t = e.times.detail
        out[i] = cm.assemble(args, cluster, wl, e.placement, e.memory, t["gen"], t["train"], sb, profile)
        done += 1
        if done >= k:
            break
    return out


# ----- a base config's settings ----------------------------------------------------------------------
def compute_dtype_of(cfg, device_type: str):
    """The trainer's compute dtype (model.compute_dtype as parallel.sharding.compute_dtype
    resolves it: "auto" is bf16 on CUDA, model.dtype elsewhere; never wider than model.dtype)."""
    from model.hf_io import to_dtype
    from parallel.sharding import compute_dtype
    return compute_dtype(cfg.model.compute_dtype, device_type, to_dtype(cfg.model.dtype))


def base_settings(cfg, prompt_len: int, device_type: str) -> tuple[dict, dict]:
    """(Workload fields, Cluster fields) that a --base-config sets, so that the search sizes what
    the written config runs: its master dtype, prompt sharing, stacked weights, the longest prompt
    it admits (data.max_prompt_len, when longer than --prompt-len: the KV slots hold it), a KL
    reference (algo.kl_coef > 0), its updates per step and whether its loss needs pi_prox, its
    held-out evaluation engine (eval.every_steps > 0: its KV cache on generator replica 0), its
    FSDP units and compute dtype."""
    from parallel.dims import resolve_fsdp_units
    from trainer.step import needs_prox
    a = cfg.algo
    wl = dict(master_dtype=cfg.model.dtype, share_prompts=cfg.trainer.share_prompts,
              stack_weights=cfg.generator.stack_weights,
              max_prompt_len=max(cfg.data.max_prompt_len, prompt_len),
              kl_reference=a.kl_coef > 0, updates=cfg.trainer.updates_per_step,
              prox_loss=needs_prox(a),
              eval_prompts=cfg.eval.num_prompts if cfg.eval.every_steps else 0,
              eval_new_tokens=cfg.eval.max_new_tokens)
    cl = dict(fsdp_units=resolve_fsdp_units(cfg.parallel.fsdp_units, device_type),
              compute_bytes=compute_dtype_of(cfg, device_type).itemsize)
    return wl, cl


# ----- output ---------------------------------------------------------------------------------------
def table(res: PlanResult, top: int) -> str:
    hdr = (f"{'#':>2} {'placement':<44} {'T_gen':>8} {'T_train':>8} {'T_sync':>7} {'step':>8} "
           f"{'vs sync':>7} {'mem_t':>6} {'mem_g':>6} {'slots':>5} {'mbt':>6}")
    lines = [hdr, "-" * len(hdr)]
    for i, e in enumerate(res.ranked[:top], 1):
        t, m = e.times, e.memory
        lines.append(f"{i:>2} {e.placement.label():<44} {_s(t.gen)} {_s(t.train)} {t.sync:>7.3f} "
                     f"{_s(e.step)} {res.speedup(e):>6.2f}x {m.trainer / cm.GB:>6.1f} "
                     f"{m.generator / cm.GB:>6.1f} {m.slots:>5} {m.micro_batch_tokens:>6}")
    if res.best_sync:
        b = res.best_sync
        lines.append(f"best synchronous placement: {b.placement.label()}: step {b.step_sync:.3f}s "
                     f"(T_gen {b.times.gen:.3f} + T_train {b.times.train:.3f} + T_sync {b.times.sync:.3f})")
    return "\n".join(lines)


def _s(x: float) -> str:
    return f"{x:>8.3f}" if x < 1000 else f"{x:>8.0f}"


def to_config(e: cm.Estimate, wl: cm.Workload, model_spec: str, base: str | None = None):
    """A validated, resolved-able Config for the placement `e` (load_config(path) round-trips)."""
    from config import ConfigError, RunConfig, load_config
    if wl.gen_dtype not in ("float32", "bfloat16", "float16") or wl.master_dtype not in (
            "float32", "bfloat16", "float16"):
        raise ConfigError(f"dtypes master={wl.master_dtype} gen={wl.gen_dtype} cannot be written to "
                          "a config (model.dtype/gen_dtype accept float32, bfloat16, float16); "
                          "plan with --gen-dtype bfloat16 to write a TOML")
    p, m = e.placement, e.memory
    cfg = load_config(base)
    cfg.model.path, cfg.model.dtype, cfg.model.gen_dtype = model_spec, wl.master_dtype, wl.gen_dtype
    par = cfg.parallel
    par.mode, par.generator_ranks = p.mode, p.generator_ranks
    par.gen_tp, par.gen_dp, par.trainer_tp, par.trainer_fsdp = p.gen_tp, p.gen_dp, p.trainer_tp, p.trainer_fsdp
    par.activation_checkpointing = p.activation_checkpointing
    cfg.generator.num_slots, cfg.generator.n_samples = m.slots, wl.group_size
    cfg.generator.max_new_tokens = wl.response_len
    cfg.trainer.prompts_per_step, cfg.trainer.micro_batch_tokens = wl.prompts_per_step, m.micro_batch_tokens
    cfg.algo.max_staleness = wl.eta
    # the engine allocates num_slots x (max_prompt_len + max_new_tokens) positions: write the
    # prompt length the KV slots were sized for (--prompt-len, or a base config's longer one)
    cfg.data.max_prompt_len = wl.prompt_cap
    # a base config's name leads (its runs' plan), but is not its folder: a run of the base
    # config there would be taken as this one's ("already completed", or resumed)
    named = base is not None and cfg.run.name != RunConfig.name
    cfg.run.name = (f"{cfg.run.name}_" if named else "") + (
        f"plan_{p.world}r_{p.mode}_g{p.generator_ranks}")
    if cfg.run.dir:  # the base's runs' folder: this run's goes beside it, under its own name
        cfg.run.dir = str(Path(cfg.run.dir).parent / cfg.run.name)
    if p.mode == "colocated":  # checkpoints are split mode's: preflight refused the file
        cfg.checkpoint.every_steps = 0
    cfg.validate().resolve(p.world)  # raises if the placement and the config disagree
    return cfg


def write_toml(res: PlanResult, wl: cm.Workload, model_spec: str, path: str, base=None) -> None:
    e = res.best
    cfg = to_config(e, wl, model_spec, base)
    t = e.times
    head = [f"# Written by launch/plan.py: the best of {res.searched} placements "
            f"({res.feasible} feasible) for world_size={e.placement.world}.",
            f"#   {e.placement.label()}",
            f"#   predicted: T_gen {t.gen:.3f}s  T_train {t.train:.3f}s  T_sync {t.sync:.3f}s  "
            f"step {e.step:.3f}s ({res.speedup(e):.2f}x the best synchronous placement)",
            f"#   memory per rank: trainer {e.memory.trainer / cm.GB:.1f} GB, generator "
            f"{e.memory.generator / cm.GB:.1f} GB",
            f"# Launch with world_size={e.placement.world}; dry run: "
            f"python train_rl.py --dry-run --config {path}"]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(head) + "\n" + cfg.to_toml())


# ----- LlamaRL comparison ---------------------------------------------------------------------------------
LLAMARL = [("llama3-8b", 256, 2.52, "bfloat16"), ("llama3-70b", 512, 3.98, "bfloat16"),
           ("llama3-405b", 1024, 10.7, "float8_e4m3fn")]


def cluster_table(wl: cm.Workload, gpu: str = "h100", log=print) -> list[dict]:
    """Predicted best-async vs best-sync step time per model (module docstring explains the gap).
    405B generates in fp8 as in LlamaRL: bf16 weights (101 GB per GPU at tp 8) do not fit. Nor
    do fp8 ones on an H100 (80 GB): 50.6 GB at tp 8 plus its staged copy for the weight sync; a
    model with no feasible placement gets a row that says why."""
    rows = []
    log(f"{'model':<12} {'GPUs':>5} {'best async placement':<44} {'async s':>8} {'sync s':>8} "
        f"{'speedup':>7} {'LlamaRL':>7}")
    for name, gpus, paper, gen_dtype in LLAMARL:
        args, cl = preset_args(name), cm.gpu_cluster(gpu, gpus // 8)
        w = replace(wl, gen_dtype=gen_dtype, eta=max(wl.eta, 1))
        res = best_plan(args, cl, w)
        b, s = res.best, res.best_sync
        if b is None:
            rows.append({"model": name, "gpus": gpus, "gen_dtype": gen_dtype, "best": None,
                         "infeasible": res.infeasible_why, "llamarl": paper})
            log(f"{name:<12} {gpus:>5} no placement fits in {gpu} memory: {res.infeasible_why}")
            continue
        row = {"model": name, "gpus": gpus, "gen_dtype": gen_dtype, "async_s": b.step,
               "sync_s": s.step_sync, "speedup": s.step_sync / b.step, "llamarl": paper,
               "best": b.placement.label(), "best_sync": s.placement.label(), "search_s": res.seconds}
        rows.append(row)
        log(f"{name:<12} {gpus:>5} {row['best']:<44} {b.step:>8.1f} {s.step_sync:>8.1f} "
            f"{row['speedup']:>6.2f}x {paper:>6.2f}x")
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests parse the README's commands with it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="Hugging Face model folder (or preset:<name>)")
    src.add_argument("--preset", help=f"one of {sorted(PRESETS)} (or 8b/70b/405b)")
    ap.add_argument("--nodes", type=int_at_least(1), default=1, help="nodes in the job")
    ap.add_argument("--gpus-per-node", type=int_at_least(1), default=8, help="GPUs (or CPU ranks) per node")
    ap.add_argument("--gpu", default="h100", help=f"{sorted(cm.GPUS)} or cpu")
    ap.add_argument("--cores", type=int_at_least(1), default=2, help="--gpu cpu: cores the ranks share")
    ap.add_argument("--mem-gb", type=float, default=16.0, help="--gpu cpu: the host's memory the "
                    "ranks share, in GB")
    ap.add_argument("--profile", help="profile JSON from launch/calibrate.py (overrides the datasheet)")
    ap.add_argument("--prompts", type=int_at_least(1), help="prompt groups per trainer step "
                    "(default: --base-config's trainer.prompts_per_step, else 512)")
    ap.add_argument("--group", type=int_at_least(1), help="samples per prompt, the GRPO group "
                    "(default: --base-config's generator.n_samples, else 16)")
    ap.add_argument("--prompt-len", type=int_at_least(1), help="mean prompt tokens (default: "
                    "--base-config's data.max_prompt_len, a bound, else 512)")
    ap.add_argument("--response-len", type=int_at_least(1), help="response tokens per sample "
                    "(default: --base-config's generator.max_new_tokens, else 2048)")
    ap.add_argument("--eta", type=int_at_least(0), help="max staleness in versions, 0 = "
                    "synchronous (default: --base-config's algo.max_staleness, else 4)")
    ap.add_argument("--gen-dtype", default=None, help="default: bfloat16 on GPUs, float32 on cpu")
    ap.add_argument("--modes", default="split,colocated", help="placement modes to search, comma separated")
    ap.add_argument("--top", type=int_at_least(1), default=10, help="rows of the candidate table")
    ap.add_argument("--refine", type=int_at_least(0), default=8, help="re-cost this many with the real sync plan")
    ap.add_argument("--out", help="write the best placement as a TOML config here")
    ap.add_argument("--base-config", help="TOML whose other settings the --out config keeps")
    ap.add_argument("--cluster-table", action="store_true", help="8B/70B/405B vs LlamaRL and exit")
    return ap


# what --cluster-table reads: the workload and the GPU; it plans its own models and clusters
CLUSTER_TABLE_FLAGS = {"cluster_table", "gpu", "prompts", "group", "prompt_len", "response_len", "eta"}


def ignored_by_cluster_table(ap: argparse.ArgumentParser, a: argparse.Namespace) -> list[str]:
    """The flags given (not at their defaults) that --cluster-table would silently ignore."""
    return [f"--{k.replace('_', '-')}" for k, v in vars(a).items()
            if k not in CLUSTER_TABLE_FLAGS and v != ap.get_default(k)]


# the workload flags' defaults without a --base-config: (flag, its default, the config key)
WORKLOAD_DEFAULTS = (("prompts", 512, "trainer.prompts_per_step"), ("group", 16, "generator.n_samples"),
                     ("prompt_len", 512, "data.max_prompt_len"),
                     ("response_len", 2048, "generator.max_new_tokens"),
                     ("eta", 4, "algo.max_staleness"))


def workload_flags(a: argparse.Namespace, base) -> list[int]:
    """--prompts, --group, --prompt-len, --response-len and --eta as given, else the
    --base-config's values (the written config keeps them: the defaults replaced them without a
    word, and --prompt-len's 512 its max_prompt_len of 32), else the defaults."""
    from config import value_of
    return [getattr(a, flag) if getattr(a, flag) is not None else
            value_of(base, key) if a.base_config else default
            for flag, default, key in WORKLOAD_DEFAULTS]


def ignored_for_device(ap: argparse.ArgumentParser, a: argparse.Namespace) -> str | None:
    """Why the flags given do not fit --gpu (each was ignored or read otherwise), or None."""
    cpu = a.gpu == "cpu"
    if not cpu and a.cores != ap.get_default("cores"):
        return f"--cores applies to --gpu cpu (the cores CPU ranks share); --gpu {a.gpu} has none"
    if not cpu and a.mem_gb != ap.get_default("mem_gb"):
        return f"--mem-gb applies to --gpu cpu (the host's memory); --gpu {a.gpu} has its own"
    if not (math.isfinite(a.mem_gb) and a.mem_gb > 0):
        return f"--mem-gb={a.mem_gb:g}: give the host's memory in GB, a number > 0"
    if cpu and a.nodes > 1:
        return ("--gpu cpu plans the ranks of one host (their cores shared): give its ranks as "
                "--gpus-per-node N with --nodes 1")
    if cpu and a.cluster_table:
        return "--cluster-table compares GPU clusters (8B/70B/405B); give --gpu h100, a100 or h200"
    return None


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cluster_table and (ignored := ignored_by_cluster_table(ap, a)):
        ap.error(f"--cluster-table plans its own models (8B/70B/405B) and clusters and writes no "
                 f"config: it does not use {' '.join(ignored)}; it reads only --gpu, --prompts, "
                 "--group, --prompt-len, --response-len and --eta")
    if (why := ignored_for_device(ap, a)) is not None:
        ap.error(why)
    try:
        return _main(a)
    except (ValueError, OSError) as e:  # OSError: e.g. --out in a folder that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(a) -> int:
    cpu = a.gpu == "cpu"
    gen_dtype = a.gen_dtype or ("float32" if cpu else "bfloat16")
    # the config that will be written (--base-config, else the defaults) changes what fits:
    # search with its settings (e.g. data.max_prompt_len sizes the KV slots), not only write them
    from config import load_config
    base = load_config(a.base_config)
    prompts, group, prompt_len, response_len, eta = workload_flags(a, base)
    base_wl, base_cl = base_settings(base, prompt_len, "cpu" if cpu else "cuda")
    wl = cm.Workload(prompts, group, prompt_len, response_len, eta,
                     base_wl.pop("master_dtype", "float32"), gen_dtype, **base_wl)
    if a.cluster_table:
        cluster_table(wl, a.gpu)
        return 0
    if not (a.model or a.preset):
        raise ValueError("give --model HF_FOLDER, --preset NAME or --cluster-table")
    spec = a.model or f"preset:{ALIASES.get(a.preset, a.preset)}"
    args = resolve_model(spec)
    prof = cm.Profile.load(a.profile) if a.profile else None
    if cpu:
        cl = cm.cpu_cluster(a.nodes * a.gpus_per_node, a.cores, a.mem_gb)
    else:
        cl = cm.gpu_cluster(a.gpu, a.nodes, a.gpus_per_node)
    cl = replace(cl, **base_cl)
    if prof is not None:
        if (prof.device == "cpu") != cpu:
            print(f"warning: the profile was measured on {prof.device}, the plan is for "
                  f"{'cpu' if cpu else a.gpu} ranks: its times will not fit them", file=sys.stderr)
        if not prof.matches(args):
            print(f"warning: the profile is of model {prof.model}, not {cm.model_signature(args)}: "
                  "only its link numbers are used" + (" and its cores' sharing curve" if cpu else ""),
                  file=sys.stderr)
        cl = cm.with_profile(cl, prof)
    modes = tuple(a.modes.split(","))
    res = best_plan(args, cl, wl, prof, modes=modes, refine=a.refine, keep=max(50, a.top))
    print(f"model {spec}: {args.num_params() / 1e9:.3f}B params; {cl.world} ranks "
          f"({cl.nodes} x {cl.gpus_per_node} {cl.name}); workload {wl.prompts_per_step} prompts x "
          f"{wl.group_size} samples, {wl.prompt_len}+{wl.response_len} tokens, eta {wl.eta}")
    print(f"searched {res.searched} placements exhaustively in {res.seconds:.2f}s: {res.feasible} "
          f"feasible{'; infeasible: ' + str(res.infeasible_why) if res.infeasible_why else ''}")
    if res.searched == 0:
        raise ValueError(no_placement_reason(args, cl.world, cl.gpus_per_node, wl.prompts_per_step,
                                             modes, cl.one_cpu_host, wl.updates,
                                             gen_tp_allowed(wl)))
    if res.best is None:
        misses = "; ".join(f"{label}: {why}" for _, label, why in res.nearest_miss.values())
        plural = "es, per mesh" if len(res.nearest_miss) > 1 else ""
        more = (f"Give the host's memory if it has more than {a.mem_gb:g} GB (--mem-gb), or "
                "fewer ranks" if cpu else
                f"Add nodes or use a larger GPU (a TP group stays inside a node: at most "
                f"--gpus-per-node {cl.gpus_per_node} GPUs share a generator replica's weights)")
        raise ValueError(f"no placement fits in memory ({res.infeasible_why}); the nearest "
                         f"miss{plural}: {misses}. {more}, or shorten --response-len / --prompt-len")
    try:  # the file first: a reader of the table that stops early (`| head`) lost it
        if a.out:
            write_toml(res, wl, spec, a.out, a.base_config)
    finally:  # also where the base config and the plan disagree (raised after it)
        print(table(res, a.top))
    if a.out:
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
