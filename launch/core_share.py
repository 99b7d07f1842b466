"""How much k busy ranks slow each other on shared CPU cores, measured with the ranks' own work.

    curve = slowdown_curve(args, workload, micro_batch_tokens, max_ranks=4)  # [[k, slowdown, cv]]

`max_ranks` probe processes start once (torch is imported once each) and build the profiled model.
On command, a process runs what a rank runs for a fixed wall-clock window, and reports its rate:
  * "gen": engine decode steps, one step's samples in flight, refilled as they finish (the
    generator loop's link poll costs nothing while no message came: trainer/link.py's watcher);
  * "train": real train steps.
slowdown(k) = the mean over k processes of (its kind's rate alone) / (its rate beside the others),
kinds alternating gen, train, gen, ... as in a split job. All k stop at the same deadline, so none
runs its tail alone.

cv(k) is the spread of a phase's duration among k busy ranks: a phase is one generation batch
(from admitting the step's prompts to the next admission) or one train step, and cv is the root
mean square of (phase / mean phase of its kind in that window - 1) over the phases that ended
by the deadline. Time-sharing serves the processes unevenly (at 3 ranks on 2 cores one of them
often holds a core alone for a whole window), so a phase of fixed work ends early or late;
where ranks wait for each other (the staleness gate, a batch from several generator replicas)
that spread lengthens the step (launch/pipeline.py).

Generator TP pairs (`pair_probes`) are measured apart: k/2 pairs of real gloo ranks decode on a
TP=2 model at once, against one pair alone. A TP decode step is mostly waiting on its peer in the
all-reduces (2 ranks, 2 cores: ~3 ms per collective, ~0.6 ms of compute per step), and a waiting
rank leaves its core to the others, so two pairs slow each other ~1.6-1.9x where k compute-bound
ranks measure s(4) = 2.3-2.5; with s(4), colocated gen 2x2 / train 2x2 came out +30-39%
(bench/plan_vs_measured.py, 2026-11-30: its generation phase ran 1.79x its alone time).

Why the ranks' own work: a pure-Python loop (this probe's first version) lives in L1 and misses
what time-sharing costs real ranks. At 4 processes on 2 cores it measured 1.89-1.97 where 4-rank
RL runs spent ~1.3x their alone-time of CPU per step (BENCHMARKS.md, "Planner").
"""
from __future__ import annotations

import dataclasses
import json
import math
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KINDS = ("gen", "train")


def slowdown_curve(args, wl, micro_batch_tokens: int, max_ranks: int, seconds: float = 0.6,
                   rounds: int = 2, timeout_s: float = 120.0) -> list:
    """[[k, slowdown, cv]] for k = 1..max_ranks (module docstring); slowdown(1) is 1 by
    definition here: the alone rates are the best of the rounds, so other users' load enters
    where it lowers the contended rates."""
    spec = json.dumps({"args": dataclasses.asdict(args), "wl": dataclasses.asdict(wl),
                       "mbt": micro_batch_tokens})
    procs: list[_Probe] = []
    try:
        for _ in range(max_ranks):
            procs.append(_Probe(spec, timeout_s))
        for p in procs:
            p.wait_ready()
        alone = {kind: 0.0 for kind in KINDS}
        spread: dict[int, list] = {k: [] for k in range(1, max_ranks + 1)}  # relative deviations
        together: dict[int, list] = {k: [] for k in range(2, max_ranks + 1)}  # rates per round
        for _ in range(rounds):  # interleaved, so a burst of outside load does not hit one k only
            for kind in KINDS:
                ((rate, phases),) = _run(procs[:1], [kind], seconds)
                alone[kind] = max(alone[kind], rate)
                spread[1] += _deviations([phases])
            for k in together:
                kinds = [KINDS[i % 2] for i in range(k)]
                runs = _run(procs[:k], kinds, seconds)
                together[k].append([rate for rate, _ in runs])
                for kind in KINDS:
                    spread[k] += _deviations([ph for kd, (_, ph) in zip(kinds, runs) if kd == kind])
        curve = [[1, 1.0, _rms(spread[1])]]
        for k, runs in together.items():
            kinds = [KINDS[i % 2] for i in range(k)]
            per_round = [statistics.mean(alone[kd] / r for kd, r in zip(kinds, rates)) for rates in runs]
            curve.append([k, max(1.0, statistics.median(per_round)), _rms(spread[k])])
        return curve
    finally:
        for p in procs:
            p.close()


def pair_probes(args, wl, max_ranks: int, rounds: int = 3, steps: int = 0,
                timeout_s: float = 300.0) -> dict:
    """Measurements on the colocated generator's mesh (max_ranks // 2 replicas of TP 2, real gloo
    ranks): "tp_concurrency", [[k, slowdown]] of generator TP=2 pairs, k = 2, 4, .. max_ranks
    (module docstring), each replica decoding its share of the step's prompts (`steps` decode
    steps, default one batch's response length); slowdown(2) = 1: one pair alone, the case the
    two-rank TP probe measures (launch/calibrate.py); and "coloc_gather", [[k, s]]: the
    colocated step's exchange of groups among all k ranks (launch/calibrate.py's gather_time).
    {} where there is nothing to measure: fewer than two pairs, or a model TP 2 cannot shard
    (tied embeddings, heads 2 does not divide: launch.plan.tp_degrees)."""
    from launch.plan import tp_degrees
    pairs = max_ranks // 2
    if pairs < 2 or 2 not in tp_degrees(args, 2, one_host=True):
        return {}
    from parallel.spawn import run_ranks
    steps = steps or wl.response_len
    runs = run_ranks(_pair_rank, 2 * pairs, dataclasses.asdict(args), dataclasses.asdict(wl),
                     steps, rounds, timeout=timeout_s)
    return {"tp_concurrency": pair_slowdowns([r["runs"] for r in runs], pairs, rounds),
            "coloc_gather": [runs[0]["gather"]]}


def pair_slowdowns(runs: list, pairs: int, rounds: int) -> list:
    """The curve from each rank's [[round, active pairs, start, [step end times]]]. Per round, the
    first pair's rate alone against each active rank's rate in the window where every active
    rank was running (none is timed while it runs alone), taken between the first and the last
    step that ended inside it; the median over rounds. Alone and together are compared within
    one round: the machine's speed drifts by 10-30% between rounds (an alone step took 16-22 ms
    over six rounds of one run)."""
    curve = [[2, 1.0]]
    for j in range(2, pairs + 1):
        per_round = []
        for rnd in range(rounds):
            alone = statistics.mean(len(ends) / (ends[-1] - t0) for r in runs[:2]
                                    for rd, jj, t0, ends in r if (rd, jj) == (rnd, 1))
            mine = [(t0, ends) for r in runs[:2 * j] for rd, jj, t0, ends in r if (rd, jj) == (rnd, j)]
            lo, hi = max(t0 for t0, _ in mine), min(ends[-1] for _, ends in mine)
            per_round.append(statistics.mean(alone / _rate_within(ends, lo, hi) for _, ends in mine))
        curve.append([2 * j, max(1.0, statistics.median(per_round))])
    return curve


def _rate_within(ends: list, lo: float, hi: float) -> float:
    """Steps per second between the first and the last of `ends` inside [lo, hi]."""
    inside = [e for e in ends if lo <= e <= hi]
    if len(inside) < 2:
        raise RuntimeError(f"the TP pairs overlapped for {hi - lo:.3f} s, too short to time a step; "
                           "raise the probe's steps")
    return (len(inside) - 1) / (inside[-1] - inside[0])


def _pair_rank(rank: int, world: int, args_d: dict, wl_d: dict, steps: int, rounds: int) -> dict:
    """One rank of `pair_probes`: for each round and each count j of active pairs, the first j
    pairs decode `steps` steps while the others wait on the store (blocked in a socket read: a
    rank waiting inside gloo used CPU for ~2/3 of an all-reduce's wall time here, which would
    take cores from the pairs being timed)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from launch.calibrate import gather_time
    from launch.cost_model import Workload
    from model.args import ModelArgs
    from parallel.sharding import build_model, parallelize_generator
    args, wl = ModelArgs(**args_d), Workload(**wl_d)
    pairs = world // 2
    mesh = init_device_mesh("cpu", (pairs, 2), mesh_dim_names=("dp", "tp"))
    model = build_model(args, torch.device("cpu"), torch.float32,
                        parallelize=lambda m: parallelize_generator(m, mesh))
    gen, engine = _decoder(model, args, wl, -(-wl.prompts_per_step // pairs))
    gen()
    while engine.has_work():  # warm-up: one whole batch
        gen()
    store, out = dist.distributed_c10d._get_default_store(), []
    for rnd in range(rounds):
        for j in range(1, pairs + 1):
            dist.barrier()
            key = f"tp_pairs/{rnd}/{j}"
            if rank < 2 * j:
                t0, ends = time.perf_counter(), []
                for _ in range(steps):
                    gen()
                    ends.append(time.perf_counter())
                out.append([rnd, j, t0, ends])
                if store.add(key, 1) == 2 * j:
                    store.set(key + "/all", "1")
            store.wait([key + "/all"], timedelta(seconds=120))
    return {"runs": out, "gather": [world, gather_time(rank, world, wl)]}


def _deviations(per_process: list) -> list:
    """Each phase's relative deviation from the mean phase of all processes of one kind in one
    window: a process that the scheduler serves less than its peers counts as late."""
    phases = [x for ph in per_process for x in ph]
    if len(phases) < 2:
        return []
    mean = statistics.mean(phases)
    return [x / mean - 1 for x in phases] if mean > 0 else []


def _rms(devs: list) -> float:
    return math.sqrt(sum(d * d for d in devs) / len(devs)) if devs else 0.0


def _run(procs, kinds, seconds: float) -> list[tuple[float, list]]:
    """(rate, complete phase durations) per process."""
    for p, kind in zip(procs, kinds):  # all commands first: they start within microseconds
        p.send(f"{kind} {seconds}")
    return [p.result() for p in procs]


class _Probe:
    """One probe process; its stdout is read by a thread, so that every wait has a timeout."""

    def __init__(self, spec: str, timeout_s: float):
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.core_share", spec],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)  # end of output: the process exited

    def _line(self, what: str) -> str:
        try:
            line = self.lines.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"a core-sharing probe process (pid {self.proc.pid}) sent nothing "
                               f"within {self.timeout_s:g} s while {what} was due") from None
        if line is None:
            raise RuntimeError(f"a core-sharing probe process exited (code {self.proc.wait()}) "
                               f"before sending {what}; its traceback is above (stderr)")
        return line

    def wait_ready(self) -> None:
        if self._line("its ready line") != "ready":
            raise RuntimeError("a core-sharing probe process did not start as expected")

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def result(self) -> tuple[float, list]:
        d = json.loads(self._line("its rate"))
        return d["rate"], d["phases"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def _decoder(model, args, wl, prompts: int):
    """(a callable running one engine step, refilling the batch of `prompts` groups when it is
    done and returning True where a new batch (a phase) begins; the engine)."""
    from rollout.engine import Engine, Request, SamplingParams
    engine = Engine(model, num_slots=prompts * wl.group_size, max_len=wl.prompt_len + wl.response_len + 1)
    prompt = [3 + i % max(1, args.vocab_size - 3) for i in range(wl.prompt_len)]
    params = SamplingParams(n=wl.group_size, max_new_tokens=wl.response_len, ignore_eos=True)

    def gen() -> bool:
        new = not engine.has_work()
        if new:
            engine.add_requests([Request(i, prompt, params) for i in range(prompts)])
        engine.step()
        engine.poll_finished()
        return new
    return gen, engine


def _worker(spec: str) -> None:
    """A probe process: build the model, then serve "<kind> <seconds>" commands from stdin."""
    import torch

    from launch.calibrate import build, train_step_fn
    from launch.cost_model import Workload
    from model.args import ModelArgs
    torch.set_num_threads(1)  # as the ranks (torchrun's OMP_NUM_THREADS=1)
    d = json.loads(spec)
    args, wl = ModelArgs(**d["args"]), Workload(**d["wl"])
    model = build(args, torch.device("cpu"), torch.float32)
    train, _, _ = train_step_fn(model, wl, "cpu", d["mbt"])
    gen, engine = _decoder(model, args, wl, wl.prompts_per_step)

    def train_phase() -> bool:
        train()
        return True
    work = {"gen": gen, "train": train_phase}
    for fn in work.values():
        fn()
    while engine.has_work():  # so that the first window starts on a phase boundary
        gen()
    print("ready", flush=True)
    for line in sys.stdin:
        kind, seconds = line.split()
        t0 = time.perf_counter()
        deadline, n, starts = t0 + float(seconds), 0, []
        while time.perf_counter() < deadline:
            now = time.perf_counter()
            if work[kind]():
                starts.append(now)
            n += 1
        end = time.perf_counter()
        if kind == "train":
            starts.append(end)  # a train phase is one call
        # phases that ended by the deadline: the last one ran partly alone
        phases = [b - a for a, b in zip(starts, starts[1:]) if b <= deadline]
        print(json.dumps({"rate": n / (end - t0), "phases": phases}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launch.core_share '<json spec>' (started by slowdown_curve)")
    _worker(sys.argv[1])
