"""The cross-mesh link on real gloo ranks: typed messages, polling, queuing, timeouts, shutdown."""
import re
import time

import pytest

from tests.dist import run_ranks
from trainer.link import Link, Msg, PeerError


def _ping_pong(rank, world):
    link = Link(rank, [1 - rank], timeout_s=30)
    out = {}
    if rank == 0:
        link.send(1, Msg.STATS, 3, {"note": "first"})
        link.send(1, Msg.TRAJECTORIES, 7, [{"ids": [1, 2, 3], "logp": [-0.125, -1e-30]}])
        ack = link.wait_for(Msg.ACK, "an ack of version 7")
        out["ack_version"] = ack.version
    else:
        m = link.wait_for(Msg.TRAJECTORIES, "trajectories")  # STATS arrives first and is queued
        assert m.payload == [{"ids": [1, 2, 3], "logp": [-0.125, -1e-30]}] and m.version == 7
        queued = link.poll()
        assert [(q.type, q.payload) for q in queued] == [(Msg.STATS, {"note": "first"})]
        link.send(0, Msg.ACK, m.version)
        out["got"] = 1
    link.flush()
    return out


def test_messages_round_trip_in_order_and_queue():
    res = run_ranks(_ping_pong, 2, timeout=60)
    assert res[0]["ack_version"] == 7 and res[1]["got"] == 1


def _timeout(rank, world):
    link = Link(rank, [1 - rank], timeout_s=30)
    if rank == 0:
        with pytest.raises(TimeoutError, match=r"rank 0 timed out after 1s waiting for weights v5 from rank 1"):
            link.wait_for(Msg.WEIGHTS_READY, "weights v5", timeout_s=1, peer=1)
    link.send(1 - rank, Msg.ACK, 0)  # let both finish cleanly
    link.wait_for(Msg.ACK, "the final ack")
    link.flush()
    return {}


def test_wait_times_out_naming_peer_and_what():
    run_ranks(_timeout, 2, timeout=60)


def _shutdown(rank, world):
    import contextlib
    import io
    link = Link(rank, [1 - rank], timeout_s=30)
    said = io.StringIO()
    if rank == 1:
        with contextlib.redirect_stderr(said):
            link.broadcast_shutdown("trainer rank 1: loss is NaN")  # waits until it arrived
    else:
        with pytest.raises(PeerError, match="rank 1 shut down while rank 0 waited for trajectories: "
                                            "trainer rank 1: loss is NaN"):
            link.wait_for(Msg.TRAJECTORIES, "trajectories")
    return said.getvalue()


def test_shutdown_with_error_reaches_the_peer():
    """The cause travels with the SHUTDOWN, and the sender prints it first: torchrun's teardown
    (SIGTERM, as its followers exit with the cause) could end it before its own traceback."""
    said = run_ranks(_shutdown, 2, timeout=60)[1]
    assert said == "error (rank 1): trainer rank 1: loss is NaN\n"


def _two_shutdowns(rank, world):
    import contextlib
    import io
    link = Link(rank, [1 - rank], timeout_s=30)
    said = io.StringIO()
    if rank == 1:
        t0 = time.monotonic()
        with contextlib.redirect_stderr(said):
            link.broadcast_shutdown("trainer rank 1: loss is NaN")  # arrived when it returns
            link.broadcast_shutdown("trainer rank 1: again")  # e.g. a second error on the way out
        return {"said": said.getvalue(), "seconds": time.monotonic() - t0}
    with pytest.raises(PeerError, match="trainer rank 1: loss is NaN"):
        link.wait_for(Msg.TRAJECTORIES, "trajectories")  # and reads nothing after it
    return {}


def test_a_second_shutdown_is_not_sent_to_a_peer_that_stopped_at_the_first():
    """The peer stops reading at the first SHUTDOWN: the second's body was never received, the
    sender's wait for it timed out (5 s) and gloo then closed every pair of the process group,
    so the harness's barrier failed ("Application timeout caused pair closure" on the sender,
    "Connection closed by peer" on the receiver). Both causes are still printed."""
    out = run_ranks(_two_shutdowns, 2, timeout=60)[1]
    assert out["said"] == ("error (rank 1): trainer rank 1: loss is NaN\n"
                           "error (rank 1): trainer rank 1: again\n")
    assert out["seconds"] < 4.0  # no wait for the unread second one (its timeout is 5 s)


def _replica_fails(rank, world):
    """Rank 1, a generator replica, fails; rank 0, the trainer, waits for groups; rank 2, the
    other replica, waits for the trainer's next message."""
    import types
    from trainer.worker import TrainerWorker
    link = Link(rank, [1, 2] if rank == 0 else [0], timeout_s=10)
    if rank == 1:
        link.broadcast_shutdown("generator rank 1: RuntimeError: boom", announce=False)
        return {}
    if rank == 2:
        m = link.wait_for(Msg.SHUTDOWN, "the trainer's next message")
        return {"error": m.payload["error"]}
    for dst in (1, 2):  # the last step's weights: rank 1 never takes them
        link.send(dst, Msg.WEIGHTS_READY, 2, {"dropped": 0})
    sent, send = [], link.send
    link.send = lambda dst, *a, **k: (sent.append(dst), send(dst, *a, **k))[1]
    trainer = types.SimpleNamespace(
        step=2, stopped=None, link=link, meshes=types.SimpleNamespace(rank=0),
        cfg=types.SimpleNamespace(trainer=types.SimpleNamespace(max_steps=5)),
        _one_step=lambda: link.wait_for(Msg.TRAJECTORIES, "4 prompt groups for step 3"))
    with pytest.raises(PeerError, match="generator rank 1: RuntimeError: boom"):
        TrainerWorker.run(trainer)
    return {"sent": sent}


def test_a_replicas_failure_reaches_the_other_replicas_with_its_cause():
    """The trainer re-raised a generator's failure (PeerError) without telling the other
    replicas: on another host they failed on the lost store or their timeout, without the
    cause. Not sent to the replica that failed, nor waited for what that one never took: it
    reads nothing more (a wait for its weights message timed out first, and closed the process
    group before the other replica had taken its SHUTDOWN)."""
    out = run_ranks(_replica_fails, 3, timeout=60)
    assert out[0]["sent"] == [2]
    assert out[2]["error"] == ("trainer rank 0: PeerError: rank 1 shut down while rank 0 waited "
                               "for 4 prompt groups for step 3: generator rank 1: RuntimeError: boom")


def _many(rank, world):
    link = Link(rank, [1 - rank], timeout_s=30, max_in_flight=4)
    if rank == 1:
        for i in range(40):
            link.send(0, Msg.TRAJECTORIES, i, [i])
        left = len(link._sends)
        link.wait_for(Msg.ACK, "the receipt of all 40")
        link.flush()
        return {"left": left}
    got = [link.wait_for(Msg.TRAJECTORIES, f"message {i}").version for i in range(40)]
    link.send(1, Msg.ACK, 0)
    link.flush()
    return {"got": got}


def test_a_sender_runs_through_its_window_and_every_message_arrives_in_order():
    """40 messages through a window of 4: each look that finds the window's older half taken
    frees it all; no message is lost or reordered."""
    receiver, sender = run_ranks(_many, 2, timeout=60)
    assert receiver["got"] == list(range(40)) and sender["left"] <= 4


def _full_window(rank, world):
    """Rank 1, a generator, ships more messages than its window holds (max_in_flight 2) to rank
    0, the trainer at its end, which reads nothing more: it sends the final SHUTDOWN and waits
    until that is received."""
    link = Link(rank, [1 - rank], timeout_s=10, max_in_flight=2)
    if rank == 1:
        for i in range(5):
            link.send(0, Msg.TRAJECTORIES, i, [{"prompt_id": i}])
        return {"got": link.wait_for(Msg.SHUTDOWN, "the final SHUTDOWN").version}
    link.send(1, Msg.SHUTDOWN, 7)
    link.flush()
    return {}


def test_a_sender_with_a_full_window_still_reads_the_final_shutdown():
    """The sender waited in gloo for the trainer to take its oldest message, the trainer for it
    to take the SHUTDOWN: both timed out, and a run whose generator shipped more than 64 groups
    during the last step failed after it (no export, no COMPLETE). Its window wait now ends
    when the receiver has shut down."""
    assert run_ranks(_full_window, 2, timeout=60)[1] == {"got": 7}


def _final_shutdowns(rank, world):
    """Rank 0, the trainer with a window of 2, sends each leader its final weights, then each a
    SHUTDOWN; leader 1 reads its SHUTDOWN 2 s later (replica 0's final evaluation)."""
    leaders = list(range(1, world))
    link = Link(rank, leaders if rank == 0 else [0], timeout_s=8, max_in_flight=2)
    if rank == 0:
        for leader in leaders:
            link.send(leader, Msg.WEIGHTS_READY, 5)
        time.sleep(0.5)  # every leader took its weights
        t0 = time.monotonic()
        for leader in leaders:
            link.send(leader, Msg.SHUTDOWN, 5)
        link.flush()
        return {"shutdown_s": time.monotonic() - t0}
    link.wait_for(Msg.WEIGHTS_READY, "the final weights")
    if rank == 1:
        time.sleep(2.0)
    return {"got": link.wait_for(Msg.SHUTDOWN, "the final SHUTDOWN").type.name}


def test_the_final_shutdowns_each_arrive_though_the_window_fills_between_them():
    """A peer sent a SHUTDOWN still reads up to it: the window dropped such a peer's unread
    SHUTDOWN as if the peer had shut down (a gloo send never waited for never arrives), so
    replica 0 timed out after its final evaluation, and the trainer's flush did not wait for it."""
    trainer, *leaders = run_ranks(_final_shutdowns, 4, timeout=60)
    assert leaders == [{"got": "SHUTDOWN"}] * 3
    assert trainer["shutdown_s"] > 1.0  # it waited for leader 1's evaluation


def test_a_full_window_looks_at_the_store_ever_less_often():
    """A sender blocked on a full window polls the job's store for its receipt: every 10 ms, 100
    looks a second for each of hundreds of generator replicas blocked through a trainer step. It
    backs off to RECEIPT_POLL_MAX_S, and still sees the receipt within one pause."""
    from collections import deque

    import trainer.link as L

    class Store:  # the oldest message is taken 1.5 s from now; no SHUTDOWN is ever waiting
        def __init__(self):
            self.calls, self.taken_at = 0, time.monotonic() + 1.5

        def check(self, keys):
            self.calls += 1
            return time.monotonic() < self.taken_at

        def add(self, key, n):
            self.calls += 1
            return 0

    link = L.Link.__new__(L.Link)
    link.rank, link.timeout_s, link._next_ticket = 0, 30.0, 1
    link._gone, link._shut = set(), set()
    link.store = Store()
    popped = []
    link._pop_sent = lambda: popped.append(link._sends.popleft())
    link._sends = deque([(None, None, 1, Msg.TRAJECTORIES, "1/1")])
    t0 = time.monotonic()
    link._wait_oldest()
    waited = time.monotonic() - t0
    assert len(popped) == 1 and 1.5 <= waited < 1.5 + L.RECEIPT_POLL_MAX_S + 0.5
    assert link.store.calls < 30, link.store.calls  # 10 ms polls: ~300 calls


def _window_times_out(rank, world):
    import torch.distributed as dist
    link = Link(rank, [1 - rank], timeout_s=1, max_in_flight=1)
    out = {}
    if rank == 1:
        link.send(0, Msg.TRAJECTORIES, 0, [])
        with pytest.raises(TimeoutError) as e:
            link.send(0, Msg.TRAJECTORIES, 1, [])
        out["error"] = str(e.value)
    dist.barrier()  # rank 0 reads nothing until then; the process group is whole
    if rank == 0:
        out["got"] = [m.version for m in (link.wait_for(Msg.TRAJECTORIES, "group 0"),
                                          link.wait_for(Msg.TRAJECTORIES, "group 1"))]
    link.flush()
    return out


def test_a_full_window_times_out_naming_the_receiver_and_keeps_the_process_group():
    """A receiver that reads nothing: the sender's window wait ends after timeout_s, naming it,
    and without a timed-out gloo wait, which would have closed every pair of the process group
    (the barrier after it failed)."""
    out = run_ranks(_window_times_out, 2, timeout=60)
    assert out[1]["error"] == ("rank 1 timed out after 1s waiting for rank 0 to receive a "
                               "TRAJECTORIES message (it sends at most 1 messages ahead)")
    assert out[0]["got"] == [0, 1]


def test_a_ctrl_c_shutdown_prints_nothing_of_its_own(capsys):
    """Ctrl-C prints one line for the whole run (train_rl.py): the broadcast stays silent. The
    cause left in the store for late readers is the first one."""
    from collections import deque

    import torch.distributed as dist
    link = Link.__new__(Link)
    link.rank, link.peers, link._sends, link.store = 1, [], deque(), dist.HashStore()
    link.broadcast_shutdown("trainer rank 1: KeyboardInterrupt: ", announce=False)
    assert capsys.readouterr().err == ""
    link.broadcast_shutdown("trainer rank 1: RuntimeError: boom")
    assert capsys.readouterr().err == "error (rank 1): trainer rank 1: RuntimeError: boom\n"
    assert link._left_error(1) == "trainer rank 1: KeyboardInterrupt: " and link._left_error(0) is None


def test_a_blocked_wait_does_not_hold_up_other_threads_store_calls():
    """wait_for blocks in the store on the key of its next message, through a connection of its
    own: another thread of the process (the CUDA-IPC sender signals versions through the store)
    keeps its round trips while this one waits. On the shared connection a set took ~1.8 s here."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    link = Link(0, [1], timeout_s=30, store=dist.PrefixStore("test/", store))
    errors = []

    def wait():
        try:
            link.wait_for(Msg.ACK, "an ack that never comes", timeout_s=2)
        except TimeoutError as e:
            errors.append(e)
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # the waiter is blocked in the store now
    t0 = time.perf_counter()
    store.set("other/thread", "v")
    assert store.get("other/thread") == b"v"
    assert time.perf_counter() - t0 < 0.5
    waiter.join()
    assert len(errors) == 1 and "an ack that never comes" in str(errors[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_wait_without_a_finite_timeout_is_refused_naming_it(bad):
    """A NaN timeout made wait_for spin for ever (`now > nan` is never true; a whole core, for
    minutes here) and inf either waited for ever (a store without clone(): 1 ms polls) or failed
    with the clock's "timestamp out of range for platform time_t", naming nothing. The wait runs
    in a thread, so that a hang fails this test instead of blocking it."""
    import threading

    import torch.distributed as dist

    with pytest.raises(ValueError, match=rf"Link needs a finite timeout_s >= 0 .*got {bad}"):
        Link(0, [1], timeout_s=bad, store=dist.HashStore())
    link = Link(0, [1], timeout_s=30, store=dist.HashStore())
    errors = []

    def wait():
        try:
            link.wait_for(Msg.ACK, "an ack of v1", timeout_s=bad)
        except Exception as e:  # noqa: BLE001 (recorded for the assertion)
            errors.append(e)
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), f"wait_for(timeout_s={bad}) still waits for an ack after 10 s"
    assert re.search(rf"Link.wait_for \(an ack of v1\) needs a finite timeout_s >= 0 .*got {bad}",
                     f"{type(errors[0]).__name__}: {errors[0]}"), errors
    with pytest.raises(ValueError, match=rf"Link.flush needs a finite timeout_s >= 0 .*got {bad}"):
        link.flush(bad)
    link.close()


def _quiet_polls(rank, world):
    link = Link(rank, [1 - rank], timeout_s=30)
    if rank == 0:
        link.wait_for(Msg.STATS, "the peer's idle polls")
        link.send(1, Msg.TRAJECTORIES, 4, [1, 2])
        link.wait_for(Msg.ACK, "the peer's ack")
        link.close()
        return {}
    import time
    reads = []
    receive = link._receive_published
    link._receive_published = lambda: (reads.append(1), receive())[1]
    for _ in range(50):
        assert link.poll() == []
        time.sleep(0.001)
    idle_reads = len(reads)
    link.send(0, Msg.STATS, 0)
    deadline, got = time.monotonic() + 20, []
    while not got and time.monotonic() < deadline:
        got = link.poll()
    link.close()
    watcher_alive = link._watcher.is_alive()
    link.send(0, Msg.ACK, 4)
    link.flush()
    return {"idle_reads": idle_reads, "got": [(int(m.type), m.version, m.payload) for m in got],
            "reads": len(reads), "watcher_alive": watcher_alive}


def test_polls_read_the_store_only_after_the_bell():
    """50 polls with nothing sent make no store round trip; the message that comes is read after
    its bell; close() ends the watcher thread."""
    res = run_ranks(_quiet_polls, 2, timeout=60)[1]
    assert res["idle_reads"] == 0
    assert res["got"] == [(int(Msg.TRAJECTORIES), 4, [1, 2])]
    assert 1 <= res["reads"] <= 3 and not res["watcher_alive"]


def _cut(rank, world):
    from trainer.checkpointing import gather_cut
    link = Link(rank, [0] if rank else [1, 2], timeout_s=30)
    if rank == 0:  # the buffer owner
        replies, before = gather_cut(link, [1, 2], step=5)
        rest = [link.wait_for(Msg.TRAJECTORIES, "a group after the cut") for _ in range(2)]
        rest = [(m.src, m.type.name, m.payload) for m in rest]
        link.send(1, Msg.SHUTDOWN, 5)
        link.send(2, Msg.SHUTDOWN, 5)
        link.flush()
        return {"replies": replies, "before": [(m.src, m.type.name, m.payload) for m in before],
                "rest": rest}
    # a generator leader: a group shipped before its reply, the reply, then one shipped after it
    assert link.wait_for(Msg.CHECKPOINT, "the cut").version == 5
    if rank == 2:
        time.sleep(0.5)  # rank 1's group after its reply arrives while the owner waits for this one
    link.send(0, Msg.TRAJECTORIES, 4, [f"g{rank}a"])
    link.send(0, Msg.CHECKPOINT, 5, {"inflight": [f"g{rank}b"]})
    link.send(0, Msg.TRAJECTORIES, 5, [f"g{rank}b"])
    link.wait_for(Msg.SHUTDOWN, "the end")
    link.flush()
    return {}


def test_the_cut_takes_what_each_generator_sent_before_its_reply_and_leaves_the_rest_queued():
    """A group shipped after its generator's CHECKPOINT reply is in that reply's in-flight list:
    in the checkpoint's buffer too, a resumed run would train it twice (seen with two generator
    replicas, before gather_cut: the owner drained every message that had arrived)."""
    out = run_ranks(_cut, 3, timeout=90)[0]
    assert out["replies"] == {1: {"inflight": ["g1b"]}, 2: {"inflight": ["g2b"]}}
    assert sorted(out["before"]) == [(1, "TRAJECTORIES", ["g1a"]), (2, "TRAJECTORIES", ["g2a"])]
    assert sorted(out["rest"]) == [(1, "TRAJECTORIES", ["g1b"]), (2, "TRAJECTORIES", ["g2b"])]


def _stop_notice(rank, world):
    """Rank 1: a generator replica's leader that got SIGTERM; rank 0: the trainer's first rank."""
    import types
    from config import Config
    from launch import preemption
    from rollout.worker import GeneratorWorker
    from trainer.worker import TrainerWorker
    link = Link(rank, [1 - rank], timeout_s=30)
    if rank == 1:
        preemption.request("SIGTERM")
        worker = GeneratorWorker(Config().resolve(2), None, None, None, None, link, None,
                                 trainer_rank0=0, replica=0)
        worker._pass_on_stop()
        worker._pass_on_stop()  # passed on once
        link.send(0, Msg.ACK, 1)
        link.wait_for(Msg.SHUTDOWN, "the end")
        link.flush()
        return {}
    got = [link.wait_for({Msg.STOP, Msg.ACK}, "the notice") for _ in range(2)]
    assert preemption.requested() is None
    TrainerWorker._on_message(types.SimpleNamespace(), got[0])  # the owner's handling of it
    link.send(1, Msg.SHUTDOWN, 1)
    link.flush()
    return {"got": [(m.type.name, m.payload) for m in got], "requested": preemption.requested()}


def test_a_generator_leader_passes_its_sigterm_on_to_the_trainer_once():
    """`kill -TERM` of a generator rank alone stops the run like a SIGTERM to every rank: its
    notice makes the trainer's first rank decide the stop (launch/preemption.py; the stop itself
    under torchrun: tests/test_faults.py)."""
    out = run_ranks(_stop_notice, 2, timeout=60)[0]
    assert out["got"] == [("STOP", {"reason": "SIGTERM on generator rank 1"}), ("ACK", None)]
    assert out["requested"] == "SIGTERM on generator rank 1"


def test_link_keys_carry_the_attempt_only_in_torchruns_shared_store(monkeypatch):
    """The restart count is per node: keys prefixed by it went unmatched across nodes, so they
    carry it only where one shared store outlives the attempts (one node's torchrun default)."""
    from trainer.link import _attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert _attempt() == "2/"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store per rendezvous round
    assert _attempt() == ""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert _attempt() == ""


def _late_reader(rank, world, port):
    """Rank 1 fails and shuts down; rank 0 reads its SHUTDOWN only after rank 1 gave up waiting
    for it and left (rank 0 was in a collective, or still starting up)."""
    import torch.distributed as dist
    link = Link(rank, [1 - rank], timeout_s=30)
    out = {}
    if rank == 1:
        link.broadcast_shutdown("generator rank 1: RuntimeError: boom", timeout_s=0.5,
                                announce=False)
        dist.destroy_process_group()  # this rank exits: its connections close
        link.store.set("sender_gone", "1")
    else:
        link.store.wait(["sender_gone"])
        try:
            link.wait_for(Msg.TRAJECTORIES, "trajectories")
            out["error"] = "no error"
        except Exception as e:  # noqa: BLE001 (what the receiver says is the test)
            out["error"] = f"{type(e).__name__}: {e}"
    link.close()
    if rank == 0:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    return out


def test_a_shutdown_read_after_its_sender_left_still_names_the_cause():
    """The sender waits a few seconds for a peer to take its SHUTDOWN; a peer that read it later
    (busy in a collective, or still starting up) found the body gone with its sender: gloo
    refused the receive at once, "RuntimeError: ... Connection closed by peer", without the cause.
    The sender leaves the cause in the job's store (torchrun's agent holds it; it outlives the
    ranks), and the SHUTDOWN arrives with it."""
    from tests.dist import free_port
    out = run_ranks(_late_reader, 2, free_port(), timeout=60)[0]
    assert out["error"] == ("PeerError: rank 1 shut down while rank 0 waited for trajectories: "
                            "generator rank 1: RuntimeError: boom")


def test_a_lost_peer_names_the_failure_another_node_recorded(monkeypatch):
    """A node whose ranks torchrun ended records why in the job's store (launch/preemption.py);
    a rank whose receive from one of them failed first ("Connection closed by peer", the dying
    rank's exit) said only that it lost its peer. Without a record: as before."""
    import torch.distributed as dist
    from launch import preemption
    from trainer.link import Link, PeerError
    link = Link(0, [2], timeout_s=30, store=dist.HashStore())
    closed = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    assert type(link._broken(closed, "the body of a message from rank 2", 2)) is ConnectionError
    what = "rank 3 (host h, node 1) exited, and torchrun ended the other ranks of that node"
    monkeypatch.setattr(preemption, "recorded_failure", lambda: what)
    err = link._broken(closed, "the body of a message from rank 2", 2)
    assert isinstance(err, PeerError) and str(err) == (
        f"the run failed on another node: {what} (rank 0 lost rank 2 while waiting for the body "
        "of a message from rank 2)")


def test_recorded_failure_reads_the_first_record_of_the_jobs_store(monkeypatch):
    import json
    import torch.distributed as dist
    from launch import preemption
    store = dist.HashStore()
    monkeypatch.setattr(preemption, "_failures", store)
    assert preemption.recorded_failure() is None
    store.set(preemption.FAILED_KEY, json.dumps({"node": "1", "what": "rank 3 exited"}))
    assert preemption.recorded_failure() == "rank 3 exited"
    monkeypatch.setattr(preemption, "_failures", None)
    assert preemption.recorded_failure() is None
