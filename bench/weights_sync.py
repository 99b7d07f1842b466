"""Weight sync, trainer -> generator, timed on the real path against a floor measured in the
same run.

    python bench/weights_sync.py                  # CPU, gloo: ~125M Llama, trainer fsdp=2 ->
                                                  # generator dp=2 (ranks 0,1 -> 2,3), fp32 -> fp32
    python bench/weights_sync.py --dtypes float32,bfloat16     # also the fp32 -> bf16 cast
    python bench/weights_sync.py --ipc            # 2 processes on one GPU, CUDA IPC, 1.1B bf16
    python bench/weights_sync.py --ipc --device cpu --shape tiny   # the same code on CPU (shm)
    python bench/weights_sync.py --rl             # train_rl.py, 2 ranks (trainer + generator),
                                                  # async (eta=1) vs sync (eta=0): step time, tok/s

gloo mode. Models are built with `parallel.sharding.build_model` + parallelize, laid out with
`Layout.from_module`, exchanged with `exchange_layouts`, planned with `plan`, and synced by
`make_sender`/`make_receiver` (WeightSender/WeightReceiver here: no GPU). One sample = barrier,
every trainer rank `push(v)` + `wait_sent()`, every generator rank `receive(v)` + `apply()`,
barrier: push -> received -> applied on every rank. Floors, timed the same way and interleaved
with ours so that load from other processes hits all alike: (1) one plain gloo send, rank 0 ->
rank 2, of all the bytes the sync moves (each of the 2 replicas receives the full model: 2 x the
model's bytes) -- "one plain send of the same bytes", the goal's floor; (2) two concurrent sends of
the model (0 -> 2 and 1 -> 3), the same bytes over two pairs; (3) one send of the model alone, one
replica's share. On this 2-core machine 4 busy ranks share 2 cores; across nodes every pair has
its own link, and (2) would take the time of (3).
Memory: `staging_bytes` sums the persistent staging tensors each rank allocated (exact);
`rss_growth` is the growth of the resident set (/proc/self/statm) from before the sender/receiver
exist to after the last version (includes what gloo keeps; transient copies are gone by then).

ipc mode. Rank 0 (trainer, one shard = the whole model) and rank 1 (generator) on the same
device; `make_sender`/`make_receiver` pick CUDA IPC from the placement. For each protocol variant
(staged: receiver copies into its staging; direct: apply from the mapped slot; _bN: N staging
buffers on the trainer, _b0 = zero copy: the generator reads the trainer's parameters; _loop:
one copy per parameter instead of one multi-tensor copy) it times
push -> applied (median over versions, CUDA-synchronised), checks that every parameter is
bitwise equal to the trainer's (cast to the generator dtype) via two per-parameter checksums of
the raw bits, and compares the effective bandwidth (model bytes / time) with one plain
device-to-device copy of the same bytes measured in the same run. Goal: <= 10 ms for the 1.1B
shape in bf16 and >= 50% of the copy bandwidth.

rl mode. Two real `train_rl.py` runs under torchrun with 2 processes, 1 trainer + 1 generator
(on a 1-GPU machine both land on the same GPU, so weights travel by CUDA IPC if the roles build
their ends with make_sender/make_receiver), on a random Llama from
`tools.make_tiny_model.make_random_model` (`--rl-shape smollm2-135m`: SmolLM2-135M's architecture,
as gpu_check.sh runs it): async (`--algo.max_staleness=1`) vs sync (`=0`). Reports per mode the
median step time, tokens/s and weight-sync time over the steps after warm-up.

The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch

from bench.common import (LLAMA_1B, print_json, read_metrics, rl_args, root_cause, run_ranks,
                          run_train_rl)
from config import int_at_least
from launch.plan import PRESETS

SHAPES = {
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                 num_heads=12, num_kv_heads=4),
    "1b": LLAMA_1B,
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2),
}
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _rss() -> int:
    """Resident bytes now (Linux /proc), else the peak (getrusage, KiB on Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bit_checksums(t: torch.Tensor) -> tuple[int, int]:
    """Two order-independent integer checksums of the raw bits: their sum, and a sum weighted by
    position (catches permutations). int64 arithmetic wraps identically on every rank."""
    bits = t.contiguous().view(_BITS[t.element_size()]).reshape(-1).long()
    pos = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
    return int(bits.sum()), int((bits * pos).sum())


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _meshes(n_trainer: int, device_type: str = "cpu"):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    world = dist.get_world_size()
    gen = list(range(n_trainer, world))
    tmesh = DeviceMesh(device_type, torch.arange(n_trainer).view(n_trainer, 1),
                       mesh_dim_names=("fsdp", "tp"))
    gmesh = DeviceMesh(device_type, torch.tensor(gen).view(-1, 1), mesh_dim_names=("dp", "tp"))
    return tmesh, gmesh, dist.new_group(list(range(n_trainer))), dist.new_group(gen)


def _build(rank, n_trainer, args, device, trainer_dtype, gen_dtype, tmesh, gmesh, tgroup, ggroup):
    """This rank's model and the plan of the trainer -> generator sync."""
    from parallel.sharding import build_model, parallelize_generator, parallelize_trainer
    from weights_sync.sync import plan_between_meshes
    trains = rank < n_trainer
    model = build_model(args, device, trainer_dtype if trains else gen_dtype, seed=0 if trains else rank,
                        parallelize=lambda m: (parallelize_trainer(m, tmesh) if trains
                                               else parallelize_generator(m, gmesh)))
    return model, plan_between_meshes(model, tgroup if trains else ggroup, rank == 0, rank == n_trainer)


def _timed(fn) -> float:
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


# ----- gloo mode: 4 ranks, trainer fsdp=2 -> generator dp=2 ------------------------------------

def gloo_worker(rank, world, shape, dtypes, versions, warmup, bucket_mb):
    import torch.distributed as dist
    from model import ModelArgs
    from weights_sync.sync import make_receiver, make_sender
    args = ModelArgs(**SHAPES[shape])
    tmesh, gmesh, tgroup, ggroup = _meshes(2)
    wgroup = dist.new_group(backend="gloo")
    is_trainer = rank < 2
    out = {}
    trainer_model = None
    for name in dtypes:
        gen_dtype = _dtype(name)
        if is_trainer and trainer_model is not None:
            model = trainer_model
            _, p = _exchange_again(rank, model, tgroup)
        else:
            model, p = _build(rank, 2, args, torch.device("cpu"), torch.float32, gen_dtype,
                              tmesh, gmesh, tgroup, ggroup)
            trainer_model = model if is_trainer else None
        numel = sum(s.numel() for s in _full_shapes(model))
        floor = torch.ones(numel, dtype=gen_dtype)  # allocated and touched before the baseline
        # every byte the sync moves (each of the 2 replicas receives the model), as one send
        whole = torch.ones(2 * numel, dtype=gen_dtype) if rank in (0, 2) else None
        base_rss = _rss()
        kw = dict(bucket_bytes=bucket_mb << 20)
        if is_trainer:
            io = make_sender(model, p, rank, gen_dtype, wgroup, 300, None, **kw)
        else:
            io = make_receiver(model, p, rank, wgroup, 300, None, **kw)
        t_single, t_pair, t_whole, t_ours, t_recv, t_apply = [], [], [], [], [], []

        def single():
            if rank == 0:
                dist.send(floor, 2, group=wgroup)
            elif rank == 2:
                dist.recv(floor, 0, group=wgroup)

        def all_bytes():
            if rank == 0:
                dist.send(whole, 2, group=wgroup)
            elif rank == 2:
                dist.recv(whole, 0, group=wgroup)

        def pair():
            if rank < 2:
                dist.send(floor, rank + 2, group=wgroup)
            else:
                dist.recv(floor, rank - 2, group=wgroup)

        def ours(v):
            if is_trainer:
                io.push(v)
                io.wait_sent()
            else:
                t0 = time.perf_counter()
                apply = io.receive(v)
                t1 = time.perf_counter()
                apply()
                t_recv.append(t1 - t0)
                t_apply.append(time.perf_counter() - t1)

        for i in range(warmup + versions):
            ts = (_timed(single), _timed(pair), _timed(all_bytes), _timed(lambda: ours(i + 1)))
            if i >= warmup:
                for acc, t in zip((t_single, t_pair, t_whole, t_ours), ts):
                    acc.append(t)
        rss_delta = _rss() - base_rss
        rec = {"single": t_single, "pair": t_pair, "whole": t_whole, "ours": t_ours, "bytes": numel * floor.element_size(),
               "staging_bytes": io.staging_bytes, "rss_growth": rss_delta,
               "checksums": _checksums(model, gen_dtype, tgroup if is_trainer else None)}
        if is_trainer:
            rec.update(_fill_diagnostic(io))
        else:
            rec.update(recv_s=t_recv, apply_s=t_apply)
        io_close = getattr(io, "close", None)
        if io_close:
            io_close()
        out[name] = rec
        del io, floor, whole
    return out


@torch.no_grad()
def _fill_diagnostic(io) -> dict:
    """The sender's copies alone (the pieces it cannot send zero-copy): time and fraction."""
    from weights_sync import stream
    t0, copied = time.perf_counter(), 0
    for d, segs in io.peers.items():
        for lo, hi, view in io.messages[d]:
            if view is None:
                stream.fill(io.pool[0], lo, hi, segs, io.tensors)
                copied += hi - lo
    total = sum(stream.stream_numel(s) for s in io.peers.values())
    return {"fill_s": time.perf_counter() - t0, "copied_fraction": copied / max(1, total)}


def _full_shapes(model):
    return [p.shape for p in model.parameters()]


def _exchange_again(rank, model, tgroup):
    """Trainer side of a second layout exchange (the generator rebuilt in another dtype)."""
    from parallel.layout import Layout
    from weights_sync.plan import plan
    from weights_sync.sync import exchange_layouts, transfer_specs
    layout = Layout.from_module(model, group=tgroup)
    src, dst = exchange_layouts(layout, rank == 0, False)
    return layout, plan(src, dst, transfer_specs(src, dst))


def _checksums(model, gen_dtype, tgroup) -> dict[str, list[int]]:
    """Per param, checksums of the full parameter in the generator dtype. Trainer shards are
    disjoint (fsdp, tp=1), so their sums add up over the trainer group."""
    import torch.distributed as dist
    out = {}
    for n, prm in model.named_parameters():
        local = _local(prm).to(gen_dtype)
        if tgroup is None:
            out[n] = list(bit_checksums(local))
            continue
        bits = local.contiguous().view(_BITS[local.element_size()]).reshape(-1).long()
        box = _box_offset(n, prm)  # global element offset of the shard (dim-0 shards)
        pos = (torch.arange(bits.numel()) + box) % 65521 + 1
        acc = torch.tensor([bits.sum(), (bits * pos).sum()])
        dist.all_reduce(acc, group=tgroup)
        out[n] = acc.tolist()
    return out


def _box_offset(name, prm) -> int:
    from parallel.layout import local_box
    box = local_box(name, prm)
    row = 1
    for s in prm.shape[1:]:
        row *= s
    return box.offsets[0] * row if box.sizes and box.sizes[0] else 0


def _median_ratio(xs, ys) -> float:
    """Median of per-sample ratios: adjacent samples share the machine's load of the moment."""
    return statistics.median(x / y for x, y in zip(xs, ys))


def summarise_gloo(results, dtypes) -> dict:
    out = {}
    for name in dtypes:
        r0 = results[0][name]
        ours, single, pair, whole = (statistics.median(r0[k])
                                     for k in ("ours", "single", "pair", "whole"))
        exact = all(results[g][name]["checksums"] == r0["checksums"] for g in (2, 3))
        out[name] = {
            "ours_s": ours, "floor_s": single, "floor_pair_s": pair, "floor_all_bytes_s": whole,
            "ratio": ours / single, "ratio_vs_pair": ours / pair, "ratio_vs_all_bytes": ours / whole,
            "ratio_vs_all_bytes_median_of_samples": _median_ratio(r0["ours"], r0["whole"]),
            "ratio_median_of_samples": _median_ratio(r0["ours"], r0["single"]),
            "ratio_vs_pair_median_of_samples": _median_ratio(r0["ours"], r0["pair"]),
            "bytes_per_replica": r0["bytes"], "gbps_per_replica": r0["bytes"] / ours / 1e9,
            "fill_s": [results[r][name]["fill_s"] for r in (0, 1)],
            "copied_fraction": [results[r][name]["copied_fraction"] for r in (0, 1)],
            "recv_s": [statistics.median(results[r][name]["recv_s"]) for r in (2, 3)],
            "apply_s": [statistics.median(results[r][name]["apply_s"]) for r in (2, 3)],
            "staging_bytes": [results[r][name]["staging_bytes"] for r in range(4)],
            "rss_growth": [results[r][name]["rss_growth"] for r in range(4)],
            "exact": exact,
        }
    return out


def run_gloo(a) -> int:
    dtypes = a.dtypes.split(",")
    t0 = time.perf_counter()
    results = run_ranks(gloo_worker, 4, a.shape, dtypes, a.versions, a.warmup, a.bucket_mb,
                        threads=1, timeout=600)
    res = summarise_gloo(results, dtypes)
    cores = os.cpu_count()
    print(f"weights sync, {a.shape} Llama shape, trainer fsdp=2 (ranks 0,1) -> generator dp=2 "
          f"(ranks 2,3), gloo, {cores} cores for 4 ranks, median of {a.versions} versions")
    for name, r in res.items():
        mb = r["bytes_per_replica"] / 2**20
        print(f"  fp32 -> {name}: {mb:.0f} MiB per replica | ours {r['ours_s'] * 1e3:.0f} ms "
              f"({r['gbps_per_replica']:.2f} GB/s per replica) | exact {r['exact']}\n"
              f"    floors: one plain send of all the bytes the sync moves (2 x model) "
              f"{r['floor_all_bytes_s'] * 1e3:.0f} ms -> ratio {r['ratio_vs_all_bytes']:.2f}x; "
              f"two concurrent sends of the model {r['floor_pair_s'] * 1e3:.0f} ms -> "
              f"{r['ratio_vs_pair']:.2f}x; one send of the model (one replica's share) "
              f"{r['floor_s'] * 1e3:.0f} ms -> {r['ratio']:.2f}x")
        print(f"    breakdown: trainer copies {[round(x * 1e3) for x in r['fill_s']]} ms for "
              f"{[round(x * 100) for x in r['copied_fraction']]}% of the bytes (the rest is sent "
              f"zero-copy); "
              f"generator receive {[round(x * 1e3) for x in r['recv_s']]} ms, apply "
              f"{[round(x * 1e3) for x in r['apply_s']]} ms")
        print(f"    staging per rank {[round(b / 2**20) for b in r['staging_bytes']]} MiB (sum "
              f"of allocated staging tensors); RSS growth "
              f"{[round(b / 2**20) for b in r['rss_growth']]} MiB")
    first = res[dtypes[0]]
    met = first["ratio_vs_all_bytes"] <= 1.5
    print(f"  goal <= 1.5x one plain send of the same bytes: {'met' if met else 'NOT met'} "
          f"({first['ratio_vs_all_bytes']:.2f}x; against one replica's share "
          f"{first['ratio']:.2f}x); wall {time.perf_counter() - t0:.0f}s")
    print_json({"bench": "weights_sync", "mode": "gloo", "shape": a.shape, "ranks": 4,
                "layout": "trainer fsdp=2 -> generator dp=2", "cores": cores,
                "ratio_vs_all_bytes": first["ratio_vs_all_bytes"], "ratio": first["ratio"],
                "ratio_vs_pair": first["ratio_vs_pair"], "goal_ratio": 1.5, "met": met,
                "results": res,
                "memory_method": "staging_bytes = sum of allocated staging tensors; "
                                 "rss_growth = resident set growth over the sync phase "
                                 "(/proc/self/statm)"})
    return 0


# ----- ipc mode: 2 processes on one device ------------------------------------------------------

def ipc_worker(rank, world, shape, device, versions, warmup, trainer_dtype, gen_dtype, variants):
    import torch.distributed as dist
    from model import ModelArgs
    from weights_sync.sync import make_receiver, make_sender
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    args = ModelArgs(**SHAPES[shape])
    tmesh, gmesh, tgroup, ggroup = _meshes(1)
    model, p = _build(rank, 1, args, dev, _dtype(trainer_dtype), _dtype(gen_dtype),
                      tmesh, gmesh, tgroup, ggroup)
    gpu_of = {0: ("local", 0), 1: ("local", 0)}  # the same device: IPC for the pair
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out = {"copy_s": _copy_time(model, dev, _dtype(gen_dtype), sync)} if rank == 1 else {}
    for direct, buffers, foreach in variants:
        name = _variant_name(direct, buffers, foreach)
        if rank == 0:
            io = make_sender(model, p, 0, _dtype(gen_dtype), None, 30, gpu_of,
                             ipc_buffers=buffers, channel=name)
        else:
            io = make_receiver(model, p, 1, None, 30, gpu_of, ipc_direct=direct, channel=name)
        io.foreach = foreach
        times, local = [], []
        for i in range(warmup + versions):
            v = i + 1
            if rank == 0:
                # a new version: (almost) every element changes, the norms' 1.0 too (+1e-3 left
                # every bf16 value from 0.5 up as it was: a sync that missed them passed the check)
                with torch.no_grad():
                    for prm in model.parameters():
                        prm.add_(torch.randn_like(prm), alpha=0.05)
                sync()
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                io.push(v)
                io.wait_sent()
            else:
                io.receive(v)()
                sync()
                local.append(time.perf_counter() - t0)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        rec = {"times": times[warmup:], "staging_bytes": io.staging_bytes,
               "checksums": {n: list(bit_checksums(_local(x).to(_dtype(gen_dtype))))
                             for n, x in model.named_parameters()}}
        if rank == 1:
            rec["local"] = local[warmup:]
        else:
            io.close()
        out[name] = rec
        del io
    out["bytes"] = sum(x.numel() for x in model.parameters()) * torch.empty(
        (), dtype=_dtype(gen_dtype)).element_size()
    return out


def _variant_name(direct: bool, buffers: int, foreach: bool) -> str:
    return f"{'direct' if direct else 'staged'}_b{buffers}{'' if foreach else '_loop'}"


def _copy_time(model, dev, dtype, sync) -> float:
    """One plain device-to-device copy of the model's bytes (median of 5)."""
    n = sum(x.numel() for x in model.parameters())
    a, b = torch.ones(n, dtype=dtype, device=dev), torch.empty(n, dtype=dtype, device=dev)
    ts = []
    for _ in range(6):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        ts.append(time.perf_counter() - t0)
    del a, b
    return statistics.median(ts[1:])


def ipc_device(name: str | None) -> str:
    """The ipc mode's device, with an index: both ranks call `torch.cuda.set_device` on it, which
    refuses a bare "cuda" (on a GPU as well). None: cuda:0 where CUDA is available, else cpu."""
    if name is None:
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device; use --device cpu "
                         "(CPU shared memory, the same code) or leave --device out")
    return f"cuda:{dev.index or 0}" if dev.type == "cuda" else dev.type


def run_ipc(a) -> int:
    device = a.device
    variants = [(False, 1, True), (True, 1, True), (False, 2, True), (False, 0, True),
                (True, 0, True), (True, 1, False), (True, 0, False)]
    t0 = time.perf_counter()
    results = run_ranks(ipc_worker, 2, a.shape, device, a.versions, a.warmup, a.trainer_dtype,
                        a.gen_dtype, variants, threads=1 if device == "cpu" else 4, timeout=600)
    nbytes, copy_s = results[1]["bytes"], results[1]["copy_s"]
    copy_gbps = nbytes / copy_s / 1e9
    print(f"weights sync by {'CUDA IPC' if device.startswith('cuda') else 'CPU shared memory'}, "
          f"{a.shape} shape, {a.trainer_dtype} -> {a.gen_dtype}, {nbytes / 2**20:.0f} MiB, 2 "
          f"processes on {device}; one plain copy of the same bytes: {copy_s * 1e3:.2f} ms "
          f"({copy_gbps:.0f} GB/s)")
    res = {}
    for variant in variants:
        name = _variant_name(*variant)
        t = statistics.median(results[0][name]["times"])
        t_local = statistics.median(results[1][name]["local"])
        exact = results[0][name]["checksums"] == results[1][name]["checksums"]
        frac = (nbytes / t_local / 1e9) / copy_gbps
        res[name] = {"time_s": t, "receiver_time_s": t_local, "frac_of_copy_bw": frac,
                     "exact": exact,
                     "staging_bytes": [results[r][name]["staging_bytes"] for r in (0, 1)]}
        print(f"  {name}: push -> applied {t * 1e3:.2f} ms (barrier-bounded), {t_local * 1e3:.2f} "
              f"ms on the receiver = {frac:.0%} of the copy bandwidth | exact {exact} | staging "
              f"{[round(b / 2**20) for b in res[name]['staging_bytes']]} MiB (trainer, generator)")
    best = min(res.values(), key=lambda r: r["receiver_time_s"])
    met = best["receiver_time_s"] <= 0.010 and best["frac_of_copy_bw"] >= 0.5
    print(f"  goal <= 10 ms and >= 50% of copy bandwidth: {'met' if met else 'NOT met'}; wall "
          f"{time.perf_counter() - t0:.0f}s")
    print_json({"bench": "weights_sync", "mode": "ipc", "device": device, "shape": a.shape,
                "bytes": nbytes, "copy_s": copy_s, "copy_gbps": copy_gbps, "results": res,
                "exact": all(r["exact"] for r in res.values()), "met": met})
    return 0


# ----- rl mode: train_rl.py, trainer + generator, async vs sync ---------------------------------

def rl_overrides(model: str, run_dir: Path, eta: int, a) -> list[str]:
    """train_rl.py arguments of one run (bench.common.rl_args: fixed-length completions, nothing
    written besides the metrics) on this bench's generator dtype and same-GPU sync setting."""
    return [*rl_args(model, run_dir, steps=a.rl_steps, prompts=a.rl_prompts, samples=a.rl_samples,
                     new_tokens=a.rl_new_tokens, eta=eta),
            f"--model.gen_dtype={a.rl_gen_dtype}", "--parallel.timeout_s=60",
            f"--parallel.ipc_buffers={a.rl_ipc_buffers}", f"--generator.decode={a.rl_decode}",
            f"--parallel.warmup_timeout_s={a.rl_timeout}"]


def rl_run(model: str, run_dir: Path, eta: int, a) -> dict:
    t0 = time.perf_counter()
    try:  # threads: the caller's OMP_NUM_THREADS (gpu_check.sh sets 8)
        proc = run_train_rl(2, rl_overrides(model, run_dir, eta, a), a.rl_timeout, threads=None)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.rl_timeout}s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not (run_dir / "metrics.jsonl").exists():
        return {"error": f"exit {proc.returncode}: {root_cause(proc.stderr or proc.stdout)}"}
    rows = read_metrics(run_dir)[a.rl_warmup:]
    if not rows:
        return {"error": f"only {a.rl_warmup} steps or fewer were logged"}
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {"step_s": med("time_step_s"), "tokens_per_s": med("tokens_per_s"),
            "weights_sync_s": med("time_weights_sync_s"), "steps": len(rows), "wall_s": wall}


def run_rl(a) -> int:
    from tools.make_tiny_model import make_random_model
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        shape = None if a.rl_shape is None else PRESETS[a.rl_shape]
        model = make_random_model(Path(tmp) / "model", hidden=a.rl_hidden, layers=a.rl_layers,
                                  shape=shape)
        for mode, eta in (("async", 1), ("sync", 0)):
            r = res[mode] = rl_run(model, Path(tmp) / mode, eta, a)
            if "error" in r:
                print(f"  {mode} (eta={eta}): FAILED {r['error']}", flush=True)
            else:
                print(f"  {mode} (eta={eta}): step {r['step_s'] * 1e3:.0f} ms, "
                      f"{r['tokens_per_s']:.0f} tok/s, weight sync {r['weights_sync_s'] * 1e3:.1f} "
                      f"ms (median of {r['steps']} steps; run wall {r['wall_s']:.0f}s)", flush=True)
    ok = all("error" not in r for r in res.values())
    dims = PRESETS[a.rl_shape] if a.rl_shape else dict(hidden_size=a.rl_hidden,
                                                        num_layers=a.rl_layers)
    out = {"bench": "weights_sync", "mode": "rl", "shape": a.rl_shape or "custom",
           "hidden": dims["hidden_size"], "layers": dims["num_layers"],
           "ipc_buffers": a.rl_ipc_buffers, "decode": a.rl_decode,
           "gen_dtype": a.rl_gen_dtype, "results": res, "ok": ok}
    if ok:
        out["speedup_async_vs_sync"] = res["sync"]["step_s"] / res["async"]["step_s"]
        print(f"  async / sync step-time speedup: {out['speedup_async_vs_sync']:.2f}x")
    print_json(out)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ipc", action="store_true", help="2 processes on one device, IPC path")
    ap.add_argument("--device", default=None, help="ipc mode: cuda:0 (default if present) or cpu")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="model shape; default 100m (gloo) or 1b (ipc)")
    ap.add_argument("--dtypes", default="float32",
                    help="gloo mode: generator dtypes, e.g. float32,bfloat16")
    ap.add_argument("--trainer-dtype", default="bfloat16", help="ipc mode")
    ap.add_argument("--gen-dtype", default="bfloat16", help="ipc mode")
    ap.add_argument("--versions", type=int_at_least(1), default=None,
                    help="timed versions (default 7 gloo, 10 ipc)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--rl", action="store_true", help="train_rl.py async vs sync, 2 ranks")
    ap.add_argument("--rl-hidden", type=int, default=1024)
    ap.add_argument("--rl-layers", type=int, default=8)
    ap.add_argument("--rl-shape", default=None, choices=sorted(PRESETS),
                    help="a real architecture with random weights instead of --rl-hidden and "
                         "--rl-layers (launch/plan.py PRESETS), e.g. smollm2-135m; the vocabulary "
                         "beyond the task tokenizer's is sampled but decodes to nothing")
    ap.add_argument("--rl-gen-dtype", default="bfloat16")
    ap.add_argument("--rl-steps", type=int, default=12)
    ap.add_argument("--rl-warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--rl-prompts", type=int, default=16)
    ap.add_argument("--rl-samples", type=int, default=8)
    ap.add_argument("--rl-new-tokens", type=int, default=64)
    ap.add_argument("--rl-timeout", type=int, default=50, help="seconds per run")
    ap.add_argument("--rl-decode", default="auto", choices=("auto", "eager", "cudagraph", "compile"),
                    help="--generator.decode of the runs (compile: the compiled step, with "
                         "FlexAttention on CUDA)")
    ap.add_argument("--rl-ipc-buffers", type=int, default=1,
                    help="--parallel.ipc_buffers of the runs (0: zero copy)")
    a = ap.parse_args(argv)
    if a.rl:
        return run_rl(a)
    if a.ipc:
        a.shape, a.versions = a.shape or "1b", a.versions or 10
        try:
            a.device = ipc_device(a.device)
        except ValueError as e:
            ap.error(str(e))
        return run_ipc(a)
    a.shape, a.versions = a.shape or "100m", a.versions or 7
    return run_gloo(a)


if __name__ == "__main__":
    sys.exit(main())
