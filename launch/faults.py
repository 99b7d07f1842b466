"""Fault injection for resilience tests (and game days): with
    TANDEM_FAULT_KILL="rank=R,step=S[,signal=KILL|INT|TERM|TERM_SELF|RAISE]"
rank R SIGKILLs itself when it reaches trainer step S (a trainer rank, at the start of the step) or
weights version S (a generator rank, when the version arrives), or with S = 0 at the end of its
start-up (either role: model, link, weight sync, engine or optimizer, a resumed run's state all
set up, nothing generated or trained yet), on the first attempt only, so the restarted job runs
through. `signal=INT` sends SIGINT to its launcher (the torchrun agent) instead, which passes it to
every rank as Ctrl-C in a terminal does; `signal=TERM` sends SIGTERM, as SLURM or `kill` of the
launcher does (launch/preemption.py); `signal=TERM_SELF` sends it to rank R alone (one node of
several preempted); `signal=RAISE` raises a RuntimeError, a failure of the rank's own (a corrupt
file, a full disk, out of memory). A value not of that form is a ValueError at the first step, not
another fault than the one asked for. Unset, it costs one dict lookup per step."""
from __future__ import annotations

import functools
import os
import signal

SIGNALS = ("KILL", "INT", "TERM", "TERM_SELF", "RAISE")


@functools.lru_cache(maxsize=None)
def parse_spec(spec: str) -> tuple[int, int, str]:
    """TANDEM_FAULT_KILL's value as (rank, step, signal name)."""
    fields = {}
    for kv in spec.split(","):
        key, eq, value = kv.partition("=")
        fields[key.strip()] = value.strip() if eq else ""
    name = fields.pop("signal", "KILL")
    try:
        rank, step = int(fields.pop("rank")), int(fields.pop("step"))
    except (KeyError, ValueError):
        rank = step = None
    if rank is None or fields or name not in SIGNALS:
        raise ValueError(f"TANDEM_FAULT_KILL={spec!r} is not of the form rank=R,step=S[,signal=S] "
                         f"with integers R and S and a signal one of {', '.join(SIGNALS)} (e.g. "
                         "TANDEM_FAULT_KILL=rank=1,step=3,signal=TERM); unset it for no fault")
    return rank, step, name


def maybe_kill(rank: int, step: int) -> None:
    spec = os.environ.get("TANDEM_FAULT_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    fault_rank, fault_step, name = parse_spec(spec)
    if fault_rank == rank and fault_step == step:
        if name == "RAISE":
            where = "the end of start-up" if step == 0 else f"step {step}"
            raise RuntimeError(f"fault injection: a failure on rank {rank} at {where}")
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
