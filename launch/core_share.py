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


def _worker(spec: str) -> None:
    """A probe process: build the model, then serve "<kind> <seconds>" commands from stdin."""
    import torch

    from launch.calibrate import build, train_step_fn
    from launch.cost_model import Workload
    from model.args import ModelArgs
    from rollout.engine import Engine, Request, SamplingParams
    torch.set_num_threads(1)  # as the ranks (torchrun's OMP_NUM_THREADS=1)
    d = json.loads(spec)
    args, wl = ModelArgs(**d["args"]), Workload(**d["wl"])
    model = build(args, torch.device("cpu"), torch.float32)
    train, _, _ = train_step_fn(model, wl, "cpu", d["mbt"])
    engine = Engine(model, num_slots=wl.seqs, max_len=wl.prompt_len + wl.response_len + 1)
    prompt = [3 + i % max(1, args.vocab_size - 3) for i in range(wl.prompt_len)]
    params = SamplingParams(n=wl.group_size, max_new_tokens=wl.response_len, ignore_eos=True)

    def gen() -> bool:  # True where a phase (a generation batch) begins
        new = not engine.has_work()
        if new:
            engine.add_requests([Request(i, prompt, params) for i in range(wl.prompts_per_step)])
        engine.step()
        engine.poll_finished()
        return new

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
