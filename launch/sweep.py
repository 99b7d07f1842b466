"""Expand a grid of `--section.key` values into runs, check them all, then launch them.

    python launch/sweep.py --config configs/tiny_cpu.toml \\
        --grid trainer.lr=1e-4,3e-4 --grid algo.max_staleness=0,1,4 --dry-run
    python launch/sweep.py --config C --grid-file grid.toml --local [--nproc 3] [--keep-going]
    python launch/sweep.py --config C --grid ... --slurm [--sbatch launch/tandem.sbatch] [--submit]

Runs are the cartesian product of the grid in the order given (the last key varies fastest). Each
gets `--run.name=<prefix>_<key>-<value>_...`. Extra `--section.key=value` arguments apply to every
run. A grid file holds a `[grid]` table: `"trainer.lr" = [1e-4, 3e-4]`.

Every run's overrides go through config.load_config before anything starts, so an unknown key or
a bad value fails fast with config's message (which names the valid keys).

--slurm writes a sweep file, one line of overrides per run, that launch/tandem.sbatch reads by
SLURM_ARRAY_TASK_ID, and prints (or, with --submit, runs) the `sbatch --array` command.
"""
import argparse
import itertools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: config.py lives in the repo root
from config import ConfigError, int_at_least, load_config, parse_cli  # noqa: E402

RUN_LOCAL = os.path.join("launch", "run_local.sh")


@dataclass
class Run:
    name: str
    overrides: list[str]  # "--section.key=value", ending with "--run.name=<name>"


def parse_grid_arg(text: str) -> tuple[str, list[str]]:
    """"trainer.lr=1e-4,3e-4" -> ("trainer.lr", ["1e-4", "3e-4"])."""
    key, eq, values = text.removeprefix("--").partition("=")
    if not eq or "." not in key or not values.strip():
        raise ValueError(f"--grid {text!r} must look like section.key=v1,v2,... (e.g. trainer.lr=1e-4,3e-4)")
    return key.strip(), [v.strip() for v in values.split(",")]


def load_grid_file(path: str) -> list[tuple[str, list[str]]]:
    """[grid] table of "section.key" = [values] (a [grid.section] sub-table works too)."""
    with open(path, "rb") as fh:
        table = tomllib.load(fh).get("grid")
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: needs a [grid] table such as  \"trainer.lr\" = [1e-4, 3e-4]")
    grid = []
    for key, values in table.items():
        # TOML reads an unquoted trainer.lr = [...] as a nested table {"trainer": {"lr": [...]}}.
        items = values.items() if isinstance(values, dict) else [(None, values)]
        for sub, vals in items:
            vals = vals if isinstance(vals, list) else [vals]
            grid.append((f"{key}.{sub}" if sub else key, [_text(v) for v in vals]))
    return grid


def _text(v) -> str:
    """A TOML value as command-line text that config's override parser reads back."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):  # list-typed fields take comma-separated values
        return ",".join(_text(x) for x in v)
    return str(v)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-") or "x"


def expand(grid: list[tuple[str, list[str]]], prefix: str, common: list[str] = ()) -> list[Run]:
    """Cartesian product of the grid, in order, each with a unique sanitised run name."""
    keys = [k.replace("-", "_") for k, _ in grid]
    for key, (raw, values) in zip(keys, grid):
        if keys.count(key) > 1:
            raise ValueError(f"grid key {key!r} is given more than once; list all its values in one --grid")
        if key == "run.name":
            raise ValueError("run.name is set per run by the sweep; use --name-prefix instead")
        if len(set(values)) != len(values):
            raise ValueError(f"grid key {key!r} repeats a value: {values}; each run must differ")
        bad = [v for v in values if not v or re.search(r"\s", v)]
        if bad:  # the sweep file is whitespace-separated (launch/tandem.sbatch splits it)
            raise ValueError(f"grid values of {key!r} must be non-empty and contain no whitespace: {bad!r}")
    # Name by the bare key ("lr") unless two grid keys share it (trainer.seed, data.seed).
    leaves = [k.rpartition(".")[2] for k in keys]
    labels = [leaf if leaves.count(leaf) == 1 else key for key, leaf in zip(keys, leaves)]
    combos = list(itertools.product(*(values for _, values in grid)))
    names = [_slug(prefix) + "".join(f"_{_slug(lab)}-{_slug(v)}" for lab, v in zip(labels, combo))
             for combo in combos]
    # Sanitising can map different values to one name ("a/b", "a:b"): number the clashes.
    names = [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return [Run(name, [*common, *(f"--{k}={v}" for k, v in zip(keys, combo)), f"--run.name={name}"])
            for name, combo in zip(names, combos)]


def validate(config: str, runs: list[Run], world_size: int | None = None) -> None:
    """Load every run's config (and resolve its layout if the world size is known); raise ConfigError."""
    for run in runs:
        try:
            cfg = load_config(config, run.overrides)
            if world_size:
                cfg.resolve(world_size)
        except ConfigError as e:
            raise ConfigError(f"run {run.name}: {e}") from None


def local_command(config: str, run: Run, nproc: int | None) -> list[str]:
    env = [f"CONFIG={config}"] + ([f"NPROC={nproc}"] if nproc else [])
    return [*env, RUN_LOCAL, *run.overrides]


def write_sweep_file(path: str, runs: list[Run]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(" ".join(run.overrides) + "\n" for run in runs)


def run_local(config: str, runs: list[Run], nproc: int | None, keep_going: bool) -> int:
    """Run one after the other; stop at the first failure unless keep_going. Returns the exit code."""
    env = {**os.environ, "CONFIG": config, **({"NPROC": str(nproc)} if nproc else {})}
    failed = []
    for i, run in enumerate(runs):
        print(f"[sweep {i + 1}/{len(runs)}] {shlex.join(local_command(config, run, nproc))}", flush=True)
        rc = subprocess.run(["bash", RUN_LOCAL, *run.overrides], cwd=ROOT, env=env).returncode
        if rc:
            failed.append(f"{run.name} (exit {rc})")
            if not keep_going:
                break
    done = i + 1
    print(f"[sweep] {done - len(failed)}/{len(runs)} runs succeeded" +
          (f"; failed: {', '.join(failed)}" if failed else "") +
          (f"; {len(runs) - done} not started (use --keep-going)" if done < len(runs) else ""))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sweep.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="Other --section.key=value arguments apply to every run.")
    ap.add_argument("--config", required=True, help="TOML preset shared by every run")
    ap.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                    help="values of one key (repeatable)")
    ap.add_argument("--grid-file", help="TOML file with a [grid] table of \"section.key\" = [values]")
    ap.add_argument("--name-prefix", help="run name prefix (default: the config's run.name)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    mode.add_argument("--local", action="store_true", help="run one after another via launch/run_local.sh")
    mode.add_argument("--slurm", action="store_true", help="write a sweep file for an sbatch job array")
    ap.add_argument("--nproc", type=int_at_least(1), help="--local: ranks per run (default: run_local.sh derives it)")
    ap.add_argument("--keep-going", action="store_true", help="--local: continue after a failed run")
    ap.add_argument("--sbatch", default=os.path.join("launch", "tandem.sbatch"), help="--slurm: batch script")
    ap.add_argument("--sweep-file", help="--slurm: where to write the overrides (default runs/sweeps/<prefix>.txt)")
    ap.add_argument("--max-concurrent", type=int_at_least(1), help="--slurm: array throttle (--array=0-N%%K)")
    ap.add_argument("--submit", action="store_true", help="--slurm: call sbatch instead of printing it")
    args, rest = ap.parse_known_args(argv)
    try:
        path, common, flags = parse_cli(rest)
        if path or flags:
            raise ValueError(f"unknown arguments {rest}: extra arguments must be --section.key=value")
        common = [f"--{o}" for o in common]
        grid = [parse_grid_arg(g) for g in args.grid] + (load_grid_file(args.grid_file) if args.grid_file else [])
        if not grid:
            raise ValueError("nothing to sweep: give --grid section.key=v1,v2 or --grid-file FILE")
        prefix = args.name_prefix or load_config(args.config, common).run.name
        runs = expand(grid, prefix, common)
        validate(args.config, runs, args.nproc if args.local else None)
    except (ValueError, OSError, tomllib.TOMLDecodeError) as e:  # ConfigError is a ValueError
        ap.error(str(e))

    if args.dry_run:
        for run in runs:
            print(shlex.join(local_command(args.config, run, args.nproc)))
        return 0
    if args.local:
        return run_local(args.config, runs, args.nproc, args.keep_going)
    sweep_file = os.path.abspath(args.sweep_file or os.path.join(ROOT, "runs", "sweeps", f"{_slug(prefix)}.txt"))
    write_sweep_file(sweep_file, runs)
    array = f"--array=0-{len(runs) - 1}" + (f"%{args.max_concurrent}" if args.max_concurrent else "")
    cmd = ["sbatch", array, args.sbatch]
    print(f"# {len(runs)} runs, overrides in {sweep_file}")
    print(shlex.join([f"SWEEP_FILE={sweep_file}", f"CONFIG={args.config}", *cmd]))
    if args.submit:  # sbatch exports the caller's environment to the job by default
        env = {**os.environ, "SWEEP_FILE": sweep_file, "CONFIG": args.config}
        return subprocess.run(cmd, env=env).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
