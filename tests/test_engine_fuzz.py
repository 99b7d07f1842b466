"""Seeded randomized ("fuzz") consistency tests of the engine's scheduling.

The engine's contract (rollout/engine.py): a sample's draws depend on its request's seed (or
the engine seed and the request's arrival order) and its sample index, never on its slot, its
neighbours, the row count, queueing, harvest timing or compaction. So for a random mix of
requests (5-30 of them; prompts of 1-20 tokens; n in 1..6; greedy, temperature 0, tempered,
top-k, top-p or both; random stop ids, sometimes more than the slot state's 4 columns; eos
ignored or not; own seeds or derived ones), submitted in batches between steps, by
`generate` or after a refused batch (a prompt too long, a prompt or stop id outside the
vocabulary, n set to 0 after construction), on 3-8 slots (queued and partly admitted groups,
prefix copies, prompts prefilled again, compaction on and off, sync_every 1-5, chunked prefills,
length buckets, a max_len that caps many samples, idle restarts), every completion must equal
what its request gives alone in a fresh engine: the same tokens, finish reason and length, mu
within fp32 rounding (the row count and the batch's kernels change the matmuls' rounding
only). Each completion is also checked against an independent reference (`reference_draw`):
each token is the inverse-CDF draw (rollout/sampling.py) at the sample's hashed uniform,
computed in float64 from the logits of a forward outside the engine, and mu its log-prob.

Weight swaps (one or two `load_weights` at random steps, kv_policy keep or recompute) have an
exact reference too, given each token's recorded version v_k:
- "recompute": token k is drawn from a full forward of prompt + completion[:k] under the
  weights of version v_k (every cached key/value is recomputed at the swap);
- "keep": every key/value is computed by the weights that were current when its token was fed
  in: the prompt's by v_0's (its prefill, which gave the first token), the key/value of
  completion token k-1 by v_k's (the decode step that fed it drew token k). The reference
  decodes one sequence through its own one-slot KV cache, switching weights per token.

Failed admissions (`check_faults`): the same workloads with admissions that raise at random
steps (before the prefill, after the prefix copies, after the first tokens), each undone by the
engine and the step retried, must give the same completions bit for bit.

Rounding knife edges: a token may differ where the draw sits within ~1e-5 of a decision (two
greedy logits, a top-k/top-p cut, the uniform at a CDF boundary), and a mu may differ with the
token kept where the top-k/top-p cut is that close (the renormalisation then includes one token
more or less: workload 113 of the Mistral model has a top-p cut 6e-8 from top_p, and its mu
moved by 8e-3 between two row counts). `reference_draw` finds these in float64 and only they
excuse a difference (after a token differs, the mix and the request alone are no longer
comparable); every other difference fails with the workload's seed and options. Tolerances
scale with 1 / temperature, by which mu = log_softmax(logits / T) magnifies the logits'
rounding.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from model import ModelArgs, Transformer
from model.kv_cache import KVCache
from rollout.engine import Engine, Request, SamplingParams
from rollout.sampling import hashed_uniform, stream_key

VOCAB = 97  # two blocks of the inverse-CDF search (sampling.BLOCK = 64), the second padded
EOS = 5
MU_TOL = 1e-5  # per unit of 1 / temperature: mu = log_softmax(logits / T) scales rounding by 1/T
EDGE = 1e-5  # a decision closer than this (logit gap, probability mass) may flip by rounding


def scale(p: SamplingParams) -> float:
    """How much a sample's temperature magnifies the logits' rounding in mu and in its draw."""
    return max(1.0, 1.0 / p.temperature) if p.temperature > 0 else 1.0


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(seed: int, window: int | None = None, std: float = 0.15) -> Transformer:
    """A tiny random fp32 model; std 0.15 gives logits of std ~2, so distributions are peaked
    enough that temperature, top-k and top-p all change the draws. `window`: a Mistral model
    with that sliding window."""
    arch = "MistralForCausalLM" if window else "LlamaForCausalLM"
    args = ModelArgs(arch=arch, vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, sliding_window=window,
                     eos_token_id=EOS, max_position_embeddings=256)
    model = Transformer(args)
    model.init_weights(std=std, seed=seed)
    return model.eval()


# ----- random workloads -----------------------------------------------------------------------
def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "greedy_T", "temp", "temp1", "top_k", "top_p", "top_kp"])
    kw: dict = dict(max_new_tokens=rng.randint(1, 24), n=rng.choice([1, 1, 2, 3, 4, 6]),
                    ignore_eos=rng.random() < 0.5,
                    stop_token_ids=rng.sample(range(VOCAB), rng.choice([0, 0, 1, 2, 3, 6])),
                    seed=None if rng.random() < 0.3 else rng.randrange(2 ** 40))
    if kind == "greedy":  # greedy rows ignore top-k/top-p; mu is tempered by T
        kw.update(greedy=True, temperature=rng.choice([1.0, 0.7]), top_k=rng.choice([0, 3]))
    elif kind == "greedy_T":
        kw.update(temperature=0.0)
    else:
        kw.update(temperature=1.0 if kind == "temp1" else rng.choice(
            [round(rng.uniform(0.3, 1.6), 2), 0.05, 3.0]))
        if kind in ("top_k", "top_kp"):
            kw.update(top_k=rng.choice([rng.randint(1, 12), 1, VOCAB, 200]))
        if kind in ("top_p", "top_kp"):
            kw.update(top_p=round(rng.uniform(0.3, 0.95), 2))
    return SamplingParams(**kw)


def random_workload(seed: int, swaps: bool = False):
    """(engine options, requests, batches, swaps): batches are (requests to add, steps to run
    after adding them or "generate", None or where a first offer of the batch has a request
    the engine must refuse), swaps {step number: weight versions to load before it}."""
    rng = random.Random(seed)
    opts = dict(num_slots=rng.randint(3, 8),
                max_len=rng.choice([rng.randint(21, 48)] * 3 + [8, 12]),
                sync_every=rng.choice([1, 1, 2, 3, 5]), compact=rng.random() < 0.6,
                kv_bucket=rng.choice([None, None, 4, 16]),
                max_prefill_tokens=rng.choice([4096, 32, 8]), seed=rng.randrange(1000))
    if swaps:
        opts["kv_policy"] = rng.choice(["keep", "recompute"])
    longest = min(20, opts["max_len"] - 1)
    reqs = [Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, longest))],
                    random_params(rng)) for i in range(rng.randint(5, 30))]
    batches, i = [], 0
    while i < len(reqs):
        k = rng.randint(1, max(1, len(reqs) // 3))
        # 40 steps: often enough to drain the engine, which then restarts from idle; "generate":
        # submitted by Engine.generate, which runs everything queued to the end
        how = "generate" if not swaps and rng.random() < 0.1 else rng.choice([0, 1, 1, 2, 3, 6, 40])
        # first offered with a prompt too long for max_len at this position: refused whole
        refused_at = rng.randint(0, k) if rng.random() < 0.1 else None
        batches.append((reqs[i:i + k], how, refused_at))
        i += k
    swap_at: dict[int, list[int]] = {}  # step -> versions loaded before it, in order
    if swaps:
        for v, at in enumerate(sorted(rng.choices(range(1, 40), k=rng.randint(1, 2))), start=1):
            swap_at.setdefault(at, []).append(v)
    return opts, reqs, batches, swap_at


class Fault(Exception):
    """An error injected into an admission (what an out-of-memory prefill would raise)."""


# where an injected Fault is raised: before the prompts' prefill, after the prefix copies, or
# after the first tokens were drawn and the slots' state written (a sample already live)
FAULT_SITES = ("prefill", "copies", "first tokens")


def inject_faults(engine: Engine) -> dict:
    """Wrap the engine's admission steps so that each raises Fault(site, armed[site]) while
    `armed[site]` is set (a step number; it is then cleared); returns `armed`."""
    armed = dict.fromkeys(FAULT_SITES, False)

    def wrap(site, fn, after: bool):
        def wrapped(*args):
            out = fn(*args) if after or not armed[site] else None
            if armed[site]:
                at, armed[site] = armed[site], False
                raise Fault(site, at)
            return out
        return wrapped

    engine._prefill = wrap("prefill", engine._prefill, False)
    engine._copy_prefixes = wrap("copies", engine._copy_prefixes, True)
    engine.st.start = wrap("first tokens", engine.st.start, True)
    return armed


def bad_request(kind: int, max_len: int) -> tuple[Request, str]:
    """A request that add_requests refuses (and with it the whole list), and what the error
    names: a prompt too long, an id outside the vocabulary, a stop id outside it, n set to 0
    after the SamplingParams were built."""
    if kind % 4 == 3:
        params = SamplingParams(max_new_tokens=3)
        params.n = 0
        return Request("bad", [1], params), "n=0"
    return [(Request("bad", [1] * max_len), "prompt has"),
            (Request("bad", [1, VOCAB]), rf"prompt ids \[{VOCAB}\] are outside"),
            (Request("bad", [1], SamplingParams(stop_token_ids=[VOCAB + 3])), "stop_token_ids"),
            ][kind % 4]


def run_mix(opts, batches, swap_at, models, faults: dict | None = None) -> tuple[list, Engine]:
    """Run the workload on one engine over a private copy of the version-0 model; before step
    number `at` (counted from 1) of `swap_at`, load the weights of its versions. `faults`:
    {step number: site}: the next admission from that step on fails there (the step is then
    retried, and the engine must compute what it would have without the failure), unless
    `generate` comes first; those that fired are removed from it."""
    model = copy.deepcopy(models[0])
    engine = Engine(model, pack_weights=False, **opts)
    armed, faults = inject_faults(engine), {} if faults is None else faults
    out, steps, refusals = [], 0, 0

    def step():
        nonlocal steps, out
        steps += 1
        for v in swap_at.get(steps, []):
            engine.load_weights(lambda: [p.copy_(q) for p, q in
                                         zip(model.parameters(), models[v].parameters())],
                                version=v)
        if steps in faults:
            armed[faults[steps]] = steps
        while True:
            try:
                engine.step()
                break
            except Fault as e:  # undone: each slot free or holding a sample; retry the step
                assert len(engine._free) + sum(i is not None for i in engine._slot) == \
                    engine.num_slots
                del faults[e.args[1]]
        if steps % 3 == 0:
            out += engine.poll_finished()

    for batch, how, refused_at in batches:
        if refused_at is not None:  # add_requests queues none of a list it refuses
            bad, named = bad_request(refusals, opts["max_len"])
            refusals += 1
            with pytest.raises(ValueError, match=f"request 'bad': .*{named}"):
                engine.add_requests(batch[:refused_at] + [bad] + batch[refused_at:])
        if how == "generate":
            armed.update(dict.fromkeys(FAULT_SITES, False))
            out += engine.generate(batch)
            continue
        engine.add_requests(batch)
        for _ in range(how):
            step()
    while engine.has_work():
        step()
    out += engine.poll_finished()
    return sorted(out, key=lambda c: (int(c.request_id[1:]), c.sample_idx)), engine


def alone(model, opts, req: Request, arrival: int) -> Engine:
    """A fresh engine with only `req` queued (n slots, every slot computed, harvest every
    step), as if it had arrived `arrival`-th: a request without its own seed takes its keys
    from the engine seed and its arrival order."""
    engine = Engine(model, num_slots=req.params.n, max_len=opts["max_len"], seed=opts["seed"],
                    pack_weights=False, compact=False, sync_every=1)
    engine._n_requests = arrival
    engine.add_requests([req])
    return engine


def run_alone(engine: Engine) -> list:
    while engine.has_work():
        engine.step()
    return sorted(engine.poll_finished(), key=lambda c: c.sample_idx)


# ----- the reference draw -----------------------------------------------------------------------
def reference_draw(logits_V: torch.Tensor, p: SamplingParams, u: float):
    """(token, mu, knife edge or '') of the engine's sampling (rollout/sampling.py), computed in
    float64 from fp32 logits: greedy = argmax with mu = log_softmax(logits / T) untruncated (T =
    temperature, 1 if 0); else the first token whose CDF of softmax(logits / T), truncated by
    top-k then top-p and renormalised, passes u. The knife edge says why the decision may flip
    by fp32 rounding (a gap or a mass within EDGE)."""
    logits = logits_V.double()
    if p.is_greedy:
        top2 = logits.topk(2).values
        tok = int(logits.argmax())
        mu = torch.log_softmax(logits / (p.temperature or 1.0), -1)[tok].item()
        edge = "greedy tie" if top2[0] - top2[1] < EDGE * max(1.0, top2[0].abs().item()) else ""
        return tok, mu, edge
    x, edge, eps = logits / p.temperature, "", EDGE * scale(p)
    if 0 < p.top_k < VOCAB:
        xs = x.sort(descending=True).values
        if xs[p.top_k - 1] - xs[p.top_k] < eps * max(1.0, xs[0].abs().item()):
            edge = "top-k cut"
        x = torch.where(x >= xs[p.top_k - 1], x, float("-inf"))
    if p.top_p < 1:
        xs, order = x.sort(descending=True)
        probs = xs.softmax(-1)
        before = probs.cumsum(-1) - probs
        if (probs > 0).logical_and((before - p.top_p).abs() < eps).any():
            edge = edge or "top-p cut"
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[order] = before < p.top_p
        x = x.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(x, -1)
    cdf = logp.exp().cumsum(-1)
    last = int(torch.nonzero(logp > float("-inf")).max())
    tok = min(int((cdf <= u).sum()), last)
    if ((cdf[:last] - u).abs() < eps).any():
        edge = edge or "CDF boundary"
    return tok, logp[tok].item(), edge


def uniforms(seed: int, sample_idx: int, n: int) -> list[float]:
    key = torch.full((n,), stream_key(seed, sample_idx), dtype=torch.int64)
    return hashed_uniform(key, torch.arange(n)).tolist()


@torch.no_grad()
def reference_logits(models: dict, c, policy: str, max_len: int) -> torch.Tensor:
    """[len(completion), V] logits each completion token was drawn from, by the reference of
    the module docstring (`policy` None: no swap, = "recompute" with one version)."""
    P, ids, vers = c.num_prompt_tokens, c.prompt_ids + c.completion_ids, c.token_versions
    if policy != "keep" or len(set(vers)) == 1:
        full = {v: models[v](torch.tensor([ids[:-1]]))[0, P - 1:] for v in set(vers)}
        return torch.stack([full[v][k] for k, v in enumerate(vers)])
    cache = KVCache.for_model(models[0], 1, max_len)
    slot = torch.zeros(1, dtype=torch.int64)
    out = [models[vers[0]](torch.tensor([c.prompt_ids]), positions=torch.arange(P)[None],
                           kv_cache=cache, slots=slot)[0, -1]]
    for k in range(1, len(vers)):
        pos = torch.tensor([[P + k - 1]])
        out.append(models[vers[k]](torch.tensor([[ids[P + k - 1]]]), positions=pos,
                                   kv_cache=cache, slots=slot)[0, -1])
    return torch.stack(out)


def reference(models, c, p: SamplingParams, seed: int, policy, max_len) -> list:
    """[(token, mu, knife edge)] the reference draws along completion `c`'s own tokens."""
    logits = reference_logits(models, c, policy, max_len)
    us = uniforms(seed, c.sample_idx, len(c.completion_ids))
    return [reference_draw(logits[k], p, u) for k, u in enumerate(us)]


def compare(tokens: list, want: list, mu: list, want_mu: list, ref: list, tol: float,
            where: str, forced: bool) -> list[str]:
    """Compare a completion's tokens and mu with `want`'s, `ref` being the reference drawn along
    these tokens: a token may differ only at a knife edge of the reference, a mu only where
    top-k/top-p may cut by rounding (the token kept, the renormalisation not). `forced`: `want`
    was drawn along these same tokens (the reference), so the positions after a difference
    still compare; else the two diverge there and the rest is not compared. Returns the knife
    edges that excused a difference."""
    excused = []
    for k, (tok, w, m, wm) in enumerate(zip(tokens, want, mu, want_mu)):
        edge = ref[k][2]
        if tok != w:
            assert edge, (f"{where}: token {k} is {tok}, expected {w}, not at a knife edge "
                          f"(reference draw {ref[k][0]})\ngot:      {tokens}\nexpected: {want}")
            excused.append(f"{where} token {k}: {edge}")
            if not forced:
                return excused
        elif abs(m - wm) > tol:
            assert "cut" in edge, (where, k, m, wm)
            excused.append(f"{where} token {k} mu: {edge}")
    if not forced:
        assert len(tokens) == len(want), (where, tokens, want)
    return excused


def check_rules(c, p: SamplingParams, max_len: int, where: str) -> None:
    """Stop and length rules: a stop id ends a completion (and only the last token is one),
    else it runs to max_new_tokens or the cache's max_len."""
    cap = min(p.max_new_tokens, max_len - c.num_prompt_tokens)
    assert 1 <= len(c.completion_ids) <= cap, where
    assert len(c.logp) == len(c.completion_ids) == len(c.token_versions), where
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    hit = [j for j, t in enumerate(c.completion_ids) if t in stops]
    if c.finish_reason == "stop":
        assert hit == [len(c.completion_ids) - 1], (where, hit)
    else:
        assert c.finish_reason == "length" and not hit and len(c.completion_ids) == cap, where


def check_workload(models: dict, seed: int, swaps: bool = False, tally: dict | None = None):
    """Run workload `seed` and check every completion; returns the knife edges that excused a
    difference. `tally` counts what the workload exercised."""
    opts, reqs, batches, swap_at = random_workload(seed, swaps)
    ctx = f"workload seed {seed}, options {opts}, swaps {swap_at}"
    got, engine = run_mix(opts, batches, swap_at, models)
    assert len(got) == sum(r.params.n for r in reqs), ctx
    assert not engine.has_work() and all(i is None for i in engine._slot), ctx
    by_req: dict = {}
    for c in got:
        by_req.setdefault(c.request_id, []).append(c)
    excused, L = [], opts["max_len"]
    for i, r in enumerate(reqs):
        mine = by_req[r.request_id]
        assert [c.sample_idx for c in mine] == list(range(r.params.n)), (ctx, r.request_id)
        single = alone(models[0], opts, r, i)
        key_seed = single._queue[0].key_seed
        want = None if swaps else run_alone(single)
        for j, c in enumerate(mine):
            where = f"{ctx}: request {r.request_id} sample {c.sample_idx}"
            assert c.prompt_ids == r.prompt_ids and c.num_prompt_tokens == len(r.prompt_ids)
            check_rules(c, r.params, L, where)
            vers = c.token_versions
            assert vers == sorted(vers) and set(vers) <= set(range(len(models))), (where, vers)
            ref = reference(models, c, r.params, key_seed, opts.get("kv_policy"), L)
            tol = MU_TOL * scale(r.params)
            excused += compare(c.completion_ids, [t for t, _, _ in ref], c.logp,
                               [m for _, m, _ in ref], ref, tol, where + " vs reference", True)
            if want is not None:  # the mix against the request alone
                a, b = c, want[j]
                diverged = compare(a.completion_ids, b.completion_ids, a.logp, b.logp, ref, tol,
                                   where + " vs alone", False)
                excused += diverged
                if not diverged or "mu:" in diverged[-1]:
                    assert a.finish_reason == b.finish_reason, where
    if tally is not None:
        st, params = engine.stats, {r.request_id: r.params for r in reqs}
        for key, n in [("workloads", 1), ("requests", len(reqs)), ("samples", len(got)),
                       ("slot moves", st.slot_moves), ("prefix copies", st.kv_copies),
                       ("prompts prefilled again", st.prefill_prompts - len(reqs)),
                       ("harvests skipped", st.decode_steps - st.harvests),
                       ("stopped", sum(c.finish_reason == "stop" for c in got)),
                       ("capped by max_len", sum(c.finish_reason == "length" and len(
                           c.completion_ids) < params[c.request_id].max_new_tokens for c in got)),
                       ("refused batches", sum(b[2] is not None for b in batches)),
                       ("generate batches", sum(b[1] == "generate" for b in batches)),
                       ("swapped samples", sum(len(set(c.token_versions)) > 1 for c in got)),
                       ("swapped samples kept", sum(len(set(c.token_versions)) > 1 for c in got)
                        if opts.get("kv_policy") == "keep" else 0),
                       ("recomputed tokens", st.recompute_tokens)]:
            tally[key] = tally.get(key, 0) + int(n)
    return excused


# ----- the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return {v: make_model(1 + 100 * v) for v in range(3)}


@pytest.fixture(scope="module")
def mistral():  # a sliding window of 5: most prompts and completions outgrow it
    return {v: make_model(4 + 100 * v, window=5) for v in range(3)}


def fuzz(models, seeds, swaps: bool = False) -> dict:
    tally: dict = {"knife edges": 0}
    for seed in seeds:
        tally["knife edges"] += len(check_workload(models, seed, swaps, tally))
    return tally


@pytest.mark.parametrize("family, seeds", [("llama", range(0, 28)), ("mistral", range(100, 118))])
def test_mix_equals_each_request_alone(family, seeds, llama, mistral):
    """Random workloads: every completion is what its request gives alone in a fresh engine and
    what the reference draws; the tally checks that the workloads exercised what they are for."""
    tally = fuzz({"llama": llama, "mistral": mistral}[family], seeds)
    for what in ("slot moves", "prefix copies", "prompts prefilled again", "harvests skipped",
                 "stopped", "capped by max_len", "refused batches", "generate batches"):
        assert tally[what] > 0, (what, tally)
    assert tally["knife edges"] <= tally["samples"] // 100, tally  # rare, or not rounding


@pytest.mark.parametrize("family, seeds", [("llama", range(0, 22)), ("mistral", range(200, 214))])
def test_weight_swaps_match_the_reference(family, seeds, llama, mistral):
    """One or two `load_weights` at random steps (kv_policy keep or recompute, per workload):
    every token is what the policy's reference draws under the weights of its version."""
    tally = fuzz({"llama": llama, "mistral": mistral}[family], seeds, swaps=True)
    for what in ("swapped samples", "swapped samples kept", "recomputed tokens"):
        assert tally[what] > 0, (what, tally)
    assert tally["knife edges"] <= tally["samples"] // 100, tally


def check_faults(models: dict, seeds, swaps: bool) -> list[str]:
    """Run each workload with and without admissions that fail at random steps (`run_mix`'s
    `faults`); the completions must be equal bit for bit. Returns the sites that fired."""
    fired: list[str] = []
    for seed in seeds:
        opts, _, batches, swap_at = random_workload(seed, swaps)
        rng = random.Random(seed)
        faults = {at: rng.choice(FAULT_SITES) for at in rng.sample(range(1, 30), 6)}
        planned = dict(faults)
        want, _ = run_mix(opts, batches, swap_at, models)
        got, engine = run_mix(opts, batches, swap_at, models, faults)
        fired += [site for at, site in planned.items() if at not in faults]
        assert [vars(c) | {"timing": None} for c in got] == \
               [vars(c) | {"timing": None} for c in want], (seed, planned, faults)
        assert not engine.has_work() and len(engine._free) == engine.num_slots
    return fired


@pytest.mark.parametrize("swaps", [False, True])
def test_failed_admissions_change_no_output(swaps, llama):
    """Admissions that fail (before the prefill, after the prefix copies, after the first
    tokens) are undone and the step retried: every completion is then, bit for bit, what the
    same workload gives without the failures. (An admission that raised used to lose its
    requests and leave their slots taken.)"""
    assert set(check_faults(llama, range(300, 306), swaps)) == set(FAULT_SITES)


def test_the_fault_check_fails_an_engine_that_does_not_requeue(llama, monkeypatch):
    import rollout.engine
    monkeypatch.setattr(rollout.engine, "_requeue", lambda queue, plan, to_prefill: None)
    with pytest.raises(AssertionError):
        check_faults(llama, range(300, 302), False)


def _shared_key(monkeypatch):  # every sample of a request draws with sample 0's key
    import rollout.engine
    monkeypatch.setattr(rollout.engine, "stream_key", lambda seed, i: stream_key(seed, 0))


def _no_prefix_copy(monkeypatch):  # later samples of a group attend to a zero/stale prompt
    monkeypatch.setattr(Engine, "_copy_prefixes", lambda self, plan, prefilled: None)


def _no_recompute(monkeypatch):  # kv_policy="recompute" keeps the old keys/values
    monkeypatch.setattr(Engine, "_recompute", lambda self: None)


@pytest.mark.parametrize("breakage, swaps", [(_shared_key, False), (_no_prefix_copy, False),
                                             (_no_recompute, True)])
def test_the_fuzz_fails_broken_engines(breakage, swaps, llama, monkeypatch):
    """The checks are not vacuous: engines broken in ways a scheduling bug could break them
    fail the first few workloads."""
    breakage(monkeypatch)
    with pytest.raises(AssertionError, match="not at a knife edge"):
        fuzz(llama, range(0, 4), swaps)
