"""Off-policy buffer and staleness gate: properties under simulated interleavings, real threads
for blocking (synchronised by the buffer's own counters and joins, never by sleeping)."""
import doctest
import random
import threading
import time

import pytest

import trainer.buffer
from trainer.batch import Group, Trajectory
from trainer.buffer import (BufferClosed, GenerationGate, OffPolicyBuffer,
                            staleness_gate_allows)


def make_group(pid, version, n=2, newer=None, replica=-1):
    """n samples; when `newer` is set, later tokens were sampled by that (newer) version."""
    later = version if newer is None else newer
    trajs = [Trajectory(pid, j, [1, 2], [3, 4, 5], [-0.5] * 3, [version, later, later],
                        float(j), "stop") for j in range(n)]
    return Group(pid, trajs, replica)


def wait_until(pred, timeout=5.0):
    """Spin (no sleep) until `pred()`; used only to observe that a thread reached its wait."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "the other thread never reached its wait"


def test_docstring_examples():
    assert doctest.testmod(trainer.buffer).failed == 0


def test_gate_formula_matches_areal():
    # B = 4, eta = 1, version 2: groups 1..16 may start ((16 - 1) // 4 = 3 <= 3), 17 may not.
    assert staleness_gate_allows(16, 2, batch_groups=4, max_staleness=1)
    assert not staleness_gate_allows(17, 2, batch_groups=4, max_staleness=1)
    buf = OffPolicyBuffer(capacity_samples=64, max_staleness=1, batch_groups=4, group_size=2)
    assert buf.admit_allowed(16, 2) and not buf.admit_allowed(17, 2)
    with pytest.raises(ValueError, match="counts the new group"):
        staleness_gate_allows(0, 0, 4, 1)


def _simulate(seed, in_order):
    """Generator and trainer act in a random interleaving. The generator samples with the
    trainer's current weights (mid-generation weight swaps give later tokens newer versions).
    `in_order`: groups finish in start order; else any in-flight group may finish next."""
    rng = random.Random(seed)
    B, n, eta = rng.randint(1, 4), rng.randint(1, 3), rng.randint(0, 3)
    buf = OffPolicyBuffer(capacity_samples=(eta + 2) * B * n + rng.randint(0, 5), max_staleness=eta,
                          batch_groups=B, group_size=n)
    gate = GenerationGate(B, eta)
    version, inflight, trained, max_staleness_seen = 0, [], 0, 0
    while version < 40:
        action = rng.random()
        if action < 0.35:
            if gate.try_acquire():
                inflight.append((gate.n_started, version))
        elif action < 0.7 and inflight:
            pid, v0 = inflight[0 if in_order else rng.randrange(len(inflight))]
            if buf.try_put(make_group(pid, v0, n, newer=version)):
                inflight.remove((pid, v0))
        elif action >= 0.7:
            batch = buf.try_take(B, version)
            if batch is not None:
                assert len(batch) == B and all(g.num_samples == n for g in batch)
                staleness = [version - g.min_version for g in batch]
                assert max(staleness) <= eta, (seed, staleness)     # never trains stale samples
                max_staleness_seen = max(max_staleness_seen, *staleness)
                trained += B
                version += 1
                gate.update(version, buf.stats()["dropped_stale"])
        st = buf.stats()
        # every started group is trained, buffered, in flight or counted as dropped
        assert gate.n_started == trained + st["size_groups"] + len(inflight) + st["dropped_stale"]
        assert st["size_samples"] <= buf.capacity_samples
    return buf.stats(), eta, max_staleness_seen


@pytest.mark.parametrize("seed", range(40))
def test_gate_bounds_staleness_so_nothing_is_dropped(seed):
    stats, eta, seen = _simulate(seed, in_order=True)
    assert stats["dropped_stale"] == 0
    assert seen <= eta


def test_out_of_order_completion_drops_but_never_trains_stale_and_never_deadlocks():
    dropped = [_simulate(seed, in_order=False)[0]["dropped_stale"] for seed in range(40)]
    assert sum(dropped) > 0    # stragglers do go stale; they are counted, and the loop finished


def test_eta_zero_trains_only_current_version():
    B, n = 2, 2
    buf = OffPolicyBuffer(capacity_samples=8, max_staleness=0, batch_groups=B, group_size=n)
    gate = GenerationGate(B, 0)
    for version in range(5):
        while gate.try_acquire():
            buf.put(make_group(gate.n_started, version, n), timeout=1.0)
        assert len(buf) == B                     # the gate admitted exactly one batch
        batch = buf.take(B, version, timeout=1.0)
        assert {g.min_version for g in batch} == {version}
        gate.update(version + 1)
    assert buf.stats()["dropped_stale"] == 0


@pytest.mark.parametrize("B,n,eta,gen_dp", [(2, 2, 1, 1), (3, 2, 2, 2), (5, 1, 0, 3), (4, 3, 3, 3)])
def test_the_smallest_capacity_config_accepts_holds_all_the_gate_lets_in(B, n, eta, gen_dp):
    """Trainer rank 0 puts the generators' groups into its buffer from its own thread, the one
    that takes (TrainerWorker._on_message): a full buffer there waits for room that nothing can
    make, and the run dies. The generator replicas run as far ahead as their staleness gate
    allows (rollout/worker.py) before each take; the smallest algo.buffer_capacity that
    Config.validate accepts must still hold all of it (one step's worth did not)."""
    import types
    from config import ConfigError, load_config
    from rollout.worker import replica_share
    from trainer.link import Message, Msg
    from trainer.worker import TrainerWorker

    def accepted(capacity):
        try:
            return load_config(None, [f"--trainer.prompts_per_step={B}", f"--generator.n_samples={n}",
                                      f"--algo.max_staleness={eta}", f"--algo.buffer_capacity={capacity}"])
        except ConfigError:
            return None
    cfg = next(c for c in map(accepted, range(1, 1000)) if c is not None)
    cfg.parallel.timeout_s = 0.01  # a put that has to wait fails the test at once
    owner = types.SimpleNamespace(cfg=cfg, buffer=OffPolicyBuffer(cfg.algo.buffer_capacity, eta, B, n))
    shares = [replica_share(B, gen_dp, r) for r in range(gen_dp)]
    started = [0] * gen_dp
    for version in range(6):  # the generators hold this version's weights, as early as can be
        for r, share in enumerate(shares):
            groups = []
            while staleness_gate_allows(started[r] + 1, version, share, eta):
                started[r] += 1
                groups.append(make_group(f"{r}-{started[r]}", version, n).to_dict())
            TrainerWorker._on_message(owner, Message(Msg.TRAJECTORIES, version, 1 + r, groups))
        assert len(owner.buffer) == (eta + 1) * B  # the gate's whole window was delivered
        assert owner.buffer.try_take(B, version) is not None


def test_take_drops_stale_and_returns_oldest_fresh_first():
    buf = OffPolicyBuffer(capacity_samples=20, max_staleness=1, batch_groups=2, group_size=2)
    for pid, v in [(1, 5), (2, 3), (3, 4), (4, 6), (5, 4)]:
        buf.put(make_group(pid, v), timeout=1.0)
    batch = buf.take(2, trainer_version=5, timeout=1.0)    # versions >= 4; 3 is stale
    assert [g.prompt_id for g in batch] == [3, 5]
    st = buf.stats()
    assert st["dropped_stale"] == 1 and st["dropped_stale_samples"] == 2
    assert st["size_groups"] == 2 and st["taken_groups"] == 2
    # dropped groups give their slot back in the gate
    assert buf.admit_allowed(n_generated_groups=2 * (5 + 1 + 1) + 1, trainer_version=5)


def test_groups_stay_whole():
    buf = OffPolicyBuffer(capacity_samples=9, max_staleness=0, batch_groups=1, group_size=3)
    with pytest.raises(ValueError, match="group_size=3"):
        buf.put(make_group(1, 0, n=2), timeout=1.0)
    g = make_group(1, 0, n=3)
    buf.put(g, timeout=1.0)
    (out,) = buf.take(1, 0, timeout=1.0)
    assert out is g and [t.sample_idx for t in out.trajectories] == [0, 1, 2]


def test_back_pressure_blocks_put_until_take_frees_room():
    buf = OffPolicyBuffer(capacity_samples=4, max_staleness=2, batch_groups=1, group_size=2)
    buf.put(make_group(1, 0), timeout=1.0)
    buf.put(make_group(2, 0), timeout=1.0)
    assert not buf.try_put(make_group(3, 0))
    errors = []

    def producer():
        try:
            buf.put(make_group(3, 1), timeout=10.0)
        except Exception as e:      # surfaced in the main thread below
            errors.append(e)

    t = threading.Thread(target=producer)
    t.start()
    wait_until(lambda: buf.stats()["waiting_puts"] == 1)
    assert len(buf) == 2                                # still blocked: full
    buf.take(1, trainer_version=0, timeout=1.0)
    t.join(timeout=10.0)
    assert not t.is_alive() and not errors
    assert len(buf) == 2 and buf.num_samples == 4


def test_blocked_take_wakes_on_put():
    buf = OffPolicyBuffer(capacity_samples=8, max_staleness=0, batch_groups=2, group_size=2)
    result = []
    t = threading.Thread(target=lambda: result.append(buf.take(2, 3, timeout=10.0)))
    t.start()
    wait_until(lambda: buf.stats()["waiting_takes"] == 1)
    buf.put(make_group(1, 3), timeout=1.0)
    buf.put(make_group(2, 2), timeout=1.0)              # stale for version 3: dropped on wake
    buf.put(make_group(3, 3), timeout=1.0)
    t.join(timeout=10.0)
    assert [g.prompt_id for g in result[0]] == [1, 3]
    assert buf.stats()["dropped_stale"] == 1


def test_timeout_messages_name_what_was_awaited():
    buf = OffPolicyBuffer(capacity_samples=4, max_staleness=1, batch_groups=2, group_size=2)
    buf.put(make_group(7, 4), timeout=1.0)
    with pytest.raises(TimeoutError, match=r"for 2 groups with min_version >= 4 .*trainer_version 5"
                                           r".*it has 1 \(versions \[4\]\)"):
        buf.take(2, trainer_version=5, timeout=0.01)
    buf.put(make_group(8, 4), timeout=1.0)
    with pytest.raises(TimeoutError,
                       match=r"room for 2 samples \(group prompt_id=9\).*4/4 samples"):
        buf.put(make_group(9, 4), timeout=0.01)
    gate = GenerationGate(batch_groups=2, max_staleness=1)
    assert gate.try_acquire() and gate.try_acquire() and gate.try_acquire() and gate.try_acquire()
    with pytest.raises(TimeoutError, match=r"group 5 may start only at trainer version >= 1, "
                                           r"trainer is at 0"):
        gate.acquire(timeout=0.01)
    with pytest.raises(ValueError, match="finite timeout"):
        buf.take(1, 0, timeout=None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_timeouts_are_rejected(bad):
    """A NaN timeout passed the `< 0` check and made a wait last for ever (Condition.wait_for
    never times out on NaN); inf overflowed the deadline with a bare OverflowError. Each call
    here could proceed at once, so the old code went ahead instead of raising."""
    buf = OffPolicyBuffer(capacity_samples=4, max_staleness=0, batch_groups=1, group_size=2)
    with pytest.raises(ValueError, match=f"OffPolicyBuffer.put needs a finite timeout.*got {bad}"):
        buf.put(make_group(1, 0), timeout=bad)
    assert len(buf) == 0
    buf.put(make_group(1, 0), timeout=1.0)
    with pytest.raises(ValueError, match=f"OffPolicyBuffer.take needs a finite timeout.*got {bad}"):
        buf.take(1, 0, timeout=bad)
    assert len(buf) == 1
    gate = GenerationGate(batch_groups=1, max_staleness=0)
    with pytest.raises(ValueError, match=f"GenerationGate.acquire needs a finite .*got {bad}"):
        gate.acquire(timeout=bad)
    assert gate.n_started == 0


def test_gate_pauses_generator_until_trainer_advances():
    gate = GenerationGate(batch_groups=1, max_staleness=0)
    assert gate.acquire(timeout=1.0) == 1 and not gate.try_acquire()
    got = []
    t = threading.Thread(target=lambda: got.append(gate.acquire(timeout=10.0)))
    t.start()
    gate.update(1)
    t.join(timeout=10.0)
    assert got == [2] and gate.trainer_version == 1
    gate.update(0)                              # stale message: versions only move forward
    assert gate.trainer_version == 1


def test_close_wakes_waiters_with_reason():
    buf = OffPolicyBuffer(capacity_samples=2, max_staleness=0, batch_groups=1, group_size=2)
    errors = []

    def consumer():
        try:
            buf.take(1, 0, timeout=10.0)
        except BufferClosed as e:
            errors.append(str(e))

    t = threading.Thread(target=consumer)
    t.start()
    wait_until(lambda: buf.stats()["waiting_takes"] == 1)
    buf.close("generator rank 3 crashed")
    t.join(timeout=10.0)
    assert errors == ["buffer closed: generator rank 3 crashed"]
    with pytest.raises(BufferClosed):
        buf.try_put(make_group(1, 0))


def test_state_dict_round_trip():
    buf = OffPolicyBuffer(capacity_samples=12, max_staleness=2, batch_groups=2, group_size=2)
    for pid, v in [(1, 3), (2, 1), (3, 2)]:
        buf.put(make_group(pid, v, newer=v + 1), timeout=1.0)
    buf.take(1, trainer_version=3, timeout=1.0)           # takes pid 2 (oldest)
    state = buf.state_dict()
    assert {type(x) for x in state["groups"]} == {dict}   # plain python data
    fresh = OffPolicyBuffer(capacity_samples=12, max_staleness=2, batch_groups=2, group_size=2)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert fresh.stats() == buf.stats()
    got = fresh.take(2, trainer_version=3, timeout=1.0)
    assert [(g.prompt_id, g.min_version) for g in got] == [(3, 2), (1, 3)]
    assert got[0].trajectories[1].token_versions == [2, 3, 3]
    small = OffPolicyBuffer(capacity_samples=2, max_staleness=2, batch_groups=1, group_size=2)
    with pytest.raises(ValueError, match="holds 4 samples but capacity_samples is 2"):
        small.load_state_dict(state)
    # groups of one version come back in arrival order, though a take has left the heap's own
    # list in another (2, 4, 3 here)
    same = OffPolicyBuffer(capacity_samples=12, max_staleness=2, batch_groups=2, group_size=2)
    for pid in range(1, 5):
        same.put(make_group(pid, 3), timeout=1.0)
    same.take(1, trainer_version=3, timeout=1.0)
    fresh.load_state_dict(same.state_dict())
    assert [g.prompt_id for g in fresh.take(2, trainer_version=3, timeout=1.0)] == [2, 3]


def test_config_validation():
    with pytest.raises(ValueError, match=r"cannot hold one trainer batch .* 4 \* 3"):
        OffPolicyBuffer(capacity_samples=11, max_staleness=1, batch_groups=4, group_size=3)
    buf = OffPolicyBuffer(capacity_samples=12, max_staleness=1, batch_groups=4, group_size=3)
    with pytest.raises(ValueError, match=r"take\(5\) must ask for 1..4 groups"):
        buf.take(5, 0, timeout=0.01)


def test_groups_of_engine_completions_keep_prompt_order_and_sample_order():
    """Completions arrive in the order they finish; each prompt becomes one group (first seen
    first), its samples sorted by index, each with its own reward and the engine's mu/versions."""
    from rollout.engine import Completion

    def done(pid, j):
        return Completion(pid, j, [1, 2], [3 + j, 4], [-0.1 * j, -0.2], [7, 8], "length", {}, 2)
    order = [done("b", 1), done("a", 0), done("b", 0), done("a", 1)]
    groups = Group.of_completions(order, [0.5, 1.0, 0.0, 0.25])
    assert [g.prompt_id for g in groups] == ["b", "a"]
    assert [[t.sample_idx for t in g.trajectories] for g in groups] == [[0, 1], [0, 1]]
    assert [[t.reward for t in g.trajectories] for g in groups] == [[0.0, 0.5], [1.0, 0.25]]
    b1 = groups[0].trajectories[1]
    assert (b1.completion_ids, b1.logp_mu, b1.token_versions) == ([4, 4], [-0.1, -0.2], [7, 8])
    with pytest.raises(ValueError):  # a reward missing: nothing is silently dropped
        Group.of_completions(order, [0.5])
    # two requests of one prompt (a step across an epoch boundary): two groups, not one of 2n
    twice = Group.of_completions(order, [0.5, 1.0, 0.0, 0.25], {"a": 7, "b": 7})
    assert [(g.prompt_id, g.num_samples) for g in twice] == [(7, 2), (7, 2)]


def test_training_order_is_independent_of_arrival():
    from trainer.worker import training_order

    def group(pid, version, first):
        return Group(pid, [Trajectory(pid, 0, [1], [first, 2], [-0.1, -0.2], [version, version],
                                      0.5, "length")])
    groups = [group(7, 1, 5), group(3, 1, 9), group(7, 1, 4), group(2, 0, 8)]
    want = [(2, 8), (3, 9), (7, 4), (7, 5)]
    for arrival in (groups, groups[::-1], groups[1:] + groups[:1]):
        got = training_order(arrival)
        assert [(g.prompt_id, g.trajectories[0].completion_ids[0]) for g in got] == want


def test_a_prompt_in_flight_twice_makes_two_whole_groups(tmp_path):
    """The generator's requests are keyed by start index: when a new (reshuffled) epoch draws a
    prompt whose group is still in flight, both groups are shipped whole (keyed by prompt id,
    the second overwrote the first: a group of 2n samples, or a KeyError)."""
    import concurrent.futures
    import types

    from model import load_pretrained
    from rollout.data import PromptItem, PromptSource
    from rollout.engine import Engine
    from rollout.worker import GeneratorWorker
    from tools.make_tiny_model import make_random_model
    model = load_pretrained(make_random_model(tmp_path / "m", hidden=32), dtype="float32").eval()
    items = [PromptItem(id=i, prompt=f"p{i}", messages=None, answer="") for i in range(3)]
    ns = types.SimpleNamespace
    cfg = ns(trainer=ns(prompts_per_step=4), parallel=ns(gen_dp=1), algo=ns(max_staleness=0),
             generator=ns(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, greedy=False,
                          n_samples=2, stop_token_ids=[], ignore_eos=True, seed=0))
    sent = []
    link = ns(send=lambda dst, kind, version, payload=None: sent.extend(payload or []))

    def reward(item, text, ids):
        done = concurrent.futures.Future()
        done.set_result(float(item.id))
        return done
    engine = Engine(model, num_slots=8, max_len=32)
    worker = GeneratorWorker(cfg, engine, PromptSource(items, seed=0), ns(decode=str),
                             ns(submit=reward), link, None, 0, 0,
                             encode=lambda it: [1, 5 + it.id, 7])
    worker._admit()  # 4 groups of 3 prompts: one prompt twice
    drawn = [p.item.id for p in worker.pending.values()]
    assert len(drawn) == 4 and len(set(drawn)) == 3
    while engine.has_work():
        engine.step()
        worker._collect()
        worker._ship_scored()
    groups = [Group.from_dict(d) for d in sent]
    assert sorted(g.prompt_id for g in groups) == sorted(drawn)
    assert all(sorted(t.sample_idx for t in g.trajectories) == [0, 1] for g in groups)
    assert not worker.pending and worker.groups_sent == 4


def test_stale_drops_are_counted_per_replica_and_survive_a_checkpoint():
    buf = OffPolicyBuffer(capacity_samples=16, max_staleness=1, batch_groups=1, group_size=2)
    for pid, (version, replica) in enumerate([(0, 1), (0, 1), (0, 0), (2, 0), (2, 1)]):
        buf.put(make_group(pid, version, replica=replica), timeout=1.0)
    assert len(buf.take(1, trainer_version=2, timeout=1.0)) == 1  # drops the three of v0
    assert [buf.dropped_of(r) for r in (0, 1, 2)] == [1, 2, 0]
    fresh = OffPolicyBuffer(capacity_samples=16, max_staleness=1, batch_groups=1, group_size=2)
    fresh.load_state_dict(buf.state_dict())
    assert [fresh.dropped_of(r) for r in (0, 1, 2)] == [1, 2, 0]
    assert {g.replica for g in fresh.take(1, 2, timeout=1.0)} <= {0, 1}
    old = {k: v for k, v in buf.state_dict().items() if k != "dropped_by"}  # earlier checkpoints
    with pytest.warns(UserWarning, match="3 stale drops are not attributed to replicas"):
        fresh.load_state_dict(old)
    assert fresh.dropped_of(1) == 0


def _replicas_with_a_straggler(give_back: bool, seed: int, B=4, replicas=2, eta=1, ticks=300):
    """Two generator replicas, each behind its own gate (rollout/worker.py), feed one buffer;
    replica 1 sometimes takes 8 ticks a group. After each step every gate learns the trainer's
    version and, with `give_back`, its replica's stale drops (as the weights message carries
    them). Returns (steps trained, groups dropped)."""
    rng = random.Random(seed)
    buf = OffPolicyBuffer(capacity_samples=10_000, max_staleness=eta, batch_groups=B, group_size=1)
    gates = [GenerationGate(B // replicas, eta) for _ in range(replicas)]
    flight: list[list] = [[] for _ in range(replicas)]
    version = pid = 0
    for tick in range(ticks):
        for r, gate in enumerate(gates):
            for done in [f for f in flight[r] if f[0] <= tick]:
                flight[r].remove(done)
                buf.put(make_group(done[1], done[2], n=1, replica=r), timeout=1.0)
            while gate.try_acquire():
                pid += 1
                flight[r].append((tick + (rng.choice([1, 1, 2, 8]) if r else 1), pid, version))
        assert any(map(len, flight)) or len(buf) >= B, "deadlock: nothing in flight, too few here"
        if buf.try_take(B, version) is not None:
            version += 1
            for r, gate in enumerate(gates):
                gate.update(version, buf.dropped_of(r) if give_back else None)
    return version, buf.stats()["dropped_stale"]


@pytest.mark.parametrize("seed", range(3))
def test_stale_drops_given_back_keep_the_pipeline_asynchronous(seed):
    """A dropped group's place in its replica's window comes back with the next weights. Not
    given back (as the generator did before), each drop shrank the window for good: after
    max_staleness * B drops (here 4, the start-up's stragglers suffice) the replicas could no
    longer run ahead at all, and the run was synchronous from then on, 2-3x slower here."""
    steps, dropped = _replicas_with_a_straggler(True, seed)
    steps_kept, dropped_kept = _replicas_with_a_straggler(False, seed)
    assert dropped_kept == 1 * 4 and dropped > dropped_kept  # the window shrank to nothing
    assert steps > 1.5 * steps_kept
