"""Checks of user input that need no process group, run on every rank before any is created, so a
bad config fails in seconds with one message instead of a hang or a wall of tracebacks."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

from config import ConfigError
from launch.faults import check_spec

# where tools/make_tiny_model.py writes by default (its --out), the tiny preset's model.path
TINY_MODEL = Path("runs/_models/tiny_addition")


def preflight(cfg, dims):
    """Validate model folder, tokenizer, layout vs heads, data, reward and run dir.
    Returns the tokenizer (loaded once here, reused by the roles)."""
    import torch
    from model import Transformer
    from model.hf_io import CheckpointReader, check_tensors, expected_tensors, load_model_args
    from model.tokenizer import load_tokenizer
    from rollout.rewards import resolve_reward
    from rollout.role import load_eval_items, load_items
    from trainer.checkpointing import check_resume

    _check_model_folder(cfg)
    _check_ref_folder(cfg)
    args = load_model_args(cfg.model.path)
    with torch.device("meta"):
        check_tensors(CheckpointReader(cfg.model.path), expected_tensors(Transformer(args)))
    _check_tp_fits_model(cfg, dims, args)
    dims.check_model(args.num_heads, args.num_kv_heads, args.tie_word_embeddings,
                     args.intermediate_size, args.vocab_size)
    _check_device_choices(cfg)
    check_spec(dims, cfg.trainer.max_steps, cfg.algo.max_staleness, cfg.trainer.prompts_per_step)
    tok = load_tokenizer(cfg.model.path)
    if tok.vocab_size > args.vocab_size:
        raise ValueError(f"tokenizer of {cfg.model.path} has {tok.vocab_size} tokens but the model's "
                         f"vocab_size is {args.vocab_size}: they do not belong together; put "
                         f"the model's own tokenizer files in {cfg.model.path}, or resize the "
                         f"model's embeddings to at least {tok.vocab_size} rows "
                         f"(transformers' resize_token_embeddings) before training")
    bad = [t for t in cfg.generator.stop_token_ids if not 0 <= t < args.vocab_size]
    if bad:
        raise ConfigError(f"generator.stop_token_ids has {bad}, outside the model's vocabulary "
                          f"[0, {args.vocab_size}): no token could ever stop on them; use ids of "
                          f"this model's tokenizer")
    # raises on a missing/empty dataset or when every prompt is too long; the first rank alone
    # logs the prompts skipped (every rank, and then each generator again, said it)
    items = load_items(cfg, tok, warn=_first_rank())[0]
    if cfg.eval.every_steps:
        load_eval_items(cfg, tok, warn=_first_rank())  # the same for the held-out prompts
    resolve_reward(cfg.reward.fn, cfg.reward.format_weight)
    _check_reward_fits_data(cfg)
    start = check_resume(cfg)  # first: a split run resumed as colocated is told so at once
    if dims.mode == "colocated" and cfg.checkpoint.every_steps:
        raise ConfigError("checkpoints are implemented for split mode only; with "
                          "parallel.mode='colocated' set checkpoint.every_steps=0")
    check_resumed(cfg, start, args, items)
    _check_writable(Path(cfg.run.dir))
    _print_resume_changes(cfg, start)
    _warn_no_learning_signal(cfg)
    _warn_warmup_past_the_end(cfg.trainer)
    _warn_past_the_models_context(cfg, args.max_position_embeddings)
    return tok


def _check_reward_fits_data(cfg) -> None:
    """The 'reasoning_gym' reward scores items of a reasoning_gym task only: on others every call
    raised, each scored 0, and the run trained on nothing and exited 0."""
    if cfg.reward.fn != "reasoning_gym":
        return
    sources = {"data.source": cfg.data.source}
    if cfg.eval.every_steps and cfg.eval.source:
        sources["eval.source"] = cfg.eval.source
    for key, source in sources.items():
        if not source.startswith("reasoning_gym:"):
            raise ConfigError(f"reward.fn='reasoning_gym' scores prompts of a reasoning_gym task "
                              f"(their own scorer), but {key}={source!r} is not one: every "
                              f"completion would score 0; use --{key}=reasoning_gym:<task>, or "
                              "another reward.fn (e.g. 'math' or 'exact_match')")


def _first_rank() -> bool:
    """Preflight runs on every rank; what it says once, the job's first rank says."""
    return int(os.environ.get("RANK", "0")) == 0


def _warn_no_learning_signal(cfg) -> None:
    """Rank 0 warns of a training run whose groups cannot differ: every algo.advantage is a group
    baseline, so each advantage is 0 and the policy loss has no gradient (only KL and entropy
    terms move the weights). Not refused: a throughput or calibration run may want it."""
    g, steps = cfg.generator, cfg.trainer.max_steps
    if steps == 0 or not _first_rank():
        return
    why = None
    if g.n_samples == 1:
        why = "generator.n_samples=1: a group of one is its own baseline"
    elif g.samples_greedily() or g.top_k == 1:
        why = (f"greedy sampling (generator.greedy={g.greedy}, temperature={g.temperature}, "
               f"top_k={g.top_k}): a group's {g.n_samples} completions are the same")
    if why is not None:
        print(f"warning: {why}, so every advantage (algo.advantage={cfg.algo.advantage!r}) is 0 "
              f"and the policy loss has no gradient for all {steps} steps; sample with "
              f"--generator.n_samples=4 at a temperature > 0 to learn from rewards",
              file=sys.stderr, flush=True)


def _warn_warmup_past_the_end(t) -> None:
    """Rank 0 warns of a warm-up as long as the run or longer (`trainer.optim.lr_lambda`: step
    k of a warm-up of W runs at (k + 1) / W x trainer.lr): the lr rises for the whole run,
    reaching trainer.lr at its last step at best, and a cosine never starts to decay. A warm-up
    of one step is none (its one step runs at trainer.lr)."""
    if not (0 < t.max_steps <= t.warmup_steps and t.warmup_steps > 1) or not _first_rank():
        return
    end = ("reaches trainer.lr only at its last step" if t.warmup_steps == t.max_steps else
           f"ends at {t.max_steps / t.warmup_steps:.3g} x trainer.lr={t.lr:g}, never reaching it")
    print(f"warning: trainer.warmup_steps={t.warmup_steps} >= trainer.max_steps={t.max_steps}: "
          f"the learning rate rises for the whole run and {end}; set --trainer.warmup_steps below "
          f"{t.max_steps} (e.g. {t.max_steps // 20 if t.max_steps >= 40 else t.max_steps // 2})",
          file=sys.stderr, flush=True)


def _warn_past_the_models_context(cfg, max_positions: int) -> None:
    """Rank 0 warns when a sample may run past the model's max_position_embeddings (the prompt
    up to data.max_prompt_len, then generator.max_new_tokens or eval.max_new_tokens): the run
    went on without a word, decoding positions the model was never trained at, where a RoPE
    model's outputs degrade quietly. Not refused: max_prompt_len is a bound, not every prompt's
    length, and some configs state a context shorter than the model takes."""
    d, g, ev = cfg.data, cfg.generator, cfg.eval
    new = max(g.max_new_tokens, ev.max_new_tokens if ev.every_steps else 0)
    if d.max_prompt_len + new <= max_positions or not _first_rank():
        return
    print(f"warning: data.max_prompt_len={d.max_prompt_len} + {new} new tokens = "
          f"{d.max_prompt_len + new} positions, past the model's max_position_embeddings="
          f"{max_positions} ({cfg.model.path}/config.json): samples may run where the model was "
          f"never trained; lower data.max_prompt_len or the max_new_tokens to fit",
          file=sys.stderr, flush=True)


def _print_resume_changes(cfg, path) -> None:
    """Rank 0 prints the settings changed since the checkpoint resumed from (`path`), and what the
    resume does with each, in one line: a changed lr, say, was applied without a word, and the log
    did not tell whether the new value or the checkpoint's took effect. Not for a run that is
    already complete (it does nothing)."""
    from trainer.checkpointing import already_complete_line, read_extra, resume_changes_line
    if path is None or not _first_rank() or already_complete_line(cfg):
        return
    line = resume_changes_line(cfg, path, read_extra(path))
    if line is not None:
        print(line, flush=True)


def check_resumed(cfg, path, args, items) -> None:
    """The checkpoint this run resumes from (`path`; None: none) holds this model's parameters,
    shape for shape, and was cut over the prompt set this config loads: both failed only after
    start-up, DCP's "Size mismatch" on every trainer rank (a model.path of another size) and the
    generators' cursors (another data.source, num_prompts or filter), after the trainer had
    resumed."""
    if path is not None:
        _check_resumed_shapes(cfg, path, args)
        _check_resumed_prompts(cfg, path, items)


def _check_resumed_shapes(cfg, path: Path, args) -> None:
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from model import Transformer
    with torch.device("meta"):
        want = {f"model.{n}": tuple(p.shape)
                for n, p in Transformer(args).named_parameters(remove_duplicate=False)}
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    have = {k: tuple(m.size) for k, m in saved.items() if k.startswith("model.") and hasattr(m, "size")}
    wrong = [f"{k[6:]} {list(have[k])} there, {list(v)} here" for k, v in want.items()
             if k in have and have[k] != v]
    wrong += [f"{k[6:]} missing there" for k in want if k not in have]
    wrong += [f"{k[6:]} only there" for k in have if k not in want]
    if wrong:
        raise ConfigError(f"resuming {path}: its parameters are not those of the model in "
                          f"{cfg.model.path} ({len(wrong)} differ: {'; '.join(wrong[:3])}"
                          f"{'; ...' if len(wrong) > 3 else ''}); resume with the model.path of "
                          "the run that saved it, or start a new --run.dir")


def _check_resumed_prompts(cfg, path: Path, items) -> None:
    """Replica 0's saved cursor stands for all: the replicas share the set, and gen_dp is
    checked with the other RESUME_SETTINGS."""
    from rollout.data import PromptSource
    from trainer.checkpointing import generator_state, read_extra
    state = generator_state(read_extra(path), 0)
    if state is None:
        return
    source = PromptSource(items, seed=cfg.data.seed, shuffle=cfg.data.shuffle, rank=0,
                          world=cfg.parallel.gen_dp)
    try:
        source.load_state_dict(state["cursor"])
    except ValueError as e:
        raise ConfigError(f"resuming {path}: {e}") from None


def _check_model_folder(cfg) -> None:
    """An empty or missing model.path, the usual first run of the tiny preset (its model is made,
    not downloaded): say which command writes it."""
    path = cfg.model.path
    if not path:
        raise ConfigError("model.path is empty; point it at a Hugging Face model folder "
                          "(config.json + safetensors)" + missing_model_hint(cfg, empty=True))
    if path.startswith("preset:") and not Path(path).exists():  # a plan's or the dry run's
        raise ConfigError(f"model.path={path!r} is a shape preset: it checks a config with "
                          "`train_rl.py --dry-run` (launch/plan.py writes one), but holds no "
                          "weights to train; point --model.path at the model's Hugging Face "
                          "folder (config.json + safetensors)")
    if not Path(path).exists():
        raise ConfigError(f"model folder {path!r} (model.path) does not exist{_looked_at(path)}; "
                          "point --model.path at "
                          "a Hugging Face model folder (config.json + safetensors)"
                          + missing_model_hint(cfg))


def _looked_at(path: str) -> str:
    """Where a relative path was looked for: the launch directory, which launch/run_local.sh
    makes the repository's root."""
    return "" if Path(path).is_absolute() else f" (looked for {Path(path).absolute()})"


def _check_ref_folder(cfg) -> None:
    """The KL reference (algo.kl_coef > 0) is another folder than model.path: it was first read
    after start-up, and a missing one failed on every trainer rank."""
    ref = cfg.model.ref_path
    if cfg.algo.kl_coef > 0 and ref and ref != cfg.model.path and not Path(ref).exists():
        raise ConfigError(f"model folder {ref!r} (model.ref_path, the KL penalty's reference with "
                          f"algo.kl_coef={cfg.algo.kl_coef}) does not exist{_looked_at(ref)}; "
                          "point --model.ref_path "
                          "at a Hugging Face model folder, or set it to '' for the starting "
                          "policy, model.path")


def _task_digits(cfg) -> int:
    """The digits of cfg's synthetic task, as the task's loader reads them."""
    return cfg.data.task_options.get("digits", cfg.data.synthetic_digits)


def tiny_model_flags(cfg, out: Path) -> list[str]:
    """tools/make_tiny_model.py's flags for a model of cfg's synthetic task at `out` (its
    default folder needs no --out)."""
    task = cfg.data.source.partition(":")[2]
    return ([] if out == TINY_MODEL else ["--out", str(out)]) + (
        [] if task == "addition" else ["--task", task]) + ["--digits", str(_task_digits(cfg))]


def missing_model_hint(cfg, empty: bool = False) -> str:
    """'; ...' naming the command that writes a model for cfg's synthetic task (`make demo` for the
    tiny preset's own), or '' for other sources. `empty`: model.path is '', so name the folder
    the command writes and how to point model.path at it."""
    kind, _, task = cfg.data.source.partition(":")
    if kind != "synthetic" or not task:
        return ""
    out = TINY_MODEL if empty else Path(cfg.model.path)
    digits = _task_digits(cfg)
    command = " ".join(["python tools/make_tiny_model.py", *tiny_model_flags(cfg, out)])
    if empty:
        return f"; for {cfg.data.source}: {command} writes {out}, then --model.path={out}"
    demo = out == TINY_MODEL and task == "addition" and digits == 1  # configs/tiny_cpu.toml's
    return (f"; `make demo` writes it, or {command}" if demo else
            f"; for {cfg.data.source} with {digits} digit(s): {command}")


def _check_tp_fits_model(cfg, dims, args) -> None:
    """Tensor parallelism splits whole heads and an even share of the MLP. A degree that does not
    is refused with the fixes that suit both the model and the world size (config.layout_fixes),
    as the layout's own errors are: ParallelDims.check_model's fix ("pick trainer_tp from
    [1, 2]") once suggested a degree that the trainer ranks could not take."""
    from config import layout_fixes
    from parallel.dims import tp_fits_model
    fits = tp_fits_model((args.num_heads, args.num_kv_heads, args.intermediate_size),
                         args.tie_word_embeddings)
    for key in ("gen_tp", "trainer_tp"):
        tp = getattr(cfg.parallel, key)
        if not fits(tp):
            sizes = (f"num_heads={args.num_heads} and num_kv_heads={args.num_kv_heads} and "
                     f"intermediate_size={args.intermediate_size}")
            why = ("the model ties its input and output embeddings, which tensor parallelism "
                   "does not split" if args.tie_word_embeddings else f"it does not divide {sizes}")
            fix = layout_fixes(_given_layout(cfg), dims.world_size, fits)
            raise ConfigError(f"parallel.{key}={tp} does not fit the model in {cfg.model.path} "
                              f"({why}). Fix: {fix}")


def _given_layout(cfg):
    """cfg.parallel with the degrees resolve() derived given back as the user gave them (0)."""
    given = copy.copy(cfg.parallel)
    for key, value in getattr(cfg, "_derived", {}).items():
        section, name = key.split(".")
        if section == "parallel":
            setattr(given, name, value)
    return given


def _check_device_choices(cfg) -> None:
    """Choices that this machine must support: model.attn_backend (against the trainer's compute
    dtype too), generator.decode, generator.decode_attention and generator.pack_weights."""
    from model.attention import check_backend
    from model.hf_io import to_dtype
    from parallel.mesh import pick_device
    from parallel.sharding import compute_dtype
    from rollout import packed_linear
    from rollout.engine import attention_choice, decode_mode
    device = pick_device()
    dtype = compute_dtype(cfg.model.compute_dtype, device.type, to_dtype(cfg.model.dtype))
    check_backend(cfg.model.attn_backend, device.type, dtype)
    g = cfg.generator
    mode = decode_mode(g.decode, device)
    attention_choice(g.decode_attention, device, mode)
    if g.pack_weights == "on" and (device.type != "cpu" or mode or not packed_linear.available()):
        # the engine refuses it too, but only once each generator has built its model
        raise ConfigError(f"generator.pack_weights='on' needs eager decode on a CPU with oneDNN "
                          f"(this run: device {device.type}, generator.decode={g.decode!r}, oneDNN "
                          f"kernels available: {packed_linear.available()}); set "
                          "--generator.pack_weights=auto (it packs where it can) or "
                          "--generator.decode=eager on CPU")


def _check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run directory {str(run_dir)!r} is not writable ({e.strerror}); "
                          f"set --run.dir to a writable folder") from None
