"""Checks of user input that need no process group, run on every rank before any is created, so a
bad config fails in seconds with one message instead of a hang or a wall of tracebacks."""
from __future__ import annotations

import os
from pathlib import Path

from config import ConfigError


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

    if not cfg.model.path:
        raise ConfigError("model.path is empty; point it at a Hugging Face model folder "
                          "(for the demo: python tools/make_tiny_model.py)")
    args = load_model_args(cfg.model.path)
    with torch.device("meta"):
        check_tensors(CheckpointReader(cfg.model.path), expected_tensors(Transformer(args)))
    dims.check_model(args.num_heads, args.num_kv_heads, args.tie_word_embeddings,
                     args.intermediate_size)
    _check_device_choices(cfg)
    tok = load_tokenizer(cfg.model.path)
    if tok.vocab_size > args.vocab_size:
        raise ValueError(f"tokenizer of {cfg.model.path} has {tok.vocab_size} tokens but the model's "
                         f"vocab_size is {args.vocab_size}: they do not belong together")
    bad = [t for t in cfg.generator.stop_token_ids if not 0 <= t < args.vocab_size]
    if bad:
        raise ConfigError(f"generator.stop_token_ids has {bad}, outside the model's vocabulary "
                          f"[0, {args.vocab_size}): no token could ever stop on them; use ids of "
                          f"this model's tokenizer")
    if dims.mode == "colocated" and cfg.checkpoint.every_steps:
        raise ConfigError("checkpoints are implemented for split mode only; with "
                          "parallel.mode='colocated' set checkpoint.every_steps=0")
    load_items(cfg, tok)  # raises on a missing/empty dataset or when every prompt is too long
    if cfg.eval.every_steps:
        load_eval_items(cfg, tok)  # the same for the held-out prompts
    resolve_reward(cfg.reward.fn, cfg.reward.format_weight)
    check_resume(cfg)
    _check_writable(Path(cfg.run.dir))
    return tok


def _check_device_choices(cfg) -> None:
    """Choices that this machine must support: model.attn_backend (against the trainer's compute
    dtype too), generator.decode and generator.decode_attention."""
    from model.attention import check_backend
    from model.hf_io import to_dtype
    from parallel.mesh import pick_device
    from parallel.sharding import compute_dtype
    from rollout.engine import attention_choice, decode_mode
    device = pick_device()
    dtype = compute_dtype(cfg.model.compute_dtype, device.type, to_dtype(cfg.model.dtype))
    check_backend(cfg.model.attn_backend, device.type, dtype)
    attention_choice(cfg.generator.decode_attention, device, decode_mode(cfg.generator.decode, device))


def _check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_test_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run directory {str(run_dir)!r} is not writable ({e.strerror}); "
                          f"set --run.dir to a writable folder") from None
