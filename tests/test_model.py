"""Our model against transformers: logits parity, round trips, forward modes, bad input."""
import json
import os

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


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_saved_weights_are_as_readable_as_the_umask_makes_any_file(tmp_path, umask, mode):
    """safetensors 0.8 writes its files 0600 whatever the umask: an export's config.json and
    tokenizer were readable to a cluster's group, its weights not."""
    import stat
    ours = Transformer(ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64))
    old = os.umask(umask)
    try:
        save_pretrained(ours, tmp_path / "one")
        save_pretrained(ours, tmp_path / "many", max_shard_bytes=20_000)
    finally:
        os.umask(old)
    files = [*(tmp_path / "one").iterdir(), *(tmp_path / "many").iterdir()]
    assert sum(f.suffix == ".safetensors" for f in files) > 2
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: mode for f in files}


def test_a_folder_with_both_the_single_file_and_an_index_loads_what_transformers_loads(tmp_path):
    """transformers reads model.safetensors when a folder also holds an index and its shards
    (an old sharded save left beside a new single one): so does tandem (it read the index)."""
    import shutil
    tiny.save_hf("qwen2", tmp_path / "sharded", max_shard_size="20KB", seed=1)
    tiny.save_hf("qwen2", tmp_path / "single", seed=2)
    for f in (tmp_path / "sharded").iterdir():
        if f.name.startswith("model-") or f.name == "model.safetensors.index.json":
            shutil.copy(f, tmp_path / "single" / f.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "single"),
                                                           dtype=torch.float32).eval()
    ours = load_pretrained(tmp_path / "single", dtype="float32").eval()
    ids = torch.randint(0, tiny.VOCAB, (1, 9))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) <= 1e-5


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


def _shared_prefix_case():
    """Two prompts (lengths 6 and 10) packed once each, with children of lengths 4, 4, 7 and 4,
    1, 3 continuing them, and a sequence of its own between: tokens, seq_lens, seq_parents, and
    each packed sequence's full token list (its parent's tokens first)."""
    lens, parents = [6, 4, 4, 7, 9, 10, 4, 1, 3], [-1, 0, 0, 0, -1, -1, 5, 5, 5]
    seqs = [torch.randint(0, tiny.VOCAB, (n,)) for n in lens]
    full = [seqs[i] if p < 0 else torch.cat([seqs[p], seqs[i]]) for i, p in enumerate(parents)]
    return torch.cat(seqs), torch.tensor(lens), torch.tensor(parents), full


def _packed_against_full(model, ids, lens, parents, full):
    """Logits and gradients of a packed forward with parents, and the same rows taken from each
    sequence run whole (a child's rows are the last ones of parent + child)."""
    w = torch.randn(len(ids), tiny.VOCAB)
    packed = model(ids, seq_lens=lens, seq_parents=parents)
    grads = torch.autograd.grad((packed * w).sum(), list(model.parameters()))
    ref = torch.cat([model(f[None])[0, -n:] for f, n in zip(full, lens.tolist())])
    grads_ref = torch.autograd.grad((ref * w).sum(), list(model.parameters()))
    return packed, ref, grads, grads_ref


def test_packed_children_continue_their_parent(family, tmp_path):
    """A packed sequence with a parent (a GRPO group's shared prompt) gives the logits and
    gradients of parent + child run whole (the parent's rows taken from its first child's call,
    children of equal total length in one call). Mistral's sliding window of 8 is crossed."""
    tiny.save_hf(family, tmp_path)
    model = load_pretrained(tmp_path, dtype="float32")
    packed, ref, grads, grads_ref = _packed_against_full(model, *_shared_prefix_case())
    assert rel_err(packed, ref) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(grads, grads_ref)) <= 1e-4


def test_packed_groups_layout_by_hand():
    """A prompt [0, 1] with children [2] and [3], then a sequence [4, 5, 6] alone: the children
    are attended as [0, 1, 2] and [0, 1, 3] with the alone one (all of length 3) in one call;
    the prompt's rows are kept from the first child only."""
    from model import attention as attn
    groups, order = attn.packed_groups([2, 1, 1, 3], [-1, 0, 0, -1], None, "cpu")
    assert len(groups) == 1 and groups[0].mask is None
    assert groups[0].rows.tolist() == [[0, 1, 2], [0, 1, 3], [4, 5, 6]]
    assert groups[0].keep.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert order.tolist() == list(range(7))
    groups, order = attn.packed_groups([3, 1, 2], [-1, -1, -1], 2, "cpu")  # by length, windowed
    assert [g.rows.tolist() for g in groups] == [[[0, 1, 2]], [[3]], [[4, 5]]]
    assert groups[0].mask.tolist() == [[[True, False, False], [True, True, False], [False, True, True]]]
    assert groups[1].mask is None and all(g.keep is None for g in groups)


def _flash_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
    """flash-attn's varlen semantics on CPU, for the key layout's test: per sequence, a causal
    mask aligned to the end (query j of n sees key positions <= m + j of m + n), and the window
    (left, 0) counted back from there."""
    from model import attention as attn
    assert causal and window_size[1] in (-1, 0)
    window = None if window_size[0] < 0 else window_size[0] + 1
    outs = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        keys = torch.arange(len(ks))[None]
        mask = attn.causal_mask(keys[:, len(ks) - len(qs):], keys, window)
        outs.append(attn.sdpa(qs[None], ks[None], vs[None], mask, causal=False)[0])
    return torch.cat(outs)


def test_flash_key_layout_for_children(family, tmp_path, monkeypatch):
    """The flash-attn path for packed sequences with parents (CUDA only) on CPU: flash-attn's
    varlen call replaced by a reference of its semantics, the gathered keys (`prefix_keys`)
    must give what parent + child run whole give."""
    from model import attention as attn
    monkeypatch.setattr(attn, "flash_attn_varlen_func", _flash_reference)
    monkeypatch.setattr(attn, "use_flash", lambda x, backend: True)
    tiny.save_hf(family, tmp_path)
    model = load_pretrained(tmp_path, dtype="float32")
    ids, lens, parents, full = _shared_prefix_case()
    index, cu, longest = attn.prefix_keys(lens.tolist(), parents.tolist(), "cpu")
    assert cu.tolist() == [0, 6, 16, 26, 39, 48, 58, 72, 83, 96] and longest == 14
    assert index[6:16].tolist() == list(range(6)) + list(range(6, 10))
    packed, ref, grads, grads_ref = _packed_against_full(model, ids, lens, parents, full)
    assert rel_err(packed, ref) <= 1e-5
    assert max(rel_err(a, b) for a, b in zip(grads, grads_ref)) <= 1e-4


@pytest.mark.parametrize("parents, why", [([-1, 0], "2 entries for 3"),
                                          ([-1, 2, -1], "seq_parents\\[1\\] = 2"),
                                          ([-1, 0, 1], "seq_parents\\[2\\] = 1")])
def test_bad_seq_parents_name_the_entry(tmp_path, parents, why):
    tiny.save_hf("llama3", tmp_path)
    model = load_pretrained(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match=why):
        model(torch.zeros(9, dtype=torch.long), seq_lens=torch.tensor([3, 3, 3]),
              seq_parents=torch.tensor(parents))


@pytest.mark.parametrize("kernel, stacked", [("auto", False), ("sdpa", False), ("matmul", True),
                                             ("flex", False), ("flex", True)])
def test_kv_cache_decode_equals_full_forward(family, tmp_path, kernel, stacked):
    """Prefill rows of different prompt lengths in one batch, then decode one token at a time,
    with each attention kernel over the cache and with the q|k|v and gate|up weights stacked
    (flex: eager FlexAttention, its reference implementation; the engine compiles it)."""
    from rollout.stacked import StackedWeights
    tiny.save_hf(family, tmp_path)
    model = load_pretrained(tmp_path, dtype="float32").eval()
    prompt_lens, steps, total = [3, 7, 5], 6, 16
    full = torch.randint(0, tiny.VOCAB, (3, total))
    with torch.no_grad():
        ref = model(full)  # [3, total, V]
        cache = KVCache.for_model(model, num_slots=4, max_len=total)
        cache.kernel = kernel
        if stacked:
            stacks = StackedWeights(model)
            cache.qkv, cache.gate_up = stacks.qkv, stacks.gate_up
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


@pytest.mark.parametrize("window", [None, 100])
def test_flex_block_mask_lists_each_rows_blocks_and_attends_as_sdpa(window):
    """Over a cache of three flex blocks: each row lists the key blocks up to its own position
    (hand-computed), and FlexAttention under that mask equals the other kernels, with large
    garbage in the cache past every row's position that must get no weight."""
    from model import attention as attn
    B, Hq, Hkv, S, D = 4, 8, 2, 3 * attn.FLEX_BLOCK - 50, 16
    pos = torch.tensor([[5], [attn.FLEX_BLOCK - 1], [attn.FLEX_BLOCK], [S - 1]])
    bm = attn.flex_block_mask(pos, S, window)
    assert bm.kv_num_blocks.flatten().tolist() == [1, 1, 2, 3]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, Hq, D, generator=g)
    k, v = (torch.randn(B, S, Hkv, D, generator=g) for _ in range(2))
    for x in (k, v):
        x[torch.arange(S)[None, :] > pos] = 1e4
    mask = attn.causal_mask(pos, torch.arange(S).expand(B, S), window)
    live = torch.arange(S) <= pos[:, :1]  # the reference: each row over its live keys only
    want = torch.cat([attn.sdpa_grouped(q[b:b + 1], k[b:b + 1, live[b]], v[b:b + 1, live[b]],
                                        mask[b:b + 1, :, live[b]], kernel="matmul")
                      for b in range(B)])
    for got in (attn.flex_grouped(q, k, v, bm), attn.sdpa_grouped(q, k, v, mask, kernel="sdpa"),
                attn.sdpa_grouped(q, k, v, mask, kernel="matmul")):
        assert rel_err(got, want) <= 1e-5
    with pytest.raises(ValueError, match="unknown decode attention kernel 'fast'.*'flex'"):
        attn.decode_kernel("fast", "cpu")


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


# ----- config.json as transformers reads it ------------------------------------------------
DROP = "<drop>"  # in `_rewrite_config`'s edits: remove the key (None writes an explicit null)


def _rewrite_config(folder, edits: dict) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in edits.items():
        if value == DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def _logits_against_transformers(folder, T: int = 20) -> tuple[float, Transformer]:
    """Our model loaded from `folder` and transformers' (reading the same config.json) on one
    batch of T tokens (longer than the windows of 8 below): relative error, and our model."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), attn_implementation="eager", dtype=torch.float32).eval()
    ours = load_pretrained(folder, dtype="float32").eval()
    ids = torch.randint(0, tiny.VOCAB, (2, T))
    with torch.no_grad():
        return rel_err(ours(ids), hf(ids).logits), ours


@pytest.mark.parametrize("model_type, config, edits, window", [
    # Qwen slides only layers >= max_window_layers (default 28: none of 2) ...
    ("qwen2", dict(use_sliding_window=True, sliding_window=8), {}, None),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), {}, 8),
    # ... or as layer_types says, which wins over max_window_layers
    ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention"] * 2), {}, 8),
    # ... and only with use_sliding_window, False when the key is missing
    ("qwen2", {}, {"sliding_window": 8, "use_sliding_window": DROP, "layer_types": DROP}, None),
    # Llama has no window, whatever the key says
    ("llama", {}, {"sliding_window": 8}, None),
    # Qwen3's default head_dim is 128, not hidden / heads (16)
    ("qwen3", {}, {"head_dim": DROP}, None),
    # swish is SiLU
    ("llama", dict(hidden_act="swish"), {}, None),
    # a Mistral config.json with layer_types is Ministral's to AutoConfig: the layers marked
    # "sliding_attention" slide, not every layer (we read a window for all, silently)
    ("mistral", dict(sliding_window=8), {"layer_types": ["full_attention"] * 2}, None),
    ("mistral", dict(sliding_window=8), {"layer_types": ["sliding_attention"] * 2}, 8),
    # a missing num_key_value_heads is the family's default (Mistral 8, Qwen 32), not the heads'
    # count (a valid checkpoint was refused for shapes)
    ("mistral", dict(num_attention_heads=16, num_key_value_heads=8), {"num_key_value_heads": DROP},
     4096),
    ("qwen2", dict(hidden_size=128, num_attention_heads=64, num_key_value_heads=32),
     {"num_key_value_heads": DROP}, None),
], ids=["qwen2-below-max_window_layers", "qwen3-max_window_layers-0", "qwen2-layer_types",
        "qwen2-no-use_sliding_window", "llama-sliding_window-key", "qwen3-no-head_dim", "swish",
        "mistral-layer_types-none-slide", "mistral-layer_types-all-slide", "mistral-no-kv-heads",
        "qwen2-no-kv-heads"])
def test_config_json_read_as_transformers_reads_it(tmp_path, model_type, config, edits, window):
    tiny.save_variant(model_type, tmp_path, **config)
    _rewrite_config(tmp_path, edits)
    err, ours = _logits_against_transformers(tmp_path)
    assert err <= 1e-5 and ours.args.sliding_window == window


@pytest.mark.parametrize("model_type, config, edits", [
    ("mistral", {}, {"sliding_window": DROP}),  # transformers' default window
    ("mistral", {}, {"sliding_window": None}),  # an explicit null: none
    ("qwen2", dict(use_sliding_window=True, max_window_layers=0), {"sliding_window": DROP}),
    ("qwen3", dict(use_sliding_window=True, max_window_layers=0), {"sliding_window": DROP}),
], ids=["mistral-no-key", "mistral-null", "qwen2-no-key", "qwen3-no-key"])
def test_default_window_as_transformers_reads_it(tmp_path, model_type, config, edits):
    """Windows too long for the tiny models' logits to show (4096): our window is the one
    transformers reads, on every layer in these configs."""
    from model.hf_io import load_model_args
    tiny.save_variant(model_type, tmp_path, **config)
    _rewrite_config(tmp_path, edits)
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert set(getattr(hf, "layer_types", None) or ["sliding_attention"]) == {"sliding_attention"}
    assert load_model_args(tmp_path).sliding_window == hf.sliding_window


def test_qwen_window_on_some_layers_is_refused(tmp_path):
    """Layer 1 of 2 slides (max_window_layers=1): we have one window for all layers."""
    tiny.save_variant("qwen2", tmp_path, use_sliding_window=True, sliding_window=8,
                      max_window_layers=1)
    with pytest.raises(ValueError, match=r"sliding_window=8 applies to layers \[1\] of 2 only"):
        load_pretrained(tmp_path)


def test_mistral_layer_types_window_on_some_layers_is_refused(tmp_path):
    """AutoConfig reads a Mistral config.json with layer_types as Ministral's: one layer of two
    slides, which our one window for all layers cannot run."""
    tiny.save_variant("mistral", tmp_path, sliding_window=8)
    _rewrite_config(tmp_path, {"layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match=r"sliding_window=8 applies to layers \[1\] of 2 only "
                                         r"\(layer_types \(read as Ministral's\)\)"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("model_type, act", [("llama", "gelu"), ("qwen2", "relu")])
def test_activation_other_than_silu_is_refused(tmp_path, model_type, act):
    tiny.save_variant(model_type, tmp_path, hidden_act=act)
    with pytest.raises(ValueError, match=f"hidden_act='{act}' is not supported.*SiLU"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("model_type, o_proj_bias", [("llama", True), ("qwen3", True),
                                                     ("qwen2", False), ("mistral", False)])
def test_attention_bias_as_transformers_builds_it(tmp_path, model_type, o_proj_bias):
    """attention_bias=True: Llama and Qwen3 bias q/k/v/o, Qwen2 q/k/v only (always), Mistral
    nothing (it ignores the key). Logits, parameter count and the export's round trip agree."""
    hf = tiny.save_variant(model_type, tmp_path / "hf", attention_bias=True)
    err, ours = _logits_against_transformers(tmp_path / "hf")
    assert err <= 1e-5
    hf_o_proj_bias = "model.layers.0.self_attn.o_proj.bias" in hf.state_dict()
    assert ours.args.o_proj_bias == o_proj_bias == hf_o_proj_bias
    assert ours.args.num_params() == sum(p.numel() for p in ours.parameters()) == hf.num_parameters()
    save_pretrained(ours, tmp_path / "ours")
    assert _logits_against_transformers(tmp_path / "ours")[0] <= 1e-5


@pytest.mark.parametrize("kwargs, why", [
    (dict(sliding_window=8), "sliding_window=8 with LlamaForCausalLM.*use MistralForCausalLM"),
    (dict(arch="MistralForCausalLM", attention_bias=True), "attention_bias=True with Mistral")],
    ids=["llama-window", "mistral-bias"])
def test_model_args_refuse_what_transformers_cannot_build(kwargs, why):
    with pytest.raises(ValueError, match=why):
        ModelArgs(**kwargs)


@pytest.mark.parametrize("kwargs, why", [
    (dict(arch="Qwen3ForCausalLM"), "cannot export qk_norm=False with Qwen3ForCausalLM.*qk_norm=True"),
    (dict(qk_norm=True), "cannot export qk_norm=True with LlamaForCausalLM.*Qwen3ForCausalLM"),
    (dict(arch="Qwen2ForCausalLM"), "cannot export attention_bias=False with Qwen2ForCausalLM")],
    ids=["qwen3-no-qk-norm", "llama-qk-norm", "qwen2-no-bias"])
def test_export_refuses_what_transformers_builds_otherwise(tmp_path, kwargs, why):
    """ModelArgs built by hand (not read from HF) whose switches config.json cannot carry:
    transformers loaded such an export silently as another model (Qwen3 q/k norms of ones added,
    Llama's dropped: logits off by 0.6 and 2.5) and our loader refused it (missing/unexpected
    tensors). The export is refused, naming the switch; nothing is written."""
    model = Transformer(ModelArgs(vocab_size=tiny.VOCAB, **kwargs))
    with pytest.raises(ValueError, match=why):
        save_pretrained(model, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_window_exports_as_transformers_runs_it(tmp_path, arch):
    """A windowed model built from ModelArgs (not read from HF): transformers slides every layer
    of the export, and our loader reads the window back."""
    args = ModelArgs(arch=arch, vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, sliding_window=8,
                     attention_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM")
    model = Transformer(args)
    model.init_weights(std=0.1, seed=0)
    save_pretrained(model, tmp_path)
    err, back = _logits_against_transformers(tmp_path, T=24)
    assert err <= 1e-5 and back.args.sliding_window == 8


def test_save_labels_the_dtype_written(tmp_path):
    """A bf16 checkpoint loaded in fp32 (as the trainer does) and saved without a dtype is
    written in fp32, and config.json says so: transformers and our loader read it in fp32."""
    tiny.hf_model("llama3").to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    ours = load_pretrained(tmp_path / "bf16", dtype="float32")
    assert ours.args.torch_dtype == "bfloat16"
    save_pretrained(ours, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    back = load_pretrained(tmp_path / "out")
    assert hf.dtype == torch.float32
    assert all(a.dtype == b.dtype and torch.equal(a, b)
               for a, b in zip(back.parameters(), ours.parameters()))


# ----- rope, head tying and defaults as transformers reads them ----------------------------
def _store_tensors(folder, tensors: dict) -> None:
    """Add (or replace) `tensors` in a saved checkpoint: in model.safetensors, or in the last
    shard file of a sharded one (listed in its index)."""
    from safetensors.torch import load_file, save_file
    index = folder / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        fname = sorted(set(meta["weight_map"].values()))[-1]
        meta["weight_map"].update(dict.fromkeys(tensors, fname))
        index.write_text(json.dumps(meta))
    else:
        fname = "model.safetensors"
    state = load_file(str(folder / fname))
    state.update(tensors)
    save_file(state, str(folder / fname), metadata={"format": "pt"})


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_tied_head_stored_identical_loads_different_is_refused(tmp_path, shard):
    """tie_word_embeddings=true with an lm_head.weight stored anyway: an identical copy loads
    tied; a different head (transformers keeps it, untied) is refused, naming the key to change."""
    kwargs = {"max_shard_size": shard} if shard else {}
    hf = tiny.save_hf("tied", tmp_path, **kwargs)
    emb = hf.model.embed_tokens.weight.detach().clone()
    _store_tensors(tmp_path, {"lm_head.weight": emb.clone()})
    err, ours = _logits_against_transformers(tmp_path)
    assert err <= 1e-5 and ours.lm_head.weight is ours.model.embed_tokens.weight
    other = emb.clone()
    other[-1, 0] += 1.0  # one element of the last row: the comparison must cover every row
    _store_tensors(tmp_path, {"lm_head.weight": other})
    with pytest.raises(ValueError, match=r"lm_head.weight differs from model.embed_tokens.weight"
                                         r".*\"tie_word_embeddings\": false"):
        load_pretrained(tmp_path)
    # compared a block of rows at a time: a block of 10 rows still finds the last row's change
    from model.hf_io import CheckpointReader, _same_values
    reader = CheckpointReader(tmp_path)
    assert not _same_values(reader, "model.embed_tokens.weight", "lm_head.weight", 10 * 4 * 64)
    assert _same_values(reader, "lm_head.weight", "lm_head.weight", 10 * 4 * 64)


def test_rope_scaling_wins_over_rope_parameters(tmp_path):
    """Both keys in config.json and they disagree: transformers (4.x and 5.x) reads rope_scaling."""
    tiny.save_variant("llama", tmp_path)
    _rewrite_config(tmp_path, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                               "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    err, ours = _logits_against_transformers(tmp_path)
    assert err <= 1e-5 and ours.args.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_model_args_rope_type_spelled_type_is_scaled(tmp_path):
    """The 4.x spelling {"type": "linear"} given to ModelArgs: our forward scales as the export
    says, so transformers reading the export computes the same logits."""
    args = ModelArgs(vocab_size=tiny.VOCAB, rope_scaling={"type": "linear", "factor": 4.0})
    assert args.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    model = Transformer(args)
    model.init_weights(std=0.1, seed=0)
    save_pretrained(model, tmp_path)
    assert _logits_against_transformers(tmp_path)[0] <= 1e-5


@pytest.mark.parametrize("rope, why", [
    ({"rope_type": "linear"}, r"rope_type 'linear' needs \['factor'\]"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     r"rope_type 'llama3' needs \['original_max_position_embeddings'\]"),
    ({"rope_type": "yarn", "factor": 2.0}, "unsupported rope_type 'yarn'"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor=0.5"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},  # the export writes the dict's
     "rope_scaling has rope_theta=500000.0 but rope_theta=10000.0"),
], ids=["linear-no-factor", "llama3-no-original-max", "yarn", "partial-rotary", "theta-twice"])
def test_model_args_refuse_incomplete_rope(rope, why):
    with pytest.raises(ValueError, match=why):
        ModelArgs(rope_scaling=rope)


def test_llama3_rope_without_original_max_takes_max_position_embeddings(tmp_path):
    """transformers fills the llama3 rope's original_max_position_embeddings from
    max_position_embeddings (256 here) when config.json omits it."""
    tiny.save_hf("llama3", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = {k: v for k, v in cfg["rope_parameters"].items() if k != "original_max_position_embeddings"}
    _rewrite_config(tmp_path, {"rope_parameters": rope, "rope_scaling": DROP})
    err, ours = _logits_against_transformers(tmp_path)
    assert err <= 1e-5 and ours.args.rope_scaling["original_max_position_embeddings"] == 256


def test_llama3_rope_takes_a_top_level_original_max_over_the_dicts(tmp_path):
    """A config.json with original_max_position_embeddings at its top level (Phi-3's spelling):
    transformers' standardize_rope_params gives it priority over the rope dict's (32 here); we
    read the dict's, other rope frequencies and logits without a word."""
    tiny.save_hf("llama3", tmp_path)
    _rewrite_config(tmp_path, {"original_max_position_embeddings": 16})
    err, ours = _logits_against_transformers(tmp_path, T=40)
    assert err <= 1e-5 and ours.args.rope_scaling["original_max_position_embeddings"] == 16


def test_legacy_inv_freq_tensors_are_ignored(tmp_path):
    """Old checkpoints store each layer's rotary_emb.inv_freq buffer; transformers ignores them."""
    hf = tiny.save_hf("llama3", tmp_path)
    inv_freq = hf.model.rotary_emb.inv_freq
    _store_tensors(tmp_path, {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone()
                              for i in range(2)})
    assert _logits_against_transformers(tmp_path)[0] <= 1e-5


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_tied_model_stored_with_head_only_loads(tmp_path, shard):
    """A tied model saved by `safetensors.torch.save_model` stores the shared tensor once, under
    its first name, lm_head.weight: transformers loads the embedding from it; so do we, whole
    (load_pretrained) and by slices (the sharded loader's `get_slice`)."""
    from safetensors.torch import load_file, save_file
    from model.hf_io import CheckpointReader, check_tensors, expected_tensors
    kwargs = {"max_shard_size": shard} if shard else {}
    hf = tiny.save_hf("tied", tmp_path, **kwargs)
    index = tmp_path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if shard else {}
    fname = weight_map.get("model.embed_tokens.weight", "model.safetensors")
    state = load_file(str(tmp_path / fname))
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, str(tmp_path / fname), metadata={"format": "pt"})
    if shard:
        weight_map["lm_head.weight"] = weight_map.pop("model.embed_tokens.weight")
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    err, ours = _logits_against_transformers(tmp_path)
    assert err <= 1e-5 and ours.lm_head.weight is ours.model.embed_tokens.weight
    emb = hf.model.embed_tokens.weight.detach()
    assert torch.equal(ours.model.embed_tokens.weight, emb)
    reader = CheckpointReader(tmp_path)
    check_tensors(reader, expected_tensors(ours))
    assert torch.equal(reader.get_slice("model.embed_tokens.weight", (5, 8), (3, 16)), emb[5:8, 8:24])
    # a head of another shape is named as stored (the checkpoint holds no embed_tokens)
    fname = weight_map.get("lm_head.weight", "model.safetensors")
    state = load_file(str(tmp_path / fname))
    state["lm_head.weight"] = torch.cat([state["lm_head.weight"], state["lm_head.weight"][:3]])
    save_file(state, str(tmp_path / fname), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor model.embed_tokens.weight \(stored as "
                                         r"lm_head.weight\): checkpoint shape \[\d+, \d+\]"):
        load_pretrained(tmp_path)
    # untied, the embedding is missing (transformers would initialise it at random)
    _rewrite_config(tmp_path, {"tie_word_embeddings": False})
    with pytest.raises(ValueError, match=r"missing tensors: \['model.embed_tokens.weight'\]"):
        load_pretrained(tmp_path)


def test_llama_mlp_bias_is_refused_by_name(tmp_path):
    from model.hf_io import load_model_args
    tiny.save_variant("llama", tmp_path, mlp_bias=True)
    with pytest.raises(ValueError, match=r"config.json: mlp_bias=True is not supported"):
        load_model_args(tmp_path)


def test_a_quantized_checkpoint_is_refused_by_its_method(tmp_path):
    """A GPTQ/AWQ/bitsandbytes folder stores qweight/scales tensors: refused by its config's
    quantization_config, not as a list of unexpected tensors."""
    from model.hf_io import load_model_args
    tiny.save_variant("llama", tmp_path)
    _rewrite_config(tmp_path, {"quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(ValueError, match=r"config.json: quantization_config \(quant_method='gptq'\) "
                                         r"is not supported.*unquantized"):
        load_model_args(tmp_path)
    _rewrite_config(tmp_path, {"quantization_config": DROP})
    load_model_args(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_missing_max_position_embeddings_is_the_family_default(tmp_path, model_type):
    """config.json without max_position_embeddings: the family's transformers default, read and
    written back (not one default for all families)."""
    from model.hf_io import load_model_args
    tiny.save_variant(model_type, tmp_path / "hf")
    _rewrite_config(tmp_path / "hf", {"max_position_embeddings": DROP})
    want = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).max_position_embeddings
    assert load_model_args(tmp_path / "hf").max_position_embeddings == want
    save_pretrained(load_pretrained(tmp_path / "hf"), tmp_path / "ours")
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "ours")).max_position_embeddings == want


@pytest.mark.parametrize("edits", [
    {"partial_rotary_factor": 0.5},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
], ids=["top-level", "in-linear-rope", "in-default-rope"])
def test_partial_rotary_factor_is_refused_by_name(tmp_path, edits):
    from model.hf_io import load_model_args
    tiny.save_variant("llama", tmp_path)
    _rewrite_config(tmp_path, edits)
    with pytest.raises(ValueError, match=r"config.json: .*partial_rotary_factor=0\.(5|25) is not supported"):
        load_model_args(tmp_path)


def test_partial_rotary_factor_one_is_accepted(tmp_path):
    tiny.save_variant("llama", tmp_path)
    _rewrite_config(tmp_path, {"partial_rotary_factor": 1.0})
    assert _logits_against_transformers(tmp_path)[0] <= 1e-5


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


def test_index_that_does_not_match_its_shards_names_tensor_and_file(tmp_path):
    """An index listing a tensor in a shard that does not hold it failed inside safetensors
    ("File does not contain tensor ...", no file); an index that is not JSON with a bare
    JSONDecodeError. Both now name the index, the tensor and its file."""
    tiny.save_hf("qwen2", tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    right = meta["weight_map"]["model.norm.weight"]
    wrong = next(f for f in sorted(set(meta["weight_map"].values())) if f != right)
    meta["weight_map"]["model.norm.weight"] = wrong
    index.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"index.json lists tensors in shard files that do not "
                                         rf"hold them: \['model.norm.weight \({wrong}\)'\]"):
        load_pretrained(tmp_path)
    index.write_text("{oops")
    with pytest.raises(ValueError, match=r"index.json: not a safetensors index \(JSONDecodeError"):
        load_pretrained(tmp_path)
    # JSON, but no map of tensor names to file names (failed with a bare AttributeError)
    for weight_map in (None, ["model.norm.weight"], {"model.norm.weight": 3}):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ValueError, match=r"index.json: not a safetensors index \(TypeError"):
            load_pretrained(tmp_path)


def test_unsupported_config_dtype_is_named(tmp_path):
    """config.json's dtype read as the load dtype: the error named None (the argument), not it."""
    tiny.save_hf("llama3", tmp_path)
    _rewrite_config(tmp_path, {"dtype": "float64", "torch_dtype": DROP})
    with pytest.raises(ValueError, match=r"unsupported dtype 'float64'; choose one of"):
        load_pretrained(tmp_path)
    assert load_pretrained(tmp_path, dtype="float32").lm_head.weight.dtype == torch.float32


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
