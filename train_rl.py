"""tandem's entry point: one SPMD program on every rank.

    torchrun --nproc-per-node 3 train_rl.py --config configs/tiny_cpu.toml [--section.key=value ...]
    python train_rl.py --help [SECTION]     # every key with its type, default and meaning

config -> checks that need no process group -> ParallelDims -> meshes -> this rank's role loop.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback

from config import (USAGE, ConfigError, help_requested, help_text, prints, resolve_config,
                    warmup_budget_s)

_STARTED = False  # process groups exist: every rank reports its own errors from here on
# Before process groups, a rank other than 0 waits this long for rank 0 to print the error they
# share (torchrun stops it once rank 0 exits): a rank that exited first would make torchrun stop
# rank 0 before its line, and the user would see no reason at all. A rank of rank 0's node still
# running after it prints the line itself; other nodes stay quiet (not a line per rank).
REPORT_GRACE_S = 5.0


def run(cfg) -> int:
    """This rank's part of the job; its exit code: 0, or 143 for a run that a SIGTERM stopped
    early (launch/preemption.py; a rank that torchrun ends after another of its host failed also
    exits 143, from the signal handler)."""
    from launch import preemption
    from launch.preflight import preflight
    from parallel.dims import ParallelDims
    from trainer.checkpointing import already_complete_line, is_complete

    if not prints(cfg.logging.log_rank, int(os.environ.get("RANK", "0"))):
        sys.stdout = open(os.devnull, "w")  # logging.log_rank; stderr (errors) stays
    dims = ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    tokenizer = preflight(cfg, dims)  # bad input is reported before any process group exists
    done = already_complete_line(cfg)  # every rank reads it, before any process group
    if done:
        if int(os.environ.get("RANK", "0")) == 0:
            print(done, flush=True)
        return 0
    if dims.mode == "split":  # colocated mode has no checkpoints: SIGTERM ends it at once
        preemption.install(grace_s=cfg.parallel.timeout_s, pid_dir=_pid_dir(cfg))
    try:
        _run_role(cfg, dims, tokenizer)
    except BaseException:
        preemption.uninstall()  # SIGTERM kills again
        raise
    # the marker was written before the barrier that every rank passed
    return 0 if is_complete(cfg) else preemption.EXIT_CODE


def _pid_dir(cfg) -> str:
    return os.path.join(cfg.run.dir, "pids")


def _run_role(cfg, dims, tokenizer) -> None:
    """Process groups, meshes, this rank's role loop, and the barrier where both meshes end."""
    import torch.distributed as dist
    from launch import preemption
    from parallel.mesh import build_meshes, init_process_group, pick_device, shutdown_barrier

    device = pick_device()
    # the start-up budget for every group, and twice it for leaders' followers (Meshes.set_timeouts)
    init_process_group(device, cfg.parallel.backend, warmup_budget_s(cfg.parallel))
    global _STARTED
    _STARTED = True
    meshes = build_meshes(dims, device)
    meshes.set_timeouts(warmup_budget_s(cfg.parallel))
    preemption.write_pid(_pid_dir(cfg), meshes.rank)
    if meshes.rank == 0:
        cfg.save(os.path.join(cfg.run.dir, "config.toml"))
        print(dims.rank_map(), flush=True)
    if dims.mode == "colocated":
        from trainer.colocated import run_colocated
        run_colocated(cfg, meshes, tokenizer)
    elif meshes.role == "trainer":
        from trainer.role import run_trainer
        run_trainer(cfg, meshes, tokenizer)
    else:
        from rollout.role import run_generator
        run_generator(cfg, meshes, tokenizer)
    # both meshes are done; the trainer exports the final policy before it arrives, which takes
    # as long as a model load: the start-up timeout, not the per-step one
    shutdown_barrier(warmup_budget_s(cfg.parallel))
    # every rank is done: the first to exit makes torchrun SIGTERM the others (and the pid-file
    # check would then find a rank gone), so from here SIGTERM is ignored and each rank exits
    # with its own code
    preemption.uninstall(ignore=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    from launch import preemption
    rank = int(os.environ.get("RANK", "0"))
    argv = sys.argv[1:] if argv is None else argv
    cfg = None
    preemption.note_sigint()
    try:
        section = help_requested(argv)
        if section is not None:
            text = help_text(section or None)  # an unknown section: ConfigError, below
            if rank == 0:
                print(USAGE + "\n" + text, flush=True)  # a broken pipe raises here, not at exit
            return 0
        cfg = resolve_config(argv)
        if cfg.run.dry_run:
            from launch.dry_run import dry_run
            return dry_run(cfg)
        return run(cfg)
    except (ConfigError, ValueError) as e:
        # Detected before process groups start, every rank sees the same error: rank 0 prints it
        # (its node's other ranks only if still running after REPORT_GRACE_S). Later, only the
        # failing rank knows: it prints one line.
        if rank != 0 and not _STARTED:
            time.sleep(REPORT_GRACE_S)
            if int(os.environ.get("GROUP_RANK", "0")) != 0:  # torchrun's node rank
                return 2
        who = f" (rank {rank})" if rank or _STARTED else ""
        print(f"error{who}: {e}", file=sys.stderr, flush=True)
        return 2
    except BrokenPipeError:  # `train_rl.py --help | head`: the reader is gone, as for any CLI tool
        _drop_stdout()
        if _STARTED:  # mid-run, its peers will time out waiting for it: leave the reason
            print(f"error (rank {rank}): stdout was closed (BrokenPipeError)", file=sys.stderr)
        return 128 + signal.SIGPIPE
    except BaseException as e:
        # Ctrl-C reaches every rank: one line, not a traceback from each; also where it ended a
        # rank through another error (a DCP save under way wraps it in a CheckpointException, a
        # collective fails on the peer it ended first)
        if isinstance(e, KeyboardInterrupt) or (preemption.interrupted()
                                                and not isinstance(e, SystemExit)):
            if rank == 0:
                from trainer.checkpointing import interrupted_line
                print(interrupted_line(cfg), file=sys.stderr, flush=True)
            return 130
        if not isinstance(e, Exception):
            raise
        print(f"[rank {rank}] " + traceback.format_exc(), file=sys.stderr, flush=True)
        return 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not fail on the
    closed pipe again (and print 'Exception ignored ... BrokenPipeError')."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


if __name__ == "__main__":
    sys.exit(main())
