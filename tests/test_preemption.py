"""launch/preemption.py: SIGTERM sets a flag instead of killing; a rank whose run does not stop
within the grace period exits with 143 and says why. (The stop itself, end to end under
torchrun: tests/test_faults.py.)"""
import os
import signal
import subprocess
import sys
import textwrap

from launch import preemption
from tests.test_e2e import ROOT


def test_sigterm_sets_the_flag_once_and_uninstall_restores_the_default():
    preemption.install(grace_s=60)
    try:
        assert preemption.requested() is None
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: the test survives
        assert preemption.requested() == "SIGTERM"
        preemption.request("SIGTERM on generator rank 2")  # a later reason does not replace it
        assert preemption.requested() == "SIGTERM"
        preemption.stopping()
    finally:
        preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and preemption.requested() is None


def _child(body: str) -> subprocess.CompletedProcess:
    code = "import os, signal, time\nfrom launch import preemption\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "RANK": "5"})


def test_a_rank_that_does_not_stop_within_the_grace_period_exits_143_and_says_why():
    proc = _child("""
        preemption.install(grace_s=0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    assert proc.returncode == preemption.EXIT_CODE == 143
    assert "[rank 5] SIGTERM 0.5s ago and the run has not stopped" in proc.stderr


def test_a_rank_that_starts_stopping_in_time_is_not_cut_off():
    proc = _child("""
        preemption.install(grace_s=0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        preemption.stopping()  # e.g. a checkpoint that takes longer than the grace period
        time.sleep(1.0)
        print(preemption.requested())
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "SIGTERM", proc.stderr


def test_a_finished_rank_ignores_sigterm_while_it_exits():
    """torchrun SIGTERMs the other ranks once the first has exited: a rank already done must end
    with its own exit code, not die by the signal."""
    proc = _child("""
        preemption.install(grace_s=60)
        preemption.uninstall(ignore=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        raise SystemExit(preemption.EXIT_CODE)
    """)
    assert proc.returncode == 143, proc.stderr


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped, as torchrun reaps a failed rank before it ends the others
    return proc.pid


def test_local_ranks_alive_reads_this_hosts_pid_files(tmp_path):
    for r, pid in {4: os.getpid(), 5: os.getpid(), 6: _dead_pid()}.items():
        (tmp_path / f"rank{r}.pid").write_text(f"{pid}\n")
    host = {"RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}  # this host: ranks 4, 5
    assert preemption.local_ranks_alive(tmp_path, host)
    assert not preemption.local_ranks_alive(tmp_path, {**host, "LOCAL_WORLD_SIZE": "3"})  # 4-6
    assert preemption.local_ranks_alive(tmp_path / "none", host)  # no pid files yet: unknown


def test_sigterm_after_a_rank_of_this_host_died_kills_at_once(tmp_path):
    """torchrun ending the survivors of a failed job: no stop that would wait for the dead rank."""
    (tmp_path / "rank0.pid").write_text(f"{_dead_pid()}\n")
    proc = _child(f"""
        os.environ.update(RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
        preemption.install(grace_s=60, pid_dir={str(tmp_path)!r})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    """)
    assert proc.returncode == preemption.EXIT_CODE, (proc.returncode, proc.stderr)


# A child whose main thread blocks in a C++ call (a store wait, as a collective on a rank of
# another host would): Python's SIGTERM handler cannot run until it returns. The signal comes
# only once the main thread is inside the call; `blocked()` returns after 30 s.
_BLOCKED_CHILD = """
    from datetime import timedelta
    import sys, threading
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    main = threading.get_ident()

    def signal_once_waiting():
        while sys._current_frames()[main].f_code.co_name != "blocked":
            time.sleep(0.01)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    def blocked():
        store.wait(["never"], timedelta(seconds=30))
    threading.Thread(target=signal_once_waiting, daemon=True).start()
    blocked()
    print("returned", flush=True)
"""


def _blocked_child(set_up: str) -> subprocess.CompletedProcess:
    return _child(textwrap.dedent(set_up) + textwrap.dedent(_BLOCKED_CHILD))


def test_sigterm_after_a_rank_of_this_host_died_kills_even_a_rank_blocked_in_cpp(tmp_path):
    """It waited the call's whole timeout (30 s here), then died."""
    (tmp_path / "rank0.pid").write_text(f"{_dead_pid()}\n")
    proc = _blocked_child(f"""
        os.environ.update(RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
        preemption.install(grace_s=60, pid_dir={str(tmp_path)!r})
    """)
    assert proc.returncode == preemption.EXIT_CODE and "returned" not in proc.stdout, (
        proc.returncode, proc.stdout, proc.stderr[-2000:])


def test_the_grace_period_runs_while_the_main_thread_is_blocked_in_cpp(tmp_path):
    """Every rank of this host alive: a SIGTERM's grace period starts at the signal, not when the
    call returns, so a rank that no stop reaches still exits `grace_s` after it."""
    proc = _blocked_child(f"""
        os.environ.update(RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="1")
        preemption.write_pid({str(tmp_path)!r}, 1)
        preemption.install(grace_s=0.5, pid_dir={str(tmp_path)!r})
    """)
    assert proc.returncode == preemption.EXIT_CODE and "returned" not in proc.stdout, (
        proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "the run has not stopped" in proc.stderr
