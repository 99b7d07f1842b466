"""Calibrate the cost model on the present hardware (CPU here, CUDA when there is one).

    python launch/calibrate.py --model runs/_models/tiny_addition --prompts 8 --group 8 \\
        --prompt-len 8 --response-len 24 --out profile.json
    python launch/plan.py --model ... --profile profile.json ...   # measured numbers win

What is measured (ReaL profiles per-layer costs the same way, arXiv 2406.14088):
  * one decoder layer's forward and backward time at a few packed micro-batch sizes T, timed in
    place by module hooks around every decoder layer of a real forward/backward and averaged
    over the layers (the rest is the "head": embedding, final norm, lm_head and log-softmax),
    fitted as a + b*T + c*T^2 by the cost model;
  * one engine decode step at a few batch sizes, as (t(R2) - t(R1)) / (R2 - R1) of two
    `Engine.generate` calls, and the fixed part (prefill + admission) t(R1) - R1 * step;
  * the trainer's per-step overhead beyond forward/backward: a real `train_step` (optimizer,
    packing, statistics) minus what the layer fits predict for it;
  * between two spawned ranks (gloo on CPU, NCCL with 2+ GPUs): p2p one-way time (half a
    ping-pong), all-reduce and all-gather times at a few sizes (on CPU also a hand-off through
    host shared memory, the weight sync's path between ranks of one host), and the cost of one
    FSDP2 / TP collective with its DTensor overhead: a real 2-rank train step minus the plain
    one, over their number; the per-step excess of the gradient-norm clip + AdamW step on
    DTensors; the generator's TP collective: an engine decode step of a TP-sharded model minus
    the plain model's, at one prompt group, over its 2L + 2 collectives (the training probe's
    backward and DTensor overheads would overcharge decode, by about 2x here); and the
    generator's hand-off per batch: its samples scored and its groups shipped over a Link to the
    other rank;
  * on CPU, the slowdown of k busy ranks on the shared cores, and how much a phase's duration
    varies among them (cv): k processes running this model's decode steps and train steps at
    once; and the slowdown of k/2 generator TP pairs decoding at once, which wait on each other
    more than they compute (launch/core_share.py).
Timings are minima over repetitions (undisturbed costs); the load of a shared machine enters
through the slowdown curve. The exceptions, where waiting for the peer is part of the cost, are
medians: the optimizer-step probe, the paired sharded-against-plain steps, the generator's
hand-off and the colocated group exchange.
Ranks are single-threaded (torchrun's OMP_NUM_THREADS=1), so the profile is too (--threads).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder is sys.path[0], where "profile" would shadow the standard
# library module of that name (cProfile, imported by torch, needs it): use the repo root instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "launch"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from config import int_at_least  # noqa: E402

from launch.core_share import pair_probes, slowdown_curve  # noqa: E402
from launch.cost_model import Profile, Workload, model_signature  # noqa: E402
from model.args import ModelArgs  # noqa: E402


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def wall_times(fn, reps: int, warmup: int = 1, device="cpu", before=None) -> list[float]:
    """Wall time of each of `reps` calls of `fn()` after `warmup` untimed ones (CUDA synced).
    `before()` runs untimed ahead of every call (e.g. a barrier so that ranks start together)."""
    out = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def timed(fn, device="cpu", reps: int = 5, warmup: int = 1, stat=min) -> float:
    """`stat` (default: the minimum, i.e. the undisturbed cost) of the wall times of `reps` calls
    after `warmup` untimed ones. Load from other processes is accounted for separately, by the
    measured slowdown curve (launch/core_share.py)."""
    return stat(wall_times(fn, reps, warmup, device))


def build(args: ModelArgs, device, dtype, seed: int = 0):
    from model import Transformer
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = Transformer(args).to(dtype)
    m.to_empty(device=device)
    m.init_weights(seed=seed)
    return m


def _fwd_bwd(model, tokens: int, seq_len: int, device, backward: bool):
    """One packed micro-batch as the trainer runs it: logits -> log-softmax -> gathered log-probs."""
    V = model.args.vocab_size
    seq_len = min(seq_len, tokens)
    n_seq, ids = tokens // seq_len, torch.randint(0, V, (tokens,), device=device)
    lens = torch.full((n_seq,), seq_len, dtype=torch.long, device=device)
    lens[-1] += tokens - n_seq * seq_len

    def run():
        with torch.set_grad_enabled(backward):
            logits = model(ids, seq_lens=lens)
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])
            if backward:
                lp.sum().backward()
                model.zero_grad(set_to_none=True)
    return run


def layer_costs(model, device, seq_len: int, token_counts, reps: int = 7) -> dict:
    """Per-layer and head forward/backward times, timed in place by module hooks around every
    decoder layer of a real forward/backward (the head is the rest: embedding, final norm,
    lm_head, log-softmax). Minimum over reps, mean over layers."""
    acc = {"fwd": 0.0, "bwd": 0.0}
    start: dict = {}

    def stamp(key):
        def hook(*_):
            _sync(device)
            start[key] = time.perf_counter()
        return hook

    def add(key, kind):
        def hook(*_):
            _sync(device)
            acc[kind] += time.perf_counter() - start[key]
        return hook
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles += [layer.register_forward_pre_hook(stamp(("f", i))),
                    layer.register_forward_hook(add(("f", i), "fwd")),
                    layer.register_full_backward_pre_hook(stamp(("b", i))),
                    layer.register_full_backward_hook(add(("b", i), "bwd"))]
    L, out = len(model.model.layers), {"layer_fwd": [], "layer_bwd": [], "head_fwd": [], "head_bwd": []}
    try:
        for T in token_counts:
            run_f, run_fb = (_fwd_bwd(model, T, seq_len, device, b) for b in (False, True))
            rows = []
            for _ in range(reps + 1):  # the first is a warm-up
                acc.update(fwd=0.0, bwd=0.0)
                t_f = timed(run_f, device, reps=1, warmup=0)
                lf = acc["fwd"]
                acc.update(fwd=0.0, bwd=0.0)
                t_fb = timed(run_fb, device, reps=1, warmup=0)
                rows.append((lf / L, acc["bwd"] / L, max(t_f - lf, 0.0), max(t_fb - t_f - acc["bwd"], 0.0)))
            med = [min(c) for c in zip(*rows[1:])]
            for key, v in zip(("layer_fwd", "layer_bwd", "head_fwd", "head_bwd"), med):
                out[key].append([T, v])
    finally:
        for h in handles:
            h.remove()
    return out


def decode_costs(model, wl: Workload, device, batches, r1: int, r2: int, stat=min) -> dict:
    """Decode step and fixed (prefill + admission) times of the real engine, groups of n samples."""
    from rollout.engine import Engine, Request, SamplingParams
    V, out = model.args.vocab_size, {"decode_step": [], "gen_fixed": []}
    for b in batches:
        prompts = max(1, b // wl.group_size)
        n = max(1, b // prompts)
        eng = Engine(model, num_slots=prompts * n, max_len=wl.prompt_len + r2 + 1, device=device)
        ids = [torch.randint(3, V, (wl.prompt_len,)).tolist() for _ in range(prompts)]

        def gen(r):
            reqs = [Request(i, ids[i], SamplingParams(n=n, max_new_tokens=r, ignore_eos=True))
                    for i in range(prompts)]
            return lambda: eng.generate(reqs)
        t1, t2 = timed(gen(r1), device, stat=stat), timed(gen(r2), device, stat=stat)
        step = max((t2 - t1) / (r2 - r1), 1e-9)
        out["decode_step"].append([prompts * n, step])
        out["gen_fixed"].append([prompts, max(t1 - r1 * step, 0.0)])
    return out


def synthetic_groups(wl: Workload, vocab: int, seed: int = 0):
    from trainer.batch import Group, Trajectory
    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(wl.prompts_per_step):
        prompt = torch.randint(3, vocab, (wl.prompt_len,), generator=g).tolist()
        trajs = [Trajectory(p, s, prompt, torch.randint(3, vocab, (wl.response_len,), generator=g).tolist(),
                            [-1.0] * wl.response_len, [0] * wl.response_len, float(s % 2), "length")
                 for s in range(wl.group_size)]
        groups.append(Group(p, trajs))
    return groups


def train_step_fn(model, wl: Workload, device, micro_batch_tokens: int, dp_group=None,
                  seed: int = 0) -> tuple:
    """(a callable running one real train_step of synthetic groups on this rank, micro-batches,
    tokens per micro-batch)."""
    from config import load_config
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.step import micro_batches, train_step
    cfg = load_config(None, [f"--trainer.prompts_per_step={wl.prompts_per_step}",
                             f"--generator.n_samples={wl.group_size}",
                             f"--trainer.micro_batch_tokens={micro_batch_tokens}"])
    opt = build_optimizer(model, cfg.trainer)
    sched = build_scheduler(opt, cfg.trainer)
    groups = synthetic_groups(wl, model.args.vocab_size, seed)
    mbs = micro_batches(groups, cfg.algo.advantage, micro_batch_tokens, cfg.trainer.share_prompts)
    return (lambda: train_step(model, opt, sched, groups, cfg, dp_group, device, 0), len(mbs),
            max(b.num_tokens for b in mbs))


def train_step_time(model, wl: Workload, device, micro_batch_tokens: int, dp_group=None,
                    seed: int = 0, stat=min) -> tuple[float, int, int]:
    """(seconds of one real train_step on this rank, micro-batches, tokens per micro-batch)."""
    fn, micro, tokens = train_step_fn(model, wl, device, micro_batch_tokens, dp_group, seed)
    return timed(fn, device, reps=5, stat=stat), micro, tokens


# ----- two ranks: links, collectives, FSDP and TP train steps ---------------------------------------
def _comm_rank(rank: int, world: int, args_d: dict, dtype_name: str, wl_d: dict, mbt: int,
               tp: bool = True) -> dict:
    """Rank `rank`'s measurements; `tp`: also the TP=2 trainer and generator probes (skipped for
    a model TP cannot shard: `two_rank_tp`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from parallel.mesh import all_gather_flat
    from parallel.sharding import build_model, parallelize_generator, parallelize_trainer
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    res = {"p2p": [], "allreduce": [], "allgather": []}
    for nbytes in (4 << 10, 256 << 10, 4 << 20, 16 << 20):
        x = torch.zeros(nbytes // 4, device=device)

        def ping():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
        res["p2p"].append([nbytes, timed(ping, device, reps=9) / 2])
        res["allreduce"].append([nbytes, timed(lambda: dist.all_reduce(x), device, reps=9)])
        full = torch.empty(nbytes // 4 // world * world, device=device)
        res["allgather"].append([nbytes, timed(lambda: all_gather_flat(
            full, x[:full.numel() // world]), device, reps=9)])
        if not cuda:
            res.setdefault("shm", []).append([nbytes, _shm_one_way(rank, x)])
    # FSDP/TP costs: the optimizer step on DTensors, then real train steps paired with plain ones
    args, wl = ModelArgs(**args_d), Workload(**wl_d)
    plain = build(args, device, dtype)
    t_step = _optimizer_step_time(plain, wl.seq_len, device)
    meshes = [("fsdp", (world, 1))] + ([("tp", (1, world))] if tp else [])
    for name, shape in meshes:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("fsdp", "tp"))
        model = build_model(args, device, dtype, parallelize=lambda m: parallelize_trainer(m, mesh))
        res[name] = {"step_excess": _optimizer_step_time(model, wl.seq_len, device) - t_step}
        if name == "fsdp":  # the real step on each rank's share, against one rank doing that share
            share = replace_wl(wl, max(1, -(-wl.prompts_per_step // world)))
            excess, micro, _ = _paired_excess(model, plain, share, device, mbt, mesh["fsdp"].get_group(),
                                              pairs=21)
            res[name].update(train_excess=excess, micro=micro, units=model.fsdp_units)
        else:  # TP ranks train the whole batch, each on its half of every layer
            excess, micro, tokens = _paired_excess(model, plain, wl, device, mbt, None)
            res[name].update(train_excess=excess, micro=micro, tokens=tokens)
    # the generator's TP: one decode step of the real engine on a TP-sharded model, against the
    # plain model, at the smallest batch (one prompt group), where the collectives dominate
    if tp:
        mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "tp"))
        sharded = build_model(args, device, dtype, parallelize=lambda m: parallelize_generator(m, mesh))
        res["tp_decode_excess"] = _paired_decode_excess(sharded, plain, wl, device, mesh["tp"].get_group())
    res["handoff"] = _handoff_times(rank, wl, sorted({1, wl.prompts_per_step}))
    res["gather"] = [world, gather_time(rank, world, wl)]
    return res


def _shm_one_way(rank: int, x: torch.Tensor, timeout_s: float = 60.0) -> float:
    """One hand-off of x's bytes between the two ranks through host shared memory, as the weight
    sync between CPU ranks of one host does it (parallel.cpu_shm, weights_sync/ipc.py over
    `CpuShmMemory`): the sender copies into its shared staging buffer and announces it on the
    IPC control keys, the receiver polls for the announcement and copies out. Half a ping-pong,
    like p2p."""
    import torch.distributed as dist
    from weights_sync.ipc import Control, CpuShmMemory, poll_until
    shm, mine = CpuShmMemory(x.device), torch.empty_like(x)
    handles: list = [None, None]
    dist.all_gather_object(handles, shm.export(mine))  # mine now lives in shared memory
    staging = [mine if r == rank else shm.open(h) for r, h in enumerate(handles)]  # rank r writes r
    ctl, count = Control(channel=f"calibrate-{x.numel()}"), [0]

    def hand_off(src: int) -> None:
        version = count[0]
        if rank == src:
            staging[src].copy_(x)
            ctl.publish_ready(src, 1 - src, version, 0)
        else:
            poll_until(lambda: ctl.take_ready(src, rank, version), time.monotonic() + timeout_s,
                       lambda: f"calibration: rank {src}'s shared-memory hand-off {version} of "
                               f"{x.numel() * 4} bytes did not arrive within {timeout_s:.0f} s")
            x.copy_(staging[src])

    def ping():
        count[0] += 1
        hand_off(0)
        hand_off(1)
    t = timed(ping, x.device, reps=9) / 2
    dist.barrier()  # both ranks are done with the buffers before they go
    return t


def gather_time(rank: int, world: int, wl: Workload) -> float:
    """Seconds of the colocated step's exchange of the batch's groups among `world` ranks, each
    giving its share (trainer/colocated.py's gather_groups): the median of 7, each after a
    barrier. 2026-11-30: colocated 4x1 spent 11-20 ms of its ~0.165 s step in it."""
    import torch.distributed as dist
    from trainer.colocated import gather_groups
    share = replace_wl(wl, max(1, -(-wl.prompts_per_step // world)))
    mine = [g.to_dict() for g in synthetic_groups(share, 64, seed=rank)]
    return statistics.median(wall_times(lambda: gather_groups(mine), 7, before=dist.barrier))


def _handoff_times(rank: int, wl: Workload, prompt_counts: list[int]) -> list:
    """[[prompts, s]]: a generator's work outside the decode loop for a batch of that many
    prompt groups, rank 0 generating for rank 1: score its samples in the generator's
    RewardRunner (exact_match), then ship the groups in one Link message until the trainer side
    has them (rollout/worker.py's _collect and _ship_scored, trainer/worker.py's _collect).
    Measured at one group and at the step's batch: a message has a fixed cost (the receive's
    hand-shake, store round trips), so half a batch costs more than half (2026-11-30: 2.0-2.3,
    3.8-4.3 and 5.6-7.6 ms for 1, 4 and 8 groups of 8)."""
    from rollout.data import PromptItem
    from rollout.rewards import RewardRunner, exact_match
    from trainer.batch import Group
    from trainer.link import Link, Msg
    link = Link(rank, [1 - rank], timeout_s=120)
    runner = RewardRunner(exact_match, timeout_s=60) if rank == 0 else None
    out = []
    for prompts in prompt_counts:
        part = replace_wl(wl, prompts)
        groups = [g.to_dict() for g in synthetic_groups(part, 64)]
        items = [PromptItem(i, "1+1=", None, "2") for i in range(part.seqs)]

        def batch():
            if rank == 0:
                runner.score_batch(items, ["2"] * len(items), [[5]] * len(items))
                link.send(1, Msg.TRAJECTORIES, 0, [Group.from_dict(d).to_dict() for d in groups])
                link.wait_for(Msg.ACK, "the calibration peer's receipt")
            else:
                [Group.from_dict(d) for d in link.wait_for(Msg.TRAJECTORIES, "calibration groups").payload]
                link.send(0, Msg.ACK, 0)
        out.append([prompts, timed(batch, reps=5, stat=statistics.median)])
    if runner is not None:
        runner.close()
    link.flush()
    link.close()
    return out


def _optimizer_step_time(model, tokens: int, device, reps: int = 15) -> float:
    """The gradient-norm clip + AdamW step, after one backward of `tokens` tokens: the median, not
    the undisturbed minimum, because a collective's time includes waiting for the peer to be
    scheduled, which is part of its real cost (with minima, the model missed FSDP layouts by
    up to -43% in bench/plan_vs_measured.py)."""
    from config import load_config
    from trainer.optim import build_optimizer, clip_grad_norm
    opt = build_optimizer(model, load_config(None, []).trainer)  # the trainer's own AdamW
    with torch.set_grad_enabled(True):  # leave gradients in place for the step
        logits = model(torch.zeros(tokens, dtype=torch.long, device=device),
                       seq_lens=torch.tensor([tokens], device=device))
        logits.float().sum().backward()
    params = list(model.parameters())
    return timed(lambda: (clip_grad_norm(params, 1.0), opt.step()), device, reps=reps,
                 stat=statistics.median)


def _paired_excess(sharded, plain, wl: Workload, device, mbt: int, dp_group, pairs: int = 7) -> tuple:
    """(median over `pairs` of (sharded step - plain step), micro-batches, tokens per micro-batch)
    of real train steps, `dp_group` the sharded model's data-parallel group (None: TP only):
    each pair runs back to back, so a change of machine speed between two blocks of repetitions
    cannot enter the difference (blocks of 5 gave per-collective costs of 1.1 or 1.9 ms from one
    calibration to the next; with 7 pairs the FSDP probe's per-collective cost still came out
    0.8-1.9 ms, so it takes 21, ~1.3 s). Every rank runs the plain step at the same time, each on
    its own core."""
    sharded_step, micro, tokens = train_step_fn(sharded, wl, device, mbt, dp_group)
    plain_step = train_step_fn(plain, wl, device, mbt)[0]
    times = _paired_times([sharded_step, plain_step], device, dp_group, pairs)
    return statistics.median(t[0] - t[1] for t in times), micro, tokens


def _paired_times(fns: list, device, group, pairs: int) -> list[list[float]]:
    """[[wall time of each of `fns`] per pair]: the calls of a pair back to back, each after a
    barrier of `group` (every rank runs the same calls), after one untimed warm-up pair."""
    import torch.distributed as dist
    out = []
    for i in range(pairs + 1):
        t = []
        for fn in fns:
            dist.barrier(group=group)
            t.append(timed(fn, device, reps=1, warmup=0))
        if i:
            out.append(t)
    return out


def _paired_decode_excess(sharded, plain, wl: Workload, device, group, pairs: int = 7) -> float:
    """A decode step's excess on the TP-sharded model over the plain one, one prompt group: the
    median over `pairs` of ((sharded - plain) at r2 tokens - (sharded - plain) at r1) / (r2 - r1),
    the four generations of a pair back to back, for the reason `_paired_excess` gives (two
    blocks of medians gave 2.8-3.6 ms per collective from one calibration to the next, and the
    generator-TP layouts followed it: bench/plan_vs_measured.py, 2026-11-30)."""
    from rollout.engine import Engine, Request, SamplingParams
    r1, r2 = 4, max(8, min(wl.response_len, 32))
    ids = torch.randint(3, plain.args.vocab_size, (wl.prompt_len,), generator=torch.Generator().manual_seed(0))

    def gen(model, r):
        eng = Engine(model, num_slots=wl.group_size, max_len=wl.prompt_len + r2 + 1, device=device)
        req = Request(0, ids.tolist(), SamplingParams(n=wl.group_size, max_new_tokens=r, ignore_eos=True))
        return lambda: eng.generate([req])
    times = _paired_times([gen(sharded, r2), gen(plain, r2), gen(sharded, r1), gen(plain, r1)],
                          device, group, pairs)
    return statistics.median(((s2 - p2) - (s1 - p1)) / (r2 - r1) for s2, p2, s1, p1 in times)


def replace_wl(wl: Workload, prompts: int) -> Workload:
    return dataclasses.replace(wl, prompts_per_step=prompts)


def two_rank_tp(args: ModelArgs) -> bool:
    """Whether the two ranks can run the model at TP 2 (the degrees the planner searches, which
    ParallelDims.check_model accepts): not with tied embeddings or heads that 2 does not divide;
    the planner then proposes no TP, and its TP costs are not measured."""
    from launch.plan import tp_degrees
    return 2 in tp_degrees(args, 2, one_host=True)


def comm_costs(args: ModelArgs, dtype, wl: Workload, mbt: int, threads: int) -> dict:
    """Spawn two ranks and return rank 0's measurements."""
    from parallel.spawn import run_ranks
    backend = "gloo" if not torch.cuda.is_available() else "cpu:gloo,cuda:nccl"
    args_d = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return run_ranks(_comm_rank, 2, args_d, str(dtype).removeprefix("torch."),
                     dataclasses.asdict(wl), mbt, two_rank_tp(args), timeout=600, threads=threads,
                     backend=backend)[0]


# ----- the whole profile ----------------------------------------------------------------------------------
def _local_block(model, wl: Workload, dev, counts, batches, r2: int, mbt: int) -> dict:
    """The single-process measurements: layers, decode, one real train_step."""
    out = {**layer_costs(model, dev, wl.seq_len, counts),
           **decode_costs(model, wl, dev, batches, max(2, r2 // 8), r2)}
    out["train_step"] = train_step_time(model, wl, dev, mbt)
    return out


def _min_block(a: dict, b: dict) -> dict:
    """Per quantity, the smaller of two blocks (taken apart in time: a burst of outside load
    rarely covers both)."""
    out = {k: [[x, min(ya, yb)] for (x, ya), (_, yb) in zip(a[k], b[k])] for k in a if k != "train_step"}
    out["train_step"] = min(a["train_step"], b["train_step"])
    return out


def measure(args: ModelArgs, wl: Workload, device: str = "cpu", threads: int = 1,
            micro_batch_tokens: int = 0, comm: bool = True, max_decode_tokens: int = 64,
            max_ranks: int = 4, log=print) -> Profile:
    """The whole profile. The single-process block runs twice, before and after the two-rank
    block, and each quantity keeps its minimum; the core-sharing rounds are split likewise."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    seq, cpu = wl.seq_len, dev.type == "cpu"
    step_tokens = wl.seqs * seq
    mbt = micro_batch_tokens or step_tokens
    counts = sorted({min(k * seq, max(mbt, seq)) for k in (1, 4, 16, 64)} | {min(mbt, step_tokens)})
    r2 = max(4, min(wl.response_len, max_decode_tokens))
    batches = sorted({wl.group_size, max(wl.group_size, wl.seqs // 4), wl.seqs})
    model = build(args, dev, dtype)
    t0 = time.perf_counter()
    conc = slowdown_curve(args, wl, mbt, max_ranks, rounds=2) if cpu else []
    first = _local_block(model, wl, dev, counts, batches, r2, mbt)
    log(f"  block 1: layers at {counts} tokens, decode at batches {batches}, train_step "
        f"({time.perf_counter() - t0:.1f}s)")
    c = None
    if comm and dev.type == "cuda" and torch.cuda.device_count() < 2:
        log("  two ranks: skipped (one GPU here: its ranks would measure the CPU's gloo links)")
        comm = False
    if comm:
        t0 = time.perf_counter()
        c = comm_costs(args, dtype, wl, mbt, threads)
        log(f"  two ranks: links, FSDP and TP overheads ({time.perf_counter() - t0:.1f}s)")
    t0 = time.perf_counter()
    if cpu:
        conc = _pool_concurrency(conc, slowdown_curve(args, wl, mbt, max_ranks, rounds=2))
        curve = [(k, round(v, 2), round(c, 2)) for k, v, c in conc]
        log(f"  cores: slowdown, phase cv of k busy ranks {curve}")
    four = pair_probes(args, wl, max_ranks, rounds=4) if cpu and comm else {}
    if four:
        log(f"  cores: slowdown of generator TP pairs decoding at once "
            f"{[(k, round(v, 2)) for k, v in four['tp_concurrency']]}")
    local = _min_block(first, _local_block(model, wl, dev, counts, batches, r2, mbt))
    log(f"  block 2 ({time.perf_counter() - t0:.1f}s)")
    (t_step, micro, mb_tok) = local.pop("train_step")
    prof = Profile(device=str(dev) if cpu else torch.cuda.get_device_name(dev),
                   dtype=str(dtype).removeprefix("torch."), threads=threads,
                   model=model_signature(args), **local, train_overhead=0.0,
                   p2p=[], allreduce=[], allgather=[], concurrency=conc,
                   tp_concurrency=four.get("tp_concurrency", []),
                   notes={"workload": dataclasses.asdict(wl), "micro_batch_tokens": mbt,
                          "torch": torch.__version__, "loadavg": os.getloadavg()[0]})
    prof.train_overhead = max(0.0, t_step - micro * prof.train_microbatch_s(mb_tok))
    prof.notes["train_step_s"] = t_step
    log(f"  train_step: {t_step * 1e3:.1f} ms ({micro} micro-batches of {mb_tok}), "
        f"overhead {prof.train_overhead * 1e3:.1f} ms; decode step at {batches[-1]}: "
        f"{prof.decode_step_s(batches[-1]) * 1e3:.2f} ms")
    if c is not None:
        prof.p2p, prof.allreduce, prof.allgather = c["p2p"], c["allreduce"], c["allgather"]
        prof.shm = c.get("shm", [])
        prof.coloc_gather = [c["gather"], *four.get("coloc_gather", [])]
        _collective_costs(prof, args, c)
        log(f"  comm: p2p {prof.p2p_gbps:.2f} GB/s"
            + (f", shared memory {prof.shm_s(16 << 20) * 1e3:.2f} ms per 16 MB" if prof.shm else "")
            + "; "
            f"per collective incl. DTensor: FSDP {prof.collective_s * 1e3:.2f} ms, TP "
            f"{prof.tp_collective_s * 1e3:.2f} ms, TP decode {prof.tp_decode_collective_s * 1e3:.2f} ms; generator hand-off "
            f"{prof.handoff_s(wl.prompts_per_step) * 1e3:.1f} ms per batch, "
            f"{prof.handoff_s(1) * 1e3:.1f} ms per group alone; per step (grad norm + AdamW on DTensors): FSDP "
            f"{prof.fsdp_step_s * 1e3:.1f} ms, TP {prof.tp_step_s * 1e3:.1f} ms")
    prof.notes["loadavg_end"] = os.getloadavg()[0]
    return prof


def _pool_concurrency(a: list, b: list) -> list:
    """Average two [[k, slowdown, cv]] curves (rounds taken apart in time); the slowdown is made
    non-decreasing in k: more busy ranks can never be faster."""
    out, prev = [], 1.0
    for (k, sa, ca), (_, sb, cb) in zip(a, b):
        prev = max(prev, (sa + sb) / 2)
        out.append([k, prev, (ca + cb) / 2])
    return out


def _collective_costs(prof: Profile, args: ModelArgs, c: dict) -> None:
    """Per-collective cost. FSDP: the real 2-rank train step's excess over one rank doing the
    same share, less the per-step excess of the gradient-norm clip and AdamW on DTensors, over
    the step's collectives (cost_model.trainer_collectives, the norm's reductions excluded): what a
    collective costs amid real micro-batches, waits for the peer included. TP likewise: the
    real 2-rank step of the whole batch against one rank's, plus the compute TP saves as the
    layer fits model it, less the per-step excess, over its collectives (2 per layer each way +
    4 per micro-batch, and the step's bookkeeping: trainer_collectives, the norm excluded). The
    probe before it, one short sequence's forward/backward, overpredicted the trainer-TP layouts
    by 3-15% at 2.9 ms per collective and by 24-36% once it came out 3.6
    (bench/plan_vs_measured.py, 2026-11-30). The per-step excesses are kept as they are."""
    from launch.cost_model import norm_reductions, trainer_collectives
    f = c["fsdp"]
    n = trainer_collectives(args, f["micro"], 2, 1, False, f["units"])["fsdp"] - norm_reductions(2, 1)
    prof.collective_s = max(0.0, (f["train_excess"] - max(0.0, f["step_excess"])) / max(n, 1))
    if "tp" in c:  # a model TP cannot shard (two_rank_tp) has no TP costs: the planner uses none
        # the real TP step's excess, plus the compute TP saves as the layer fits model it
        t = c["tp"]
        saved = t["micro"] * (prof.train_microbatch_s(t["tokens"]) - prof.train_microbatch_s(t["tokens"], 2))
        n = trainer_collectives(args, t["micro"], 1, 2, False)["tp"] - norm_reductions(1, 2)
        prof.tp_collective_s = max(0.0, (t["train_excess"] + saved - max(0.0, t["step_excess"])) / n)
        prof.tp_decode_collective_s = max(0.0, c["tp_decode_excess"] / (2 * args.num_layers + 2))
        prof.tp_step_s = max(0.0, t["step_excess"])
    prof.handoff = c["handoff"]
    prof.fsdp_step_s = max(0.0, c["fsdp"]["step_excess"])
    prof.notes["two_rank"] = {k: c[k] for k in ("fsdp", "tp", "tp_decode_excess", "handoff") if k in c}


def model_args_from(spec: str) -> ModelArgs:
    """An HF folder, or 'preset:<name>' / a bare preset name (see launch.plan.PRESETS)."""
    from launch.plan import resolve_model
    return resolve_model(spec)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests parse the README's commands with it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model folder or preset:<name>")
    ap.add_argument("--prompts", type=int_at_least(1), default=8, help="prompt groups per step")
    ap.add_argument("--group", type=int_at_least(1), default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int_at_least(1), default=8, help="prompt tokens")
    ap.add_argument("--response-len", type=int_at_least(1), default=24, help="response tokens per sample")
    ap.add_argument("--micro-batch-tokens", type=int_at_least(0), default=0, help="0 = one micro-batch per step")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where to measure: cuda or cpu (default: cuda where there is one)")
    ap.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads per rank")
    ap.add_argument("--no-comm", action="store_true", help="skip the 2-rank link measurements")
    ap.add_argument("--max-ranks", type=int_at_least(1), default=4, help="CPU: measure core sharing up to this")
    ap.add_argument("--out", default="profile.json",
                    help="the profile JSON to write (launch/plan.py --profile reads it)")
    return ap


def out_ready(path: str) -> None:
    """Make `--out`'s folder (as a run directory is made) and refuse a folder as the file."""
    out = Path(path)
    if out.is_dir():
        raise ValueError("is a folder; give the profile's file name, e.g. profile.json")
    out.parent.mkdir(parents=True, exist_ok=True)


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: this machine has no CUDA device; use --device cpu")
    try:
        args = model_args_from(a.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # before the minutes of measuring: a missing folder lost them at the end
        out_ready(a.out)
    except (OSError, ValueError) as e:
        print(f"error: --out {a.out}: {e}", file=sys.stderr)
        return 2
    wl = Workload(a.prompts, a.group, a.prompt_len, a.response_len)
    t0 = time.perf_counter()
    prof = measure(args, wl, a.device, a.threads, a.micro_batch_tokens, comm=not a.no_comm,
                   max_ranks=a.max_ranks)
    prof.save(a.out)
    print(f"wrote {a.out} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
