"""Expand a grid of `--section.key` values into runs, check them all, then launch them.

    python launch/sweep.py --config configs/tiny_cpu.toml \\
        --grid trainer.lr=1e-4,3e-4 --grid algo.max_staleness=0,1,4 --dry-run
    python launch/sweep.py --config C --grid-file grid.toml --local [--nproc 3] [--keep-going]
    python launch/sweep.py --config C --grid ... --slurm [--sbatch launch/tandem.sbatch] [--submit]

Runs are the cartesian product of the grid in the order given (the last key varies fastest).
Each gets `--run.name=<prefix>_<key>-<value>_...`; the prefix is --name-prefix, else the
config's run.name, else the config file's name. A run whose folder holds a run of other
settings (another sweep's) is refused before any starts; the same sweep run again resumes or
skips its runs. Extra `--section.key=value` arguments apply to every
run. A grid file holds a `[grid]` table: `"trainer.lr" = [1e-4, 3e-4]`.

Every run's overrides go through config.load_config before anything starts, so an unknown key or
a bad value fails fast with config's message (which names the valid keys).

--slurm writes a sweep file, one line of overrides per run, that launch/tandem.sbatch reads by
SLURM_ARRAY_TASK_ID, and prints (or, with --submit, runs) the `sbatch --array` command. A task
reads its line when it starts (again when requeued), so a sweep file is never rewritten with
other runs: the default, runs/sweeps/<prefix>-<digest>.txt, is named by its contents.
"""
import argparse
import hashlib
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: config.py lives in the repo root
from config import (ConfigError, RunConfig, int_at_least, load_config, parse_cli,  # noqa: E402
                    value_of)

RUN_LOCAL = os.path.join("launch", "run_local.sh")
SBATCH = os.path.join("launch", "tandem.sbatch")


@dataclass
class Run:
    name: str
    overrides: list[str]  # "--section.key=value", ending with "--run.name=<name>"


def parse_grid_arg(text: str) -> tuple[str, list[str]]:
    """"trainer.lr=1e-4,3e-4" -> ("trainer.lr", ["1e-4", "3e-4"]). Commas inside brackets or
    braces belong to one value: "stop_token_ids=[1,2],[3]" is two values, as is a list of JSON
    objects for a table key."""
    key, eq, values = text.removeprefix("--").partition("=")
    if not eq or "." not in key or not values.strip():
        raise ValueError(f"--grid {text!r} must look like section.key=v1,v2,... (e.g. trainer.lr=1e-4,3e-4)")
    return key.strip(), [v.strip() for v in _top_level_split(values, text)]


def _top_level_split(text: str, where: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(c, 0)
        if depth < 0:
            break
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"--grid {where!r}: unbalanced brackets or braces")
    return parts + [text[start:]]


def load_grid_file(path: str) -> list[tuple[str, list[str]]]:
    """[grid] table of "section.key" = [values] (a [grid.section] sub-table works too)."""
    with open(path, "rb") as fh:
        table = tomllib.load(fh).get("grid")
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: needs a [grid] table such as  \"trainer.lr\" = [1e-4, 3e-4]")
    grid = []
    for key, values in table.items():
        # TOML reads an unquoted trainer.lr = [...] as a nested table {"trainer": {"lr": [...]}}.
        items = values.items() if isinstance(values, dict) and "." not in key else [(None, values)]
        for sub, vals in items:
            name = f"{key}.{sub}" if sub else key
            if isinstance(vals, dict):
                raise ValueError(
                    f"{path}: grid key {name!r} holds one table ({_text(vals)}), which would be "
                    f"one run, not a run per value inside it; list the tables to sweep: "
                    f"\"{name}\" = [{{digits = 1}}, {{digits = 2}}] (a [grid.{name}] header "
                    "makes such a table too)")
            vals = vals if isinstance(vals, list) else [vals]
            grid.append((name, [_text(v) for v in vals]))
    return grid


def _text(v) -> str:
    """A TOML value as command-line text that config's override parser reads back."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):  # list-typed fields take comma-separated values
        return "[" + ",".join(_text(x) for x in v) + "]"
    if isinstance(v, dict):  # table-typed fields take a JSON object
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def _slug(text: str) -> str:
    text = re.sub(r"^-(?=[0-9.])", "m", text)  # -1 -> m1: a name unlike 1's
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-") or "x"


def _same_values(key: str, values: list[str], config: str | None) -> list[str]:
    """The grid's values that mean the same setting as an earlier one (1e-4 and 0.0001)."""
    seen, repeats = [], []
    for v in values:
        setting = v
        if config is not None:
            try:
                setting = value_of(load_config(config, [f"--{key}={v}"]), key)
            except ConfigError:
                pass  # validate() reports it with the run's name
        (repeats.append(v) if setting in seen else seen.append(setting))
    return repeats


def expand(grid: list[tuple[str, list[str]]], prefix: str, common: list[str] = (),
           config: str | None = None) -> list[Run]:
    """Cartesian product of the grid, in order, each with a unique sanitised run name. With
    `config`, values are compared as the settings they make (1e-4 repeats 0.0001)."""
    keys = [k.replace("-", "_") for k, _ in grid]
    for key, (raw, values) in zip(keys, grid):
        if keys.count(key) > 1:
            raise ValueError(f"grid key {key!r} is given more than once; list all its values in one --grid")
        if not values:  # the product would be empty: no run, and --slurm an array of 0--1
            raise ValueError(f"grid key {key!r} has no values; give it at least one "
                             "(e.g. \"trainer.lr\" = [1e-4]) or leave it out of the grid")
        if key in ("run.name", "run.dir"):
            raise ValueError(f"{key} is set per run by the sweep (run.name, its folder "
                             "runs/<run.name>); use --name-prefix instead")
        repeats = _same_values(key, values, config)
        if repeats:
            raise ValueError(f"grid key {key!r} repeats a value: {repeats} in {values}; each run "
                             "must differ")
        bad = [v for v in values if not v or re.search(r"\s", v)]
        if bad:  # the sweep file is whitespace-separated (launch/tandem.sbatch splits it)
            raise ValueError(f"grid values of {key!r} must be non-empty and contain no whitespace: {bad!r}")
    # Name by the bare key ("lr") unless two grid keys share it (trainer.seed, data.seed).
    leaves = [k.rpartition(".")[2] for k in keys]
    labels = [leaf if leaves.count(leaf) == 1 else key for key, leaf in zip(keys, leaves)]
    combos = list(itertools.product(*(values for _, values in grid)))
    names = [_slug(prefix) + "".join(f"_{_slug(lab)}-{_slug(v)}" for lab, v in zip(labels, combo))
             for combo in combos]
    # Sanitising can map different values to one name ("a/b", "a:b"): number the clashes, until
    # no two names (numbered ones included) are alike.
    while len(set(names)) < len(names):
        names = [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return [Run(name, [*common, *(f"--{k}={v}" for k, v in zip(keys, combo)), f"--run.name={name}"])
            for name, combo in zip(names, combos)]


def default_prefix(config: str, common: list[str]) -> str:
    """The runs' name prefix without --name-prefix: the config's run.name, or where it leaves
    that at its default ("tandem"), the config file's name: two configs without a name ran
    their sweeps in the same folders (the second's finished runs skipped as done)."""
    name = load_config(config, common).run.name
    return name if name != RunConfig.name else os.path.splitext(os.path.basename(config))[0]


def validate(config: str, runs: list[Run], world_size: int | None = None) -> None:
    """Load every run's config (and resolve its layout if the world size is known); raise
    ConfigError. Two runs in one folder (a run.dir given to all) are refused: the second would
    find the first's steps done and train nothing."""
    folders: dict[str, str] = {}
    for run in runs:
        try:
            cfg = load_config(config, run.overrides)
            if world_size:
                cfg.resolve(world_size)
        except ConfigError as e:
            raise ConfigError(f"run {run.name}: {e}") from None
        folder = run_folder(cfg)
        if folder in folders:
            raise ConfigError(f"runs {folders[folder]} and {run.name} would share the run folder "
                              f"{folder}: leave run.dir unset (each run gets runs/<run.name>)")
        folders[folder] = run.name
        _check_folder_holds_this_run(config, run, folder)


# what a run may change and still train on in the folder of an earlier one (a sweep run again,
# longer); the other sections make the experiment
_FREE_SECTIONS = ("parallel", "eval", "checkpoint", "logging", "run")
_FREE_KEYS = ("trainer.max_steps",)


def _check_folder_holds_this_run(config: str, run: Run, folder: str) -> None:
    """A run whose folder holds a run of other settings (another sweep's, of the same names) is
    refused: it would have been skipped as finished, or resumed that run's checkpoint. Compared:
    the keys the config file, the overrides and the folder's saved config.toml set, outside
    `_FREE_SECTIONS`/`_FREE_KEYS` (the saved file's: a key that an earlier sweep's overrides set,
    --trainer.weight_decay=0.1, and this one leaves at its default was not compared)."""
    saved_path = os.path.join(folder if os.path.isabs(folder) else os.path.join(ROOT, folder),
                              "config.toml")
    if not os.path.isfile(saved_path):
        return
    try:
        saved = load_config(saved_path)
    except ConfigError:
        return  # not one this version reads: train_rl.py's resume checks say what they can
    cfg = load_config(config, run.overrides)  # as given: config.toml keeps derived keys' so
    differ = []
    for key in dict.fromkeys([*_keys_set(config, run.overrides), *_keys_set(saved_path, [])]):
        if key.split(".")[0] in _FREE_SECTIONS or key in _FREE_KEYS:
            continue
        now = value_of(cfg, key)
        if key.endswith(".seed"):  # the saved config holds the sums (Config.resolve)
            now += cfg.run.seed
        if now != value_of(saved, key):
            differ.append(f"{key}={now!r} (the folder's run: {value_of(saved, key)!r})")
    if differ:
        raise ConfigError(f"run {run.name}: its folder {folder} holds a run of other settings: "
                          f"{', '.join(differ)}; it would be skipped as finished or resume that "
                          "run. Give this sweep its own --name-prefix, or move that folder away")


# the seeds run.seed is added to (Config.resolve): compared whether or not a key sets them, so
# that a sweep of another --run.seed is told its folders hold the first one's runs
_SEEDS = ("data.seed", "generator.seed", "trainer.seed")


def _keys_set(config: str, overrides: list[str]) -> list[str]:
    """The "section.key" names the config file and the overrides set, in that order, and the
    seeds."""
    with open(config, "rb") as fh:
        table = tomllib.load(fh)
    keys = [f"{sec}.{k}" for sec, vals in table.items() if isinstance(vals, dict) for k in vals]
    keys += [o.removeprefix("--").partition("=")[0].replace("-", "_") for o in overrides]
    return list(dict.fromkeys([*keys, *_SEEDS]))


def run_folder(cfg) -> str:
    """The run's folder as `Config.resolve` derives it (runs/<run.name> unless run.dir is set),
    relative to the repository root that run_local.sh runs from."""
    return os.path.normpath(cfg.run.folder())


def finished_line(config: str, run: Run) -> str | None:
    """What train_rl.py would say of a run that already completed (and then do nothing), without
    starting torchrun for it (~8 s each when a sweep is run again); None for any other run."""
    from trainer.checkpointing import already_complete_line
    cfg = load_config(config, run.overrides)
    folder = run_folder(cfg)
    cfg.run.dir = folder if os.path.isabs(folder) else os.path.join(ROOT, folder)
    return already_complete_line(cfg)


def shell_env(*pairs: tuple[str, str]) -> list[str]:
    """VAR=value words that a shell still reads as assignments when quoted (shlex.join would
    quote the whole word, and bash would run it as a command)."""
    return [f"{k}={shlex.quote(v)}" for k, v in pairs]


def local_command(config: str, run: Run, nproc: int | None) -> str:
    """The shell line that runs `run` (from the repository root)."""
    env = shell_env(("CONFIG", config), *([("NPROC", str(nproc))] if nproc else []))
    return " ".join([*env, shlex.join([RUN_LOCAL, *run.overrides])])


def check_sweep_file_words(runs: list[Run]) -> None:
    """launch/tandem.sbatch splits a sweep line at whitespace: no override may hold any."""
    for run in runs:
        bad = [o for o in run.overrides if re.search(r"\s", o)]
        if bad:
            raise ValueError(f"--slurm: override(s) {bad} hold whitespace, which the sweep file "
                             "cannot carry; write them without spaces (e.g. "
                             "--data.task_options={\"digits\":1})")


def sweep_file_text(runs: list[Run]) -> str:
    return "".join(" ".join(run.overrides) + "\n" for run in runs)


def default_sweep_file(prefix: str, runs: list[Run]) -> str:
    """runs/sweeps/<prefix>-<digest of its lines>.txt: another sweep of the same prefix gets
    another file (write_sweep_file), the same sweep submitted again the same one."""
    digest = hashlib.sha1(sweep_file_text(runs).encode()).hexdigest()[:8]
    return os.path.join(ROOT, "runs", "sweeps", f"{_slug(prefix)}-{digest}.txt")


def write_sweep_file(path: str, runs: list[Run]) -> None:
    """Write the runs' lines to `path`, which must not hold another sweep's: an array task reads
    its line when it starts, so the queued (and requeued: preempted) tasks of that sweep would
    run this one's overrides, under this one's run names."""
    text = sweep_file_text(runs)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            if fh.read() != text:
                raise ValueError(f"--sweep-file {path} holds another sweep's runs, which its array "
                                 "job's queued or requeued tasks still read by line; give another "
                                 "--sweep-file (or leave it out: runs/sweeps/<prefix>-<digest>.txt), "
                                 "or delete that file once no task of its sweep can start again")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def run_local(config: str, runs: list[Run], nproc: int | None, keep_going: bool) -> int:
    """Run one after the other; stop at the first failure unless keep_going. Returns the exit
    code: 130 after a Ctrl-C, which ends the sweep (the runs resume when it is run again)."""
    env = {**os.environ, "CONFIG": config, **({"NPROC": str(nproc)} if nproc else {})}
    failed, finished = [], 0
    for i, run in enumerate(runs):
        line = finished_line(config, run)
        if line is not None:
            print(f"[sweep {i + 1}/{len(runs)}] {run.name}: {line}", flush=True)
            finished += 1
            continue
        print(f"[sweep {i + 1}/{len(runs)}] {local_command(config, run, nproc)}", flush=True)
        try:
            rc = wait_launcher(subprocess.Popen(["bash", RUN_LOCAL, *run.overrides], cwd=ROOT, env=env))
        except KeyboardInterrupt:
            print(f"[sweep] interrupted in run {run.name} ({i + 1}/{len(runs)}); {i - len(failed)} "
                  "runs succeeded before it; run the same sweep again to go on (a finished run "
                  "says so, an unfinished one resumes from its latest checkpoint)", flush=True)
            return 130
        if rc:
            failed.append(f"{run.name} (exit {rc})")
            if not keep_going:
                break
    done = i + 1
    print(f"[sweep] {done - len(failed)}/{len(runs)} runs succeeded" +
          (f" ({finished} had already completed: not run again)" if finished else "") +
          (f"; failed: {', '.join(failed)}" if failed else "") +
          (f"; {len(runs) - done} not started (use --keep-going)" if done < len(runs) else ""))
    return 1 if failed else 0


# How long a Ctrl-C'd launcher may take to stop: torchrun gives its ranks 30 s after passing a
# signal on (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and Ctrl-C is not a signal it waits longer for.
INTERRUPT_WAIT_S = 60.0


def wait_launcher(proc: subprocess.Popen) -> int:
    """The exit code of a run's launcher. On Ctrl-C, which reaches the launcher too (the terminal
    signals its whole foreground process group), give it INTERRUPT_WAIT_S to stop its ranks and
    print where the run can resume (subprocess.run SIGKILLed it 0.25 s in: that line was lost and
    the ranks were orphaned), then raise the KeyboardInterrupt; kill it after that, or at once on
    a second Ctrl-C."""
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=INTERRUPT_WAIT_S)
        except subprocess.TimeoutExpired:
            print(f"[sweep] the run's launcher (pid {proc.pid}) did not stop within "
                  f"{INTERRUPT_WAIT_S:g} s of the Ctrl-C: killing it", file=sys.stderr, flush=True)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise


# the modes each mode-bound flag applies to: given with another, it was silently ignored
# (--dry-run --submit submitted nothing)
_FLAG_MODES = {"sbatch": ("slurm",), "sweep_file": ("slurm",), "max_concurrent": ("slurm",),
               "submit": ("slurm",), "keep_going": ("local",), "nproc": ("local", "dry_run")}


def _flags_of_other_modes(ap: argparse.ArgumentParser, args) -> str | None:
    """What is wrong with the flags given outside their modes (`_FLAG_MODES`), or None."""
    mode = "slurm" if args.slurm else "local" if args.local else "dry_run"
    dash = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for flag, modes in _FLAG_MODES.items():
        if mode not in modes and getattr(args, flag) != ap.get_default(flag):
            return (f"{dash(flag)} applies to {' and '.join(map(dash, modes))} only, not to "
                    f"{dash(mode)}")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sweep.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="Other --section.key=value arguments apply to every run.")
    ap.add_argument("--config", required=True, help="TOML preset shared by every run")
    ap.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                    help="values of one key (repeatable)")
    ap.add_argument("--grid-file", help="TOML file with a [grid] table of \"section.key\" = [values]")
    ap.add_argument("--name-prefix", help="run name prefix (default: the config's run.name, "
                    "else the config file's name)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    mode.add_argument("--local", action="store_true", help="run one after another via launch/run_local.sh")
    mode.add_argument("--slurm", action="store_true", help="write a sweep file for an sbatch job array")
    ap.add_argument("--nproc", type=int_at_least(1), help="--local (and --dry-run): ranks per run (default: run_local.sh derives it)")
    ap.add_argument("--keep-going", action="store_true", help="--local: continue after a failed run")
    ap.add_argument("--sbatch", default=SBATCH, help="--slurm: batch script")
    ap.add_argument("--sweep-file", help="--slurm: where to write the overrides (default "
                    "runs/sweeps/<prefix>-<digest>.txt); not a file that holds another sweep")
    ap.add_argument("--max-concurrent", type=int_at_least(1), help="--slurm: array throttle (--array=0-N%%K)")
    ap.add_argument("--submit", action="store_true", help="--slurm: call sbatch instead of printing it")
    args, rest = ap.parse_known_args(argv)
    if misplaced := _flags_of_other_modes(ap, args):
        ap.error(misplaced)
    try:
        path, common, flags = parse_cli(rest)
        if path or flags:
            raise ValueError(f"unknown arguments {rest}: extra arguments must be --section.key=value")
        common = [f"--{o}" for o in common]
        grid = [parse_grid_arg(g) for g in args.grid] + (load_grid_file(args.grid_file) if args.grid_file else [])
        if not grid:
            raise ValueError("nothing to sweep: give --grid section.key=v1,v2 or --grid-file FILE")
        # the runs start in the repository root: paths given from elsewhere are made absolute
        args.config = os.path.abspath(args.config)
        prefix = args.name_prefix or default_prefix(args.config, common)
        runs = expand(grid, prefix, common, args.config)
        # the layouts of the ranks given (--local, --dry-run: it passed layouts --local refused)
        validate(args.config, runs, args.nproc)
        if args.slurm:
            check_sweep_file_words(runs)
            sweep_file = os.path.abspath(args.sweep_file or default_sweep_file(prefix, runs))
            write_sweep_file(sweep_file, runs)
    except (ValueError, OSError, tomllib.TOMLDecodeError) as e:  # ConfigError is a ValueError
        ap.error(str(e))

    if args.dry_run:
        print(f"# from {ROOT}")
        for run in runs:
            print(local_command(args.config, run, args.nproc))
        return 0
    if args.local:
        return run_local(args.config, runs, args.nproc, args.keep_going)
    array = f"--array=0-{len(runs) - 1}" + (f"%{args.max_concurrent}" if args.max_concurrent else "")
    sbatch = os.path.join(ROOT, args.sbatch) if args.sbatch == SBATCH else os.path.abspath(args.sbatch)
    cmd = ["sbatch", array, sbatch]
    print(f"# {len(runs)} runs, overrides in {sweep_file}; submit from the repository root (the "
          "job runs where it was submitted from)")
    print(" ".join(["cd", shlex.quote(ROOT), "&&",
                    *shell_env(("SWEEP_FILE", sweep_file), ("CONFIG", args.config)), shlex.join(cmd)]))
    if args.submit:  # sbatch exports the caller's environment to the job by default
        env = {**os.environ, "SWEEP_FILE": sweep_file, "CONFIG": args.config}
        return subprocess.run(cmd, env=env, cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
