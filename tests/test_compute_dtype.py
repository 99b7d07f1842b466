"""The trainer's compute dtype (`model.compute_dtype`): fp32 parameters, gradients and optimizer
state, with the forward in bf16 -- by autocast on one FSDP rank, by FSDP's param dtype on several
-- and CPU attention in fp32, but for bf16 autocast's two batched bf16 matmuls
(parallel/sharding.py, trainer/step.py, model/attention.py)."""
import pytest
import torch

from parallel.sharding import compute_dtype
from tests import tiny
from tests.dist import run_ranks
from tests.test_parallel import _full, _step_setup

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("choice,device,params,expected", [
    ("auto", "cuda", FP32, BF16),       # GPUs train in bf16 whatever the FSDP degree
    ("auto", "cpu", FP32, FP32),        # CPUs in the parameters' dtype
    ("auto", "cpu", BF16, BF16),
    ("bfloat16", "cpu", FP32, BF16),
    ("float32", "cuda", FP32, FP32),
    ("float32", "cpu", BF16, BF16),     # never wider than the parameters
    ("auto", "cuda", torch.float16, torch.float16),  # nor a sideways cast
    ("bfloat16", "cpu", torch.float16, torch.float16),
])
def test_compute_dtype_choice(choice, device, params, expected):
    assert compute_dtype(choice, device, params) == expected


def test_compute_dtype_names_a_bad_choice():
    with pytest.raises(ValueError, match="compute_dtype='fp16'"):
        compute_dtype("fp16", "cpu", FP32)


def _qkv(dtype, seed=0, kv_heads=4):
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 9, 4, 16), (2, 9, kv_heads, 16), (2, 9, kv_heads, 16)]
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _attention_by_hand(q, k, v, keep_TS):
    """softmax(q k^T / sqrt(D) where kept) v in float64, kv heads repeated for grouped queries."""
    q, k, v = (x.detach().double() for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~keep_TS, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cpu_attention_runs_in_bf16_under_autocast_only(kv_heads):
    """Under bf16 autocast (fp32 inputs): the grouped matmul kernel in bf16, output in v's dtype,
    within bf16 rounding of the float64 attention by hand (and not fp32-exact), gradients within
    bf16 rounding of fp32 ones. bf16 inputs without autocast: PyTorch's SDPA in fp32 (as the bf16
    generator's fp32 cache attends), returned in bf16; fp32 inputs: exactly SDPA in fp32."""
    from model.attention import causal_mask, sdpa
    F = torch.nn.functional

    def exact(q, k, v):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                             is_causal=True, enable_gqa=kv_heads != 4)
        return out.transpose(1, 2)
    q32, k32, v32 = _qkv(FP32, kv_heads=kv_heads)
    window = causal_mask(torch.arange(9)[None], torch.arange(9)[None], 3)  # [1, 9, 9] keep-mask
    with torch.autocast("cpu", dtype=BF16):
        out = sdpa(q32, k32, v32, window, causal=True)
    err = (out.double() - _attention_by_hand(q32, k32, v32, window[0])).abs().max()
    assert out.dtype == FP32 and 1e-6 < err < 0.03  # rounded to bf16 on the way: not fp32 math
    assert torch.equal(sdpa(q32, k32, v32, None, causal=True), exact(q32, k32, v32))
    sdpa(q32, k32, v32, None, causal=True).sum().backward()
    ref_grads = [x.grad.clone() for x in (q32, k32, v32)]
    for x in (q32, k32, v32):
        x.grad = None
    with torch.autocast("cpu", dtype=BF16):
        sdpa(q32, k32, v32, None, causal=True).sum().backward()
    for x, r in zip((q32, k32, v32), ref_grads):
        assert (x.grad - r).abs().max() < 0.05 * r.abs().max()
    q, k, v = _qkv(BF16, kv_heads=kv_heads)
    out = sdpa(q, k, v, None, causal=True)
    ref = exact(*(x.detach().float() for x in (q, k, v))).to(BF16)
    assert out.dtype == BF16 and torch.equal(out, ref)
    out.float().sum().backward()
    assert all(x.grad.dtype == BF16 and x.grad.abs().sum() > 0 for x in (q, k, v))


def _step_worker(rank, world, folder, compute):
    """One train_step on `world` FSDP ranks with `compute`; records the dtypes q_proj sees."""
    from torch.distributed.device_mesh import init_device_mesh
    import parallel.sharding as sh
    from trainer.step import train_step
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    cfg, model, opt, sched, groups = _step_setup(
        folder, "model", lambda m: sh.parallelize_trainer(m, mesh, compute=compute))
    seen = []
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda mod, inp, out: seen.append(
        (str(mod.weight.dtype), str(out.dtype))))
    before = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    res = train_step(model, opt, sched, groups[rank::world], cfg,
                     mesh["fsdp"].get_group() if world > 1 else None, "cpu", 0)
    state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    return {"seen": seen, "autocast": str(model.autocast_dtype), "norm": res.grad_norm,
            "update": {n: _full(p.detach()) - before[n] for n, p in model.named_parameters()},
            "dtypes": sorted({str(p.dtype) for p in model.parameters()} | {str(t.dtype) for t in state})}


def _cosine(a: dict, b: dict) -> float:
    x = torch.cat([a[n].flatten() for n in sorted(a)])
    y = torch.cat([b[n].flatten() for n in sorted(b)])
    return float(x @ y / (x.norm() * y.norm()))


def test_bf16_compute_on_one_rank_autocasts_and_on_two_casts_parameters(tmp_path):
    """One rank: autocast (fp32 weights, bf16 outputs); two FSDP ranks: bf16 weights in the
    forward. Both keep fp32 parameters and AdamW state, and their update points the same way as
    the fp32 step's (bf16 rounding, not another computation)."""
    tiny.save_hf("llama3", tmp_path)
    fp32 = run_ranks(_step_worker, 1, str(tmp_path), "float32")[0]
    one = run_ranks(_step_worker, 1, str(tmp_path), "bfloat16")[0]
    two = run_ranks(_step_worker, 2, str(tmp_path), "bfloat16")[0]
    assert set(fp32["seen"]) == {("torch.float32", "torch.float32")} and fp32["autocast"] == "None"
    assert set(one["seen"]) == {("torch.float32", "torch.bfloat16")} and one["autocast"] == "torch.bfloat16"
    assert set(two["seen"]) == {("torch.bfloat16", "torch.bfloat16")} and two["autocast"] == "None"
    for res in (fp32, one, two):
        assert res["dtypes"] == ["torch.float32"]
    for res in (one, two):
        assert res["norm"] != fp32["norm"]  # really computed in bf16 ...
        assert res["norm"] == pytest.approx(fp32["norm"], rel=0.05)  # ... and still the same step
        assert _cosine(res["update"], fp32["update"]) > 0.99
