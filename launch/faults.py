"""Fault injection for resilience tests (and game days): with
    TANDEM_FAULT_KILL="rank=R,step=S[,signal=INT|TERM]"
rank R SIGKILLs itself when it reaches trainer step S (a trainer rank, at the start of the step) or
weights version S (a generator rank, when the version arrives), on the first attempt only, so the
restarted job runs through. `signal=INT` sends SIGINT to its launcher (the torchrun agent) instead,
which passes it to every rank as Ctrl-C in a terminal does; `signal=TERM` sends SIGTERM, as SLURM
or `kill` of the launcher does (launch/preemption.py); `signal=TERM_SELF` sends it to rank R alone
(one node of several preempted). Unset, it costs one dict lookup per step."""
from __future__ import annotations

import os
import signal


def maybe_kill(rank: int, step: int) -> None:
    spec = os.environ.get("TANDEM_FAULT_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    fields = dict(kv.split("=", 1) for kv in spec.split(","))
    if int(fields["rank"]) == rank and int(fields["step"]) == step:
        name = fields.get("signal", "KILL")
        if name == "TERM_SELF":
            print(f"[rank {rank}] fault injection: SIGTERM to this rank alone at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if name in ("INT", "TERM"):
            print(f"[rank {rank}] fault injection: SIG{name} to the launcher at step {step}", flush=True)
            os.kill(os.getppid(), getattr(signal, f"SIG{name}"))
            return
        print(f"[rank {rank}] fault injection: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
