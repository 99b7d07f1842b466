"""A generator replica with TP 2 on real gloo ranks (rollout/worker.py): one rank's failure reaches
the other rank of its replica with its cause, whichever rank fails and wherever.

The leader (tp rank 0) alone talks to the trainer; every rank steps the engine, whose TP forward
all-reduces over the replica (the fake engine's one all-reduce a step stands for it). A failure on
one rank left the other in its next collective: it ended with a bare gloo time-out (or
"Connection closed by peer") after the group's timeout, naming nothing, and a leader whose
follower failed told the trainer only that gloo error."""
import types
from datetime import timedelta

import pytest

from tests.dist import run_ranks

ns = types.SimpleNamespace
TP_TIMEOUT_S = 3.0  # the TP group's: a rank left waiting for a failed peer gives up after this


class _TPEngine:
    """A TP replica's engine: each step all-reduces over the TP group (the TP matmuls'), and a
    request's `n` samples finish after 2 steps. `fail_at`: the step that raises (before its
    all-reduce), as a CUDA error on this rank alone would."""

    def __init__(self, tp_group, fail_at=None):
        self.tp, self.fail_at = tp_group, fail_at
        self.running, self.finished, self.steps = {}, [], 0

    def has_work(self):
        return bool(self.running)

    def add_requests(self, requests):
        for r in requests:
            self.running[r.request_id] = [r, 0]

    def step(self):
        import torch
        import torch.distributed as dist
        from rollout.engine import Completion
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError(f"CUDA error: out of memory (step {self.steps})")
        dist.all_reduce(torch.ones(1), group=self.tp)
        for rid, entry in list(self.running.items()):
            entry[1] += 1
            if entry[1] == 2:
                r = self.running.pop(rid)[0]
                self.finished += [Completion(rid, j, list(r.prompt_ids), [3, 4], [-0.5, -0.5],
                                             [0, 0], "length", {}, len(r.prompt_ids))
                                  for j in range(r.params.n)]

    def poll_finished(self):
        out, self.finished = self.finished, []
        return out

    def load_weights(self, apply, version):
        pass


class _LeaderLink:
    """The trainer as the leader sees it: `inbox` (one list of messages a poll), and a `send` of
    message type `fails` that raises, as one to a trainer that is gone does."""

    def __init__(self, inbox, fails=None):
        self.inbox, self.fails, self.sent = list(inbox), fails, []

    def poll(self):
        if self.fails == "poll":
            raise ConnectionError("the link's poll: its store is gone")
        return self.inbox.pop(0) if self.inbox else []

    def send(self, dst, kind, version, payload=None):
        if kind.name == self.fails:
            raise ConnectionError(f"trainer rank 0 took no {kind.name} message in 10s")
        self.sent.append(kind.name)

    def wait_for(self, types, what, timeout_s=None, consume=True):
        if not self.inbox:  # the paused leader's wait: ends if a message is there
            raise TimeoutError(f"waited {timeout_s}s for {what}")


def _replica(rank, scenario, fails, fail_rank, fail_at):
    """Ranks 0-1: one generator replica with TP 2 (a TP group of its own). What each rank raised,
    its engine steps (an evaluation's included) and the leader's messages sent."""
    import torch.distributed as dist
    from launch import preemption
    from rollout.data import PromptItem, PromptSource
    from rollout.worker import GeneratorWorker
    from trainer.link import Message, Msg
    tp_group = dist.new_group([0, 1], timeout=timedelta(seconds=TP_TIMEOUT_S))
    weights = Message(Msg.WEIGHTS_READY, 1, 0, {"dropped": 0})
    inbox = {"weights": [[weights]], "evaluation": [[weights]],
             "checkpoint": [[Message(Msg.CHECKPOINT, 0, 0)]],
             "checkpoint, shutdown": [[Message(Msg.CHECKPOINT, 0, 0), Message(Msg.SHUTDOWN, 0, 0)]],
             "clean": [[], [], [weights], [], [Message(Msg.SHUTDOWN, 1, 0)]]}.get(scenario, [])
    from tests.test_worker_cut import generator_cfg, scored
    cfg = generator_cfg(max_staleness=0, max_new_tokens=2, warmup_timeout_s=10.0)
    items = [PromptItem(id=i, prompt=f"p{i}", messages=None, answer="") for i in range(4)]
    engine = _TPEngine(tp_group, fail_at if rank == fail_rank else None)
    link = _LeaderLink(inbox, fails) if rank == 0 else None
    w = GeneratorWorker(cfg, engine, PromptSource(items, seed=0), ns(decode=str),
                        scored(1.0), link, ns(receive=lambda v: None), 0, 0,
                        tp_group=tp_group, encode=lambda it: [1, 5 + it.id])
    if scenario == "evaluation":  # an evaluation after each swap: engine steps of its own
        w.evaluator = ns(due=lambda version: True,
                         maybe_run=lambda version: (engine.step(), {"time_s": 0.0})[1])
    requested = preemption.requested
    if scenario == "stop" and rank == 0:
        preemption.requested = lambda: "SIGTERM"  # this rank alone got the signal
    try:
        w.run()
        error = "no error"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        preemption.requested = requested
    return {"error": error, "steps": engine.steps, "sent": link.sent if link else []}


def _replicas(rank, world, runs):
    """`_replica` for each (scenario, fails, fail_rank, fail_at) of `runs`, one after the other."""
    return {"runs": [_replica(rank, *run) for run in runs]}


LEADER_ONLY = [  # (scenario, the leader's send or poll that fails, engine steps before it)
    ("groups", "TRAJECTORIES", 2),   # _ship_scored, after the first groups' 2 steps
    ("weights", "ACK", 0),           # _swap's ack, before any engine step
    ("checkpoint", "CHECKPOINT", 0),  # _handle's reply with the cut
    ("checkpoint, shutdown", "CHECKPOINT", 0),  # the run ends with that batch of messages
    ("evaluation", "ACK", 0),        # reported before the evaluation after the swap
    ("evaluation", "EVALUATING", 0),
    ("stop", "STOP", 1),             # _pass_on_stop: reported at the next poll
    ("none", "poll", 0)]             # the leader's own link.poll


def test_a_leader_only_failure_reaches_the_followers_with_its_cause():
    """A link failure on the leader alone (outside the paused wait, which already told them)
    raised there at once; the follower went on to its next collective (the next poll's broadcast
    or the engine's all-reduce) and failed after the TP group's timeout with a gloo error. Now the
    leader goes on in lockstep to the next broadcast, sends its cause there and raises. And in a
    run without failures the broadcasts that would carry one are matched on both ranks: groups,
    new weights and their ack, more groups, the shutdown. (One spawn for all: the ranks' start
    costs more than the scenarios.)"""
    runs = [(scenario, fails, None, None) for scenario, fails, _ in LEADER_ONLY]
    leader, follower = run_ranks(_replicas, 2, runs + [("clean", None, None, None)], timeout=60)
    for (scenario, fails, steps), lead, follow in zip(LEADER_ONLY, leader["runs"],
                                                      follower["runs"]):
        assert lead["error"].startswith("ConnectionError: "), (scenario, fails, lead)
        assert fails in lead["error"], (scenario, lead)
        assert follow["error"] == f"PeerError: this TP group's leader failed: {lead['error']}", (
            scenario, fails, follow)
        assert lead["steps"] == follow["steps"] == steps, (scenario, fails, lead, follow)
    assert leader["runs"][-1] == {"error": "no error", "steps": 4,
                                  "sent": ["TRAJECTORIES", "ACK", "TRAJECTORIES"]}
    assert follower["runs"][-1] == {"error": "no error", "steps": 4, "sent": []}


@pytest.mark.parametrize("fail_rank, other", [(1, "tp rank 1"), (0, "tp rank 0")])
def test_a_rank_failing_in_the_engine_is_named_by_the_other(fail_rank, other):
    """One rank of the replica fails inside the engine step (before the TP all-reduce): the other
    waits in that all-reduce until the TP group's timeout (or until the failed rank's process
    is gone). It failed with the gloo error alone: a leader's shutdown told the trainer that
    gloo error instead of its follower's cause. Now the failed rank leaves its cause in the job's
    store, and the other raises an error naming it. (A spawn each: the store keeps a failed
    rank's cause for the rest of the job.)"""
    from rollout.worker import ReplicaRankFailed
    from trainer.link import PeerError
    out = run_ranks(_replicas, 2, [("none", None, fail_rank, 2)], timeout=60)
    failed, waited = out[fail_rank]["runs"][0], out[1 - fail_rank]["runs"][0]
    assert failed["error"] == "RuntimeError: CUDA error: out of memory (step 2)"
    assert waited["error"] == (f"ReplicaRankFailed: generator rank {fail_rank} ({other} of this "
                               f"replica) failed: {failed['error']}"), waited
    # rollout/role.py tells the trainer any failure of a leader but a PeerError (the trainer's
    # own shutdown): a follower's cause must not come as one
    assert not issubclass(ReplicaRankFailed, PeerError)


def test_reward_failures_get_a_console_line_when_they_grow_at_most_once_a_minute(capsys):
    """The runner logs only the first error and time-out of a reward; one that then fails for
    most samples showed only as a flat reward curve. The leader prints the counts when they grew
    since its last line, at most every RewardReport.EVERY_S."""
    from types import SimpleNamespace as ns
    from rollout.rewards import RewardReport
    from rollout.worker import GeneratorWorker
    counts = {"calls": 10, "errors": 0, "timeouts": 0, "skipped": 0, "guarded": 0, "stuck": 0}
    w = GeneratorWorker.__new__(GeneratorWorker)
    w.rewards, w.replica, w.cfg = ns(stats=lambda: dict(counts)), 1, ns(reward=ns(timeout_s=5.0))
    w.reward_report = RewardReport()
    w._report_rewards()
    assert capsys.readouterr().out == ""  # nothing failed
    counts.update(calls=20, errors=3, timeouts=1)
    w._report_rewards()
    assert capsys.readouterr().out == (  # none skipped or guarded: not spoken of (a user's
        "generator replica 1: of 20 reward calls so far, 3 raised and 1 ran past "  # reward was
        "reward.timeout_s=5.0 (scored 0.0)\n")  # told of "too large for math_verify")
    counts.update(errors=4, skipped=2, guarded=1)
    w._report_rewards()
    assert capsys.readouterr().out == ""  # within the minute
    w.reward_report.next_at = 0.0  # the minute is over
    w._report_rewards()
    assert capsys.readouterr().out == (
        "generator replica 1: of 22 reward calls so far, 4 raised and 1 ran past "
        "reward.timeout_s=5.0 (scored 0.0), 2 were skipped (too many stuck: scored 0.0 without "
        "running), 1 answers were compared as strings (too large for math_verify)\n")
    w._report_rewards()
    assert capsys.readouterr().out == ""  # no new failure
    w.rewards = ns()  # a runner without counts (a TP follower's Unscored has empty ones)
    w._report_rewards()
    assert capsys.readouterr().out == ""


def test_a_follower_killed_without_a_word_is_named_by_its_leader(monkeypatch):
    """A TP follower SIGKILLed (the out-of-memory killer) leaves no cause in the store: its leader
    and the trainer said only gloo's "Connection closed by peer". On its host the leader now
    finds it exited (its pid file; a zombie until torchrun reaps it counts)."""
    import torch.distributed as dist
    from launch import preemption
    from rollout import worker
    monkeypatch.setattr(dist, "get_rank", lambda: 4)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [4, 5])
    monkeypatch.setattr(worker, "left_error", lambda rank: None)
    monkeypatch.setattr(preemption, "exited_ranks", lambda: [])
    assert worker._peer_failure(object()) is None  # nothing known: the caller's gloo error stands
    monkeypatch.setattr(preemption, "exited_ranks", lambda: [5])
    assert worker._peer_failure(object()) == (
        "generator rank 5 (tp rank 1 of this replica) exited without a word: killed (SIGKILL, or "
        "the kernel's out-of-memory killer: see dmesg; torchrun's summary names its signal)")
    monkeypatch.setattr(worker, "left_error", lambda rank: "RuntimeError: boom" if rank == 5 else None)
    assert worker._peer_failure(object()).endswith("failed: RuntimeError: boom")  # a cause wins


def _broadcasts(rank, world):
    import torch.distributed as dist
    from rollout import worker
    from trainer.link import Msg
    group, pickled, real = dist.new_group([0, 1]), [], dist.broadcast_object_list
    dist.broadcast_object_list = lambda *a, **k: pickled.append(1) or real(*a, **k)
    msg = ns(type=Msg.WEIGHTS_READY, version=3, payload={"dropped": 1})
    got = []
    for news in ([], [msg], [], []):
        got.append(worker._tp_broadcast(group, news if rank == 0 else [], None))
    dist.broadcast_object_list = real
    return {"got": got, "pickled": len(pickled)}


def test_a_step_without_news_broadcasts_one_number_not_a_pickle():
    """The leader's per-step broadcast to its TP followers pickled an empty list every engine
    step (a size and then the bytes: two collectives and a pickle a decode step). Now a number
    says whether there is news, and only a step with news pickles it: 4 steps, 1 pickle, and
    the followers get the leader's message as it was."""
    from trainer.link import Msg
    leader, follower = run_ranks(_broadcasts, 2, timeout=60)
    assert leader["pickled"] == follower["pickled"] == 1
    assert follower["got"] == [[], [(int(Msg.WEIGHTS_READY), 3, {"dropped": 1})], [], []]
    assert leader["got"][0] == leader["got"][2] == []
