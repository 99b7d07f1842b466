"""launch/dry_run.py: a 1024-rank config checked on this CPU machine, without process groups."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config import ConfigError, load_config
from launch.dry_run import dry_run, world_size_of

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/example_1024.toml"
KEY_LINES = ("dry run: world_size=1024", "trainer_ranks=512 (trainer_fsdp=128 x trainer_tp=4)",
             "generator mesh (dp=256, tp=2)", "layouts: trainer 128x4 and generator 256x2",
             "weight sync plan: 512 src ranks -> 512 dst ranks (256 replicas), 291 params",
             "max sender bytes", "memory per rank", "trainer   rank:", "generator rank:",
             "dry run ok in")


def _run(env_world: str | None):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    if env_world:
        env["WORLD_SIZE"] = env_world
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train_rl.py", "--dry-run", "--config", CONFIG], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("env_world", [None, "1024"], ids=["world-from-config", "world-from-env"])
def test_dry_run_1024_ranks(env_world):
    """`python train_rl.py --dry-run --config configs/example_1024.toml` in < 30 s: world size
    from the config's degrees (or from WORLD_SIZE, as under torchrun), rank map, layouts, the
    real weight-sync plan and memory per rank."""
    proc, elapsed = _run(env_world)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in KEY_LINES:
        assert line in proc.stdout, f"missing {line!r} in:\n{proc.stdout}"
    assert "h100 (80 GB, 72 GB usable): fits" in proc.stdout
    assert elapsed < 30, f"dry run took {elapsed:.1f}s"


def test_world_size_needs_explicit_degrees(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(CONFIG)
    assert world_size_of(cfg) == 512 + 128 * 4
    cfg.parallel.trainer_fsdp = 0
    with pytest.raises(ConfigError, match="cannot derive the world size.*trainer_fsdp"):
        world_size_of(cfg)
    cfg.parallel.trainer_fsdp, cfg.parallel.mode = 64, "colocated"
    assert world_size_of(cfg) == 64 * 4


def test_dry_run_of_a_real_model_folder_runs_preflight(tmp_path, monkeypatch, capsys):
    """A real (tiny) HF folder: preflight checks weights, tokenizer and data too."""
    from tools.make_tiny_model import make_random_model
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = make_random_model(tmp_path / "model", hidden=32, layers=2)
    cfg = load_config("configs/tiny_cpu.toml", [f"--model.path={model}", f"--run.dir={tmp_path / 'run'}",
                                                "--parallel.trainer_fsdp=2", "--parallel.gen_tp=2",
                                                "--parallel.generator_ranks=2", "--algo.kl_coef=0"])
    assert dry_run(cfg) == 0
    out = capsys.readouterr().out
    assert "dry run: world_size=4" in out and "preflight: model folder, tokenizer" in out
    assert "weight sync plan: 2 src ranks -> 2 dst ranks (1 replicas)" in out
    # with a KL penalty the trainer rank also holds its shard of the frozen reference
    kl = load_config("configs/tiny_cpu.toml", [f"--model.path={model}", f"--run.dir={tmp_path / 'run'}",
                                               "--parallel.trainer_fsdp=2", "--parallel.gen_tp=2",
                                               "--parallel.generator_ranks=2", "--algo.kl_coef=0.1"])
    assert dry_run(kl) == 0
    kl_out = capsys.readouterr().out
    from launch.dry_run import _gb
    from model import load_pretrained
    shard = load_pretrained(model, dtype="float32").args.num_params() * 4 / 2   # fp32, fsdp 2
    assert "KL reference shard" not in out
    assert f"KL reference shard {_gb(shard)}" in kl_out
    # the preset's held-out evaluation: a second KV cache on replica 0, of min(200, 256) slots
    # x (32 + 8) positions, 2 layers x k/v x 1 of 2 kv heads (gen_tp 2) x head_dim 8 in fp32
    from types import SimpleNamespace
    from launch.dry_run import _eval_kv_bytes
    kv_eval = 200 * 40 * 2 * 2 * 1 * 8 * 4
    assert _eval_kv_bytes(cfg, load_pretrained(model).args, SimpleNamespace(gen_tp=2)) == kv_eval
    assert f"+ held-out eval KV cache {_gb(kv_eval)} (replica 0)" in out
    off = load_config("configs/tiny_cpu.toml", [f"--model.path={model}", f"--run.dir={tmp_path / 'run'}",
                                                "--parallel.trainer_fsdp=2", "--parallel.gen_tp=2",
                                                "--parallel.generator_ranks=2", "--eval.every_steps=0"])
    assert dry_run(off) == 0
    assert "held-out eval" not in capsys.readouterr().out


def test_dry_run_rejects_heads_that_tp_cannot_split(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(CONFIG, ["--parallel.trainer_tp=16", "--parallel.trainer_fsdp=32"])
    with pytest.raises(ValueError, match="trainer_tp=16 does not divide"):
        dry_run(cfg)


def test_dry_run_command_lines_read_their_flags(monkeypatch, capsys):
    """`python -m launch.dry_run FILE` (no --config) was a traceback; --dry-run=false still made a
    dry run."""
    from config import resolve_config
    from launch.dry_run import main
    assert main([CONFIG]) == 2
    assert capsys.readouterr().err.startswith("error: unexpected argument 'configs/example_1024.toml'")
    assert main(["--config", CONFIG, "--fast"]) == 2
    assert "unknown flag(s) ['--fast']" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    tiny = ["--config", "configs/tiny_cpu.toml"]
    assert not resolve_config([*tiny, "--dry-run=false"]).run.dry_run
    assert resolve_config([*tiny, "--dry-run"]).run.dry_run
    with pytest.raises(ConfigError, match="run.dry_run='maybe' has the wrong type"):
        resolve_config([*tiny, "--dry-run=maybe"])
