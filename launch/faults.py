"""Fault injection for resilience tests (and game days): with
    TANDEM_FAULT_KILL="rank=R,step=S[,signal=KILL|INT|TERM|TERM_SELF|RAISE][,groups=G]"
rank R SIGKILLs itself when it reaches trainer step S (a trainer rank, at the start of the step) or
weights version S (a generator rank, when the version arrives), or with S = 0 at the end of its
start-up (either role: model, link, weight sync, engine or optimizer, a resumed run's state all
set up, nothing generated or trained yet), on the first attempt only, so the restarted job runs
through. `signal=INT` sends SIGINT to its launcher (the torchrun agent) instead, which passes it to
every rank as Ctrl-C in a terminal does; `signal=TERM` sends SIGTERM, as SLURM or `kill` of the
launcher does (launch/preemption.py); `signal=TERM_SELF` sends it to rank R alone (one node of
several preempted); `signal=RAISE` raises a RuntimeError, a failure of the rank's own (a corrupt
file, a full disk, out of memory). With `groups=G` a generator rank (of a replica without
generator TP) acts instead once it has shipped G groups since weights version S arrived (in a
synchronous run: inside that version's batch, so G below the replica's share of
trainer.prompts_per_step), shipping no more before, and then generates nothing more until the
trainer asks for a checkpoint or shuts down: a stop cuts that batch with groups in flight. A
value not of that form is a ValueError at the first step, not another fault than the one asked
for. A spec that cannot act in this job's layout (a rank it does not have, a step past
trainer.max_steps, groups=G where no rank ships groups that way) is refused by preflight
(`check_spec`) rather than running a job that never sees the fault. Unset, it costs an
environment lookup per step and per shipment of groups."""
from __future__ import annotations

import functools
import os
import signal

SIGNALS = ("KILL", "INT", "TERM", "TERM_SELF", "RAISE")


@functools.lru_cache(maxsize=None)
def parse_spec(spec: str) -> tuple[int, int, str, int | None]:
    """TANDEM_FAULT_KILL's value as (rank, step, signal name, groups or None)."""
    fields = {}
    for kv in spec.split(","):
        key, eq, value = kv.partition("=")
        fields[key.strip()] = value.strip() if eq else ""
    name = fields.pop("signal", "KILL")
    try:
        rank, step = int(fields.pop("rank")), int(fields.pop("step"))
        groups = int(fields.pop("groups")) if "groups" in fields else None
    except (KeyError, ValueError):
        rank = step = groups = None
    if rank is None or fields or name not in SIGNALS or (groups is not None and groups < 1):
        raise ValueError(f"TANDEM_FAULT_KILL={spec!r} is not of the form rank=R,step=S[,signal=S]"
                         f"[,groups=G] with integers R, S and G >= 1 and a signal one of "
                         f"{', '.join(SIGNALS)} (e.g. TANDEM_FAULT_KILL=rank=1,step=3,signal=TERM); "
                         "unset it for no fault")
    return rank, step, name, groups


def check_spec(dims, max_steps: int, max_staleness: int, batch_groups: int) -> None:
    """Preflight: TANDEM_FAULT_KILL (on a job's first attempt) names a fault this job can reach,
    in the layout `dims` (parallel.dims.ParallelDims); a malformed one is refused here too."""
    spec = _spec()
    if spec is None:
        return
    rank, step, _, groups = parse_spec(spec)
    why = _unreachable(dims, rank, step, groups, max_steps, max_staleness, batch_groups)
    if why:
        raise ValueError(f"TANDEM_FAULT_KILL={spec!r} would never act in this job: {why}; "
                         "name a fault this job reaches, or unset it")


def _unreachable(dims, rank: int, step: int, groups: int | None, max_steps: int,
                 max_staleness: int, batch_groups: int) -> str | None:
    """Why rank `rank` never reaches `step` (with `groups`) in this job, else None."""
    if not 0 <= rank < dims.world_size:
        return f"rank {rank} is not one of its ranks 0..{dims.world_size - 1}"
    if not 0 <= step <= max_steps:
        return f"step {step} is not one of its steps 0..{max_steps} (trainer.max_steps)"
    if groups is None:
        return None
    if dims.mode == "colocated" or not dims.is_generator(rank):
        return (f"groups={groups} acts on a generator rank of a split run, and rank {rank} is "
                f"{'a colocated rank' if dims.mode == 'colocated' else 'a trainer rank'}")
    if dims.gen_tp > 1:
        return (f"groups={groups} acts on a replica without generator TP, and this job has "
                f"gen_tp={dims.gen_tp}")
    from rollout.worker import replica_share
    share = replica_share(batch_groups, dims.gen_dp, dims.generator_coord(rank)[0])
    if max_staleness == 0 and groups > share:
        return (f"a synchronous run's generator rank {rank} ships {share} groups per version "
                f"(its share of trainer.prompts_per_step={batch_groups}), fewer than groups="
                f"{groups}")
    return None


_fired: set[str] = set()  # the specs with `groups` that have acted (once each)


def _spec() -> str | None:
    """TANDEM_FAULT_KILL on a job's first attempt (None: unset, or a restarted job)."""
    spec = os.environ.get("TANDEM_FAULT_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return spec


def groups_cap(rank: int, step: int, sent: int, ready: int) -> int:
    """How many of `ready` scored groups a generator rank ships now, `sent` of version `step`'s
    already shipped: all, unless a groups=G spec names this rank and version and has not acted
    yet: then up to G in all, the others kept in flight for the stop's cut."""
    spec = _spec()
    if spec is None or spec in _fired:
        return ready
    fault_rank, fault_step, _, fault_groups = parse_spec(spec)
    if fault_groups is None or (fault_rank, fault_step) != (rank, step):
        return ready
    return min(ready, max(fault_groups - sent, 0))


def maybe_kill(rank: int, step: int, groups: int | None = None) -> bool:
    """The fault, if TANDEM_FAULT_KILL names this rank at this step (`groups`: a generator's
    groups shipped so far of version `step`; a spec with groups acts only on those calls).
    True where a signal was sent and the rank goes on (INT, TERM, TERM_SELF)."""
    spec = _spec()
    if spec is None:
        return False
    fault_rank, fault_step, name, fault_groups = parse_spec(spec)
    if (fault_rank, fault_step) != (rank, step) or (fault_groups is None) != (groups is None):
        return False
    if fault_groups is not None:
        if groups < fault_groups or spec in _fired:
            return False
        _fired.add(spec)
    if name == "RAISE":
        where = "the end of start-up" if step == 0 else f"step {step}"
        raise RuntimeError(f"fault injection: a failure on rank {rank} at {where}")
    if name == "TERM_SELF":
        print(f"[rank {rank}] fault injection: SIGTERM to this rank alone at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        return True
    if name in ("INT", "TERM"):
        print(f"[rank {rank}] fault injection: SIG{name} to the launcher at step {step}", flush=True)
        os.kill(os.getppid(), getattr(signal, f"SIG{name}"))
        return True
    print(f"[rank {rank}] fault injection: SIGKILL at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return False  # not reached
