"""Weight sync on real gloo ranks: bitwise-exact shards after push for every layout pair the config
admits, two versions in a row and a resume, the same plan on every rank, atomic swap, models of
different shapes refused at planning, and timeouts that name the peer and the version."""
import hashlib
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests import tiny
from tests.dist import run_ranks

GEN_DTYPE = torch.bfloat16


def _setup(rank, folder, n_trainer, gen_tp=1, device="cpu", gen_dtype=GEN_DTYPE, trainer_tp=1):
    """Trainer ranks [0, n_trainer) with fsdp x tp, generator ranks after them with dp x tp; returns
    this rank's model, the weight-sync plan, the weights group and the trainer group."""
    from torch.distributed.device_mesh import DeviceMesh
    from model.hf_io import load_model_args
    from parallel.sharding import build_model, parallelize_generator, parallelize_trainer
    from weights_sync.sync import plan_between_meshes

    world = dist.get_world_size()
    gen = list(range(n_trainer, world))
    tmesh = DeviceMesh("cpu", torch.arange(n_trainer).view(-1, trainer_tp), mesh_dim_names=("fsdp", "tp"))
    gmesh = DeviceMesh("cpu", torch.tensor(gen).view(-1, gen_tp), mesh_dim_names=("dp", "tp"))
    tgroup, ggroup = dist.new_group(list(range(n_trainer))), dist.new_group(gen)
    wgroup = dist.new_group(backend="gloo")
    args, dev = load_model_args(folder), torch.device(device)
    if rank < n_trainer:
        model = build_model(args, dev, torch.float32, path=folder,
                            parallelize=lambda m: parallelize_trainer(m, tmesh))
    else:
        model = build_model(args, dev, gen_dtype, seed=rank,
                            parallelize=lambda m: parallelize_generator(m, gmesh))
    group = tgroup if rank < n_trainer else ggroup
    return model, plan_between_meshes(model, group, rank == 0, rank == n_trainer), wgroup, tgroup


def _full_params(model, group):
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _loc(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


# Every layout pair the config admits on 5 ranks (parallel.dims: tp divides the head counts and
# the MLP, tied embeddings only without TP): (trainer fsdp, trainer tp, generator tp, generator
# dp, family, generator dtype). The tiny models' vocabulary (97) divides by no TP degree; their
# GQA k/v heads (2) are split by TP 2.
LAYOUTS = [
    (2, 1, 1, 1, "qwen2", "bfloat16"),  # FSDP -> one generator rank (q/k/v biases)
    (2, 1, 2, 1, "qwen2", "bfloat16"),  # FSDP rows -> TP columns (o_proj, down_proj)
    (3, 1, 1, 1, "qwen2", "bfloat16"),  # uneven FSDP shards
    (2, 1, 1, 2, "qwen2", "bfloat16"),  # two generator replicas
    (1, 2, 2, 1, "qwen3", "bfloat16"),  # trainer TP: q/k norms are Replicate DTensors there
    (2, 1, 1, 1, "tied", "bfloat16"),   # the head moves once, as the embedding (transfer_specs)
    (2, 2, 1, 1, "qwen2", "bfloat16"),  # FSDP x TP: strided shards of an uneven TP split
    (2, 2, 1, 1, "qwen3", "bfloat16"),
    (1, 1, 2, 2, "qwen2", "bfloat16"),  # generator TP x DP
    (1, 2, 1, 3, "qwen2", "bfloat16"),  # trainer TP -> three replicas
    (3, 1, 2, 1, "qwen2", "float32"),   # no cast: pieces go straight from the shard
    (2, 1, 1, 3, "tied", "bfloat16"),
]


RESUMED = 7  # the version a resumed run pushes first: any number, not v + 1


def _resume(rank, c, model, plan, n_trainer, gen, tgroup, wgroup, gen_dtype, root):
    """A restart's sender and receiver: the trainer saves its shards (version 2), moves on (its
    shards change), builds a new sender, then loads the checkpoint in place; the generator
    starts from zeros. Returns (sender, receiver), None where this rank is not that side."""
    from parallel.checkpoint import load_sharded, save_sharded
    from weights_sync.sync import WeightReceiver, WeightSender
    sender = recv = None
    if rank < n_trainer:
        path = Path(root) / f"layout{c}"
        save_sharded(path, model, group=tgroup)
        with torch.no_grad():
            for prm in model.parameters():
                _loc(prm).mul_(-3.0)  # lost progress: the restarted model differs from the save
        sender = WeightSender(model, plan, rank, gen_dtype, wgroup, timeout_s=30,
                              bucket_bytes=4096)
        load_sharded(path, model, group=tgroup)
    elif rank in gen:
        with torch.no_grad():
            for prm in model.parameters():
                _loc(prm).zero_()
        recv = WeightReceiver(model, plan, rank, wgroup, timeout_s=30, bucket_bytes=4096)
    return sender, recv


def _plan_facts(c, rank, plan, is_generator) -> dict:
    """What the parent checks of this rank's plan: its digest (every rank of both meshes must
    derive the same one, or they wait on transfers the others never planned), and on a
    generator rank, the elements it receives against the elements of its boxes (each once)."""
    digest = hashlib.sha1(repr(list(plan.steps.items())).encode()).digest()
    out = {f"{c}.plan": torch.tensor(list(digest))}
    if is_generator:
        received = sum(t.global_box.numel for ts in plan.recvs_to(rank).values() for t in ts)
        held = sum(plan.dst.boxes[rank][s.name].numel for s in plan.specs)
        out[f"{c}.numel"] = torch.tensor([received, held])
    return out


def _layout_worker(rank, world, folders, layouts):
    """Each layout pair in turn on ranks [0, fsdp * tp) (trainer) and the next gen_tp * gen_dp
    (generator); the other ranks idle but take part in every group's creation and in the layout
    exchange (world collectives). One sender and receiver per pair follow two versions of
    in-place updates; then, as after a restart, a fresh sender is built before the checkpoint
    of version 2 is loaded into the trainer's shards (trainer.role.start_trainer's order), and a
    fresh receiver on re-initialised generator weights receives it as version RESUMED."""
    from torch.distributed.device_mesh import DeviceMesh
    from model.hf_io import load_model_args
    from parallel.layout import local_box
    from parallel.sharding import build_model, parallelize_generator, parallelize_trainer
    from weights_sync.sync import (WeightReceiver, WeightSender, exchange_layouts,
                                   plan_between_meshes)
    wgroup, out = dist.new_group(backend="gloo"), {}
    for c, (fsdp, tp, gen_tp, gen_dp, family, dtype) in enumerate(layouts):
        n_trainer, gen_dtype = fsdp * tp, getattr(torch, dtype)
        gen = list(range(n_trainer, n_trainer + gen_tp * gen_dp))
        tmesh = DeviceMesh("cpu", torch.arange(n_trainer).view(fsdp, tp),
                           mesh_dim_names=("fsdp", "tp"))
        gmesh = DeviceMesh("cpu", torch.tensor(gen).view(gen_dp, gen_tp),
                           mesh_dim_names=("dp", "tp"))
        tgroup, ggroup = dist.new_group(list(range(n_trainer))), dist.new_group(gen)
        args, cpu = load_model_args(folders[family]), torch.device("cpu")
        if rank < n_trainer:
            model = build_model(args, cpu, torch.float32, path=folders[family],
                                parallelize=lambda m: parallelize_trainer(m, tmesh))
            p = plan_between_meshes(model, tgroup, rank == 0, False)
            sender = WeightSender(model, p, rank, gen_dtype, wgroup, timeout_s=30,
                                  bucket_bytes=4096)
        elif rank in gen:
            model = build_model(args, cpu, gen_dtype, seed=rank,
                                parallelize=lambda m: parallelize_generator(m, gmesh))
            p = plan_between_meshes(model, ggroup, False, rank == n_trainer)
            recv = WeightReceiver(model, p, rank, wgroup, timeout_s=30, bucket_bytes=4096)
            if args.tie_word_embeddings:
                head, embed = model.lm_head.weight, model.model.embed_tokens.weight
                out[f"{c}.tied"] = torch.tensor(head is embed)
        else:
            exchange_layouts(None, False, False)
        if rank < n_trainer or rank in gen:
            out.update(_plan_facts(c, rank, p, rank in gen))
        for version in (1, 2, RESUMED):
            if version == RESUMED and (rank < n_trainer or rank in gen):
                # a restart's plan is the same: the layouts did not change
                sender, recv = _resume(rank, c, model, p, n_trainer, gen, tgroup, wgroup,
                                       gen_dtype, folders["checkpoints"])
            if rank < n_trainer and version != RESUMED:
                opt = torch.optim.SGD(model.parameters(), lr=0.01 * version)
                for prm in model.parameters():  # a new version: an optimizer changes every shard
                    prm.grad = torch.ones_like(prm)
                opt.step()
            if rank < n_trainer:
                full = _full_params(model, tgroup)
                sender.push(version)
                sender.wait_sent()
                if rank == 0:
                    out.update({f"{c}.v{version}.{n}": t for n, t in full.items()})
            elif rank in gen:
                before = {n: _loc(prm).clone() for n, prm in model.named_parameters()}
                apply = recv.receive(version)
                # received but not applied: the model still holds the old version (no torn state)
                assert all(torch.equal(before[n], _loc(prm)) for n, prm in model.named_parameters())
                apply()
                for n, prm in model.named_parameters():
                    box = local_box(n, prm)
                    out[f"{c}.v{version}.{n}"] = _loc(prm).clone()
                    out[f"{c}.box.{n}"] = torch.tensor([box.offsets, box.sizes])
            dist.barrier()
    return out


@pytest.mark.slow
def test_generator_shards_bitwise_equal_trainer_slices(tmp_path):
    """Every layout pair of LAYOUTS, in one spawn of 5 ranks (a spawn costs more than a sync):
    after each of two versions and after a resume, every generator rank's shard is bitwise its
    box of the trainer's gathered full parameters, cast to the generator dtype."""
    folders = {"checkpoints": str(tmp_path / "checkpoints")}
    for family in sorted({lay[4] for lay in LAYOUTS}):
        folders[family] = str(tmp_path / family)
        tiny.save_hf(family, folders[family])
    results = run_ranks(_layout_worker, 5, folders, LAYOUTS, timeout=300)
    for c, (fsdp, tp, gen_tp, gen_dp, family, dtype) in enumerate(LAYOUTS):
        n_trainer, gen_dtype = fsdp * tp, getattr(torch, dtype)
        names = {k.split(".", 2)[2] for k in results[0] if k.startswith(f"{c}.v1.")}
        assert names, LAYOUTS[c]
        members = results[:n_trainer + gen_tp * gen_dp]
        digest = results[0][f"{c}.plan"]
        assert all(torch.equal(r[f"{c}.plan"], digest) for r in members), LAYOUTS[c]
        for res in results[n_trainer:n_trainer + gen_tp * gen_dp]:
            assert bool(res.get(f"{c}.tied", True)), LAYOUTS[c]  # the head is still the embedding
            received, held = res[f"{c}.numel"].tolist()
            assert received == held, (LAYOUTS[c], received, held)  # every element once
            for version in (1, 2, RESUMED):
                got = {k.split(".", 2)[2] for k in res if k.startswith(f"{c}.v{version}.")}
                assert got == names, (LAYOUTS[c], got ^ names)
                for name in names:
                    local = res[f"{c}.v{version}.{name}"]
                    offsets, sizes = res[f"{c}.box.{name}"].tolist()
                    full = results[0][f"{c}.v{version}.{name}"]
                    box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                    want = full[box].to(gen_dtype)
                    assert local.dtype == gen_dtype and torch.equal(local, want), \
                        (LAYOUTS[c], version, name)


def _stale_apply_worker(rank, world, folder):
    from weights_sync.sync import WeightReceiver, WeightSender
    model, p, wgroup, _ = _setup(rank, folder, 1)
    if rank == 0:
        sender = WeightSender(model, p, rank, GEN_DTYPE, wgroup, timeout_s=30)
        for version in (1, 2):
            with torch.no_grad():
                for prm in model.parameters():
                    prm.add_(version)
            sender.push(version)
            sender.wait_sent()
        return None
    recv = WeightReceiver(model, p, rank, wgroup, timeout_s=30)
    stale = recv.receive(1)
    ticket = recv.post(2)  # the staging is being overwritten from here on
    try:
        stale()
        return "applied while v2 was arriving"
    except RuntimeError as e:
        during = str(e)
    current = recv.finish(ticket)
    try:
        stale()
    except RuntimeError as e:
        current()
        return during + " | " + str(e)
    return "applied"


def test_an_apply_kept_past_a_later_receive_is_refused(tmp_path):
    """receive(v)'s apply() copies what the staging holds when it runs: kept past receive(v+1),
    it installed v+1's weights under version v's number (the engine tags tokens with it)."""
    tiny.save_hf("llama3", tmp_path)
    msg = run_ranks(_stale_apply_worker, 2, str(tmp_path), timeout=120)[1]
    during, after = msg.split(" | ")
    assert ("apply() of weights version 1 after a later receive() began refilling the staging "
            "(not completed)") in during  # v2 is on its way
    assert "apply() of weights version 1 after receive() of version 2" in after


def _timeout_worker(rank, world, folder, silent_side):
    """`silent_side` never posts its half; the other side must time out naming it."""
    from weights_sync.sync import WeightReceiver, WeightSender
    model, p, wgroup, _ = _setup(rank, folder, 2, 1)
    if rank == 2 and silent_side == "trainer":
        recv = WeightReceiver(model, p, rank, wgroup, timeout_s=2)
        with pytest.raises(TimeoutError, match=r"weights version 7 from trainer rank [01]"):
            recv.receive(7)
    elif rank < 2 and silent_side == "generator":
        sender = WeightSender(model, p, rank, GEN_DTYPE, wgroup, timeout_s=2)
        sender.push(9)
        with pytest.raises(TimeoutError, match=r"generator rank 2.*version 9|version 9.*generator ranks \[2\]"):
            sender.wait_sent()
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("silent_side", ["trainer", "generator"])
def test_missing_peer_times_out_naming_peer_and_version(tmp_path, silent_side):
    tiny.save_hf("llama3", tmp_path)
    run_ranks(_timeout_worker, 3, str(tmp_path), silent_side, timeout=120)


def _replicated(specs, ranks):
    from parallel.layout import Layout
    return Layout.from_placements(specs, ranks, (len(ranks),), ("dp",),
                                  {s.name: [("replicate",)] for s in specs}, replica_axis="dp")


def _specs(named):
    from parallel.layout import ParamSpec
    return [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]


def test_transfer_specs_refuses_generator_params_the_trainer_lacks():
    from weights_sync.sync import transfer_specs
    trainer = _specs([("embed.weight", torch.empty(8, 4)), ("value_head.weight", torch.empty(1, 4))])
    generator = _specs([("embed.weight", torch.empty(8, 4, dtype=GEN_DTYPE)),
                        ("lm_head.weight", torch.empty(8, 4, dtype=GEN_DTYPE)),
                        ("norm.weight", torch.empty(4, dtype=GEN_DTYPE))])
    with pytest.raises(ValueError, match=r"\['lm_head.weight', 'norm.weight'\]"):
        transfer_specs(_replicated(trainer, [0]), _replicated(generator, [1]))
    # trainer-only params stay behind
    got = transfer_specs(_replicated(trainer, [0]), _replicated(generator[:1], [1]))
    assert [s.name for s in got] == ["embed.weight"]


def test_transfer_specs_of_a_tied_model_move_the_shared_weight_once(tmp_path):
    """Both sides enumerate parameters alike: a tied head is the embedding, listed once."""
    from model.hf_io import load_model_args
    from model.transformer import Transformer
    from weights_sync.sync import transfer_specs
    tiny.save_hf("tied", tmp_path)
    args = load_model_args(str(tmp_path))
    assert args.tie_word_embeddings
    model = Transformer(args)
    trainer = _specs(model.named_parameters())
    generator = _specs((n, t.to(GEN_DTYPE)) for n, t in model.named_parameters())
    got = [s.name for s in transfer_specs(_replicated(trainer, [0]), _replicated(generator, [1]))]
    assert got == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in got and got.count("model.embed_tokens.weight") == 1


def test_models_of_different_shapes_are_refused_by_name_before_any_transfer():
    """The planning step every rank runs at start-up (plan_between_meshes: transfer_specs, then
    plan) refuses a generator built from another model, naming the parameter, both meshes'
    shapes and the fix, before a sender or receiver exists: nothing is sent, nobody waits."""
    from weights_sync.plan import plan
    from weights_sync.sync import transfer_specs
    trainer = _specs([("embed.weight", torch.empty(97, 8)), ("norm.weight", torch.empty(8))])
    generator = _specs([("embed.weight", torch.empty(100, 8, dtype=GEN_DTYPE)),
                        ("norm.weight", torch.empty(8, dtype=GEN_DTYPE))])
    src, dst = _replicated(trainer, [0]), _replicated(generator, [1, 2])
    with pytest.raises(ValueError) as e:
        plan(src, dst, transfer_specs(src, dst))
    msg = str(e.value)
    assert "'embed.weight'" in msg and "(97, 8)" in msg and "(100, 8)" in msg, msg
    assert re.search(r"\(97, 8\) on the trainer.*\(100, 8\) on the generator", msg), msg
    assert "same model" in msg, msg  # the fix


class _CountCopies(TorchDispatchMode):
    """Elements written by every op run under it: fresh outputs and in-place copies."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ret = func._schema.returns
        if func is torch.ops.aten.copy_.default:
            self.numel += args[0].numel()
        elif ret and ret[0].alias_info is None and isinstance(out, torch.Tensor):
            self.numel += out.numel()  # not a view: allocated and written
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fill_sends_exactly_the_box_slices_copying_each_element_once(dtype):
    """Every bucket size (ranges cutting rows, packing several boxes): the buckets concatenate to
    the boxes' row-major slices, and filling copies each element once (flattening a whole
    non-contiguous box per bucket was quadratic)."""
    from parallel.layout import Box
    from weights_sync.stream import Segment, buckets, fill, messages, stream_numel
    gen = torch.Generator().manual_seed(0)
    tensors = {"col": torch.randn(6, 10, generator=gen), "cube": torch.randn(3, 4, 5, generator=gen),
               "vec": torch.randn(12, generator=gen), "rows": torch.randn(6, 10, generator=gen)}
    boxes = [("col", Box((1, 2), (4, 5))), ("cube", Box((0, 1, 1), (3, 2, 3))),
             ("vec", Box((2,), (7,))), ("rows", Box((2, 0), (3, 10))), ("col", Box((0, 7), (6, 1)))]
    segs, start = [], 0
    for name, box in boxes:
        segs.append(Segment(name, box, start, box.numel))
        start += box.numel
    total = stream_numel(segs)
    want = torch.cat([tensors[n][b.slices()].reshape(-1) for n, b in boxes]).to(dtype)
    for bucket_numel in range(1, total + 1):
        for ranges in (buckets(total, bucket_numel), messages(segs, bucket_numel, 4)):
            bucket, sent = torch.empty(bucket_numel, dtype=dtype), []
            with _CountCopies() as copies:
                for lo, hi in ranges:
                    fill(bucket, lo, hi, segs, tensors)
                    sent.append(bucket[:hi - lo].clone())
            assert torch.equal(torch.cat(sent), want), bucket_numel
            assert copies.numel == 2 * total, (bucket_numel, copies.numel)  # fill + the clone


def _two_peer_plan(trainer, generator):
    """A 4x4 fp32 param from trainer ranks `trainer` (rows sharded) to generator ranks
    `generator` (each a replica holding it whole): every trainer rank sends to every generator."""
    from parallel.layout import Layout, ParamSpec
    from weights_sync.plan import plan
    specs = [ParamSpec("w", (4, 4), "float32")]
    src = Layout.from_placements(specs, trainer, (len(trainer),), ("fsdp",), {"w": [("shard", 0)]})
    dst = Layout.from_placements(specs, generator, (len(generator), 1), ("dp", "tp"),
                                 {"w": [("replicate",), ("replicate",)]}, replica_axis="dp")
    return plan(src, dst, specs)


def _holder(rank, p):
    """A module holding this rank's shard of the plan's one param."""
    box = p.src.boxes.get(rank, p.dst.boxes.get(rank))["w"]
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.randn(box.sizes))
    return m


def _deadline_worker(rank, world, timeout_s, slow_s, grace_s):
    """Each side's peers are served in plan order: the first one posts its half `slow_s` late
    (alive, within timeout_s), the second never does. The version's waits share one deadline,
    so the error comes after timeout_s (not slow_s + timeout_s) and names the silent peer."""
    import time
    from weights_sync.sync import VersionThread, WeightReceiver, WeightSender
    VersionThread.JOIN_GRACE_S = grace_s  # < slow_s: a budget per peer would lose to join
    out = {}
    # 1. sender rank 0 -> generator ranks 1 (slow) and 2 (silent)
    p, group = _two_peer_plan([0], [1, 2]), dist.new_group(backend="gloo")
    slow, silent = list(p.sends_from(0))
    if rank == 0:
        sender = WeightSender(_holder(0, p), p, 0, torch.float32, group, timeout_s=timeout_s)
        sender.push(3)
        with pytest.raises(TimeoutError, match=rf"generator rank {silent} to receive version 3") as e:
            sender.wait_sent()
        assert f"rank {slow}" not in str(e.value), str(e.value)  # it received in time
    elif rank == slow:
        recv = WeightReceiver(_holder(rank, p), p, rank, group, timeout_s=timeout_s)
        time.sleep(slow_s)  # a slow generator (busy decoding), not synchronisation
        recv.receive(3)()
    dist.barrier()
    # 2. generator rank 2 <- trainer ranks 0 (slow) and 1 (silent)
    p, group = _two_peer_plan([0, 1], [2]), dist.new_group(backend="gloo")
    slow, silent = list(p.recvs_to(2))
    if rank == 2:
        recv = WeightReceiver(_holder(2, p), p, 2, group, timeout_s=timeout_s)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"weights version 4 from trainer rank {silent}"):
            recv.receive(4)
        out["recv_s"] = time.monotonic() - t0
    elif rank == slow:
        sender = WeightSender(_holder(rank, p), p, rank, torch.float32, group, timeout_s=timeout_s)
        time.sleep(slow_s)
        sender.push(4)
        sender.wait_sent()
    dist.barrier()
    return out


def _wire_worker(rank, world, send_dtype, send_bucket_bytes):
    """Trainer rank 0 (fp32 shard) -> generator rank 1 (bf16), the sender told `send_dtype` and
    `send_bucket_bytes` (the receiver keeps the default bucket)."""
    from weights_sync.sync import WeightReceiver, WeightSender
    p, group = _two_peer_plan([0], [1]), dist.new_group(backend="gloo")
    if rank == 0:
        sender = WeightSender(_holder(0, p), p, 0, getattr(torch, send_dtype), group, timeout_s=3,
                              bucket_bytes=send_bucket_bytes)
        sender.push(1)
        with pytest.raises(TimeoutError, match="generator rank 1 to receive version 1"):
            sender.wait_sent()  # the generator refused the stream: its bytes are never taken
        return {}
    model = _holder(1, p).to(GEN_DTYPE)
    before = model.w.detach().clone()
    recv = WeightReceiver(model, p, 1, group, timeout_s=30)
    with pytest.raises(ValueError) as e:
        recv.receive(1)
    assert torch.equal(model.w.detach(), before)  # nothing applied, nothing half-written
    return {"error": str(e.value)}


@pytest.mark.parametrize("send_dtype,send_bucket_bytes,want", [
    # bf16 bits read as fp16 (same size): the old code applied garbage without a word
    ("float16", 64 << 20, r"trainer rank 0 sends weights as float16, this rank's parameters are "
                          r"bfloat16; the trainer must cast to the generator dtype"),
    # fp32 bytes into bf16 buffers: the old code's generator died in gloo (SIGABRT)
    ("float32", 64 << 20, r"sends weights as float32, this rank's parameters are bfloat16"),
    # smaller buckets than the receiver's: the old code's generator took the first 4-element
    # message as its whole 16-element buffer and applied it, 12 elements stale, without a word
    ("bfloat16", 8, r"cuts its stream every 4 elements, this rank every 33554432; give "
                    r"make_sender and make_receiver the same bucket_bytes")],
    ids=["fp16-as-bf16", "fp32-as-bf16", "bucket"])
def test_a_sender_of_another_wire_format_is_refused_by_name(send_dtype, send_bucket_bytes, want):
    """The pair's header carries the sender's wire dtype, stream length and bucket size; the
    generator checks the first version's before it posts a buffer, later ones before an apply
    (the format is fixed at construction; the IPC transport refuses a dtype mismatch
    too: tests/test_ipc.py)."""
    error = run_ranks(_wire_worker, 2, send_dtype, send_bucket_bytes, timeout=120)[1]["error"]
    assert re.search(want, error), error
    assert "generator rank 1" in error


def test_header_check_names_each_mismatch():
    """Pure: the header of a pair carries (version, wire dtype, stream numel, bucket numel); each
    field that differs from the receiver's own derivation is named, a version as before."""
    from parallel.layout import Box
    from weights_sync.stream import Segment
    from weights_sync.sync import check_header, header
    segs = [Segment("w", Box((0, 0), (3, 4)), 0, 12), Segment("b", Box((0,), (5,)), 12, 5)]
    want = header(7, torch.bfloat16, segs, 1024)
    assert want[2] == 17
    check_header(list(want), want, rank=5, src=1)
    cases = [(header(6, torch.bfloat16, segs, 1024), RuntimeError,
              r"generator rank 5 expected weights version 7 but trainer rank 1 sent version 6"),
             (header(7, torch.float16, segs, 1024), ValueError,
              r"trainer rank 1 sends weights as float16, this rank's parameters are bfloat16"),
             (header(7, torch.bfloat16, segs[:1], 1024), ValueError,
              r"trainer rank 1 sends 12 elements, the plan gives this pair 17"),
             (header(7, torch.bfloat16, segs, 512), ValueError,
              r"cuts its stream every 512 elements, this rank every 1024")]
    for got, kind, match in cases:
        with pytest.raises(kind, match=match):
            check_header(got, want, rank=5, src=1)
    # the dtype codes tell every torch dtype apart, the same in every process (no salted hash)
    dtypes = {getattr(torch, n) for n in ("float64", "float32", "bfloat16", "float16", "int64",
                                          "int32", "int8", "uint8", "float8_e4m3fn", "float8_e5m2")}
    assert len({header(0, d, segs, 1)[1] for d in dtypes}) == len(dtypes)


def test_a_waits_timeout_is_told_from_a_lost_peer_in_gloo_and_nccl_words():
    """gloo's timeout says "Timed out", NCCL's "... before timing out": both are timeouts (NCCL's
    was reported as a lost peer); an error before the deadline that says neither is a lost peer
    (NCCL's "either an error or timeout" too), and one at the deadline is a timeout whatever it
    says."""
    from datetime import timedelta
    from weights_sync.sync import PeerLost, _wait

    class Work:
        def __init__(self, text, sleep_s=0.0):
            self.text, self.sleep_s = text, sleep_s

        def wait(self, timeout: timedelta):
            time.sleep(self.sleep_s)
            raise RuntimeError(self.text)

    far = time.monotonic() + 60
    for text in ("[gloo] Timed out waiting 3000ms for recv", "Watchdog caught collective "
                 "operation timeout: WorkNCCL(SeqNum=5) ran for 3000 milliseconds before timing out."):
        with pytest.raises(TimeoutError, match=r"weight sync timed out after 60s waiting for x") as e:
            _wait(Work(text), far, 60.0, "x")
        assert not isinstance(e.value, PeerLost)
    for text in ("Connection closed by peer", "Exception (either an error or timeout) detected "
                 "by watchdog: NCCL communicator was aborted"):
        with pytest.raises(PeerLost, match=r"lost its peer while waiting for x"):
            _wait(Work(text), far, 60.0, "x")
    with pytest.raises(TimeoutError, match="timed out") as e:
        _wait(Work("Connection closed by peer", sleep_s=0.2), time.monotonic() + 0.1, 0.1, "x")
    assert not isinstance(e.value, PeerLost)


@pytest.mark.slow
def test_version_waits_share_one_deadline_and_name_the_silent_peer():
    # margins of seconds on a loaded 2-core runner: the slow peer posts 3 s inside the budget,
    # join's grace (2 s) stays below slow_s, and the receiver's limit is 1.5 s either side
    timeout_s, slow_s = 6.0, 3.0
    results = run_ranks(_deadline_worker, 3, timeout_s, slow_s, 2.0, timeout=120)
    # a budget per source would wait slow_s + timeout_s = 9 s
    assert results[2]["recv_s"] < timeout_s + slow_s / 2, results[2]["recv_s"]


def test_a_sender_closed_after_a_timed_out_wait_does_not_wait_again(monkeypatch):
    """wait_sent() timed out on a version whose thread is stuck (a generator gone): the caller's
    cleanup close() waited out a second whole timeout_s (plus the grace) for the same thread,
    then raised the same error; a later wait_sent() raises at once."""
    import threading
    import time
    from weights_sync.sync import VersionThread, WeightSender
    monkeypatch.setattr(VersionThread, "JOIN_GRACE_S", 0.0)
    release = threading.Event()
    sender = WeightSender.__new__(WeightSender)
    sender.rank, sender.timeout_s, sender.peers = 0, 0.3, {1: []}
    sender._inflight = VersionThread()
    sender._inflight.start(4, lambda: release.wait(30), (), "stuck")
    with pytest.raises(TimeoutError, match="weights version 4: trainer rank 0 still waiting"):
        sender.wait_sent()
    t0 = time.monotonic()
    sender.close()
    with pytest.raises(TimeoutError, match="weights version 4"):
        sender.wait_sent()
    assert time.monotonic() - t0 < 0.1
    release.set()


def _colocated_worker(rank, world, folder, gen_dtype, gen_dp):
    """Both models on each rank (trainer FSDP over all, generator gen_dp x TP: with TP, pieces go
    both ways between two ranks; with replicas, one rank's pieces to several), run_colocated's
    plan and exchange, two versions with the trainer's weights changed between; every batch of
    point-to-point operations counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from model.hf_io import load_model_args
    from parallel.layout import Layout
    from parallel.sharding import build_model, parallelize_generator, parallelize_trainer
    from trainer.colocated import _PlanWithoutSelf
    from weights_sync.exchange import BatchedExchange
    from weights_sync.plan import plan_cached
    from weights_sync.sync import WeightReceiver, WeightSender, local_tensors, transfer_specs
    tmesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    gmesh = init_device_mesh("cpu", (gen_dp, world // gen_dp), mesh_dim_names=("dp", "tp"))
    args, cpu = load_model_args(folder), torch.device("cpu")
    t_model = build_model(args, cpu, torch.float32, path=folder,
                          parallelize=lambda m: parallelize_trainer(m, tmesh))
    g_model = build_model(args, cpu, gen_dtype, seed=5,
                          parallelize=lambda m: parallelize_generator(m, gmesh))
    group = dist.new_group(backend="gloo")
    src = Layout.from_module(t_model, group=group)
    dst = Layout.from_module(g_model, group=group)
    plan = _PlanWithoutSelf(plan_cached(src, dst, transfer_specs(src, dst)), rank)
    exchange = BatchedExchange(WeightSender(t_model, plan, rank, gen_dtype, group, 60, streams=False),
                               WeightReceiver(g_model, plan, rank, group, 60))
    batches, real = [], dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: batches.append(len(ops)) or real(ops)
    shard = sum(t.numel() for t in local_tensors(t_model).values()) * gen_dtype.itemsize
    out = {"peers": exchange.peers(), "staging": exchange.staging_bytes / shard}
    for version in (1, 2):
        with torch.no_grad():
            for p in t_model.parameters():
                _loc(p).add_(0.01 * version)
        exchange.run(version)()
        for t in plan.local():
            exchange.receiver.tensors[t.param][t.dst_box.slices()].copy_(
                exchange.sender.tensors[t.param][t.src_box.slices()])
        want, got = _full_params(t_model, None), _full_params(g_model, None)
        out[version] = all(torch.equal(got[n], want[n].to(gen_dtype)) for n in got)
    dist.batch_isend_irecv = real
    out["batches"] = batches
    return out


@pytest.mark.parametrize("gen_dtype, world, gen_dp", [(torch.bfloat16, 2, 1), (torch.float32, 2, 1),
                                                      (torch.bfloat16, 3, 3)])
def test_colocated_exchange_posts_each_version_as_one_batch(tmp_path, gen_dtype, world, gen_dp):
    """Colocated ranks are both sender and receiver of the same pairs. A thread of sends beside
    the main thread's receives (split mode's sender and receiver, as colocated used them) would
    queue a pair's sends and receives in some order on one NCCL stream, where a send ahead of the
    receive it waits for deadlocks both ranks; one `batch_isend_irecv` a version is one NCCL group.
    On gloo ranks: the generator's weights are the trainer's, bitwise (bf16: cast), after each of
    two versions, every operation of a version in one batch. The copied pieces' buffers hold at
    most the rank's trainer shard, and a piece once, not once per replica: where 3 replicas each
    take a rank's whole shard from it, cast, one shard (2 x the shard before)."""
    tiny.save_hf("qwen2", tmp_path)
    for res in run_ranks(_colocated_worker, world, str(tmp_path), gen_dtype, gen_dp, timeout=120):
        assert res[1] and res[2], res
        assert len(res["batches"]) == 2 and res["batches"][0] == res["batches"][1] > 2
        assert len(res["peers"]) == world - 1
        assert 0 < res["staging"] <= 1.0, res  # the copied pieces of the shard, at most all
        if gen_dp == 3:  # the whole shard goes to 2 replicas, all of it cast: one copy
            assert res["staging"] == pytest.approx(1.0, abs=1e-6), res
