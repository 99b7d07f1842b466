"""Launchers: sweep grid expansion and validation, and the exact commands the shell scripts run.

The shell scripts run for real with stub executables (a fake PYTHON, fake srun/scontrol/torchrun on
PATH) that record their arguments, so nothing is launched and no SLURM is needed.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from config import ConfigError, load_config
from launch import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_LOCAL = os.path.join(ROOT, "launch", "run_local.sh")
SBATCH = os.path.join(ROOT, "launch", "tandem.sbatch")
TINY = "configs/tiny_cpu.toml"
GRID = [("trainer.lr", ["1e-4", "3e-4"]), ("algo.max_staleness", ["0", "1", "4"])]


def _stub(path, body: str) -> str:
    with open(path, "w") as fh:
        fh.write("#!/bin/bash\n" + textwrap.dedent(body))
    os.chmod(path, 0o755)
    return str(path)


def _args(path) -> list[str]:
    with open(path) as fh:
        return fh.read().splitlines()


# ---- sweep.py ------------------------------------------------------------------------------------

def test_expand_is_an_ordered_cartesian_product():
    runs = sweep.expand(GRID, "sw")
    assert [r.overrides[:2] for r in runs] == [
        [f"--trainer.lr={lr}", f"--algo.max_staleness={s}"] for lr in ("1e-4", "3e-4") for s in ("0", "1", "4")]
    assert [r.name for r in runs][:2] == ["sw_lr-1e-4_max_staleness-0", "sw_lr-1e-4_max_staleness-1"]
    assert all(r.overrides[-1] == f"--run.name={r.name}" for r in runs)
    assert len({r.name for r in runs}) == 6
    assert [r.name for r in sweep.expand(GRID, "sw")] == [r.name for r in runs]  # deterministic


def test_names_are_sanitised_and_unique():
    runs = sweep.expand([("data.source", ["a/b.jsonl", "a:b.jsonl"]), ("trainer.seed", ["1"]),
                         ("data.seed", ["2"])], "my sweep!")
    names = [r.name for r in runs]
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-")
               for n in names)
    assert len(set(names)) == 2                                   # clashes after sanitising get numbered
    assert "trainer.seed-1_data.seed-2" in names[0]               # a shared leaf name keeps its section
    assert names[0].startswith("my-sweep_source-a-b.jsonl")


def test_names_keep_signs_and_stay_unique_after_numbering():
    assert [r.name for r in sweep.expand([("generator.seed", ["-1", "1"])], "sw")] == [
        "sw_seed-m1", "sw_seed-1"]  # -1 was named like 1 (and a later 1 ran in its folder)
    names = [r.name for r in sweep.expand([("data.source", ["a/b", "a:b", "a-b_0"])], "p")]
    assert len(set(names)) == 3  # "a-b_0" is what numbering made of "a/b"


def test_grid_values_with_commas_inside_brackets_and_tables(tmp_path):
    """A list or JSON value holds commas: it was cut at each one (three runs for two lists)."""
    assert sweep.parse_grid_arg("generator.stop_token_ids=[1,2],[3]") == (
        "generator.stop_token_ids", ["[1,2]", "[3]"])
    key, values = sweep.parse_grid_arg('data.task_options={"max_digits":1,"x":[1,2]},{"max_digits":2}')
    assert values == ['{"max_digits":1,"x":[1,2]}', '{"max_digits":2}']
    with pytest.raises(ValueError, match="unbalanced"):
        sweep.parse_grid_arg("generator.stop_token_ids=[1,2")
    runs = sweep.expand([("generator.stop_token_ids", ["[1,2]", "[3]"])], "sw")
    assert [load_config(TINY, r.overrides).generator.stop_token_ids for r in runs] == [[1, 2], [3]]
    with pytest.raises(ConfigError, match=r"stop_token_ids='\[1' is not a list"):
        load_config(TINY, ["--generator.stop_token_ids=[1"])
    grid = tmp_path / "grid.toml"  # a table key in a grid file: JSON on the command line
    grid.write_text('[grid]\n"data.task_options" = [{max_digits = 1}, {max_digits = 2}]\n'
                    '"generator.stop_token_ids" = [[1, 2], [3]]\n')
    g = sweep.load_grid_file(str(grid))
    assert g == [("data.task_options", ['{"max_digits":1}', '{"max_digits":2}']),
                 ("generator.stop_token_ids", ["[1,2]", "[3]"])]
    cfgs = [load_config(TINY, r.overrides) for r in sweep.expand(g, "sw")]
    assert [(c.data.task_options, c.generator.stop_token_ids) for c in cfgs][-1] == (
        {"max_digits": 2}, [3])


def test_sweep_refuses_runs_that_would_share_a_folder_or_a_setting(tmp_path):
    runs = sweep.expand([("trainer.lr", ["1e-4", "3e-4"])], "sw", ["--run.dir=/tmp/one"])
    with pytest.raises(ConfigError, match="would share the run folder /tmp/one"):
        sweep.validate(TINY, runs)
    with pytest.raises(ValueError, match=r"repeats a value: \['0.0001'\]"):
        sweep.expand([("trainer.lr", ["1e-4", "0.0001"])], "sw", config=TINY)
    with pytest.raises(ValueError, match="run.dir is set per run"):
        sweep.expand([("run.dir", ["a", "b"])], "sw")


def test_sweeps_of_other_settings_never_share_run_folders(tmp_path, monkeypatch):
    """Two configs without a run.name both named their runs tandem_<values>, and a sweep of other
    extra settings reused an earlier one's names: the second sweep's runs were skipped as finished
    ("nothing to do", counted as succeeded) or resumed the other experiment's checkpoints."""
    import tomllib
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    for path, kl in ((a, 0.2), (b, 0.0)):
        path.write_text(f"[algo]\nkl_coef = {kl}\n[trainer]\nmax_steps = 3\n")
    # without a run.name, the prefix is the config file's name
    assert sweep.default_prefix(str(a), []) == "a" and sweep.default_prefix(TINY, []) == "tiny_cpu"
    monkeypatch.setattr(sweep, "ROOT", str(tmp_path))  # runs/<name> under tmp_path
    runs = sweep.expand([("trainer.lr", ["1e-4", "3e-4"])], "a", config=str(a))
    sweep.validate(str(a), runs)  # no folder yet
    folder = tmp_path / "runs" / "a_lr-1e-4"
    folder.mkdir(parents=True)
    saved = load_config(str(a), runs[0].overrides)
    (folder / "config.toml").write_text(saved.resolve(3).to_toml())
    sweep.validate(str(a), runs)  # the same sweep again (its runs resume or say they are done)
    longer = sweep.expand([("trainer.lr", ["1e-4", "3e-4"])], "a", ["--trainer.max_steps=9",
                                                                     "--logging.console_every=5"])
    sweep.validate(str(a), longer)  # ... also trained on longer, or shown otherwise
    for config, common, what in ((str(a), ["--algo.kl_coef=0"], "algo.kl_coef=0.0 (the folder's "
                                                                  "run: 0.2)"),
                                 (str(a), ["--trainer.seed=1"], "trainer.seed=1 (the folder's "
                                                                "run: 0)"),
                                 (str(a), ["--run.seed=1"], "data.seed=1 (the folder's run: 0)"),
                                 (str(b), [], "algo.kl_coef=0.0 (the folder's run: 0.2)")):
        other = sweep.expand([("trainer.lr", ["1e-4", "3e-4"])], "a", common)
        with pytest.raises(ConfigError, match=rf"run a_lr-1e-4: its folder .*a_lr-1e-4 holds a run "
                                              rf"of other settings: {re.escape(what)}.*--name-prefix"):
            sweep.validate(config, other)
    # a key only the folder's run set (its sweep's extra override), left at its default now
    decayed = sweep.expand([("trainer.lr", ["1e-4"])], "a", ["--trainer.weight_decay=0.1"])
    (folder / "config.toml").write_text(load_config(str(a), decayed[0].overrides).resolve(3).to_toml())
    with pytest.raises(ConfigError, match=r"trainer.weight_decay=0.0 \(the folder's run: 0.1\)"):
        sweep.validate(str(a), runs)
    sweep.validate(str(a), decayed)
    # run.seed is folded into the section seeds of the saved config
    seeded = sweep.expand([("trainer.lr", ["1e-4"])], "a", ["--run.seed=2"])
    (folder / "config.toml").write_text(load_config(str(a), seeded[0].overrides).resolve(3).to_toml())
    assert tomllib.loads((folder / "config.toml").read_text())["trainer"]["seed"] == 2
    sweep.validate(str(a), seeded)


def test_a_grid_file_table_value_must_be_listed(tmp_path):
    """[grid.data.task_options] digits = [1, 2] (or "data.task_options" = {digits = 1}) is one
    table value: it made one run of {"digits": [1, 2]}, or a misread key."""
    for text in ('[grid.data.task_options]\ndigits = [1, 2]\n', '[grid]\n"data.task_options" = {digits = 1}\n'):
        (tmp_path / "g.toml").write_text(text)
        with pytest.raises(ValueError, match=r"grid key 'data.task_options' holds one table \(.*"
                                             r"list the tables to sweep"):
            sweep.load_grid_file(str(tmp_path / "g.toml"))


def test_slurm_refuses_an_override_with_whitespace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--config", TINY, "--grid", "trainer.lr=1e-4,3e-4", '--data.task_options={"max_digits": 1}',
                    "--slurm", "--sweep-file", str(tmp_path / "s.txt")])
    assert "hold whitespace, which the sweep file cannot carry" in capsys.readouterr().err
    assert not (tmp_path / "s.txt").exists()


def test_relative_paths_from_another_folder(tmp_path, monkeypatch, capsys):
    """The runs start in the repository root: a config path relative to the caller's folder
    reached run_local.sh as the same relative path there (not found)."""
    shutil.copy(os.path.join(ROOT, TINY), tmp_path / "my.toml")
    monkeypatch.chdir(tmp_path)
    assert sweep.main(["--config", "my.toml", "--grid", "trainer.lr=1e-4", "--dry-run"]) == 0
    assert f"CONFIG={tmp_path / 'my.toml'} launch/run_local.sh" in capsys.readouterr().out


@pytest.mark.parametrize("grid, match", [
    ([("trainer.lr", ["1", "2"]), ("trainer.lr", ["3"])], "more than once"),
    ([("trainer.lr", ["1", "1"])], "repeats a value"),
    ([("data.source", ["a b"])], "whitespace"),
    ([("run.name", ["x"])], "name-prefix"),
])
def test_expand_rejects_ambiguous_grids(grid, match):
    with pytest.raises(ValueError, match=match):
        sweep.expand(grid, "sw")


def test_validation_uses_config_messages():
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.lrr'.*valid keys of \[trainer\]:.* lr,"):
        sweep.validate(TINY, sweep.expand([("trainer.lrr", ["1e-4"])], "sw"))
    with pytest.raises(ConfigError, match=r"run sw_max_staleness-x: .*max_staleness='x' has the wrong type"):
        sweep.validate(TINY, sweep.expand([("algo.max_staleness", ["0", "x"])], "sw"))
    with pytest.raises(ConfigError, match="invalid parallel layout for world_size=1"):
        sweep.validate(TINY, sweep.expand(GRID, "sw"), world_size=1)
    sweep.validate(TINY, sweep.expand(GRID, "sw"), world_size=3)


def test_unknown_key_fails_before_anything_runs(capsys, tmp_path):
    sweep_file = tmp_path / "sweep.txt"
    with pytest.raises(SystemExit) as e:
        sweep.main(["--config", TINY, "--grid", "trainer.lr=1e-4", "--grid", "algo.nope=1",
                    "--slurm", "--sweep-file", str(sweep_file)])
    assert e.value.code == 2
    assert "unknown key 'algo.nope'" in capsys.readouterr().err
    assert not sweep_file.exists()


def test_dry_run_prints_commands(capsys):
    assert sweep.main(["--config", TINY, "--grid", "trainer.lr=1e-4,3e-4", "--grid", "algo.max_staleness=0,1,4",
                       "--name-prefix", "sw", "--generator.n_samples=4", "--dry-run"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header == f"# from {sweep.ROOT}" and len(lines) == 6
    assert lines[0] == (f"CONFIG={os.path.abspath(TINY)} launch/run_local.sh --generator.n_samples=4 "
                        "--trainer.lr=1e-4 --algo.max_staleness=0 --run.name=sw_lr-1e-4_max_staleness-0")
    assert lines[5].endswith("--trainer.lr=3e-4 --algo.max_staleness=4 --run.name=sw_lr-3e-4_max_staleness-4")
    # with --nproc, each run's layout is checked as --local checks it (it printed a command that
    # the same --local then refused)
    with pytest.raises(SystemExit):
        sweep.main(["--config", TINY, "--grid", "parallel.trainer_tp=1,3", "--nproc", "3", "--dry-run"])
    assert "trainer_tp=3 does not divide the 2 trainer ranks" in capsys.readouterr().err


def test_grid_file_and_default_prefix(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text('[grid]\n"trainer.lr" = [1e-4, 3e-4]\nalgo.loss = ["aipo", "ppo"]\n'
                    '"parallel.compile" = [true]\n')
    assert sweep.load_grid_file(str(grid)) == [
        ("trainer.lr", ["0.0001", "0.0003"]), ("algo.loss", ["aipo", "ppo"]), ("parallel.compile", ["true"])]
    assert sweep.main(["--config", TINY, "--grid-file", str(grid), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()[1:]
    assert len(out) == 4 and out[1].endswith("--run.name=tiny_cpu_lr-0.0001_loss-ppo_compile-true")


def test_slurm_writes_one_override_line_per_run(tmp_path, capsys):
    sweep_file = tmp_path / "s" / "sweep.txt"
    assert sweep.main(["--config", TINY, "--grid", "trainer.lr=1e-4,3e-4", "--name-prefix", "sw",
                       "--slurm", "--sweep-file", str(sweep_file), "--max-concurrent", "2"]) == 0
    assert sweep_file.read_text() == ("--trainer.lr=1e-4 --run.name=sw_lr-1e-4\n"
                                      "--trainer.lr=3e-4 --run.name=sw_lr-3e-4\n")
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (f"cd {sweep.ROOT} && SWEEP_FILE={sweep_file} CONFIG={os.path.abspath(TINY)} "
                       f"sbatch --array=0-1%2 {os.path.join(sweep.ROOT, 'launch', 'tandem.sbatch')}")


def test_a_grid_key_without_values_is_refused(tmp_path, capsys):
    """`"trainer.lr" = []` in a grid file made no runs: --local crashed (UnboundLocalError),
    --slurm wrote an empty sweep file and printed `sbatch --array=0--1`."""
    grid = tmp_path / "grid.toml"
    grid.write_text('[grid]\n"trainer.lr" = []\n')
    for mode in (["--local"], ["--slurm", "--sweep-file", str(tmp_path / "s.txt")], ["--dry-run"]):
        with pytest.raises(SystemExit) as e:
            sweep.main(["--config", TINY, "--grid-file", str(grid), *mode])
        assert e.value.code == 2
        assert "grid key 'trainer.lr' has no values" in capsys.readouterr().err
    assert not (tmp_path / "s.txt").exists()


def test_a_later_sweep_never_rewrites_the_lines_an_earlier_ones_tasks_read(tmp_path, monkeypatch, capsys):
    """Both sweeps of one prefix wrote runs/sweeps/<prefix>.txt: the first one's queued (or
    requeued) array tasks then ran the second one's overrides and run names."""
    monkeypatch.setattr(sweep, "ROOT", str(tmp_path))
    lr, staleness = ["--grid", "trainer.lr=1e-4,3e-4"], ["--grid", "algo.max_staleness=0,1"]
    files = []
    for grid in (lr, staleness, lr):
        assert sweep.main(["--config", TINY, *grid, "--slurm"]) == 0
        files.append(capsys.readouterr().out.split("overrides in ")[1].split(";")[0])
    assert files[0] != files[1] and files[2] == files[0]  # the same sweep again: its own file
    assert all(os.path.dirname(f) == str(tmp_path / "runs" / "sweeps") for f in files)
    assert open(files[0]).read() == ("--trainer.lr=1e-4 --run.name=tiny_cpu_lr-1e-4\n"
                                     "--trainer.lr=3e-4 --run.name=tiny_cpu_lr-3e-4\n")
    explicit = tmp_path / "mine.txt"  # an explicit file: the same sweep again, never another
    assert sweep.main(["--config", TINY, *lr, "--slurm", "--sweep-file", str(explicit)]) == 0
    assert sweep.main(["--config", TINY, *lr, "--slurm", "--sweep-file", str(explicit)]) == 0
    with pytest.raises(SystemExit) as e:
        sweep.main(["--config", TINY, *staleness, "--slurm", "--sweep-file", str(explicit)])
    assert e.value.code == 2 and "holds another sweep's runs" in capsys.readouterr().err
    assert "--trainer.lr=3e-4" in explicit.read_text()


@pytest.mark.parametrize("keep_going, started, rc", [(False, 1, 1), (True, 3, 1)])
def test_local_runs_in_order_and_stops_on_failure(tmp_path, monkeypatch, capsys, keep_going, started, rc):
    log = tmp_path / "calls"
    # A PYTHON whose "torchrun" fails for lr=1e-4: the first of three runs (run_local's config
    # check runs on the real one).
    monkeypatch.setenv("PYTHON", _stub(tmp_path / "python", f"""\
        if [[ "$1 $2" != "-m torch.distributed.run" ]]; then exec {sys.executable} "$@"; fi
        echo "$*" >> {log}
        [[ "$*" != *--trainer.lr=1e-4* ]]
        """))
    argv = ["--config", TINY, "--grid", "trainer.lr=1e-4,2e-4,3e-4", "--local", "--nproc", "3"]
    assert sweep.main(argv + ["--keep-going"] * keep_going) == rc
    calls = _args(log)
    assert len(calls) == started and all("--nproc-per-node 3" in c for c in calls)
    assert [c.split("--trainer.lr=")[1].split()[0] for c in calls] == ["1e-4", "2e-4", "3e-4"][:started]
    assert "failed: tiny_cpu_lr-1e-4 (exit 1)" in capsys.readouterr().out


def test_a_sweep_run_again_starts_no_launcher_for_its_finished_runs(tmp_path, monkeypatch, capsys):
    """Each finished run took a torchrun start (~8 s) to say it was complete; the sweep now says
    what train_rl.py would and moves on, and starts the unfinished ones as before."""
    log = tmp_path / "calls"
    monkeypatch.setenv("PYTHON", _stub(tmp_path / "python", f"""\
        if [[ "$1 $2" != "-m torch.distributed.run" ]]; then exec {sys.executable} "$@"; fi
        echo "$*" >> {log}
        """))
    prefix = f"sweeptest{os.getpid()}"  # the runs' folders are the repository's runs/<name>
    folders = {lr: Path(sweep.ROOT, "runs", f"{prefix}_lr-{lr}") for lr in ("1e-4", "2e-4", "3e-4")}
    try:
        for lr, steps in (("1e-4", 800), ("3e-4", 5)):  # tiny_cpu's trainer.max_steps is 800
            folders[lr].mkdir(parents=True)
            (folders[lr] / "COMPLETE").write_text(json.dumps({"steps": steps}))
        argv = ["--config", TINY, "--grid", "trainer.lr=1e-4,2e-4,3e-4", "--name-prefix", prefix,
                "--local", "--nproc", "3"]
        assert sweep.main(argv) == 0
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    assert [c.split("--trainer.lr=")[1].split()[0] for c in _args(log)] == ["2e-4", "3e-4"]
    out = capsys.readouterr().out
    assert (f"[sweep 1/3] {prefix}_lr-1e-4: run {folders['1e-4']} already completed 800 steps "
            "(trainer.max_steps=800): nothing to do." in out), out
    assert "[sweep] 3/3 runs succeeded (1 had already completed: not run again)\n" in out


def test_ctrl_c_lets_the_runs_launcher_stop_and_ends_the_sweep_with_one_line(tmp_path):
    """Ctrl-C reaches the sweep and its run's launcher alike. subprocess.run SIGKILLed the
    launcher 0.25 s later, before torchrun had stopped its ranks and shown where the run can
    resume, then the sweep died with a KeyboardInterrupt traceback."""
    import queue
    import signal
    import threading
    launcher = _stub(tmp_path / "python", f"""\
        if [[ "$1 $2" != "-m torch.distributed.run" ]]; then exec {sys.executable} "$@"; fi
        trap 'sleep 1; echo "launcher: interrupted, resume from step_000002"; exit 130' INT
        echo ready
        while true; do sleep 0.05; done
        """)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "sweep.py"), "--config", TINY,
                             "--grid", "trainer.lr=1e-4,2e-4", "--local", "--nproc", "3"],
                            cwd=ROOT, env={**os.environ, "PYTHON": launcher}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=read, daemon=True).start()
    out = []
    try:
        while "ready\n" not in out:  # the first run's launcher is up
            out.append(lines.get(timeout=60))
            assert out[-1] is not None, f"the sweep ended before its launcher started: {out}"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole foreground group
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    while out[-1] is not None:
        out.append(lines.get(timeout=60))
    out = "".join(out[:-1])
    assert proc.returncode == 130, out
    assert "launcher: interrupted, resume from step_000002" in out and "Traceback" not in out, out
    assert out.rstrip().splitlines()[-1].startswith(
        "[sweep] interrupted in run tiny_cpu_lr-1e-4 (1/2); 0 runs succeeded before it; run the same sweep again")
    assert "[sweep 2/2]" not in out


# ---- shell scripts -------------------------------------------------------------------------------

@pytest.mark.parametrize("script", [RUN_LOCAL, SBATCH])
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", script], check=True)


@pytest.fixture
def fake_python(tmp_path):
    """A PYTHON that records a torchrun invocation and runs anything else (run_local's NPROC probe)."""
    record = tmp_path / "torchrun_args"
    path = _stub(tmp_path / "python", f"""\
        if [[ "$1 $2" == "-m torch.distributed.run" ]]; then printf '%s\\n' "$@" > {record}; exit 0; fi
        exec {sys.executable} "$@"
        """)
    return path, record


def _run_local(fake_python, args=(), **env):
    path, record = fake_python
    env = {**os.environ, "PYTHON": path, **env}
    proc = subprocess.run(["bash", RUN_LOCAL, *args], env=env, capture_output=True, text=True, cwd="/")
    return proc, (_args(record) if record.exists() else None)


def test_run_local_command_line(fake_python):
    """Every rank's console by default: with LOG_RANK=0 the generator's lines (its set-up, the
    eval lines) never showed; train_rl.py keeps each role's output to its own few lines."""
    proc, args = _run_local(fake_python, ["--trainer.lr=1e-4", "--run.name=x"], NPROC="4", MAX_RESTARTS="2")
    assert proc.returncode == 0, proc.stderr
    assert args == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--max-restarts", "2",
                    "--role", "rank", "--tee", "3", "--log-dir", "runs/torchrun_logs",
                    "train_rl.py", "--config", TINY, "--trainer.lr=1e-4", "--run.name=x"]
    assert proc.stderr.startswith(f"+ {fake_python[0]} -m torch.distributed.run --standalone")


def test_run_local_all_ranks_fixed_port(fake_python, tmp_path):
    config = tmp_path / "x.toml"  # the config is loaded (and checked for NPROC) before torchrun
    config.write_text("[model]\npath = \"runs/_models/tiny_addition\"\n")
    _, args = _run_local(fake_python, NPROC="2", LOG_RANK="all", RDZV_PORT="29123", CONFIG=str(config))
    assert "--local-ranks-filter" not in args and "--standalone" not in args
    assert args[2:11] == ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29123",
                          "--nproc-per-node", "2", "--max-restarts"]
    assert args[-3:] == ["train_rl.py", "--config", str(config)]


@pytest.mark.parametrize("overrides, nproc", [
    ([], "3"),                                                   # the tiny demo: 1 generator + 2 trainers
    (["--parallel.trainer_fsdp=4", "--parallel.generator_ranks=2"], "6"),
    (["--parallel.mode=colocated", "--parallel.gen_tp=2", "--parallel.gen_dp=2"], "4"),
    (["--config", "configs/example_multinode.toml"], "24"),      # the config train_rl.py reads: 16 + 4 x 2
])
def test_run_local_derives_nproc_from_config(fake_python, overrides, nproc):
    proc, args = _run_local(fake_python, overrides, LOG_RANK="1,2")
    assert proc.returncode == 0, proc.stderr
    assert args[args.index("--nproc-per-node") + 1] == nproc
    assert args[args.index("--local-ranks-filter") + 1] == "1,2"


def test_run_local_bad_override_fails_before_torchrun(fake_python):
    proc, args = _run_local(fake_python, ["--trainer.lrr=1"])
    assert proc.returncode != 0 and args is None
    assert "valid keys of [trainer]" in proc.stderr
    assert "NPROC" not in proc.stderr  # a misspelt key: the world size has no part in it
    # a layout that the derived world cannot take says how the world was chosen
    proc, args = _run_local(fake_python, ["--parallel.gen_tp=2"])
    assert proc.returncode != 0 and args is None
    assert "gen_tp=2 does not divide the 1 generator ranks" in proc.stderr, proc.stderr
    assert "(3 ranks, derived from the config as NPROC was unset; set NPROC for another world)" \
        in proc.stderr


@pytest.mark.parametrize("env, args, message", [
    ({"NPROC": "abc"}, [], "NPROC=abc must be a number of ranks"),
    ({"MAX_RESTARTS": "-1"}, [], "MAX_RESTARTS=-1 must be a count"),
    ({"LOG_RANK": "rank0"}, [], "LOG_RANK=rank0 must be local ranks such as 0 or 0,2, or all"),
    # rank 5 of 3: every console line filtered out, the run silent to its end
    ({"LOG_RANK": "0,5"}, [], "LOG_RANK=0,5 names local rank 5, but NPROC=3 ranks are 0..2"),
    ({"LOG_RANK": "3", "NPROC": "3"}, [], "LOG_RANK=3 names local rank 3, but NPROC=3 ranks are 0..2"),
    # NPROC given: the config was not checked, every rank failed alike
    ({"NPROC": "4"}, ["--trainer.lrr=1"], "unknown key 'trainer.lrr'"),
    ({"NPROC": "2"}, ["--parallel.trainer_fsdp=4"], "invalid parallel layout for world_size=2"),
])
def test_run_local_refuses_bad_settings_before_torchrun(fake_python, env, args, message):
    """torchrun answered a bad NPROC or LOG_RANK with a traceback, and a LOG_RANK naming no rank
    with a run that printed nothing."""
    proc, torchrun = _run_local(fake_python, args, **env)
    assert proc.returncode != 0 and torchrun is None
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.fixture
def slurm(tmp_path):
    """Stub scontrol/srun/torchrun on PATH and a fake SLURM job environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "torchrun_args"
    _stub(bin_dir / "scontrol", 'test "$1 $2 $3" = "show hostnames node[07-09]" && printf "node07\\nnode08\\nnode09\\n"\n')
    _stub(bin_dir / "srun", 'test "$1" = --kill-on-bad-exit=1 && shift && exec "$@"\n')
    _stub(bin_dir / "torchrun", f"printf '%s\\n' \"$@\" > {record}\n"
                                f"echo \"$TORCH_ELASTIC_SHUTDOWN_TIMEOUT\" > {record}.shutdown_timeout\n")
    for tool in ("bash", "sed", "grep", "basename"):  # a PATH with nothing else on it
        os.symlink(shutil.which(tool), bin_dir / tool)
    os.symlink(sys.executable, bin_dir / "python3")  # what the activated virtualenv provides
    shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")  # the submit dir's
    (tmp_path / "train_rl.py").touch()  # the submit dir is the repository root
    # 3 nodes x 8 = 24 ranks: example_multinode.toml's 16 generator + 2 x 4 trainer ranks; the job
    # loads config.py from the submit dir (here through PYTHONPATH) to check the config first
    env = {"PATH": str(bin_dir), "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "1234",
           "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "node[07-09]", "HOME": str(tmp_path),
           "PYTHONPATH": ROOT}
    return env, record


def _sbatch(slurm, args=(), **env):
    env_, record = slurm
    proc = subprocess.run(["bash", SBATCH, *args], env={**env_, **env}, capture_output=True, text=True)
    return proc, (_args(record) if record.exists() else None)


def test_sbatch_command_line(slurm):
    # 12 ranks: 4 generator + 8 trainer
    (slurm[1].parent / "configs" / "big.toml").write_text("[parallel]\ngenerator_ranks = 4\n")
    proc, args = _sbatch(slurm, ["--trainer.lr=1e-6"], CONFIG="configs/big.toml", GPUS_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr
    assert args == ["--nnodes", "3", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "node07:29500", "--rdzv-id", "1234", "--max-restarts", "3",
                    "train_rl.py", "--config", "configs/big.toml", "--run.name=big_1234", "--trainer.lr=1e-6"]
    # SIGTERM 120 s before the time limit, and torchrun gives its ranks 100 s to checkpoint
    assert "#SBATCH --signal=TERM@120\n" in open(SBATCH).read()
    assert (slurm[1].parent / "torchrun_args.shutdown_timeout").read_text() == "100\n"


def test_sbatch_array_task_reads_its_sweep_line(slurm, tmp_path):
    sweep_file = tmp_path / "sweep.txt"
    runs = sweep.expand(GRID, "sw")
    sweep.write_sweep_file(str(sweep_file), runs)
    proc, args = _sbatch(slurm, SWEEP_FILE=str(sweep_file), SLURM_ARRAY_TASK_ID="4",
                         SLURM_ARRAY_JOB_ID="1230", SLURM_JOB_ID="1238", MAX_RESTARTS="0")
    assert proc.returncode == 0, proc.stderr
    assert args[args.index("--rdzv-id") + 1] == "1238"
    # The sweep line comes last, so its run name wins over the job-id default.
    assert args[args.index("train_rl.py"):] == [
        "train_rl.py", "--config", "configs/example_multinode.toml", "--run.name=llama8b_math_64r_4",
        *runs[4].overrides]


def test_sbatch_sweep_overrides_function(slurm, tmp_path):
    sweep_file = tmp_path / "sweep.txt"
    sweep_file.write_text("--a.b=1 --run.name=r0\n--a.b=2 --run.name=r1\n")

    def call(task):
        return subprocess.run(["bash", "-c", f'source "{SBATCH}" && sweep_overrides "{sweep_file}" {task}'],
                              capture_output=True, text=True, env=slurm[0])
    assert call(1).stdout == "--a.b=2 --run.name=r1\n"
    missing = call(2)
    assert missing.returncode == 1 and "holds 2 runs (submit with --array=0-1)" in missing.stderr
    assert "not a task index" in call("x").stderr
    proc, args = _sbatch(slurm, SWEEP_FILE=str(sweep_file), SLURM_ARRAY_TASK_ID="5", SLURM_ARRAY_JOB_ID="1")
    assert proc.returncode != 0 and args is None                 # no torchrun without the task's overrides
    proc, args = _sbatch(slurm, SWEEP_FILE=str(sweep_file))      # no array: it ran without the file
    assert proc.returncode != 0 and args is None and "is no array job" in proc.stderr


def test_demo_reports_a_bad_override_in_one_line(capsys, monkeypatch):
    """launch/demo.py (make demo) read its arguments unlike train_rl.py ("--a.b v" failed) and
    answered a bad one with a traceback."""
    from launch import demo
    monkeypatch.chdir(ROOT)  # demo.main changes to the repository root; restored after
    assert demo.main(["--trainer.lrr", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: override 'trainer.lrr=1': unknown key") and err.count("\n") == 1
    assert demo.main(["--config", "x.toml"]) == 2
    assert "takes --section.key=value overrides only" in capsys.readouterr().err


def test_demo_ends_a_failed_rl_run_with_one_line_and_its_exit_code(capsys, monkeypatch):
    """A failed torchrun ended `make demo` with a CalledProcessError traceback below the run's own
    error; now one line with the exit code and the command that resumes the run."""
    import subprocess
    from launch import demo
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(demo, "held_out_accuracy", lambda folder, cfg: 0.25)
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 143)
    monkeypatch.setattr(demo.subprocess, "run", run)
    monkeypatch.setattr(demo.Path, "is_file", lambda self: True)  # the tiny model "exists"
    assert demo.main(["--trainer.max_steps=3", "--run.dir=runs/x"]) == 143
    err = capsys.readouterr().err
    assert err == ("error: the RL run exited with 143 (its output is above); to resume it: "
                   "python launch/demo.py --trainer.max_steps=3 --run.dir=runs/x\n")
    assert len(calls) == 1 and "train_rl.py" in calls[0]


def test_demo_warm_starts_a_model_of_the_task_trained_and_refuses_bad_input_first(capsys, monkeypatch):
    """The warm start made an addition model whatever data.source said (its tokenizer dropped
    the reverse task's '>': before 0.000 -> after 0.000), a bad reward.fn was a traceback after
    the warm start, and the resume hint lost its quotes (JSON unreadable when pasted back)."""
    import subprocess
    from launch import demo
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(demo, "held_out_accuracy", lambda folder, cfg: 0.25)
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if "tools/make_tiny_model.py" in cmd else 1)
    monkeypatch.setattr(demo.subprocess, "run", run)
    monkeypatch.setattr(demo.Path, "is_file", lambda self: "_models" not in str(self))
    argv = ["--data.source=synthetic:reverse", '--data.task_options={"digits":2}',
            "--model.path=runs/_models/rev", "--run.dir", "runs/x y"]
    assert demo.main(argv) == 1
    assert calls[0][1:] == ["tools/make_tiny_model.py", "--out", "runs/_models/rev", "--task",
                            "reverse", "--digits", "2"]
    hint = capsys.readouterr().err.strip().split("to resume it: ")[1]
    import shlex
    assert shlex.split(hint)[2:] == ["--data.source=synthetic:reverse", '--data.task_options={"digits":2}',
                                     "--model.path=runs/_models/rev", "--run.dir=runs/x y"]
    calls.clear()
    assert demo.main(["--reward.fn=nowhere_pkg.mod:score"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nowhere_pkg" in err and "Traceback" not in err
    assert demo.main(["--data.source=prompts.jsonl"]) == 2
    assert "warm-starts a tiny model for a synthetic task" in capsys.readouterr().err
    assert calls == []  # refused before the warm start


def _demo_run(monkeypatch, argv, env_omp=None):
    """demo.main with the evaluations (0.25 before, 0.75 after) and torchrun faked: its stdout
    is the demo's own lines; returns the command and environment torchrun was given."""
    import subprocess
    from launch import demo
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(demo, "held_out_accuracy",
                        lambda folder, cfg: 0.75 if folder.name == "hf_final" else 0.25)
    if env_omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env_omp)
    calls = []

    def run(cmd, **kw):
        calls.append((cmd, kw.get("env")))
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(demo.subprocess, "run", run)
    monkeypatch.setattr(demo.Path, "is_file", lambda self: True)  # the tiny model "exists"
    assert demo.main(argv) == 0
    assert len(calls) == 1
    return calls[0]


def test_demo_says_how_many_prompts_it_scores_and_where_its_outputs_are(capsys, monkeypatch):
    """The demo's 'before RL: 0.325' sat next to the run's 'eval v0 | greedy reward 0.305 on 200
    held-out prompts' (and the warm start's 0.305): three figures of one policy, the demo's on 400
    sums, unsaid. Its last line named metrics.jsonl but not the final policy or eval.jsonl."""
    _demo_run(monkeypatch, ["--trainer.max_steps=3", "--run.dir=runs/x"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("== held-out greedy exact match before RL: 0.250 (400 held-out sums; the "
                      "run's eval lines score the first 200)")
    assert out[-3] == ("== held-out greedy exact match on 400 sums: before 0.250 -> after 0.750 "
                       "(0.0 min in all)")
    assert out[-2].startswith("== outputs in runs/x: hf_final/ (the final policy), metrics.jsonl "
                              "(every step), eval.jsonl (held-out evaluations), tb/")
    assert json.loads(out[-1]) == {"demo": "tiny_cpu", "before": 0.25, "after": 0.75,
                                   "minutes": json.loads(out[-1])["minutes"]}  # still the last line


def test_demo_keeps_torchruns_thread_banner_and_800_step_lines_off_the_console(capsys, monkeypatch):
    """torchrun printed a 4-line OMP_NUM_THREADS banner on stderr (it sets 1 where the variable is
    unset and says so); the demo now sets that 1 itself. 800 step lines scrolled the before/after
    figures away: one line every 10 steps unless --logging.console_every is given."""
    cmd, env = _demo_run(monkeypatch, ["--run.dir=runs/x"])
    assert env["OMP_NUM_THREADS"] == "1" and "--logging.console_every=10" in cmd
    assert cmd[cmd.index("train_rl.py") + 1:cmd.index("train_rl.py") + 3] == ["--config", TINY]
    cmd, env = _demo_run(monkeypatch, ["--run.dir=runs/x", "--logging.console_every", "1"],
                         env_omp="2")
    assert env["OMP_NUM_THREADS"] == "2"  # the user's own setting stands
    assert not any(a.startswith("--logging.console_every=") for a in cmd)
    assert cmd[-2:] == ["--logging.console_every", "1"]


@pytest.mark.parametrize("config_text, env, name", [
    ('[run]\nname = "mine"\n', {}, "mine"),              # the config's name, as torchrun would use it
    ("[trainer]\nlr = 1e-6\n", {}, "own_1234"),           # none in the config: file name + job id
    ('[run]\nname = "mine"\n', {"RUN_NAME": "x"}, "x_1234"),
    ('[run]\nname = "mine"\n', {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_JOB_ID": "1230"}, "mine_4"),
])
def test_sbatch_run_name_is_the_configs_own(slurm, tmp_path, config_text, env, name):
    """tandem.sbatch passed --run.name=<config file>_<job id> always, so a config's run.name
    never took effect."""
    (tmp_path / "own.toml").write_text(config_text)
    proc, args = _sbatch(slurm, ["--trainer.lr=1e-6"], CONFIG="own.toml", GPUS_PER_NODE="1", **env)
    assert proc.returncode == 0, proc.stderr
    assert args[args.index("train_rl.py"):] == [
        "train_rl.py", "--config", "own.toml", f"--run.name={name}", "--trainer.lr=1e-6"]


def test_sbatch_run_name_of_a_preset(slurm):
    proc, args = _sbatch(slurm, CONFIG="configs/example_multinode.toml")
    assert proc.returncode == 0, proc.stderr
    assert "--run.name=llama8b_math_64r" in args


@pytest.mark.parametrize("given", [["--config", "own.toml"], ["--config=own.toml"]])
def test_sbatch_config_among_the_arguments_trains_and_names_the_run(slurm, tmp_path, given):
    """A --config among the arguments trained (train_rl.py takes the later one) while the run was
    named after $CONFIG (example_multinode.toml's llama8b_math_64r): that run's folder."""
    (tmp_path / "own.toml").write_text('[run]\nname = "mine"\n[parallel]\ngenerator_ranks = 4\n')
    proc, args = _sbatch(slurm, [*given, "--trainer.lr=1e-6"], GPUS_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr
    assert args[args.index("train_rl.py"):] == [
        "train_rl.py", "--config", "own.toml", "--run.name=mine", "--trainer.lr=1e-6"]


@pytest.mark.parametrize("args, env, message", [
    ([], {"CONFIG": "configs/nope.toml"}, "config file not found: configs/nope.toml"),
    (["--trainer.lrr=1e-6"], {}, "unknown key 'trainer.lrr' (did you mean 'lr'?)"),
    # 16 generator ranks need more than 2 nodes x 8
    ([], {"SLURM_NNODES": "2"}, "for SLURM_NNODES=2 x GPUS_PER_NODE=8 = 16 ranks: invalid parallel "
                               "layout for world_size=16"),
    ([], {"SLURM_GPUS_ON_NODE": "4"}, "GPUS_PER_NODE=4 = 12 ranks"),   # the allocation's GPUs
])
def test_sbatch_refuses_a_config_that_cannot_run_before_srun(slurm, args, env, message):
    """A missing config, a typo in an override or a layout that does not fit the allocation
    started torchrun on every node, whose ranks all failed alike, MAX_RESTARTS + 1 times."""
    proc, torchrun = _sbatch(slurm, args, **env)
    assert proc.returncode != 0 and torchrun is None
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_sbatch_gpus_per_node_defaults_to_the_allocations(slurm):
    """--nproc-per-node was 8 whatever --gpus-per-node the job was submitted with."""
    (slurm[1].parent / "configs" / "small.toml").write_text("[parallel]\ngenerator_ranks = 4\n")
    for env, nproc in (({"SLURM_GPUS_ON_NODE": "4"}, "4"),
                       ({"SLURM_GPUS_ON_NODE": "4", "GPUS_PER_NODE": "2"}, "2")):
        proc, args = _sbatch(slurm, CONFIG="configs/small.toml", **env)
        assert proc.returncode == 0, proc.stderr
        assert args[args.index("--nproc-per-node") + 1] == nproc


@pytest.mark.parametrize("unset, submit_dir, message", [
    ("SLURM_JOB_NODELIST", None, "SLURM_JOB_NODELIST is not set: this script runs under sbatch"),
    (None, "/", "no train_rl.py in / (SLURM_SUBMIT_DIR): submit from the repository root"),
])
def test_sbatch_outside_a_job_or_the_repository_says_so(slurm, unset, submit_dir, message):
    env = dict(slurm[0])
    env.pop(unset, None)
    if submit_dir:
        env["SLURM_SUBMIT_DIR"] = submit_dir
    proc, args = _sbatch((env, slurm[1]))
    assert proc.returncode != 0 and args is None
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_demo_help_prints_its_usage(capsys, monkeypatch, flag):
    """`python launch/demo.py --help` failed: 'takes --section.key=value overrides only'."""
    from launch import demo
    monkeypatch.chdir(ROOT)
    assert demo.main([flag]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "make demo" in captured.out and "--trainer.max_steps=50" in captured.out


def test_the_final_export_line_names_its_seconds(tmp_path, monkeypatch, capsys):
    """README: each checkpoint and Hugging Face export is reported with its folder and the
    seconds it took; the final export's line had no seconds."""
    import types
    from parallel import checkpoint
    from trainer import role
    monkeypatch.setattr(checkpoint, "export_hf", lambda model, out, tokenizer, group: out)
    cfg = load_config(TINY, [f"--run.dir={tmp_path}"]).resolve(3)
    role.finish_run(cfg, types.SimpleNamespace(trainer_group=None), model=None, tokenizer=object(),
                    version=6, owner=True)
    out = capsys.readouterr().out
    assert re.fullmatch(rf"exported the final policy \(version 6\) to {tmp_path / 'hf_final'} "
                        r"\(\d+\.\ds\)\n", out), out


# ---- dry_run.py ----------------------------------------------------------------------------------

def test_dry_run_of_a_config_whose_weights_are_elsewhere_names_the_preset_fix(monkeypatch):
    """configs/example_multinode.toml's model folder is on the cluster's storage: the dry run, meant
    to check such a config where the weights are not, ended at 'does not exist' without saying
    how to check the layout anyway."""
    from launch import dry_run
    monkeypatch.setenv("WORLD_SIZE", "64")
    cfg = load_config(os.path.join(ROOT, "configs", "example_multinode.toml"))
    with pytest.raises(ConfigError, match=r"model\.path='/shared/models/Llama-3.1-8B-Instruct'.*does "
                                          r"not exist.*--model\.path=preset:llama3-8b"):
        dry_run.dry_run(cfg)


@pytest.mark.parametrize("mode, flag, message", [
    (["--dry-run"], ["--submit"], "--submit applies to --slurm only, not to --dry-run"),
    (["--local"], ["--max-concurrent", "2"], "--max-concurrent applies to --slurm only, not to --local"),
    (["--slurm"], ["--nproc", "3"], "--nproc applies to --local and --dry-run only, not to --slurm"),
    (["--dry-run"], ["--keep-going"], "--keep-going applies to --local only, not to --dry-run"),
])
def test_a_flag_of_another_mode_is_refused(mode, flag, message, capsys):
    """`--dry-run --submit` printed the commands and submitted nothing, without a word; so were
    the other modes' flags ignored."""
    with pytest.raises(SystemExit) as e:
        sweep.main(["--config", TINY, "--grid", "trainer.lr=1e-4", *mode, *flag])
    assert e.value.code == 2 and message in capsys.readouterr().err
