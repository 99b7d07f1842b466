"""One training step (forward + backward + AdamW step) of tandem's model vs `transformers`
LlamaForCausalLM, same shapes, same AdamW, same batch, same loss, in one run.

    python bench/train_step.py            # CPU: tiny Llama; ours fsdp=2 on 2 gloo ranks, ours and
                                          # HF on 1 process (the same weights: losses must agree)
    python bench/train_step.py --gpu      # + 1 GPU: 1.1B Llama shape, bf16, B=8 x 1024
    python bench/train_step.py --gpu --compile   # ours with torch.compile per decoder layer

Throughput is tokens/s over the median step. MFU = 6 * params * tokens / step time / peak, where
the peak is *measured in the same run* by a large matmul (fp32 on CPU, bf16 on GPU), because a CPU
has no meaningful datasheet figure; on GPU the 790 TFLOP/s measured before (REFERENCES.md, where
HF reached 52.8%) is reported alongside. Both sides compute the loss the same way: logits upcast to
fp32, summed cross entropy divided by the global token count (what the trainer does).
Ours takes plain [B, T] input by default; --packed feeds it the trainer's packed form
(`model(ids_N, seq_lens=...)`, trainer/batch.py), which without flash-attn attends sequence by
sequence (`model.attention.packed_groups`: one SDPA call per sequence length, gathered in and
out); HF always takes [B, T].
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch
import torch.nn.functional as F

from bench.common import (LLAMA_1B, matmul_peak_flops, median, mfu, print_json, run_ranks,
                          time_steps, train_flops)
from config import int_at_least
from model import ModelArgs

CPU_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=4,
                 num_heads=8, num_kv_heads=4, max_position_embeddings=512)
GPU_SHAPE = dict(LLAMA_1B, max_position_embeddings=2048)
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
REFERENCE_H200_PEAK = 790e12  # REFERENCES.md, measured bf16 matmul peak on the H200


def make_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    """[rows, seq + 1] token ids: inputs are [:, :-1], next-token targets [:, 1:]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, seq + 1), generator=g)


def loss_of(logits: torch.Tensor, targets: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Summed next-token CE in fp32 over the global token count (FSDP sums the gradients)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           reduction="sum") / total_tokens


def _step_fn(forward, opt, tgt, total_tokens):
    """One timed training step: forward -> summed CE / global tokens -> backward -> AdamW."""
    def step():
        loss = loss_of(forward(), tgt, total_tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.losses.append(loss.item())
    step.losses = []
    return step


def ours_step_fn(model, opt, ids, total_tokens, packed: bool):
    inp, tgt = ids[:, :-1], ids[:, 1:]
    seq_lens = torch.full((inp.shape[0],), inp.shape[1], device=ids.device)
    forward = (lambda: model(inp.reshape(-1), seq_lens=seq_lens)) if packed else (lambda: model(inp))
    return _step_fn(forward, opt, tgt, total_tokens)


def hf_step_fn(model, opt, ids, total_tokens):
    inp, tgt = ids[:, :-1], ids[:, 1:]
    return _step_fn(lambda: model(input_ids=inp, use_cache=False).logits, opt, tgt, total_tokens)


def hf_model(args: ModelArgs, device, dtype):
    """transformers' LlamaForCausalLM with the same config.json our model would write, SDPA."""
    import transformers
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(args.to_hf_config()))
        config = transformers.AutoConfig.from_pretrained(d)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=dtype)
    return model.train()


def summarise(name, times, tokens, params, peak, threads, extra=None) -> dict:
    step_s = median(times)
    rec = dict(step_s=round(step_s, 5), tokens_per_s=round(tokens / step_s, 1),
               mfu=round(mfu(train_flops(params, tokens), step_s, peak), 4), threads=threads,
               **(extra or {}))
    print(f"  {name:<28} {rec['step_s'] * 1e3:9.1f} ms/step  {rec['tokens_per_s']:10.0f} tok/s  "
          f"MFU {100 * rec['mfu']:5.1f}%  threads {threads}")
    return rec


# ----- CPU -------------------------------------------------------------------------------------
def _timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _cpu_worker(rank, world, shape, rows, seq, iters, warmup, threads, packed):
    """All three runs, interleaved step by step so that a shared, noisy CPU slows them alike:
    one fsdp step on both ranks (1 thread each), then rank 0 alone (rank 1 blocks, idle, in a
    barrier) runs one single-process step of ours and one of HF with `threads` threads."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from parallel.sharding import build_model, parallelize_trainer

    warnings.filterwarnings("ignore", message="DTensor random operators")  # init on a CPU mesh
    margs, tokens = ModelArgs(**shape), rows * seq
    ids = make_batch(shape["vocab_size"], rows, seq)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    sharded = build_model(margs, torch.device("cpu"), torch.float32, seed=0,
                          parallelize=lambda m: parallelize_trainer(m, mesh)).train()
    fsdp_step = ours_step_fn(sharded, torch.optim.AdamW(sharded.parameters(), **ADAMW),
                             ids.chunk(world)[rank], tokens, packed)  # this rank's rows
    out = {"fsdp": []}
    if rank == 0:
        torch.set_num_threads(threads)
        out["peak"] = matmul_peak_flops("cpu", torch.float32, n=1024)
        torch.set_num_threads(1)
        out["peak_1thread"] = matmul_peak_flops("cpu", torch.float32, n=1024)
        ours = build_model(margs, torch.device("cpu"), torch.float32, seed=0).train()
        hf = hf_model(margs, "cpu", torch.float32)
        hf.load_state_dict(ours.state_dict())  # same names (HF-named modules): the same weights
        single = {"ours": ours_step_fn(ours, torch.optim.AdamW(ours.parameters(), **ADAMW), ids,
                                       tokens, packed),
                  "hf": hf_step_fn(hf, torch.optim.AdamW(hf.parameters(), **ADAMW), ids, tokens)}
        out.update(ours=[], hf=[])
    for i in range(warmup + iters):
        dist.barrier()
        t = _timed(fsdp_step)
        dist.barrier()
        if rank == 0:
            torch.set_num_threads(threads)
            for name in (("ours", "hf") if i % 2 else ("hf", "ours")):  # alternate the order
                dt = _timed(single[name])
                if i >= warmup:
                    out[name].append(dt)
            torch.set_num_threads(1)
        if i >= warmup:
            out["fsdp"].append(t)
    if rank == 0:  # again at the end: a different figure means other work shared the CPU
        torch.set_num_threads(threads)
        out["peak_end"] = matmul_peak_flops("cpu", torch.float32, n=1024)
    out["loss_first"] = {"fsdp_rank_part": fsdp_step.losses[0]}
    if rank == 0:
        out["loss_first"].update(ours=single["ours"].losses[0], hf=single["hf"].losses[0])
    return out


def cpu_section(a) -> dict:
    shape, rows, seq = CPU_SHAPE, a.cpu_batch, a.cpu_seq
    params, tokens = ModelArgs(**shape).num_params(), rows * seq
    load_before = os.getloadavg()[0]
    print(f"CPU: Llama {params / 1e6:.2f}M params (hidden {shape['hidden_size']}, "
          f"{shape['num_layers']} layers, heads {shape['num_heads']}/{shape['num_kv_heads']}, "
          f"vocab {shape['vocab_size']}), batch {rows} x {seq} = {tokens} tokens, fp32, AdamW, "
          f"ours input: {'packed' if a.packed else 'plain [B, T]'}; load average before: "
          f"{load_before:.2f}")
    ranks = run_ranks(_cpu_worker, 2, shape, rows, seq, a.iters, a.warmup, a.cpu_threads,
                      a.packed, threads=1)
    r0, peak = ranks[0], ranks[0]["peak"]
    print(f"  fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s with {a.cpu_threads} threads "
          f"({r0['peak_1thread'] / 1e9:.1f} with 1); MFU below is against the "
          f"{a.cpu_threads}-thread peak. Steps interleaved; medians of {a.iters}")
    # n threads should nearly multiply the 1-thread peak, at the start and at the end alike
    lo = 0.75 * min(a.cpu_threads, os.cpu_count() or 1) * r0["peak_1thread"]
    quiet = min(peak, r0["peak_end"]) > lo
    if not quiet:
        print(f"  WARNING: the {a.cpu_threads}-thread matmul peak was {peak / 1e9:.1f} at the start "
              f"and {r0['peak_end'] / 1e9:.1f} GFLOP/s at the end: other processes shared the CPU, "
              f"these numbers are unreliable")
    loss = r0["loss_first"]
    ours_1p = summarise("ours, 1 process", r0["ours"], tokens, params, peak, a.cpu_threads,
                        {"loss_first": loss["ours"]})
    hf_1p = summarise("HF transformers, 1 process", r0["hf"], tokens, params, peak, a.cpu_threads,
                      {"loss_first": loss["hf"]})
    # a step ends when the slowest rank ends; the ranks start each step together (barrier)
    times = [max(ts) for ts in zip(*(r["fsdp"] for r in ranks))]
    ours_fsdp = summarise("ours, 2 ranks fsdp=2", times, tokens, params, peak, 2,
                          {"ranks": 2, "threads_per_rank": 1, "rows_per_rank": rows // 2})
    same = abs(loss["ours"] - loss["hf"]) < 1e-4
    print(f"  first-step loss ours {loss['ours']:.6f} vs HF {loss['hf']:.6f} "
          f"({'same' if same else 'DIFFERENT'} weights and batch)")
    vs_1p, vs_fsdp = (r["tokens_per_s"] / hf_1p["tokens_per_s"] for r in (ours_1p, ours_fsdp))
    print(f"  tokens/s relative to HF: ours 1 process {vs_1p:.3f}x, ours fsdp=2 {vs_fsdp:.3f}x; "
          f"load average after: {os.getloadavg()[0]:.2f}")
    return dict(params=params, tokens_per_step=tokens, batch=[rows, seq], dtype="float32",
                input="packed" if a.packed else "plain_BT", peak_flops=peak,
                peak_flops_1thread=r0["peak_1thread"], peak_flops_end=r0["peak_end"],
                cpu_quiet=quiet, ours_1proc=ours_1p, hf_1proc=hf_1p,
                ours_fsdp2=ours_fsdp, losses_match=same, speedup_ours_1proc_vs_hf=vs_1p,
                speedup_ours_fsdp2_vs_hf=vs_fsdp, loadavg_before=load_before,
                loadavg_after=os.getloadavg()[0])


# ----- GPU -------------------------------------------------------------------------------------
def gpu_section(a) -> dict:
    """1 device, bf16 parameters, gradients and AdamW state on both sides (what fits and runs
    fastest; fp32 master weights + autocast would add a weight cast per matmul on both sides)."""
    from parallel.sharding import apply_compile, build_model
    dev = torch.device(a.gpu_device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("GPU: skipped (no CUDA device)")
        return {"skipped": "no CUDA device"}
    dt = torch.bfloat16
    margs = ModelArgs(**(GPU_SHAPE if a.gpu_shape == "1.1b" else CPU_SHAPE), torch_dtype="bfloat16")
    rows, seq = a.gpu_batch, a.gpu_seq
    params, tokens = margs.num_params(), rows * seq
    name = torch.cuda.get_device_name(dev) if cuda else str(dev)
    # the CPU stand-in only exercises the code: a small matmul (bf16 on an AVX2 CPU runs ~1 GFLOP/s)
    peak = matmul_peak_flops(dev, dt, n=8192 if cuda else 256, iters=20 if cuda else 3)
    print(f"GPU section on {name}: Llama {params / 1e9:.3f}B params, batch {rows} x {seq} = "
          f"{tokens} tokens, bf16 parameters + grads + AdamW state (fused) on both sides")
    print(f"  bf16 matmul peak {peak / 1e12:.1f} TFLOP/s measured now; MFU below against it "
          f"(mfu_vs_790 in the JSON: against REFERENCES' {REFERENCE_H200_PEAK / 1e12:.0f})")
    ids = make_batch(margs.vocab_size, rows, seq).to(dev)
    ours = build_model(margs, dev, dt, seed=0).train()
    hf = hf_model(margs, dev, dt)
    hf.load_state_dict(ours.state_dict())  # same weights: the first losses must agree
    hf.cpu()  # each side alone on the device: its peak memory must not include the other model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    if a.compile:
        apply_compile(ours)  # the trainer's per-layer torch.compile (parallel.sharding)
    sides = (("ours" + (" (compiled layers)" if a.compile else ""), "ours", ours,
              lambda o: ours_step_fn(ours, o, ids, tokens, a.packed)),
             ("HF transformers (sdpa)", "hf", hf, lambda o: hf_step_fn(hf, o, ids, tokens)))
    results = {}
    for label, key, model, make in sides:
        model.to(dev)  # back from the CPU (HF): parameters move in place, the step's refs hold
        step = make(torch.optim.AdamW(model.parameters(), **ADAMW, fused=True))
        times = time_steps(step, a.iters, a.gpu_warmup, device=dev)
        results[key] = summarise(label, times, tokens, params, peak, torch.get_num_threads(), {
            "loss_first": step.losses[0],
            "mfu_vs_790": round(mfu(train_flops(params, tokens), median(times), REFERENCE_H200_PEAK), 4),
            "max_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if cuda else None})
        del step  # drops the optimizer state
        model.cpu()  # frees the device for the other side
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    ratio = results["ours"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    print(f"  first-step loss ours {results['ours']['loss_first']:.5f} vs HF "
          f"{results['hf']['loss_first']:.5f}; tokens/s relative to HF: ours {ratio:.3f}x")
    return dict(device=name, params=params, tokens_per_step=tokens, batch=[rows, seq],
                dtype="bfloat16 params, grads, AdamW state", compile=a.compile,
                input="packed" if a.packed else "plain_BT", peak_flops=peak,
                reference_peak_flops=REFERENCE_H200_PEAK, **results, speedup_ours_vs_hf=ratio)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="also run the 1.1B GPU section")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU section")
    ap.add_argument("--compile", action="store_true", help="GPU: torch.compile each decoder layer of ours")
    ap.add_argument("--packed", action="store_true", help="ours takes packed ids_N + seq_lens")
    ap.add_argument("--iters", type=int_at_least(1), default=10,
                    help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed CPU steps first")
    ap.add_argument("--gpu-warmup", type=int, default=3, help="untimed GPU steps first")
    ap.add_argument("--cpu-threads", type=int, default=2, help="threads of the 1-process runs")
    ap.add_argument("--cpu-batch", type=int_at_least(2), default=8,
                    help="rows of the CPU batch, an even number: fsdp=2 gives each rank half")
    ap.add_argument("--cpu-seq", type=int, default=256)
    ap.add_argument("--gpu-device", default="cuda", help="'cpu' runs the GPU section's code path "
                    "on the CPU (a smoke test, with --gpu-shape tiny)")
    ap.add_argument("--gpu-shape", default="1.1b", choices=["1.1b", "tiny"])
    ap.add_argument("--gpu-batch", type=int, default=8)
    ap.add_argument("--gpu-seq", type=int, default=1024)
    a = ap.parse_args(argv)
    if a.cpu_batch % 2:  # else rank 1 of the fsdp=2 run has no rows of its own (or fewer)
        ap.error(f"--cpu-batch {a.cpu_batch}: the fsdp=2 run splits the rows between its 2 "
                 "ranks; give an even number")
    record = {"bench": "train_step", "torch": torch.__version__}
    if not a.no_cpu:
        record["cpu"] = cpu_section(a)
    record["gpu"] = gpu_section(a) if a.gpu else {"skipped": "pass --gpu"}
    if not a.gpu:
        print("GPU: skipped (pass --gpu)")
    print_json(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
