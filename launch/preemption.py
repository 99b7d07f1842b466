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
check. torchrun ends the ranks of that host only, and those died silently: where one was the
trainer's first rank or a generator replica's leader, the other hosts learnt of the failure from
what broke next, or waited for it until parallel.timeout_s (the trainer, for groups that a dead
node's replicas would have made) and failed with a time-out naming neither rank nor node. So,
once the job's process group exists (`write_pid`), the dying rank first records the failure in the
job's store, the first one only (`_record_failure`, at most FAILURE_WRITE_S, over a connection of
its own), and a thread on every host's first rank looks for it every FAILURE_POLL_S
(`_read_failures`): one of another host prints one line naming it and exits with 1 (under
--max-restarts its agent counts a restart too), and its torchrun ends the rest of its host. A
rank signalled alone or by a restart (every rank of its host alive) records nothing, nor does a
node whose ranks all ended on their own (one rank a node: its own error path tells its peers).
The handler takes no lock that the code it interrupts could hold, and prints nothing; the one
thing it does besides noting the signal is the `act` of an `acting_on_request` block (a link
message, whose store and gloo calls the block's code, interrupted between two bytecodes, is
not in). Store calls are the threads' only.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading

EXIT_CODE = 128 + signal.SIGTERM
FAILED_KEY = "first"  # under attempt_store("failed"): {"node", "what"} of the first failure
FAILURE_POLL_S = 1.0  # how often a host's first rank looks for another host's failure
FAILURE_WRITE_S = 2.0  # how long a dying rank tries to record it (its store may be gone with it)


class _State:
    def __init__(self):
        self.reason: str | None = None
        self.signalled = threading.Event()  # set by the handler, once: starts the grace period
        self.stopping = threading.Event()  # this rank's part of the stop is under way: no limit
        self.act = None  # called when the stop is asked for (acting_on_request), or None


_state = _State()
_pid_dir = None
_wakeup: tuple | None = None  # (read end, write end, the wake-up fd set before ours)
_failures = None  # the job's store, under attempt_store("failed"): where failures are recorded
_reader: tuple | None = None  # (thread, stop event) of `_read_failures`, on a host's first rank
_own_pid_file: str | None = None  # this rank's, removed as it finishes (`uninstall`)


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
    watcher as if they were ours. (Forked from another thread, Python refuses to unset it there.)
    It has none of the threads either: its handler records no failure (`_on_sigterm`)."""
    global _failures, _reader
    _failures = _reader = None
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
    grace period now (the handler's own part waits for the main thread). Before it ends the
    process, the failure is recorded for the other hosts (`_record_failure`)."""
    while True:
        try:
            data = r.recv(64)
        except OSError:
            return  # closed by uninstall
        if not data:
            return
        if signal.SIGTERM not in data:
            continue
        gone = exited_ranks()
        if gone:
            _record_failure(gone)
            os._exit(EXIT_CODE)
        _state.signalled.set()


def uninstall(ignore: bool = False) -> None:
    """Back to the default SIGTERM (the process dies at once), or with `ignore` to none at all,
    for a rank whose run is over and that only has to exit: torchrun sends SIGTERM to the other
    ranks once the first has exited, and Python drops its handlers while it shuts down, so a
    handled SIGTERM there would still end the process by signal. Ends the grace thread, and the
    sharing of failures (`share_failures`); with `ignore`, this rank's pid file goes too: a rank of
    its host that torchrun signals once this one has exited (143 after a stop) must not take
    that for a failure, nor record one."""
    global _state, _wakeup, _failures, _reader, _own_pid_file
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else signal.SIG_DFL)
    _state.stopping.set()
    _state.signalled.set()
    _state = _State()
    if _reader is not None:
        thread, stop = _reader
        stop.set()
        thread.join(FAILURE_POLL_S)  # one store call at most: none is under way at exit
        _reader = None
    _failures = None
    if ignore and _own_pid_file is not None:
        with contextlib.suppress(OSError):
            os.remove(_own_pid_file)
    _own_pid_file = None
    if _wakeup is not None:
        r, w, previous = _wakeup
        signal.set_wakeup_fd(previous)  # whoever had set one before install
        r.close()
        w.close()
        _wakeup = None


def _on_sigterm(signum, frame) -> None:
    s = _state
    if _pid_dir is not None and not local_ranks_alive(_pid_dir):
        if _failures is None:
            os._exit(EXIT_CODE)  # torchrun ending a failed job: die now (as `_watch` does)
        return  # `_watch` records the failure, then ends the process (the handler: no store call)
    if s.reason is None:  # a second SIGTERM (SLURM and torchrun each send one) changes nothing
        s.reason = "SIGTERM"
        s.signalled.set()
        _act(s)


def pid_file(pid_dir, rank: int) -> str:
    return os.path.join(pid_dir, f"rank{rank}.pid")


def write_pid(pid_dir, rank: int) -> None:
    """`<pid_dir>/rank<N>.pid`: for the check below, operators, and the fault tests. Written once
    the job's process group exists (train_rl.py): from then on this rank shares failures with the
    other hosts (`share_failures`, where `install` was given this pid directory)."""
    global _own_pid_file
    os.makedirs(pid_dir, exist_ok=True)
    path = pid_file(pid_dir, rank)
    with open(path, "w") as f:
        f.write(f"{os.getpid()}\n")
    if _pid_dir is not None and os.path.abspath(pid_dir) == os.path.abspath(_pid_dir):
        _own_pid_file = path
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            share_failures()


def local_ranks_alive(pid_dir, env=os.environ) -> bool:
    """False when a rank of this host has exited (`gone_ranks`)."""
    return not gone_ranks(pid_dir, env)


def exited_ranks() -> list[int]:
    """`gone_ranks` of the pid directory `install` was given; none without one."""
    return gone_ranks(_pid_dir) if _pid_dir is not None else []


def gone_ranks(pid_dir, env=os.environ) -> list[int]:
    """The ranks of this host (torchrun numbers them RANK - LOCAL_RANK onwards) that have
    exited; none where unknown (no pid file: not written yet, or removed by a finished rank)."""
    rank, local = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    first, gone = rank - local, []
    for r in range(first, first + int(env.get("LOCAL_WORLD_SIZE", "1"))):
        try:
            with open(pid_file(pid_dir, r)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue
        if _exited(pid):
            gone.append(r)
    return gone


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's (a reused pid)
    # dead but not yet reaped by its torchrun agent (a zombie, Linux): a peer that a SIGKILL
    # (the kernel's out-of-memory killer) just ended, as its closed connections wake this rank
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[:1] == ["Z"]
    except OSError:
        return False


# ----- failures shared between hosts (module docstring) ---------------------------------------
def share_failures(store=None) -> None:
    """From now on, a failure that torchrun ends this host's ranks for is recorded in the job's
    `store` (default: the process group's; its keys per torchrun attempt), and one recorded by
    another host ends this one, with a line naming it (on the host's first rank; the others go
    when torchrun ends them). Only after `install` with a pid directory; once."""
    global _failures, _reader
    if _wakeup is None or _failures is not None:
        return
    from trainer.link import attempt_store  # the job's store and key prefixes, as the link's
    failures = attempt_store("failed", store)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        try:  # a connection of its own: a poll must not wait behind the main thread's calls
            waiter = failures.clone()
        except (RuntimeError, NotImplementedError):
            waiter = None  # a store without clone() (not torchrun's): failures are only recorded
        if waiter is not None:
            stop = threading.Event()
            thread = threading.Thread(target=_read_failures, args=(waiter, stop),
                                      name="failure-watch", daemon=True)
            thread.start()
            _reader = (thread, stop)
    _failures = failures


def _record_failure(gone: list[int]) -> None:
    """Best effort: that the ranks `gone` of this host exited, unless a failure was recorded
    first (another's on this host is its consequence) or Ctrl-C ends the run (no failure). From
    `_watch`, over a connection of its own (the main thread may be in a call on the process
    group's), for at most FAILURE_WRITE_S: a store that lived on this host may be gone, and a
    connection to it is retried until the store's timeout."""
    store = _failures
    if store is None or interrupted():
        return
    node = os.environ.get("GROUP_RANK", "0")  # torchrun's node rank
    what = (f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} (host "
            f"{socket.gethostname()}, node {node}) exited, and torchrun ended the other ranks of "
            "that node")
    value = json.dumps({"node": node, "what": what})

    def record():
        with contextlib.suppress(Exception):
            store.clone().compare_set(FAILED_KEY, "", value)  # the first stays

    thread = threading.Thread(target=record, name="failure-record", daemon=True)
    thread.start()
    thread.join(FAILURE_WRITE_S)


def recorded_failure() -> str | None:
    """The failure a host recorded (`_record_failure`), or None: for an error that would name
    only a lost peer (trainer/link.py), as the host's dying ranks may close their connections
    before this host's reader sees the record."""
    store = _failures
    if store is None:
        return None
    try:
        if not store.check([FAILED_KEY]):
            return None
        return json.loads(store.get(FAILED_KEY))["what"]
    except Exception:
        return None


def _read_failures(store, stop: threading.Event) -> None:
    """Every FAILURE_POLL_S, whether a host recorded a failure; one of another host's: a line
    naming it, and exit 1 (torchrun then ends this host's other ranks). A poll, not a wait on the
    key: nothing else could end that wait (a thread still in one at exit can abort the process:
    trainer/link.py), and a timed-out one logs a c10d warning."""
    node = os.environ.get("GROUP_RANK", "0")
    while not stop.wait(FAILURE_POLL_S):
        try:
            if not store.check([FAILED_KEY]):
                continue
            failure = json.loads(store.get(FAILED_KEY))
            where, what = failure["node"], failure["what"]
        except Exception:
            return  # the store is gone: the job is ending (its own errors say why)
        if where == node or interrupted() or stop.is_set():
            return  # this host's own failure: torchrun is ending its ranks already
        print(f"error (rank {os.environ.get('RANK', '0')}): the run failed on another node: "
              f"{what}; that node's log has the cause. This rank exits too",
              file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(1)


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
    why = (f"SIGTERM {grace_s:g}s ago and the run has not stopped (no trainer step boundary "
           f"reached it): exiting")
    print(f"[rank {rank}] {why}", file=sys.stderr, flush=True)
    _leave_cause(int(rank), f"rank {rank}: {why} (its grace period, parallel.timeout_s)")
    os._exit(EXIT_CODE)


def _leave_cause(rank: int, why: str, wait_s: float = 2.0) -> None:
    """Leave why this rank exits where its peers look when it is gone (`trainer.link.left_error`:
    a TP leader, the trainer), else they named only gloo's "Connection reset". From a thread
    waited for at most `wait_s`: a store that no longer answers must not hold the exit."""
    def leave():
        import torch.distributed as dist

        from trainer.link import leave_error
        if dist.is_available() and dist.is_initialized():
            leave_error(rank, why)
    t = threading.Thread(target=leave, name="tandem-grace-cause", daemon=True)
    t.start()
    t.join(wait_s)
