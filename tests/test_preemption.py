"""launch/preemption.py: SIGTERM sets a flag instead of killing; a rank whose run does not stop
within the grace period exits with 143 and says why. (The stop itself, end to end under
torchrun: tests/test_faults.py.)"""
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from launch import preemption

ROOT = Path(__file__).resolve().parent.parent  # (not test_e2e's: its imports slow every rank)


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


def test_a_rank_cut_off_by_its_grace_period_leaves_why_for_its_peers(tmp_path):
    """A TP follower signalled alone and ended by its grace period was named by its leader only
    as gloo's "Connection reset": it now leaves the cause where the link's readers look."""
    store = tmp_path / "store"
    proc = _child(f"""
        import torch.distributed as dist
        dist.init_process_group("gloo", store=dist.FileStore({str(store)!r}, 1), rank=0, world_size=1)
        preemption.install(grace_s=0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    """)
    assert proc.returncode == 143, proc.stderr
    import torch.distributed as dist
    from trainer.link import left_error
    # the default group's store: the one given, its keys under the group's name ("0/")
    got = left_error(5, store=dist.PrefixStore("0/", dist.FileStore(str(store), 1)))
    assert got == ("rank 5: SIGTERM 0.5s ago and the run has not stopped (no trainer step boundary "
                   "reached it): exiting (its grace period, parallel.timeout_s)"), got


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


def test_a_rank_dead_but_not_yet_reaped_counts_as_gone(tmp_path):
    """A peer killed a moment ago is a zombie until its torchrun agent reaps it: os.kill(pid, 0)
    still succeeds, and a TP leader woken by its closed connection found it alive."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
        (tmp_path / "rank1.pid").write_text(f"{proc.pid}\n")
        (tmp_path / "rank0.pid").write_text(f"{os.getpid()}\n")
        host = {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
        assert preemption.gone_ranks(tmp_path, host) == [1]
    finally:
        proc.wait()


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


# ----- a paused generator leader passes its SIGTERM on at once ---------------------------------
def _signal_when_in(fn_name: str, deadline_s: float = 30.0) -> None:
    """SIGTERM to this process once its main thread is inside `fn_name` (in a thread)."""
    import threading
    import time
    main = threading.get_ident()

    def inside() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None and frame.f_code.co_name != fn_name:
            frame = frame.f_back
        return frame is not None

    def signal_once_inside():
        deadline = time.monotonic() + deadline_s
        while not inside():
            if time.monotonic() > deadline:
                return  # the test's own waits then fail, naming what they waited for
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=signal_once_inside, daemon=True).start()


def _paused_leader(rank, world):
    """Rank 0: the trainer's first rank. Ranks 1-2: a generator replica with TP 2 (leader 1),
    its staleness window full: it pauses for the next weights. Only the leader gets SIGTERM."""
    import types
    import torch.distributed as dist
    from config import Config
    from rollout.worker import GeneratorWorker
    from trainer.link import Link, Msg
    ns = types.SimpleNamespace
    tp_group = dist.new_group([1, 2])
    if rank == 0:
        link = Link(0, [1], timeout_s=30)
        out = {"stop": link.wait_for(Msg.STOP, "the paused leader's notice before any new weights",
                                     timeout_s=20).payload}
        link.send(1, Msg.WEIGHTS_READY, 1, {"dropped": 0})  # the step under way ends as usual
        out["ack"] = link.wait_for(Msg.ACK, "the ack of v1").version
        link.send(1, Msg.CHECKPOINT, 1)  # the stop's checkpoint
        out["cut"] = link.wait_for(Msg.CHECKPOINT, "the leader's cut").payload["inflight"]
        link.send(1, Msg.SHUTDOWN, 1)
        link.wait_for(Msg.STATS, "the leader's last message")
        out["rest"] = [m.type.name for m in link.poll()]  # a second STOP would be here
        link.flush()
        return out
    cfg = Config().resolve(3)
    cfg.parallel.timeout_s = cfg.parallel.warmup_timeout_s = 30.0
    link = Link(rank, [0], timeout_s=30) if rank == 1 else None
    engine = ns(has_work=lambda: False, load_weights=lambda apply, version: None)
    w = GeneratorWorker(cfg, engine, ns(state_dict=dict), None, None, link,
                        ns(receive=lambda version: None), trainer_rank0=0, replica=0,
                        tp_group=tp_group)
    w.gate = ns(try_acquire=lambda: False, update=lambda version, dropped: None, n_started=0)
    if rank == 1:
        preemption.install(grace_s=60)
        _signal_when_in("_pause")
    w.run()
    if link is not None:
        link.send(0, Msg.STATS, w.version)
        link.flush()
    preemption.uninstall()
    return {"version": w.version, "stop": w.stop}


def test_a_paused_generator_leader_passes_its_sigterm_on_at_once():
    """A TP leader paused by the staleness gate waits for the trainer's next message: its SIGTERM
    reached the trainer only once the next weights had arrived, and a trainer whose buffer held
    its next batch by then trained one more step first (here the trainer withholds the weights
    until the notice: it never came). Now the notice goes at once; the weights of the step under
    way still arrive on both ranks of the replica and are acked, once, and the stop's checkpoint
    cut and shutdown go on as usual."""
    from tests.dist import run_ranks
    trainer, leader, follower = run_ranks(_paused_leader, 3, timeout=60)
    assert trainer == {"stop": {"reason": "SIGTERM on generator rank 1"}, "ack": 1, "cut": [],
                       "rest": []}
    assert leader == follower == {"version": 1, "stop": True}


# ----- a SIGTERM during the end of a finished run ----------------------------------------------
def _trainer_end(rank, world, folder, run_dir):
    """A one-rank trainer whose last step is done: its end (the generators' SHUTDOWN, the final
    export, COMPLETE). A SIGTERM comes as the export starts writing, which then takes 3x the
    grace period (a large model)."""
    import time
    import types
    import torch
    from config import load_config
    from model import load_pretrained
    from parallel import checkpoint as C
    from parallel.dims import ParallelDims
    from parallel.mesh import build_meshes
    from trainer.checkpointing import is_complete
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.role import finish_run
    from trainer.worker import TrainerWorker
    ns = types.SimpleNamespace
    cfg = load_config(None, ["--parallel.mode=colocated", "--trainer.max_steps=2",
                             f"--run.dir={run_dir}", "--logging.tensorboard=false",
                             "--logging.progress=false"]).resolve(1)
    meshes = build_meshes(ParallelDims.from_config(cfg.parallel, 1), torch.device("cpu"))
    model = load_pretrained(folder, dtype="float32")
    opt = build_optimizer(model, cfg.trainer)
    sender = ns(push=lambda v: None, wait_sent=lambda: None, close=lambda: None)
    link = ns(send=lambda *a, **k: None, flush=lambda timeout_s=None: None)  # no generators
    w = TrainerWorker(cfg, meshes, model, opt, build_scheduler(opt, cfg.trainer), sender, link,
                      start_step=2)
    grace_s, save_file = 0.5, C.save_file

    def slow_save_file(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3 * grace_s)  # the write of a large model's file, not a synchronisation
        save_file(*args, **kwargs)
    C.save_file = slow_save_file
    preemption.install(grace_s=grace_s)
    w.run()
    finish_run(cfg, meshes, model, None, w.version, owner=True)
    out = {"requested": preemption.requested(), "complete": is_complete(cfg)}
    preemption.uninstall()
    return out


def test_a_sigterm_during_the_final_export_lets_it_finish(tmp_path):
    """The end of a finished run (final SHUTDOWN, export, COMPLETE, the end barrier) has waits
    with timeouts of their own, like a stop's checkpoint: the grace period exited the process in
    the middle of it (the export left as `hf_final.tmp`, no COMPLETE: a finished run that its
    re-run has to end again, and with checkpoint.every_steps=0 trains again from the start)."""
    from tests.dist import run_ranks
    from tests.rl_model import make_rl_model
    folder = make_rl_model(tmp_path / "m")
    out = run_ranks(_trainer_end, 1, folder, str(tmp_path / "run"), timeout=60)[0]
    assert out == {"requested": "SIGTERM", "complete": True}
    assert sorted(os.listdir(tmp_path / "run" / "hf_final")) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "run" / "hf_final.tmp").exists()


def test_a_generator_leader_passes_a_sigterm_during_an_evaluation_on_at_once():
    """A held-out evaluation (eval.every_steps) may last up to parallel.timeout_s, and the trainer
    trains on from the other replicas' groups meanwhile: the notice went only after it."""
    import types
    from config import Config
    from rollout.worker import GeneratorWorker
    ns = types.SimpleNamespace
    sent = []
    link = ns(send=lambda dst, kind, version, payload=None:
              sent.append((kind.name, version, payload)))

    def evaluation(version):
        os.kill(os.getpid(), signal.SIGTERM)
        return {"time_s": 2.0}
    w = GeneratorWorker(Config().resolve(2), ns(load_weights=lambda apply, version: None), None,
                        None, None, link, ns(receive=lambda version: None), trainer_rank0=0,
                        replica=0)
    w.evaluator = ns(due=lambda version: True, maybe_run=evaluation)
    preemption.install(grace_s=60)
    try:
        w._swap(1)
    finally:
        preemption.uninstall()
    assert sent == [("ACK", 1, sent[0][2]), ("EVALUATING", 1, None),
                    ("STOP", 1, {"reason": "SIGTERM on generator rank 0"}),
                    ("EVALUATING", 1, {"seconds": 2.0})]


# ----- Ctrl-C during a checkpoint --------------------------------------------------------------
_CTRL_C_IN_A_SAVE = """
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    import train_rl

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):  # Ctrl-C while the shards are written
            os.kill(os.getpid(), signal.SIGINT)
            return super().write_data(plan, planner)

    def run(cfg):  # this rank's part of the run: a checkpoint, as trainer/checkpointing.save's
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{ckpt}.store", rank=0, world_size=1)
        dcp.save({{"w": torch.zeros(4)}}, storage_writer=Writer({ckpt!r}))
    train_rl.run = run
    sys.exit(train_rl.main(["--config", "configs/tiny_cpu.toml", "--run.dir={run_dir}"]))
"""


def test_ctrl_c_during_a_checkpoint_ends_a_rank_with_one_line(tmp_path):
    """DCP wraps a KeyboardInterrupt raised in a save in a CheckpointException, which is no
    Exception: train_rl.main let it out, and Ctrl-C printed a traceback from each trainer rank
    (with the inner tracebacks of every rank's part of the save) and no 'interrupted' line."""
    for rank, line in (("0", f"interrupted: {tmp_path} has no checkpoint to resume from"), ("1", "")):
        body = _CTRL_C_IN_A_SAVE.format(ckpt=str(tmp_path / f"ckpt{rank}"), run_dir=tmp_path)
        proc = subprocess.run([sys.executable, "-c", "import os, signal\n" + textwrap.dedent(body)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RANK": rank, "WORLD_SIZE": "3"})
        assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
        assert proc.stderr.startswith(line) and proc.stderr.count("\n") == (1 if line else 0), proc.stderr


# ----- a failure that torchrun ends one host's ranks for reaches the other hosts --------------
# A rank of a host whose torchrun ended its ranks after one failed: it shares failures through the
# job's store (the test's), then, blocked in a C++ call, gets that SIGTERM.
_ENDED_RANK = """
    import sys, threading
    from datetime import timedelta
    import torch.distributed as dist
    os.environ.update({env})
    preemption.install(grace_s=60, pid_dir={pid_dir!r})
    store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=timedelta(seconds=30))
    preemption.share_failures(store)
    main = threading.get_ident()

    def signal_once_waiting():
        while sys._current_frames()[main].f_code.co_name != "blocked":
            time.sleep(0.01)
        {then}

    def blocked():
        store.wait(["never"], timedelta(seconds=30))
    threading.Thread(target=signal_once_waiting, daemon=True).start()
    blocked()
    print("returned", flush=True)
"""


def _host(pid_dir, port: int, node: int, rank: int, local: int, then: str) -> subprocess.Popen:
    env = dict(RANK=str(rank), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(node))
    code = "import os, signal, time\nfrom launch import preemption\n" + textwrap.dedent(
        _ENDED_RANK).format(env=env, pid_dir=str(pid_dir), port=port, then=then)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_rank_that_torchrun_ends_after_a_host_mate_died_ends_the_other_hosts_naming_it(tmp_path):
    """Node 1's rank 2 died; torchrun ends rank 3, which died of the SIGTERM at once, silently:
    node 0 learnt nothing (its trainer waited for groups until parallel.timeout_s). Rank 3 now
    records it in the job's store first; node 0's first rank (its main thread blocked in a C++
    call, as in a collective) reads it, says so and exits; node 1's first rank (a stand-in for
    rank 2, alive) leaves its own node's failure to torchrun. End to end under two torchrun
    agents: tests/test_e2e.py."""
    from datetime import timedelta

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    node1 = tmp_path / "node1"
    node1.mkdir()
    (node1 / "rank2.pid").write_text(f"{_dead_pid()}\n")
    procs = [_host(tmp_path / "node0", store.port, 0, 0, 0, then="pass"),  # reads it, blocked
             _host(node1, store.port, 1, 3, 1, then="os.kill(os.getpid(), signal.SIGTERM)"),
             # node 1's first rank: its reader stops at the record, and it goes on
             _host(tmp_path / "node1b", store.port, 1, 2, 0,
                   then="preemption._reader[0].join(30); print('went on', flush=True); os._exit(0)")]
    try:
        (out0, err0), (out3, err3), (out2, err2) = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == preemption.EXIT_CODE and "returned" not in out3, err3[-2000:]
    assert procs[0].returncode == 1 and "returned" not in out0, (procs[0].returncode, err0[-2000:])
    what = (f"rank 2 (host {socket.gethostname()}, node 1) exited, and torchrun ended the other "
            "ranks of that node")
    assert (f"error (rank 0): the run failed on another node: {what}; that node's log has the "
            "cause. This rank exits too") in err0, err0[-2000:]
    assert procs[2].returncode == 0 and out2 == "went on\n" and "error" not in err2, err2[-2000:]


def test_the_first_failure_recorded_stays_and_ctrl_c_records_none(monkeypatch):
    """A host's other ranks die of the first one's failure (and a host that a failure ended, of
    that): the first record names the cause, later ones do not replace it. Ctrl-C is no failure."""
    import json
    from datetime import timedelta

    import torch.distributed as dist
    from trainer.link import attempt_store
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = attempt_store("failed", dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                                                  timeout=timedelta(seconds=30)))
    monkeypatch.setattr(preemption, "_failures", store)
    monkeypatch.setattr(preemption, "_sigint", True)
    preemption._record_failure([0])
    assert not store.check([preemption.FAILED_KEY])
    monkeypatch.setattr(preemption, "_sigint", False)
    for node, gone in (("1", [4, 5]), ("1", [6]), ("0", [0])):
        monkeypatch.setenv("GROUP_RANK", node)
        preemption._record_failure(gone)
    failure = json.loads(store.get(preemption.FAILED_KEY))
    assert failure["node"] == "1" and failure["what"].startswith("ranks 4, 5 (host "), failure


def test_a_finished_rank_is_not_taken_for_a_failed_one(tmp_path):
    """torchrun SIGTERMs a host's other ranks once one has exited 143 after a stop: one still
    between the end barrier and `uninstall` found the finished rank gone and took that for a
    failure (it died of the signal; with failures shared it would also have recorded one, and
    ended the other hosts with an error). A finished rank's pid file goes as it finishes."""
    proc = _child(f"""
        os.environ.update(RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
        preemption.install(grace_s=60, pid_dir={str(tmp_path)!r})
        preemption.write_pid({str(tmp_path)!r}, 0)
        preemption.uninstall(ignore=True)  # train_rl: after the end barrier
    """)
    assert proc.returncode == 0, proc.stderr
    host_mate = {"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert preemption.local_ranks_alive(tmp_path, host_mate)
