"""SIGTERM stops a split-mode run at the next trainer step boundary, with a checkpoint.

SLURM sends SIGTERM to every process of a job at preemption, on `scancel`, and at its time limit
(`launch/tandem.sbatch` asks for it 120 s early with `--signal=TERM@120`); torchrun passes its own
SIGTERM on to every rank. Rather than dying mid-step, every rank notes it here, and:
  - the trainer's first rank, as it starts waiting for the next batch, tells the other trainer
    ranks in the batch broadcast that every step has (no extra collective), they save a checkpoint
    of the last finished step (none before the first; the periodic one if it is that step's), the
    generators are shut down, and every rank exits with 143 (128 + SIGTERM), with no final export;
  - a generator replica's leader passes its SIGTERM on to the trainer's first rank, so a generator
    rank killed alone stops the run the same way (at once also while it is paused for the next
    weights: `acting_on_request`);
  - the other trainer ranks pass theirs on in a one-number all-reduce before each batch (with more
    than one trainer rank: `TrainerWorker._stop_asked`), so a trainer rank signalled alone (one
    node of several preempted) stops the run too, after the step under way or the next; a
    generator TP follower signalled alone does not (its leader decides for the replica);
  - a rank whose run has not stopped `grace_s` after its SIGTERM (one signalled alone, whose signal
    reached no rank that decides) exits then, with 143; not one whose stop is under way, nor a
    trainer rank in the end of a finished run (the final export, COMPLETE, the end barrier): their
    waits have timeouts of their own.
Running the same command again resumes from that checkpoint. torchrun sends SIGKILL 30 s after its
SIGTERM unless `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (or `--shutdown-timeout`) says otherwise; the
checkpoint has to be written within it. Ctrl-C (SIGINT) still stops every rank at once.

torchrun also sends SIGTERM when it ends the ranks of a job in which one has failed (to restart
it, or to give up). A stop then would wait for the dead rank until SIGKILL, so a rank that finds
another rank of its host gone (their pid files, `<run_dir>/pids`) dies of the SIGTERM at once, as
without this module, also while its main thread is blocked in a C++ call (a collective waiting for
a rank of another host), where Python's handler cannot run until the call returns: the signal's
C-level wake-up byte (`signal.set_wakeup_fd`) is read by a thread (`_watch`), which makes the
check. A failure on another host is not seen that way: there the ranks wait until torchrun's
SIGKILL (30 s by default) before the restart.
The handler takes no lock that the code it interrupts could hold, and prints nothing; the one
thing it does besides noting the signal is the `act` of an `acting_on_request` block (a link
message, whose store and gloo calls the block's code, interrupted between two bytecodes, is
not in).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

EXIT_CODE = 128 + signal.SIGTERM


class _State:
    def __init__(self):
        self.reason: str | None = None
        self.signalled = threading.Event()  # set by the handler, once: starts the grace period
        self.stopping = threading.Event()  # this rank's part of the stop is under way: no limit
        self.act = None  # called when the stop is asked for (acting_on_request), or None


_state = _State()
_pid_dir = None
_wakeup: tuple | None = None  # (read end, write end, the wake-up fd set before ours)


def install(grace_s: float, pid_dir: str | os.PathLike | None = None) -> None:
    """Handle SIGTERM on this rank from now on (call from the main thread). `pid_dir`: where the
    ranks write `rank<N>.pid` (train_rl.py), for the check that this host's ranks are all alive."""
    global _state, _pid_dir
    _state, _pid_dir = _State(), pid_dir
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_grace, args=(_state, grace_s), name="sigterm-grace", daemon=True).start()
    if pid_dir is not None and _wakeup is None:
        _start_watch()


def _start_watch() -> None:
    global _wakeup
    r, w = socket.socketpair()
    w.setblocking(False)  # set_wakeup_fd's requirement: the C handler must never block
    previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    _wakeup = (r, w, previous)
    threading.Thread(target=_watch, args=(r,), name="sigterm-watch", daemon=True).start()


def _forget_in_child() -> None:
    """A forked child inherits the wake-up fd: its own signals would reach this process's
    watcher as if they were ours. (Forked from another thread, Python refuses to unset it there.)"""
    if _wakeup is not None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass


os.register_at_fork(after_in_child=_forget_in_child)


def _watch(r: socket.socket) -> None:
    """Every signal with a Python handler writes its number to the wake-up socket from C, at
    once, whatever the main thread is doing. A SIGTERM while a rank of this host is gone (torchrun
    ending a failed job) ends the process here, as the default action would; any other starts the
    grace period now (the handler's own part waits for the main thread)."""
    while True:
        try:
            data = r.recv(64)
        except OSError:
            return  # closed by uninstall
        if not data:
            return
        if signal.SIGTERM not in data:
            continue
        if _pid_dir is not None and not local_ranks_alive(_pid_dir):
            os._exit(EXIT_CODE)
        _state.signalled.set()


def uninstall(ignore: bool = False) -> None:
    """Back to the default SIGTERM (the process dies at once), or with `ignore` to none at all,
    for a rank whose run is over and that only has to exit: torchrun sends SIGTERM to the other
    ranks once the first has exited, and Python drops its handlers while it shuts down, so a
    handled SIGTERM there would still end the process by signal. Ends the grace thread."""
    global _state, _wakeup
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else signal.SIG_DFL)
    _state.stopping.set()
    _state.signalled.set()
    _state = _State()
    if _wakeup is not None:
        r, w, previous = _wakeup
        signal.set_wakeup_fd(previous)  # whoever had set one before install
        r.close()
        w.close()
        _wakeup = None


def _on_sigterm(signum, frame) -> None:
    s = _state
    if _pid_dir is not None and not local_ranks_alive(_pid_dir):
        os._exit(EXIT_CODE)  # torchrun ending a failed job: die now (as `_watch` does)
    if s.reason is None:  # a second SIGTERM (SLURM and torchrun each send one) changes nothing
        s.reason = "SIGTERM"
        s.signalled.set()
        _act(s)


def pid_file(pid_dir, rank: int) -> str:
    return os.path.join(pid_dir, f"rank{rank}.pid")


def write_pid(pid_dir, rank: int) -> None:
    """`<pid_dir>/rank<N>.pid`: for the check below, operators, and the fault tests."""
    os.makedirs(pid_dir, exist_ok=True)
    with open(pid_file(pid_dir, rank), "w") as f:
        f.write(f"{os.getpid()}\n")


def local_ranks_alive(pid_dir, env=os.environ) -> bool:
    """False when a rank of this host (torchrun numbers them RANK - LOCAL_RANK onwards) has
    exited; True where unknown (no pid file yet)."""
    rank, local = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    first = rank - local
    for r in range(first, first + int(env.get("LOCAL_WORLD_SIZE", "1"))):
        try:
            with open(pid_file(pid_dir, r)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, another user's (a reused pid)
    return True


def note_sigint() -> None:
    """From now on Ctrl-C (SIGINT) raises KeyboardInterrupt as by default, noted first
    (`interrupted`), so that what it makes fail otherwise is known for what it is: a DCP save
    wraps it in a CheckpointException (no Exception), and a rank blocked in a collective fails
    on a peer that it ended first. Call from the main thread; an ignored SIGINT stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


_sigint = False


def _on_sigint(signum, frame) -> None:
    global _sigint
    _sigint = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether a Ctrl-C reached this process since `note_sigint`."""
    return _sigint


def request(reason: str) -> None:
    """Ask for the stop without a signal (a generator's notice, fault injection)."""
    if _state.reason is None:
        _state.reason = reason
        _act(_state)


def requested() -> str | None:
    """Why this rank was asked to stop ('SIGTERM', ...), or None."""
    return _state.reason


@contextlib.contextmanager
def acting_on_request(act):
    """Within the block, a stop asked for (a SIGTERM, `request`) calls `act()` at once, also one
    asked for before the block: for a wait that only a peer's message ends, after which the
    caller would see it too late (a generator leader paused for the next weights passes its
    SIGTERM on to the trainer here; after the weights, the trainer had trained one more step).
    `act` runs on this thread, from the handler, between two bytecodes of the block: the block
    must not be in the middle of anything that `act` does (the paused leader only receives, `act`
    only sends). It should not raise: a failure is left to the caller's own check after the
    block (raised from the handler, it would break off the wait at an arbitrary point)."""
    s = _state
    s.act = act
    try:
        if s.reason is not None:
            _act(s)
        yield
    finally:
        s.act = None


def _act(s: _State) -> None:
    act, s.act = s.act, None  # once
    if act is not None:
        try:
            act()
        except Exception:
            pass  # acting_on_request: the caller's check after the block raises it


def stopping() -> None:
    """This rank has started its part of the stop (a checkpoint may take longer than grace_s), or
    the end of a finished run (the final export): waits with timeouts of their own follow, and
    the grace period no longer applies."""
    _state.stopping.set()


def _grace(state: _State, grace_s: float) -> None:
    state.signalled.wait()
    if state.stopping.wait(grace_s):
        return
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank}] SIGTERM {grace_s:g}s ago and the run has not stopped (no trainer "
          f"step boundary reached it): exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)
