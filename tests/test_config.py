"""Tests for config.py: defaults, help text, presets, overrides, errors, TOML round trip, resolve()."""
import dataclasses
import itertools
import json
import os
import re
import tomllib
from typing import Literal, Optional

import pytest

import config as C
from config import Config, ConfigError, load_config, parse_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny_cpu.toml")
MULTINODE = os.path.join(REPO, "configs", "example_multinode.toml")
SMOLLM2 = os.path.join(REPO, "configs", "smollm2_135m_arith.toml")


def _write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ---- defaults, help text, presets ------------------------------------------------------------------

def test_defaults_load_and_validate():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.trainer.lr == 1e-5 and cfg.algo.loss == "aipo" and cfg.generator.stop_token_ids == []
    assert cfg.parallel.mode == "split" and cfg.parallel.trainer_fsdp == 0 and cfg.run.dir == ""


def test_every_section_and_field_has_help():
    sections = dataclasses.fields(Config)
    assert [s.name for s in sections] == ["model", "parallel", "generator", "trainer", "algo", "data",
                                          "reward", "eval", "checkpoint", "logging", "run"]
    n = 0
    for s in sections:
        cls = s.default_factory
        assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), f"{cls.__name__} has no docstring"
        for f in dataclasses.fields(cls):
            help_text = f.metadata.get("help", "")
            assert len(help_text) > 5, f"{s.name}.{f.name} has no help text"
            n += 1
    docs = C.field_docs()
    assert len(docs) == n > 70
    assert "learning rate" in docs["trainer.lr"]


def test_default_lists_are_not_shared():
    a, b = Config(), Config()
    a.generator.stop_token_ids.append(7)
    a.data.task_options["digits"] = 3
    assert b.generator.stop_token_ids == [] and b.data.task_options == {}


def test_task_options_table_from_toml_and_json_from_the_command_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\ntask_options = {max_digits = 1, operators = ["+", "-"]}\n')
    cfg = load_config(str(path))
    assert cfg.data.task_options == {"max_digits": 1, "operators": ["+", "-"]}
    cfg = load_config(str(path), ['--data.task_options={"allow_negation": false, "x y": 2.5}'])
    assert cfg.data.task_options == {"allow_negation": False, "x y": 2.5}
    saved = str(tmp_path / "run" / "config.toml")
    cfg.save(saved)
    assert 'task_options = {allow_negation = false, "x y" = 2.5}' in open(saved).read()
    assert load_config(saved) == cfg
    assert load_config(None, ["--data.task_options="]).data.task_options == {}
    # bad values, from the command line or the file; the first two are what a saved config
    # cannot hold again: JSON's null (it came back as ""), a TOML date
    for given, pattern in [
        ('{"tasks": ["a", null]}', r"data.task_options\['tasks'\]\[1\] is null, which a saved "
                                   r"config.toml cannot hold.*leave the key out"),
        ("{start = 1979-05-27}", r"data.task_options\['start'\] is date"),
        ("{digits: 2}", r"data.task_options='\{digits: 2\}' is not a JSON object .*"
                        r"--data.task_options='\{\"digits\":1\}'"),
        ("[1]", r"data.task_options=\[1\] has the wrong type: expected a table \(on the command "
                r"line a JSON object\)"),
        ("3", r"c.toml: data.task_options=3 has the wrong type"),
    ]:
        in_file = given.startswith("{") and "=" in given or given == "3"
        path.write_text(f"[data]\ntask_options = {given}\n")
        with pytest.raises(ConfigError, match=pattern):
            load_config(str(path)) if in_file else load_config(None, [f"--data.task_options={given}"])


def test_tiny_cpu_preset_loads_and_resolves_on_3_ranks():
    cfg = load_config(TINY)
    assert cfg.model.path == "runs/_models/tiny_addition"
    assert (cfg.data.source, cfg.reward.fn, cfg.algo.loss) == ("synthetic:addition", "exact_match", "aipo")
    assert (cfg.generator.n_samples, cfg.trainer.prompts_per_step, cfg.generator.max_new_tokens) == (8, 32, 8)
    assert cfg.trainer.lr == 2e-4 and cfg.algo.max_staleness == 1 and cfg.trainer.max_steps == 800
    assert cfg.algo.kl_coef == 0.2 and cfg.model.ref_path == ""
    r = cfg.resolve(3)
    assert r.model.ref_path == cfg.model.path  # the KL reference is the warm start
    assert (r.parallel.generator_ranks, r.parallel.gen_dp, r.parallel.trainer_fsdp) == (1, 1, 2)
    assert r.algo.buffer_capacity == 32 * 8 * 2  # prompts_per_step * n_samples * (eta + 1)
    assert r.run.dir == os.path.join("runs", "tiny_cpu")


def test_multinode_preset_loads_and_resolves_on_64_ranks():
    r = load_config(MULTINODE).resolve(64)
    p = r.parallel
    assert (p.generator_ranks, p.gen_tp, p.gen_dp, p.trainer_tp, p.trainer_fsdp) == (16, 4, 4, 4, 12)
    assert r.model.gen_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="world_size=3"):
        load_config(MULTINODE).resolve(3)


def test_smollm2_preset_loads_and_resolves_on_3_ranks():
    r = load_config(SMOLLM2).resolve(3)
    assert (r.parallel.generator_ranks, r.parallel.trainer_fsdp) == (1, 2)
    assert r.data.source == "reasoning_gym:basic_arithmetic" and r.data.chat_template
    assert r.data.task_options["max_digits"] == 1 and r.data.task_options["operators"] == ["+", "-"]


# ---- overrides -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [("true", True), ("1", True), ("yes", True), ("On", True),
                                           ("false", False), ("0", False), ("no", False), ("NO", False)])
def test_bool_override_spellings(text, expected):
    assert load_config(None, [f"--parallel.compile={text}"]).parallel.compile is expected


def test_overrides_of_every_field_type():
    cfg = load_config(None, [
        "--trainer.lr=3e-4",                  # float
        "trainer.max_steps=7",                # int, without the leading --
        "--model.path=/m/llama",              # str
        "--generator.stop_token_ids=1, 2,3",  # list[int], comma separated
        "--algo.loss=ppo",                    # Literal
        "--run.dry_run",                      # bare bool key = true
        "--algo.kl_coef=1",                   # int text into a float field
        "--model.ref_path=/m/ref",
    ])
    assert cfg.trainer.lr == 3e-4 and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.max_steps == 7 and cfg.model.path == "/m/llama"
    assert cfg.generator.stop_token_ids == [1, 2, 3]
    assert cfg.algo.loss == "ppo" and cfg.run.dry_run is True
    assert cfg.algo.kl_coef == 1.0 and isinstance(cfg.algo.kl_coef, float)
    assert load_config(None, ["--generator.stop_token_ids="]).generator.stop_token_ids == []
    assert load_config(None, ["--generator.stop_token_ids=[5,6]"]).generator.stop_token_ids == [5, 6]


def test_overrides_beat_the_toml_file_and_later_overrides_win():
    cfg = load_config(TINY, ["--trainer.lr=1e-3", "--trainer.lr=5e-4", "--run.name=x"])
    assert cfg.trainer.lr == 5e-4 and cfg.run.name == "x" and cfg.trainer.max_steps == 800


def test_coerce_list_str_optional_and_literal():
    assert C._coerce("a, b,c", list[str], "k", text=True) == ["a", "b", "c"]
    assert C._coerce(["a", "b"], list[str], "k") == ["a", "b"]
    for none in ("none", "None", "", "null"):
        assert C._coerce(none, Optional[int], "k", text=True) is None
    assert C._coerce("3", Optional[int], "k", text=True) == 3
    assert C._coerce("", Optional[str], "k") is None           # how the TOML writer encodes None
    assert C._coerce(None, int | None, "k") is None
    assert C._coerce("b", Literal["a", "b"], "k", text=True) == "b"
    with pytest.raises(ConfigError, match="k=2 has the wrong type: expected str"):
        C._coerce(["a", 2], list[str], "k")
    with pytest.raises(ConfigError, match="k='x'.*expected int"):
        C._coerce("x", Optional[int], "k", text=True)


# ---- errors ----------------------------------------------------------------------------------------

def test_unknown_key_names_it_and_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--trainer.lrr=1e-5"])
    msg = str(e.value)
    assert "trainer.lrr" in msg and "did you mean 'lr'" in msg
    assert "valid keys of [trainer]: max_steps, prompts_per_step" in msg and "max_nonfinite_steps" in msg
    path = _write(tmp_path, "[generator]\ntemprature = 0.5\n")
    with pytest.raises(ConfigError, match=rf"{path}: unknown key 'generator.temprature'.*valid keys of \[generator\]: num_slots"):
        load_config(path)


def test_unknown_section_lists_valid_sections(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[optim\]; valid sections: model, parallel, generator, trainer"):
        load_config(None, ["--optim.lr=1"])
    path = _write(tmp_path, "[trainr]\nlr = 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown section \[trainr\] \(did you mean 'trainer'\?\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"\[run\] must be a table"):
        load_config(_write(tmp_path, 'run = "x"\n'))


def test_malformed_override_key():
    for bad in ("--lr=1e-5", "--trainer.=1", "--trainer.lr.x=1"):
        with pytest.raises(ConfigError, match="must look like --section.key=value"):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match=r"needs a value: --trainer.max_steps=<int>"):
        load_config(None, ["--trainer.max_steps"])


@pytest.mark.parametrize("item,expected", [
    ("--trainer.lr=abc", "trainer.lr='abc' has the wrong type: expected float"),
    ("--trainer.max_steps=2.5", "trainer.max_steps='2.5' has the wrong type: expected int"),
    ("--parallel.compile=maybe", "parallel.compile='maybe' has the wrong type: expected bool \\(true/false"),
    ("--generator.stop_token_ids=1,x", r"generator.stop_token_ids='x' has the wrong type: expected int"),
])
def test_wrong_type_override_names_key_value_and_type(item, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [item])


@pytest.mark.parametrize("line,expected", [
    ('lr = "x"', "trainer.lr='x' has the wrong type: expected float"),
    ("max_steps = 2.0", "trainer.max_steps=2.0 has the wrong type: expected int"),
    ("max_steps = true", "trainer.max_steps=True has the wrong type: expected int"),
    ('schedule = "linear"', "trainer.schedule='linear' is not a valid choice; choose one of 'constant', 'cosine'"),
])
def test_wrong_type_in_toml_names_file_key_value_and_type(tmp_path, line, expected):
    path = _write(tmp_path, f"[trainer]\n{line}\n")
    with pytest.raises(ConfigError, match=f"{path}: {expected}"):
        load_config(path)


def test_bad_toml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "[trainer]\nlr = 1e-5\nmax_steps = = 3\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: invalid TOML"):
        load_config(path)


def test_missing_file_names_path():
    with pytest.raises(ConfigError, match="config file not found: configs/nope.toml"):
        load_config("configs/nope.toml")


@pytest.mark.parametrize("item,expected", [
    ("--trainer.lr=-1e-5", r"trainer.lr=-1e-05 is invalid: it must be > 0 \(set --trainer.lr=<value > 0>\)"),
    ("--generator.temperature=-0.1", "generator.temperature=-0.1 is invalid: it must be >= 0"),
    ("--generator.top_p=0", "generator.top_p=0.0 is invalid: it must be > 0"),
    ("--generator.top_p=1.5", "generator.top_p=1.5 is invalid: it must be <= 1"),
    ("--algo.rho=0.5", "algo.rho=0.5 is invalid: it must be >= 1"),
    ("--trainer.beta2=1", "trainer.beta2=1.0 is invalid: it must be < 1"),
    ("--parallel.timeout_s=inf", r"parallel.timeout_s=inf is invalid: a timeout must be a finite "
                                 r"number of seconds \(set --parallel.timeout_s=<seconds>, e.g. 300.0\)"),
    ("--reward.timeout_s=inf", "reward.timeout_s=inf is invalid: a timeout must be a finite"),
    ("--parallel.gen_tp=0", "parallel.gen_tp=0 is invalid: it must be >= 1"),
    ("--algo.loss=foo", r"algo.loss='foo' is not a valid choice; choose one of 'aipo', 'ppo', 'decoupled_ppo'"),
    ("--parallel.mode=hybrid", "choose one of 'split', 'colocated'"),
    ("--logging.log_rank=zero", "logging.log_rank='zero' is invalid: use 'all' or comma-separated"),
    # runs/ itself (or a folder outside it): config.toml, checkpoints and COMPLETE in the folder
    # every run shares
    ("--run.name=", r"run.name='' is invalid: .* would be 'runs', not a folder of its own"),
    ("--run.name=.", r"run.name='.' is invalid: .* would be 'runs'"),
    ("--run.name=..", r"run.name='..' is invalid: .* would be '.'"),
    ("--run.name=../x", r"run.name='../x' is invalid: .* would be 'x'"),
])
def test_invalid_values_name_value_and_fix(item, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [item])


def test_cross_field_rules():
    with pytest.raises(ConfigError, match=r"rloo' needs generator.n_samples >= 2, got 1.*--generator.n_samples"):
        load_config(None, ["--algo.advantage=rloo", "--generator.n_samples=1"])
    with pytest.raises(ConfigError, match=r"buffer_capacity=10 cannot hold.*8\*4\*2 = 64 samples.*>= 64"):
        load_config(None, ["--algo.buffer_capacity=10"])
    # one step is not enough: the staleness gate lets the generators deliver max_staleness + 1
    # steps before the trainer takes a batch (trainer/worker.py puts them in from its own thread)
    with pytest.raises(ConfigError, match=r"buffer_capacity=32 cannot hold.*8\*4\*3 = 96 samples"):
        load_config(None, ["--algo.buffer_capacity=32", "--algo.max_staleness=2"])
    assert load_config(None, ["--algo.buffer_capacity=96", "--algo.max_staleness=2"])
    # colocated mode generates each step on-policy, with no buffer: one step is its bound
    with pytest.raises(ConfigError, match=r"buffer_capacity=10 cannot hold.*8\*4 = 32 samples"):
        load_config(None, ["--algo.buffer_capacity=10", "--parallel.mode=colocated"])
    assert load_config(None, ["--algo.buffer_capacity=32", "--parallel.mode=colocated"])
    with pytest.raises(ConfigError, match=r"compute_dtype='float32' cannot compute wider.*"
                                          r"model.dtype='bfloat16'.*--model.dtype=float32"):
        load_config(None, ["--model.dtype=bfloat16", "--model.compute_dtype=float32"])
    with pytest.raises(ConfigError, match=r"model.compute_dtype='fp16' is not a valid choice"):
        load_config(None, ["--model.compute_dtype=fp16"])
    # compiled TP layers pad to static token counts (tests/test_parallel.py); refused before
    assert load_config(None, ["--parallel.compile=true", "--parallel.trainer_tp=2"]).parallel.compile
    load_config(None, ["--parallel.compile=true", "--parallel.gen_tp=2"])  # the trainer's layers only
    assert load_config(None, ["--logging.log_rank=0, 4"]).logging.log_rank == "0, 4"
    assert load_config(None, ["--logging.log_rank=all"]).logging.log_rank == "all"
    # a rank the job lacks: nothing on the console, exit 0
    with pytest.raises(ConfigError, match=r"logging.log_rank='0, 4' names rank\(s\) 4, which this "
                                          r"job of 3 ranks lacks.*ranks 0..2"):
        load_config(None, ["--logging.log_rank=0, 4"]).resolve(3)
    assert load_config(None, ["--logging.log_rank=0, 4"]).resolve(5)
    assert load_config(None, ["--run.name=sweep1/lr-1e-4"]).resolve(3).run.dir == "runs/sweep1/lr-1e-4"
    assert load_config(None, ["--run.name=", "--run.dir=/tmp/r"]).resolve(3).run.dir == "/tmp/r"
    # token IS weights only PPO's clipped ratio; AIPO and decoupled PPO ignored it silently
    with pytest.raises(ConfigError, match=r"algo.token_is='mask' applies to algo.loss='ppo' only; "
                                          r"algo.loss='aipo'.*--algo.token_is=none"):
        load_config(None, ["--algo.token_is=mask"])
    load_config(None, ["--algo.token_is=mask", "--algo.loss=ppo"])
    # one prompt group for two data-parallel trainer ranks: one raised, the other waited in FSDP
    with pytest.raises(ConfigError, match=r"prompts_per_step=1 leaves some of the "
                                          r"parallel.trainer_fsdp=2 .*>= 2"):
        load_config(None, ["--trainer.prompts_per_step=1", "--parallel.generator_ranks=1"]).resolve(3)
    load_config(None, ["--trainer.prompts_per_step=2", "--parallel.generator_ranks=1"]).resolve(3)
    with pytest.raises(ConfigError, match=r"prompts_per_step=1 leaves some of the "
                                          r"parallel.gen_dp=2 generator replicas.*>= 2"):
        load_config(None, ["--trainer.prompts_per_step=1", "--parallel.generator_ranks=2"]).resolve(3)
    with pytest.raises(ConfigError, match=r"prompts_per_step=3 leaves .*trainer.updates_per_step=2 "
                                          r"updates; set --trainer.prompts_per_step to >= 4"):
        load_config(None, ["--trainer.prompts_per_step=3", "--trainer.updates_per_step=2",
                           "--parallel.generator_ranks=1"]).resolve(3)


def test_validate_catches_hand_built_bad_values():
    cfg = Config()
    cfg.algo.kl_estimator = "k4"
    with pytest.raises(ConfigError, match="algo.kl_estimator='k4' is not a valid choice"):
        cfg.validate()
    cfg = Config()
    cfg.trainer.max_steps = "10"
    with pytest.raises(ConfigError, match="trainer.max_steps='10' has the wrong type"):
        cfg.resolve(3)


# ---- TOML round trip -------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    cfg = load_config(TINY, ["--generator.stop_token_ids=2,7", "--run.name=we\"ird\\name\tä",
                             "--trainer.lr=3.3e-7", "--parallel.timeout_s=1e30"])
    path = str(tmp_path / "run" / "config.toml")
    for c in (cfg, cfg.resolve(3)):
        c.save(path)
        assert load_config(path).resolve(3) == c.resolve(3)
        assert Config.from_dict(c.to_dict()) == c
    cfg.save(path)
    assert load_config(path) == cfg
    assert not [p for p in os.listdir(tmp_path / "run") if ".tmp" in p]


def test_a_saved_config_derives_its_derived_keys_again(tmp_path):
    """The run's saved config.toml, used as the base of another run, pinned the first run's
    folder (a sweep from it found "already completed" and trained nothing), its layout and its
    buffer size: the keys resolve derives are saved as given, their values in comments."""
    r = load_config(TINY, ["--run.name=first"]).resolve(3)
    path = str(tmp_path / "config.toml")
    r.save(path)
    text = open(path).read()
    assert f'# derived for this run: "{os.path.join("runs", "first")}"\ndir = ""' in text
    again = load_config(path, ["--run.name=second", "--algo.max_staleness=4"]).resolve(5)
    assert again.run.dir == os.path.join("runs", "second")
    t, g = again.trainer, again.generator
    assert again.algo.buffer_capacity == t.prompts_per_step * g.n_samples * 5
    assert again.parallel.trainer_fsdp == 5 - again.parallel.generator_ranks
    assert load_config(path).resolve(3) == r  # and it reproduces the run itself
    given = load_config(TINY, ["--run.dir=/tmp/x", "--parallel.trainer_fsdp=2"]).resolve(3)
    given.save(path)
    assert 'dir = "/tmp/x"' in open(path).read() and load_config(path).parallel.trainer_fsdp == 2


def test_saved_file_is_commented_and_none_is_empty_string(tmp_path):
    text = Config().to_toml()
    assert "[trainer]\n# Optimizer steps" in text and "# Peak AdamW learning rate.\nlr = 1e-05\n" in text
    assert C._toml_value(None) == '""' and C._toml_value([]) == "[]" and C._toml_value(True) == "true"
    value = tomllib.loads(f"x = {C._toml_value(None)}\n")["x"]
    assert C._coerce(value, Optional[float], "x") is None


def test_from_dict_names_source():
    with pytest.raises(ConfigError, match=r"^my-source: trainer.lr='x'"):
        Config.from_dict({"trainer": {"lr": "x"}}, source="my-source")


# ---- resolve ---------------------------------------------------------------------------------------

def test_resolve_split_derives_and_is_idempotent():
    cfg = load_config(None, ["--parallel.generator_ranks=4", "--parallel.gen_tp=2", "--parallel.trainer_tp=2",
                             "--algo.max_staleness=0"])
    r = cfg.resolve(16)
    p = r.parallel
    assert (p.gen_dp, p.trainer_fsdp) == (2, 6)
    assert r.algo.buffer_capacity == 8 * 4 * 1 and r.run.dir == os.path.join("runs", "tandem")
    assert cfg.parallel.gen_dp == 0, "resolve must not mutate its input"
    assert r.resolve(16) == r


def test_run_seed_is_added_to_every_section_seed_once(tmp_path):
    """run.seed (a sweep's one key) moves the data, generator and trainer seeds; the resolved
    config holds the sums, so resolving again, or rerunning its saved TOML, changes nothing."""
    base = load_config(None, ["--data.seed=3", "--generator.seed=5"]).resolve(3)
    r = load_config(None, ["--data.seed=3", "--generator.seed=5", "--run.seed=7"]).resolve(3)
    assert (r.data.seed, r.generator.seed, r.trainer.seed) == (10, 12, 7)
    assert (base.data.seed, base.generator.seed, base.trainer.seed) == (3, 5, 0)
    assert r.run.seed == 0 and r.resolve(3) == r
    r.save(str(tmp_path / "config.toml"))
    assert load_config(str(tmp_path / "config.toml")).resolve(3) == r


def test_resolve_colocated_and_explicit_values_are_kept():
    r = load_config(None, ["--parallel.mode=colocated", "--parallel.gen_tp=2", "--parallel.trainer_tp=4",
                           "--run.dir=/tmp/x", "--algo.buffer_capacity=100"]).resolve(8)
    p = r.parallel
    assert (p.generator_ranks, p.gen_dp, p.trainer_fsdp) == (8, 4, 2)
    assert r.run.dir == "/tmp/x" and r.algo.buffer_capacity == 100
    assert r.resolve(8) == r
    r = load_config(None, ["--parallel.generator_ranks=2", "--parallel.gen_dp=2", "--parallel.trainer_fsdp=4"]).resolve(6)
    assert (r.parallel.gen_dp, r.parallel.trainer_fsdp) == (2, 4)


def test_stacking_every_projection_is_refused_with_generator_tp_before_the_run():
    """The engine cannot stack tensor-parallel shards: stack_weights='all' with gen_tp > 1 failed
    only once each generator had built its model; resolve names it with the two fixes."""
    with pytest.raises(ConfigError, match=r"stack_weights='all'.*gen_tp=2.*stack_weights=auto.*gen_tp=1"):
        load_config(None, ["--parallel.generator_ranks=2", "--parallel.gen_tp=2",
                           "--generator.stack_weights=all"]).resolve(4)
    for item in ("--generator.stack_weights=auto", "--parallel.gen_tp=1"):
        load_config(None, ["--parallel.generator_ranks=2", "--parallel.gen_tp=2",
                           "--generator.stack_weights=all", item]).resolve(4)


@pytest.mark.parametrize("world,overrides,expected", [
    (1, [], r"world_size=1 .*split mode needs 1 <= generator_ranks < world_size.*launch at least 2 ranks"),
    (4, ["--parallel.generator_ranks=4"], r"generator_ranks=4.*set --parallel.generator_ranks to one of \[1, 2, 3\]"),
    (4, ["--parallel.generator_ranks=0"], r"generator_ranks=0.*--parallel.mode=colocated"),
    (4, ["--parallel.generator_ranks=2", "--parallel.gen_tp=4"],
     r"gen_tp=4 does not divide the 2 generator ranks. Fix: set --parallel.gen_tp to one of \[1, 2\]"),
    (8, ["--parallel.generator_ranks=2", "--parallel.trainer_tp=4"],
     r"trainer_tp=4 does not divide the 6 trainer ranks.*one of \[1, 2, 3, 6\]; or instead set "
     r"--parallel.generator_ranks=4"),
    (8, ["--parallel.generator_ranks=2", "--parallel.trainer_fsdp=4"],
     r"trainer_tp\*trainer_fsdp = 1\*4 != 6 trainer ranks. Fix: set --parallel.trainer_fsdp=6 .*; or "
     r"instead launch 6 ranks, the world these degrees describe$"),
    # every degree given (a plan's config) on another world: the launch first
    (100, ["--parallel.generator_ranks=512", "--parallel.gen_tp=2", "--parallel.gen_dp=256",
           "--parallel.trainer_tp=4", "--parallel.trainer_fsdp=128"],
     r"Fix: launch 1024 ranks, the world these degrees describe; or instead set"),
    (6, ["--parallel.generator_ranks=2", "--parallel.gen_dp=1"], r"gen_tp\*gen_dp = 1\*1 != 2 generator ranks"),
    (8, ["--parallel.mode=colocated", "--parallel.gen_tp=3"], r"mode='colocated'.*gen_tp=3 does not divide the 8"),
    (8, ["--parallel.mode=colocated", "--parallel.trainer_tp=2", "--parallel.trainer_fsdp=2"],
     r"trainer_tp\*trainer_fsdp = 2\*2 != 8 trainer ranks"),
])
def test_resolve_layout_errors_print_every_factor_and_fix(world, overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides).resolve(world)
    msg = str(e.value)
    assert f"world_size={world}" in msg and "Fix:" in msg
    for factor in ("generator_ranks=", "gen_tp=", "gen_dp=", "trainer_tp=", "trainer_fsdp="):
        assert factor in msg
    assert re.search(expected, msg), msg


# ---- parse_cli -------------------------------------------------------------------------------------

def test_parse_cli_splits_config_overrides_and_flags():
    path, overrides, flags = parse_cli(["--config", "configs/tiny_cpu.toml", "--trainer.lr=1e-5",
                                        "--generator.top_p", "0.9", "--trainer.lr", "-1", "--run.dry_run",
                                        "--dry-run", "--log-level=debug"])
    assert path == "configs/tiny_cpu.toml"
    assert overrides == ["trainer.lr=1e-5", "generator.top_p=0.9", "trainer.lr=-1", "run.dry_run"]
    assert flags == {"dry_run": True, "log_level": "debug"}
    assert parse_cli(["--config=a.toml"]) == ("a.toml", [], {})
    assert parse_cli([]) == (None, [], {})
    cfg = load_config(path, overrides[:2])
    assert cfg.generator.top_p == 0.9


def test_parse_cli_errors():
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        parse_cli(["stray"])
    with pytest.raises(ConfigError, match="--config needs a file"):
        parse_cli(["--config"])


def test_help_text_lists_every_key_with_its_type_and_default():
    text = C.help_text()
    for key, doc in C.field_docs().items():
        assert f"--{key}  (" in text and doc in text, key
    assert "--trainer.max_steps  (int, default " in text
    assert "--algo.loss  (one of 'aipo', 'ppo', 'decoupled_ppo', default \"aipo\")" in text
    algo = C.help_text("algo")
    assert "--algo.loss" in algo and "--trainer." not in algo and algo.startswith("[algo]")
    with pytest.raises(C.ConfigError, match="did you mean 'trainer'"):
        C.help_text("trainr")


@pytest.mark.parametrize("argv, words, rc", [
    (["--help"], ["usage: torchrun", "--parallel.generator_ranks", "--logging."], 0),
    (["-h", "generator"], ["usage: torchrun", "--generator.temperature"], 0),
    (["--config", "configs/tiny_cpu.toml", "--help=reward"], ["--reward.fn"], 0),
    (["--help", "nosuch"], ["unknown section [nosuch]"], 2),
])
def test_train_rl_help_exits_cleanly(argv, words, rc):
    """`train_rl.py --help` on a fresh checkout: no process group, no config needed."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "train_rl.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == rc, proc.stderr
    out = proc.stdout + proc.stderr
    for w in words:
        assert w in out, (w, out[-500:])
    assert "Traceback" not in out


def test_kl_reference_defaults_to_the_starting_policy():
    """algo.kl_coef > 0 with no model.ref_path: KL to model.path; an explicit ref_path is kept;
    without KL no reference is named."""
    start = ["--model.path=/m/start"]
    assert load_config(None, [*start, "--algo.kl_coef=0.1"]).resolve(3).model.ref_path == "/m/start"
    assert load_config(None, [*start, "--algo.kl_coef=0.1", "--model.ref_path=/m/ref"]
                       ).resolve(3).model.ref_path == "/m/ref"
    assert load_config(None, start).resolve(3).model.ref_path == ""


def test_log_rank_selects_the_ranks_that_print():
    from config import prints
    assert prints("all", 7) and prints("0", 0) and not prints("0", 1)
    assert prints("0, 4", 4) and not prints("0,4", 40) and not prints("10", 1)


def test_train_rl_help_into_a_closed_pipe_exits_quietly():
    """`python train_rl.py --help | head` printed BrokenPipeError tracebacks: the generic except
    in main caught it. The pipe's read end is closed before the program starts, so every write
    fails, whatever the timing."""
    import subprocess
    import sys
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "train_rl.py", "--help"], cwd=REPO, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 141, proc.stderr  # 128 + SIGPIPE, as `yes | head`


# ---- help strings that name choices, examples and measurements --------------------------------------

def _help(key: str) -> str:
    return C.field_docs()[key]


def test_task_options_examples_work_on_the_default_source():
    """The help's example ({max_digits = 1}) and the JSON error's suggestion failed on the
    default source, synthetic:addition, which takes `digits`."""
    from rollout.data import load_prompts, task_options
    example = re.search(r"e\.g\. (\{.*?\})", _help("data.task_options")).group(1)
    options = tomllib.loads(f"x = {example}")["x"]
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--data.task_options={digits: 1}"])
    suggested = re.search(r"write it as (--data\.task_options=\S+)", str(e.value)).group(1)
    for given in (load_config(None, [f"--data.task_options={json.dumps(options)}"]),
                  load_config(None, [suggested.replace("'", "")])):
        assert given.data.source == C.DataConfig().source  # the default source
        assert load_prompts(given.data.source, num_prompts=2, **task_options(given.data))


def test_reward_fn_help_lists_every_builtin():
    from rollout.rewards import BUILTIN_REWARDS
    for name in BUILTIN_REWARDS:
        assert f"'{name}'" in _help("reward.fn"), name


def test_compiled_cpu_decode_speedup_is_the_same_in_help_and_readme():
    readme = open(os.path.join(REPO, "README.md")).read()
    in_readme = re.search(r"on CPU (\d\.\d+-\d\.\d+)x\s+eager", readme).group(1)
    in_help = re.search(r"on CPU .*?(\d\.\d+-\d\.\d+)x", _help("generator.decode")).group(1)
    assert in_help == in_readme


def test_example_1024_header_quotes_the_planner(capsys):
    """The header's prediction is what its own planner command prints now (the cost model
    changes: it once quoted T_train 7.6 s and 1.17x after the model had moved on)."""
    from launch import plan
    header = open(os.path.join(REPO, "configs", "example_1024.toml")).read().split("\n\n")[0]
    text = " ".join(line.lstrip("#").strip() for line in header.splitlines())
    command = re.search(r"python launch/plan\.py (.*?) picks", text).group(1).replace("\\", " ")
    quoted = re.search(r"picks (G=.*?) \(predicted: T_gen ([\d.]+) s, T_train ([\d.]+) s, T_sync "
                       r"([\d.]+) s, async step ([\d.]+) s, ([\d.]+x) the best", text).groups()
    assert plan.main(command.split()) == 0
    best = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(" 1 "))
    placement, rest = best[3:].split("  ", 1)
    t_gen, t_train, t_sync, step, ratio = rest.split()[:5]
    assert (placement.strip(), *(f"{float(x):.1f}" for x in (t_gen, t_train, t_sync, step)), ratio) \
        == quoted


# ---- layout errors: every fix they suggest resolves -------------------------------------------------

def _suggested_fixes(message: str) -> list[list[str]]:
    """The alternatives after 'Fix: ' as override lists: 'set --parallel.k to one of [a, b]' is
    one alternative per value; '... and --parallel.k2=v' changes both keys at once."""
    fixes = []
    for alternative in message.split("Fix: ", 1)[1].split("; or instead "):
        choices = [[f"--parallel.{key}={value}"] if value else
                   [f"--parallel.{key}={v.strip()}" for v in values.split(",")]
                   for key, value, values in re.findall(
                       r"--parallel\.(\w+)(?:=(\w+)| to one of \[([^\]]*)\])", alternative)]
        fixes += [list(fix) for fix in itertools.product(*choices)] if choices else []
    return fixes


ROOMY = ["--trainer.prompts_per_step=1024"]  # enough groups for any layout's data-parallel ranks


@pytest.mark.parametrize("world, overrides", [
    (4, ["--parallel.trainer_tp=2"]),  # it once suggested trainer_tp 3 "or" generator_ranks=2 ...
    (4, ["--parallel.trainer_tp=3", "--parallel.generator_ranks=2"]),  # ... and then 1 or 2
    (1, []),
    (4, ["--parallel.generator_ranks=4"]),
    (4, ["--parallel.generator_ranks=4", "--parallel.trainer_tp=2"]),  # 1..3 were not all valid
    (4, ["--parallel.generator_ranks=0"]),
    (4, ["--parallel.generator_ranks=2", "--parallel.gen_tp=4"]),
    (8, ["--parallel.generator_ranks=2", "--parallel.trainer_tp=4"]),
    (8, ["--parallel.generator_ranks=2", "--parallel.trainer_fsdp=4"]),
    (8, ["--parallel.generator_ranks=2", "--parallel.trainer_tp=4", "--parallel.trainer_fsdp=2"]),
    (6, ["--parallel.generator_ranks=2", "--parallel.gen_dp=1"]),
    (8, ["--parallel.generator_ranks=4", "--parallel.gen_tp=3", "--parallel.trainer_tp=3"]),  # no one change
    (8, ["--parallel.mode=colocated", "--parallel.gen_tp=3"]),
    (8, ["--parallel.mode=colocated", "--parallel.trainer_tp=2", "--parallel.trainer_fsdp=2"]),
    (1024, ["--parallel.generator_ranks=500", "--parallel.gen_tp=8", "--parallel.trainer_tp=8"]),
])
def test_each_suggested_layout_fix_resolves(world, overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*ROOMY, *overrides]).resolve(world)
    fixes = _suggested_fixes(str(e.value))
    assert fixes, str(e.value)
    for fix in fixes:
        load_config(None, [*ROOMY, *overrides, *fix]).resolve(world)  # raises if the fix is wrong


def test_layout_fixes_respect_the_models_head_counts(tmp_path):
    """The audit's loop on the tiny demo model (4 heads, 2 KV heads) at world 4: trainer_tp=2
    suggested trainer_tp=3, which start-up then refused for the heads ("pick trainer_tp from
    [1, 2]"), and trainer_tp=2 again suggested 3. A readable model folder limits the suggestions
    to degrees its heads and MLP split evenly."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 384}))
    given = [*ROOMY, f"--model.path={model}", "--parallel.trainer_tp=2"]
    with pytest.raises(ConfigError) as e:
        load_config(None, given).resolve(4)
    fixes = _suggested_fixes(str(e.value))
    assert sorted(fixes) == [["--parallel.generator_ranks=2"], ["--parallel.trainer_tp=1"]], str(e.value)
    for fix in fixes:
        p = load_config(None, [*given, *fix]).resolve(4).parallel
        assert all(n % tp == 0 for tp in (p.gen_tp, p.trainer_tp) for n in (4, 2, 384))
    # degrees that describe another world are suggested as a launch only where the model takes
    # them (trainer_tp=3 at 4 ranks resolved, and start-up then refused it for the heads)
    with pytest.raises(ConfigError) as e:
        load_config(None, [*ROOMY, f"--model.path={model}", "--parallel.trainer_tp=3",
                           "--parallel.trainer_fsdp=1"]).resolve(3)
    assert "launch 4 ranks" not in str(e.value) and "set --parallel.trainer_tp=2" in str(e.value)


def test_dual_clip_is_off_by_default_and_checked_against_the_loss_and_clip_eps():
    """algo.dual_clip_c: 0 (off) by default, the references' PPO; with a PPO loss it must exceed
    1 + clip_eps (at or below it, A < 0 tokens inside the clip range lost their gradient), and
    AIPO refuses it (its weight is capped at rho: it did nothing there)."""
    assert Config().algo.dual_clip_c == 0.0 and "verl's clip_ratio_c" in _help("algo.dual_clip_c")
    for loss in ("ppo", "decoupled_ppo"):
        cfg = load_config(None, [f"--algo.loss={loss}", "--algo.dual_clip_c=3"])
        assert cfg.algo.dual_clip_c == 3.0
    with pytest.raises(ConfigError, match=r"algo.dual_clip_c=3.0 applies to algo.loss='ppo' and "
                                          r"'decoupled_ppo'.*--algo.dual_clip_c=0, or "
                                          r"--algo.loss=ppo"):
        load_config(None, ["--algo.dual_clip_c=3"])
    with pytest.raises(ConfigError, match=r"algo.dual_clip_c=1.2 must exceed 1 \+ "
                                          r"algo.clip_eps = 1.2.*--algo.dual_clip_c=3"):
        load_config(None, ["--algo.loss=ppo", "--algo.dual_clip_c=1.2"])
    load_config(None, ["--algo.loss=ppo", "--algo.dual_clip_c=1.2", "--algo.clip_eps=0.1"])
    with pytest.raises(ConfigError, match=r"algo.dual_clip_c=-1.0 is invalid: it must be >= 0"):
        load_config(None, ["--algo.loss=ppo", "--algo.dual_clip_c=-1"])


# ---- help strings checked against what the code does ----------------------------------------------

def test_model_path_help_says_a_run_needs_one_and_a_dry_run_takes_a_preset():
    """The help said "'' = none", but every run refuses an empty model.path at start-up; a dry
    run takes a shape preset instead, which the help did not say."""
    from launch.dry_run import model_shape
    from launch.preflight import _check_model_folder
    text = _help("model.path")
    assert "'' = none" not in text and "refuses the default ''" in text
    with pytest.raises(ConfigError, match="model.path is empty"):
        _check_model_folder(Config())
    preset = re.search(r"e\.g\. '(preset:[\w.-]+)'", text).group(1)
    args, is_preset = model_shape(load_config(None, [f"--model.path={preset}"]))
    assert is_preset and args.num_layers > 0


def test_attn_backend_help_names_every_reason_flash_is_refused():
    """'flash' is refused in fp32 too (flash-attn runs in fp16/bf16 only); the help named only
    a missing flash-attn or CUDA."""
    import torch
    from model.attention import check_backend
    with pytest.raises(ValueError, match="compute dtype float32"):
        check_backend("flash", "cuda", torch.float32)
    assert "fp32 (model.compute_dtype)" in _help("model.attn_backend")


def test_synthetic_digits_help_names_every_synthetic_task_it_sets():
    """data.synthetic_digits sets every synthetic task's `digits` (synthetic:reverse's string
    length too, in place of its own default 4); the help said "of synthetic arithmetic tasks"."""
    from rollout.data import load_prompts, task_options
    from rollout.tasks import TASKS
    for name in TASKS:
        cfg = load_config(None, [f"--data.source=synthetic:{name}", "--data.synthetic_digits=6"])
        assert task_options(cfg.data) == {"digits": 6}
        assert load_prompts(cfg.data.source, num_prompts=1, **task_options(cfg.data))
        assert f"synthetic:{name}" in _help("data.synthetic_digits"), name
    reverse = load_prompts("synthetic:reverse", num_prompts=1, **task_options(
        load_config(None, ["--data.source=synthetic:reverse"]).data))[0]
    assert len(reverse.answer) == C.DataConfig().synthetic_digits == 2  # not ReverseTask's 4


def test_num_prompts_help_gives_each_sources_size_at_0():
    """data.num_prompts=0 loads 10000 items of a synthetic task and 1000 of a reasoning_gym one;
    the help said "all (synthetic: its default size)"."""
    from rollout.data import REASONING_GYM_DEFAULT_SIZE, SYNTHETIC_DEFAULT_SIZE, load_prompts
    text = _help("data.num_prompts")
    assert f"{SYNTHETIC_DEFAULT_SIZE} items of a synthetic task" in text
    assert f"{REASONING_GYM_DEFAULT_SIZE} of a reasoning_gym task" in text
    assert len(load_prompts("synthetic:addition", num_prompts=0)) == SYNTHETIC_DEFAULT_SIZE


def test_prox_cap_help_says_tokens_above_it_are_dropped_not_truncated():
    """decoupled_ppo_loss drops a token whose pi_prox/mu exceeds prox_cap (no loss, no gradient);
    the help called it a "cap on the ... IS weight", which reads as min(weight, cap)."""
    import torch
    from trainer.losses import decoupled_ppo_loss
    logp = torch.tensor([0.5, 0.5]).log().requires_grad_()
    mu = torch.tensor([0.25, 0.05]).log()  # behaviour weights 2 and 10
    out = decoupled_ppo_loss(logp, logp.detach(), mu, torch.ones(2), torch.ones(2, dtype=torch.bool),
                             eps=0.2, prox_cap=5.0)
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-2.0)  # weight 10 neither truncated to 5 nor kept
    assert logp.grad.tolist() == pytest.approx([-2.0, 0.0]) and int(out.tokens) == 2
    text = _help("algo.prox_cap")
    assert "dropped from the loss, not truncated" in text and "cap on" not in text


def test_clip_eps_help_names_every_loss_whose_clip_waits_for_a_second_update():
    """PPO with token IS clips around pi_old, the policy before the step's updates, as
    decoupled PPO clips around pi_prox: with one update a step neither clips anything, while
    naive PPO clips around mu. The help named decoupled PPO only."""
    import torch
    from types import SimpleNamespace
    from trainer.step import _loss
    logp = torch.tensor([-0.1, -3.0, -1.0]).requires_grad_()
    batch = SimpleNamespace(loss_mask_N=torch.ones(3, dtype=torch.bool),
                            logp_mu_N=torch.tensor([-2.0, -0.5, -1.0]), adv_N=torch.tensor([1., -1., 1.]))
    inert = []
    for loss, token_is in (("ppo", "none"), ("ppo", "truncate"), ("ppo", "mask"), ("decoupled_ppo", "none")):
        acfg = load_config(None, [f"--algo.loss={loss}", f"--algo.token_is={token_is}"]).algo
        if int(_loss(acfg, logp, batch).clipped_count) == 0:  # one update: logp_prox is None
            inert.append((loss, token_is))
    assert inert == [("ppo", "truncate"), ("ppo", "mask"), ("decoupled_ppo", "none")]
    text = _help("algo.clip_eps")
    assert "for decoupled PPO and for PPO with algo.token_is" in text
    assert "inert with trainer.updates_per_step=1" in text


def test_stack_weights_help_matches_the_engines_choice_on_an_eager_cpu_step():
    """'qkv' stacks q|k|v only where 'auto' stacks (CUDA, the compiled step), so on an eager
    CPU step it stacks nothing, while 'all' stacks there too; the help read "'qkv' = q|k|v
    only" as if it forced them."""
    import torch
    from model import ModelArgs, Transformer
    from rollout.engine import Engine
    model = Transformer(ModelArgs(vocab_size=31, hidden_size=16, intermediate_size=24, num_layers=1,
                                  num_heads=2, num_kv_heads=1))
    model.init_weights(seed=0)
    made = {c: Engine(model, num_slots=2, max_len=16, stack_weights=c, pack_weights=False,
                      device=torch.device("cpu")).stacked_weights
            for c in ("qkv", True, None)}
    assert made["qkv"] is None and made[None] is None and made[True] is not None
    text = _help("generator.stack_weights")
    assert "'qkv' = q|k|v only, where 'auto' stacks" in text and "'all' = both, wherever" in text


def test_pack_weights_help_names_what_the_engine_packs_and_where():
    """The engine packs bf16 linears too (where oneDNN has the kernels), and only in the eager
    CPU step: 'on' is refused for the compiled step. The help said "the large fp32 linears"."""
    import torch
    from model import ModelArgs, Transformer
    from rollout import packed_linear
    from rollout.engine import _packed_linears
    text = _help("generator.pack_weights")
    assert "bf16" in text and "eager decode" in text and "'on' fails there" in text
    model = Transformer(ModelArgs(vocab_size=31, hidden_size=16, intermediate_size=24, num_layers=1,
                                  num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="needs an eager CPU engine"):
        _packed_linears(model, torch.device("cpu"), True, compiled=True)
    if packed_linear.available() and torch.bfloat16 in packed_linear.packed_dtypes():
        assert _packed_linears(model.to(torch.bfloat16), torch.device("cpu"), True, compiled=False).modules


def test_max_nonfinite_steps_help_says_what_0_does():
    """0 aborts at the first skipped step, as 1 does (0 reads as "off" elsewhere in this config:
    grad_clip, kl_coef, every_steps); the help did not say."""
    from trainer.step import NonFiniteGuard, StepResult
    for k in (0, 1):
        with pytest.raises(FloatingPointError, match="1 trainer steps in a row"):
            NonFiniteGuard(k).check(StepResult({}, float("nan"), skipped=True, lr=0.0))
    assert "0 and 1 both abort at the first" in _help("trainer.max_nonfinite_steps")


def test_dry_run_help_says_what_a_dry_run_does(capsys):
    """run.dry_run said "Build everything"; a dry run creates no process group and builds no
    model (a 1024-rank config is checked on one CPU process)."""
    import torch.distributed as dist
    import train_rl
    assert "Build everything" not in _help("run.dry_run")
    assert "no process group is created and no model is built" in _help("run.dry_run")
    assert train_rl.main(["--dry-run", "--config", os.path.join(REPO, "configs", "example_1024.toml")]) == 0
    assert "dry run ok" in capsys.readouterr().out and not dist.is_initialized()


def test_num_slots_help_says_which_decode_steps_compute_every_slot():
    """Only eager decode on CPU compacts away the free slots; the compiled step on CPU computes
    every slot, as CUDA does. The help (and the README) said "on CPU only the filled ones"."""
    from model import ModelArgs, Transformer
    from rollout.engine import Engine
    model = Transformer(ModelArgs(vocab_size=31, hidden_size=16, intermediate_size=24, num_layers=1,
                                  num_heads=2, num_kv_heads=1))
    model.init_weights(seed=0)
    rows = {mode: Engine(model, num_slots=4, max_len=16, compile_decode=mode,
                         pack_weights=False)._decode_key()[-1] for mode in (False, "compile")}
    assert rows == {False: 1, "compile": 4}  # idle: the eager step computes one row, not four
    assert "eager decode on CPU computes only the filled ones" in _help("generator.num_slots")
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "idle rows compacted away in eager CPU decode" in readme


def test_warmup_timeout_help_says_start_up_takes_the_longer_of_the_two():
    """The start-up, first-step and end waits take max(timeout_s, warmup_timeout_s)
    (config.warmup_budget_s): a warmup_timeout_s below timeout_s does not shorten them, which
    the help did not say."""
    p = load_config(None, ["--parallel.timeout_s=600", "--parallel.warmup_timeout_s=60"]).parallel
    assert C.warmup_budget_s(p) == 600
    assert "the longer of this and timeout_s" in _help("parallel.warmup_timeout_s")


def test_temperature_help_says_greedy_log_probs_still_use_it():
    """Greedy decoding ignores the temperature for the tokens, but the engine records mu at it
    and the trainer takes its log-probs at it (trainer.step.trainer_temperature); the help said
    "ignored when greedy"."""
    from model import ModelArgs, Transformer
    from rollout.engine import Engine, Request, SamplingParams
    from trainer.step import trainer_temperature
    model = Transformer(ModelArgs(vocab_size=31, hidden_size=16, intermediate_size=24, num_layers=1,
                                  num_heads=2, num_kv_heads=1))
    model.init_weights(seed=0)
    done = {}
    for t in (1.0, 0.5, 0.0):
        params = SamplingParams(max_new_tokens=4, greedy=True, temperature=t, ignore_eos=True)
        done[t] = Engine(model, num_slots=2, max_len=16, pack_weights=False).generate(
            [Request(0, [1, 2, 3], params)])[0]
    assert done[1.0].completion_ids == done[0.5].completion_ids == done[0.0].completion_ids
    at_0 = SamplingParams(max_new_tokens=4, greedy=False, temperature=0.0, ignore_eos=True)
    assert Engine(model, num_slots=2, max_len=16, pack_weights=False).generate(
        [Request(0, [1, 2, 3], at_0)])[0].completion_ids == done[1.0].completion_ids  # 0 = greedy
    assert done[0.0].logp == done[1.0].logp and done[0.5].logp != done[1.0].logp
    assert (trainer_temperature(0.5), trainer_temperature(0.0)) == (0.5, 1.0)
    text = _help("generator.temperature")
    assert "ignored when greedy" not in text and "0 = greedy" in text and "(mu)" in text
