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
