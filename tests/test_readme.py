"""Every command in the README's shell blocks still parses: the scripts exist, their options are
known, and the configs and overrides they name load. (The README once documented
`launch/calibrate.py --out profile.json`, which fails for want of --model.) Nothing is run."""
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
