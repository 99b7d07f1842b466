"""oneDNN-prepacked linears (rollout/packed_linear.py) against the plain modules they stand in for,
and the engine with and without them."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model import load_pretrained
from model.args import ModelArgs
from model.transformer import Transformer
from rollout import packed_linear
from rollout.engine import Engine, Request, SamplingParams
from rollout.packed_linear import PackedLinears
from tests import tiny

pytestmark = pytest.mark.skipif(not packed_linear.available(),
                                reason="this torch build has no oneDNN packed linear kernels")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) with tied embeddings made explicit below."""
    path = tmp_path_factory.mktemp("qwen2")
    tiny.save_hf("qwen2", path)
    return load_pretrained(path, dtype="float32").eval()


def test_forward_matches_plain_linears_and_leaves_modules_alone(model):
    ids = torch.randint(0, tiny.VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    packed = PackedLinears(model, min_numel=0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(packed.modules) == len(linears) > 0
    with torch.no_grad():
        ref = model(ids)
        with packed.active(), torch.profiler.profile() as prof:
            assert all("forward" in vars(m) for m in linears)
            got = model(ids)
    calls = {e.key: e.count for e in prof.key_averages()}
    # oneDNN really ran: one call per single linear and one per group of siblings (q|k|v, gate|up)
    assert [len(g) for g in packed.groups] == [3, 2] * model.args.num_layers
    assert calls.get("mkldnn::_linear_pointwise") == len(packed.singles) + len(packed.groups)
    assert "aten::linear" not in calls
    assert (got - ref).abs().max() <= 1e-5
    assert all("forward" not in vars(m) for m in linears)  # back to nn.Linear.forward
    model(ids).sum().backward()  # autograd outside the block, as a trainer needs
    assert all(m.weight.grad is not None for m in linears)
    model.zero_grad(set_to_none=True)


def test_repacks_only_changed_weights(model):
    packed = PackedLinears(model, min_numel=0)
    lin = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, lin.in_features)
    with torch.no_grad():
        with packed.active():
            lin(x)
        first = packed.repacks
        assert first == len(packed.singles) + len(packed.groups)  # one packed copy per weight or stack
        with packed.active():
            lin(x)
        assert packed.repacks == first  # unchanged weights are reused
        lin.weight.mul_(2.0)  # an in-place update, as a weight swap does
        with packed.active():
            got = lin(x)
        assert packed.repacks == first + 1
        assert torch.allclose(got, F.linear(x, lin.weight), atol=1e-5)
        lin.weight.div_(2.0)


def test_siblings_called_in_any_order_or_on_other_inputs(model):
    """A group's shared call serves its members on one input; a member called again, out of
    order, or on another tensor still gets its own linear of its own input."""
    packed = PackedLinears(model, min_numel=0)
    attn = model.model.layers[1].self_attn
    x, y = torch.randn(2, 3, attn.q_proj.in_features), torch.randn(4, attn.q_proj.in_features)
    calls = [(attn.v_proj, x), (attn.q_proj, y), (attn.k_proj, x), (attn.q_proj, x),
             (attn.v_proj, x), (attn.k_proj, y), (attn.v_proj, y)]
    with torch.no_grad():
        want = [F.linear(inp, m.weight, m.bias) for m, inp in calls]
        with packed.active():
            got = [m(inp) for m, inp in calls]
    for a, b in zip(got, want):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5


def test_changed_bias_repacks_its_group(model):
    packed = PackedLinears(model, min_numel=0)
    attn = model.model.layers[0].self_attn
    x = torch.randn(5, attn.k_proj.in_features)
    with torch.no_grad():
        with packed.active():
            attn.k_proj(x)
        first = packed.repacks
        attn.k_proj.bias.add_(1.0)
        with packed.active():
            got = attn.k_proj(x)
        assert packed.repacks == first + 1  # the q|k|v stack, bias included, packed again
        assert (got - F.linear(x, attn.k_proj.weight, attn.k_proj.bias)).abs().max() <= 1e-5
        attn.k_proj.bias.sub_(1.0)


def test_tied_weight_is_packed_once():
    m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    m[1].weight = m[0].weight
    packed = PackedLinears(m, min_numel=0)
    with torch.no_grad(), packed.active():
        m(torch.randn(2, 8))
    assert packed.repacks == 1


BF16_PACKS = torch.bfloat16 in packed_linear.packed_dtypes()


def test_refuses_grad_and_skips_other_dtypes():
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16),
                      nn.Linear(8, 8).to(torch.float16))
    packed = PackedLinears(m, min_numel=0)
    # fp32 weights are packed, bf16 ones where this CPU has oneDNN's bf16 kernels, fp16 never
    assert packed.modules == [m[0], m[1]] if BF16_PACKS else packed.modules == [m[0]]
    with packed.active(), pytest.raises(RuntimeError, match="no_grad"):
        m[0](torch.randn(2, 8))
    if BF16_PACKS:
        with torch.no_grad(), packed.active(), pytest.raises(RuntimeError,
                                                             match="bfloat16 inputs only"):
            m[1](torch.randn(2, 8))  # an fp32 input to a bf16 weight


def test_bf16_left_plain_where_onednn_cannot_pack_it(tmp_path, monkeypatch):
    """On a CPU without oneDNN's bf16 kernels (AVX2 only: packing a bf16 weight raises there) a
    bf16 model is not packed: the automatic choice keeps MKL, pack_weights=True says why."""
    monkeypatch.setattr(packed_linear, "packed_dtypes", lambda: (torch.float32,))
    tiny.save_hf("qwen2", tmp_path)
    model = load_pretrained(tmp_path, dtype="bfloat16").eval()
    assert PackedLinears(model, min_numel=0).modules == []
    engine = Engine(model, num_slots=2, max_len=16)
    assert engine.packed_weights is None and engine.pack_trial is None
    sp = SamplingParams(max_new_tokens=4, seed=1, ignore_eos=True)
    assert len(engine.generate([Request(0, [1, 5, 7], sp)])[0].completion_ids) == 4
    with pytest.raises(ValueError, match=r"no linear of this torch.bfloat16 model can be packed"):
        Engine(model, num_slots=2, max_len=16, pack_weights=True)


@pytest.mark.skipif(not BF16_PACKS, reason="this CPU has no oneDNN bf16 kernels (AVX2 only)")
def test_bf16_model_forward_and_engine_match_unpacked(tmp_path):
    """bf16 weights packed (stacked siblings too): the forward within bf16 rounding of the plain
    one, and the engine's sampled tokens and log-probs alike with and without packing."""
    tiny.save_hf("qwen2", tmp_path)
    model = load_pretrained(tmp_path, dtype="bfloat16").eval()
    packed = PackedLinears(model, min_numel=0)
    assert [len(g) for g in packed.groups] == [3, 2] * model.args.num_layers
    ids = torch.randint(0, tiny.VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).float()
        with packed.active(), torch.profiler.profile() as prof:
            got = model(ids).float()
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("mkldnn::_linear_pointwise") == len(packed.singles) + len(packed.groups)
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()  # bitwise equal on the AMX Xeon
    sp = SamplingParams(max_new_tokens=8, temperature=0.7, seed=5, ignore_eos=True)
    reqs = [Request(i, [1 + i, 5, 7, 2 + i], sp) for i in range(3)]
    out = {pack: Engine(model, num_slots=3, max_len=16, pack_weights=pack).generate(reqs)
           for pack in (False, True)}
    same = sum(a.completion_ids == b.completion_ids for a, b in zip(out[True], out[False]))
    assert same >= 2  # bf16 rounding may flip a near-tie draw, not whole batches
    for a, b in zip(out[True], out[False]):
        n = next((i for i, (x, y) in enumerate(zip(a.completion_ids, b.completion_ids)) if x != y),
                 len(a.completion_ids))
        assert n == 0 or max(abs(x - y) for x, y in zip(a.logp[:n], b.logp[:n])) <= 0.05


def test_engine_same_tokens_and_logp_with_and_without_packing(model):
    sp = SamplingParams(max_new_tokens=8, temperature=0.7, seed=5, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    reqs = [Request(i, torch.randint(0, tiny.VOCAB, (n,), generator=g).tolist(), sp)
            for i, n in enumerate([4, 9, 2, 13])]
    out = {}
    for pack in (False, True):
        engine = Engine(model, num_slots=3, max_len=32, pack_weights=pack)
        assert (engine.packed_weights is not None) == pack
        out[pack] = engine.generate(reqs)
    assert [len(c.completion_ids) for c in out[False]] == [8] * 4
    assert [c.completion_ids for c in out[True]] == [c.completion_ids for c in out[False]]
    for a, b in zip(out[True], out[False]):
        assert max(abs(x - y) for x, y in zip(a.logp, b.logp)) <= 1e-5
    with pytest.raises(ValueError, match="pack_weights=True needs an eager CPU engine"):
        Engine(model, num_slots=2, max_len=8, pack_weights=True, compile_decode=True)


def test_weights_written_through_data_are_repacked_on_a_version_change(tmp_path):
    """Weight sync writes through `.data` (no version-counter bump): setting the engine's version,
    directly (colocated) or through load_weights, must repack, or mu would come from old weights."""
    tiny.save_hf("llama3", tmp_path / "a", seed=0)
    tiny.save_hf("llama3", tmp_path / "b", seed=1)
    model = load_pretrained(tmp_path / "a", dtype="float32").eval()
    new = load_pretrained(tmp_path / "b", dtype="float32").eval()
    sp = SamplingParams(max_new_tokens=6, temperature=0.9, seed=2, ignore_eos=True)
    reqs = [Request(i, [3 + i, 7, 11 + i], sp) for i in range(3)]
    want = Engine(new, num_slots=3, max_len=16, pack_weights=False).generate(reqs)
    assert [len(c.completion_ids) for c in want] == [6] * 3

    def write_new():
        for p, q in zip(model.parameters(), new.parameters()):
            p.data.copy_(q.data)

    for swap in ("version", "load_weights"):
        engine = Engine(model, num_slots=3, max_len=16, pack_weights=True)
        engine.generate(reqs)  # packs the old weights
        if swap == "version":
            write_new()
            engine.version = 1
        else:
            engine.load_weights(write_new, 1)
        got = engine.generate(reqs)
        assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
        for a, b in zip(got, want):
            assert a.token_versions == [1] * 6
            assert max(abs(x - y) for x, y in zip(a.logp, b.logp)) <= 1e-5
        model.load_state_dict(load_pretrained(tmp_path / "a", dtype="float32").state_dict())


def test_automatic_choice_skips_small_linears(model):
    """Left to choose, the engine packs only weights of at least MIN_NUMEL elements (oneDNN's call
    overhead makes small ones slower); this tiny model has none, so nothing is packed."""
    assert max(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) < packed_linear.MIN_NUMEL
    assert Engine(model, num_slots=2, max_len=8).packed_weights is None
    assert len(Engine(model, num_slots=2, max_len=8, pack_weights=True).packed_weights.modules) > 0
    big = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 255))
    assert PackedLinears(big).modules == [big[0]]


def test_pays_off_compares_pairs_with_a_margin():
    """Hand-computed: the median over pairs of packed / plain decides, against 1 - min_gain."""
    # ratios 0.75, 1.0, 0.889: median 0.889 < 0.98
    assert packed_linear.pays_off([9.0, 10.0, 8.0], [12.0, 10.0, 9.0])
    assert not packed_linear.pays_off([9.0, 10.0, 8.0], [12.0, 10.0, 9.0], min_gain=0.15)  # >= 0.85
    assert not packed_linear.pays_off([5.0], [5.0])  # a tie keeps the weights unpacked
    assert not packed_linear.pays_off([9.9, 5.0], [10.0, 5.0])  # ratios 0.99, 1.0: within 2%
    # The machine slowed down over the first two pairs and recovered for the third: per pair,
    # packed is 0.9x (0.9, 0.9, 1.94 -> 0.9), though its median (9.0) is above plain's (5.0).
    assert packed_linear.pays_off([4.5, 9.0, 9.5], [5.0, 10.0, 4.9])
    with pytest.raises(ValueError, match="0 packed and 2 plain"):
        packed_linear.pays_off([], [1.0, 2.0])
    with pytest.raises(ValueError, match="in pairs, got 3 packed and 2 plain"):
        packed_linear.pays_off([1.0, 2.0, 3.0], [1.0, 2.0])


@pytest.mark.parametrize("verdict", [True, False])
def test_engine_packs_by_its_timed_trial(monkeypatch, verdict):
    """Left to choose, an engine over linears large enough to pack times decode forwards both
    ways and follows `pays_off` on those timings; pinning pack_weights skips the trial."""
    args = ModelArgs(vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=1,
                     num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    big = Transformer(args).eval()
    seen = []

    def judge(packed_s, plain_s):
        seen.append((len(packed_s), len(plain_s)))
        return verdict
    monkeypatch.setattr(packed_linear, "pays_off", judge)
    engine = Engine(big, num_slots=4, max_len=16)
    trial = engine.pack_trial
    assert seen == [(trial["pairs"], trial["pairs"])]
    assert 2 <= trial["pairs"] <= packed_linear.TRIAL_PAIRS
    assert 0 < trial["ratio"]
    line = packed_linear.describe(trial, 4)
    assert ("oneDNN-packed" if verdict else "plain (MKL)") in line
    assert f"medians of {trial['pairs']} pairs, packed / plain {trial['ratio']:.2f} by pair" in line
    assert trial["packed"] is verdict and trial["packed_ms"] > 0 and trial["plain_ms"] > 0
    assert (engine.packed_weights is not None) is verdict
    sp = SamplingParams(max_new_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    reqs = [Request(i, [1 + i, 7, 9], sp) for i in range(3)]
    want = Engine(big, num_slots=4, max_len=16, pack_weights=False).generate(reqs)
    got = engine.generate(reqs)  # the trial's garbage at position 0 is harmless
    assert [len(c.completion_ids) for c in want] == [5] * 3
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    for a, b in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a.logp, b.logp)) <= 1e-5
    for pinned in (True, False):
        assert Engine(big, num_slots=4, max_len=16, pack_weights=pinned).pack_trial is None
    assert len(seen) == 1


def test_generator_pack_weights_config_reaches_the_engine(model):
    """`generator.pack_weights` on/off pins the engine's choice (no trial); auto leaves it to the
    trial, which this tiny model never needs (nothing large enough to pack)."""
    from config import ConfigError, load_config
    from rollout.role import build_engine
    big = Transformer(ModelArgs(vocab_size=64, hidden_size=256, intermediate_size=512,
                                num_layers=1, num_heads=4, num_kv_heads=2)).eval()
    for value, packs in (("on", True), ("off", False)):
        cfg = load_config(None, [f"--generator.pack_weights={value}"])
        engine = build_engine(big, cfg, 0, torch.device("cpu"), print_choice=False)
        assert engine.pack_trial is None and (engine.packed_weights is not None) is packs
    engine = build_engine(model, load_config(None), 0, torch.device("cpu"), print_choice=True)
    assert engine.pack_trial is None and engine.packed_weights is None
    with pytest.raises(ConfigError, match="generator.pack_weights='yes' is not a valid choice"):
        load_config(None, ["--generator.pack_weights=yes"])
