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
             "per busy sender max", "memory per rank", "trainer   rank:", "generator rank:",
             "dry run ok in")


def _run(env_world: str | None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    if env_world:  # as under torchrun, 4 ranks a node
        env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"] = env_world, "4"
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
    # the sync time's links: torchrun's ranks a node (8 assumed: plans on 4 a node disagreed)
    per_node = "4" if env_world else "8"
    assert f"predicted sync time on h100 links ({per_node} GPUs a node): " in proc.stdout
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
    # colocated, the world is trainer_fsdp * trainer_tp: the message added generator_ranks
    cfg.parallel.trainer_fsdp = 0
    with pytest.raises(ConfigError, match=r"world = trainer_fsdp \* trainer_tp = n \* 4 in "
                                          "colocated mode") as e:
        world_size_of(cfg)
    assert "generator_ranks +" not in str(e.value)


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


def test_dry_run_refuses_a_vocabulary_split_dcp_cannot_checkpoint(tmp_path, monkeypatch):
    """trainer_tp not dividing the vocabulary at trainer_fsdp >= 3 failed at the first
    checkpoint, after the steps trained (ParallelDims._check_vocab): the dry run and preflight
    refuse it with the model's vocab_size."""
    from model.hf_io import load_model_args
    from tools.make_tiny_model import make_random_model
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = make_random_model(tmp_path / "model", hidden=32, layers=2)
    vocab = load_model_args(model).vocab_size
    assert vocab % 2, vocab
    cfg = load_config("configs/tiny_cpu.toml", [f"--model.path={model}", f"--run.dir={tmp_path / 'run'}",
                                                "--parallel.trainer_fsdp=3", "--parallel.trainer_tp=2",
                                                "--parallel.generator_ranks=1"])
    with pytest.raises(ValueError, match=rf"trainer_tp=2 does not divide vocab_size={vocab}"):
        dry_run(cfg)


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
    for argv in (["--help"], ["--help", "trainer"], ["-h"]):  # "unknown flag(s) ['--help']"
        assert main(argv) == 0
        assert capsys.readouterr().out.startswith("Dry run: check a config for a big job")
    monkeypatch.setenv("WORLD_SIZE", "3")
    tiny = ["--config", "configs/tiny_cpu.toml"]
    assert not resolve_config([*tiny, "--dry-run=false"]).run.dry_run
    assert resolve_config([*tiny, "--dry-run"]).run.dry_run
    with pytest.raises(ConfigError, match="run.dry_run='maybe' has the wrong type"):
        resolve_config([*tiny, "--dry-run=maybe"])
    for bad in ("abc", "0"):  # was int()'s "invalid literal for int() with base 10: 'abc'"
        monkeypatch.setenv("WORLD_SIZE", bad)
        with pytest.raises(ConfigError, match=rf"WORLD_SIZE='{bad}' is not a number of ranks; .*"
                                              rf"WORLD_SIZE=64 python train_rl.py --dry-run"):
            resolve_config([*tiny, "--dry-run"])


def _llama8b_2x2(*overrides: str):
    """Llama-3-8B, trainer fsdp 2 x tp 2 and generator 2 x tp 2 (world 8), bf16 generator."""
    return load_config(None, ["--model.path=preset:llama3-8b", "--model.gen_dtype=bfloat16",
                              "--parallel.generator_ranks=4", "--parallel.gen_tp=2",
                              "--parallel.trainer_tp=2", "--parallel.trainer_fsdp=2",
                              "--generator.num_slots=4", "--generator.n_samples=4",
                              "--trainer.prompts_per_step=8", "--eval.every_steps=0", *overrides])


# Llama-3-8B trainer rank at fsdp 2 x tp 2, fp32 master: 16 B/param over 4 ranks plus
# (2 layers + root) / tp gathered in the compute dtype (cb); activations per token
# L * cb * (4h + (2q + 2kv + 4i) / tp) + V * (cb + 8)
_N, _LAYER, _ROOT = 8_030_261_248, 218_112_000, 2 * 128256 * 4096 + 4096


def _trainer_gb(cb: int, tokens: int) -> float:
    state = _N / 4 * 16 + (2 * _LAYER + _ROOT) / 2 * cb
    per_tok = 32 * cb * (4 * 4096 + (2 * 4096 + 2 * 1024 + 4 * 14336) // 2) + 128256 * (cb + 8)
    return (state + tokens * per_tok) / 1e9


def test_dry_run_charges_one_whole_sequence_of_activations(monkeypatch, capsys):
    """micro_batch_tokens 4096 < one sequence of 512 + 16384 tokens: the runtime still packs the
    whole sequence, so the activations are 16896 tokens' (75.9 GB), not 4096's (18.4 GB), and the
    trainer rank (109.5 GB) does not fit an H100; the cost model's reason is printed."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _llama8b_2x2("--generator.max_new_tokens=16384", "--data.max_prompt_len=512",
                       "--trainer.micro_batch_tokens=4096")
    assert dry_run(cfg) == 0
    out = capsys.readouterr().out
    gb = _trainer_gb(2, 16896)
    assert f"{gb:.1f}" == "109.5"
    assert f"trainer   rank: {gb:.1f} GB = states+gathered 33.6 GB + activations of 16896 tokens" in out
    assert f"h100 (80 GB, 72 GB usable): DOES NOT FIT (trainer: needs {gb:.1f} GB > 72.0 GB usable)" in out
    assert "h200 (141 GB, 127 GB usable): fits" in out


def test_dry_run_uses_the_trainers_compute_dtype(monkeypatch, capsys):
    """model.compute_dtype=float32 doubles the gathered units and the activations: 100.3 GB
    against 70.4 GB in bf16 (the "auto" choice on GPUs) for 8192 tokens."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ("--generator.max_new_tokens=2048", "--data.max_prompt_len=512",
            "--trainer.micro_batch_tokens=8192")
    assert dry_run(_llama8b_2x2(*base, "--model.compute_dtype=float32")) == 0
    fp32 = capsys.readouterr().out
    assert dry_run(_llama8b_2x2(*base)) == 0
    auto = capsys.readouterr().out
    assert (f"{_trainer_gb(4, 8192):.1f}", f"{_trainer_gb(2, 8192):.1f}") == ("100.3", "70.4")
    assert "fp32 compute" in fp32 and "trainer   rank: 100.3 GB = states+gathered 35.1 GB" in fp32
    assert "h100 (80 GB, 72 GB usable): DOES NOT FIT (trainer: needs 100.3 GB" in fp32
    assert "bf16 compute" in auto and "trainer   rank: 70.4 GB" in auto


def test_dry_run_counts_the_weight_sync_staging(monkeypatch, capsys):
    """The generator rank holds its bf16 shard (8.03e9 * 2 / 2 = 8.0 GB) and one staged copy of
    it for the weight sync over NCCL (the meshes are on separate GPUs: parallel.ipc_buffers=0,
    same-GPU zero copy, changes nothing there)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dry_run(_llama8b_2x2()) == 0
    assert "weights 8.0 GB + KV cache" in (out := capsys.readouterr().out)
    assert "+ weight-sync staging 8.0 GB" in out
    assert dry_run(_llama8b_2x2("--parallel.ipc_buffers=0")) == 0
    assert "+ weight-sync staging 8.0 GB" in capsys.readouterr().out


def test_dims_cli_names_the_flag_and_the_fix(capsys):
    """`python -m parallel.dims`: --trainer-tp 0 was a ZeroDivisionError, and a --gen-tp that
    does not divide the generator ranks reported a gen_dp=-1 the user never gave."""
    from parallel.dims import main
    with pytest.raises(SystemExit) as e:
        main(["--world", "4", "--generator-ranks", "2", "--trainer-tp", "0"])
    assert e.value.code == 2 and "argument --trainer-tp: 0 is below 1" in capsys.readouterr().err
    assert main(["--world", "3", "--generator-ranks", "1", "--gen-tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--gen-tp 2 does not divide the 1 generator ranks" in err and "from [1]" in err
    assert "-1" not in err
    assert main(["--world", "6", "--generator-ranks", "2", "--trainer-tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--trainer-tp 3 does not divide the 4 trainer ranks" in err
    assert "choose --trainer-tp from [1, 2, 4]" in err
    assert main(["--world", "4", "--generator-ranks", "4"]) == 2
    assert "leaves no trainer ranks" in capsys.readouterr().err
    assert main(["--world", "4", "--generator-ranks", "2", "--gen-tp", "2"]) == 0
    assert "gen_dp=1 x gen_tp=2" in capsys.readouterr().out


def test_dims_cli_refuses_a_layout_its_model_cannot_take(tmp_path, capsys):
    """With --model, a trainer TP of 3 over 4 heads printed its mesh (exit 0), a layout the
    runtime refuses; and a degree suggested must divide the mesh's ranks too (it offered 2 for 3
    trainer ranks)."""
    from parallel.dims import ParallelDims, main
    from tests.rl_model import make_rl_model
    model = make_rl_model(tmp_path / "m")  # 4 heads, 2 KV heads
    assert main(["--world", "4", "--generator-ranks", "1", "--trainer-tp", "3", "--model",
                 str(model)]) == 2
    err = capsys.readouterr().err
    assert "trainer_tp=3 does not divide num_heads=4" in err and "pick trainer_tp from [1]" in err
    with pytest.raises(ValueError, match=r"pick trainer_tp from \[1, 2\]"):
        ParallelDims(6, "split", 2, 1, 2, 1, 4).check_model(4, 2, intermediate_size=64)
    assert main(["--world", "3", "--generator-ranks", "1", "--trainer-tp", "2", "--model",
                 str(model)]) == 0


def test_a_config_that_fits_no_card_says_so_in_its_last_line(monkeypatch, capsys):
    """'DOES NOT FIT' on both cards, then 'dry run ok': the last line read as if all was well."""
    from launch.dry_run import dry_run
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dry_run(load_config(CONFIG, ["--generator.num_slots=4096"])) == 0  # the config holds
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("dry run ok in ") and last.endswith(
        ": the config and its layouts hold, but its memory per rank fits neither card above (lower "
        "generator.num_slots or trainer.micro_batch_tokens, or spread the model over more ranks: "
        "launch/plan.py)")
