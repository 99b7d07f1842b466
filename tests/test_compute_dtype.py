"""The trainer's compute dtype (`model.compute_dtype`): fp32 parameters, gradients and optimizer
state, with the forward in bf16 -- by autocast on one FSDP rank, by FSDP's param dtype on several
-- and CPU attention kept in fp32 either way (parallel/sharding.py, trainer/step.py,
model/attention.py)."""
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


def _qkv(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 9, 4, 16, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def test_cpu_sdpa_computes_in_fp32_and_returns_v_dtype():
    from model.attention import sdpa
    q, k, v = _qkv(BF16)
    out = sdpa(q, k, v, None, causal=True)
    ref = sdpa(*(x.detach().float() for x in (q, k, v)), None, causal=True).to(BF16)
    assert out.dtype == BF16 and torch.equal(out, ref)
    out.float().sum().backward()
    assert q.grad.dtype == BF16 and q.grad.abs().sum() > 0
    # under CPU autocast: fp32 in, fp32 math (autocast would have run SDPA in bf16)
    q32, k32, v32 = _qkv(FP32)
    with torch.autocast("cpu", dtype=BF16):
        out = sdpa(q32, k32, v32, None, causal=True)
    assert out.dtype == FP32 and torch.equal(out, sdpa(q32, k32, v32, None, causal=True))


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
