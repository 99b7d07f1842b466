"""Bad input: each case ends train_rl.main non-zero within 60 s with one clear message (no
traceback), before any process group exists."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.rl_model import make_rl_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    return make_rl_model(tmp_path_factory.mktemp("m") / "model")


def _corrupt(good_model, tmp_path, what):
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(good_model, folder)
    if what == "truncated":
        f = folder / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    elif what == "vocab":  # another model's tokenizer: 100 printable characters vs 17 embeddings
        import string
        from model.tokenizer import build_char_tokenizer
        build_char_tokenizer(string.printable).save(folder)
    elif what == "arch":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["architectures"] = ["GPTNeoXForCausalLM"]
        (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _case(name, tmp_path, good_model):
    """-> (extra argv, config text or None, expected words)."""
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[trainer]\nlr = 1e-4\nmax_steps = = 3\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    not_dir = tmp_path / "a_file"
    not_dir.write_text("x")
    m = f"--model.path={good_model}"
    return {
        "malformed_toml": (["--config", str(bad_toml)], ["bad.toml:3", "invalid TOML"]),
        "missing_config": (["--config", str(tmp_path / "nope.toml")], ["config file not found"]),
        "unknown_key": ([m, "--trainer.lrr=1"], ["trainer.lrr", "lr"]),
        "wrong_type": ([m, "--trainer.max_steps=ten"], ["max_steps", "int"]),
        "unknown_flag": ([m, "--fast"], ["unknown flag", "--fast"]),
        "impossible_layout": ([m, "--parallel.generator_ranks=3"], ["generator_ranks", "world_size=3"]),
        # world 5 (set below): 4 trainer ranks as tp=4, but the model has 2 kv heads
        "tp_vs_heads": ([m, "--parallel.trainer_tp=4"], ["trainer_tp=4", "num_kv_heads=2"]),
        # the usual first run of the tiny preset: the hint names the command that writes it
        "missing_model": (["--model.path=" + str(tmp_path / "nomodel")],
                          ["does not exist", f"python tools/make_tiny_model.py --out "
                           f"{tmp_path / 'nomodel'} --digits 1"]),
        # a plan's config for the dry run, launched as it is: the hint made a tiny model there
        "preset_model_path": (["--model.path=preset:llama3-8b"],
                              ["model.path='preset:llama3-8b' is a shape preset",
                               "point --model.path at the model's Hugging Face folder"]),
        "empty_model_path": (["--model.path="], ["model.path is empty",
                                                 "python tools/make_tiny_model.py --digits 1"]),
        # world 4 (set below): 3 trainer ranks; the model's 4 heads and 2 KV heads allow tp 1 or 2
        "layout_vs_heads": ([m, "--parallel.trainer_tp=2"],
                            ["trainer_tp=2 does not divide the 3 trainer ranks",
                             "set --parallel.trainer_tp=1; or instead set --parallel.generator_ranks=2"]),
        "tp_vs_heads_and_layout": ([m, "--parallel.trainer_tp=3"],
                                   ["trainer_tp=3", "num_kv_heads=2", "Fix: set --parallel.trainer_tp=1"]),
        "unknown_task_option": ([m, '--data.task_options={"max_digits":1}'],
                                ["synthetic task 'addition'", "'max_digits'", "accepts ['digits']"]),
        "corrupt_model": (["--model.path=" + _corrupt(good_model, tmp_path / "c1", "truncated")],
                          ["truncated or corrupt"]),
        "unsupported_arch": (["--model.path=" + _corrupt(good_model, tmp_path / "c2", "arch")],
                             ["unsupported architecture", "LlamaForCausalLM"]),
        "vocab_mismatch": (["--model.path=" + _corrupt(good_model, tmp_path / "c3", "vocab")],
                           ["tokenizer", "vocab_size is 17", "resize the model's embeddings to at "
                                                 "least 104 rows"]),
        "empty_dataset": ([m, f"--data.source={empty}"], ["empty.jsonl"]),
        "all_prompts_too_long": ([m, "--data.max_prompt_len=2"], ["max_prompt_len"]),
        "bad_reward_path": ([m, "--reward.fn=nowhere_pkg.mod:score"], ["nowhere_pkg"]),
        # every call raised TypeError: the run trained on zero rewards, rc 0 (tests/rl_model.py)
        "reward_signature": ([m, "--reward.fn=tests.rl_model:two_argument_reward"],
                             ["reward 'tests.rl_model:two_argument_reward' takes (completion_text: "
                              "str, answer: str) -> float", "def two_argument_reward(item, "
                              "completion_text, completion_ids) -> float"]),
        # a relative path is looked for in the launch directory (run_local.sh: the repo's root)
        "relative_model_path": ([m[:-len(good_model)] + "no_such_model_dir"],
                                ["'no_such_model_dir' (model.path) does not exist (looked for "
                                 f"{ROOT / 'no_such_model_dir'})"]),
        "relative_prompt_file": ([m, "--data.source=no_such_prompts.jsonl"],
                                 [f"data.source, looked for {ROOT / 'no_such_prompts.jsonl'}"]),
        "run_dir_not_writable": ([m, f"--run.dir={not_dir}/run"], ["not writable", "run.dir"]),
        "flash_without_flash_attn": ([m, "--model.attn_backend=flash"],
                                     ["model.attn_backend='flash'", "--model.attn_backend=auto"]),
        "cudagraph_without_cuda": ([m, "--generator.decode=cudagraph"],
                                   ["generator.decode='cudagraph' needs a CUDA device", "'auto'"]),
        "flex_without_compile": ([m, "--generator.decode_attention=flex"],
                                 ["generator.decode_attention='flex' needs the compiled decode step",
                                  "generator.decode='compile'"]),
        # the compiled step packs its own weights: the engine refused 'on' after start-up
        "pack_weights_with_compile": ([m, "--generator.pack_weights=on", "--generator.decode=compile"],
                                      ["generator.pack_weights='on' needs eager decode",
                                       "--generator.pack_weights=auto"]),
        "stop_ids_outside_vocab": ([m, "--generator.stop_token_ids=[-5, 999999]"],
                                   ["generator.stop_token_ids has [-5, 999999]", "vocabulary"]),
        # every reward call raised: the run trained on zero rewards and exited 0
        "reasoning_gym_reward_on_other_data": ([m, "--reward.fn=reasoning_gym"],
                                               ["reward.fn='reasoning_gym' scores prompts of a "
                                                "reasoning_gym task", "data.source="
                                                "'synthetic:addition' is not one"]),
        # TANDEM_FAULT_KILL (FAULTS below) that no rank of this job reaches ran without the fault
        "fault_rank_outside_the_job": ([m], ["TANDEM_FAULT_KILL='rank=3,step=2'",
                                             "would never act in this job",
                                             "rank 3 is not one of its ranks 0..2"]),
        "fault_groups_on_a_trainer_rank": ([m], ["'rank=1,step=2,groups=1'",
                                                 "rank 1 is a trainer rank"]),
        # refused at the first step before, after the model load and process groups
        "fault_malformed": ([m], ["TANDEM_FAULT_KILL='rank=1' is not of the form"]),
        # the preset evaluates every 100 steps: a file dataset has no held-out part of its own
        "eval_without_held_out": ([m, f"--data.source={prompts}"],
                                  ["eval.every_steps=100", "prompts.jsonl", "set eval.source"]),
    }[name]


CASES = ["malformed_toml", "missing_config", "unknown_key", "wrong_type", "unknown_flag",
         "impossible_layout", "tp_vs_heads", "missing_model", "corrupt_model", "unsupported_arch",
         "vocab_mismatch", "empty_dataset", "all_prompts_too_long", "bad_reward_path",
         "run_dir_not_writable", "flash_without_flash_attn", "cudagraph_without_cuda",
         "flex_without_compile", "eval_without_held_out", "stop_ids_outside_vocab",
         "empty_model_path", "preset_model_path", "layout_vs_heads", "tp_vs_heads_and_layout", "unknown_task_option",
         "pack_weights_with_compile", "reward_signature", "relative_model_path",
         "relative_prompt_file", "fault_rank_outside_the_job", "fault_groups_on_a_trainer_rank",
         "fault_malformed", "reasoning_gym_reward_on_other_data"]
FAULTS = {"fault_rank_outside_the_job": "rank=3,step=2",  # TANDEM_FAULT_KILL (launch/faults.py)
          "fault_groups_on_a_trainer_rank": "rank=1,step=2,groups=1", "fault_malformed": "rank=1"}
WORLDS = {"tp_vs_heads": "5", "layout_vs_heads": "4", "tp_vs_heads_and_layout": "4"}  # else 3
# what a case's message must not say: a degree the other check refuses, a key task_options refuses
ABSENT = {"layout_vs_heads": ["[1, 3]"], "tp_vs_heads_and_layout": ["[1, 2]"],
          "unknown_task_option": ["'seed'"]}


# Each case runs train_rl.main in this process (a fresh interpreter per case cost ~5-9 s of
# imports on 2 cores); these two also run as a user runs them, in a process of their own.
IN_A_PROCESS = ("malformed_toml", "empty_dataset")


def _in_a_process(argv, world):
    env = {**os.environ, "WORLD_SIZE": world, "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "train_rl.py", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr


def _in_this_process(argv, world, monkeypatch, capsys, rank="0"):
    import train_rl
    from parallel import mesh

    def no_groups(*args, **kwargs):  # a regression must fail here, not wait for peers
        raise AssertionError("reached process-group set-up: preflight let the bad input through")
    monkeypatch.setattr(mesh, "init_process_group", no_groups)
    for k, v in {"WORLD_SIZE": world, "RANK": rank, "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    rc = train_rl.main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("name", CASES)
def test_bad_input_fails_fast_with_one_message(name, tmp_path, good_model, monkeypatch, capsys):
    argv, words = _case(name, tmp_path, good_model)
    if name == "flash_without_flash_attn":
        from model.attention import flash_attn_varlen_func
        if flash_attn_varlen_func is not None and torch.cuda.is_available():
            pytest.skip("flash-attn runs on this machine")
    if name == "cudagraph_without_cuda" and torch.cuda.is_available():
        pytest.skip("CUDA graphs run on this machine")
    if "--config" not in argv:
        argv = ["--config", "configs/tiny_cpu.toml", f"--run.dir={tmp_path / 'run'}", *argv]
    # As rank 0 of a job: every check here runs before any process group exists.
    world = WORLDS.get(name, "3")
    if name in FAULTS:
        monkeypatch.setenv("TANDEM_FAULT_KILL", FAULTS[name])
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    t0 = time.monotonic()
    if name in IN_A_PROCESS:
        rc, err = _in_a_process(argv, world)
    else:
        rc, err = _in_this_process(argv, world, monkeypatch, capsys)
    assert time.monotonic() - t0 < 60
    assert rc != 0
    assert "Traceback" not in err, err
    assert err.count("error") >= 1 and len(err.strip().splitlines()) <= 3, err
    for w in words:
        assert w in err, (w, err)
    for w in ABSENT.get(name, []):
        assert w not in err, (w, err)


def test_missing_model_hints_name_the_command_that_writes_it(tmp_path):
    """The tiny preset's folder is written by `make demo`; another synthetic task's or digit
    count's by make_tiny_model.py with its flags; other sources get no command."""
    from config import load_config
    from launch.preflight import TINY_MODEL, missing_model_hint
    tiny = "configs/tiny_cpu.toml"
    # `make demo` writes the preset's folder; make_tiny_model.py without --out writes TINY_MODEL
    assert Path(load_config(os.path.join(ROOT, tiny)).model.path) == TINY_MODEL
    assert f'default=Path("{TINY_MODEL}")' in (ROOT / "tools" / "make_tiny_model.py").read_text()
    hint = missing_model_hint(load_config(os.path.join(ROOT, tiny)))
    assert "`make demo`" in hint and "python tools/make_tiny_model.py --digits 1" in hint
    hint = missing_model_hint(load_config(os.path.join(ROOT, tiny), [
        "--data.source=synthetic:reverse", "--data.synthetic_digits=3", f"--model.path={tmp_path}/m"]))
    assert "make demo" not in hint
    assert f"python tools/make_tiny_model.py --out {tmp_path}/m --task reverse --digits 3" in hint
    hint = missing_model_hint(load_config(os.path.join(ROOT, tiny), ['--data.task_options={"digits":2}']))
    assert "make demo" not in hint and "--digits 2" in hint  # task_options override the digits
    assert missing_model_hint(load_config(None, ["--data.source=reasoning_gym:basic_arithmetic"])) == ""


def test_a_rank_other_than_0_reports_the_error_when_still_running_after_the_grace(
        tmp_path, good_model, monkeypatch, capsys):
    """Rank 0 prints the error every rank finds before process groups; another rank waits
    REPORT_GRACE_S (torchrun stops it once rank 0 exits): a rank that exits first makes torchrun
    stop rank 0, which may not have printed yet. Still running then, a rank of rank 0's node
    prints it itself; a rank of another node exits quietly (no line per rank of a large job)."""
    import train_rl
    monkeypatch.setattr(train_rl, "REPORT_GRACE_S", 0.3)
    argv, words = _case("unknown_key", tmp_path, good_model)
    argv = ["--config", "configs/tiny_cpu.toml", f"--run.dir={tmp_path / 'run'}", *argv]
    for node, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("GROUP_RANK", node)
        t0 = time.monotonic()
        rc, err = _in_this_process(argv, "3", monkeypatch, capsys, rank="1")
        assert rc == 2 and time.monotonic() - t0 >= 0.3
        assert len(err.strip().splitlines()) == lines, (node, err)
    monkeypatch.delenv("GROUP_RANK")  # a launcher without node ranks: as on rank 0's node
    rc, err = _in_this_process(argv, "3", monkeypatch, capsys, rank="1")
    assert rc == 2 and err.startswith("error (rank 1): ") and len(err.strip().splitlines()) == 1
    for w in words:
        assert w in err, (w, err)


def test_a_resume_over_another_prompt_set_or_model_is_refused_before_process_groups(
        tmp_path, good_model, monkeypatch, capsys):
    """The generators' cursors refused a resume over another prompt set, and DCP one into a
    model of another size ("Size mismatch" on every trainer rank), only after start-up;
    preflight now compares the checkpoint with what this config loads, and the same passes."""
    from config import load_config
    from launch.preflight import check_resumed
    from model import load_pretrained
    from model.hf_io import load_model_args
    from model.tokenizer import load_tokenizer
    from parallel.checkpoint import save_sharded
    from rollout.data import PromptSource
    from rollout.role import load_items
    from tools.make_tiny_model import make_random_model
    from trainer.checkpointing import checkpoint_root
    base = ["--config", "configs/tiny_cpu.toml", f"--model.path={good_model}",
            f"--run.dir={tmp_path / 'run'}", "--data.num_prompts=100"]
    cfg = load_config("configs/tiny_cpu.toml", base[2:]).resolve(3)
    items = load_items(cfg, load_tokenizer(good_model))[0]
    cursor = PromptSource(items, seed=cfg.data.seed, shuffle=cfg.data.shuffle, rank=0,
                          world=1).state_dict()
    step = checkpoint_root(cfg) / "step_000002"
    save_sharded(step, load_pretrained(good_model), extra={
        "step": 2, "version": 2, "generators": {"0": {"cursor": cursor, "inflight": [], "started": 8}}})
    check_resumed(cfg, step, load_model_args(good_model), items)  # the same model and set: resumes
    rc, err = _in_this_process([*base, "--data.num_prompts=50"], "3", monkeypatch, capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert f"resuming {step}: prompt cursor was saved with num_items=100" in err
    assert "this source has num_items=50" in err
    wider = make_random_model(tmp_path / "wider", hidden=48, layers=2)
    rc, err = _in_this_process([*base, f"--model.path={wider}"], "3", monkeypatch, capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert f"resuming {step}: its parameters are not those of the model in {wider}" in err
    assert "model.embed_tokens.weight [" in err and "; ...);" in err, err


def test_prompts_skipped_are_logged_once_by_the_first_rank(tmp_path, good_model, monkeypatch, caplog):
    """Preflight runs on every rank and each generator loads the prompts again: a run on 3 ranks
    printed "skipped N of M training prompts" 4 times. Preflight's first rank alone says it."""
    import logging
    from config import load_config
    from launch.preflight import preflight
    from parallel.dims import ParallelDims
    from rollout.role import load_eval_items, load_items
    cfg = load_config("configs/tiny_cpu.toml", [f"--model.path={good_model}", f"--run.dir={tmp_path}",
                                                "--data.synthetic_digits=2", "--data.max_prompt_len=6",
                                                "--data.num_prompts=200"]).resolve(3)
    dims = ParallelDims.from_config(cfg.parallel, 3)
    said = {}
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rollout.data"):
            tok = preflight(cfg, dims)
        said[rank] = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert said["1"] == [] and len(said["0"]) == 2, said  # the training and the held-out prompts
    assert "training prompts (synthetic:addition) longer than data.max_prompt_len=6" in said["0"][0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollout.data"):
        kept = load_items(cfg, tok, warn=False)[0]
        load_eval_items(cfg, tok, warn=False)
    assert 0 < len(kept) < 200 and not caplog.records


def _check_warnings(base, cases, absent, monkeypatch, capsys, also=""):
    """preflight of configs/tiny_cpu.toml with `base` plus each case's arguments, as rank 0 and
    as rank 1: rank 0 warns with the case's text (and `also`) where it has one; rank 1 never
    says `absent`, nor rank 0 for a case of None."""
    from config import load_config
    from launch.preflight import preflight
    from parallel.dims import ParallelDims
    dims = ParallelDims.from_config(load_config("configs/tiny_cpu.toml", base).resolve(3).parallel, 3)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        for args, want in cases.items():
            preflight(load_config("configs/tiny_cpu.toml", [*base, *args]).resolve(3), dims)
            err = capsys.readouterr().err
            if want is None or rank == "1":
                assert absent not in err, (args, err)
            else:
                assert "warning: " in err and want in err and also in err, err


def test_a_training_run_whose_groups_cannot_differ_gets_one_warning(tmp_path, good_model, monkeypatch, capsys):
    """n_samples = 1, or greedy sampling: every group baseline gives advantage 0 and the run
    trained nothing from its rewards without a word (reward_zero_std_frac 1.0, grad_norm 0).
    Warned by rank 0 (calibration and throughput runs may want it); an evaluation-only run not."""
    cases = {("--generator.n_samples=1",): "generator.n_samples=1: a group of one",
             ("--generator.temperature=0",): "greedy sampling (generator.greedy=False, "
                                             "temperature=0.0, top_k=0): a group's 8 completions",
             ("--generator.top_k=1",): "top_k=1): a group's 8",
             ("--generator.n_samples=1", "--trainer.max_steps=0"): None,  # evaluation only
             (): None}
    _check_warnings([f"--model.path={good_model}", f"--run.dir={tmp_path}"], cases, "warning",
                    monkeypatch, capsys, also="every advantage (algo.advantage='group_mean') is 0 "
                                              "and the policy loss has no gradient for all 800 steps")


def test_a_warmup_as_long_as_the_run_gets_one_warning(tmp_path, good_model, monkeypatch, capsys):
    """trainer.warmup_steps >= max_steps: the lr rose for the whole run and never reached
    trainer.lr, silently. Rank 0 says so; a warm-up shorter than the run, a one-step warm-up (its
    step runs at trainer.lr) or an evaluation-only run gets nothing."""
    cases = {("--trainer.warmup_steps=50",): "trainer.warmup_steps=50 >= trainer.max_steps=40: "
                                             "the learning rate rises for the whole run and ends "
                                             "at 0.8 x trainer.lr=0.0002, never reaching it; set "
                                             "--trainer.warmup_steps below 40 (e.g. 2)",
             ("--trainer.warmup_steps=40",): "rises for the whole run and reaches trainer.lr only "
                                             "at its last step; set --trainer.warmup_steps below "
                                             "40 (e.g. 2)",
             ("--trainer.warmup_steps=8", "--trainer.max_steps=5"): "below 5 (e.g. 2)",
             ("--trainer.warmup_steps=39",): None,
             ("--trainer.warmup_steps=1", "--trainer.max_steps=1"): None,
             ("--trainer.warmup_steps=50", "--trainer.max_steps=0"): None}  # evaluation only
    _check_warnings([f"--model.path={good_model}", f"--run.dir={tmp_path}", "--trainer.max_steps=40"],
                    cases, "warmup", monkeypatch, capsys)


def test_samples_that_may_run_past_the_models_context_get_one_warning(tmp_path, monkeypatch,
                                                                       capsys):
    """data.max_prompt_len + max_new_tokens past the model's max_position_embeddings (64 here, as
    the demo's model) ran without a word, decoding positions the model was never trained at."""
    from tools.make_tiny_model import make_random_model
    short = make_random_model(tmp_path / "model", shape={"max_position_embeddings": 64})
    cases = {("--data.max_prompt_len=60",): "data.max_prompt_len=60 + 8 new tokens = 68 "
                                            "positions, past the model's max_position_embeddings=64",
             ("--generator.max_new_tokens=40",): "data.max_prompt_len=32 + 40 new tokens = 72",
             ("--eval.every_steps=5", "--eval.max_new_tokens=40"): "32 + 40 new tokens = 72",
             ("--eval.every_steps=0", "--eval.max_new_tokens=40"): None,  # no evaluation
             ("--data.max_prompt_len=56",): None, (): None}  # 56 + 8 = 64 fits
    _check_warnings([f"--model.path={short}", f"--run.dir={tmp_path / 'run'}"], cases,
                    "max_position_embeddings", monkeypatch, capsys,
                    also="lower data.max_prompt_len or the max_new_tokens to fit")


def test_a_split_run_resumed_in_colocated_mode_is_told_so_first(tmp_path, good_model, monkeypatch, capsys):
    """It took two refusals: first "set checkpoint.every_steps=0" (colocated has no checkpoints),
    and only with that set the one that matters: this run would resume a split run's checkpoint."""
    from tests.test_checkpoint_dcp import _checkpoints
    run = tmp_path / "run"
    _checkpoints(run / "checkpoints", {2: {}})
    rc, err = _in_this_process(["--config", "configs/tiny_cpu.toml", f"--model.path={good_model}",
                                f"--run.dir={run}", "--parallel.mode=colocated",
                                "--checkpoint.every_steps=2"], "2", monkeypatch, capsys)
    assert rc != 0 and "parallel.mode='colocated' has no checkpoints, but this run would resume " \
                       "from" in err, err
