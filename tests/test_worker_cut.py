"""A generator replica's checkpoint cut (rollout/worker.py `_cut`) and its resume: every prompt
that was in flight is regenerated with its own start index (and so its seed), also when the cut
is taken while a resumed run has not yet admitted them again. And the trainer's side of a resume:
its first step warms up like a fresh run's (trainer/worker.py)."""
import concurrent.futures
import types

import pytest

from model import load_pretrained
from rollout.data import PromptItem, PromptSource
from rollout.engine import Engine
from rollout.worker import GeneratorWorker
from tools.make_tiny_model import make_random_model
from trainer.link import Message, Msg

ns = types.SimpleNamespace


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_random_model(tmp_path_factory.mktemp("m"), hidden=32)
    return load_pretrained(folder, dtype="float32").eval()


class _Link:
    def __init__(self, inbox=()):
        self.inbox, self.sent = list(inbox), []

    def poll(self):
        out, self.inbox = self.inbox, []
        return out

    def send(self, dst, kind, version, payload=None):
        self.sent.append((kind, version, payload))


def generator_cfg(max_staleness: int, max_new_tokens: int, warmup_timeout_s: float):
    """What a GeneratorWorker driven by fakes reads of its config: 2 groups of 2 samples a step."""
    return ns(trainer=ns(prompts_per_step=2), algo=ns(max_staleness=max_staleness),
              parallel=ns(gen_dp=1, timeout_s=10.0, warmup_timeout_s=warmup_timeout_s),
              generator=ns(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                           greedy=False, n_samples=2, stop_token_ids=[], ignore_eos=True, seed=0))


def scored(value: float):
    """A RewardRunner stand-in whose every reward is `value`, at once."""
    def submit(item, text, ids):
        f = concurrent.futures.Future()
        f.set_result(value)
        return f
    return ns(submit=submit)


def _worker(model, link):
    cfg = generator_cfg(max_staleness=1, max_new_tokens=3, warmup_timeout_s=100.0)
    items = [PromptItem(id=i, prompt=f"p{i}", messages=None, answer="") for i in range(10)]
    engine = Engine(model, num_slots=4, max_len=32)
    engine.load_weights = lambda apply, version: None  # no trainer: the weights stay as they are
    return GeneratorWorker(cfg, engine, PromptSource(items, seed=0), ns(decode=str),
                           scored(0.0), link, ns(receive=lambda v: None), 0, 0,
                           encode=lambda it: [1, 5 + it.id, 7])


def _admitted(w):
    return [(p.item.id, p.index) for p in w.pending.values()]


def test_a_cut_before_the_resumed_prompts_are_admitted_keeps_them(model):
    first = _worker(model, _Link())
    first._admit()  # the gate lets 4 groups start (2 a step, eta 1); none finishes
    cut = first._cut()
    inflight = _admitted(first)
    assert len(inflight) == 4 and cut["started"] == 4
    # resumed from that cut, its first poll holds the resume's weights and the next checkpoint:
    # the cut is taken before the in-flight prompts are admitted again
    link = _Link([Message(Msg.WEIGHTS_READY, 0, 1), Message(Msg.CHECKPOINT, 1, 1)])
    second = _worker(model, link)
    second.resume(cut, 0)
    second._handle(second._poll())
    again = next(p for kind, _, p in link.sent if kind == Msg.CHECKPOINT)
    assert again["started"] == 4 and [tuple(x) for x in again["inflight"]] == inflight
    # a run resumed from the second cut regenerates the same prompts with the same indices
    third = _worker(model, _Link())
    third.resume(again, 0)
    third.version = 0
    third._admit()
    assert _admitted(third)[:4] == inflight
    assert third.gate.n_started == 4  # then new prompts from start index 4 on


def _sync_worker(model, link, stop_ids):
    """A synchronous replica (max_staleness 0) of 4 groups of 2 samples a step, all 8 at once in
    the engine; `stop_ids` end its samples at different lengths."""
    cfg = generator_cfg(max_staleness=0, max_new_tokens=12, warmup_timeout_s=100.0)
    cfg.trainer.prompts_per_step, cfg.generator.stop_token_ids = 4, stop_ids
    items = [PromptItem(id=i, prompt=f"p{i}", messages=None, answer="") for i in range(10)]
    engine = Engine(model, num_slots=8, max_len=32, pack_weights=False)
    return GeneratorWorker(cfg, engine, PromptSource(items, seed=0), ns(decode=str),
                           scored(0.0), link, ns(receive=lambda v: None), 0, 0,
                           encode=lambda it: [1, 5 + it.id, 7, 2 + it.id % 3][: 2 + it.id % 3])


def _shipped(link) -> list[dict]:
    return [g for kind, _, groups in link.sent if kind == Msg.TRAJECTORIES for g in groups]


def _generate(w, until=lambda w: False) -> None:
    w._admit()
    while w.pending and not until(w):
        w.engine.step()
        w._collect()
        w._ship_scored()


def test_a_synchronous_cut_inside_a_batch_resumes_bitwise(model):
    """SIGTERM's cut falls inside a synchronous batch: some groups were trained, the rest are in
    flight. The resumed replica runs the whole batch again (the trained groups as replays, not
    shipped), so the in-flight groups' tokens and log-probs are bitwise the uninterrupted run's:
    generated alone they ran as a smaller batch, with other rounding."""
    stop_ids = [0, 5, 10]  # 3 of the 17 ids: lengths from 1 to 12
    ref_link = _Link()
    _generate(_sync_worker(model, ref_link, stop_ids))
    ref = _shipped(ref_link)
    assert len(ref) == 4
    link = _Link()
    first = _sync_worker(model, link, stop_ids)
    _generate(first, until=lambda w: _shipped(link))  # the first group shipped, 3 in flight
    cut = first._cut()
    before = _shipped(link)
    assert len(before) == 1 and len(cut["inflight"]) == 3 and len(cut["wave"]) == 4
    link2 = _Link()
    second = _sync_worker(model, link2, stop_ids)
    second.resume(cut, 0)
    _generate(second)
    assert second.engine.stats.prefill_prompts == 4  # the whole batch, the trained group too
    assert before + _shipped(link2) == ref  # and only the rest shipped, bitwise
    assert second._cut()["inflight"] == [] and not second.pending
    # resumed with other stop ids (a setting a resume may change), the shipped group's replay
    # outlasts the in-flight groups; it is cancelled then, not left running into the next batch
    third = _sync_worker(model, _Link(), [0, 1, 5])
    third.resume(cut, 0)
    third._admit()
    while any(not p.replay for p in third.pending.values()):
        third.engine.step()
        third._collect()
        third._ship_scored()
    assert not third.pending and not third.engine.has_work()


def test_groups_dropped_as_stale_come_back_to_the_gate_with_the_weights(model):
    """The trainer's weights message carries how many of this replica's groups its buffer
    dropped as stale (a running total); each frees its place in the staleness window."""
    link = _Link()
    w = _worker(model, link)
    w._admit()
    assert w.gate.n_started == 4  # 2 a step, eta 1: the window is full at version 0
    link.inbox = [Message(Msg.WEIGHTS_READY, 0, 0, {"dropped": 2})]
    w._handle(w._poll())
    w._admit()
    assert w.gate.n_started == 6 and len(w.pending) == 6
    link.inbox = [Message(Msg.WEIGHTS_READY, 0, 0, {"dropped": 1})]  # late, older: no effect
    w._handle(w._poll())
    w._admit()
    assert w.gate.n_started == 6


# ----- the trainer's side: a resumed process warms up like a fresh one -------------------------
class _TrainerLink:
    """Generator leaders that ship one batch of groups for each version the trainer is at
    (`deliver`), or nothing; every wait is an empty slice of the fake clock `now`."""

    def __init__(self, worker, now, deliver=True):
        self.worker, self.now, self.deliver, self.sent = worker, now, deliver, []

    def poll(self):
        if not self.deliver or len(self.worker.buffer):
            return []
        from trainer.batch import Group, Trajectory
        v, cfg = self.worker.version, self.worker.cfg
        groups = [Group(f"{v}-{p}", [Trajectory(f"{v}-{p}", j, [1, 2 + p], [3, 4 + j], [-1.0, -1.5],
                                                [v, v], float(j), "stop")
                                     for j in range(cfg.generator.n_samples)])
                  for p in range(cfg.trainer.prompts_per_step)]
        return [Message(Msg.TRAJECTORIES, v, 0, [g.to_dict() for g in groups])]

    def wait_for(self, types, what, timeout_s=None, **kw):
        self.now[0] += timeout_s
        raise TimeoutError(what)

    def send(self, dst, kind, version, payload=None):
        self.sent.append((kind, version))

    def flush(self, timeout_s=None):
        pass

    def broadcast_shutdown(self, error, announce=True):
        self.sent.append(("SHUTDOWN", error))


def _resumed_trainer(rank, world, folder, run_dir):
    """A trainer resumed at step 3 (its schedule there): the first batch wait, then two steps."""
    import torch
    from config import load_config
    from model import load_pretrained
    from parallel.dims import ParallelDims
    from parallel.mesh import build_meshes
    from trainer import worker as W
    from trainer.metrics import MetricsLogger
    from trainer.optim import build_optimizer, build_scheduler
    start = 3
    cfg = load_config(None, ["--parallel.mode=colocated", "--trainer.prompts_per_step=2",
                             "--generator.n_samples=2", "--algo.max_staleness=0",
                             f"--trainer.max_steps={start + 2}", "--trainer.warmup_steps=10",
                             "--trainer.lr=1e-3", "--parallel.timeout_s=7",
                             "--parallel.warmup_timeout_s=900", "--logging.progress=false",
                             "--logging.tensorboard=false", f"--run.dir={run_dir}"]).resolve(1)
    meshes = build_meshes(ParallelDims.from_config(cfg.parallel, 1), torch.device("cpu"))
    shortened, current = [], {}
    real_shorten = meshes.set_timeouts
    meshes.set_timeouts = lambda s: shortened.append((s, current["w"].step)) or real_shorten(s)
    model = load_pretrained(folder, dtype="float32")
    opt = build_optimizer(model, cfg.trainer)
    sched = build_scheduler(opt, cfg.trainer)
    for _ in range(start):  # where checkpointing.load leaves the schedule
        opt.step()
        sched.step()
    used = []  # the lr of each update, as the optimizer applies it
    opt.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    sender = ns(push=lambda v: None, wait_sent=lambda: None, close=lambda: None)
    now = [0.0]
    W.time = ns(monotonic=lambda: now[0], perf_counter=W.time.perf_counter)  # the fake clock

    def trainer(deliver):
        logger = MetricsLogger(run_dir, tensorboard=False) if deliver else None
        current["w"] = w = W.TrainerWorker(cfg, meshes, model, opt, sched, sender, None,
                                           start_step=start, logger=logger)
        w.link = _TrainerLink(w, now, deliver)
        return w
    try:
        trainer(deliver=False)._collect()
    except TimeoutError as e:
        first_wait = str(e)
    trainer(deliver=True).run()
    current["w"].logger.close()
    return {"first_wait": first_wait, "shortened": shortened, "used": used}


def test_a_resumed_trainer_warms_up_like_a_fresh_one(tmp_path):
    """A resumed trainer's first batch waits for the generators' start-up (model load, compile,
    the in-flight prompts regenerated) as at step 0: parallel.warmup_timeout_s, not timeout_s;
    after its first step its process groups' timeouts are shortened to timeout_s (once). And
    each step's logged lr is the one its update used, not the scheduler's next one."""
    import json

    from tests.dist import run_ranks
    from tests.rl_model import make_rl_model
    folder = make_rl_model(tmp_path / "m")
    out = run_ranks(_resumed_trainer, 1, folder, str(tmp_path / "run"), timeout=300)[0]
    assert "waited 900s for 2 prompt groups at version 3" in out["first_wait"]
    # after the first step of this process (before step 4); at the end the start-up budget again
    # on every trainer rank, for the final evaluation and export (rank 0 alone waited for them)
    assert out["shortened"] == [(7.0, 3), (900.0, 5)]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 5]
    used = out["used"]  # in the warm-up: each step's lr differs from the next one's
    assert len(used) == 2 and used[0] < used[1] and [r["lr"] for r in rows] == used


def _colocated_run(rank, world, folder, run_dir):
    """A 2-step colocated run on one rank; the timeouts its process groups were shortened to."""
    import torch
    from config import load_config
    from launch.preflight import preflight
    from parallel import mesh as M
    from parallel.dims import ParallelDims
    from trainer.colocated import run_colocated
    calls, real = [], M.Meshes.set_timeouts
    M.Meshes.set_timeouts = lambda self, s: calls.append(s) or real(self, s)
    cfg = load_config(None, [
        "--parallel.mode=colocated", f"--model.path={folder}", f"--run.dir={run_dir}",
        "--trainer.max_steps=2", "--trainer.prompts_per_step=2", "--generator.n_samples=2",
        "--generator.num_slots=4", "--generator.max_new_tokens=4", "--parallel.timeout_s=60",
        "--parallel.warmup_timeout_s=900", "--logging.tensorboard=false",
        "--logging.progress=false", "--checkpoint.hf_export_final=false",
        "--reward.fn=tests.rl_model:length_reward", "--algo.kl_coef=0",
        "--eval.every_steps=0"]).resolve(world)
    dims = ParallelDims.from_config(cfg.parallel, world)
    tokenizer = preflight(cfg, dims)
    run_colocated(cfg, M.build_meshes(dims, torch.device("cpu")), tokenizer)
    return calls


def test_colocated_mode_shortens_its_timeouts_after_the_first_step(tmp_path):
    """The process groups start with parallel.warmup_timeout_s (model load, compile, the first
    step); split mode's roles shorten them to timeout_s after their first step, colocated mode
    never did: a dead peer was noticed after 900 s instead of 60. The end (final evaluation and
    export) takes the start-up budget again, as split mode's does (tests/test_colocated.py)."""
    from tests.dist import run_ranks
    from tests.rl_model import make_rl_model
    folder = make_rl_model(tmp_path / "m")
    assert run_ranks(_colocated_run, 1, folder, str(tmp_path / "run"), timeout=300) == [[60.0, 900.0]]


def _fresh_trainer(folder, run_dir, logger_cls, push=lambda v: None):
    """A fresh trainer (3 steps, fake generators, `push` as its weight sender's) and its logger."""
    import torch
    from config import load_config
    from model import load_pretrained
    from parallel.dims import ParallelDims
    from parallel.mesh import build_meshes
    from trainer import worker as W
    from trainer.optim import build_optimizer, build_scheduler
    cfg = load_config(None, ["--parallel.mode=colocated", "--trainer.prompts_per_step=2",
                             "--generator.n_samples=2", "--algo.max_staleness=0",
                             "--trainer.max_steps=3", "--logging.progress=false",
                             "--logging.tensorboard=false", f"--run.dir={run_dir}"]).resolve(1)
    meshes = build_meshes(ParallelDims.from_config(cfg.parallel, 1), torch.device("cpu"))
    model = load_pretrained(folder, dtype="float32")
    opt = build_optimizer(model, cfg.trainer)
    logger = logger_cls(run_dir, tensorboard=False)
    sender = ns(push=push, wait_sent=lambda: None, close=lambda: None)
    w = W.TrainerWorker(cfg, meshes, model, opt, build_scheduler(opt, cfg.trainer), sender, None,
                        logger=logger)
    w.link = _TrainerLink(w, [0.0])
    return w, logger


def _trainer_with_slow_logging(rank, world, folder, run_dir):
    """A fresh trainer whose metrics logging takes 0.3 s a row: its run's wall time."""
    import time
    from trainer.metrics import MetricsLogger

    class SlowLogger(MetricsLogger):
        def log(self, metrics):
            super().log(metrics)
            time.sleep(0.3)
    w, logger = _fresh_trainer(folder, run_dir, SlowLogger)
    t0 = time.perf_counter()
    w.run()
    wall = time.perf_counter() - t0
    logger.close()
    return wall


def _trainer_whose_push_fails(rank, world, folder, run_dir):
    """A fresh trainer whose weight push fails at version 2: the error."""
    from trainer.metrics import MetricsLogger

    def push(v):
        if v == 2:
            raise ConnectionError("generator rank 1 is gone")
    w, logger = _fresh_trainer(folder, run_dir, MetricsLogger, push)
    try:
        w.run()
    except ConnectionError as e:
        return str(e)
    finally:
        logger.close()


def test_a_step_whose_weight_push_fails_still_logs_its_row(tmp_path):
    """The push comes after the step's checkpoint, and the row after the push: a push that failed
    (a generator gone) lost the row of a step a resume then goes on after, for good."""
    import json
    from tests.dist import run_ranks
    from tests.rl_model import make_rl_model
    folder = make_rl_model(tmp_path / "m")
    err = run_ranks(_trainer_whose_push_fails, 1, folder, str(tmp_path / "run"), timeout=300)[0]
    assert err == "generator rank 1 is gone"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_step_times_add_up_to_the_wall_time(tmp_path):
    """time_step_s runs from the previous step's stamp, so it includes that row's logging: the
    steps' times add up to the run's wall time (the bench's TRL side is timed between step
    ends). It left the logging out: 1.4-3 ms a step of TensorBoard writes, 3-6% of vs_trl's."""
    import json
    from tests.dist import run_ranks
    from tests.rl_model import make_rl_model
    folder = make_rl_model(tmp_path / "m")
    wall = run_ranks(_trainer_with_slow_logging, 1, folder, str(tmp_path / "run"), timeout=300)[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [r["time_step_s"] for r in rows]
    assert len(times) == 3 and all(t >= 0.3 for t in times[1:])  # the previous row's 0.3 s
    assert sum(times) == pytest.approx(wall - 0.3, abs=0.05)  # all but the last row's logging


def test_the_generator_waits_out_the_trainers_first_step(model):
    """A generator with its staleness window full waits for the next weights: until the first
    version a trainer step of this process made, with parallel.warmup_timeout_s (the trainer is
    loading, compiling, taking its first step; with timeout_s a compiling trainer failed the run
    at its first step), then timeout_s; a resumed run first gets the resumed version back."""
    waits, shortened = [], []
    link = _Link()
    link.wait_for = lambda types, what, timeout_s=None, consume=True: waits.append(timeout_s)
    w = _worker(model, link)
    w.on_first_swap = lambda: shortened.append(w.version)
    w._pause()
    w._swap(1)
    w._pause()
    assert waits == [100.0, None] and shortened == [0]  # called inside the swap of v1
    resumed = _worker(model, link)
    resumed.on_first_swap = lambda: shortened.append(resumed.version)
    resumed.resume(w._cut(), 1)
    resumed._swap(1)  # the resumed weights, back from the trainer
    resumed._pause()
    resumed._swap(2)  # the resumed trainer's first step
    resumed._pause()
    assert waits[2:] == [100.0, None] and shortened == [0, 1]


def test_a_trainer_shutdown_with_an_error_fails_the_generator_with_its_cause(model):
    """The trainer's failure reaches the generator as a SHUTDOWN carrying the error: it was taken
    for a normal end (the run then failed later, at the shutdown barrier, without the cause)."""
    from trainer.link import PeerError
    w = _worker(model, _Link())
    with pytest.raises(PeerError, match="trainer shut the run down: trainer rank 1: boom"):
        w._handle([Message(Msg.SHUTDOWN, -1, 0, {"error": "trainer rank 1: boom"})])
    w._handle([Message(Msg.SHUTDOWN, 3, 0)])  # the normal end
    assert w.stop


def test_the_trainers_batch_timeout_names_an_evaluation_under_way():
    import time
    from trainer.worker import TrainerWorker
    note = TrainerWorker._evaluating_note(ns(evaluating=(2, 4, time.monotonic() - 7)))
    assert note.startswith("; generator rank 2 has been evaluating v4 for 7s") and "eval.num_prompts" in note
    assert TrainerWorker._evaluating_note(ns(evaluating=None)) == ""


def test_the_trainers_wait_names_the_step_it_waits_for():
    """After step 2's console line the batch awaited is step 3's; a generator's failure while
    the trainer waited for it said "for step 2" (the steps done, not the one waited for)."""
    from trainer.worker import TrainerWorker

    class Failed(Exception):
        pass

    def wait_for(types, what, timeout_s=None):
        raise Failed(what)
    worker = ns(cfg=ns(trainer=ns(prompts_per_step=4), parallel=ns(timeout_s=10.0),
                       logging=ns(progress=False)),
                warm=True, step=2, version=2, link=ns(poll=lambda: [], wait_for=wait_for),
                buffer=ns(try_take=lambda n, version: None))
    with pytest.raises(Failed, match="^4 prompt groups for step 3$"):
        TrainerWorker._collect(worker)


@pytest.mark.parametrize("error, ctrl_c, announced", [
    (RuntimeError("Connection closed by peer"), False, True),   # a failure of its own: printed
    (RuntimeError("Connection closed by peer"), True, False),   # what a Ctrl-C broke: not
    (KeyboardInterrupt(), True, False)])
def test_the_trainers_shutdown_prints_no_error_that_a_ctrl_c_caused(monkeypatch, error, ctrl_c,
                                                                    announced):
    """A Ctrl-C that ended a peer first fails this rank's collective ("Connection closed by
    peer"): that is the interruption, which train_rl prints as one line, not an error line. The
    generators get the SHUTDOWN either way."""
    from launch import preemption
    from trainer.worker import TrainerWorker
    monkeypatch.setattr(preemption, "_sigint", ctrl_c)
    calls = []

    def one_step():
        raise error
    worker = ns(cfg=ns(trainer=ns(max_steps=5)), stopped=None, step=0, meshes=ns(rank=0),
                _one_step=one_step,
                link=ns(broadcast_shutdown=lambda msg, announce: calls.append(announce)))
    with pytest.raises(type(error)):
        TrainerWorker.run(worker)
    assert calls == [announced]


def test_a_checkpoint_cut_waits_one_deadline_for_all_replies():
    """The cut's wait for the generators' replies had a fresh timeout_s per message that arrived
    meanwhile (groups, acks): one deadline for them all now."""
    from trainer.checkpointing import gather_cut
    budgets = []
    inbox = [Message(Msg.TRAJECTORIES, 0, 2, []), Message(Msg.ACK, 0, 2, {}),
             Message(Msg.CHECKPOINT, 2, 2, {"started": 4})]

    class CutLink(_Link):
        timeout_s = 10.0

        def wait_for(self, types, what, timeout_s=None, **kw):
            import time
            time.sleep(0.05)
            budgets.append(timeout_s)
            return inbox.pop(0)

        def put_back(self, msgs):
            pass
    replies, before = gather_cut(CutLink(), [2], 2)
    assert replies == {2: {"started": 4}} and len(before) == 2
    assert budgets[0] <= 10.0 and budgets[0] > budgets[1] > budgets[2] > 9.5


def _leader_fails(rank, world):
    """Trainer rank 0 and a generator TP leader fail while waiting on the other mesh; their
    followers wait for them in a broadcast. What each rank raises."""
    import torch.distributed as dist
    from trainer.link import PeerError
    from trainer.worker import TrainerWorker
    out = {}

    def collect():
        raise TimeoutError("trainer rank 0 waited 10s for 4 prompt groups")
    trainer = ns(is_owner=rank == 0, _collect=collect, _stop_asked=lambda: None, step=2,
                 meshes=ns(dims=ns(trainer_rank_list=[0]), trainer_group=dist.group.WORLD))
    gen_link = ns(wait_for=lambda *a, **k: (_ for _ in ()).throw(
        TimeoutError("rank 0 timed out after 10s waiting for a new weight version")))
    gen = ns(link=gen_link if rank == 0 else None, tp_group=dist.group.WORLD, cold_swaps=0,
             cfg=ns(parallel=ns(timeout_s=10.0, warmup_timeout_s=20.0)),
             version=3)
    for name, call in (("trainer", lambda: TrainerWorker._take_batch(trainer)),
                       ("generator", lambda: (GeneratorWorker._pause(gen),
                                              GeneratorWorker._poll(gen)))):
        try:
            call()
            out[name] = "no error"
        except (TimeoutError, PeerError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_followers_fail_with_their_leaders_cause():
    """The ranks that wait for a leader's decisions (trainer ranks in the batch broadcast, TP
    followers in the message broadcast) timed out with a bare gloo error, at the same moment as
    the leader's own, named one or before it. The leader now sends them its error."""
    from tests.dist import run_ranks
    leader, follower = run_ranks(_leader_fails, 2, timeout=60)
    assert leader["trainer"].startswith("TimeoutError: trainer rank 0 waited 10s")
    assert follower["trainer"] == ("PeerError: trainer rank 0 failed: TimeoutError: trainer rank 0 "
                                   "waited 10s for 4 prompt groups")
    assert leader["generator"].startswith("TimeoutError: rank 0 timed out")
    assert follower["generator"].startswith("PeerError: this TP group's leader failed: "
                                            "TimeoutError: rank 0 timed out after 10s")


def _late_owner(rank, world):
    import time
    import torch
    from config import load_config
    from parallel.dims import ParallelDims
    from parallel.mesh import build_meshes
    from trainer.worker import broadcast_json
    cfg = load_config(None, ["--parallel.generator_ranks=1"]).resolve(world)
    meshes = build_meshes(ParallelDims.from_config(cfg.parallel, world), torch.device("cpu"))
    meshes.set_timeouts(1.0)
    got = "generator"
    if meshes.role == "trainer":
        if rank == 0:
            time.sleep(1.6)  # the owner waited (up to timeout_s) for the generators' groups
        got = broadcast_json({"step": 1} if rank == 0 else None, 0, meshes.trainer_group)
    meshes.set_timeouts(60.0)  # the harness's barrier: the ranks come at different times
    return got


def test_trainer_ranks_wait_longer_for_the_owner_than_it_waits_for_the_generators():
    """After warm-up the groups wait timeout_s, the trainer group twice that: its ranks wait for
    trainer rank 0's batch while rank 0 waits up to timeout_s for the generators."""
    from tests.dist import run_ranks
    assert run_ranks(_late_owner, 3, timeout=60) == [{"step": 1}, {"step": 1}, "generator"]


def test_the_process_groups_start_with_the_start_up_budget_and_followers_twice_it(monkeypatch):
    """Before the first step a leader waits max(timeout_s, warmup_timeout_s) on the other mesh
    (config.warmup_budget_s). The default group was created with warmup_timeout_s alone (shorter
    when timeout_s is longer), and the followers' groups inherited it: no margin over the leader,
    whose named error could then come after their bare gloo time-out."""
    import torch
    import train_rl
    from config import load_config
    from parallel import mesh as M
    got = []

    class Stop(Exception):
        pass

    def build(dims, device):
        meshes = M.Meshes(dims, 0, device)
        meshes.set_timeouts = lambda s: got.append(("set_timeouts", s)) or (_ for _ in ()).throw(Stop())
        return meshes
    monkeypatch.setattr(M, "pick_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(M, "init_process_group", lambda device, backend, s: got.append(("init", s)))
    monkeypatch.setattr(M, "build_meshes", build)
    cfg = load_config(None, ["--parallel.timeout_s=1200", "--parallel.warmup_timeout_s=900"])
    with pytest.raises(Stop):
        train_rl._run_role(cfg, None, None)
    assert got == [("init", 1200.0), ("set_timeouts", 1200.0)]



class _Meshes:
    """Two trainer ranks, their own process group `group` (a test breaks it, the harness's stays
    whole), and one generator leader that is never reached."""

    def __init__(self, rank, group):
        import torch
        self.rank, self.device, self.trainer_group = rank, torch.device("cpu"), group
        self.dims = ns(trainer_rank_list=[0, 1], trainer_fsdp=2,
                       generator_mesh_ranks=lambda: [[2]])
        self.trainer = type("Mesh", (dict,), {"get_coordinate": lambda m: [rank, 0]})(
            fsdp=ns(get_group=lambda: self.trainer_group))

    def set_timeouts(self, seconds):
        pass


def _two_trainers(rank, link, **trainer):
    """A TrainerWorker on two trainer ranks with their own process group; fake generators,
    training and weight sends."""
    import torch.distributed as dist
    from trainer import worker as W
    cfg = ns(trainer=ns(prompts_per_step=1, max_nonfinite_steps=3, **trainer),
             algo=ns(buffer_capacity=4, max_staleness=1), generator=ns(n_samples=1),
             parallel=ns(timeout_s=30.0, warmup_timeout_s=30.0), logging=ns(progress=False),
             checkpoint=ns(every_steps=0, hf_export_every=0))
    sender = ns(push=lambda v: None, wait_sent=lambda: None, close=lambda: None)
    w = W.TrainerWorker(cfg, _Meshes(rank, dist.new_group([0, 1])), None, None, None, sender, link)
    W.train_step = lambda *a, **k: ns(stats={"tokens": 1.0, "is_ratio_max": 1.0}, skipped=False)
    w._collect = lambda: []
    return w


def _raised(call) -> str:
    try:
        call()
        return "no error"
    except Exception as e:  # noqa: BLE001 (what each rank raises is the test)
        return f"{type(e).__name__}: {e}"


def _owner_fails_alone(rank, world, max_steps, fail):
    """Trainer rank 0 (the owner) fails in step 1 after the step's last collective, in work it
    does alone (`fail`: its weights message to a generator, or its metrics row); trainer rank 1
    goes on to its next meeting with it. What each raises, and what rank 0 told the generators."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout
    told = []

    def send(dst, kind, version, payload=None):
        if fail == "send":
            raise TimeoutError("rank 0 timed out after 1s waiting for rank 2 to receive a "
                               "WEIGHTS_READY message (it sends at most 64 messages ahead)")

    def log(row):
        if fail == "log":
            raise OSError(28, "No space left on device")
    link = ns(send=send, flush=lambda timeout_s=None: None,
              broadcast_shutdown=lambda error, announce=True: told.append(error))
    w = _two_trainers(rank, link if rank == 0 else None, max_steps=max_steps)
    w.logger, w._metrics = ns(log=log) if rank == 0 else None, lambda *a: {}
    _set_pg_timeout(timedelta(seconds=3), w.meshes.trainer_group)  # rank 1's wait for rank 0
    return {"error": _raised(w.run), "told": told}


@pytest.mark.parametrize("max_steps, fail, cause", [
    (3, "send", "TimeoutError: rank 0 timed out after 1s waiting for rank 2 to receive a "
                "WEIGHTS_READY message (it sends at most 64 messages ahead)"),
    (1, "log", "OSError: [Errno 28] No space left on device")])
def test_the_owners_failure_between_steps_reaches_the_other_trainer_ranks(max_steps, fail, cause):
    """Trainer rank 0 fails after the step's last collective, alone (its weights message to a
    generator timed out, its metrics row failed): the other trainer ranks, in their next meeting
    with it (the next step's start, or the run's end after its last step), timed out with gloo's
    bare "Timed out waiting ... for send operation", or went on to the end as if it had not."""
    from tests.dist import run_ranks
    owner, follower = run_ranks(_owner_fails_alone, 2, max_steps, fail, timeout=60)
    assert owner["error"] == cause
    assert follower["error"] == f"PeerError: trainer rank 0 failed after step 1: {cause}"
    assert owner["told"] == [f"trainer rank 0: {cause}"]


def _owner_gone(rank, world, leaves_cause):
    """Trainer rank 0 fails at the start of step 2 and exits (with a link: its cause left in the
    job's store as it shuts the generators down); trainer rank 1 waits for it. What each
    raises."""
    import gc

    import torch.distributed as dist
    from trainer import worker as W
    from trainer.link import Link
    link = Link(0, [], timeout_s=30) if rank == 0 and leaves_cause else None
    w = _two_trainers(rank, link, max_steps=3)
    w._push_weights = lambda: None

    def maybe_kill(r, step):
        if r == 0 and step == 2:
            raise MemoryError("host out of memory")
    W.maybe_kill = maybe_kill
    out = _raised(w.run)
    if rank == 0:  # it exits: its connections close
        group = w.meshes.trainer_group
        del w
        gc.collect()
        dist.destroy_process_group(group)
        del group
        gc.collect()
    if link is not None:
        link.close()
    return out


@pytest.mark.parametrize("leaves_cause", [True, False])
def test_a_trainer_rank_that_lost_the_owner_names_the_step_and_the_owners_cause(leaves_cause):
    """The other trainer ranks wait for trainer rank 0 in collectives (the step's start, its
    batch, the stats); where it failed elsewhere and exited, they failed with gloo's bare
    "Connection closed by peer": no step, nothing awaited, no cause. The cause comes from the
    job's store, where the owner's link left it (trainer/link.py)."""
    from tests.dist import run_ranks
    owner, follower = run_ranks(_owner_gone, 2, leaves_cause, timeout=60)
    assert owner == "MemoryError: host out of memory"
    if leaves_cause:
        assert follower == ("PeerError: trainer rank 0 failed: trainer rank 0: MemoryError: host "
                            "out of memory (trainer rank 1 waited for the other trainer ranks at "
                            "the start of step 2)")
    else:
        assert follower.startswith("ConnectionError: trainer rank 1 waited for the other trainer "
                                   "ranks at the start of step 2, which failed: ")


def test_a_failed_prune_of_an_old_checkpoint_warns_and_the_next_save_retries(tmp_path, monkeypatch,
                                                                             capsys):
    """Trainer rank 0 prunes the old checkpoints after the save's last sync point: a failure there
    (a network file system's "Directory not empty", a permission) killed the run that had just
    saved a new checkpoint, and the other trainer ranks then failed without the cause. Now a
    warning naming the folder and the error; the next save's prune deletes it."""
    import os
    import shutil

    from parallel import checkpoint as C
    from trainer import checkpointing
    from trainer import worker as W

    def save_sharded(path, model, opt, extra, group=None):  # every rank's shards, then renamed
        path.mkdir(parents=True)
        (path / ".metadata").write_text("")
        return path
    monkeypatch.setattr(C, "save_sharded", save_sharded)
    monkeypatch.setattr(W, "broadcast_json", lambda obj, src, group: obj)  # one trainer rank
    monkeypatch.setattr(checkpointing, "_owner_extra", lambda worker, step: {"step": step})
    worker = ns(is_owner=True, model=None, opt=None,
                cfg=ns(run=ns(dir=str(tmp_path)), checkpoint=ns(keep_last=1)),
                meshes=ns(dims=ns(trainer_rank_list=[0]), trainer_group=None))
    root = tmp_path / "checkpoints"
    checkpointing.save(worker, 1)
    rmtree = shutil.rmtree

    def nfs_rmtree(path, ignore_errors=False, **kwargs):
        if ignore_errors:
            return rmtree(path, ignore_errors=True, **kwargs)
        raise OSError(39, "Directory not empty", str(path))
    monkeypatch.setattr(shutil, "rmtree", nfs_rmtree)
    capsys.readouterr()
    assert checkpointing.save(worker, 2) == root / "step_000002"
    err = capsys.readouterr().err
    assert err.startswith(f"warning: could not prune the old checkpoints under {root} "
                          "(checkpoint.keep_last=1): OSError: [Errno 39] Directory not empty: "
                          f"'{root / 'step_000001'}'"), err
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002"]
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    checkpointing.save(worker, 3)
    assert sorted(os.listdir(root)) == ["step_000003"]
