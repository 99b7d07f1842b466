"""Every command in the README's shell blocks still parses: the scripts exist, their options are
known, and the configs and overrides they name load. (The README once documented
`launch/calibrate.py --out profile.json`, which fails for want of --model.) Nothing is run.
Then some of the README's statements about the code, checked against the code they describe."""
import json
import os
import re
import shlex

import pytest

from config import load_config, parse_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[list[str]]:
    """The README's ```bash``` lines as argv lists: comments dropped, continuations joined."""
    text = open(os.path.join(REPO, "README.md")).read()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(shlex.split(line))
    return commands


def _env_and_argv(argv: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    return env, argv


def _check_train_rl(args: list[str]) -> None:
    from config import help_requested
    if help_requested(args) is not None:
        return
    path, overrides, flags = parse_cli(args)
    assert set(flags) <= {"dry_run"}, flags
    load_config(os.path.join(REPO, path) if path else None, overrides)


def check(argv: list[str]) -> str:
    """What the command is, after checking that it parses; an unknown form fails the test, so
    that a new kind of README command gets a check here."""
    env, argv = _env_and_argv(list(argv))
    if argv[0] == "source":  # the virtualenv that `make demo` / `make test` create
        assert argv[1:] == [".venv/bin/activate"] and os.path.exists(os.path.join(REPO, "Makefile")), argv
        return "venv"
    if argv[0] == "make":
        assert argv[1] in ("demo", "test"), argv
        return "make"
    if argv[0] == "torchrun":
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        assert argv[script] == "train_rl.py", argv
        _check_train_rl(argv[script + 1:])
        return "train_rl"
    if argv[0] in ("launch/run_local.sh", "sbatch"):
        script = next(a for a in argv if a.startswith("launch/"))
        assert os.path.exists(os.path.join(REPO, script)), script
        rest = argv[argv.index(script) + 1:]
        load_config(os.path.join(REPO, env["CONFIG"]), parse_cli(rest)[1])
        return "launcher"
    assert argv[0] == "python", argv
    script, args = argv[1], argv[2:]
    assert os.path.exists(os.path.join(REPO, script)), script
    if script == "train_rl.py":
        _check_train_rl(args)
    elif script == "launch/sweep.py":
        from launch.sweep import main as sweep_main
        assert "--dry-run" in args, "only a dry-run sweep is checked by running it"
        assert sweep_main([a if not a.endswith(".toml") else os.path.join(REPO, a) for a in args]) == 0
    elif script in ("launch/plan.py", "launch/calibrate.py"):
        from launch import calibrate, plan
        module = plan if script == "launch/plan.py" else calibrate
        module.build_parser().parse_args(args)
    else:
        pytest.fail(f"no check for README command {argv}")
    return script


def test_every_readme_command_parses(capsys):
    kinds = [check(argv) for argv in readme_commands()]
    assert {"make", "train_rl", "launcher", "launch/plan.py", "launch/calibrate.py",
            "launch/sweep.py", "train_rl.py"} <= set(kinds), kinds


def test_a_broken_command_is_caught():
    with pytest.raises(SystemExit):
        check(["python", "launch/calibrate.py", "--out", "profile.json"])  # no --model
    with pytest.raises(ValueError, match="unknown key"):
        check(["python", "train_rl.py", "--config", "configs/tiny_cpu.toml", "--trainer.lrr=1"])


def test_the_venv_is_activated_before_the_first_bare_command():
    """`make demo` / `make test` install into .venv, but the README's later `python ...` and
    `torchrun ...` lines ran whatever python the shell had (no torch there): the reader must
    meet `source .venv/bin/activate` first. The newcomer's set-up stays two commands."""
    text = open(os.path.join(REPO, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    quick_start = [line.split("#")[0].strip() for line in blocks[0].splitlines()]
    assert [line for line in quick_start if line] == ["make demo", "make test"]
    first_bare = min(block.start(1) + line.start() for block in re.finditer(r"```bash\n(.*?)```", text, re.S)
                     for line in re.finditer(r"^(python|torchrun) ", block.group(1), flags=re.M))
    activate = text.find("source .venv/bin/activate")
    assert 0 <= activate < first_bare, "the first bare command comes before the activation"


# ---- the README's claims about the code, checked against it ---------------------------------------

def _readme() -> str:
    return " ".join(open(os.path.join(REPO, "README.md")).read().split())  # lines joined


def test_saved_config_writes_derived_keys_as_the_readme_says(tmp_path):
    """The README said config.toml writes the derived keys as "derive"; it writes them as given
    (0 or "", which derive them again), their values for this run in comments."""
    from config import DERIVED, load_config, value_of
    readme = _readme()
    assert 'are written as given, 0 or "" (derive it again), with this run\'s values in comments' in readme
    cfg = load_config(os.path.join(REPO, "configs", "tiny_cpu.toml")).resolve(3)
    cfg.save(str(tmp_path / "config.toml"))
    text = (tmp_path / "config.toml").read_text()
    for key in DERIVED:
        if key == "parallel.generator_ranks":  # the preset gives it (1): nothing derived
            continue
        section, name = key.split(".")
        assert re.search(rf"# derived for this run: {re.escape(json.dumps(value_of(cfg, key)))}\n"
                         rf"{name} = (0|\"\")\n", text), key


def test_the_readmes_plan_signature_is_weights_sync_plans():
    """The README's folder table gave `plan(src_layout, dst_layout)`; it takes the parameter
    specs too."""
    import inspect
    from weights_sync.plan import plan
    args = re.search(r"`plan\(([^)]*)\)`", _readme()).group(1).split(", ")
    assert len(args) == len(inspect.signature(plan).parameters), args


def test_resume_settings_the_readme_says_are_refused_before_process_groups():
    """The keys the README names are RESUME_SETTINGS (launch/preflight via check_resume); the
    prompt set and the model's shapes are refused there too (preflight.check_resumed, whose
    behaviour tests/test_bad_input.py checks)."""
    from launch.preflight import check_resumed
    from trainer.checkpointing import RESUME_SETTINGS
    readme = _readme()
    sentence = re.search(r"but not (.*?): the checkpoint's gates", readme).group(1)
    assert set(re.findall(r"`(\w+\.\w+)`", sentence)) == set(RESUME_SETTINGS), sentence
    assert ("the prompt set, or the model's parameter shapes (another `model.path`) is refused "
            "before any process group") in readme
    assert "prompt set" in check_resumed.__doc__ and "shape" in check_resumed.__doc__


def test_the_readmes_ppo_with_token_is_clips_around_the_policy_before_the_update():
    """The README said PPO clips around mu, token IS or not; with token IS it clips around the
    policy before the step's updates, so one update a step clips nothing (trainer/step._loss)."""
    import torch
    from types import SimpleNamespace
    from config import load_config
    from trainer.step import _loss
    logp = torch.tensor([-0.1, -3.0, -1.0])
    batch = SimpleNamespace(loss_mask_N=torch.ones(3, dtype=torch.bool),
                            logp_mu_N=torch.tensor([-2.0, -0.5, -1.0]), adv_N=torch.tensor([1., -1., 1.]))
    clipped = {t: int(_loss(load_config(None, ["--algo.loss=ppo", f"--algo.token_is={t}"]).algo,
                            logp, batch).clipped_count) for t in ("none", "truncate")}
    assert clipped == {"none": 2, "truncate": 0}
    assert ("(with token IS, `algo.token_is`, as verl's TIS: clipped around the policy before the "
            "step's updates instead" in _readme())
