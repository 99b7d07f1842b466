"""Faults: SIGKILL a trainer rank, then a generator rank, mid-run. torchrun restarts the job, it
resumes from the last checkpoint, metrics stay contiguous, every prompt is trained exactly once,
and in synchronous mode the final parameters equal an uninterrupted run, bitwise. Ctrl-C ends
every rank with one line; SIGTERM stops the run at a step boundary with a checkpoint; a rank's
failure in start-up ends the ranks of another node at once, naming it."""
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dist import Captured, run_captured
from tests.rl_model import make_rl_model
from tests.test_e2e import QUICK, ROOT, read_metrics
from trainer.checkpointing import generator_state, read_extra

pytestmark = pytest.mark.slow
STEPS = 6


def launch(model, run_dir, max_restarts, kill=None, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "--max-restarts", str(max_restarts), "train_rl.py", "--config", "configs/tiny_cpu.toml",
           *QUICK, f"--model.path={model}", f"--run.dir={run_dir}", f"--trainer.max_steps={STEPS}",
           "--algo.max_staleness=0", "--checkpoint.every_steps=2", "--trainer.lr=1e-2",
           "--logging.tensorboard=false", *extra]  # after QUICK: later overrides win
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kill:
        env["TANDEM_FAULT_KILL"] = kill  # launch/faults.py: SIGKILL at a given step, 1st attempt
    return Captured(cmd, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    model = make_rl_model(tmp / "model")
    proc = launch(model, tmp / "run", 0)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    return model, tmp / "run"


def final_params(run_dir: Path) -> dict:
    return load_file(str(run_dir / "hf_final" / "model.safetensors"))


@pytest.mark.parametrize("victim_rank", [1, 2], ids=["trainer", "generator"])
def test_kill_a_rank_resumes_without_loss(reference, tmp_path, victim_rank):
    model, ref_dir = reference
    run_dir = tmp_path / "run"
    # killed in step 3 (trainer: as it starts it; generator: as weights v3 arrive), after the
    # checkpoint of step 2
    proc = launch(model, run_dir, max_restarts=1, kill=f"rank={victim_rank},step=3")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert "fault injection: SIGKILL at step 3" in out + err
    assert "resumed from" in out and "step_000002" in out, out[-3000:] + err[-3000:]
    rows, ref_rows = read_metrics(run_dir), read_metrics(ref_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # contiguous, no duplicates
    trained = [pid for r in rows for pid in r["prompt_ids"]]
    assert len(trained) == len(set(trained))  # no prompt trained twice
    assert trained == [pid for r in ref_rows for pid in r["prompt_ids"]]  # and none lost
    # the generators' version, as acknowledged: the restored one at least (it read 0 after the
    # resume until an acknowledgement came, as if the generators had gone back to the start)
    gen = [r["generator_version"] for r in rows]
    assert gen == sorted(gen) and gen[2] >= 2, gen
    # held-out evaluations: each version once, as in the uninterrupted run (the resumed run
    # dropped and redid those from its checkpoint's version on)
    evals = lambda d: [{k: r[k] for k in ("step", "reward_mean")}  # noqa: E731
                       for r in map(json.loads, (d / "eval.jsonl").read_text().splitlines())]
    assert evals(run_dir) == evals(ref_dir) and [e["step"] for e in evals(ref_dir)] == [0, STEPS]
    ref = final_params(ref_dir)
    got = final_params(run_dir)
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def test_ctrl_c_ends_every_rank_with_one_line_naming_the_checkpoint(tmp_path):
    """Ctrl-C (SIGINT to torchrun, which passes it to every rank): one line on how to resume, not
    a KeyboardInterrupt traceback from each rank (resuming is what the kills above test)."""
    model = make_rl_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    proc = launch(model, run_dir, max_restarts=0, kill="rank=0,step=4,signal=INT")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "fault injection: SIGINT" in out, out[-3000:] + err[-3000:]
    assert err.count("interrupted: ") == 1, err[-5000:]
    assert (f"interrupted: run the same command again to resume {run_dir} from its latest "
            "checkpoint, step_000002") in err
    assert "[rank" not in err and "KeyboardInterrupt" not in err, err[-5000:]
    assert (run_dir / "checkpoints" / "step_000002" / ".metadata").is_file()


def test_a_start_up_failure_on_another_node_ends_the_run_naming_it(tmp_path):
    """Two torchrun agents, one rank each (trainer rank 0 on node 0, generator rank 1 on node 1):
    the generator fails at the end of its start-up. torchrun ends a failed rank's job on that
    node only; trainer rank 0, on the other, waited for the first groups until
    parallel.warmup_timeout_s (120 s here) and then failed with a time-out not naming the cause:
    the generator's link was built, and its failures told the trainer, only after start-up."""
    from tests.dist import two_nodes
    model = make_rl_model(tmp_path / "model")
    args = ["--config", "configs/tiny_cpu.toml", *QUICK, f"--model.path={model}",
            f"--run.dir={tmp_path / 'run'}", "--trainer.max_steps=2", "--logging.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_FAULT_KILL": "rank=1,step=0,signal=RAISE"}
    errs, agents = two_nodes(args, env, 1, tmp_path / "run", timeout=100)  # well before the 120 s
    assert errs is not None, "the nodes did not end within 100 s of node 1's failure"
    cause = "generator rank 1: RuntimeError: fault injection: a failure on rank 1 at the end of start-up"
    assert all(a.returncode not in (0, None) for a in agents), errs
    assert f"error (rank 1): {cause}" in errs[1], errs[1][-3000:]
    # trainer rank 0 waits for the first groups (or is still starting, then reads it first)
    assert "trainer.link.PeerError: " in errs[0] and cause in errs[0], errs[0][-3000:]
    assert "TimeoutError" not in errs[0], errs[0][-3000:]


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint_and_the_rerun_resumes(reference, tmp_path):
    """SIGTERM (SLURM preemption or time limit, `kill` of the launcher): the ranks finish the step
    under way, save a checkpoint of it and exit, with one line naming it; the same command run
    again resumes from it and trains every prompt once, as the uninterrupted run did."""
    model, ref_dir = reference
    run_dir = tmp_path / "run"
    # the generator (rank 2) signals the launcher once it has shipped the first group of the
    # batch weights v3 sample (step 4's), and generates nothing more until the trainer asks for
    # the stop's cut, which then has that batch's other groups in flight; periodic checkpoints
    # are at 2, 4, 6
    proc = launch(model, run_dir, max_restarts=0, kill="rank=2,step=3,signal=TERM,groups=1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "fault injection: SIGTERM" in out, out[-3000:] + err[-3000:]
    assert "[rank" not in err, err[-5000:]  # no rank's traceback (torchrun prints its own)
    rows = read_metrics(run_dir)
    last = rows[-1]["step"]
    assert last == 3 and [r["step"] for r in rows] == list(range(1, last + 1))
    ckpt = run_dir / "checkpoints" / f"step_{last:06d}"
    assert err.count("SIGTERM: stopped after step") == 1, err[-5000:]
    assert (f"SIGTERM: stopped after step {last} of {STEPS}, checkpoint {ckpt}; run the same "
            "command again to resume") in err
    assert (ckpt / ".metadata").is_file()
    assert not (run_dir / "hf_final").exists() and not (run_dir / "COMPLETE").exists()
    cut = generator_state(read_extra(ckpt), 0)  # the generator's half of the stop's checkpoint
    proc = launch(model, run_dir, max_restarts=0)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert f"resumed from {ckpt} at step {last}" in out, out[-3000:]
    rows, ref_rows = read_metrics(run_dir), read_metrics(ref_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["prompt_ids"] for r in rows] == [r["prompt_ids"] for r in ref_rows]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in ref_rows]  # same samples
    # A stop in mid-generation: the resumed generator runs the cut's whole batch again, the
    # groups trained before the cut as replays (rollout/worker.py `_redo_list`; the in-flight
    # ones alone, a smaller batch, rounded differently: parameters off by ~1e-6, seen in CI)
    assert len(cut["wave"]) == len(ref_rows[0]["prompt_ids"]) > len(cut["inflight"]) > 0, cut
    ref, got = final_params(ref_dir), final_params(run_dir)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name


def test_sigterm_to_one_trainer_rank_alone_stops_the_run_with_a_checkpoint(reference, tmp_path):
    """One node of several preempted: trainer rank 1 alone gets SIGTERM. Only trainer rank 0
    decides a stop; rank 1 carried on until its grace period (here 20 s) ended it with 143 and
    torchrun the job, the steps since the last checkpoint lost. It now passes the signal on."""
    model, _ = reference
    run_dir = tmp_path / "run"
    proc = launch(model, run_dir, max_restarts=0, kill="rank=1,step=3,signal=TERM_SELF",
                  extra=["--parallel.timeout_s=20", "--trainer.max_steps=40"])
    out, err = proc.communicate(timeout=300)
    assert "fault injection: SIGTERM to this rank alone" in out, out[-3000:] + err[-3000:]
    last = read_metrics(run_dir)[-1]["step"]
    assert last in (2, 3), (last, err[-5000:])  # signalled as step 3 starts
    ckpt = run_dir / "checkpoints" / f"step_{last:06d}"
    assert (f"SIGTERM on trainer rank 1: stopped after step {last} of 40, checkpoint {ckpt}"
            in err), err[-5000:]
    assert (ckpt / ".metadata").is_file() and "[rank" not in err, err[-5000:]


def test_a_run_stopped_in_a_completed_runs_folder_is_not_reported_complete(reference, tmp_path):
    """A run resumed from an explicit checkpoint in a folder whose earlier run completed, then
    stopped by SIGTERM: its exit code said success (the earlier run's COMPLETE marker was read),
    so a launcher would neither requeue nor restart it, and the re-run it suggests did nothing."""
    import shutil
    model, ref_dir = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    assert json.loads((run_dir / "COMPLETE").read_text())["steps"] == STEPS
    # the earlier run's last checkpoint moved away, as check_resume asks for a resume before it
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:06d}")
    ckpt = run_dir / "checkpoints" / "step_000004"
    proc = launch(model, run_dir, max_restarts=0, kill="rank=1,step=5,signal=TERM",
                  extra=[f"--checkpoint.resume={ckpt}"])
    out, err = proc.communicate(timeout=300)
    assert "fault injection: SIGTERM" in out and "SIGTERM: stopped after step" in err, err[-3000:]
    assert proc.returncode != 0 and not (run_dir / "COMPLETE").exists(), (proc.returncode, err[-3000:])


def test_a_finished_run_trains_on_from_its_last_step(reference, tmp_path):
    """The last step is checkpointed too: raising trainer.max_steps, as the 'already completed'
    line says, resumes at the finished step. Its last checkpoint was the last multiple of
    checkpoint.every_steps before it, so the steps after that were trained twice."""
    import shutil
    model, ref_dir = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}").is_dir()
    # as if the run had died in the last step's weight push, after its checkpoint and before its
    # row: the resume went on after that step, and its row was missing for good
    logged = read_metrics(run_dir)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged[:-1]))
    proc = launch(model, run_dir, max_restarts=0, extra=[f"--trainer.max_steps={STEPS + 2}"])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert f"at step {STEPS} (version {STEPS})" in out
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 3))
    assert rows[STEPS - 1]["loss"] == logged[-1]["loss"]  # the checkpoint's copy of the row
    assert rows[STEPS - 1]["time_weights_sync_s"] is None


@pytest.mark.parametrize("spec", ["rank=1", "rank=1;step=3", "rank=one,step=3", "rank=1,step=3,signal=SIGTERM",
                                  "rank=1,step=3,signal=term", "rank=1,step=3,sig=TERM",
                                  "rank=1,step=3,groups=0", "rank=1,step=3,groups=two"])
def test_a_malformed_fault_spec_is_refused_naming_its_form(spec, monkeypatch):
    """A spec without a step was a KeyError traceback on every rank, and an unknown signal name
    (SIGTERM for TERM) SIGKILLed the rank: another fault than the one the test asked for."""
    from launch import faults
    monkeypatch.setenv("TANDEM_FAULT_KILL", spec)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(os, "kill", lambda pid, sig: pytest.fail(f"sent {sig!r} for {spec!r}"))
    with pytest.raises(ValueError, match=r"TANDEM_FAULT_KILL=.* is not of the form rank=R,step=S.*TERM_SELF"):
        faults.maybe_kill(1, 3)


@pytest.mark.parametrize("spec, sent", [
    ("rank=1,step=3", ("self", "SIGKILL")), ("rank=1, step=3 ", ("self", "SIGKILL")),
    ("rank=1,step=3,signal=TERM", ("launcher", "SIGTERM")), ("rank=1,step=3,signal=INT", ("launcher", "SIGINT")),
    ("rank=1,step=3,signal=TERM_SELF", ("self", "SIGTERM"))])
def test_a_fault_spec_sends_its_signal_at_its_rank_and_step_only(spec, sent, monkeypatch):
    import signal
    from launch import faults
    monkeypatch.setenv("TANDEM_FAULT_KILL", spec)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    calls = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: calls.append(
        ("self" if pid == os.getpid() else "launcher", signal.Signals(sig).name)))
    faults.maybe_kill(1, 3, groups=1)  # a generator's shipment: only specs with groups=G act
    for rank, step in ((0, 3), (1, 2), (1, 4), (1, 3)):
        faults.maybe_kill(rank, step)
    assert calls == [sent]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted job runs through
    faults.maybe_kill(1, 3)
    assert calls == [sent]


@pytest.mark.parametrize("layout, spec, why", [
    ({}, "rank=4,step=2", "rank 4 is not one of its ranks 0..3"),
    ({}, "rank=-1,step=2", "rank -1 is not one of its ranks 0..3"),
    ({}, "rank=0,step=7", "step 7 is not one of its steps 0..6 (trainer.max_steps)"),
    ({}, "rank=1,step=2,groups=1", "rank 1 is a trainer rank"),
    ({"mode": "colocated", "generator_ranks": 4, "gen_dp": 4, "trainer_fsdp": 4}, "rank=1,step=2,groups=1",
     "rank 1 is a colocated rank"),
    ({"generator_ranks": 2, "gen_tp": 2, "gen_dp": 1, "trainer_fsdp": 2}, "rank=3,step=2,groups=1",
     "this job has gen_tp=2"),
    # 5 groups per step over 2 replicas: rank 2 ships 3 a version, rank 3 ships 2
    ({}, "rank=3,step=2,groups=3", "rank 3 ships 2 groups per version (its share of "
                                    "trainer.prompts_per_step=5), fewer than groups=3"),
    ({}, "rank=3,step=2,groups=2", None), ({}, "rank=2,step=2,groups=3", None),
    ({"max_staleness": 1}, "rank=3,step=2,groups=3", None),  # async: more ship under a version
    ({}, "rank=0,step=6", None), ({}, "rank=3,step=0,signal=RAISE", None)])
def test_a_fault_spec_no_rank_of_the_job_reaches_is_refused_naming_why(layout, spec, why, monkeypatch):
    """A groups=G spec on a trainer rank, a rank the job lacks, ... ran the job without a fault:
    the test or game day that asked for one passed without seeing it."""
    from launch import faults
    from parallel.dims import ParallelDims
    layout = {"world_size": 4, "generator_ranks": 2, "gen_dp": 2, "trainer_fsdp": 2, **layout}
    staleness = layout.pop("max_staleness", 0)
    dims = ParallelDims(**layout)
    monkeypatch.setenv("TANDEM_FAULT_KILL", spec)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    check = lambda: faults.check_spec(dims, 6, staleness, 5)  # noqa: E731
    if why is None:
        check()
    else:
        with pytest.raises(ValueError, match=f"TANDEM_FAULT_KILL='{spec}' would never act in "
                                             f"this job: .*{re.escape(why)}; .*unset it"):
            check()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted job has no fault to act
    check()


def test_a_groups_fault_acts_once_inside_its_versions_batch(monkeypatch):
    """groups=G: the generator rank acts on the first of its shipments that brings version S's
    groups to G or more, once; the step-only calls (a version's arrival) do not act."""
    from launch import faults
    monkeypatch.setenv("TANDEM_FAULT_KILL", "rank=2,step=3,signal=TERM_SELF,groups=2")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(faults, "_fired", set())
    calls = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: calls.append((pid == os.getpid(), sig)))
    # before it acts, that rank ships at most G of the version's groups in all (4 ready each time)
    assert [faults.groups_cap(r, st, sent, 4) for r, st, sent in ((2, 3, 0), (2, 3, 1), (1, 3, 0),
                                                                   (2, 2, 0))] == [2, 1, 4, 4]
    seen = []
    for rank, step, groups in ((2, 3, None), (2, 3, 1), (1, 3, 3), (2, 2, 3), (2, 3, 3), (2, 3, 4)):
        faults.maybe_kill(rank, step, groups=groups)
        seen.append(len(calls))
    assert seen == [0, 0, 0, 0, 1, 1]
    assert faults.groups_cap(2, 3, 2, 4) == 4  # acted: no cap
    faults.maybe_kill(2, 3)  # the spec's rank and step, no groups: a version's arrival
    assert len(calls) == 1


def test_a_raise_fault_fails_its_rank_at_its_step_only(monkeypatch):
    """signal=RAISE: a RuntimeError, as a rank's own failure; step 0 is the end of start-up."""
    from launch import faults
    monkeypatch.setenv("TANDEM_FAULT_KILL", "rank=1,step=0,signal=RAISE")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(os, "kill", lambda pid, sig: pytest.fail(f"sent {sig!r}"))
    for rank, step in ((0, 0), (1, 1), (2, 0)):
        faults.maybe_kill(rank, step)
    with pytest.raises(RuntimeError, match=r"^fault injection: a failure on rank 1 at the end of start-up$"):
        faults.maybe_kill(1, 0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted job runs through
    faults.maybe_kill(1, 0)


_FIRST_EXPORT = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from weights_sync.ipc import CpuShmMemory
before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
CpuShmMemory(torch.device("cpu")).export(torch.zeros(1000))  # starts this process's shm manager
restored = signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
for kid in open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split():
    if "torch_shm" in open(f"/proc/{{kid}}/comm").read():
        status = open(f"/proc/{{kid}}/status").read().splitlines()
        blocked = int(next(ln for ln in status if ln.startswith("SigBlk")).split()[1], 16)
        print(restored, bool(blocked >> (signal.SIGTERM - 1) & 1), bool(blocked >> (signal.SIGINT - 1) & 1))
"""


def test_the_shm_manager_a_rank_starts_does_not_die_of_a_signal_to_the_process_group():
    """torchrun passes its SIGTERM (and Ctrl-C) on with killpg: to each rank's process group, the
    torch_shm_manager that a rank's first shared-memory export spawns included. A manager killed
    as it started left the rank spinning in `_share_filename_cpu_` with the GIL held, for ever:
    its grace period and Ctrl-C could not end it (TANDEM_FAULT_KILL=rank=0,step=0,signal=TERM
    stopped nothing until torchrun's SIGKILL 30 s later, in 4 of 8 runs). The export now starts
    the manager with SIGTERM and SIGINT blocked (it inherits the mask; the rank gets its signal
    once the call is back): read from the manager's /proc status, and the rank's mask restored."""
    proc = run_captured([sys.executable, "-c", _FIRST_EXPORT.format(root=str(ROOT))], 60,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True", "True"], (proc.stdout, proc.stderr[-2000:])


def test_a_fault_spec_fires_in_colocated_mode_too(tmp_path):
    """TANDEM_FAULT_KILL was read in split mode's loops only (trainer/worker.py, rollout/worker.py,
    their roles' start-up): a colocated run trained to its end and exited 0, as if the fault it
    was given had been survived (a resilience test of colocated mode passed without one)."""
    model = make_rl_model(tmp_path / "model")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "train_rl.py", "--config", "configs/tiny_cpu.toml", *QUICK,
           f"--model.path={model}", f"--run.dir={tmp_path / 'run'}", "--trainer.max_steps=3",
           "--parallel.mode=colocated", "--logging.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_FAULT_KILL": "rank=1,step=2,signal=RAISE"}
    proc = run_captured(cmd, 240, cwd=ROOT, env=env)
    assert "RuntimeError: fault injection: a failure on rank 1 at step 2" in proc.stderr, (
        proc.returncode, proc.stderr[-3000:])
    assert proc.returncode != 0 and not (tmp_path / "run" / "COMPLETE").exists()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]  # failed as step 2 started


def test_ctrl_c_before_the_first_checkpoint_does_not_ask_for_checkpoints_already_set(tmp_path):
    """Ctrl-C before the first periodic checkpoint of a run that has them (checkpoint.every_steps
    = 2, interrupted in step 1) said "set --checkpoint.every_steps=N to make a run resumable": a
    fix the command already has. The line should say no checkpoint is there yet instead."""
    from config import load_config
    from trainer.checkpointing import interrupted_line
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.toml"),
                      [f"--run.dir={tmp_path / 'run'}", "--checkpoint.every_steps=2"])
    line = interrupted_line(cfg)
    assert line.startswith(f"interrupted: {tmp_path / 'run'} has no checkpoint"), line
    assert "set --checkpoint.every_steps" not in line, line
    off = load_config(str(ROOT / "configs" / "tiny_cpu.toml"),
                      [f"--run.dir={tmp_path / 'run'}", "--checkpoint.every_steps=0"])
    assert "set --checkpoint.every_steps=N" in interrupted_line(off)  # that advice stays where it applies


def test_a_periodic_checkpoint_does_not_cancel_a_lone_tp_followers_grace_period(monkeypatch):
    """A generator TP follower signalled alone does not stop the run: README says its grace period
    (parallel.timeout_s) then ends it with 143. But the next periodic checkpoint's message, which
    its leader passes on, was taken for the stop's own (`_handle`: a checkpoint while a stop is
    asked for) and marked the follower's stop under way: the grace period never ended, and the
    follower ran on to the end with its SIGTERM ignored (3 ranks, gen_tp=2, every_steps=2,
    TANDEM_FAULT_KILL=rank=2,step=3,signal=TERM_SELF, timeout_s=5: 200 steps, exit 0; with
    every_steps=0 it exited 5 s after the signal, as documented)."""
    from launch import preemption
    from rollout.worker import GeneratorWorker
    from trainer.link import Msg
    monkeypatch.setattr(preemption, "_state", preemption._State())
    preemption.request("SIGTERM")  # this follower's own signal, as its handler notes it
    follower = object.__new__(GeneratorWorker)
    follower.link, follower.tp_group = None, None  # a follower: no link; the broadcast is not needed here
    follower._handle([(int(Msg.CHECKPOINT), 4, None)])  # the periodic checkpoint of step 4
    assert not preemption._state.stopping.is_set(), \
        "a periodic checkpoint cancelled the grace period of a follower signalled alone"
    follower._handle([(int(Msg.CHECKPOINT), 6, {"stop": True})])  # the stop's own checkpoint
    assert preemption._state.stopping.is_set()
