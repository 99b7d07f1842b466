"""Our model against transformers: logits parity, round trips, forward modes, bad input."""
import json

import pytest
import torch
import transformers

from model import KVCache, ModelArgs, Transformer, load_pretrained, save_pretrained
from tests import tiny


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_match_transformers(family, tmp_path):
    hf = tiny.save_hf(family, tmp_path)
    ours = load_pretrained(tmp_path, dtype="float32").eval()
    ids = torch.randint(0, tiny.VOCAB, (3, 20))  # longer than Mistral's window of 8
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) <= 1e-5


def test_save_then_transformers_loads_same_logits(family, tmp_path):
    tiny.save_hf(family, tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", dtype="float32").eval()
    save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(0, tiny.VOCAB, (2, 16))
    with torch.no_grad():
        assert rel_err(back(ids).logits, ours(ids)) <= 1e-5
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings",
                "attention_bias", "torch_dtype", "architectures"):
        assert key in cfg


def test_sharded_checkpoint_loads(tmp_path):
    hf = tiny.save_hf("qwen2", tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_pretrained(tmp_path / "hf", dtype="float32")
    ids = torch.randint(0, tiny.VOCAB, (1, 9))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) <= 1e-5
    # and our own sharded writer round-trips through transformers
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "ours").glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "ours" / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(back(ids).logits, hf(ids).logits) <= 1e-5


def test_dtype_cast_on_load(tmp_path):
    tiny.save_hf("llama3", tmp_path)
    model = load_pretrained(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_packed_varlen_equals_per_sequence(family, tmp_path):
    tiny.save_hf(family, tmp_path)
    model = load_pretrained(tmp_path, dtype="float32").eval()
    lens = [5, 11, 1, 9]
    seqs = [torch.randint(0, tiny.VOCAB, (n,)) for n in lens]
    with torch.no_grad():
        packed = model(torch.cat(seqs), seq_lens=torch.tensor(lens))
        assert packed.shape == (sum(lens), tiny.VOCAB)
        ref = torch.cat([model(s[None])[0] for s in seqs])
    assert rel_err(packed, ref) <= 1e-5


def test_packed_equal_lengths_share_a_call_exactly(family, tmp_path):
    """Packed sequences of equal length are attended in one batched call: logits and gradients
    equal those of each sequence alone (Mistral's sliding window of 8 included: lengths 11)."""
    tiny.save_hf(family, tmp_path)
    model = load_pretrained(tmp_path, dtype="float32")
    lens = [5, 11, 5, 3, 11, 5]
    seqs = [torch.randint(0, tiny.VOCAB, (n,)) for n in lens]
    w = torch.randn(sum(lens), tiny.VOCAB)
    packed = model(torch.cat(seqs), seq_lens=torch.tensor(lens))
    grads = torch.autograd.grad((packed * w).sum(), list(model.parameters()))
    ref = torch.cat([model(s[None])[0] for s in seqs])
    grads_ref = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
    assert rel_err(packed, ref) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(grads, grads_ref)) <= 1e-4


def test_kv_cache_decode_equals_full_forward(family, tmp_path):
    """Prefill rows of different prompt lengths in one batch, then decode one token at a time."""
    tiny.save_hf(family, tmp_path)
    model = load_pretrained(tmp_path, dtype="float32").eval()
    prompt_lens, steps, total = [3, 7, 5], 6, 16
    full = torch.randint(0, tiny.VOCAB, (3, total))
    with torch.no_grad():
        ref = model(full)  # [3, total, V]
        cache = KVCache.for_model(model, num_slots=4, max_len=total)
        slots = torch.tensor([2, 0, 3])  # rows live in arbitrary cache slots
        T = max(prompt_lens)
        pos = torch.arange(T).expand(3, T)  # right-padded prefill; padding is overwritten later
        logits = model(full[:, :T], positions=pos, kv_cache=cache, slots=slots)
        for r, n in enumerate(prompt_lens):
            assert rel_err(logits[r, :n], ref[r, :n]) <= 1e-5
        cur = torch.tensor(prompt_lens)
        for _ in range(steps):
            tok = full.gather(1, cur[:, None])
            step = model(tok, positions=cur[:, None], kv_cache=cache, slots=slots)
            want = ref[torch.arange(3), cur]
            assert rel_err(step[:, 0], want) <= 1e-5
            cur = cur + 1
        # the cache's RoPE tables give bitwise what computing them in the forward gives
        tables, computed = (KVCache.for_model(model, num_slots=4, max_len=total) for _ in range(2))
        computed.rope = None
        assert tables.rope is not None and tables.rope[0].shape == (total, 1, model.args.head_dim)
        out = [model(full[:, :T], positions=pos, kv_cache=c, slots=slots) for c in (tables, computed)]
        assert torch.equal(*out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_transformers_bitwise(dtype):
    """RMSNorm equals transformers' LlamaRMSNorm bit for bit in fp32, bf16 and fp16: forward,
    input gradient and weight gradient, also under CPU bf16 autocast, and at a decode step's
    shape under inference mode."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from model.transformer import RMSNorm
    torch.manual_seed(0)
    ours, ref = RMSNorm(48, 1e-6).to(dtype), LlamaRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    for autocast in (False, True):
        x = (torch.randn(3, 7, 48) * 3).to(dtype).requires_grad_()
        g = torch.randn(3, 7, 48).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, y_ref = ours(x), ref(x)
        assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
        grads = torch.autograd.grad(y, (x, ours.weight), g)
        grads_ref = torch.autograd.grad(y_ref, (x, ref.weight), g)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    with torch.inference_mode():
        x = (torch.randn(16, 1, 48) * 3).to(dtype)
        assert torch.equal(ours(x), ref(x))


def test_meta_build_then_init():
    args = ModelArgs(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    out = model(torch.randint(0, 50, (2, 5)))
    assert out.shape == (2, 5, 50) and torch.isfinite(out).all()


# ----- bad input ----------------------------------------------------------------------------
def test_missing_config_json(tmp_path):
    tiny.save_hf("llama3", tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        load_pretrained(tmp_path)


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(tmp_path / "nope")


def test_truncated_safetensors(tmp_path):
    tiny.save_hf("llama3", tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_pretrained(tmp_path)


def test_unsupported_architecture(tmp_path):
    tiny.save_hf("llama3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_pretrained(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    tiny.save_hf("llama3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: checkpoint shape "
                                         r"\[64, 96\] != model shape \[64, 100\]"):
        load_pretrained(tmp_path)


def test_missing_and_unexpected_tensors_listed(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny.save_hf("llama3", tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    state["model.extra.weight"] = state.pop("model.norm.weight")
    save_file(state, str(f))
    with pytest.raises(ValueError, match=r"missing tensors: \['model.norm.weight'\].*"
                                         r"unexpected tensors: \['model.extra.weight'\]"):
        load_pretrained(tmp_path)


def test_attention_backend_check_names_what_is_missing():
    """model.attn_backend at start-up: 'auto' and 'sdpa' run anywhere; 'flash' names each
    missing part (flash-attn, CUDA, a half-precision compute dtype)."""
    from model import attention as attn
    for backend in ("auto", "sdpa"):
        attn.check_backend(backend, "cpu", torch.float32)
    with pytest.raises(ValueError, match="no CUDA device, compute dtype float32, not fp16/bf16"):
        attn.check_backend("flash", "cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        attn.check_backend("xformers", "cuda", torch.bfloat16)
    if attn.flash_attn_varlen_func is None:
        with pytest.raises(ValueError, match=r"\(flash-attn is not installed\)"):
            attn.check_backend("flash", "cuda", torch.bfloat16)
