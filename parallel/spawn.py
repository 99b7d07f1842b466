"""Run a function on N local ranks (torch.multiprocessing spawn) with a timeout: the harness of
the distributed tests, the benchmarks and the profiler; and run a command (torchrun) with its
output captured in files (Captured, run_captured).

Each rank returns a dict of tensors / numbers / strings; it comes back through a torch.save file
read with `weights_only=True` (no arbitrary unpickling). A rank's exception fails the call with
that rank's traceback; a hang fails it after `timeout` seconds instead of blocking forever, with
every rank's thread stacks as they were STACKS_BEFORE_S earlier (where each one waited).

`start_method="forkserver"` forks the ranks from a server process that imported FORKSERVER_PRELOAD
once (the first call starts it): a spawned rank imports torch afresh, ~3.5 s of a 2-core machine
for three ranks, against ~0.1 s forked. Each rank then takes the caller's environment, stdout and
stderr as they are at the call (multiprocessing sets its working directory and sys.path), not as
the server found them; what the preloaded modules read from the environment on import stays as
the server saw it. START_METHOD is the default: "spawn", and "forkserver" in the test suite
(tests/conftest.py), whose hundreds of calls each paid for the imports.
"""
from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHOD = "spawn"
STACKS_BEFORE_S = 10.0  # a hung rank writes every thread's stack this long before the time-out
# what the fork server imports before it forks ranks: what nearly every rank imports, and no CUDA
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp",
                      "torch.distributed.tensor", "torch.distributed.checkpoint", "torch._dynamo",
                      "safetensors.torch", "transformers"]


class _CallerOutput:
    """The caller's stdout and stderr as they travel to a forked rank: pickled as file descriptors
    that the fork server passes on (multiprocessing's DupFd), so that the rank writes to the
    caller's open files, offsets shared, as a spawned rank (which inherits them) does."""

    def __reduce__(self):
        from multiprocessing.context import assert_spawning
        from multiprocessing.reduction import DupFd
        assert_spawning(self)  # DupFd passes fds only while a process is being started
        return _Fds, tuple(DupFd(fd) if _inheritable(fd) else None for fd in (1, 2))


def _inheritable(fd: int) -> bool:
    """What a spawned rank would inherit: an open fd without close-on-exec (a closed stdout's
    number reused by one of Python's own files, a pipe say, is close-on-exec)."""
    try:
        return os.get_inheritable(fd)
    except OSError:  # closed
        return False


class _Fds:
    """_CallerOutput in the rank: the caller's fd 1 and 2, each None where a spawned rank would
    not have inherited it."""

    def __init__(self, *dups):
        self.dups = dups

    def install(self) -> None:
        for fd, dup, name in zip((1, 2), self.dups, ("stdout", "stderr")):
            stream = getattr(sys, name)
            if stream is not None:  # None: the server started without it (a print is dropped)
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            # closed in the caller: /dev/null (not closed, so that no file the rank opens takes
            # the number) and no stream (print is a no-op), as in a spawned rank
            new = os.open(os.devnull, os.O_WRONLY) if dup is None else dup.detach()
            os.dup2(new, fd)
            os.close(new)
            if dup is None:
                setattr(sys, name, None)
            elif hasattr(stream, "reconfigure"):
                # buffered as a new process's: stderr and a terminal by line, else by block
                stream.reconfigure(line_buffering=name == "stderr" or stream.isatty())


def _caller_state() -> dict:
    return {"env": dict(os.environ), "output": _CallerOutput()}


def _take_caller_state(state: dict) -> None:
    """A forked rank's environment and stdout/stderr are the fork server's, from when it started:
    take the caller's."""
    os.environ.clear()
    os.environ.update(state["env"])
    state["output"].install()


def _worker(rank, world, port, outdir, threads, backend, fn, args, timeout=None, caller=None):
    if caller is not None:
        _take_caller_state(caller)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    stacks = open(Path(outdir) / f"rank{rank}.stacks", "w")
    if timeout is not None:  # so that a hang names where each rank waits (run_ranks reports it)
        faulthandler.dump_traceback_later(max(1.0, timeout - STACKS_BEFORE_S), file=stacks)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300))
        result = fn(rank, world, *args)
        torch.save(result or {}, Path(outdir) / f"rank{rank}.pt")
        # all ranks done before any tears down gloo: a rank closing its pairs while a peer still
        # drains the last collective can abort the peer ("terminate called without an active
        # exception", seen once in CI on test_generator_tp2_logits_equal_single_device)
        dist.barrier()
    except BaseException:
        (Path(outdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done, result saved: leave without the interpreter's finalization, which frees what still
    # refers to the process groups (cached device meshes). A gloo thread still joinable there
    # would abort the process, the likeliest source of a "terminate called without an active
    # exception" SIGABRT that still hit rank 3 of test_pair_probes_run_real_pairs once in CI
    # (2026-11-30), with the barrier in place (0 of 20 runs of that test alone repeated it).
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: the caller's was closed
            stream.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float = 180.0, threads: int = 1,
              backend: str = "gloo", start_method: str | None = None) -> list[dict]:
    """Run `fn(rank, world, *args)` on `world` new ranks, spawned or forked from the fork server
    (`start_method`, None: START_METHOD; see above); return each rank's result."""
    start_method = start_method or START_METHOD
    caller = None
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
        caller = _caller_state()
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world, free_port(), outdir, threads, backend, fn, args,
                                                timeout, caller), nprocs=world, join=False,
                                 start_method=start_method)
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world} ranks did not finish in {timeout:.0f}s\n"
                                       f"{_reports(Path(outdir))}")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(Path(outdir) / f"rank{r}.pt", weights_only=True) for r in range(world)]


class Captured(subprocess.Popen):
    """A text-mode Popen whose stdout and stderr go to temporary files, not pipes: communicate()
    returns once the process has ended. Through pipes it waited for their last writer too, and
    torch's shm manager (the child that a rank's first shared-memory export starts, the CPU weight
    sync's) keeps the rank's stderr open for its 2 s shut-down delay after the run has ended."""

    def __init__(self, cmd, **kwargs):
        self._files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        for f in self._files:
            # a writer that outlives the command (the shm manager) appends, and does not overwrite
            # what communicate() reads from the start
            flags = fcntl.fcntl(f.fileno(), fcntl.F_GETFL)
            fcntl.fcntl(f.fileno(), fcntl.F_SETFL, flags | os.O_APPEND)
        super().__init__(cmd, stdout=self._files[0], stderr=self._files[1], text=True, **kwargs)

    def communicate(self, input=None, timeout=None):
        assert input is None, "Captured takes no input"
        self.wait(timeout)  # TimeoutExpired as Popen's: the process still runs
        texts = []
        for f in self._files:
            f.seek(0)
            texts.append(f.read())
        return tuple(texts)

    def __exit__(self, *exc):
        try:
            super().__exit__(*exc)
        finally:
            for f in self._files:
                f.close()


def run_captured(cmd, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) through Captured. A
    time-out (or any exception: Ctrl-C) kills the command, and with start_new_session=True its
    whole process group: the children left in it too (a torchrun's ranks are each in a session of
    their own, and end once their agent, which holds their store, is gone)."""
    with Captured(cmd, **kwargs) as proc:
        try:
            with _sigterm_raises():
                out, err = proc.communicate(timeout=timeout)
        except BaseException as e:
            # (the group may be gone already: an error reading the output after the end)
            with contextlib.suppress(ProcessLookupError):
                if kwargs.get("start_new_session"):
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            proc.wait()
            if isinstance(e, _Terminated):  # the command is gone: now the SIGTERM's own action
                signal.raise_signal(signal.SIGTERM)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class _Terminated(BaseException):
    """A SIGTERM that arrived while `run_captured`'s command ran (`_sigterm_raises`)."""


@contextlib.contextmanager
def _sigterm_raises():
    """A SIGTERM meanwhile raises _Terminated (in the main thread, where handlers run), so that
    `run_captured` kills its command first and then lets the signal act as it would have (the
    previous handler back): its default action ended the caller at once, its clean-up skipped,
    and a command in a session of its own (a bench's torchrun, its ranks) ran on into the next
    timed section of a `timeout`-capped bench/gpu_check.sh. An ignored SIGTERM (or one handled
    outside Python) is left as it is."""
    before = signal.getsignal(signal.SIGTERM)
    if (threading.current_thread() is not threading.main_thread()
            or before in (signal.SIG_IGN, None)):
        yield
        return

    def stop(signum, frame):
        raise _Terminated
    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _reports(outdir: Path) -> str:
    """Each rank's traceback if it raised, and its threads' stacks if it was still running
    STACKS_BEFORE_S before the time-out."""
    parts = []
    for f in sorted(outdir.glob("*.err")) + sorted(outdir.glob("*.stacks")):
        text = f.read_text().strip()
        if text:
            parts.append(f"--- {f.name}\n{text}")
    return "\n".join(parts)
