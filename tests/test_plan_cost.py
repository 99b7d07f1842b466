"""launch/cost_model.py against hand-computed cases, and launch/plan.py's search and TOML output."""
from __future__ import annotations

import dataclasses
import math
import re
import sys
import time

import pytest
import torch

from config import load_config
from launch import cost_model as cm
from launch.plan import best_plan, main as plan_main, preset_args
from model import KVCache, Transformer
from model.args import ModelArgs

L8B = preset_args("llama3-8b")
TINY = ModelArgs(vocab_size=17, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2)


def test_model_arithmetic_llama8b():
    assert L8B.num_params() == 8_030_261_248
    assert cm.matmul_params(L8B) == 8_030_261_248 - 128256 * 4096
    assert cm.kv_bytes_per_token(L8B, 2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert cm.kv_bytes_per_token(L8B, 2, tp=8) == 131072 // 8
    assert cm.act_bytes_per_token_layer(L8B, 2, 1) == 2 * (4 * 4096 + 2 * 4096 + 2 * 1024 + 4 * 14336)


def test_param_specs_match_the_model():
    for args in (TINY, ModelArgs(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3,
                                 num_heads=4, num_kv_heads=2, attention_bias=True, qk_norm=True)):
        with torch.device("meta"):
            model = Transformer(args)
        assert [(s.name, s.shape) for s in cm.param_specs(args)] == \
            [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        assert sum(math.prod(s.shape) for s in cm.param_specs(args)) == args.num_params()


def test_memory_hand_computed():
    n = L8B.num_params()
    layer = cm.layer_params(L8B)
    root = n - 32 * layer
    assert layer == 218_112_000 and root == 2 * 128256 * 4096 + 4096
    # fsdp 8, tp 1: 16 B/param sharded + (2 layers + root) unsharded in bf16 (docstring example)
    got = cm.trainer_state_bytes(L8B, 8, 1, 4, 2)
    assert got == pytest.approx(n / 8 * 16 + (2 * layer + root) * 2)
    assert got / 1e9 == pytest.approx(19.03, abs=0.01)
    assert cm.trainer_state_bytes(L8B, 1, 1, 4, 2) == n * 16  # no FSDP: nothing gathered
    # one "model" unit: the whole model gathered in bf16 plus its unsharded fp32 gradients
    assert cm.trainer_state_bytes(L8B, 8, 1, 4, 2, "model") / 1e9 == pytest.approx(64.24, abs=0.01)
    # KV cache example: 256 slots x 2560 positions, bf16, tp 1
    assert cm.generator_kv_bytes(L8B, 1, 2, 256, 2560) == 131072 * 256 * 2560
    # feasibility: one H100 generator, bf16, P + R = 2560: the weights (16.06 GB), their staged
    # copy for the weight sync (16.06 GB) and the engine's stacked q|k|v copy
    # (32 * 4096 * 6144 * 2 B = 1.61 GB) leave (72 - 2 * 16.06 - 1.61) GB / 0.3355 GB = 114 slots
    cl = cm.gpu_cluster("h100", 1)
    wl = cm.Workload(512, 16, 512, 2048, gen_dtype="bfloat16")
    stacked = 32 * 4096 * 6144 * 2
    assert cm.stacked_copy_bytes(L8B, cl, wl, 1) == stacked
    assert cm.stacked_copy_bytes(L8B, cl, wl, 2) == 0  # TP shards: three projections
    used, slots, why = cm.generator_memory(L8B, cl, wl, gen_tp=1, gen_dp=1)
    assert not why and slots == int((0.9 * 80e9 - 2 * n * 2 - stacked) // (131072 * 2560)) == 114
    # one rank cannot hold the 8B trainer (16 B/param = 128 GB > 72 GB usable); 2 ranks just can
    # with activation checkpointing: 64.2 + 2.97 GB gathered + one 2560-token sequence (4.4 GB)
    _, _, why = cm.trainer_memory(L8B, cl, wl, fsdp=1, tp=1, ac=True)
    assert why.startswith("trainer")
    used, mbt, why = cm.trainer_memory(L8B, cl, wl, fsdp=2, tp=1, ac=True)
    assert not why and mbt == 2560 and used / 1e9 == pytest.approx(71.60, abs=0.01)
    assert cm.trainer_memory(L8B, cl, wl, fsdp=2, tp=1, ac=False)[2].startswith("trainer")
    _, mbt, why = cm.trainer_memory(L8B, cl, wl, fsdp=8, tp=1, ac=True)
    per_tok = 32 * 2 * 4096 + cm.act_bytes_per_token_layer(L8B, 2, 1) + 128256 * 10
    fit = int((0.9 * 80e9 - cm.trainer_state_bytes(L8B, 8, 1, 4, 2)) // per_tok)
    assert not why and mbt == 1 << (fit.bit_length() - 1) == 16384


def test_generator_memory_holds_the_weight_sync_staging_copy():
    """The generator receives each version into one staged copy of its shard (WeightReceiver),
    so its memory is weights + staging + KV: Llama-3-8B in bf16 at gen_tp 2, 100 slots of 2560
    positions: 8.03 GB + 8.03 GB + 100 * 2560 * 65536 B (16.78 GB) = 32.84 GB. The most slots
    that fit 72 GB: (72 - 2 * 8.03) GB / 0.1678 GB = 333 (381 without the staged copy)."""
    cl, n = cm.gpu_cluster("h100", 1), L8B.num_params()
    wl = cm.Workload(512, 16, 512, 2048, gen_dtype="bfloat16")
    assert cm.sync_staging_bytes(L8B, wl, 2) == n * 2 / 2
    used, slots, why = cm.generator_memory(L8B, cl, wl, 2, 1, slots=100)
    assert not why and used == pytest.approx(n + n + 100 * 2560 * 65536)
    assert used / 1e9 == pytest.approx(32.84, abs=0.01)
    most = cm.generator_memory(L8B, cl, wl, 2, 1)[1]
    assert most == int((0.9 * 80e9 - 2 * n) // (2560 * 65536)) == 333


def test_generator_memory_holds_the_held_out_evaluation_cache():
    """eval.every_steps gives generator replica 0 an evaluation engine with its own KV cache of
    min(eval.num_prompts, num_slots) slots beside the rollout one (rollout.role.build_eval); the
    planner filled the GPU with rollout slots without it. Llama-3-8B bf16 at gen_tp 2, 2560
    positions a slot (65536 B a position): 72 GB - 2 * 8.03 GB leaves 333 slots without
    evaluations; with 200 evaluation prompts each of the first 200 slots has a twin:
    2 * s <= 333.4 -> 166 slots; with 100, s + 100 <= 333.4 -> 233."""
    cl, n = cm.gpu_cluster("h100", 1), L8B.num_params()
    per_slot = 2560 * 65536
    wl = lambda k, new=0: cm.Workload(512, 16, 512, 2048, gen_dtype="bfloat16",  # noqa: E731
                                      eval_prompts=k, eval_new_tokens=new)
    assert cm.generator_memory(L8B, cl, wl(0), 2, 1)[1] == 333
    used, slots, why = cm.generator_memory(L8B, cl, wl(200), 2, 1)
    assert not why and slots == 166 and used == pytest.approx(2 * n + 2 * 166 * per_slot)
    used, slots, why = cm.generator_memory(L8B, cl, wl(100), 2, 1)
    assert not why and slots == 233 and used == pytest.approx(2 * n + (233 + 100) * per_slot)
    # a given slot count (the dry run's num_slots): the evaluation cache is min(200, 256) slots of
    # 512 + eval.max_new_tokens positions
    used = cm.generator_memory(L8B, cl, wl(200, 1024), 2, 1, slots=256)[0]
    assert used == pytest.approx(2 * n + 256 * per_slot + 200 * 1536 * 65536)
    assert cm.eval_kv_bytes(L8B, cl, wl(200, 1024), 2, 256) == 200 * 1536 * 65536


def test_plan_with_held_out_evaluations_writes_a_config_that_fits(tmp_path, capsys):
    """Llama-3-8B on 8 H100s with a base config's eval.every_steps: the written config's dry run
    said DOES NOT FIT (colocated, 229 slots: 72.8 GB generator + 29.3 GB trainer > 72 GB),
    because the search did not count the evaluation engine's KV cache on replica 0."""
    from launch.dry_run import dry_run
    base, out = tmp_path / "base.toml", tmp_path / "best.toml"
    base.write_text(load_config(None, ["--eval.every_steps=5"]).to_toml())
    assert plan_main(["--preset", "llama3-8b", "--nodes", "1", "--gpus-per-node", "8", "--prompts",
                      "512", "--group", "16", "--prompt-len", "512", "--response-len", "4096",
                      "--top", "1", "--base-config", str(base), "--out", str(out)]) == 0
    capsys.readouterr()
    cfg = load_config(str(out))
    assert cfg.eval.every_steps == 5
    assert dry_run(cfg) == 0
    out_text = capsys.readouterr().out
    assert "held-out eval KV cache" in out_text
    assert "h100 (80 GB, 72 GB usable): fits" in out_text


def test_plan_respects_the_base_configs_updates_per_step(tmp_path, capsys):
    """trainer.updates_per_step deals every trainer data-parallel rank a group per update
    (config.py: trainer_fsdp * updates <= prompts_per_step); the search proposed trainer_fsdp up
    to --prompts, and writing its best placement (4 CPU ranks, 3 prompts: train 3x1) failed
    after the search with config.py's error."""
    from launch.plan import no_placement_reason, placements
    base, out = tmp_path / "base.toml", tmp_path / "best.toml"
    base.write_text(load_config(None, ["--trainer.updates_per_step=2"]).to_toml())
    argv = ["--preset", "tiny", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4",
            "--group", "8", "--prompt-len", "8", "--response-len", "64", "--top", "1",
            "--base-config", str(base)]
    assert plan_main([*argv, "--prompts", "3", "--out", str(out)]) == 0
    cfg = load_config(str(out))
    assert cfg.trainer.updates_per_step == 2 and cfg.parallel.trainer_fsdp * 2 <= 3
    cfg.resolve(cfg.parallel.generator_ranks + cfg.parallel.trainer_fsdp * cfg.parallel.trainer_tp)
    for p in placements(TINY, 4, 4, 3, one_host=True, updates=2):
        assert p.trainer_fsdp * 2 <= 3
    assert any(p.trainer_fsdp == 3 for p in placements(TINY, 4, 4, 3, one_host=True))
    capsys.readouterr()
    # 8 ranks, 1 prompt: the fix names the updates and a --prompts that has a placement
    assert plan_main([*argv[:7], "8", *argv[8:], "--prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "trainer_fsdp * trainer.updates_per_step" in err and "raise --prompts to at least 3" in err
    assert next(placements(TINY, 8, 8, 3, one_host=True, updates=2), None) is not None
    assert next(placements(TINY, 8, 8, 2, one_host=True, updates=2), None) is None
    assert "at least 3" in no_placement_reason(TINY, 8, 8, 1, one_host=True, updates=2)


def test_plan_with_stacked_weights_keeps_the_generator_at_tp_1(tmp_path, capsys):
    """config.py refuses generator.stack_weights='all' with gen_tp > 1: such a base config made
    the plan fail after its search whenever the best placement had generator TP (4 CPU ranks,
    2 prompts: gen 1x2)."""
    base, out = tmp_path / "base.toml", tmp_path / "best.toml"
    argv = ["--preset", "tiny", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "4",
            "--prompts", "2", "--group", "8", "--prompt-len", "8", "--response-len", "64", "--top", "1"]
    base.write_text(load_config(None, ["--generator.stack_weights=all"]).to_toml())
    assert plan_main([*argv, "--base-config", str(base), "--out", str(out)]) == 0
    cfg = load_config(str(out))
    assert cfg.generator.stack_weights == "all" and cfg.parallel.gen_tp == 1
    from launch.plan import placements
    assert {p.gen_tp for p in placements(TINY, 4, 4, 2, one_host=True)} == {1, 2}
    assert {p.gen_tp for p in placements(TINY, 4, 4, 2, one_host=True, gen_tp=False)} == {1}


def test_plan_of_one_rank_in_split_mode_names_the_rank_count(capsys):
    """One rank, --modes split: the error blamed --prompts and said "use fewer ranks"."""
    argv = ["--preset", "tiny", "--gpu", "cpu", "--nodes", "1", "--gpus-per-node", "1",
            "--prompts", "2", "--group", "2", "--prompt-len", "8", "--response-len", "8"]
    assert plan_main([*argv, "--modes", "split"]) == 2
    err = capsys.readouterr().err
    assert "split mode needs at least 2 ranks" in err and "--modes colocated" in err
    assert "fewer ranks" not in err
    assert plan_main(argv) == 0  # colocated on the one rank


def test_plan_that_nothing_fits_names_the_nearest_miss(capsys):
    """Llama-3-405B in bf16 on 4 H100 nodes: the error said only {'generator': 296} and "add
    nodes", which cannot help: a generator replica is at most one node (TP 8), whose shard and
    its staged copy are 405.85e9 * 2 B / 8 * 2 = 202.9 GB > 72 GB usable."""
    assert plan_main(["--preset", "405b", "--nodes", "4", "--prompts", "64", "--group", "8",
                      "--prompt-len", "512", "--response-len", "1024"]) == 2
    err = capsys.readouterr().err
    n = preset_args("405b").num_params()
    assert f"{n * 2 / 8 * 2 / 1e9:.1f}" == "202.9"
    # the colocated placements' trainer states (244.9 GB a rank) miss too, and are named as such
    assert "the nearest misses, per mesh: G=8 gen 1x8" in err
    assert "generator: weights 202.9 GB (+0.0 GB reserved) leave no room for one KV slot" in err
    assert "coloc N=32 gen 4x8 | train 4x8: trainer: needs 244.9 GB > 72.0 GB usable" in err
    assert "at most --gpus-per-node 8 GPUs" in err


def test_plan_table_has_the_rows_asked_for(capsys):
    """--top 80 printed 50 rows of 144 feasible placements: the search kept its 50 best only."""
    argv = ["--preset", "llama3-8b", "--nodes", "2", "--prompts", "64", "--group", "8",
            "--prompt-len", "512", "--response-len", "1024", "--top"]
    assert plan_main([*argv, "80"]) == 0
    out = capsys.readouterr().out
    assert "144 feasible" in out
    rows = [ln for ln in out.splitlines() if re.match(r"\s*\d+ (G=|coloc)", ln)]
    assert [int(r.split()[0]) for r in rows] == list(range(1, 81))


def test_trainer_memory_holds_the_longest_sequence_admitted(tmp_path, capsys):
    """The runtime packs at least one whole sequence a micro-batch, and a config admits prompts
    up to data.max_prompt_len: the peak is that longest sequence, not the mean one. Llama-3-8B,
    fsdp 2, AC, --prompt-len 512 + 2048 with data.max_prompt_len 1024: the plan charged 2560
    tokens (71.6 GB, fits) and wrote micro_batch_tokens 2560; the dry run of that config charged
    3072 (72.5 GB > 72 GB usable: DOES NOT FIT)."""
    cl = cm.gpu_cluster("h100", 1)
    mean = cm.Workload(64, 8, 512, 2048)
    capped = cm.Workload(64, 8, 512, 2048, max_prompt_len=1024)
    assert (mean.longest_seq, capped.longest_seq) == (2560, 3072)
    state = cm.trainer_state_bytes(L8B, 2, 1, 4, 2)
    per_tok = 32 * 2 * 4096 + cm.act_bytes_per_token_layer(L8B, 2, 1) + 128256 * 10
    used, mbt, why = cm.trainer_memory(L8B, cl, mean, 2, 1, True)
    assert not why and mbt == 2560 and used == pytest.approx(state + 2560 * per_tok)
    assert (state + 3072 * per_tok) / 1e9 == pytest.approx(72.5, abs=0.05)
    used, _, why = cm.trainer_memory(L8B, cl, capped, 2, 1, True, 0.0, 2560)
    assert used == pytest.approx(state + 3072 * per_tok) and why.startswith("trainer: needs 72.5 GB")
    assert "one sequence of 3072" in cm.trainer_memory(L8B, cl, capped, 2, 1, True)[2]
    # the plan on 3 H100s (G=1 + fsdp 2 was its pick): nothing fits, said, instead of a config
    # that does not fit
    base = tmp_path / "base.toml"
    base.write_text(load_config(None, ["--data.max_prompt_len=1024"]).to_toml())
    assert plan_main(["--preset", "llama3-8b", "--nodes", "1", "--gpus-per-node", "3", "--prompts",
                      "64", "--group", "8", "--prompt-len", "512", "--response-len", "2048",
                      "--base-config", str(base), "--out", str(tmp_path / "best.toml")]) == 2
    assert "one sequence of 3072" in capsys.readouterr().err
    assert not (tmp_path / "best.toml").exists()


def test_kv_slots_are_sized_for_the_longest_prompt_admitted():
    """The engine allocates num_slots x (data.max_prompt_len + max_new_tokens) positions: the
    planner sizes a slot for max_prompt_len (by default the --prompt-len) + R positions."""
    cl = cm.gpu_cluster("h100", 1)
    mean = cm.Workload(8, 4, 64, 256, gen_dtype="bfloat16")
    capped = cm.Workload(8, 4, 64, 256, gen_dtype="bfloat16", max_prompt_len=256)
    assert (mean.slot_len, capped.slot_len, capped.seq_len) == (320, 512, 320)
    kv = lambda w: cm.generator_memory(L8B, cl, w, 1, 1, slots=10)[0]  # noqa: E731
    assert kv(capped) - kv(mean) == 10 * (512 - 320) * 131072
    with pytest.raises(ValueError, match="max_prompt_len=32 < prompt_len=64"):
        cm.Workload(8, 4, 64, 256, max_prompt_len=32)


def test_written_config_allocates_the_kv_cache_the_plan_sized(capsys):
    """plan.py wrote data.max_prompt_len = max(256, --prompt-len) while sizing the slots for
    --prompt-len + R: Llama-3-8B with 64 + 256 tokens filled an H100 with slots of 320 positions,
    and the written config made them 512 (110 GB: does not fit)."""
    from launch.dry_run import dry_run
    from launch.plan import to_config
    wl = cm.Workload(512, 16, 64, 256, 4, "float32", "bfloat16")
    res = best_plan(L8B, cm.gpu_cluster("h100", 1), wl)
    e, cfg = res.best, to_config(res.best, wl, "preset:llama3-8b")
    g, p = cfg.generator, e.placement
    assert cfg.data.max_prompt_len == 64 and g.max_new_tokens == 256
    # the engine's cache of the written config is the one the plan counted: K and V, 32 layers,
    # 8 / gen_tp kv heads of 128, bf16, per position
    positions = g.num_slots * (cfg.data.max_prompt_len + g.max_new_tokens)
    engine_kv = positions * 2 * 32 * (8 // p.gen_tp) * 128 * 2
    weights = L8B.num_params() * 2 / p.gen_tp
    stacked = 32 * 4096 * 6144 * 2 if p.gen_tp == 1 else 0
    assert e.memory.generator == pytest.approx(2 * weights + stacked + engine_kv)
    assert e.memory.generator <= 0.9 * 80e9
    assert dry_run(cfg.resolve(p.world)) == 0
    assert "h100 (80 GB, 72 GB usable): fits" in capsys.readouterr().out


def test_base_config_settings_reach_the_search():
    """--base-config was only copied into the written config: the search sized memory without
    its KL reference, FSDP units, compute dtype, stacked weights, prompt sharing, longest prompt
    or weight-sync staging."""
    from launch.plan import base_settings
    base = load_config(None, ["--algo.kl_coef=0.1", "--parallel.fsdp_units=model",
                              "--model.compute_dtype=float32", "--generator.stack_weights=all",
                              "--trainer.share_prompts=false", "--data.max_prompt_len=1024",
                              "--parallel.ipc_buffers=0", "--trainer.updates_per_step=4",
                              "--algo.loss=decoupled_ppo"])
    wl, cl = base_settings(base, 512, "cuda")
    assert wl == dict(master_dtype="float32", share_prompts=False, stack_weights="all",
                      max_prompt_len=1024, kl_reference=True, updates=4, prox_loss=True,
                      eval_prompts=0, eval_new_tokens=0)
    assert cl == dict(fsdp_units="model", compute_bytes=4)
    assert base_settings(load_config(None), 512, "cuda") == (
        dict(master_dtype="float32", share_prompts=True, stack_weights="auto", max_prompt_len=512,
             kl_reference=False, updates=1, prox_loss=False, eval_prompts=0, eval_new_tokens=0),
        dict(fsdp_units="layer", compute_bytes=2))
    evals = load_config(None, ["--eval.every_steps=5", "--eval.num_prompts=64",
                               "--eval.max_new_tokens=128"])
    assert base_settings(evals, 512, "cuda")[0]["eval_prompts"] == 64
    assert base_settings(evals, 512, "cuda")[0]["eval_new_tokens"] == 128
    assert base_settings(load_config(None), 8, "cpu")[1] == dict(fsdp_units="model", compute_bytes=4)
    # the KL reference: frozen fp32 parameters, sharded like the trainer (fsdp 2 x tp 2): 8.03 GB
    h100, n = cm.gpu_cluster("h100", 1), L8B.num_params()
    plain = cm.Workload(64, 8, 512, 2048)
    kl = cm.Workload(64, 8, 512, 2048, kl_reference=True)
    assert cm.reference_bytes(L8B, kl, 2, 2) == n * 4 / 4 and cm.reference_bytes(L8B, plain, 2, 2) == 0
    with_ref = cm.trainer_memory(L8B, h100, kl, 2, 2, False, 0.0, 4096)[0]
    assert with_ref - cm.trainer_memory(L8B, h100, plain, 2, 2, False, 0.0, 4096)[0] == pytest.approx(n)


@pytest.mark.parametrize("setting", ["--algo.kl_coef=0.1", "--parallel.fsdp_units=model"])
def test_plan_with_a_base_config_writes_one_that_fits(setting, tmp_path, capsys):
    """Llama-3-8B on 8 H100s: with a base config's KL reference or whole-model FSDP units the
    written config's dry run did not fit (78.5 and 93.0 GB on a trainer rank); the search now
    sizes the micro-batch with them."""
    from launch.dry_run import dry_run
    base, out = tmp_path / "base.toml", tmp_path / "best.toml"
    base.write_text(load_config(None, [setting]).to_toml())
    assert plan_main(["--preset", "llama3-8b", "--nodes", "1", "--gpus-per-node", "8", "--prompts",
                      "64", "--group", "8", "--prompt-len", "512", "--response-len", "2048",
                      "--top", "1", "--base-config", str(base), "--out", str(out)]) == 0
    capsys.readouterr()
    cfg = load_config(str(out))
    assert dry_run(cfg) == 0
    assert "h100 (80 GB, 72 GB usable): fits" in capsys.readouterr().out


def test_plan_keeps_the_base_configs_workload_name_and_checkpoints_where_they_run(tmp_path, capsys):
    """--base-config's prompts_per_step, n_samples, max_new_tokens and max_staleness were
    replaced by the flags' defaults (512, 16, 2048, 4) without a word, its run.name too; and a
    colocated plan kept its checkpoint.every_steps, which preflight then refused."""
    from launch.dry_run import dry_run
    base, out = tmp_path / "base.toml", tmp_path / "best.toml"
    base.write_text(load_config(None, [
        "--trainer.prompts_per_step=48", "--generator.n_samples=4", "--algo.max_staleness=2",
        "--generator.max_new_tokens=128", "--run.name=mine", "--checkpoint.every_steps=50",
        "--data.max_prompt_len=96", "--run.dir=/scratch/me/mine"]).to_toml())
    argv = ["--preset", "llama-1.1b", "--nodes", "1", "--gpus-per-node", "8", "--top", "1",
            "--base-config", str(base), "--out", str(out)]
    assert plan_main(argv) == 0
    cfg = load_config(str(out))
    assert (cfg.trainer.prompts_per_step, cfg.generator.n_samples, cfg.generator.max_new_tokens,
            cfg.algo.max_staleness) == (48, 4, 128, 2)
    assert cfg.data.max_prompt_len == 96  # --prompt-len's default (512) replaced it
    assert cfg.run.name.startswith("mine_plan_8r_")  # its own folder, named after the base's
    # beside the base's, not in it (a run there was "already completed" by the base's)
    assert cfg.run.dir == f"/scratch/me/{cfg.run.name}"
    assert plan_main([*argv, "--prompts", "64", "--eta", "0"]) == 0  # flags still win
    cfg = load_config(str(out))
    assert (cfg.trainer.prompts_per_step, cfg.algo.max_staleness) == (64, 0)
    assert plan_main([*argv, "--modes", "colocated"]) == 0
    cfg = load_config(str(out))
    assert cfg.parallel.mode == "colocated" and cfg.checkpoint.every_steps == 0
    capsys.readouterr()
    assert dry_run(cfg) == 0
    assert plan_main([*argv[:-4], "--out", str(out)]) == 0  # no base config: the defaults
    cfg = load_config(str(out))
    assert (cfg.trainer.prompts_per_step, cfg.generator.n_samples, cfg.algo.max_staleness) == (
        512, 16, 4) and cfg.run.name.startswith("plan_")


def test_a_folder_named_like_a_preset_is_the_folder(tmp_path, monkeypatch):
    """A model folder ./70b was planned (and dry-run) as the Llama-3-70B preset."""
    from launch.plan import resolve_model
    from tests import tiny
    tiny.save_hf("qwen2", tmp_path / "70b")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("70b").num_layers == 2
    assert resolve_model("preset:70b").num_layers == 80
    monkeypatch.chdir("/")
    assert resolve_model("70b").num_layers == 80  # no such folder: the preset


def test_plan_without_a_base_config_writes_the_default_longest_prompt(tmp_path):
    """--prompt-len is the mean prompt: written as data.max_prompt_len it dropped every longer
    prompt (about half of them); the defaults' 256 is written and sized instead."""
    out = tmp_path / "best.toml"
    assert plan_main(["--preset", "llama-1.1b", "--nodes", "1", "--gpus-per-node", "8",
                      "--prompts", "64", "--group", "8", "--prompt-len", "100",
                      "--response-len", "256", "--top", "1", "--out", str(out)]) == 0
    assert load_config(str(out)).data.max_prompt_len == 256


def test_plan_with_a_compiling_base_config_may_pick_trainer_tp(tmp_path):
    """A base config with parallel.compile gives a plan whose config loads and keeps compile,
    with the trainer TP the search picks (config.py refused compile with trainer TP once, and
    the plan then searched the trainer at TP 1 only)."""
    base, out = tmp_path / "base.toml", tmp_path / "best.toml"
    base.write_text(load_config(None, ["--parallel.compile=true"]).to_toml())
    argv = ["--preset", "llama3-70b", "--nodes", "4", "--gpus-per-node", "8", "--prompts", "64",
            "--group", "8", "--prompt-len", "512", "--response-len", "2048", "--top", "1"]
    assert plan_main([*argv, "--out", str(tmp_path / "free.toml")]) == 0
    assert load_config(str(tmp_path / "free.toml")).parallel.trainer_tp > 1  # what it would pick
    assert plan_main([*argv, "--base-config", str(base), "--out", str(out)]) == 0
    cfg = load_config(str(out))
    assert cfg.parallel.compile and cfg.parallel.trainer_tp > 1


def test_stacked_copy_bytes_are_what_the_engine_stacks():
    """The stacked q|k|v and gate|up copies the planner counts (biases too) are the bytes
    StackedWeights holds."""
    from rollout.stacked import StackedWeights
    args = ModelArgs(vocab_size=200, hidden_size=64, intermediate_size=128, num_layers=3,
                     num_heads=4, num_kv_heads=2, attention_bias=True)
    wl = cm.Workload(8, 8, 16, 32, gen_dtype="bfloat16")
    model = Transformer(args).to(torch.bfloat16)
    real = sum(t.numel() * t.element_size() for t in StackedWeights(model).tensors())
    assert cm.stacked_copy_bytes(args, cm.gpu_cluster("h100", 1), wl, 1) == real
    assert cm.stacked_copy_bytes(args, cm.cpu_cluster(3, 2), wl, 1) == 0  # CPU: not stacked
    qkv = sum(t.numel() * t.element_size() for t in StackedWeights(model, gate_up=False).tensors())
    wl_qkv = cm.Workload(8, 8, 16, 32, gen_dtype="bfloat16", stack_weights="qkv")
    assert qkv < real and cm.stacked_copy_bytes(args, cm.gpu_cluster("h100", 1), wl_qkv, 1) == qkv
    wl_all = cm.Workload(8, 8, 16, 32, gen_dtype="bfloat16", stack_weights="all")
    assert cm.stacked_copy_bytes(args, cm.cpu_cluster(3, 2), wl_all, 1) == real  # forced: CPU too
    wl_off = cm.Workload(8, 8, 16, 32, gen_dtype="bfloat16", stack_weights="off")
    assert cm.stacked_copy_bytes(args, cm.gpu_cluster("h100", 1), wl_off, 1) == 0
    # Llama-3-8B: gate|up's 7.52 GB of copies are over the automatic limit, stacked only on "all"
    wl8 = cm.Workload(512, 16, 512, 2048, gen_dtype="bfloat16", stack_weights="all")
    gate_up = 32 * 2 * 14336 * 4096 * 2
    assert cm.stacked_copy_bytes(L8B, cm.gpu_cluster("h100", 1), wl8, 1) == 32 * 4096 * 6144 * 2 + gate_up


def test_packed_copies_count_in_cpu_generator_memory():
    """The CPU engine's packed weight copies (rollout/packed_linear.py) are generator memory: hand
    computed for SmolLM2-135M, and equal to what PackedLinears packs for a model whose down-sized
    head falls below the size threshold."""
    from rollout.packed_linear import MIN_NUMEL, PackedLinears
    smol = ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, tie_word_embeddings=True)
    cpu, wl = cm.cpu_cluster(3, 2), cm.Workload(8, 8, 16, 32, gen_dtype="float32")
    assert cm.packed_copy_bytes(smol, cpu, wl, 1) == (30 * 3_538_944 + 28_311_552) * 4
    assert cm.packed_copy_bytes(smol, cpu, wl, 2) == 0  # TP shards keep their own forward
    assert cm.packed_copy_bytes(smol, cm.gpu_cluster("h100", 1), wl, 1) == 0
    bf16 = cm.Workload(8, 8, 16, 32, gen_dtype="bfloat16")  # bf16 weights are packed too
    assert cm.packed_copy_bytes(smol, cpu, bf16, 1) == (30 * 3_538_944 + 28_311_552) * 2
    assert cm.packed_copy_bytes(smol, cpu, cm.Workload(8, 8, 16, 32, gen_dtype="float16"), 1) == 0
    args = ModelArgs(vocab_size=200, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=8, num_kv_heads=4, attention_bias=True)
    assert 200 * 256 < MIN_NUMEL <= 256 * 256  # the head is too small, every layer linear large enough
    torch.manual_seed(0)
    packed = PackedLinears(Transformer(args))
    real = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
               for unit in packed._units for m in unit)
    assert cm.packed_copy_bytes(args, cpu, wl, 1) == 4 * real
    assert cm.packed_copy_bytes(args, cpu, bf16, 1) == 2 * real
    half, slots, _ = cm.generator_memory(args, cpu, bf16, 1, 1)
    fp16 = cm.generator_memory(args, cpu, cm.Workload(8, 8, 16, 32, gen_dtype="float16"), 1, 1)[0]
    used = cm.generator_memory(args, cpu, wl, 1, 1)[0]
    assert half - fp16 == pytest.approx(2 * real)  # the same bytes but for bf16's packed copies
    # the CPU engine's KV cache is fp32 for every generator dtype (model.kv_cache.cache_dtype)
    kv = slots * 2 * 2 * 4 * 32 * 4 * bf16.seq_len  # K and V, 2 layers, 4 kv heads of 32, fp32
    assert used == pytest.approx(2 * (half - kv) + kv)  # bf16 -> fp32 doubles the rest


def test_kv_cache_bytes_follow_the_engine():
    """What the engine allocates (KVCache.for_model) is what the cost model counts: the
    generator's dtype on GPUs, fp32 for a bf16/fp16 generator on CPU."""
    cpu, gpu = cm.cpu_cluster(3, 2), cm.gpu_cluster("h100", 1)
    assert [cm.kv_elem_bytes(cpu, d) for d in ("float32", "bfloat16", "float16")] == [4, 4, 4]
    assert [cm.kv_elem_bytes(gpu, d) for d in ("float32", "bfloat16", "float16")] == [4, 2, 2]
    args = ModelArgs(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2)
    with torch.device("meta"):
        model = Transformer(args).to(torch.bfloat16)
    cache = KVCache.for_model(model, num_slots=3, max_len=10, device="cpu")
    assert cache.k.element_size() == cm.kv_elem_bytes(cpu, "bfloat16")
    assert 2 * cache.k.numel() * cache.k.element_size() == cm.generator_kv_bytes(
        args, 1, cm.kv_elem_bytes(cpu, "bfloat16"), 3, 10)


def test_generation_time_hand_computed():
    """The docstring example: 8B on one H100, tp 1, 16 slots, P 512, R 2048."""
    cl = cm.gpu_cluster("h100", 1)
    wl = cm.Workload(1, 16, 512, 2048, gen_dtype="bfloat16")
    g = cm.generation_time(L8B, cl, wl, gen_tp=1, gen_dp=1, slots=16)
    n_mm = cm.matmul_params(L8B)
    step_bytes = n_mm * 2 + 16 * 1536 * 131072
    step = max(step_bytes / (3350e9 * 0.7), 2 * n_mm * 16 / (989e12 * 0.5))
    assert step == pytest.approx(7.774e-3, rel=1e-3)  # bandwidth-bound: 18.2 GB / 2345 GB/s
    prefill = (2 * n_mm * 512 + 2 * 32 * 4096 * 512 ** 2) / (989e12 * 0.5)
    assert g["decode_step"] == pytest.approx(step)
    assert g["prefill"] == pytest.approx(prefill)
    assert g["total"] == pytest.approx(prefill + 2048 * step)
    assert g["waves"] == 1


def test_train_time_and_collectives_hand_computed():
    cl = cm.gpu_cluster("h100", 8)  # 64 GPUs: the fsdp group spans nodes -> 50 GB/s * 0.8
    wl = cm.Workload(512, 16, 512, 2048, share_prompts=False)
    t = cm.train_time(L8B, cl, wl, fsdp=64, tp=1, ac=False, micro_batch_tokens=16384)
    tokens = 8 * 16 * 2560  # ceil(512/64) prompts x 16 samples x 2560 tokens
    attention = 3 * 2 * 32 * 4096 * 2560 ** 2 * 128
    flops = 6 * cm.matmul_params(L8B) * tokens + attention
    assert t["compute"] == pytest.approx(flops / (989e12 * 0.4))
    # shared prompts (the trainer's default): each prompt packed once, less its last token,
    # which each sample carries instead of its own last
    shared = cm.train_time(L8B, cl, cm.Workload(512, 16, 512, 2048), 64, 1, False, 16384)
    shared_tokens = 8 * (511 + 16 * 2048)
    assert shared["compute"] == pytest.approx(
        (6 * cm.matmul_params(L8B) * shared_tokens + attention) / (989e12 * 0.4))
    assert shared["micro_batches"] == -(-shared_tokens // 16384) == 17
    micro = -(-tokens // 16384)
    collectives = 3 * 33 * micro + 1 + 4  # 33 FSDP units; grad norm (1 mesh dim) + bookkeeping
    comm = micro * (2 * 2 + 4) * 63 / 64 * L8B.num_params() / 40e9 + collectives * 63 * 10e-6
    assert t["fsdp_comm"] == pytest.approx(comm)
    assert t["comm"] == 0.0  # hidden under compute (overlap 1)
    assert cm.allreduce_s(8, 1e6, 360e9, 10e-6) == pytest.approx(2 * 7 / 8 * 1e6 / 360e9 + 14e-5)
    assert cm.allgather_s(1, 1e9, 1.0, 1.0) == 0.0
    # the tiny model, fsdp 2 with 4 micro-batches -> 3*3*4 + 1 + 4 = 41 (docstring)
    assert cm.trainer_collectives(TINY, 4, 2, 1, False) == {"fsdp": 41, "tp": 0}
    # TP only: no data-parallel reductions, the norm and the batch broadcast
    assert cm.trainer_collectives(TINY, 4, 1, 2, True) == {"fsdp": 0, "tp": (8 + 4 + 4) * 4 + 1 + 2}
    assert cm.trainer_collectives(TINY, 4, 2, 2, False)["fsdp"] == 3 * 3 * 4 + 2 + 4
    # one "model" unit: one all-gather + one reduce-scatter per step, whatever the micro-batches
    assert cm.trainer_collectives(TINY, 4, 2, 1, False, "model") == {"fsdp": 2 + 1 + 4, "tp": 0}


def test_a_kl_reference_costs_one_forward_per_micro_batch():
    """algo.kl_coef > 0: the trainer runs the frozen reference's forward on every micro-batch
    (trainer.step.reference_logp); the plan counted its memory but not its time. Hand-computed
    from test_train_time_and_collectives_hand_computed's 8B case and the toy profile."""
    cl = cm.gpu_cluster("h100", 8)
    plain, kl = (cm.Workload(512, 16, 512, 2048, share_prompts=False, kl_reference=k)
                 for k in (False, True))
    t0, t1 = (cm.train_time(L8B, cl, w, 64, 1, False, 16384) for w in (plain, kl))
    tokens, micro = 8 * 16 * 2560, -(-8 * 16 * 2560 // 16384)
    forward = 2 * cm.matmul_params(L8B) * tokens + 2 * 32 * 4096 * 2560 ** 2 * 128
    assert t1["compute"] - t0["compute"] == pytest.approx(forward / (989e12 * 0.4))
    # one all-gather of the reference's 1/64 shards a micro-batch (bf16), one per unit (33)
    assert t1["fsdp_comm"] - t0["fsdp_comm"] == pytest.approx(
        micro * 2 * 63 / 64 * L8B.num_params() / 40e9 + 33 * micro * 63 * 10e-6)
    # collectives: + (L + 1) all-gathers (or the one "model" unit) and 2L + 2 TP all-reduces
    assert cm.trainer_collectives(TINY, 4, 2, 1, False, forwards=1) == {"fsdp": 53, "tp": 0}
    assert cm.trainer_collectives(TINY, 4, 2, 1, False, "model", 1)["fsdp"] == 2 + 4 + 1 + 4
    assert cm.trainer_collectives(TINY, 4, 1, 2, True, forwards=1)["tp"] == \
        (8 + 4 + 4 + 6) * 4 + 1 + 2
    # measured: each micro-batch adds L layer forwards and the head's forward of the profile;
    # 4 groups of a 4-token prompt, shared (less its last token), and 2 x 8: 76 tokens
    prof, cpu = _toy_profile(), cm.cpu_cluster(4, 2)
    m0, m1 = (cm.train_time(TINY, cpu, cm.Workload(4, 2, 4, 8, kl_reference=k), 1, 1, False,
                            10_000, prof) for k in (False, True))
    assert m1["compute"] - m0["compute"] == pytest.approx(prof.forward_microbatch_s(76))
    assert prof.forward_microbatch_s(76) == pytest.approx(2 * 76 * 1e-5)  # 2 layers, no head



def test_updates_per_step_cost_their_optimizer_steps_and_the_prox_forward():
    """trainer.updates_per_step = 4 with decoupled PPO: the same tokens in 4 updates (each its own
    micro-batches), 4 optimizer steps, one pi_prox forward a micro-batch; one FSDP "model" unit
    gathers and reduce-scatters once per update. Hand-computed from the toy profile."""
    prof, cpu = _toy_profile(), cm.cpu_cluster(4, 2)
    one, four = (cm.train_time(TINY, cpu, cm.Workload(8, 2, 4, 8, updates=u, prox_loss=True), 1, 1,
                               False, 10_000, prof) for u in (1, 4))
    assert one["micro_batches"] == 1 and four["micro_batches"] == 4  # 152 tokens, 38 an update
    # compute: the same layer work (linear in tokens) plus the prox forward of each update's 38
    assert four["compute"] - one["compute"] == pytest.approx(4 * prof.forward_microbatch_s(38))
    plain = cm.train_time(TINY, cpu, cm.Workload(8, 2, 4, 8, updates=4), 1, 1, False, 10_000, prof)
    assert plain["compute"] == pytest.approx(one["compute"])  # AIPO needs no pi_prox
    assert cm.trainer_collectives(TINY, 4, 2, 1, False, "model", 0, 4)["fsdp"] == 2 * 4 + 4 + 4
    # pi_prox's forwards gather again per layer unit, not with the one "model" unit (its
    # parameters stay gathered from the first forward to the first update's backward)
    assert cm.trainer_collectives(TINY, 4, 2, 1, False, "model", 1, 4, regathers=0)["fsdp"] == \
        2 * 4 + 4 + 4
    assert cm.trainer_collectives(TINY, 4, 2, 1, False, "layer", 1, 1, regathers=0)["fsdp"] == 53
    h100 = cm.gpu_cluster("h100", 1)
    o1, o4 = (cm.train_time(L8B, h100, cm.Workload(64, 8, 512, 2048, updates=u), 8, 1, False,
                            16384)["optimizer"] for u in (1, 4))
    assert o4 == pytest.approx(4 * o1)


def test_step_time_formulas():
    cl = cm.gpu_cluster("h100", 1)
    p = cm.Placement(8, "split", 4, 1, 1)
    assert cm.step_time(3.0, 2.0, 0.5, 0, p, cl) == pytest.approx(5.5 + 2 * cm.LINK_POLL_S)
    assert cm.step_time(3.0, 2.0, 0.5, 1, p, cl) == 3.0  # max(T_gen, T_train + T_sync)
    assert cm.step_time(1.0, 2.0, 0.5, 4, p, cl) == 2.5
    coloc = cm.Placement(8, "colocated", 8, 1, 1)
    assert cm.step_time(3.0, 2.0, 0.5, 4, coloc, cl) == 5.5  # time-shared: always synchronous
    cpu = cm.cpu_cluster(3, 2)  # the docstring example: 2 shared cores, G 1, T 2
    assert cm.step_time(0.1, 0.2, 0.0, 1, cm.Placement(3, "split", 1, 1, 1), cpu) == pytest.approx(0.25)
    assert cm.slowdown(3, cpu) == 1.5 and cm.slowdown(3, cl) == 1.0
    # 4 ranks on 2 cores, 0.05 s of each phase in collectives. Synchronous split (G 2, T 2): only
    # compute is slowed, s(2) = 1: 0.05 + 0.05 + 0.15 + 0.05 + 0.01 + 2 polls. Colocated (s(4) =
    # 2): the whole phases, collectives included: (0.1 + 0.2) * 2 + 0.01.
    cpu4, comm = cm.cpu_cluster(4, 2), dict(gen_comm=0.05, train_comm=0.05)
    assert cm.step_time(0.1, 0.2, 0.01, 0, cm.Placement(4, "split", 2, 1, 1), cpu4, **comm) \
        == pytest.approx(0.31 + 2 * cm.LINK_POLL_S)
    assert cm.step_time(0.1, 0.2, 0.01, 1, cm.Placement(4, "colocated", 4, 1, 1), cpu4, **comm) \
        == pytest.approx(0.61)


def test_colocated_generator_tp_pairs_use_their_own_slowdown():
    """4 ranks on 2 cores, no spread: colocated gen 2x2 slows its generation by the TP-pair curve
    (1.5 at 4 ranks) and its training by s(4) = 2: 0.1 * 1.5 + 0.2 * 2 + 0.01; gen_tp 1 and a
    profile without the pair curve keep s(4) for both phases: (0.1 + 0.2) * 2 + 0.01."""
    prof = _toy_profile()
    prof.concurrency = [[1, 1.0, 0.0], [2, 1.0, 0.0], [4, 2.0, 0.0]]
    prof.tp_concurrency = [[2, 1.0], [4, 1.5]]
    cpu4 = cm.cpu_cluster(4, 2)
    tp2, tp1 = cm.Placement(4, "colocated", 4, 2, 2), cm.Placement(4, "colocated", 4, 1, 1)
    assert cm.step_time(0.1, 0.2, 0.01, 1, tp2, cpu4, prof) == pytest.approx(0.56)
    assert cm.step_time(0.1, 0.2, 0.01, 1, tp1, cpu4, prof) == pytest.approx(0.61)
    assert prof.tp_pair_slowdown(8) == 3.0  # beyond the last point: grows as k
    prof.tp_concurrency = []
    assert cm.step_time(0.1, 0.2, 0.01, 1, tp2, cpu4, prof) == pytest.approx(0.61)


def test_tp_pair_slowdowns_hand_computed():
    """Alone the first pair steps every 10 ms; together both pairs step every 20 ms, the second
    pair starting 50 ms late: only the window where all four run counts, so 2.0, not less. The
    second round's machine is 20% slower alone and together alike: still 2.0 (same round)."""
    from launch.core_share import pair_slowdowns

    def rank(pair_start: float, slow: float):
        return [[rnd, 1, 0.0, [s * 0.010 * f for s in range(1, 25)]] for rnd, f in ((0, 1.0), (1, slow))] + \
               [[rnd, 2, pair_start, [pair_start + s * 0.020 * f for s in range(1, 25)]]
                for rnd, f in ((0, 1.0), (1, slow))]
    runs = [rank(10.0, 1.2), rank(10.0, 1.2), rank(10.05, 1.2), rank(10.05, 1.2)]
    assert pair_slowdowns(runs, 2, 2) == [[2, 1.0], [4, pytest.approx(2.0)]]
    with pytest.raises(RuntimeError, match="overlapped for .* too short"):
        pair_slowdowns([rank(10.0, 1.0)] * 2 + [rank(20.0, 1.0)] * 2, 2, 2)


def test_pair_probes_run_real_pairs():
    """launch/core_share.py's probes on the colocated generator mesh of a tiny model: two gloo TP
    pairs decode alone and together, and the four ranks exchange a step's groups; nothing to
    measure for one pair or a tied model."""
    import dataclasses
    from launch.core_share import pair_probes
    wl = cm.Workload(2, 2, 4, 8)
    got = pair_probes(TINY, wl, 4, rounds=1)
    curve, ((k, gather),) = got["tp_concurrency"], got["coloc_gather"]
    assert [k for k, _ in curve] == [2, 4] and curve[0][1] == 1.0 and 1.0 <= curve[1][1] < 10
    assert k == 4 and 0 < gather < 5
    assert pair_probes(TINY, wl, 3) == {}
    assert pair_probes(dataclasses.replace(TINY, tie_word_embeddings=True), wl, 4) == {}


def test_colocated_step_pays_the_group_exchange():
    """Measured at 2 and 4 ranks (4 and 9 ms): 3 ranks interpolate (6.5 ms), 8 ranks scale the
    4-rank point by peers (9 * 7/3 = 21 ms), a lone point scales likewise (4 * 2 = 8 ms at 3);
    the colocated estimate's sync carries it, a split layout's does not."""
    prof = _toy_profile()
    prof.coloc_gather = [[2, 4e-3], [4, 9e-3]]
    assert (prof.gather_s(1), prof.gather_s(3), prof.gather_s(8)) == pytest.approx((0.0, 6.5e-3, 21e-3))
    lone = _toy_profile()
    lone.coloc_gather = [[2, 4e-3]]
    assert lone.gather_s(3) == pytest.approx(8e-3)
    cpu4, wl = cm.cpu_cluster(4, 2), cm.Workload(8, 4, 4, 12, eta=1, gen_dtype="float32")
    coloc = cm.Placement(4, "colocated", 4, 1, 1)
    with_gather = cm.estimate(TINY, cpu4, wl, coloc, prof).times.sync
    assert with_gather - cm.estimate(TINY, cpu4, wl, coloc, _toy_profile()).times.sync == pytest.approx(9e-3)
    split = cm.Placement(4, "split", 2, 1, 1)
    assert cm.estimate(TINY, cpu4, wl, split, prof).times.sync == cm.estimate(TINY, cpu4, wl, split, _toy_profile()).times.sync


def test_sync_bytes_real_plan_matches_closed_form_and_reduced_plan():
    p = cm.Placement(16, "split", 8, 4, 2)  # trainer 4 x 2, generator 2 x 4
    even = cm.sync_bytes_even(TINY, p, 2)
    full = cm.sync_bytes_from_plan(TINY, p, "bfloat16", reduced=False)
    reduced = cm.sync_bytes_from_plan(TINY, p, "bfloat16", reduced=True)
    # one layer x L is exact for the sharded matrices; replicated norms may be balanced
    # differently (0.3% of this tiny model's bytes, < 0.1% of a Llama-8B's)
    assert full.max_recv == reduced.max_recv
    assert full.max_send == pytest.approx(reduced.max_send, rel=0.01)
    # the closed form assumes even shards: here the norms are replicated over gen_tp (+480 B) and
    # vocab 17 splits 5/4/4/4 over tp 4 (+192 B for embedding and head)
    assert full.max_recv == even.max_recv + 480 + 192
    assert full.max_send >= even.max_send * 0.99
    cl = cm.gpu_cluster("h100", 2)
    assert cm.sync_time(full, cl, p) == pytest.approx(
        max(full.max_send, full.max_recv) / 40e9 + full.peers_per_recv * 10e-6)


def _toy_profile() -> cm.Profile:
    """Costs proportional to the work, no fixed parts: generation and training scale perfectly."""
    z = [[1, 0.0], [1000, 0.0]]
    return cm.Profile("toy", "float32", 1, cm.model_signature(TINY),
                      layer_fwd=[[0, 0.0], [1000, 1e-2]], layer_bwd=[[0, 0.0], [1000, 2e-2]],
                      head_fwd=z, head_bwd=z, decode_step=[[0, 0.0], [10, 1e-3]], gen_fixed=z,
                      train_overhead=0.0, p2p=[], allreduce=[], allgather=[],
                      tp_collective_s=1e-4)


def test_search_finds_the_obviously_best_split():
    """8 prompts x 4 samples, 4 + 12 tokens, 4 GPUs. T_gen = 12 * 1e-4 * 32/G_dp = 0.0384/G_dp,
    T_train = 2 * 3e-5 * 512/fsdp = 0.0307/fsdp: halving the world (G 2 x 1, trainer 2 x 1) gives
    max(0.0192, 0.0154) = 0.0192, every other split is slower, TP only adds collectives (exposed:
    overlap 0)."""
    cl = cm.gpu_cluster("h100", 1, gpus_per_node=4, overlap=0.0)
    wl = cm.Workload(8, 4, 4, 12, eta=1, gen_dtype="float32", share_prompts=False)  # 512 tokens
    res = best_plan(TINY, cl, wl, _toy_profile(), modes=("split",))
    b = res.best.placement
    assert (b.generator_ranks, b.gen_tp, b.trainer_tp, b.activation_checkpointing) == (2, 1, 1, False)
    assert res.best.times.gen == pytest.approx(0.0192)
    assert res.best.times.train == pytest.approx(0.01536, rel=1e-3)
    # with perfect scaling, time-sharing all GPUs (colocated, synchronous) beats splitting them
    both = best_plan(TINY, cl, wl, _toy_profile())
    assert both.best.placement.mode == "colocated"
    assert both.best.step == pytest.approx(0.0096 + 0.00768 + both.best.times.sync, rel=1e-3)


def test_search_is_exhaustive_and_fast_at_1024_gpus():
    cl = cm.gpu_cluster("h100", 128)
    wl = cm.Workload(512, 16, 512, 2048, eta=4)
    t0 = time.perf_counter()
    res = best_plan(L8B, cl, wl)
    elapsed = time.perf_counter() - t0
    assert res.searched > 5000 and res.feasible > 0
    assert elapsed < 30, f"search took {elapsed:.1f}s (target < 10 s)"
    assert res.best.step <= res.best_sync.step_sync  # async never loses to the best sync placement
    assert res.best.times.detail["sync_bytes"].source.startswith("plan")  # re-costed with the real plan


def test_plan_writes_a_loadable_config(tmp_path, capsys):
    out = tmp_path / "best.toml"
    rc = plan_main(["--preset", "llama3-8b", "--nodes", "4", "--prompts", "64", "--group", "8",
                    "--prompt-len", "256", "--response-len", "512", "--eta", "2", "--top", "3",
                    "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "best synchronous placement" in text and "searched" in text
    cfg = load_config(str(out))
    p = cfg.parallel
    world = p.trainer_fsdp * p.trainer_tp + (p.generator_ranks if p.mode == "split" else 0)
    assert world == 32
    resolved = cfg.resolve(world)
    assert resolved.parallel.gen_dp * resolved.parallel.gen_tp == resolved.parallel.generator_ranks
    assert cfg.model.path == "preset:llama3-8b" and cfg.algo.max_staleness == 2
    assert cfg.generator.n_samples == 8 and cfg.generator.max_new_tokens == 512


def test_generator_tp_uses_the_decode_probe():
    """Per decode step, a split-mode TP generator pays (2L + 3) collectives: 2 all-reduces per
    layer, embedding, head and the link-poll broadcast (2L + 2 colocated), at the decode probe's
    cost (plus a wire latency per extra ring step beyond 2 ranks); a profile written before that
    probe existed falls back to the training TP collective."""
    wl = cm.Workload(2, 4, 8, 10)
    cl = cm.cpu_cluster(2, 2)
    prof = _toy_profile()  # tp_collective_s = 1e-4, decode 1e-4 s per sequence, no fixed part
    prof.tp_decode_collective_s = 3e-5
    g = cm.generation_time(TINY, cl, wl, gen_tp=2, gen_dp=1, slots=8, prof=prof)
    assert g["decode_step"] == pytest.approx(8e-4 / 2 + 7 * 3e-5)
    assert g["comm"] == pytest.approx(10 * 7 * 3e-5)
    prof.tp_decode_collective_s = 0.0
    g = cm.generation_time(TINY, cl, wl, gen_tp=2, gen_dp=1, slots=8, prof=prof)
    assert g["comm"] == pytest.approx(10 * 7 * 1e-4)
    # the colocated loop generates without the link: no poll broadcast, 2L + 2 collectives
    g = cm.generation_time(TINY, cl, wl, gen_tp=2, gen_dp=1, slots=8, prof=prof, link_poll=False)
    assert g["comm"] == pytest.approx(10 * 6 * 1e-4)
    coloc = cm.estimate(TINY, cl, wl, cm.Placement(2, "colocated", 2, 2, 1), prof)
    split = cm.estimate(TINY, cm.cpu_cluster(4, 2), wl, cm.Placement(4, "split", 2, 2, 1), prof)
    assert coloc.times.detail["gen"]["comm"] == pytest.approx(10 * 6 * 1e-4)
    assert split.times.detail["gen"]["comm"] == pytest.approx(10 * 7 * 1e-4)


def test_collectives_beyond_two_ranks_add_wire_latency_only():
    """The 2-rank probe's per-collective cost is per-call work; each extra ring step on k ranks
    adds the 2-rank all-reduce's intercept. Hand-computed: FSDP "model" units, 1 micro-batch:
    2 + (1 + 4) = 7 collectives; on 2 ranks (7 - 1) * c + step; on 4 ranks + 7 * 2 * a."""
    prof = _toy_profile()
    prof.collective_s, prof.fsdp_step_s = 1e-3, 5e-4
    prof.allreduce = [[1000, 2e-4], [2000, 3e-4]]  # intercept a = 1e-4 s
    assert prof.ring_steps_s(2) == 0.0 and prof.ring_steps_s(4) == pytest.approx(2e-4)
    cl = cm.cpu_cluster(4, 2)
    wl = cm.Workload(4, 2, 4, 8)
    t = {k: cm.train_time(TINY, cl, wl, k, 1, False, 10_000, prof) for k in (2, 4)}
    assert t[2]["micro_batches"] == t[4]["micro_batches"] == 1
    assert t[2]["fsdp_comm"] == pytest.approx(6 * 1e-3 + 5e-4)
    assert t[4]["fsdp_comm"] == pytest.approx(6 * 1e-3 + 5e-4 + 7 * 2e-4)
    # the intercept comes from the two smallest sizes: large ones vary 2x on gloo and would move it
    prof.allreduce = [[4096, 3.5e-4], [262144, 3.8e-4], [4 << 20, 4.6e-3], [16 << 20, 1e-2]]
    assert prof.wire_latency_s == pytest.approx(3.5e-4 - 4096 * 0.3e-4 / 258048)
    prof.allreduce = []  # no link measurements: no extra latency known
    assert prof.ring_steps_s(4) == 0.0


def test_p2p_latency_and_message_times_follow_the_measured_sizes():
    """A calibration of 2026-11-30: the 4 MB point slow, 16 MB fast. The least-squares line put
    the latency at ~0.6 ms, and a 3-peer weight sync of a 300 KB model at 1.6 ms. Hand-computed:
    the latency is the intercept through the two smallest sizes, a message is interpolated in
    the measured sizes, and beyond the largest one the rest goes at the fit's bandwidth."""
    prof = _toy_profile()
    prof.p2p = [[4096, 9.2e-5], [262144, 2.47e-4], [4 << 20, 2.25e-3], [16 << 20, 3.38e-3]]
    slope = (2.47e-4 - 9.2e-5) / (262144 - 4096)
    assert prof.p2p_latency == pytest.approx(9.2e-5 - 4096 * slope)
    assert prof.p2p_s(1000) == 9.2e-5 and prof.p2p_s(262144) == pytest.approx(2.47e-4)
    assert prof.p2p_s(304896) == pytest.approx(2.47e-4 + (304896 - 262144) * (2.25e-3 - 2.47e-4)
                                               / ((4 << 20) - 262144))
    more = (32 << 20) - (16 << 20)
    assert prof.p2p_s(32 << 20) == pytest.approx(3.38e-3 + more / (prof.p2p_gbps * 1e9))
    sb = cm.SyncBytes(103864, 304896, 3, "plan")
    sync = cm.sync_time(sb, cm.cpu_cluster(4, 2), cm.Placement(4, "split", 1, 1, 1), prof)
    assert sync == pytest.approx(prof.p2p_s(304896) + 2 * prof.p2p_latency)
    assert sync < 5e-4
    prof.p2p = []
    assert prof.p2p_latency == 0.0  # nothing measured: no latency known


def test_cpu_weight_sync_is_priced_on_the_shared_memory_points():
    """Split-mode CPU ranks of one host sync weights through shared memory (parallel.cpu_shm),
    so a CPU profile's `shm` points price the sync there; other clusters and colocated mode
    (point to point) keep the p2p points, and a profile without `shm` (written before it was
    measured) keeps p2p on CPU too. Hand-computed from the points: 8 MB interpolated between
    4 and 16 MB, 2 extra peers at the small-size intercept."""
    prof = _toy_profile()
    prof.p2p = [[4096, 6e-5], [262144, 1.2e-4], [4 << 20, 9e-4], [16 << 20, 3.6e-3]]
    prof.shm = [[4096, 2e-5], [262144, 3e-5], [4 << 20, 2e-4], [16 << 20, 1.5e-3]]
    sb = cm.SyncBytes(1 << 20, 8 << 20, 3, "plan")
    place = cm.Placement(4, "split", 1, 1, 1)
    shm_latency = 2e-5 - 4096 * (3e-5 - 2e-5) / (262144 - 4096)
    at_8mb = 2e-4 + (4 << 20) * (1.5e-3 - 2e-4) / (12 << 20)
    assert cm.sync_time(sb, cm.cpu_cluster(4, 2), place, prof) == pytest.approx(
        at_8mb + 2 * shm_latency)
    assert cm.sync_time(sb, cm.gpu_cluster("h100", 1), place, prof) == pytest.approx(
        prof.p2p_s(8 << 20) + 2 * prof.p2p_latency)
    colocated = cm.Placement(4, "colocated", 4, 1, 1)  # its sync is point to point
    assert cm.sync_time(sb, cm.cpu_cluster(4, 2), colocated, prof) == pytest.approx(
        prof.p2p_s(8 << 20) + 2 * prof.p2p_latency)
    prof.shm = []
    assert cm.sync_time(sb, cm.cpu_cluster(4, 2), place, prof) == pytest.approx(
        prof.p2p_s(8 << 20) + 2 * prof.p2p_latency)


def test_decode_is_priced_at_the_engine_slots_not_the_live_rows():
    """The engine decodes every KV slot each step, live or not (rollout/engine.py), so a replica
    with 16 slots and 8 sequences (2 of 4 prompts x 4 samples) pays 16 rows a step: hand-computed
    with the toy profile's 1e-4 s per row, 16e-4 s a step, 10 steps, 1 wave. The planner's own
    slot count for it is its 8 sequences, which halves that."""
    wl, cl, prof = cm.Workload(4, 4, 8, 10), cm.cpu_cluster(2, 2), _toy_profile()
    g = cm.generation_time(TINY, cl, wl, gen_tp=1, gen_dp=2, slots=16, prof=prof)
    assert g["decode_step"] == pytest.approx(16e-4) and g["waves"] == 1
    assert g["total"] == pytest.approx(10 * 16e-4)
    assert cm.plan_memory(TINY, cl, wl, cm.Placement(3, "split", 2, 1, 1)).slots == 8
    assert cm.plan_memory(TINY, cl, wl, cm.Placement(2, "split", 1, 1, 1)).slots == 16
    g = cm.generation_time(TINY, cl, wl, gen_tp=1, gen_dp=2, slots=8, prof=prof)
    assert g["total"] == pytest.approx(10 * 8e-4)


def test_generator_hand_off_is_paid_per_replica_message():
    """The hand-off (scoring + shipping a replica's groups in one message) is added to T_gen:
    measured at 1 and 4 groups, 3 ms + 1 ms a group, so a replica of 2 groups pays 5 ms, not
    half of the 7 ms batch. A profile from before the two sizes shares its batch's time pro rata."""
    wl, cl, prof = cm.Workload(4, 2, 8, 10), cm.cpu_cluster(2, 2), _toy_profile()
    base = {dp: cm.generation_time(TINY, cl, wl, 1, dp, 8, prof)["total"] for dp in (1, 2)}
    prof.handoff = [[1, 0.004], [4, 0.007]]
    for dp, cost in ((1, 0.007), (2, 0.005)):
        got = cm.generation_time(TINY, cl, wl, 1, dp, 8, prof)["total"]
        assert got == pytest.approx(base[dp] + cost)
    prof.handoff, prof.gen_handoff_s = [], 0.01
    for dp, share in ((1, 0.01), (2, 0.005)):
        got = cm.generation_time(TINY, cl, wl, 1, dp, 8, prof)["total"]
        assert got == pytest.approx(base[dp] + share)


def test_profile_fits_and_rings():
    assert cm.fit([[1, 3], [2, 5], [3, 7]]) == pytest.approx((1.0, 2.0))
    assert cm.fit([[1, 5], [2, 4]]) == (4.5,)  # a negative slope (noise) falls back to the mean
    prof = _toy_profile()
    prof.allreduce = [[0, 1e-3], [1e6, 2e-3]]
    assert prof.allreduce_s(2, 1e6) == pytest.approx(2e-3)
    assert prof.allreduce_s(4, 1e6) == pytest.approx(3 * (1e-3 + 2 * 1e6 / 4 * 1e-9))
    prof.concurrency = [[1, 1.0], [2, 1.0], [4, 2.0]]
    assert prof.slowdown(3) == 1.5 and prof.slowdown(8) == 4.0


def test_two_rank_probe_measures_every_cost():
    """launch/calibrate.py's two-rank block on a tiny model (real gloo ranks): every quantity the
    cost model reads is measured, and the ones that only add work come out positive."""
    from launch.calibrate import comm_costs
    wl = cm.Workload(2, 2, 4, 8)
    c = comm_costs(TINY, torch.float32, wl, 64, 1)
    assert {"p2p", "shm", "allreduce", "allgather", "fsdp", "tp", "tp_decode_excess", "handoff",
            "gather"} <= set(c)
    assert [n for n, _ in c["shm"]] == [n for n, _ in c["p2p"]]  # the same sizes, both links
    assert c["gather"][0] == 2 and c["gather"][1] > 0
    assert c["tp"]["train_excess"] > 0 and c["tp"]["micro"] >= 1
    assert [n for n, _ in c["handoff"]] == [1, 2] and all(t > 0 for _, t in c["handoff"])
    assert c["tp_decode_excess"] > 0  # 2L + 2 collectives per decode step on top of the compute
    assert c["fsdp"]["units"] == "model" and c["fsdp"]["micro"] >= 1
    assert all(t > 0 for _, t in c["p2p"] + c["shm"] + c["allreduce"] + c["allgather"])


def test_two_rank_probe_skips_tp_for_a_model_tp_cannot_shard():
    """Calibrating a tied-embedding model (SmolLM2-135M's shape) crashed in the TP=2 probes; the
    planner proposes no TP for it, so the probe measures links and FSDP only, and the profile's
    TP costs stay 0. Heads that 2 does not divide (3 heads) likewise."""
    from launch import calibrate
    from launch.core_share import pair_probes
    tied = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    odd = ModelArgs(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1,
                    num_heads=3, num_kv_heads=1)
    wl = cm.Workload(2, 2, 4, 4)
    c = calibrate.comm_costs(tied, torch.float32, wl, wl.seqs * wl.seq_len, 1)
    assert "tp" not in c and "tp_decode_excess" not in c
    assert c["fsdp"]["micro"] >= 1 and all(t > 0 for _, t in c["p2p"])
    two_rank_tp, _collective_costs = calibrate.two_rank_tp, calibrate._collective_costs
    assert (two_rank_tp(TINY), two_rank_tp(tied), two_rank_tp(odd)) == (True, False, False)
    assert pair_probes(odd, cm.Workload(2, 2, 4, 4), max_ranks=4) == {}
    pts = [[8, 1e-4], [64, 4e-4]]
    prof = cm.Profile("cpu", "float32", 1, cm.model_signature(tied), pts, pts, pts, pts, pts, pts,
                      0.0, c["p2p"], c["allreduce"], c["allgather"])
    _collective_costs(prof, tied, c)
    assert prof.tp_collective_s == prof.tp_decode_collective_s == prof.tp_step_s == 0.0
    assert "tp" not in prof.notes["two_rank"]


def test_plan_names_the_profile_file_and_key_it_cannot_use(tmp_path, capsys):
    """A profile that is missing, not JSON, lacks keys or has no points gave a raw traceback
    (TypeError, ZeroDivisionError, FileNotFoundError); now an error naming the file and key."""
    import json
    argv = ["--preset", "tiny", "--gpu", "cpu", "--gpus-per-node", "2", "--prompts", "4",
            "--group", "2", "--prompt-len", "4", "--response-len", "4", "--profile"]
    missing, garbled, partial, empty = (tmp_path / n for n in ("none.json", "garbled.json",
                                                               "partial.json", "empty.json"))
    garbled.write_text("{not json")
    partial.write_text(json.dumps({"device": "cpu", "dtype": "float32"}))
    d = {"device": "cpu", "dtype": "float32", "threads": 1, "model": cm.model_signature(TINY),
         "train_overhead": 0.0, **{k: [] for k in ("layer_fwd", "layer_bwd", "head_fwd", "head_bwd",
                                                   "decode_step", "gen_fixed", "p2p", "allreduce",
                                                   "allgather")}}
    empty.write_text(json.dumps(d))
    for path, words in ((missing, f"cannot read profile {missing}: [Errno 2]"),
                        (garbled, f"cannot read profile {garbled}"),
                        (partial, f"profile {partial} lacks the key(s) ['threads', 'model', 'layer_fwd'"),
                        (empty, f"profile {empty}: layer_fwd has no measured points")):
        assert plan_main([*argv, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err, err
    with pytest.raises(ValueError, match="no measured points"):
        cm.fit([])


def test_core_sharing_probe_runs_rank_work():
    """launch/core_share.py on a tiny model: two probe processes run engine decode steps and real
    train steps, alone then together; the curve starts at 1 and cannot fall below it."""
    from launch.core_share import slowdown_curve
    curve = slowdown_curve(TINY, cm.Workload(2, 2, 4, 8), 64, max_ranks=2, seconds=0.3, rounds=1)
    assert [k for k, *_ in curve] == [1, 2] and curve[0][1] == 1.0
    assert 1.0 <= curve[1][1] < float("inf")
    assert all(0.0 < cv < 1.0 for *_, cv in curve)  # every window held phases that varied


def test_core_sharing_probe_that_dies_is_named():
    """A probe process that fails while warming up ends the curve with an error that says how to
    see why, instead of a hang on its pipe."""
    import dataclasses
    from launch.core_share import slowdown_curve
    bad = dataclasses.replace(TINY, vocab_size=3)  # its prompts' token ids are out of range
    with pytest.raises(RuntimeError, match="probe process exited .* before sending its ready line"):
        slowdown_curve(bad, cm.Workload(2, 2, 4, 8), 64, max_ranks=2, seconds=0.05, rounds=1)


def test_core_sharing_probe_that_hangs_times_out():
    """Every wait on a probe has a timeout that names what it waited for."""
    import queue
    import subprocess
    import threading
    from launch.core_share import _Probe
    probe = _Probe.__new__(_Probe)  # a silent process in place of a real probe
    probe.timeout_s = 0.2
    probe.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    probe.lines = queue.Queue()
    threading.Thread(target=probe._read, daemon=True).start()
    try:
        with pytest.raises(TimeoutError, match=r"sent nothing within 0.2 s while its rate was due"):
            probe.result()
    finally:
        probe.proc.kill()
        probe.proc.wait()


@pytest.mark.parametrize("argv, words", [
    (["--nodes", "0"], ["--nodes", "0 is below 1"]),
    (["--prompts", "0"], ["--prompts", "0 is below 1"]),
    (["--eta", "-1"], ["--eta", "-1 is below 0"]),
    (["--gpu", "cpu", "--cores", "0"], ["--cores"]),
    (["--top", "0"], ["--top"]),
    (["--nodes", "two"], ["--nodes", "invalid int value: 'two'"]),
])
def test_plan_cli_rejects_bad_numbers_naming_the_option(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(["--preset", "tiny", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(w in err for w in words), err


def test_plan_rejects_an_unknown_mode_and_bad_inputs_with_their_names(capsys):
    assert plan_main(["--preset", "tiny", "--modes", "split,coloc"]) == 2
    assert "unknown placement mode(s) ['coloc']" in capsys.readouterr().err
    for make, words in ((lambda: cm.Workload(8, 0, 5, 24), "group_size=0"),
                        (lambda: cm.Workload(8, 8, 5, 24, eta=-1), "eta=-1"),
                        (lambda: cm.gpu_cluster("h100", 0), "nodes=0"),
                        (lambda: cm.cpu_cluster(4, 0), "cores=0")):
        with pytest.raises(ValueError, match=words):
            make()


def test_calibrate_cli_rejects_bad_input_before_measuring(tmp_path, capsys):
    from launch.calibrate import main as calibrate_main
    out = tmp_path / "p.json"
    assert calibrate_main(["--model", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        calibrate_main(["--model", "preset:tiny", "--response-len", "0", "--out", str(out)])
    assert e.value.code == 2 and "--response-len: 0 is below 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            calibrate_main(["--model", "preset:tiny", "--device", "cuda", "--out", str(out)])
        assert "no CUDA device" in capsys.readouterr().err
    assert not out.exists()


def test_a_profile_without_links_takes_the_clusters():
    """calibrate.py on one GPU measures compute but no links (two ranks there would time the
    CPU's gloo): the collectives then cost what the cluster's datasheet links say, the compute
    what the profile measured."""
    prof = _toy_profile()
    prof.tp_collective_s = 0.0
    assert not prof.has_links and _toy_profile().has_links
    cl = cm.gpu_cluster("h100", 1, gpus_per_node=4)
    assert cm.with_profile(cl, prof) is cl  # no p2p measured: the datasheet's links stay
    wl = cm.Workload(8, 4, 4, 12, eta=1, gen_dtype="float32")
    measured = cm.train_time(TINY, cl, wl, 2, 2, False, 256, prof)
    datasheet = cm.train_time(TINY, cl, wl, 2, 2, False, 256, None)
    assert measured["fsdp_comm"] == datasheet["fsdp_comm"] > 0
    assert measured["tp_comm"] == datasheet["tp_comm"] > 0
    assert measured["compute"] != datasheet["compute"]
    g = cm.generation_time(TINY, cl, wl, gen_tp=2, gen_dp=1, slots=8, prof=prof)
    ar = cm.allreduce_s(2, 8 * TINY.hidden_size * 4, cm.link_bw(cl, 2), cl.link_latency_s)
    assert g["decode_step"] == pytest.approx(prof.decode_step_s(8, 2) + 2 * TINY.num_layers * ar)


def test_plan_says_why_it_found_no_placement_to_search(capsys):
    """8 GPUs, 2 prompt groups, SmolLM2-135M's shape (tied embeddings: TP 1 only): every
    generator replica and trainer data-parallel rank needs a group, so G <= 2 and 8 - G <= 2,
    and colocated 8 <= 2: nothing to search. The error said "no placement fits in memory ...
    shorten --prompts", the opposite fix; it needs G = 4, 8 - G = 4: --prompts >= 4."""
    argv = ["--preset", "smollm2-135m", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "h100",
            "--group", "4", "--prompt-len", "64", "--response-len", "64", "--prompts"]
    assert plan_main([*argv, "2"]) == 2
    captured = capsys.readouterr()
    assert "searched 0 placements" in captured.out
    assert "fits in memory" not in captured.err and "TP degrees [1]" in captured.err
    assert "raise --prompts to at least 4" in captured.err
    assert plan_main([*argv, "4"]) == 0


@pytest.mark.parametrize("kw, words", [
    (dict(world=8, generator_ranks=3, gen_tp=2, trainer_tp=2),
     "the generator's tp 2 does not divide its 3 ranks"),
    (dict(world=8, generator_ranks=4, gen_tp=2, trainer_tp=3),
     "the trainer's tp 3 does not divide its 4 ranks"),
    (dict(world=8, generator_ranks=8), "split mode needs 1 <= generator_ranks < world"),
    (dict(world=8, generator_ranks=0), "split mode needs 1 <= generator_ranks < world"),
    (dict(world=8, mode="colocated", generator_ranks=4), "generator_ranks must be 8"),
    (dict(world=8, mode="coloc", generator_ranks=4), "mode must be 'split' or 'colocated'"),
    (dict(world=8, generator_ranks=4, gen_tp=0), "gen_tp=0: it must be >= 1"),
])
def test_placement_refuses_what_the_runtime_refuses(kw, words):
    """A hand-made Placement was costed as it came: G=3 at gen_tp 2 as one replica of 2 ranks
    (gen_dp = 3 // 2), and G = world divided by zero trainer ranks."""
    with pytest.raises(ValueError, match=re.escape(words)):
        cm.Placement(**kw)


def test_cluster_table_refuses_flags_it_would_ignore(tmp_path, capsys):
    """--cluster-table plans its own models and clusters: a --preset, --profile or --out given
    with it were silently ignored (no config written, rc 0)."""
    from launch.plan import build_parser, ignored_by_cluster_table
    out = tmp_path / "ct.toml"
    with pytest.raises(SystemExit) as e:
        plan_main(["--cluster-table", "--preset", "tiny", "--gpus-per-node", "2",
                   "--profile", str(tmp_path / "p.json"), "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "does not use --preset --gpus-per-node --profile --out" in err
    assert not out.exists()
    ap = build_parser()
    used = ["--cluster-table", "--gpu", "h200", "--prompts", "64", "--group", "8", "--prompt-len",
            "128", "--response-len", "256", "--eta", "2"]
    assert ignored_by_cluster_table(ap, ap.parse_args(used)) == []
    assert ignored_by_cluster_table(ap, ap.parse_args([*used, "--top", "3"])) == ["--top"]


def test_plan_warns_when_the_profile_is_of_other_hardware(tmp_path, capsys):
    path = tmp_path / "cpu_profile.json"
    prof = _toy_profile()
    prof.device = "cpu"
    prof.save(str(path))
    assert plan_main(["--preset", "tiny", "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "4",
                      "--prompts", "8", "--group", "4", "--prompt-len", "4", "--response-len", "12",
                      "--profile", str(path)]) == 0
    assert "measured on cpu, the plan is for h100 ranks" in capsys.readouterr().err


def test_placements_are_those_the_runtime_accepts():
    """The search proposed TP degrees that preflight refuses (ParallelDims.check_model): an
    intermediate size the degree does not divide; a trainer TP that does not divide the
    vocabulary at trainer_fsdp >= 3 (DCP cannot checkpoint it)."""
    from launch.plan import placements, tp_degrees
    from parallel.dims import ParallelDims
    odd = ModelArgs(vocab_size=64, hidden_size=64, intermediate_size=90, num_layers=2,
                    num_heads=8, num_kv_heads=8)
    assert tp_degrees(odd, 8) == [1, 2]  # 90 = 2 x 45: 4 and 8 divide the heads, not 90
    qwen3 = ModelArgs(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=8, num_kv_heads=4, qk_norm=True)
    assert tp_degrees(qwen3, 8) == [1, 2, 4]  # per-head q/k norms train under TP too
    odd_vocab = dataclasses.replace(qwen3, vocab_size=97)
    for args in (odd, qwen3, odd_vocab):
        layouts = set()
        for p in placements(args, 8, 8, 64):
            trainers = 8 - p.generator_ranks if p.mode == "split" else 8
            dims = ParallelDims(8, p.mode, p.generator_ranks, p.gen_tp, p.generator_ranks // p.gen_tp,
                                trainers // p.trainer_tp, p.trainer_tp)
            dims.check_model(args.num_heads, args.num_kv_heads, args.tie_word_embeddings,
                             args.intermediate_size, args.vocab_size)
            layouts.add((trainers // p.trainer_tp, p.trainer_tp))
        assert ((3, 2) in layouts) == (args is not odd_vocab)  # 6 trainer ranks as fsdp 3 x tp 2


def test_colocated_memory_counts_the_exchange_send_buffers():
    """A colocated rank sends a version as one batch (weights_sync/exchange.py), each copied
    piece in a buffer of its own: at most its trainer shard in the generator's dtype. Llama-3-8B
    in bf16 on 8 colocated H100s: 8.03e9 * 2 / 8 = 2.0 GB beside both meshes' own."""
    wl = cm.Workload(64, 8, 512, 2048, gen_dtype="bfloat16")
    send = cm.colocated_send_bytes(L8B, wl, 8)
    assert send == pytest.approx(L8B.num_params() * 2 / 8, rel=0.01)
    mem = cm.plan_memory(L8B, cm.gpu_cluster("h100", 1), wl, cm.Placement(8, "colocated", 8, 1, 1))
    assert mem.per_rank == pytest.approx(mem.trainer + mem.generator + send)


def test_a_colocated_rank_whose_trainer_states_do_not_fit_is_told_so():
    """Llama-3-8B's trainer states (~128 GB) on one H100: the colocated rank's reason named the
    generator ("no room for one KV slot ... shorten --response-len"), which nothing fixes."""
    mem = cm.plan_memory(L8B, cm.gpu_cluster("h100", 1, 1), cm.Workload(8, 16, 512, 2048),
                         cm.Placement(1, "colocated", 1, 1, 1))
    assert mem.why.startswith("trainer: ") and "KV slot" not in mem.why, mem.why


def test_a_fit_never_falls_over_its_measured_range():
    """A quadratic through noisy points fell between them (1.83 ms at 32 tokens, 1.54 ms at
    512): the planner then found more TP slower there. It falls back to a line (or a constant)."""
    pts = [[32, 2e-3], [128, 1.5e-3], [512, 1.6e-3], [2048, 5e-3]]
    coef = cm.fit(pts, 2)
    at = lambda x: sum(c * x ** i for i, c in enumerate(coef))  # noqa: E731
    xs = range(32, 2049, 16)
    assert all(at(b) >= at(a) for a, b in zip(xs, xs[1:])), coef
    assert cm.fit([[1, 3], [2, 5], [3, 7]]) == (1.0, 2.0)
    assert len(cm.fit([[1, 1], [2, 4], [3, 9]], 2)) == 3  # a rising quadratic stays one


def test_the_chosen_plan_is_one_whose_sync_was_recosted():
    """Generation-bound plans tie on step time: refine re-costed the first k by step alone (any
    of the tied ones), while the ranking broke the tie by total phase time, so the chosen plan's
    sync could be the closed form's (here: 'even shards')."""
    from launch.plan import best_plan
    res = best_plan(preset_args("llama-1.1b"), cm.gpu_cluster("h100", 3, 6),
                    cm.Workload(16, 4, 256, 512, 1, "float32", "bfloat16"))
    assert res.best.times.detail["sync_bytes"].source.startswith("plan"), res.best.placement.label()


@pytest.mark.parametrize("argv, why", [
    (["--preset", "8b", "--cores", "16"], "--cores applies to --gpu cpu"),
    (["--preset", "8b", "--gpu", "cpu", "--nodes", "2"], "--gpu cpu plans the ranks of one host"),
    (["--cluster-table", "--gpu", "cpu"], "--cluster-table compares GPU clusters"),
    (["--preset", "8b", "--mem-gb", "64"], "--mem-gb applies to --gpu cpu"),
    (["--preset", "tiny", "--gpu", "cpu", "--mem-gb", "0"], "--mem-gb=0: give the host's memory"),
    (["--preset", "tiny", "--gpu", "cpu", "--mem-gb", "nan"], "--mem-gb=nan: give the host's memory"),
    (["--preset", "tiny", "--gpu", "cpu", "--mem-gb", "inf"], "--mem-gb=inf: give the host's memory")])
def test_plan_refuses_flags_its_device_would_ignore(argv, why, capsys):
    """--cores on GPUs was ignored, --gpu cpu --nodes 2 planned one host of all the ranks, and
    --cluster-table --gpu cpu printed H100 numbers: each silently."""
    with pytest.raises(SystemExit) as e:
        plan_main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_the_plan_file_is_written_before_the_table_is_read(tmp_path, monkeypatch, capsys):
    """`plan.py ... --out best.toml | head -1`: the pipe closed while the table printed
    (BrokenPipeError, exit 2) and the file, written after it, was lost."""
    from launch import plan

    def closed_pipe(*a, **k):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(plan, "table", closed_pipe)
    out = tmp_path / "best.toml"
    argv = ["--preset", "llama-1.1b", "--nodes", "1", "--top", "1", "--out", str(out)]
    assert plan_main(argv) == 2
    assert "Broken pipe" in capsys.readouterr().err
    assert load_config(str(out)).parallel.mode in ("split", "colocated")
    # a config that cannot be written (its base disagrees) still shows the table, then why
    monkeypatch.undo()

    def refused(*a, **k):
        raise ValueError("the base config disagrees")
    monkeypatch.setattr(plan, "to_config", refused)
    assert plan_main([*argv[:-1], str(tmp_path / "other.toml")]) == 2
    got = capsys.readouterr()
    assert "best synchronous placement" in got.out and "error: the base config disagrees" in got.err, got


def test_a_cpu_plan_takes_the_hosts_memory(capsys):
    """--gpu cpu planned against 16 GB no flag could change, and told a host of too little to
    'add nodes or use a larger GPU', which --gpu cpu refuses."""
    argv = ["--preset", "llama-1.1b", "--gpu", "cpu", "--gpus-per-node", "4", "--prompts", "8",
            "--group", "4", "--prompt-len", "64", "--response-len", "64", "--top", "1"]
    assert plan_main([*argv, "--mem-gb", "4"]) == 2
    err = capsys.readouterr().err
    assert "no placement fits in memory" in err and "Give the host's memory if it has more than " \
        "4 GB (--mem-gb), or fewer ranks" in err and "larger GPU" not in err, err
    assert plan_main([*argv, "--mem-gb", "64"]) == 0
