"""Same-GPU weight sync (weights_sync/ipc.py) and the per-peer transport factory (sync.py).

CUDA is absent in CI, so the IPC protocol runs with its CPU stand-in (a shared-memory file per
staging buffer, torch's file_system sharing): handles exported once, ready/ack sequencing, buffer
reuse only after the ack, timeouts naming the peer and version. Single-process tests drive the
state machine step by step over an in-memory store; multi-process tests run it on real gloo ranks,
alone and mixed with gloo point-to-point peers. The CUDA tests skip without a GPU.
"""
import concurrent.futures
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.layout import Box, Layout, ParamSpec
from tests.dist import run_ranks
from weights_sync.ipc import Control, CpuShmMemory, IpcReceiver, IpcSender, _decode, _encode
from weights_sync.plan import plan
from weights_sync.sync import MultiReceiver, MultiSender, WeightReceiver, WeightSender, \
    make_receiver, make_sender, transport_for

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----- pure pieces ---------------------------------------------------------------------------

def test_handle_encoding_round_trips_without_pickle():
    args = (torch.Tensor, torch.Size([3, 4]), (4, 1), 0, torch.UntypedStorage, torch.bfloat16, 0,
            b"\x00\xffhandle", 96, 0, False, b"ref", 8, None, True)
    assert _decode(_encode(args)) == args
    with pytest.raises(TypeError, match="cannot encode type"):
        _encode(dict)


def test_cuda_handle_binds_to_torchs_rebuild_with_this_process_device(monkeypatch):
    """The CUDA open path without a GPU: the decoded handle binds to torch's
    rebuild_cuda_tensor signature, and the device is the receiver's own index."""
    import torch.multiprocessing.reductions as red
    from weights_sync.ipc import CudaIpcMemory
    seen = {}

    @functools.wraps(red.rebuild_cuda_tensor)  # keeps the real signature for the binding
    def fake(*a):
        seen["args"] = a
    monkeypatch.setattr(red, "rebuild_cuda_tensor", fake)
    args = (torch.Tensor, torch.Size([4]), (1,), 0, torch.UntypedStorage, torch.bfloat16, 3,
            b"h", 8, 0, False, b"r", 0, b"e", True)
    CudaIpcMemory(torch.device("cuda", 1)).open({"args": _encode(args)})
    assert seen["args"][6] == 1 and seen["args"][:6] == args[:6] and seen["args"][7:] == args[7:]
    with pytest.raises(RuntimeError, match="cannot share it by IPC"):
        CudaIpcMemory(torch.device("cuda", 0)).export(torch.zeros(2))  # a CPU tensor


@pytest.mark.parametrize("a,b,want", [
    (("h", 0), ("h", 0), "ipc"), (("h", 0), ("h", 1), "nccl"), (("h", 0), ("g", 0), "nccl"),
    (("h", -1), ("h", -1), "gloo"), (("h", 0), ("h", -1), "gloo"), (None, ("h", 0), "gloo"),
    # with UUIDs (what build_meshes gathers) the UUID decides, not the process-local index:
    (("h", 0, "GPU-a"), ("h", 0, "GPU-b"), "nccl"),  # SLURM per-task binding: both see cuda:0
    (("h", 1, "GPU-a"), ("h", 0, "GPU-a"), "ipc"),  # one GPU under two CUDA_VISIBLE_DEVICES orders
    (("h", -1, ""), ("h", -1, ""), "gloo")])
def test_transport_per_pair(a, b, want):
    gpu_of = {r: g for r, g in ((0, a), (1, b)) if g is not None}
    assert transport_for(0, 1, gpu_of) == want
    assert transport_for(0, 1, None) == "gloo"


@pytest.mark.parametrize("a,b,shm,no_shm", [
    (("h", -1, "h/boot1"), ("h", -1, "h/boot1"), "ipc", "gloo"),  # CPU ranks sharing this host
    (("h", -1, "h/boot1"), ("h", -1, "h/boot2"), "gloo", "gloo"),  # same name, another machine
    (("h", -1, ""), ("h", -1, ""), "gloo", "gloo"),  # no boot id (not Linux): never shared memory
    (("h", -1, "h/boot1"), ("h", 0, "GPU-a"), "gloo", "gloo"),
    (("h", 0, "GPU-a"), ("h", 0, "GPU-a"), "ipc", "ipc")])  # CUDA IPC whatever cpu_shm says
def test_cpu_ranks_of_one_host_share_memory(a, b, shm, no_shm):
    gpu_of = {0: a, 1: b}
    assert transport_for(0, 1, gpu_of, cpu_shm=True) == shm
    assert transport_for(0, 1, gpu_of, cpu_shm=False) == no_shm


def test_host_memory_id(tmp_path):
    import socket
    from parallel.mesh import host_memory_id
    (tmp_path / "boot_id").write_text("1234-abcd\n")
    assert host_memory_id(str(tmp_path / "boot_id")) == f"{socket.gethostname()}/1234-abcd"
    assert host_memory_id(str(tmp_path / "missing")) == ""


def test_control_messages_are_consumed_and_polled_without_blocking():
    c = Control(dist.HashStore(), "t")
    assert c.take_ready(0, 1, 3) is None and c.acked(0, 1, 0) is None and c.latest(0, 1) is None
    c.publish_ready(0, 1, 3, slot=1)
    assert c.latest(0, 1) == 3 and c.take_ready(0, 1, 2) is None
    assert c.take_ready(0, 1, 3) == 1 and c.take_ready(0, 1, 3) is None  # consumed
    c.ack(0, 1, 1, 3)
    assert c.acked(0, 1, 1) == 3 and c.acked(0, 1, 0) is None and c.acked(1, 0, 1) is None


# ----- the protocol in one process: two trainer "ranks" 0, 1 (row halves) -> generator rank 2 --

class Toy(nn.Module):
    def __init__(self, rows: int, dtype=torch.float32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(rows, 4, generator=g).to(dtype))
        self.b = nn.Parameter(torch.randn(5, generator=g).to(dtype))


def _toy_plan(n_src=2, rows=6, dst_rank=9):
    """Trainer ranks 0..n_src-1 hold row blocks of w (rows, 4) and all of b; generator rank
    `dst_rank` holds everything."""
    specs = [ParamSpec("w", (rows, 4), "float32"), ParamSpec("b", (5,), "float32")]
    block = rows // n_src
    src_boxes = {r: {"w": Box((r * block, 0), (block, 4)), "b": Box((0,), (5,))}
                 for r in range(n_src)}
    # b is replicated on the trainer: the planner splits its receivers between the copies
    src = Layout(tuple(specs), tuple(range(n_src)), src_boxes, (tuple(range(n_src)),))
    dst = Layout(tuple(specs), (dst_rank,),
                 {dst_rank: {"w": Box.full((rows, 4)), "b": Box.full((5,))}}, ((dst_rank,),))
    return plan(src, dst, specs)


def _pair(buffers=1, timeout_s=5.0, gen_dtype=torch.bfloat16, direct=False):
    """One trainer rank 0 holding everything, one generator rank 9, an in-memory store."""
    p = _toy_plan(n_src=1)
    store = dist.HashStore()
    trainer, gen = Toy(6, seed=1), Toy(6, gen_dtype, seed=2)
    sender = IpcSender(trainer, p, 0, gen_dtype, timeout_s, buffers=buffers, store=store)
    recv = IpcReceiver(gen, p, 9, timeout_s, store=store, direct=direct)
    return trainer, gen, sender, recv


def _bump(model, version):
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(version)


def _same(trainer, gen):
    return all(torch.equal(gen.get_parameter(n), p.detach().to(gen.get_parameter(n).dtype))
               for n, p in trainer.named_parameters())


@pytest.mark.parametrize("direct", [False, True])
def test_versions_arrive_bitwise_and_apply_is_atomic(direct):
    trainer, gen, sender, recv = _pair(direct=direct)
    for v in (1, 2, 3):
        _bump(trainer, v)
        assert not recv.ready(v)
        sender.push(v)
        sender.wait_sent()
        assert recv.ready(v) and not recv.ready(v + 1)  # a poll, nothing consumed
        before = {n: p.detach().clone() for n, p in gen.named_parameters()}
        apply = recv.receive(v)
        assert all(torch.equal(before[n], p) for n, p in gen.named_parameters())  # not yet
        apply()
        assert _same(trainer, gen), v
    sender.close()


@pytest.mark.parametrize("buffers,direct", [(1, False), (2, False), (1, True), (0, False),
                                            (0, True)])
def test_no_message_before_its_copy_is_done(buffers, direct):
    """What the CUDA path relies on: a slot is announced only once filled, and released (acked)
    only once copied out of. CPU copies are synchronous, so the other order (ack, then copy)
    passed every other test here, fast and slow; on a GPU the trainer would refill the slot
    while the generator still copied it. Here each peer acts the moment it is told: the
    generator reads a slot when it is announced, the trainer overwrites it (zero copy: its
    parameters) when it is acked."""
    trainer, gen, sender, recv = _pair(buffers=buffers, direct=direct)
    announced = {}
    publish, ack = sender.control.publish_ready, recv.control.ack

    def publish_and_read(s, d, version, slot):
        publish(s, d, version, slot)
        if not sender.zero_copy:
            announced[version] = (slot, sender.staging[d][slot].clone())

    def ack_and_overwrite(s, d, slot, version):
        ack(s, d, slot, version)
        for t in sender.tensors.values() if sender.zero_copy else [sender.staging[d][slot]]:
            t.fill_(float("nan"))  # the trainer's next fill (zero copy: update) may start now

    sender.control.publish_ready, recv.control.ack = publish_and_read, ack_and_overwrite
    g = torch.Generator().manual_seed(7)
    for v in (1, 2, 3):
        with torch.no_grad():
            for prm in trainer.parameters():
                prm.copy_(torch.randn(prm.shape, generator=g))
        want = {n: prm.detach().to(torch.bfloat16) for n, prm in trainer.named_parameters()}
        sender.push(v)
        if not sender.zero_copy:
            sender.wait_sent()
            slot, seen = announced[v]
            assert torch.equal(seen, sender.staging[9][slot]), v  # announced after the fill
        recv.receive(v)()
        sender.wait_sent()
        assert all(torch.equal(gen.get_parameter(n), t) for n, t in want.items()), v
    sender.close()


def test_handles_are_exported_and_mapped_once():
    trainer, gen, sender, recv = _pair(buffers=2)
    ptrs = [b.data_ptr() for b in sender.staging[9]]
    mapped = None
    for v in range(1, 5):
        sender.push(v)
        recv.receive(v)()
        mapped = mapped or list(recv.sources[0])
        assert [b.data_ptr() for b in sender.staging[9]] == ptrs
        assert all(a is b for a, b in zip(recv.sources[0], mapped))
    sender.close()


def test_staging_is_reused_only_after_the_ack():
    trainer, gen, sender, recv = _pair(buffers=1, timeout_s=1.0)
    want = {n: p.detach().to(torch.bfloat16) for n, p in trainer.named_parameters()}
    sender.push(1)
    sender.wait_sent()
    _bump(trainer, 2)  # v2 differs from v1, so a v2 written into the buffer would show
    sender.push(2)  # staging v2 needs the only buffer, which still holds unacked v1
    with pytest.raises(TimeoutError, match=r"generator rank 9 has not acked weights version 1"):
        sender.wait_sent()
    # the refused version never touched the buffer: the receiver still gets v1 intact
    recv.receive(1)()
    assert all(torch.equal(gen.get_parameter(n), t) for n, t in want.items())


def test_double_buffering_keeps_an_unacked_version_intact():
    trainer, gen, sender, recv = _pair(buffers=2, timeout_s=1.0)
    snaps = {}
    for v in (1, 2):
        _bump(trainer, v)
        snaps[v] = {n: p.detach().to(torch.bfloat16) for n, p in trainer.named_parameters()}
        sender.push(v)
        sender.wait_sent()  # returns without any ack: the trainer is free to step
    sender.push(3)  # both buffers hold unacked versions: v3 must wait for v1's ack
    with pytest.raises(TimeoutError, match=r"not acked weights version 1"):
        sender.wait_sent()
    for v in (1, 2):
        recv.receive(v)()
        assert all(torch.equal(gen.get_parameter(n), t) for n, t in snaps[v].items()), v
    sender.push(3)  # slot 0 is free again
    sender.wait_sent()
    recv.receive(3)
    sender.close()


def test_direct_mode_holds_the_slot_until_applied():
    trainer, gen, sender, recv = _pair(buffers=1, timeout_s=1.0, direct=True)
    assert recv.staging_bytes == 0
    _bump(trainer, 1)
    want = {n: p.detach().to(torch.bfloat16) for n, p in trainer.named_parameters()}
    sender.push(1)
    apply = recv.receive(1)  # announced, not copied: the trainer's slot is still in use
    _bump(trainer, 2)  # v2 differs from v1, so a v2 written into the slot would show
    sender.push(2)
    with pytest.raises(TimeoutError, match="not acked weights version 1"):
        sender.wait_sent()
    apply()  # scatters from the trainer's slot, then releases it
    assert all(torch.equal(gen.get_parameter(n), t) for n, t in want.items())
    sender.push(2)
    sender.wait_sent()
    stale = recv.receive(2)
    sender.push(3)  # waits for v2's slot, held by a received but unapplied version
    with pytest.raises(TimeoutError, match="not acked weights version 2"):
        sender.wait_sent()
    sender.push(3)
    recv.receive(3)  # releases the unapplied v2 first, then finds v3
    with pytest.raises(RuntimeError, match="apply before receiving again"):
        stale()


def test_staged_apply_refuses_after_a_later_receive():
    """A staged apply() copies what the staging holds when it runs: v1's apply after receive(2)
    installed v2's weights under version 1's number, without a word (direct mode refused it)."""
    trainer, gen, sender, recv = _pair(buffers=2, timeout_s=1.0)
    _bump(trainer, 1)
    sender.push(1)
    stale = recv.receive(1)
    sender.wait_sent()
    _bump(trainer, 2)
    sender.push(2)
    current = recv.receive(2)
    with pytest.raises(RuntimeError, match="apply before receiving again"):
        stale()
    current()
    assert _same(trainer, gen)
    sender.close()


@pytest.mark.parametrize("direct", [False, True])
def test_zero_copy_reads_the_trainer_parameters(direct):
    """buffers=0: no staging on the trainer; the generator copies (and casts) its boxes straight
    out of the trainer's shared parameters, and the trainer is held until it has."""
    trainer, gen, sender, recv = _pair(buffers=0, timeout_s=1.0, direct=direct)
    assert sender.staging_bytes == 0
    for v in (1, 2):
        _bump(trainer, v)
        sender.push(v)
        apply = recv.receive(v)
        apply()
        sender.wait_sent()
        assert _same(trainer, gen), v
    sender.close()


@pytest.mark.parametrize("rows, dtype, why", [
    (4, torch.bfloat16, r"trainer rank 0 stages 29 elements, this rank expects 21: their plans "
                        r"differ; plan both ends from the same layouts"),
    (6, torch.float16, r"trainer rank 0 stages dtype bfloat16, this rank expects float16; the "
                       r"trainer must cast")])
def test_a_receiver_of_another_plan_or_dtype_is_told_which(rows, dtype, why):
    """Plans of other layouts (the same dtype) were told "the trainer must cast"."""
    store = dist.HashStore()
    sender = IpcSender(Toy(6), _toy_plan(n_src=1), 0, torch.bfloat16, 5.0, buffers=1, store=store)
    recv = IpcReceiver(Toy(rows, dtype), _toy_plan(n_src=1, rows=rows), 9, 5.0, store=store)
    sender.push(1)
    with pytest.raises(ValueError, match=rf"^generator rank 9: {why}"):
        recv.receive(1)


def test_zero_copy_holds_the_trainer_until_read():
    _, _, sender, _ = _pair(buffers=0, timeout_s=0.5)
    sender.push(1)
    with pytest.raises(TimeoutError, match=r"not acked weights version 1 after 0.5s, so the "
                                           r"parameters it reads cannot be changed"):
        sender.wait_sent()  # nobody has read version 1


def test_zero_copy_refuses_a_shard_that_does_not_hold_the_plan():
    store = dist.HashStore()
    # the trainer planned for its 4-row model (its own check passes), the generator for 6 rows
    sender = IpcSender(Toy(4), _toy_plan(n_src=1, rows=4), 0, torch.bfloat16, 5.0, buffers=0,
                       store=store)
    recv = IpcReceiver(Toy(6, torch.bfloat16), _toy_plan(n_src=1), 9, 5.0, store=store)
    with pytest.raises(ValueError, match=r"shares 'w' with shape \(4, 4\).*different layouts"):
        recv.receive(1)
    assert sender.staging_bytes == 0


def test_receiver_times_out_naming_peer_and_version():
    _, _, sender, recv = _pair(timeout_s=0.5)
    sender.push(4)
    sender.wait_sent()
    with pytest.raises(TimeoutError, match=r"version 5 from trainer rank\(s\) \[0\].*\{0: 4\}"):
        recv.receive(5)


def test_close_waits_for_the_last_ack():
    _, _, sender, recv = _pair(timeout_s=0.5)
    sender.push(1)
    with pytest.raises(TimeoutError, match="version 1"):
        sender.close()
    recv.receive(1)
    sender.close()


@pytest.mark.parametrize("buffers", [0, 1])
def test_close_after_a_failed_wait_does_not_wait_again(buffers):
    """A generator that missed its deadline already had its timeout: a cleanup's close() sat
    out another whole timeout_s and raised the same TimeoutError again. A later version that
    goes through makes close() wait for its ack as before."""
    _, _, sender, recv = _pair(buffers=buffers, timeout_s=0.3)
    sender.push(1)
    if buffers:  # one buffer: v2 waits for v1's ack
        sender.wait_sent()
        sender.push(2)
    with pytest.raises(TimeoutError, match="not acked weights version 1"):
        sender.wait_sent()
    sender.close()  # returns at once
    recv.receive(1)()
    sender.push(2)  # the generator is back: this version's waits count again
    with pytest.raises(TimeoutError, match="not acked weights version 2"):
        sender.close()


def test_a_stuck_staging_thread_times_out_with_a_watch(monkeypatch):
    """A fill that never finishes (e.g. behind a GPU stream that hangs) is outside the thread's
    polls: without a watch, wait_sent's join gave up after timeout_s plus its grace; with one
    (the trainer's first rank), its watch loop waited for ever."""
    import threading
    from weights_sync.ipc import watch_link
    _, _, sender, _ = _pair(buffers=1, timeout_s=0.2)
    monkeypatch.setattr(sender._inflight, "JOIN_GRACE_S", 0.1)
    release = threading.Event()
    monkeypatch.setattr(sender.memory, "run", lambda fn, after, *a, **k: release.wait(60))
    watch_link(sender, FakeLink(0))
    sender.push(1)
    done = concurrent.futures.ThreadPoolExecutor(1).submit(sender.wait_sent)
    try:
        with pytest.raises(TimeoutError, match=r"weights version 1: trainer rank 0 has not staged "
                                               r"it for generator ranks \[9\] \(CPU shared memory\)"):
            done.result(timeout=30)
    finally:
        release.set()


def test_a_failed_receive_leaves_no_earlier_apply_to_run():
    """Two sources, staged: receive(2) copied trainer rank 0's part of v2 into the staging, then
    timed out on rank 1. The v1 apply() still held by the caller installed rank 0's v2 rows with
    rank 1's v1 rows under version 1; it is refused, as after a completed later receive()."""
    p, store = _toy_plan(n_src=2), dist.HashStore()
    halves = [Toy(3, seed=5), Toy(3, seed=6)]
    with torch.no_grad():
        halves[1].b.copy_(halves[0].b)  # b is replicated on the trainer
    gen = Toy(6, torch.bfloat16, seed=4)
    senders = [IpcSender(h, p, r, torch.bfloat16, 0.3, buffers=2, store=store)
               for r, h in enumerate(halves)]
    recv = IpcReceiver(gen, p, 9, 0.3, store=store)
    for s in senders:
        s.push(1)
    apply1 = recv.receive(1)
    for h in halves:
        _bump(h, 100)
    senders[0].push(2)
    senders[0].wait_sent()
    with pytest.raises(TimeoutError, match=r"version 2 from trainer rank\(s\) \[1\]"):
        recv.receive(2)
    before = {n: x.detach().clone() for n, x in gen.named_parameters()}
    with pytest.raises(RuntimeError, match=r"apply\(\) of weights version 1 after a later "
                                           r"receive\(\) began refilling the staging \(not "
                                           r"completed\); apply before receiving again"):
        apply1()
    assert all(torch.equal(before[n], x) for n, x in gen.named_parameters())


def test_a_multi_senders_close_closes_every_part_then_raises_the_first_error():
    """MultiSender.close stopped at the first part that raised: the IPC part's failure left the
    point-to-point part's sends unwaited."""
    closed = []

    class Part:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def close(self):
            closed.append(self.name)
            if self.error:
                raise self.error
    sender = MultiSender.__new__(MultiSender)
    sender.parts = [Part("ipc", TimeoutError("ipc part")), Part("p2p", RuntimeError("p2p part"))]
    with pytest.raises(TimeoutError, match="ipc part"):
        sender.close()
    assert closed == ["ipc", "p2p"]


def test_dtype_mismatch_is_a_value_error():
    p = _toy_plan(n_src=1)
    store = dist.HashStore()
    IpcSender(Toy(6), p, 0, torch.float32, 5.0, store=store)  # forgot to cast to bf16
    recv = IpcReceiver(Toy(6, torch.bfloat16), p, 9, 5.0, store=store)
    with pytest.raises(ValueError, match="cast to the generator dtype"):
        recv.receive(1)


# ----- shard shapes against the plan ----------------------------------------------------------

@pytest.mark.parametrize("side,rows,direct", [
    ("generator", 8, False), ("generator", 8, True), ("generator", 4, False),
    ("generator", 4, True), ("trainer", 8, False), ("trainer", 4, False)])
def test_a_shard_of_another_shape_than_the_plan_is_refused_at_setup(side, rows, direct):
    """Box views slice silently: a generator with 8 rows where the plan has 6 received rows 0-5
    and kept 6-7 stale without a word; a trainer with 8 rows sent only its first 6; 4 rows
    failed inside the copy with a bare size mismatch. Both ends now refuse at construction,
    naming the parameter, both shapes and the fix."""
    p, store = _toy_plan(n_src=1), dist.HashStore()
    t_rows, g_rows = (6, rows) if side == "generator" else (rows, 6)
    want = rf"{side} rank {0 if side == 'trainer' else 9}: the weight-sync plan gives parameter " \
           rf"'w' a local shard of shape \(6, 4\), this rank's model has \({rows}, 4\).*same model"
    with pytest.raises(ValueError, match=want):
        IpcSender(Toy(t_rows), p, 0, torch.bfloat16, 5.0, store=store)
        IpcReceiver(Toy(g_rows, torch.bfloat16), p, 9, 5.0, store=store, direct=direct)


@pytest.mark.parametrize("side,rows", [("trainer", 8), ("generator", 8), ("generator", 4)])
def test_the_network_transport_checks_its_shards_too(side, rows):
    """The NCCL/gloo WeightSender and WeightReceiver slice by the same boxes: the same check."""
    from weights_sync.sync import WeightReceiver, WeightSender
    p = _toy_plan(n_src=1)
    with pytest.raises(ValueError, match=rf"{side} rank {0 if side == 'trainer' else 9}: .*'w' a "
                                         rf"local shard of shape \(6, 4\), this rank's model has "
                                         rf"\({rows}, 4\)"):
        if side == "trainer":
            WeightSender(Toy(rows), p, 0, torch.bfloat16, None, 5.0)
        else:
            WeightReceiver(Toy(rows, torch.bfloat16), p, 9, None, 5.0)
    WeightSender(Toy(6), p, 0, torch.bfloat16, None, 5.0)  # the plan's shapes: accepted
    WeightReceiver(Toy(6, torch.bfloat16), p, 9, None, 5.0)


def test_a_missing_parameter_is_named():
    class NoBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"parameter 'b' a local shard of shape \(5,\), this "
                                         r"rank's model has None"):
        IpcReceiver(NoBias(), _toy_plan(n_src=1), 9, 5.0, store=dist.HashStore())


# ----- a peer's SHUTDOWN on the link ends the waits on it --------------------------------------

class FakeLink:
    """What `link_watch` reads of trainer/link.py's Link: poll() and put_back()."""

    def __init__(self, rank):
        self.rank, self.queue = rank, []

    def poll(self):
        out, self.queue = self.queue, []
        return out

    def put_back(self, msgs):
        self.queue = list(msgs) + self.queue


def _shutdown(src, error="generator rank 9: RuntimeError: boom"):
    from trainer.link import Message, Msg
    return Message(Msg.SHUTDOWN, -1, src, {"error": error} if error else None)


def _no_staging_thread():
    import threading
    return not any(t.name.startswith("weights-ipc-") for t in threading.enumerate())


@pytest.mark.parametrize("buffers", [0, 1])
def test_sender_wait_ends_on_a_generator_shutdown(buffers):
    """The generator failed and said so on the link: the trainer's wait for its ack ends at once
    with PeerError carrying the cause and naming what was awaited. Before, it sat out
    timeout_s (+5 s of join grace) and raised a bare TimeoutError."""
    from trainer.link import Message, Msg, PeerError
    from weights_sync.ipc import watch_link
    _, _, sender, _ = _pair(buffers=buffers, timeout_s=3.0)
    link = FakeLink(0)
    watch_link(sender, link)
    sender.push(1)  # zero copy: waits for the ack of 1; one buffer: push(2) waits for it
    if buffers:
        sender.wait_sent()
        sender.push(2)
    link.queue = [Message(Msg.TRAJECTORIES, 0, 9, []), _shutdown(9)]
    slot = "the parameters it reads" if buffers == 0 else "CPU shared memory staging buffer 0"
    with pytest.raises(PeerError, match=rf"rank 9 shut down while rank 0 waited for generator rank "
                                        rf"9 to ack weights version 1 \({slot}\): generator rank 9: "
                                        rf"RuntimeError: boom"):
        sender.wait_sent()
    assert _no_staging_thread()  # abandoned: no store call of it outlives the error
    # nothing consumed: the trainer's loop still handles both, in order
    assert [m.type for m in link.queue] == [Msg.TRAJECTORIES, Msg.SHUTDOWN]


def test_a_staging_thread_that_fails_to_start_leaves_no_endless_watch(monkeypatch):
    """push() clears the 'staging done' flag before it starts the thread: a start that failed
    (no thread to set it again) left wait_sent's watch loop waiting for ever."""
    from weights_sync.ipc import watch_link
    _, _, sender, _ = _pair(buffers=1, timeout_s=1.0)
    watch_link(sender, FakeLink(0))

    def no_thread(*args):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(sender._inflight, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        sender.push(1)
    monkeypatch.undo()
    done = concurrent.futures.ThreadPoolExecutor(1).submit(sender._watch_inflight)
    assert done.result(timeout=5) is None  # returns at once


def test_sender_close_watches_too():
    from trainer.link import PeerError
    from weights_sync.ipc import watch_link
    _, _, sender, _ = _pair(buffers=2, timeout_s=3.0)
    sender.push(1)
    sender.wait_sent()  # two buffers: staged without an ack
    link = FakeLink(0)
    watch_link(sender, link)
    link.queue = [_shutdown(9)]
    with pytest.raises(PeerError, match=r"waited for generator rank 9 to ack weights version 1"):
        sender.close()


def test_a_quiet_link_changes_nothing():
    from weights_sync.ipc import watch_link
    trainer, gen, sender, recv = _pair(buffers=0, timeout_s=3.0)
    links = FakeLink(0), FakeLink(9)
    watch_link(sender, links[0])
    watch_link(recv, links[1])
    for v in (1, 2):
        _bump(trainer, v)
        sender.push(v)
        recv.receive(v)()
        sender.wait_sent()
        assert _same(trainer, gen)
    sender.close()


def test_watch_link_reaches_the_ipc_parts_of_a_composite():
    """make_sender/make_receiver return a Multi* where a rank has IPC and point-to-point peers:
    only the IPC parts wait on the store (gloo/NCCL waits fail once the peer's process ends)."""
    from weights_sync.ipc import watch_link
    _, _, sender, recv = _pair()
    watch_link(MultiSender([sender]), FakeLink(0))
    watch_link(MultiReceiver(None, recv), FakeLink(9))
    assert sender.watch is not None and recv.watch is not None


def test_receiver_wait_ends_on_a_trainer_failure_not_on_its_normal_end():
    """The trainer's normal end is a plain SHUTDOWN sent right after its last push, whose
    announcement may still be on its way: only a SHUTDOWN with an error ends receive()."""
    from trainer.link import PeerError
    from weights_sync.ipc import watch_link
    _, _, sender, recv = _pair(timeout_s=0.2)
    link = FakeLink(9)
    watch_link(recv, link)
    link.queue = [_shutdown(0, error=None)]
    with pytest.raises(TimeoutError, match="version 1 from trainer rank"):
        recv.receive(1)
    assert len(link.queue) == 1  # still there for the generator's loop
    link.queue = [_shutdown(0, error="trainer rank 0: RuntimeError: loss is NaN")]
    with pytest.raises(PeerError, match=r"rank 0 shut down while rank 9 waited for weights version 1 "
                                        r"from trainer rank\(s\) \[0\] \(CPU shared memory\): trainer rank 0: "
                                        r"RuntimeError: loss is NaN"):
        recv.receive(1)


def _shutdown_worker(rank, world):
    """Trainer rank 0 and generator rank 1 share "a GPU" (the CPU stand-in) and a real Link; the
    generator fails before it reads version 1."""
    from trainer.link import Link, PeerError
    from weights_sync.ipc import watch_link
    p = _toy_plan(n_src=1, dst_rank=1)
    link = Link(rank, [1 - rank], timeout_s=30)
    if rank == 1:
        IpcReceiver(Toy(6, torch.bfloat16), p, 1, 30)
        link.broadcast_shutdown("generator rank 1: RuntimeError: boom", announce=False)
        return {}
    sender = IpcSender(Toy(6), p, 0, torch.bfloat16, 30, buffers=0)
    watch_link(sender, link)
    sender.push(1)
    with pytest.raises(PeerError, match=r"rank 1 shut down while rank 0 waited for generator rank 1 "
                                        r"to ack weights version 1 \(the parameters it reads\): "
                                        r"generator rank 1: RuntimeError: boom"):
        sender.wait_sent()  # the timeout (30 s) would be a TimeoutError
    link.close()
    return {}


def test_a_generator_shutdown_on_a_real_link_ends_the_trainer_wait():
    run_ranks(_shutdown_worker, 2, timeout=60)


@pytest.mark.parametrize("buffers", [1, 0])
def test_two_sources_with_a_replicated_param(buffers):
    p = _toy_plan(n_src=2)
    store = dist.HashStore()
    full = Toy(6, seed=3)
    halves = [Toy(3), Toy(3)]
    with torch.no_grad():
        for r, h in enumerate(halves):
            h.w.copy_(full.w[3 * r:3 * r + 3])
            h.b.copy_(full.b)
    gen = Toy(6, torch.bfloat16, seed=4)
    senders = [IpcSender(h, p, r, torch.bfloat16, 5.0, buffers=buffers, store=store)
               for r, h in enumerate(halves)]
    recv = IpcReceiver(gen, p, 9, 5.0, store=store)
    for s in senders:
        s.push(1)
    recv.receive(1)()
    assert _same(full, gen)
    for s in senders:
        s.close()


def test_cpu_stand_in_shares_memory():
    m = CpuShmMemory(torch.device("cpu"))
    t = torch.zeros(8)
    u = m.open(m.export(t))
    t[3] = 5
    assert u[3] == 5 and u.numel() == 8
    base = torch.arange(24.0).view(4, 6)
    view = base[1:3, ::2]  # a strided view at an offset, as a parameter shard can be
    w = m.open(m.export(view))
    base[2, 4] = -1
    assert w.shape == view.shape and torch.equal(w, view) and w[1, 2] == -1


# ----- real gloo ranks: trainer fsdp=2 (ranks 0, 1) -> generator dp=2 (ranks 2, 3) ----------

GEN_DTYPE = torch.bfloat16


def _save_tiny(arch, path):
    # imported here, not at the top: tests.tiny imports transformers (~4 s), and every spawned
    # rank of this module's multi-process tests imports the module again
    from tests import tiny
    tiny.save_hf(arch, path)


def _local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _sync_worker(rank, world, folder, n_trainer, gpu_of, buffers, device="cpu", gen_tp=1,
                 gen_dtype=GEN_DTYPE):
    from torch.distributed.tensor import DTensor
    from tests.test_weights_sync import _setup
    model, p, wgroup, tgroup = _setup(rank, folder, n_trainer, gen_tp, device, gen_dtype)
    out = {}
    if rank < n_trainer:
        sender = make_sender(model, p, rank, gen_dtype, wgroup, 30, gpu_of, bucket_bytes=4096,
                             ipc_buffers=buffers)
        out["kind"] = torch.tensor([isinstance(sender, MultiSender), isinstance(sender, IpcSender)])
        if isinstance(sender, WeightSender):  # messages sent from the shard without a copy
            views = [v is not None for ms in sender.messages.values() for _, _, v in ms]
            out["zero_copy"] = torch.tensor([sum(views), len(views) - sum(views)])
    else:
        from parallel.layout import local_box
        recv = make_receiver(model, p, rank, wgroup, 30, gpu_of, bucket_bytes=4096)
        out["kind"] = torch.tensor([isinstance(recv, MultiReceiver), isinstance(recv, IpcReceiver)])
        for n, x in model.named_parameters():
            box = local_box(n, x)
            out[f"box.{n}"] = torch.tensor([box.offsets, box.sizes])
    for version in (1, 2, 3):
        if rank < n_trainer:
            opt = torch.optim.SGD(model.parameters(), lr=0.01 * version)
            for prm in model.parameters():
                prm.grad = torch.ones_like(prm)
            opt.step()
            sender.push(version)
            sender.wait_sent()
            full = {n: (x.full_tensor() if isinstance(x, DTensor) else x).detach().cpu().clone()
                    for n, x in model.named_parameters()}
            if rank == 0:
                out.update({f"v{version}.{n}": t for n, t in full.items()})
        else:
            before = {n: _local(x).clone() for n, x in model.named_parameters()}
            apply = recv.receive(version)
            assert all(torch.equal(before[n], _local(x)) for n, x in model.named_parameters())
            apply()
            out.update({f"v{version}.{n}": _local(x).cpu().clone() for n, x in model.named_parameters()})
        dist.barrier()
    if rank < n_trainer:
        sender.close()
    return out


def _check_versions(results, n_trainer, dtype=GEN_DTYPE):
    """Every generator rank's local shard equals its box of the trainer's full params."""
    for res in results[n_trainer:]:
        for key, local in res.items():
            if key.startswith("v"):
                offsets, sizes = res["box." + key.split(".", 1)[1]].tolist()
                full = results[0][key].to(dtype)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
                assert local.dtype == dtype and torch.equal(local, full), key


@pytest.mark.slow
def test_mixed_transports_on_gloo_ranks(tmp_path):
    """Ranks 0 and 2 share "GPU" 0, ranks 1 and 3 share "GPU" 1 (CPU stand-in for IPC): the
    pairs 0->2 and 1->3 go by shared memory, 0->3 and 1->2 by gloo, concurrently."""
    _save_tiny("qwen2", tmp_path)
    gpu_of = {0: ("h", 0), 1: ("h", 1), 2: ("h", 0), 3: ("h", 1)}
    results = run_ranks(_sync_worker, 4, str(tmp_path), 2, gpu_of, 1, timeout=240)
    assert all(r["kind"].tolist() == [True, False] for r in results)  # composite on every rank
    _check_versions(results, 2)


@pytest.mark.slow
@pytest.mark.parametrize("buffers", [1, 2, 0])
def test_all_ipc_pair_on_gloo_ranks(tmp_path, buffers):
    _save_tiny("llama3", tmp_path)
    gpu_of = {0: ("h", 0), 1: ("h", 0)}
    results = run_ranks(_sync_worker, 2, str(tmp_path), 1, gpu_of, buffers, timeout=240)
    assert all(r["kind"].tolist() == [False, True] for r in results)
    _check_versions(results, 1)


@pytest.mark.slow
def test_factory_without_placement_keeps_point_to_point(tmp_path):
    _save_tiny("llama3", tmp_path)
    results = run_ranks(_sync_worker, 3, str(tmp_path), 2, None, 1, timeout=240)
    assert all(r["kind"].tolist() == [False, False] for r in results)
    _check_versions(results, 2)


@pytest.mark.slow
def test_point_to_point_sends_contiguous_same_dtype_pieces_without_a_copy(tmp_path):
    """fp32 -> fp32, trainer fsdp=2 -> generator tp=2: FSDP row shards cut by the generator's
    column split (o_proj, down_proj) are not contiguous and go through a bucket; the rest is
    sent straight from the shard. Both kinds arrive bitwise."""
    _save_tiny("qwen2", tmp_path)
    results = run_ranks(_sync_worker, 4, str(tmp_path), 2, None, 1, "cpu", 2, torch.float32,
                        timeout=240)
    for r in results[:2]:
        direct, filled = r["zero_copy"].tolist()
        assert direct > 0 and filled > 0, (direct, filled)
    _check_versions(results, 2, torch.float32)


def test_factory_returns_plain_point_to_point_parts():
    p = _toy_plan(n_src=1)
    sender = make_sender(Toy(6), p, 0, torch.float32, None, 5.0, {0: ("h", -1), 9: ("h", -1)})
    recv = make_receiver(Toy(6), p, 9, None, 5.0, None)
    assert type(sender) is WeightSender and type(recv) is WeightReceiver


# ----- device waits: CudaIpcMemory's logic on CPU (a fake side stream and fake events) --------

class FakeEvent:
    """What `wait_done` reads of a torch.cuda.Event: query(), true from its `polls`-th call on
    (None: never, as on a wedged GPU)."""

    def __init__(self, polls=None):
        self.polls, self.queries = polls, 0

    def query(self):
        self.queries += 1
        return self.polls is not None and self.queries >= self.polls

    @property
    def done(self):
        return self.polls is not None and self.queries >= self.polls


class FakeStream:
    """CudaIpcMemory's side stream without CUDA (`torch.cuda.stream(it)` is then a no-op): it logs
    the calls, and its events complete after `polls` queries."""

    def __init__(self, polls=None, log=None):
        self.polls, self.log, self.events = polls, [] if log is None else log, []

    def wait_event(self, event):
        self.log.append(("wait_event", event))

    def record_event(self):
        self.events.append(FakeEvent(self.polls))
        self.log.append(("record_event",))
        return self.events[-1]

    def synchronize(self):  # what a wedged GPU does to it: no deadline, no message
        raise AssertionError("stream.synchronize() waited with no deadline")


def _fake_cuda_memory(polls=None):
    """CudaIpcMemory whose copies run on CPU behind a FakeStream."""
    from weights_sync.ipc import CudaIpcMemory
    m = CudaIpcMemory(torch.device("cuda", 0))
    m._stream = FakeStream(polls)
    return m


_MARKERS = itertools.count()


class FakeCudaSharing(CpuShmMemory):
    """The CPU stand-in's sharing (export/open) with CudaIpcMemory's ordering and waits: markers
    are tokens naming the thread that took them, every copy is logged where it runs."""

    def __init__(self, polls=None):
        super().__init__(torch.device("cpu"))
        self.log = []
        self.cuda = _fake_cuda_memory(polls)
        self.cuda._stream.log = self.log

    def marker(self):
        import threading
        return ("marker", next(_MARKERS), threading.current_thread().name)

    def run(self, fn, after, *args, **kwargs):
        def logged():
            self.log.append(("copy",))
            fn()
        self.cuda.run(logged, after, *args, **kwargs)
        assert self.cuda.stream.events[-1].done  # run() returned: the device said done
        self.log.append(("done",))


def _faked(sender=None, recv=None, polls=None):
    """Give each end a FakeCudaSharing; its log (one per end) is returned."""
    logs = []
    for end in (sender, recv):
        if end is not None:
            end.memory = FakeCudaSharing(polls)
            logs.append(end.memory.log)
    return logs


def test_wait_done_polls_until_the_event_completes():
    import time
    from weights_sync.ipc import wait_done
    ev = FakeEvent(polls=4)
    wait_done(ev, time.monotonic() + 5, "a copy")
    assert ev.queries == 4  # no query after the one that said done
    late = FakeEvent(polls=1)
    wait_done(late, time.monotonic() - 1, "a copy")  # done work passes even past the deadline


def test_wait_done_times_out_naming_what_it_waited_for():
    import time
    from weights_sync.ipc import wait_done
    ev = FakeEvent(polls=None)
    with pytest.raises(TimeoutError, match=r"trainer rank 0's copy of weights version 3 had not "
                                           r"finished on cuda:1 after [0-9.]+s .*Xid.*raise "
                                           r"--parallel.timeout_s"):
        wait_done(ev, time.monotonic() + 0.1, "trainer rank 0's copy of weights version 3",
                  "cuda:1")
    assert ev.queries > 1

    def abandoned():
        raise RuntimeError("abandoned")
    with pytest.raises(RuntimeError, match="abandoned"):  # a watch ends it early, as other waits
        wait_done(FakeEvent(None), time.monotonic() + 30, "a copy", watch=abandoned)


def test_cuda_run_orders_its_copies_and_waits_with_a_deadline():
    """CudaIpcMemory.run on CPU: the side stream waits for `after`, then runs the copies, then
    records the event that the host polls. It waited with stream.synchronize(), which has no
    deadline: a wedged GPU held the trainer (or generator) for ever without a word."""
    import time
    m = _fake_cuda_memory(polls=3)
    ran = []
    m.run(lambda: ran.append(m.stream.log[:]), "after", time.monotonic() + 5, "a copy")
    assert ran == [[("wait_event", "after")]]  # the copies run after the wait, on the stream
    assert m.stream.log[-1] == ("record_event",) and m.stream.events[0].done
    stuck = _fake_cuda_memory(polls=None)
    with pytest.raises(TimeoutError, match=r"^a copy had not finished on cuda:0 after"):
        stuck.run(lambda: None, "after", time.monotonic() + 0.1, "a copy")


@pytest.mark.parametrize("buffers", [1, 0])
def test_a_wedged_gpu_under_the_sender_times_out_naming_the_copy(buffers):
    """The trainer's fill (zero copy: the update before the announcement) never finishes on the
    device: wait_sent() raises in timeout_s naming the copy, and nothing is announced."""
    _, _, sender, recv = _pair(buffers=buffers, timeout_s=0.3)
    _faked(sender, polls=None)
    sender.push(1)
    what = (r"trainer rank 0's update to weights version 1 \(the parameters generator rank 9 "
            r"reads\)" if buffers == 0 else
            r"trainer rank 0's copy of weights version 1 into CPU shared memory staging buffer 0 for "
            r"generator rank 9")
    with pytest.raises(TimeoutError, match=what + r" had not finished on cuda:0 after"):
        sender.wait_sent()
    assert not recv.ready(1)


@pytest.mark.parametrize("direct", [False, True])
def test_a_wedged_gpu_under_the_receiver_times_out_naming_the_copy(direct):
    """The generator's copy out of the trainer's slot (direct: its apply) never finishes:
    receive() (direct: apply()) raises naming it, and the slot is not released."""
    _, _, sender, recv = _pair(buffers=1, timeout_s=0.3, direct=direct)
    sender.push(1)
    sender.wait_sent()
    _faked(recv=recv, polls=None)
    what = (r"generator rank 9's apply of weights version 1 from trainer rank\(s\) \[0\] "
            r"\(CPU shared memory, direct\)" if direct else
            r"generator rank 9's copy of weights version 1 out of trainer rank 0's CPU shared memory slot 0")
    with pytest.raises(TimeoutError, match=what + " had not finished on cuda:0 after"):
        recv.receive(1)()
    assert recv.control.acked(0, 9, 0) is None


def test_a_shutdown_ends_a_staging_thread_stuck_on_the_device():
    """The generator failed while the trainer's fill sat behind a wedged GPU: wait_sent() ends
    with the generator's cause, and the staging thread stops at its next poll of the device
    (in stream.synchronize() it outlived the error, for ever)."""
    from trainer.link import PeerError
    from weights_sync.ipc import watch_link
    _, _, sender, _ = _pair(buffers=1, timeout_s=30.0)
    _faked(sender, polls=None)
    link = FakeLink(0)
    watch_link(sender, link)
    sender.push(1)
    link.queue = [_shutdown(9)]
    with pytest.raises(PeerError, match="generator rank 9: RuntimeError: boom"):
        sender.wait_sent()
    assert _no_staging_thread()


@pytest.mark.parametrize("buffers,direct", [(1, False), (2, False), (1, True), (0, False),
                                            (0, True)])
def test_no_message_before_the_device_says_its_copy_is_done(buffers, direct):
    """The CUDA ordering, with device work that completes only after a few polls: every
    announcement (ready) and release (ack) comes after the event behind its copies reported
    done, and every copy waits on its stream for the marker its caller took first: push()'s on
    the trainer's thread (the optimizer step), receive()'s (an earlier apply still reading the
    staging), apply()'s (the engine's queued steps)."""
    trainer, gen, sender, recv = _pair(buffers=buffers, direct=direct)
    logs = _faked(sender, recv, polls=3)
    for end, name in ((sender, "publish_ready"), (recv, "ack")):
        def told(*args, _real=getattr(end.control, name), _log=end.memory.log, _name=name):
            _log.append((_name,) + args)
            _real(*args)
        setattr(end.control, name, told)
    for v in (1, 2, 3):
        _bump(trainer, v)
        sender.push(v)
        recv.receive(v)()
        sender.wait_sent()
        assert _same(trainer, gen), v
    sender.close()
    for log, name in zip(logs, ("publish_ready", "ack")):
        # each version: its copies, the device's "done", then (and only then) the message
        steps = [e[0] for e in log if e[0] in ("copy", "done", name)]
        assert steps == ["copy", "done", name] * 3, log
        copies = [i for i, e in enumerate(log) if e == ("copy",)]
        assert all(log[i - 1][0] == "wait_event" for i in copies), log
        markers = [log[i - 1][1] for i in copies]
        # each taken afresh, on the caller's thread (not the staging thread's)
        assert len(set(markers)) == len(markers) == 3, log
        assert all(m[0] == "marker" and not m[2].startswith("weights-ipc-") for m in markers)


def test_the_shared_memory_follows_the_device_and_both_ends_must_agree():
    """The CUDA choices, made from a device object (no GPU needed): CUDA IPC and one copy per
    parameter on CUDA, the shared-memory file and the multi-tensor copy on CPU. A trainer
    sharing by CUDA IPC with a CPU generator is refused naming both kinds and the fix."""
    from weights_sync.ipc import CudaIpcMemory, _foreach_default, shared_memory_for
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert type(shared_memory_for(cuda)) is CudaIpcMemory and shared_memory_for(cuda).device == cuda
    assert type(shared_memory_for(cpu)) is CpuShmMemory
    assert _foreach_default(cuda) is False and _foreach_default(cpu) is True
    _, _, sender, recv = _pair()
    info = sender.control.handles(0, 9)
    sender.control.publish_handles(0, 9, {**info, "kind": CudaIpcMemory.kind})
    with pytest.raises(ValueError, match=r"generator rank 9: trainer rank 0 shares memory of kind "
                                         r"'cuda_ipc', this rank uses 'cpu_shm' \(it runs on cpu\)"
                                         r".*same kind of device"):
        recv.receive(1)


@CUDA
def test_cuda_run_times_out_on_a_busy_device_then_completes():
    """The real event behind wait_done: a kernel that outlasts the deadline is a TimeoutError
    naming the work; the stream then drains, and a later run() waits for its copies."""
    import time
    from weights_sync.ipc import CudaIpcMemory
    m = CudaIpcMemory(torch.device("cuda", 0))
    with pytest.raises(TimeoutError, match=r"a long kernel had not finished on cuda:0"):
        m.run(lambda: torch.cuda._sleep(2_000_000_000), m.marker(), time.monotonic() + 0.05,
              "a long kernel")  # about a second on a 2 GHz clock
    m.stream.synchronize()
    src = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    m.run(lambda: dst.copy_(src), m.marker(), time.monotonic() + 30, "a copy")
    assert torch.equal(src, dst)


# ----- the real CUDA path (skipped without a GPU) --------------------------------------------

@CUDA
def test_cuda_ipc_handle_round_trip_in_process():
    from weights_sync.ipc import CudaIpcMemory
    m = CudaIpcMemory(torch.device("cuda", 0))
    h = m.export(torch.arange(16, dtype=torch.bfloat16, device="cuda"))
    assert "args" in h  # opening needs another process: CUDA refuses a process's own handle


@CUDA
@pytest.mark.slow
@pytest.mark.parametrize("buffers", [2, 0])
def test_cuda_ipc_two_processes_one_gpu(tmp_path, buffers):
    _save_tiny("llama3", tmp_path)
    gpu_of = {0: ("h", 0), 1: ("h", 0)}
    results = run_ranks(_sync_worker, 2, str(tmp_path), 1, gpu_of, buffers, "cuda:0", timeout=240)
    assert all(r["kind"].tolist() == [False, True] for r in results)
    _check_versions(results, 1)


# ----- bench/weights_sync.py: the CPU code paths of every mode bench/gpu_check.sh runs --------

def _bench(*args, check: bool = True) -> dict:
    import json
    import sys
    from tests.dist import run_captured
    proc = run_captured([sys.executable, "bench/weights_sync.py", *args], 300)
    assert proc.returncode == (0 if check else 1), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_gloo_and_ipc_modes_on_cpu():
    gloo = _bench("--shape", "tiny", "--versions", "1", "--dtypes", "float32,bfloat16")
    assert gloo["bench"] == "weights_sync" and all(r["exact"] for r in gloo["results"].values())
    ipc = _bench("--ipc", "--device", "cpu", "--shape", "tiny", "--versions", "2")
    assert ipc["exact"] and set(ipc["results"]) == {"staged_b1", "direct_b1", "staged_b2",
                                                   "staged_b0", "direct_b0", "direct_b1_loop",
                                                   "direct_b0_loop"}


@pytest.mark.slow
def test_bench_rl_mode_on_cpu():
    out = _bench("--rl", "--rl-shape", "tiny", "--rl-gen-dtype", "float32",
                 "--rl-steps", "4", "--rl-warmup", "1", "--rl-prompts", "2", "--rl-samples", "2",
                 "--rl-new-tokens", "4", "--rl-timeout", "200")
    assert out["ok"] and out["results"]["sync"]["tokens_per_s"] > 0
    assert (out["shape"], out["hidden"], out["layers"], out["decode"]) == ("tiny", 64, 2, "auto")


def test_bench_rl_mode_passes_its_decode_step_to_the_runs():
    """--rl-decode reaches train_rl.py: the CUDA graph, asked for on CPU, is refused by its
    preflight in both runs (gpu_check.sh d2 runs the compiled step this way on a GPU)."""
    out = _bench("--rl", "--rl-shape", "tiny", "--rl-gen-dtype", "float32", "--rl-steps", "2",
                 "--rl-prompts", "2", "--rl-samples", "2", "--rl-new-tokens", "4",
                 "--rl-timeout", "200", "--rl-decode", "cudagraph", check=False)
    assert not out["ok"] and out["decode"] == "cudagraph"
    for r in out["results"].values():
        assert "generator.decode='cudagraph' needs a CUDA device" in r["error"]


def test_unreachable_cpu_shared_memory_names_the_fix():
    """A generator that cannot open the trainer's shared-memory file (ranks on one host that do
    not share /dev/shm) is told which switch sends the weights over gloo instead."""
    from weights_sync.ipc import CpuShmMemory
    mem = CpuShmMemory(torch.device("cpu"))
    shared = torch.zeros(4)
    handle = mem.export(shared)
    assert mem.open(handle).tolist() == [0.0] * 4  # the real handle opens
    handle["name"] = _encode(b"/torch_tandem_no_such_segment")
    with pytest.raises(RuntimeError, match=r"--parallel.cpu_shm=false"):
        mem.open(handle)
