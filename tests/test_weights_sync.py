"""Weight sync on real gloo ranks: bitwise-exact shards after push, two versions in a row,
atomic swap, and timeouts that name the peer and the version."""
import pytest
import torch
import torch.distributed as dist

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


def _sync_worker(rank, world, folder, n_trainer, gen_tp, trainer_tp=1):
    from parallel.layout import local_box
    from weights_sync.sync import WeightReceiver, WeightSender

    model, p, wgroup, tgroup = _setup(rank, folder, n_trainer, gen_tp, trainer_tp=trainer_tp)
    out = {}
    # one sender/receiver for both versions: they must follow in-place updates of the shards
    if rank < n_trainer:
        sender = WeightSender(model, p, rank, GEN_DTYPE, wgroup, timeout_s=30, bucket_bytes=4096)
    else:
        recv = WeightReceiver(model, p, rank, wgroup, timeout_s=30, bucket_bytes=4096)
    for version in (1, 2):
        if rank < n_trainer:
            opt = torch.optim.SGD(model.parameters(), lr=0.01 * version)
            for prm in model.parameters():  # a new version: an optimizer changes every shard
                prm.grad = torch.ones_like(prm)
            opt.step()
            full = _full_params(model, tgroup)
            sender.push(version)
            sender.wait_sent()
            if rank == 0:
                for n, t in full.items():
                    out[f"v{version}.{n}"] = t
        else:
            before = {n: _loc(prm).clone() for n, prm in model.named_parameters()}
            apply = recv.receive(version)
            # received but not applied: the model still holds the old version (no torn state)
            assert all(torch.equal(before[n], _loc(prm)) for n, prm in model.named_parameters())
            apply()
            for n, prm in model.named_parameters():
                box = local_box(n, prm)
                out[f"v{version}.{n}"] = _loc(prm).clone()
                out[f"box.{n}"] = torch.tensor([box.offsets, box.sizes])
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,n_trainer,gen_tp,trainer_tp,family", [
    (3, 2, 1, 1, "qwen2"), (4, 2, 2, 1, "qwen2"), (4, 3, 1, 1, "qwen2"), (4, 2, 1, 1, "qwen2"),
    (4, 2, 2, 2, "qwen3")])  # trainer TP: q/k norms are Replicate DTensors there, plain here
def test_generator_shards_bitwise_equal_trainer_slices(tmp_path, world, n_trainer, gen_tp,
                                                       trainer_tp, family):
    tiny.save_hf(family, tmp_path)
    results = run_ranks(_sync_worker, world, str(tmp_path), n_trainer, gen_tp, trainer_tp,
                        timeout=240)
    trainer0 = results[0]
    for res in results[n_trainer:]:
        for version in (1, 2):
            for key, local in res.items():
                if not key.startswith(f"v{version}."):
                    continue
                name = key[len(f"v{version}."):]
                offsets, sizes = res[f"box.{name}"].tolist()
                full = trainer0[key]
                want = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].to(GEN_DTYPE)
                assert local.dtype == GEN_DTYPE and torch.equal(local, want), (version, name)


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
