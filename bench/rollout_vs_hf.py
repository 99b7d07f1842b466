"""Rollout throughput: tandem's Engine vs Hugging Face `generate`, same weights, same run.

CPU section (always): a ~3.4M-parameter random Llama (hidden 256, 4 layers, 8 heads / 4 kv,
vocab 4096), 64 prompts of 16-48 tokens (seeded), +64 sampled tokens each (temperature 1, no
top-k/top-p, EOS ignored). Ours: Engine(num_slots=64), with eager and with compiled decode
(`--cpu-modes`; the best is the headline). HF: one left-padded batch of all 64 prompts with an
attention mask, `generate(do_sample=True, use_cache=True)`. All are warmed up once, then timed
`--repeats` times alternately; the median is reported. The process pins glibc's malloc policy
first (`parallel.mesh.pin_malloc`): otherwise the two sides slow each other through its moving
mmap threshold (`--default-malloc` to see it).

GPU section (`--gpu`, only when CUDA is available): the 1.1B Llama shape of shared/REFERENCES.md
(hidden 2048, 16 layers, GQA 32/8, intermediate 8192, vocab 32000: 1.10B) in bf16, B=64, prompt 128,
+256 tokens. Ours in each of `--modes` (CUDA graph, compiled, attention kernels: see
`engines_by_mode`) vs HF generate with the default dynamic cache and with
`cache_implementation="static"`; `--profile` adds each variant's top kernels, kernels and kernel
time a decode step, the device's idle time (`device_timeline`), and the engine's host time by
phase with the device's stalls during each (`host_phases`).

    .venv/bin/python bench/rollout_vs_hf.py [--gpu] [--repeats 3]

Prints human-readable lines, then one JSON line (`{"bench": "rollout_vs_hf", ...}`) last.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
import time

from common import LLAMA_1B, hf_names, pin_malloc, print_json  # also puts the repo on sys.path

import torch  # noqa: E402
import transformers  # noqa: E402

from config import int_at_least  # noqa: E402
from model import load_pretrained  # noqa: E402
from model.args import ModelArgs  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from rollout.engine import Engine, Request, SamplingParams, decode_mode  # noqa: E402


def hf_llama(device: str, dtype: torch.dtype, **shape):
    cfg = transformers.LlamaConfig(eos_token_id=None, bos_token_id=None, pad_token_id=0,
                                   max_position_embeddings=2048, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def left_padded(prompts: list[list[int]], device: str):
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def run_ours(engine: Engine, prompts, new_tokens: int) -> int:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    done = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    return sum(len(c.completion_ids) for c in done)


DECODES, ATTENTIONS, FLAGS = ("eager", "cudagraph", "compile"), ("auto", "sdpa", "matmul", "flex"), \
    ("nostack", "qkvonly", "autotune", "sync64")


def parse_mode(mode: str) -> tuple[str, str, list[str]]:
    """`decode[:attention[:flag...]]` -> (decode, attention or "", flags)."""
    decode, attention, *flags = mode.split(":") + [""]
    return decode, attention, [f for f in flags if f]


def valid_mode(mode: str) -> bool:
    decode, attention, flags = parse_mode(mode)
    return decode in DECODES and attention in ("", *ATTENTIONS) and set(flags) <= set(FLAGS)


def engines_by_mode(model, modes, device: str, num_slots: int, max_len: int) -> dict:
    """One engine per decode mode, keyed `ours_<mode>`. A mode is `decode[:attention[:flag]]`:
    decode of eager, cudagraph, compile; the attention kernel over the cache (Engine's
    `decode_attention`, default auto); flag `nostack`: one matmul a projection (Engine's
    stack_weights=False), `qkvonly`: q|k|v stacked, gate and up two matmuls, `autotune`: compiled
    with inductor's GEMM autotuning (`gpu_section`), `sync64`: the finished flags read every 64
    steps, not 8 (Engine's sync_every; every completion here ends at the same step, a multiple
    of 64, so the tokens are the same and only the device's waits for the host differ)."""
    engines = {}
    for m in modes:  # "autotune" is the bench's (gpu_section), not the engine's
        decode, attention, flags = parse_mode(m)
        stacks = False if "nostack" in flags else "qkv" if "qkvonly" in flags else None
        engines["ours_" + m.replace(":", "_").rstrip("_")] = Engine(
            model, num_slots=num_slots, max_len=max_len,
            compile_decode=decode_mode(decode, torch.device(device)),
            decode_attention=attention or "auto", stack_weights=stacks,
            sync_every=64 if "sync64" in flags else None)
    return engines


def autotuned(fn):
    """`fn` whose first call (the warm-up, which compiles) runs with inductor's GEMM autotuning
    on (Triton templates timed against cuBLAS for each matmul shape). Dynamo's cache is dropped
    before it: an engine otherwise reuses the code compiled for an earlier engine of the same
    kernels (seen on the H200: the autotune variant "warmed up" in 0.5 s). The engines timed
    before it keep their captured graphs, which cover every cache-length bucket after their
    warm-up run."""
    import torch._inductor.config as inductor_config
    first = [True]

    def call():
        if not first[0]:
            return fn()
        first[0] = False
        torch._dynamo.reset()
        with inductor_config.patch(max_autotune_gemm=True):
            return fn()
    return call


def run_hf(model, ids, mask, new_tokens: int, **kw) -> int:
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, use_cache=True, pad_token_id=0, **kw)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def measure(fns: dict, device: str, repeats: int, results: dict, sequential: bool = False) -> None:
    """Warm each up once, then time them alternately `repeats` times, so that a busy machine
    hits all alike; or, `sequential`, each in turn, its result printed at once (a run cut short
    keeps the finished ones). Reports the median and the best (least disturbed) run. A variant
    whose warm-up raises is reported as failed and left out."""
    times: dict = {}
    tokens: dict = {}

    def warm(k, f) -> bool:
        t = time.perf_counter()
        try:
            f()  # warm-up (and compile / capture)
        except Exception as e:  # noqa: BLE001 -- a failed variant must not lose the others
            print(f"  {k}: FAILED in warm-up: {type(e).__name__}: {str(e)[:300]}", flush=True)
            results[k] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
            return False
        print(f"  {k}: warmed up in {time.perf_counter() - t:.1f} s", flush=True)
        times[k] = []
        return True

    def time_once(k) -> None:
        holder: dict = {}
        times[k].append(timed(lambda: holder.setdefault("n", fns[k]()), device))
        tokens[k] = holder["n"]

    def report(k) -> None:
        med, best = statistics.median(times[k]), min(times[k])
        results[k] = {"tok_per_s": round(tokens[k] / med, 1),
                      "tok_per_s_best": round(tokens[k] / best, 1),
                      "seconds": round(med, 4), "new_tokens": tokens[k],
                      "all_seconds": [round(t, 4) for t in times[k]]}
        print(f"  {k:<18} {tokens[k] / med:9.1f} new tok/s median, {tokens[k] / best:9.1f} best "
              f"({med:.3f} s median of {repeats})", flush=True)

    if sequential:
        for k, f in fns.items():
            if warm(k, f):
                for _ in range(repeats):
                    time_once(k)
                report(k)
        return
    ok = [k for k, f in fns.items() if warm(k, f)]
    for _ in range(repeats):
        for k in ok:
            time_once(k)
    for k in ok:
        report(k)


def profile_run(fn, device: str, label: str, top: int = 25, steps=None) -> dict:
    """One warm run of `fn` under torch.profiler: the `top` kernels (CUDA) or ops (CPU) by total
    device time, with their call counts, so that a decode step's time can be attributed; with
    `steps` (a callable: the decode steps taken so far) also the kernels and kernel time per
    decode step of that run."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    steps_before = steps() if steps else 0
    with profile(activities=acts) as prof:
        fn()
    key = "device_time_total" if device == "cuda" else "cpu_time_total"
    rows = sorted((e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)),
                  key=lambda e: getattr(e, key), reverse=True)  # labels repeat their ops' time
    if device == "cuda":  # kernels only: a host op's row repeats its kernels' time (aten::mm)
        rows = [e for e in rows if _kernel(e)] or rows
    out = [{"name": e.key[:90], "calls": e.count, "ms": round(getattr(e, key) / 1e3, 3)}
           for e in rows[:top]]
    total = sum(getattr(e, key) for e in rows) / 1e3
    print(f"  profile of one {label} run, top {top} by {key} (of {total:.1f} ms summed):")
    for r in out:
        print(f"    {r['ms']:9.3f} ms {r['calls']:7d} x  {r['name']}")
    res = {"top": out, "ms": round(total, 3)}
    if steps:
        steps = steps() - steps_before
        calls = sum(e.count for e in rows)
        res.update(kernels_per_step=round(calls / steps, 1), ms_per_step=round(total / steps, 4))
        print(f"  {label}: {steps} decode steps, {calls / steps:.1f} kernels and "
              f"{total / steps:.3f} ms of kernel time a step (prefill included)")
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events if _kernel(e)]
    phases = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith(PHASE) and e.device_type.name == "CPU"]
    if spans:
        res["timeline"] = device_timeline(spans)
        t = res["timeline"]
        print(f"  {label}: device busy {t['busy_ms']} of {t['span_ms']} ms; idle {t['idle_ms']} ms "
              f"of which {t['stall_ms']} ms in {t['stalls']} gaps of >= {STALL_US} us (waiting "
              f"for the host), the rest between kernels")
    if phases:
        res["host"] = host_phases(phases, spans)
        print(f"  {label}: host time by engine phase, and the device's stalls while the host was "
              f"in it (ms): " + ", ".join(f"{k} {v['host_ms']} ({v['calls']}x), stalled "
                                          f"{v['stall_ms']}" for k, v in res["host"].items()))
    return res


def _kernel(e) -> bool:
    """A device event that is not a label's device-side range (which spans the label's kernels
    and the gaps between them: `engine_phases`'s labels have one on CUDA)."""
    return e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)


PHASE = "engine."  # the record_function labels `engine_phases` puts on the engine's methods
PHASE_METHODS = ("_harvest", "_prefill", "_copy_prefixes", "_start_samples", "_decode")


@contextlib.contextmanager
def engine_phases(engine: Engine):
    """Label the engine's phases (harvest, prefill, prefix copies, first tokens, decode step) for
    the profiler while the block runs, so that the device's stalls can be put on the host work
    they waited for (`host_phases`); the engine itself carries no labels (its hot path)."""
    from torch.profiler import record_function

    def labelled(name, fn):
        @functools.wraps(fn)
        def call(*a, **kw):
            with record_function(PHASE + name.lstrip("_")):
                return fn(*a, **kw)
        return call
    for name in PHASE_METHODS:
        setattr(engine, name, labelled(name, getattr(engine, name)))
    try:
        yield
    finally:
        for name in PHASE_METHODS:
            delattr(engine, name)  # the class's methods again


def host_phases(phases: list[tuple[str, float, float]], spans: list[tuple[float, float]]) -> dict:
    """Per labelled host phase (name, start, end in us; phases do not nest): its calls and host
    time, and how much of the device's stalls (gaps of >= STALL_US between kernel spans) fell
    while the host was in it; the stalls outside every phase are "other" (the engine's Python
    between phases, the bench's loop)."""
    out: dict = {}
    for name, a, b in phases:
        row = out.setdefault(name[len(PHASE):], {"calls": 0, "host_ms": 0.0, "stall_ms": 0.0})
        row["calls"] += 1
        row["host_ms"] += (b - a) / 1e3
    gaps = [(a, b) for a, b in idle_gaps(spans) if b - a >= STALL_US] if spans else []
    outside = sum(g1 - g0 for g0, g1 in gaps)
    for name, a, b in phases:
        hit = sum(max(0.0, min(b, g1) - max(a, g0)) for g0, g1 in gaps)
        out[name[len(PHASE):]]["stall_ms"] += hit / 1e3
        outside -= hit
    if gaps:
        out["other"] = {"calls": 0, "host_ms": 0.0, "stall_ms": outside / 1e3}
    return {k: {f: round(v, 3) for f, v in row.items()} for k, row in out.items()}


STALL_US = 50  # a gap between kernels this long is the host, not the device's launch latency


def idle_gaps(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (start, end) gaps between kernel (start, end) spans, overlapping spans merged."""
    gaps, end = [], None
    for a, b in sorted(spans):
        if end is not None and a > end:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    return gaps


def device_timeline(spans: list[tuple[float, float]]) -> dict:
    """Busy and idle time of the device over kernel (start, end) spans in us: idle time in the
    gaps of at least STALL_US (the device waited for the host) and in the shorter ones."""
    gaps = idle_gaps(spans)
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    idle = sum(b - a for a, b in gaps)
    stalls = [b - a for a, b in gaps if b - a >= STALL_US]
    r3 = lambda us: round(us / 1e3, 3)  # noqa: E731
    return {"span_ms": r3(span), "busy_ms": r3(span - idle), "idle_ms": r3(idle),
            "stall_ms": r3(sum(stalls)), "stalls": len(stalls)}


def cpu_section(repeats: int, modes: tuple = ("eager", "compile")) -> dict:
    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    hf = hf_llama("cpu", torch.float32, **shape)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(d, dtype="float32").eval()
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(16, 49, (64,), generator=gen).tolist()
    prompts = [torch.randint(1, 4096, (n,), generator=gen).tolist() for n in lens]
    new = 64
    engines = engines_by_mode(ours, modes, "cpu", 64, max(lens) + new)
    ids, mask = left_padded(prompts, "cpu")
    params = sum(p.numel() for p in ours.parameters())
    print(f"CPU: {params / 1e6:.2f}M-param Llama, 64 prompts of {min(lens)}-{max(lens)} tokens, "
          f"+{new} sampled tokens, {torch.get_num_threads()} threads; ours: {', '.join(modes)} "
          "decode (compile: its compilation is in the warm-up)")
    res: dict = {"params": params, "threads": torch.get_num_threads()}
    fns = {k: lambda e=e: run_ours(e, prompts, new) for k, e in engines.items()}
    fns["hf_dynamic_cache"] = lambda: run_hf(hf, ids, mask, new)
    measure(fns, "cpu", repeats, res)
    timed = [k for k in engines if "tok_per_s" in res[k]]  # a failed variant is reported, skipped
    if not timed or "tok_per_s" not in res["hf_dynamic_cache"]:
        print("  no speedup: HF or every variant of ours failed (above)")
        return res
    for k in timed:
        for name, stat in (("speedup", "tok_per_s"), ("speedup_best", "tok_per_s_best")):
            res[k][name] = round(res[k][stat] / res["hf_dynamic_cache"][stat], 2)
        print(f"  speedup {k} / HF: {res[k]['speedup']:.2f}x median, "
              f"{res[k]['speedup_best']:.2f}x best")
        print(f"  {k}: engine stats (all runs) {engines[k].stats}; packed linears, the engine's "
              f"timed choice: {engines[k].pack_trial}")
        res[k]["pack_trial"] = engines[k].pack_trial
    best = max(timed, key=lambda k: res[k]["tok_per_s"])
    res.update(best=best, speedup=res[best]["speedup"], speedup_best=res[best]["speedup_best"])
    print(f"  speedup ours (best: {best}) / HF: {res['speedup']:.2f}x median")
    return res


GPU_SHAPE = hf_names(LLAMA_1B)


def gpu_section(repeats: int, device: str = "cuda", shape: dict = GPU_SHAPE, B: int = 64,
                P: int = 128, new: int = 256, hf_static: bool = True,
                modes: tuple = ("eager", "cudagraph"), profile: bool = False) -> dict:
    """(device/shape/sizes are parameters only so that the code path can be dry-run on CPU.)"""
    hf = hf_llama(device, torch.bfloat16, **shape)
    args = ModelArgs.from_hf_config(hf.config.to_dict())
    with torch.device("meta"):
        ours = Transformer(args).to(torch.bfloat16)
    ours.to_empty(device=device)
    ours.load_state_dict(hf.state_dict())
    ours.tie_weights()
    ours.eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, shape["vocab_size"], (P,), generator=gen).tolist() for _ in range(B)]
    ids, mask = left_padded(prompts, device)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"GPU ({name}): {args.num_params() / 1e9:.2f}B Llama shape bf16, B={B}, prompt {P}, +{new}")
    res: dict = {"device": name}
    engines = engines_by_mode(ours, modes if device == "cuda" else ("eager",), device, B, P + new)
    fns = {"hf_dynamic_cache": lambda: run_hf(hf, ids, mask, new)}  # first: timed in any case
    if hf_static:  # transformers compiles the forward for a static cache: ~1 min more
        fns["hf_static_cache"] = lambda: run_hf(hf, ids, mask, new, cache_implementation="static")
    fns.update({k: functools.partial(run_ours, e, prompts, new) for k, e in engines.items()})
    for k in [k for k in fns if k.endswith("_autotune")]:  # compiled at its first (warm-up) run
        fns[k] = autotuned(fns[k])
    measure(fns, device, repeats, res, sequential=device == "cuda")
    timed_ok = {k: v["tok_per_s"] for k, v in res.items() if "tok_per_s" in v}
    best_hf = max((v for k, v in timed_ok.items() if k.startswith("hf_")), default=None)
    ours_best = max((v for k, v in timed_ok.items() if k.startswith("ours")), default=None)
    if best_hf and ours_best:  # else a side failed: reported above, the rest is still printed
        res["speedup_vs_best_hf"] = round(ours_best / best_hf, 2)
        print(f"  speedup best ours / best HF: {res['speedup_vs_best_hf']:.2f}x")
    if profile:  # a diagnostic: a failure here must not lose the measurements above
        res["profile"] = {}
        for k, e in engines.items():
            if "failed" in res[k]:
                continue
            try:
                with engine_phases(e):
                    res["profile"][k] = profile_run(fns[k], device, k,
                                                    steps=lambda e=e: e.stats.decode_steps)
            except Exception as err:  # noqa: BLE001
                print(f"  profile failed: {type(err).__name__}: {err}")
                res["profile"][k] = f"failed: {type(err).__name__}: {err}"
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="also run the 1.1B GPU section")
    ap.add_argument("--repeats", type=int_at_least(1), default=3,
                    help="timed runs of each variant after its warm-up (the median is reported)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU section")
    ap.add_argument("--no-hf-static", action="store_true",
                    help="GPU: leave out HF's static-cache generate (it compiles, ~1 min)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU: also profile one run of each of --modes (top kernels, kernels a "
                         "step, device idle time)")
    ap.add_argument("--modes", default="eager,cudagraph",
                    help="GPU: our decode variants, each decode[:attention[:flag]]: decode of "
                         "eager, cudagraph, compile (torch.compile + CUDA graph); attention of "
                         "auto, sdpa, matmul, flex (compile only); flag nostack: one matmul a "
                         "projection, qkvonly: q|k|v stacked, gate and up not, autotune: inductor's "
                         "GEMM autotuning, sync64: the finished flags read every 64 steps")
    ap.add_argument("--cpu-modes", default="eager,compile",
                    help="CPU: our decode variants, of eager and compile (torch.compile of the "
                         "decode step; ~30-40 s of compilation in the warm-up)")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc's malloc policy as it is (see the module docstring)")
    a = ap.parse_args(argv)
    for flag, modes in (("--modes", a.modes), ("--cpu-modes", a.cpu_modes)):
        bad = [m for m in modes.split(",") if m and not valid_mode(m)]
        if bad:
            ap.error(f"{flag}: {bad}; each is decode[:attention[:flag]] with decode of "
                     f"{DECODES}, attention of {ATTENTIONS} and flags of {FLAGS}")
    out = {"bench": "rollout_vs_hf",
           "fixed_malloc": False if a.default_malloc else pin_malloc()}
    if not a.no_cpu:
        out["cpu"] = cpu_section(a.repeats, tuple(m for m in a.cpu_modes.split(",") if m))
    if a.gpu:
        if torch.cuda.is_available():
            with torch.no_grad():
                out["gpu"] = gpu_section(a.repeats, hf_static=not a.no_hf_static,
                                         modes=tuple(m for m in a.modes.split(",") if m),
                                         profile=a.profile)
        else:
            print("GPU section skipped: CUDA is not available")
            out["gpu"] = "skipped: no CUDA"
    print_json(out)


if __name__ == "__main__":
    main()
