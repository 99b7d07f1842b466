"""The generation engine: static KV cache, continuous batching, host-sync-free decode, mu per token.

    engine = Engine(model, num_slots=64, max_len=2048)
    done = engine.generate([Request(i, ids, SamplingParams(n=4, max_new_tokens=256)) for ...])
    # or incrementally (the generator loop): add_requests(...); while has_work(): step();
    # poll_finished(); and between two steps: load_weights(apply_fn, version), cancel(ids)

**Slots.** The KV cache (model/kv_cache.py) has `num_slots` rows of `max_len` positions; one slot
holds one sample. Per-slot state (tokens, mu, versions, length, live flag, sampling parameters,
stop ids, and the uniforms of every draw the sample may make, hashed at admission) lives in device
tensors (`_SlotState`), so a decode step is a fixed sequence of kernels
over the first R slots: `model(last_token[R, 1], positions=[R, 1], kv_cache)` with `slots=None`
(no cache gather: slots [0, R) of the cache are a view), sampling, and the state update. Slots
among them that are free or finished compute garbage at position 0 that nobody reads. Decode
attends only to the first `Lb` cache positions: a host-side upper bound on every live length (no
sync needed), rounded up to `kv_bucket` (on CPU: the whole cache once that passes half of it,
`FULL_READ_ABOVE`).

**Rows (`compact`, on by default with eager decode on CPU).** Samples finish at different lengths,
and once the queue is empty (the end of an RL step's batch) their slots stay free. With `compact`
each harvest moves the samples above the n owned slots into the freed slots below (their state
rows, their cached keys/values and their bookkeeping: `stats.slot_moves`), and free slots are
taken lowest first, so the owned slots are always [0, n) and decode computes R = n rows instead of
`num_slots`: SmolLM2-135M in fp32 took 88 ms a decode step at 16 rows and 42 ms at 4
(BENCHMARKS.md, "Row compaction"). A sample's draws depend on its key, never on its slot, so a
move changes no draw; the row count does change the matmuls' rounding (fp32: mu within 1e-5).
Without it (CUDA, where each (R, Lb) would be a graph of its own) R = num_slots.

**One engine iteration (`step`).**
1. Harvest, at most every `sync_every` steps (1 on CPU, where a sync is free; 8 on CUDA), when
   queued work could use free slots, or when a sample has certainly finished (the host counts the
   step of its last possible token: max_new_tokens or the cache's end): one device->host read of
   the live flags, then the finished rows. A slot that finishes on a stop id between two harvests
   idles until the next: that is the tradeoff. (Without the last rule a batch whose samples all
   ran to max_new_tokens decoded up to `sync_every` - 1 steps of nothing after its end.)
2. Admit queued requests into free slots at once (continuous batching). The n samples of a request
   share ONE prompt prefill: the prompt is prefilled into one slot (several new prompts are batched
   right-padded, sorted by length, `slots=` their slots), its cache prefix [0, P) is copied to the
   other samples' slots, and every sample draws its first token from the same last-position
   logits. When fewer than n slots are free, the rest of the group waits; its samples later copy
   the prefix from a still-running sibling (or the prompt is prefilled again if none is left).
3. One decode step over the first R slots (eager, or a replayed CUDA graph; `compile_decode`).

**Weights (`load_weights(apply_fn, version)`, between two steps).** `apply_fn()` overwrites the
model's parameters in place (addresses must not change: CUDA graphs hold them; if they do change
the graphs are dropped and re-captured), then `engine.version = version`. Tokens sampled afterwards
carry the new version. What happens to the keys/values already cached is the `kv_policy`:
- "keep" (default): in-flight sequences continue on their old cached keys/values; new tokens are
  computed by the new weights attending to old-weight KV. Cheapest; each token carries the version
  that sampled it, and the trajectory's staleness is its oldest token's version. Samples of a
  group still queued at the swap start from the group's old-weight prompt logits (their first
  token carries the old version).
- "recompute": every in-flight sequence's prompt + generated tokens are prefilled again with the
  new weights (batched, no logits), so tokens sampled after the swap are exactly what a fresh run
  of the new weights would give for that prefix. Costs one prefill of all in-flight tokens;
  queued samples get their prompt prefilled again.
**Bad input and failures.** `add_requests` checks every request (prompt ids, SamplingParams,
stop ids against the vocabulary) and queues copies of all of them or, naming the first bad one,
none. An admission that raises (an out-of-memory prefill, say) is undone before the error goes
on: its samples are queued again, every slot is free or running as before, and the error's note
names the requests; `cancel(ids)` drops requests (queued, running or unpolled). `generate` that
raises cancels its own requests, so a retry starts clean and draws the same samples.
Sampling and mu conventions: rollout/sampling.py.
"""
from __future__ import annotations

import math
import numbers
import time
from collections import Counter, deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from model.kv_cache import KVCache
from model import attention as attn
from rollout import packed_linear, stacked
from rollout.packed_linear import PackedLinears
from rollout.sampling import hashed_uniform, mix32, process_logits, sample, stream_key

KV_POLICIES = ("keep", "recompute")
# On CPU, decode reads the whole cache once the live bound passes max_len / this: a prefix of each
# slot's [max_len, head_dim] block is a strided read, which the batched matmuls took ~2x longer
# over than a contiguous one of the same size when this was set (2-core EPYC, 1.74 vs 0.85 ms).
# Under inference_mode the two came out even (a run within 0.3% either way; BENCHMARKS.md
# "Generation"), so this is kept as the measured-safe choice, not a gain.
FULL_READ_ABOVE = 2
COMPILE_MODES = (False, True, "compile", "cudagraph")


def decode_mode(choice: str, device: torch.device) -> bool | str:
    """`generator.decode` as the Engine's `compile_decode` ('auto': graphs where there is CUDA)."""
    if choice == "cudagraph" and device.type != "cuda":
        raise ValueError(f"generator.decode='cudagraph' needs a CUDA device, this rank runs on "
                         f"{device}; use 'auto' or 'eager'")
    if choice == "auto":
        return "cudagraph" if device.type == "cuda" else False
    return {"eager": False, "cudagraph": "cudagraph", "compile": "compile"}[choice]


# The compiled decode step's wrapper (the code that calls its kernels and matmuls) is C++ rather
# than Python (inductor's `cpp_wrapper`) on CPU for models of at most this many layers. Measured
# (BENCHMARKS.md "Generation"): the vs_trl model's 4 layers took 0.88-0.97x the batch time, its
# Python wrapper ~0.3 ms of a ~2.5 ms step, with no longer a cold compile; SmolLM2's 30 layers
# gained nothing (their matmuls dwarf the calls) and compiled 45 s longer cold (166-178 s
# against 121-132 s on 2 cores).
CPP_WRAPPER_MAX_LAYERS = 8


def compile_options(device: torch.device, num_layers: int, sharded: bool = False) -> dict:
    """inductor's options for the compiled decode step (CPP_WRAPPER_MAX_LAYERS). On CUDA the step
    is replayed as a CUDA graph, which has no per-call wrapper cost to save. A tensor-parallel
    model (`sharded`) keeps the Python wrapper: the C++ one cannot lower its collectives (the
    first step failed with "arg type Any is not yet supported by custom_op_wrapper")."""
    small = device.type == "cpu" and num_layers <= CPP_WRAPPER_MAX_LAYERS and not sharded
    return {"cpp_wrapper": True} if small else {}


@dataclass
class SamplingParams:
    """How one request is sampled. `temperature == 0` means greedy."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # on top of the model's eos ids
    ignore_eos: bool = False  # when True only stop_token_ids stop a completion
    n: int = 1  # samples of this prompt (a GRPO group); they share one prefill
    seed: int | None = None  # None: derived from the engine seed and the request's arrival order

    def __post_init__(self) -> None:
        bad = _params_problems(self)
        if bad:
            raise ValueError("invalid SamplingParams: " + ", ".join(bad))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def _params_problems(p: SamplingParams) -> list[str]:
    """What makes `p` unusable, one "field=value (rule)" each. Checked at construction and again
    at submission: a field set afterwards is not checked by the dataclass, and a float n, seed or
    stop id, or a max_new_tokens or n set to 0, failed only at admission (the request's slots
    taken for good); a float top_k was truncated and a NaN temperature sampled at 1."""
    bad = []

    def need(ok: bool, name: str, rule: str) -> None:
        if not ok:
            bad.append(f"{name}={getattr(p, name)!r} ({rule})")

    def is_int(v) -> bool:
        return isinstance(v, numbers.Integral)

    def is_num(v) -> bool:
        return isinstance(v, numbers.Real)

    need(is_int(p.max_new_tokens) and p.max_new_tokens >= 1, "max_new_tokens",
         "must be an int >= 1")
    need(is_num(p.temperature) and p.temperature >= 0, "temperature",  # NaN >= 0 is False
         "must be a number >= 0; 0 = greedy")
    need(is_num(p.top_p) and 0 < p.top_p <= 1, "top_p", "must be in (0, 1]")
    need(is_int(p.top_k) and p.top_k >= 0, "top_k", "must be an int >= 0; 0 = off")
    need(is_int(p.n) and p.n >= 1, "n", "must be an int >= 1")
    need(p.seed is None or is_int(p.seed), "seed", "must be an int or None")
    stops = p.stop_token_ids
    need(isinstance(stops, (list, tuple, set, frozenset, range))
         and all(is_int(t) and t >= 0 for t in stops), "stop_token_ids",
         "must be a list of token ids >= 0")
    return bad


@dataclass
class Request:
    request_id: Any
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    """One sample of one request. `logp[k]` (mu) and `token_versions[k]` belong to
    `completion_ids[k]`. `timing`: perf_counter stamps submitted/admitted/first_token/finished
    (host enqueue times on CUDA; `finished` is when the harvest saw it) and derived seconds."""

    request_id: Any
    sample_idx: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logp: list[float]
    token_versions: list[int]
    finish_reason: str  # "stop" | "length"
    timing: dict[str, float]
    num_prompt_tokens: int

    @property
    def min_version(self) -> int:
        return min(self.token_versions)


@dataclass
class EngineStats:
    """Counters since construction (tests assert on them; benchmarks report them)."""

    prefill_calls: int = 0  # model forwards that prefilled prompts
    prefill_prompts: int = 0  # prompts prefilled (one per request, not per sample)
    prefill_tokens: int = 0  # real prompt tokens prefilled
    prefill_padded_tokens: int = 0  # tokens through the model, padding included
    kv_copies: int = 0  # samples whose prompt KV was copied from a sibling slot
    decode_steps: int = 0
    harvests: int = 0  # device->host syncs of the live flags
    generated_tokens: int = 0  # completion tokens of harvested samples
    recompute_tokens: int = 0  # tokens re-prefilled by kv_policy="recompute"
    decode_rows: int = 0  # slot rows computed by decode steps, live or not (`compact`)
    slot_moves: int = 0  # samples moved to a lower slot by `compact`


@dataclass
class _Group:
    """Host bookkeeping of one request while any of its samples is queued."""

    request: Request
    key_seed: int
    pending: deque  # sample indices not yet admitted
    submitted_at: float
    logits_V: Tensor | None = None  # last-prompt-position logits, kept while samples wait
    logits_version: int = 0
    live_slots: set = field(default_factory=set)  # running samples: their cache holds the prompt


class _SlotState:
    """Per-slot device tensors. tokens/logp/version have one scratch column (index max_len) that
    rows which are not live write their garbage to."""

    def __init__(self, S: int, L: int, device: torch.device, max_stop: int = 4):
        i64 = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(S, L + 1, **i64)
        self.logp = torch.zeros(S, L + 1, dtype=torch.float32, device=device)
        self.version = torch.zeros(S, L + 1, **i64)
        self.seq_len = torch.ones(S, **i64)  # prompt + generated tokens
        # the position decode feeds each slot: its last token's (garbage 0 if not live). Set
        # before the (compiled) step, which then reads it as an input: FlexAttention's compiled
        # mask may only capture input tensors (inductor's CPU template refuses one computed)
        self.pos = torch.zeros(S, 1, **i64)
        self.gen = torch.zeros(S, **i64)  # generated tokens
        self.max_new = torch.ones(S, **i64)
        # the uniform of each completion token's draw (rollout/sampling.py: a hash of the sample's
        # key and the token's index), hashed for the whole completion at admission: a decode
        # step then gathers one instead of running ~25 small integer kernels
        self.u = torch.zeros(S, L, dtype=torch.float64, device=device)
        self.top_k = torch.zeros(S, **i64)
        self.temp = torch.ones(S, dtype=torch.float32, device=device)
        self.top_p = torch.ones(S, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(S, dtype=torch.bool, device=device)
        self.live = torch.zeros(S, dtype=torch.bool, device=device)  # assigned and not finished
        self.owned = torch.zeros(S, dtype=torch.bool, device=device)  # assigned, not harvested
        self.stopped = torch.zeros(S, dtype=torch.bool, device=device)  # finished on a stop id
        self.stop_ids = torch.full((S, max_stop), -1, **i64)
        self.version_now = torch.zeros(1, **i64)

    def _tensors(self) -> dict[str, Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, Tensor)}

    def _rows_tensors(self) -> dict[str, Tensor]:
        return {k: v for k, v in self._tensors().items() if k != "version_now"}

    def rows(self, R: int) -> "_SlotState":
        """The state of slots [0, R) as views (writes land here); itself when R is all."""
        if R == self.seq_len.shape[0]:
            return self
        view = object.__new__(_SlotState)
        vars(view).update({k: v[:R] for k, v in self._rows_tensors().items()},
                          version_now=self.version_now)
        return view

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Copy rows `src` to rows `dst`; the rows left behind are neither owned nor live."""
        for t in self._rows_tensors().values():
            t[dst] = t[src]
        self.owned[src] = False
        self.live[src] = False

    def snapshot(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self._tensors().items()}

    def restore(self, snap: dict[str, Tensor]) -> None:
        for k, v in self._tensors().items():
            v.copy_(snap[k])

    def set_positions(self) -> None:
        """`pos` for the next decode step: each slot's last token (0 where not live)."""
        self.pos.copy_(torch.where(self.live, self.seq_len - 1, 0)[:, None])

    def append(self, tok: Tensor, mu: Tensor, L: int) -> None:
        """Record each live row's new token, its mu and the weight version, then end the rows
        that stopped, reached max_new or the cache's length L. Rows not live write to the
        scratch column and stay as they are."""
        live = self.live
        col = torch.where(live, self.seq_len, L)[:, None]
        self.tokens.scatter_(1, col, tok[:, None])
        self.logp.scatter_(1, col, mu[:, None])
        self.version.scatter_(1, col, self.version_now.expand(col.shape[0], 1))
        self.seq_len += live
        self.gen += live
        stop = (tok[:, None] == self.stop_ids).any(-1)
        done = live & (stop | (self.gen >= self.max_new) | (self.seq_len >= L))
        self.stopped |= done & stop
        self.live &= ~done

    def start(self, table: Sequence[Tensor], logits_RV: Tensor, flags: tuple, L: int) -> None:
        """Start R admitted samples: write their prompts and parameters (`_sample_table`'s host
        tensors), hash the uniforms of every draw they may make, draw their first tokens from
        `logits_RV` (`_sample_rows` with `flags`) and end those that stop at once."""
        M = int(table[1][:, 2].max())  # the most tokens any of these samples may draw (host)
        dev = self.tokens.device
        prompts, ints, floats, stops = (t.to(dev, non_blocking=True) for t in table)
        R = ints.shape[0]
        slot, P, max_new, key, top_k, greedy, ver = ints.unbind(1)
        greedy = greedy.bool()
        self.tokens[slot, : prompts.shape[1]] = prompts
        self.max_new[slot], self.top_k[slot], self.greedy[slot] = max_new, top_k, greedy
        u_RM = hashed_uniform(key[:, None].expand(R, M), torch.arange(M, device=dev).expand(R, M))
        self.u[slot, :M] = u_RM
        self.temp[slot], self.top_p[slot], self.stop_ids[slot] = floats[:, 0], floats[:, 1], stops
        truncate, tempered, mode = flags
        tok, mu = _sample_rows(logits_RV, floats[:, 0], top_k, floats[:, 1], greedy,
                               None if mode == "greedy" else u_RM[:, 0], truncate, tempered, mode)
        self.tokens[slot, P], self.logp[slot, P], self.version[slot, P] = tok, mu, ver
        self.seq_len[slot], self.gen[slot] = P + 1, 1
        stop = (tok[:, None] == stops).any(-1)
        self.stopped[slot] = stop
        self.live[slot] = ~(stop | (max_new <= 1) | (P + 1 >= L))
        self.owned[slot] = True

    def read(self, rows: list[int]) -> tuple[list, ...]:
        """(seq_len, tokens, logp, version, stopped) of these rows as host lists, each cut to the
        longest row."""
        idx = torch.tensor(rows, device=self.seq_len.device)
        seq_len = self.seq_len[idx].tolist()
        width = max(seq_len)
        out = [t[idx, :width].tolist() for t in (self.tokens, self.logp, self.version)]
        return (seq_len, *out, self.stopped[idx].tolist())

    def grow_stop_ids(self, k: int) -> None:
        old = self.stop_ids
        self.stop_ids = torch.full((old.shape[0], k), -1, dtype=old.dtype, device=old.device)
        self.stop_ids[:, : old.shape[1]] = old


class _CacheView(KVCache):
    """The first `Lb` positions of a KVCache's first `R` slots (None: all), as views: writes
    land in the full cache."""

    def __init__(self, cache: KVCache, Lb: int, R: int | None = None):  # nothing is allocated
        self.kv = cache.kv[:, :, :R, :, :Lb]
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self.rope, self._whole = cache.rope, cache.whole()
        self.qkv, self.gate_up = cache.qkv, cache.gate_up

    def whole(self) -> KVCache:
        return self._whole


def _completion(info: dict, tokens: list, logp: list, versions: list, n: int, stopped: bool,
                now: float) -> Completion:
    """The Completion of a harvested sample: its slot's host info and its rows up to length n."""
    group, P = info["group"], info["P"]
    t = dict(submitted=group.submitted_at, admitted=info["admitted"],
             first_token=info["first_token"], finished=now)
    t.update(prefill_s=t["first_token"] - t["admitted"], decode_s=now - t["first_token"])
    return Completion(group.request.request_id, info["sample_idx"], list(group.request.prompt_ids),
                      tokens[P:n], logp[P:n], versions[P:n], "stop" if stopped else "length", t, P)


def _sample_table(plan, stop_sets: list[list[int]], L: int, K: int):
    """Host tensors of the admitted samples `plan` [(slot, group, sample index)], one row each:
    prompts [R, P_max], ints [R, 7] (slot, P, max_new, key, top_k, greedy, version), floats
    [R, 2] (temperature, top_p) and stop ids [R, K] (-1 padded)."""
    R, P_max = len(plan), max(len(g.request.prompt_ids) for _, g, _ in plan)
    prompts = torch.zeros(R, P_max, dtype=torch.int64)
    ints = torch.zeros(R, 7, dtype=torch.int64)
    floats = torch.zeros(R, 2, dtype=torch.float32)
    stops = torch.full((R, K), -1, dtype=torch.int64)
    for r, ((s, g, i), stop) in enumerate(zip(plan, stop_sets)):
        p, P = g.request.params, len(g.request.prompt_ids)
        prompts[r, :P] = torch.tensor(g.request.prompt_ids)
        greedy = p.is_greedy
        ints[r] = torch.tensor([s, P, min(p.max_new_tokens, L - P), stream_key(g.key_seed, i),
                                0 if greedy else p.top_k, greedy, g.logits_version])
        floats[r, 0] = p.temperature if p.temperature > 0 else 1.0
        floats[r, 1] = 1.0 if greedy else p.top_p
        stops[r, : len(stop)] = torch.tensor(stop, dtype=torch.int64)
    return prompts, ints, floats, stops


def _first_logits(plan, device: torch.device) -> Tensor:
    """[R, V]: the logits each admitted sample draws its first token from, its group's (every
    sample of a group draws from the group's one set of last-prompt-position logits)."""
    groups = list({id(g): g for _, g, _ in plan}.values())
    row = {id(g): r for r, g in enumerate(groups)}
    rows = torch.tensor([row[id(g)] for _, g, _ in plan], device=device)
    return torch.stack([g.logits_V for g in groups])[rows]


def _prefix_copies(plan, prefilled_slots: set[int]) -> list[tuple[int, list[int], int]]:
    """The prompt-KV copies of an admission `plan` [(slot, group, sample index)]: for each group
    with samples not in `prefilled_slots`, (a slot holding its prompt, those samples' slots,
    the prompt's length)."""
    copies: dict[int, tuple[int, list[int], int]] = {}
    for s, g, _ in plan:
        if s not in prefilled_slots:
            src = next(iter(g.live_slots))
            copies.setdefault(id(g), (src, [], len(g.request.prompt_ids)))[1].append(s)
    return list(copies.values())


def _sample_rows(logits_RV, temp_R, top_k_R, top_p_R, greedy_R, u_R, truncate: bool,
                 tempered: bool, mode: str):
    """Sampled token [R] and its mu [R]. Host flags pick the kernels: `truncate` (any row uses
    top-k/top-p), `tempered` (any row's temperature is not 1: else no division, which at 1 would
    change nothing) and `mode` ("greedy": every row, "sample": no row, "mixed")."""
    temp = temp_R if tempered else None
    if truncate:
        x_RV = process_logits(logits_RV, 1.0 if temp is None else temp, top_k_R, top_p_R)
        temp = None
    else:  # sample() normalises and tempers in its one pass: the raw logits are enough
        x_RV = logits_RV.float()
    return sample(x_RV, u_R, {"greedy": True, "sample": False}.get(mode, greedy_R), temp)


def _needs(p: SamplingParams) -> tuple[int, int, int]:
    """Whether a sample needs the top-k/top-p sort, the temperature division and a draw."""
    return (int(not p.is_greedy and (p.top_k > 0 or p.top_p < 1)),
            int(p.temperature > 0 and p.temperature != 1.0), int(not p.is_greedy))


class _Needs:
    """`_needs` counted over a set of slots: the host flags that pick the sampling kernels."""

    def __init__(self, needs=()):
        self.counts = [0, 0, 0]
        for n in needs:
            self.add(n)

    def add(self, needs: tuple[int, int, int], sign: int = 1) -> None:
        self.counts = [c + sign * n for c, n in zip(self.counts, needs)]

    def flags(self, rows: int) -> tuple[bool, bool, str]:
        """(truncate, tempered, mode) of `_sample_rows` for `rows` rows, these counted."""
        truncating, tempered, sampling = self.counts
        mode = "greedy" if sampling == 0 else "sample" if sampling == rows else "mixed"
        return truncating > 0, tempered > 0, mode


class _DecodeGraphs:
    """The decode step as CUDA graphs, one per decode key, all in one memory pool. A key's graph
    is captured at its first use; `clear()` drops them all (parameters replaced, or slot-state
    tensors regrown)."""

    def __init__(self, device: torch.device, decode_fn: Callable, state: _SlotState):
        self.device, self.decode_fn, self.state = device, decode_fn, state
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def run(self, key: tuple) -> None:
        (self._graphs.get(key) or self._capture(key)).replay()

    def clear(self) -> None:
        self._graphs.clear()

    def _capture(self, key: tuple) -> "torch.cuda.CUDAGraph":
        """Warm up (and compile) on a side stream, restore the state, capture one decode step.
        Warm-up steps rewrite the KV entries the real step writes, with the same values."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            _warm_up(self.decode_fn, self.state, key, runs=3)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):  # records, runs nothing
            self.decode_fn(*key)
        self._graphs[key] = graph
        return graph


def _warm_up(decode_fn: Callable, state: _SlotState, key: tuple, runs: int) -> None:
    """Run decode steps (compiling on the first) and undo their effect on the slot state.
    Their KV writes need no undo: a live slot rewrites the entry of its last token with the
    values the real step writes, other slots write garbage at position 0."""
    snap = state.snapshot()
    for _ in range(runs):
        decode_fn(*key)
        state.restore(snap)


class Engine:
    """Generation over one (possibly tensor-parallel) model; one engine per DP replica.

    num_slots / max_len: KV-cache rows and positions (prompt + completion <= max_len).
    device / dtype: where the cache lives (the model's device) and its dtype (`cache_dtype`).
    seed: sampling seed of requests without their own `SamplingParams.seed`.
    kv_policy: "keep" | "recompute", what `load_weights` does to cached keys/values.
    sync_every: decode steps between device->host reads of the finished flags (1 on CPU, 8 on
        CUDA). compile_decode: False (eager), "cudagraph" (CUDA graph of the eager step), True or
        "compile" (torch.compile, plus a CUDA graph on CUDA).
    max_prefill_tokens: padded tokens per prefill forward. kv_bucket: decode reads the cache up to
        a multiple of this (one CUDA graph each): 32 on CUDA, 1 on CPU.
    pack_weights: run the fp32/bf16 linears on oneDNN-prepacked weights while the engine computes
        (rollout/packed_linear.py); None = on CPU where available, for linears of at least a
        256 x 256 weight (slower below), if decode forwards timed both ways here show it faster
        (`pack_trial`; it depends on the CPU); True = all of them; False = none. The two ways
        differ by rounding only (fp32: log-probs within 1e-5); pin it for bitwise-repeatable runs.
        Another engine's `packed_weights` over the same model: share its packed copies.
    compact: keep the owned slots at the front, decode computes only them ("Rows" above); None =
        with eager decode on CPU; True needs eager decode; False = decode computes every slot.
    decode_attention: how decode attends over the cache (`model.attention.DECODE_KERNELS`,
        `attention_choice`; "flex" needs the compiled step, and reads the whole cache's length
        under a block mask instead of a length bucket). stack_weights: one matmul over the
        stacked q|k|v weights and one over gate|up (rollout/stacked.py); None = where the model
        allows it, on CUDA or with the compiled step (the CPU's eager step gained nothing); "qkv"
        the same for q|k|v only; another engine's `stacked_weights` over the same model: compute
        with those copies.
    """

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, device=None,
                 dtype: torch.dtype | None = None, *, seed: int = 0, kv_policy: str = "keep",
                 sync_every: int | None = None, compile_decode: bool | str = False,
                 max_prefill_tokens: int = 4096, kv_bucket: int | None = None,
                 pack_weights: bool | PackedLinears | None = None, compact: bool | None = None,
                 decode_attention: str = "auto", stack_weights=None):
        device = _checked_device(model, device, num_slots, max_len, kv_policy, compile_decode,
                                 seed)
        self.decode_attention = attention_choice(decode_attention, device, compile_decode)
        self.compact = _compact_choice(compact, device, compile_decode)
        self.model, self.device, self.num_slots, self.max_len = model, device, num_slots, max_len
        # decode reads the cache up to a length bucket; on CUDA each bucket is one graph
        use_compile = compile_decode in (True, "compile")
        self.kv_bucket = kv_bucket or (32 if device.type == "cuda" else 1)
        self.seed, self.kv_policy = int(seed), kv_policy
        self.max_prefill_tokens = max_prefill_tokens
        self.sync_every = sync_every or (8 if device.type == "cuda" else 1)
        self.cache = KVCache.for_model(model, num_slots, max_len, dtype=dtype, device=device)
        self.st = _SlotState(num_slots, max_len, device)
        self.stats = EngineStats()
        self._version = 0
        self._queue: deque[_Group] = deque()
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is used first
        self._slot: list[dict | None] = [None] * num_slots  # host info of the sample in a slot
        self._finished: list[Completion] = []
        self._n_requests = self._steps = self._since_sync = 0
        self._bound_base = 0  # max over owned slots of (length at admission - admission step)
        self._last_step = math.inf  # min over owned slots of the step of their last possible token
        self._needs = _Needs()  # over the owned slots
        self._body = _compiled(self._decode_body, model, device, use_compile)
        self._use_graphs = device.type == "cuda" and compile_decode is not False
        self._graphs = _DecodeGraphs(device, self._decode_fn, self.st)
        self._param_ptrs = _param_pointers(self.model)
        # pack_trial: the automatic choice's timings, for the logs (None if none was timed)
        packed, self.pack_trial = _choose_packing(model, self.cache, device, pack_weights,
                                                  use_compile)
        stacks = _stacked_weights(model, device, stack_weights, use_compile)
        self._copies = _WeightCopies(packed, stacks)
        self.cache.qkv, self.cache.gate_up = (stacks.qkv, stacks.gate_up) if stacks else (None, None)

    # ----- public API ---------------------------------------------------------------------------
    @property
    def packed_weights(self) -> PackedLinears | None:
        """The oneDNN-packed copies this engine computes with (None: plain linears)."""
        return self._copies.packed

    @property
    def stacked_weights(self) -> "stacked.StackedWeights | None":
        """The stacked q|k|v (and gate|up) weights this engine computes with (None: one matmul
        a projection)."""
        return self._copies.stacked

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        """Set after new weights are in place (`load_weights` does it): it also renews the
        engine's weight copies, since a swap may write through `.data` or a flat buffer, which
        leaves the parameters' version counters unchanged."""
        self._version = _checked_version(v)
        self.st.version_now.fill_(self._version)
        self._copies.invalidate()

    def add_requests(self, requests: Sequence[Request]) -> None:
        """Queue copies of the requests (FIFO; `_checked_request`). Raises ValueError naming the
        first one the engine cannot run (a prompt that leaves no room to generate or holds an id
        outside the vocabulary, bad SamplingParams), and then queues none of them."""
        requests = [_checked_request(r, self.max_len, self.model.args.vocab_size) for r in requests]
        now = time.perf_counter()
        for r in requests:
            seed = r.params.seed
            if seed is None:
                seed = mix32(self.seed) << 32 | mix32(self._n_requests + 0x5BD1E995)
            self._n_requests += 1
            self._queue.append(_Group(r, seed, deque(range(r.params.n)), now))

    def has_work(self) -> bool:
        return bool(self._queue) or len(self._free) < self.num_slots

    @torch.inference_mode()  # no_grad plus no version counters or view tracking: 6-7% faster
    def step(self) -> None:  # CPU decode (BENCHMARKS.md, "Generation")
        """One engine iteration: harvest (when due), admit + prefill, one decode step."""
        self._since_sync += 1
        due = self._since_sync >= self.sync_every or self._steps >= self._last_step
        if due or (self._queue and self._free):
            self._harvest()
        with self._copies.active():
            if self._queue and self._free:
                self._admit()
            if len(self._free) < self.num_slots:
                self._decode()

    def poll_finished(self) -> list[Completion]:
        out, self._finished = self._finished, []
        return out

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Run until every request is done; completions in request order, then sample order.
        Completions of other requests finished meanwhile stay for `poll_finished`. If a step
        raises, these requests are cancelled (no retry finds them running) and the arrival count
        restored (a retry draws what this call would have drawn); others' requests stay."""
        rank = _request_ranks(requests, _held_ids(self._queue, self._slot, self._finished))
        arrivals = self._n_requests
        self.add_requests(requests)
        mine, others = [], []
        try:
            while self.has_work():
                self.step()
        except BaseException as e:
            self.cancel(rank)
            self._n_requests = arrivals
            e.add_note(f"Engine: generate() cancelled its requests {_names(rank)}: none is left "
                       "queued, running or unpolled, and the engine serves later calls with all "
                       "its slots (other callers' requests were kept)")
            raise
        for c in self.poll_finished():
            (mine if c.request_id in rank else others).append(c)
        self._finished = others + self._finished
        return sorted(mine, key=lambda c: (rank[c.request_id], c.sample_idx))

    @torch.inference_mode()  # as step(): its slot state may be inference tensors (grown in one)
    def cancel(self, request_ids: Iterable) -> list:
        """Drop requests between two steps: their queued samples, their running ones (the slots
        are free at once) and their finished ones not yet polled. Returns the ids found."""
        ids = list(dict.fromkeys(request_ids))
        drop = set(ids)
        slots = [s for s, i in enumerate(self._slot)
                 if i is not None and i["group"].request.request_id in drop]
        found = {g.request.request_id for g in self._queue} & drop
        found |= {self._slot[s]["group"].request.request_id for s in slots}
        found |= {c.request_id for c in self._finished if c.request_id in drop}
        self._queue = deque(g for g in self._queue if g.request.request_id not in drop)
        self._finished = [c for c in self._finished if c.request_id not in drop]
        if slots:
            self._release(slots)
            self._settle()
        return [i for i in ids if i in found]

    @torch.no_grad()
    def load_weights(self, apply_fn: Callable[[], None], version: int,
                     kv_policy: str | None = None) -> None:
        """Swap weights at a safe point (between steps); see the module docstring for policies."""
        policy = kv_policy or self.kv_policy
        if policy not in KV_POLICIES:
            raise ValueError(f"kv_policy={policy!r}; choose one of {KV_POLICIES}")
        _checked_version(version)  # before apply_fn: new weights under the old version otherwise
        apply_fn()
        self.version = version
        if _param_pointers(self.model) != self._param_ptrs:  # parameters replaced, not copied into
            self._graphs.clear()
            self._param_ptrs = _param_pointers(self.model)
        if policy == "recompute":
            with torch.inference_mode(), self._copies.active():
                self._recompute()

    # ----- harvest ------------------------------------------------------------------------------
    def _harvest(self) -> None:
        self._since_sync = 0
        if len(self._free) == self.num_slots:
            return
        self.stats.harvests += 1
        done = (self.st.owned & ~self.st.live).nonzero()[:, 0].tolist()  # the one sync
        if not done:
            return
        seq_len, tokens, logp, versions, stopped = self.st.read(done)
        now, infos = time.perf_counter(), [self._slot[s] for s in done]
        self._release(done)
        for j, info in enumerate(infos):
            self.stats.generated_tokens += seq_len[j] - info["P"]
            self._finished.append(_completion(info, tokens[j], logp[j], versions[j], seq_len[j],
                                              stopped[j], now))
        self._settle()

    def _settle(self) -> None:
        """After slots were freed: the live bound, compaction, and the idle restart."""
        self._bound_base = max((i["bound"] for i in self._slot if i is not None), default=0)
        self._last_step = min((i["last"] for i in self._slot if i is not None), default=math.inf)
        if self.compact:
            self._compact()
        if len(self._free) == self.num_slots:
            # Idle: back to the initial slot order and step count, so what an engine computes
            # never depends on its history (a resumed job regenerates bit for bit).
            self._free = list(range(self.num_slots - 1, -1, -1))
            self._steps = self._bound_base = 0

    def _release(self, slots: list[int]) -> None:
        """Free these slots now, whatever their samples' state (cancelled, or admitted by a
        failed admission): neither live nor owned, off the books."""
        if not slots:
            return
        idx = torch.tensor(slots, device=self.device)
        self.st.live[idx] = False
        self.st.owned[idx] = False
        for s in slots:
            info, self._slot[s] = self._slot[s], None
            if info is not None:
                info["group"].live_slots.discard(s)
                self._needs.add(info["needs"], -1)
            self._free.append(s)

    def _compact(self) -> None:
        """Move the samples in slots at or above n (the number of owned slots) into the free
        slots below n, so that the owned slots are [0, n) and the free ones, taken lowest first,
        [n, num_slots): decode then computes n rows (`_decode_key`)."""
        n = self.num_slots - len(self._free)
        src, dst = _compaction_moves(self._slot)
        if src:
            self._move(src, dst)
        self._free = list(range(self.num_slots - 1, n - 1, -1))

    def _move(self, src: list[int], dst: list[int]) -> None:
        """Move samples from slots `src` to the free slots `dst`: their state rows, their cached
        keys/values up to the engine's bound on their lengths, and their host bookkeeping."""
        cached = min(self.max_len, max(self._slot[s]["bound"] for s in src) + self._steps)
        src_t, dst_t = (torch.tensor(x, device=self.device) for x in (src, dst))
        self.st.move(src_t, dst_t)
        self.cache.move(src_t, dst_t, cached)
        for s, d in zip(src, dst):
            info, self._slot[s] = self._slot[s], None
            self._slot[d] = info
            info["group"].live_slots.discard(s)
            info["group"].live_slots.add(d)
        self.stats.slot_moves += len(src)

    # ----- admission: prefill, prefix copies, first tokens --------------------------------------
    def _admit(self) -> None:
        """Admit queued samples into the free slots. If that raises (an out-of-memory prefill),
        it is undone: the samples are queued again, their slots free, the error says which."""
        free, bounds = list(self._free), (self._bound_base, self._last_step)
        plan, to_prefill = _take_queued(self._queue, self._free)
        try:
            self._start_plan(plan, to_prefill)
        except BaseException as e:
            self._release([s for s, _, _ in plan])
            self._free, (self._bound_base, self._last_step) = free, bounds
            _requeue(self._queue, plan, to_prefill)
            names = _names(g.request.request_id for _, g, _ in plan)
            e.add_note(f"Engine: admitting requests {names} failed and was undone: their samples "
                       "are queued again (the next step() retries them) and no slot is lost; to "
                       f"drop them: engine.cancel([{names}])")
            raise

    def _start_plan(self, plan, to_prefill) -> None:
        """Prefill the prompts, copy prefixes to siblings, start every sample of the plan."""
        t0 = time.perf_counter()
        prefilled = self._prefill([(g.request.prompt_ids, s) for g, s in to_prefill])
        for (g, s), logits_V in zip(to_prefill, prefilled):
            g.logits_V, g.logits_version = logits_V, self.version
            g.live_slots.add(s)  # the copy source below, even before it is registered
        self._copy_prefixes(plan, {s for _, s in to_prefill})
        self._start_samples(plan, t0)
        for g in {id(g): g for _, g, _ in plan}.values():
            if not g.pending:
                g.logits_V = None  # every sample admitted: the logits are no longer needed

    def _copy_prefixes(self, plan, prefilled_slots: set[int]) -> None:
        """Copy each group's prompt KV [0, P) from a slot holding it to its new samples' slots."""
        for src, dst, P in _prefix_copies(plan, prefilled_slots):
            d = torch.tensor(dst, device=self.device)
            self.cache.move(torch.full_like(d, src), d, P)
            self.stats.kv_copies += len(dst)

    def _start_samples(self, plan, t_admit: float) -> None:
        """Write prompts and per-slot parameters of the admitted samples, draw their first token."""
        stop_sets = [self._stop_ids(g.request.params) for _, g, _ in plan]
        if max(map(len, stop_sets)) > self.st.stop_ids.shape[1]:
            self.st.grow_stop_ids(max(map(len, stop_sets)))
            self._graphs.clear()
        table = _sample_table(plan, stop_sets, self.max_len, self.st.stop_ids.shape[1])
        for s, g, i in plan:
            P = len(g.request.prompt_ids)
            # its first token is drawn now, its last by decode step `last` at the latest
            last = self._steps + min(g.request.params.max_new_tokens, self.max_len - P) - 1
            self._slot[s] = dict(group=g, sample_idx=i, P=P, admitted=t_admit, last=last,
                                 bound=P + 1 - self._steps, needs=_needs(g.request.params))
            self._last_step = min(self._last_step, last)
            self._needs.add(self._slot[s]["needs"])
            g.live_slots.add(s)
        flags = _Needs(self._slot[s]["needs"] for s, _, _ in plan).flags(len(plan))
        self.st.start(table, _first_logits(plan, self.device), flags, self.max_len)
        now = time.perf_counter()
        for s, _, _ in plan:
            self._slot[s]["first_token"] = now
        self._bound_base = max(self._bound_base, max(self._slot[s]["bound"] for s, _, _ in plan))

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        eos = [] if p.ignore_eos else self.model.args.eos_ids
        return sorted(set(p.stop_token_ids) | set(eos))

    def _prefill(self, items: list[tuple[Sequence[int], int]], logits: bool = True) -> list[Tensor]:
        """Prefill token lists into slots (batched, right-padded, sorted by length, chunked to
        `max_prefill_tokens`); returns each item's last-position logits [V] when `logits`."""
        out: list[Tensor | None] = [None] * len(items)
        for idx in _length_chunks([len(q) for q, _ in items], self.max_prefill_tokens):
            seqs = [items[i][0] for i in idx]
            h = self._prefill_forward(_right_padded(seqs).to(self.device, non_blocking=True),
                                      torch.tensor([items[i][1] for i in idx], device=self.device))
            self.stats.prefill_tokens += sum(map(len, seqs))
            if logits:
                last = torch.tensor([len(q) - 1 for q in seqs], device=self.device)
                rows_V = self.model.lm_head(h[torch.arange(len(idx), device=self.device), last])
                for r, i in enumerate(idx):
                    out[i] = rows_V[r]
                self.stats.prefill_prompts += len(idx)
        return out

    def _prefill_forward(self, ids_BT: Tensor, slots_B: Tensor) -> Tensor:
        B, T = ids_BT.shape
        pos = torch.arange(T, device=self.device).expand(B, T)
        self.stats.prefill_calls += 1
        self.stats.prefill_padded_tokens += B * T
        return self.model.hidden_states(ids_BT, positions=pos, kv_cache=_CacheView(self.cache, T),
                                        slots=slots_B)

    # ----- decode -------------------------------------------------------------------------------
    def _decode(self) -> None:
        key = self._decode_key()
        if self._use_graphs:
            self._graphs.run(key)
        else:
            self._decode_fn(*key)
        self._steps += 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += key[-1]

    def _decode_fn(self, *key) -> None:
        """One decode step (`_decode_body`, compiled or not, after setting its positions)."""
        self.st.set_positions()
        self._body(*key)

    def _decode_key(self) -> tuple[bool, bool, str, int, int]:
        """Host-side choice of the decode kernels: (truncate, tempered, sampling mode, cache
        length read, slot rows computed)."""
        bound = max(1, min(self.max_len, self._bound_base + self._steps))  # idle: a 1-long read
        Lb = _read_length(bound, self.max_len, self.kv_bucket, self.device, self.decode_attention)
        owned = self.num_slots - len(self._free)  # free slots' draws are never read
        rows = max(1, owned) if self.compact else self.num_slots  # the owned are [0, owned)
        return (*self._needs.flags(owned), Lb, rows)

    def _decode_body(self, truncate: bool, tempered: bool, mode: str, Lb: int, R: int) -> None:
        """One token for each live slot of the first R; pure device code (CUDA-graph safe)."""
        st, L = self.st.rows(R), self.max_len
        pos_S1 = st.pos  # the tensor itself when R is all (FlexAttention's mask captures it)
        ids_S1 = st.tokens.gather(1, pos_S1)
        cache = _CacheView(self.cache, Lb, R)
        cache.kernel = self.decode_attention
        logits_SV = self.model(ids_S1, positions=pos_S1, kv_cache=cache)[:, 0]
        u_S = None if mode == "greedy" else st.u.gather(1, st.gen[:, None])[:, 0]
        tok, mu = _sample_rows(logits_SV, st.temp, st.top_k, st.top_p, st.greedy, u_S, truncate,
                               tempered, mode)
        st.append(tok, mu, L)

    # ----- weights ------------------------------------------------------------------------------
    def _recompute(self) -> None:
        """kv_policy="recompute": prefill every running sequence again under the new weights."""
        self._harvest()
        for g in self._queue:  # queued samples must not start from old-weight logits
            g.logits_V = None
        slots = [s for s, i in enumerate(self._slot) if i is not None]
        if not slots:
            return
        lengths = (self.st.seq_len[slots] - 1).tolist()  # tokens whose KV is cached
        for idx in _length_chunks(lengths, self.max_prefill_tokens):
            rows = torch.tensor([slots[i] for i in idx], device=self.device)
            self._prefill_forward(self.st.tokens[rows, : lengths[idx[-1]]], rows)
            self.stats.recompute_tokens += sum(lengths[i] for i in idx)


def _compiled(decode_body: Callable, model: torch.nn.Module, device: torch.device,
              use_compile: bool) -> Callable:
    """The decode step, compiled if `use_compile`. The cache length read is the one size that
    changes from step to step: the second length seen recompiles with it symbolic (dynamo's
    automatic dynamic shapes), and that one graph serves every later length (dynamic=True, every
    size symbolic from the start, compiled longer and ran slower on CPU: BENCHMARKS.md
    "Generation")."""
    if not use_compile:
        return decode_body
    return torch.compile(decode_body, dynamic=None, options=compile_options(
        device, model.args.num_layers, _has_dtensor(model)))


def _param_pointers(model: torch.nn.Module) -> list[int]:
    """Where the parameters' data lives: a change says they were replaced, not copied into (a
    DTensor's own data_ptr() is 0: its local shard's is read)."""
    return [(p.to_local() if hasattr(p, "to_local") else p).data_ptr() for p in model.parameters()]


def _time_decode_packing(model: torch.nn.Module, cache: KVCache, packed: PackedLinears) -> dict:
    """`packed_linear.trial` on decode forwards of every slot over the whole cache. They write
    garbage at position 0 of every slot, as idle slots do in decode: nothing is cached yet."""
    ids = torch.zeros(cache.num_slots, 1, dtype=torch.int64, device=cache.k.device)
    view = _CacheView(cache, cache.max_len)
    return packed_linear.trial(packed, lambda: model(ids, positions=ids, kv_cache=view))


def _choose_packing(model, cache: KVCache, device, choice: bool | None, compiled: bool):
    """(the engine's PackedLinears or None, the timed trial or None): `_packed_linears`, and
    for the automatic choice of a model without DTensor shards, packed only if the trial shows
    it faster."""
    packed = _packed_linears(model, device, choice, compiled)
    if choice is not None or packed is None or _has_dtensor(model):
        return packed, None
    trial = _time_decode_packing(model, cache, packed)
    return (packed if trial["packed"] else None), trial


def _has_dtensor(model: torch.nn.Module) -> bool:
    """A tensor-parallel model: its ranks must compute alike, so no per-rank timed choice."""
    return any(hasattr(p, "to_local") for p in model.parameters())


def _checked_device(model, device, num_slots: int, max_len: int, kv_policy: str,
                    compile_decode, seed) -> torch.device:
    """The engine's device (the model's unless given), after checking the engine's arguments."""
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    if param.device != device:
        raise ValueError(f"the model is on {param.device} but the engine was asked for "
                         f"{device}; move the model first")
    if num_slots < 1 or max_len < 2:
        raise ValueError(f"need num_slots >= 1 and max_len >= 2, got {num_slots}, {max_len}")
    if kv_policy not in KV_POLICIES:
        raise ValueError(f"kv_policy={kv_policy!r}; choose one of {KV_POLICIES}")
    if compile_decode not in COMPILE_MODES:
        raise ValueError(f"compile_decode={compile_decode!r}; choose one of {COMPILE_MODES}")
    if compile_decode == "cudagraph" and device.type != "cuda":
        raise ValueError("compile_decode='cudagraph' needs a CUDA device")
    if not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed={seed!r}: the engine's sampling seed must be an int (it keys the "
                         "draws of requests without their own SamplingParams.seed)")
    return device


def attention_choice(choice: str, device: torch.device, compile_decode) -> str:
    """`generator.decode_attention` as the Engine's `decode_attention` kernel: 'auto' = "flex"
    for the compiled step on CUDA (1.08x SDPA's step on the H200, BENCHMARKS.md "GPU"), else
    "sdpa" on CUDA and "matmul" on CPU; "flex" only with the compiled step (eager FlexAttention
    is a slow reference implementation)."""
    compiled = compile_decode in (True, "compile")
    if choice == "auto" and device.type == "cuda" and compiled:
        return "flex"
    kernel = attn.decode_kernel(choice, device.type)
    if kernel == "flex" and not compiled:
        raise ValueError(f"generator.decode_attention='flex' needs the compiled decode step "
                         f"(generator.decode='compile', the Engine's compile_decode='compile'; got "
                         f"{compile_decode!r}): eager FlexAttention is a slow reference; use 'auto'")
    return kernel


def _read_length(bound: int, max_len: int, bucket: int, device: torch.device, kernel: str) -> int:
    """Cache positions a decode step reads: the live bound rounded up to the bucket; on CPU the
    whole cache past max_len / FULL_READ_ABOVE; with the flex kernel always the whole (its block
    mask skips the blocks past each row)."""
    Lb = min(max_len, -(-bound // bucket) * bucket)
    if kernel == "flex" or (device.type == "cpu" and Lb * FULL_READ_ABOVE > max_len):
        return max_len
    return Lb


class _WeightCopies:
    """The engine's copies of its model's weights, which must follow them: oneDNN-packed linears
    (CPU eager, rollout/packed_linear.py) and stacked q|k|v and gate|up (CUDA, and the compiled
    step on CPU; rollout/stacked.py); either None."""

    def __init__(self, packed: PackedLinears | None, stacks: "stacked.StackedWeights | None"):
        self.packed, self.stacked = packed, stacks

    def invalidate(self) -> None:
        """After weights were written in a way that moves no version counter."""
        if self.packed is not None:
            self.packed.invalidate()
        if self.stacked is not None:
            self.stacked.refresh(force=True)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Compute on the copies: stacked ones refilled if a weight moved, packed forwards on."""
        if self.stacked is not None:
            self.stacked.refresh()
        with self.packed.active() if self.packed is not None else nullcontext():
            yield


def _stacked_weights(model: torch.nn.Module, device: torch.device, choice, compiled: bool):
    """`stack_weights`: None = where the model allows it (rollout/stacked.py), on CUDA or with
    the compiled step (CPU, vs_trl's generator: q|k|v 0.93x the batch time, gate|up 0.97-0.98x
    more; eager: no change), q|k|v, and gate|up while its copies stay small
    (`stacked.stacks_gate_up`); "qkv" = the same for q|k|v only; True = both, wherever; False =
    none; a StackedWeights (another engine's over the same model): that one."""
    if isinstance(choice, stacked.StackedWeights):
        return choice
    if choice not in (None, True, False, "qkv"):
        raise ValueError(f"stack_weights={choice!r}; choose None (automatic), 'qkv', True, False "
                         "or another engine's stacked_weights")
    qkv_ok, gate_up_ok = (stacked.stackable(model, g) for g in (stacked.QKV, stacked.GATE_UP))
    if choice is True and not (qkv_ok and gate_up_ok):
        raise ValueError("stack_weights=True: this model's q/k/v or gate/up projections cannot be "
                         "stacked (tensor-parallel shards, mixed dtypes or biases); leave "
                         "stack_weights=None (generator.stack_weights='auto')")
    auto = choice is None or choice == "qkv"
    if not (qkv_ok and ((device.type == "cuda" or compiled) if auto else choice)):
        return None
    gate_up = gate_up_ok and stacked.stacks_gate_up(choice, stacked.gate_up_bytes(model))
    return stacked.StackedWeights(model, gate_up=gate_up)


def _checked_request(r: Request, max_len: int, vocab: int) -> Request:
    """The copy of `r` that the engine queues: prompt ids, seed and every number of its
    SamplingParams as Python ints and floats (a numpy or tensor prompt gave completions of numpy
    or tensor ids, a numpy uint64 seed overflowed at admission), the params checked again, the
    stop ids in the vocabulary (outside it they could never stop a completion). Changing `r`
    later changes nothing queued. ValueError naming the request otherwise."""
    prompt = _checked_prompt(r, max_len, vocab)
    p = r.params
    bad = _params_problems(p)
    if bad:
        raise ValueError(f"request {r.request_id!r}: invalid SamplingParams: " + ", ".join(bad))
    outside = [t for t in p.stop_token_ids if t >= vocab]
    if outside:
        raise ValueError(f"request {r.request_id!r}: stop_token_ids {sorted(outside)[:5]} are "
                         f"outside the model's vocabulary [0, {vocab}): they could never stop a "
                         "completion; give ids of the model's own tokenizer")
    params = replace(p, max_new_tokens=int(p.max_new_tokens), temperature=float(p.temperature),
                     top_p=float(p.top_p), top_k=int(p.top_k), n=int(p.n),
                     stop_token_ids=[int(t) for t in p.stop_token_ids],
                     seed=None if p.seed is None else int(p.seed))
    return Request(r.request_id, prompt, params)


def _checked_prompt(r: Request, max_len: int, vocab: int) -> list[int]:
    """A prompt the engine can run, as Python ints: 1..max_len-1 tokens (room for one new token),
    every id in the vocabulary. Checked before queueing: in the prefill a bad id is an IndexError
    on CPU (that left the request's slots taken: every later generate() spun forever) and a
    device assert on CUDA."""
    n_prompt = len(r.prompt_ids)
    if n_prompt == 0:
        raise ValueError(f"request {r.request_id!r}: the prompt is empty; give at least "
                         "one token (a chat template's or the tokenizer's BOS)")
    if n_prompt > max_len - 1:
        raise ValueError(
            f"request {r.request_id!r}: prompt has {n_prompt} tokens; the engine's "
            f"max_len={max_len} allows 1..{max_len - 1} (room for >= 1 new token); "
            "filter long prompts in the data layer or raise max_len")
    try:
        ids = torch.as_tensor(r.prompt_ids)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        ids = e
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point \
            or ids.dtype.is_complex or ids.dtype == torch.bool:
        what = f"{ids.dtype}, shape {list(ids.shape)}" if isinstance(ids, Tensor) else ids
        raise ValueError(f"request {r.request_id!r}: prompt ids must be one list of integers "
                         f"(got {what}); encode prompts with the model's own tokenizer")
    if ids.min() < 0 or ids.max() >= vocab:
        bad = ids[(ids < 0) | (ids >= vocab)][:5].tolist()
        raise ValueError(
            f"request {r.request_id!r}: prompt ids {bad} are outside the model's "
            f"vocabulary [0, {vocab}); encode prompts with the model's own tokenizer")
    return ids.tolist()


def _names(request_ids: Iterable, most: int = 20) -> str:
    """Request ids for a message, each once: "'a', 'b'" (the first `most`, then how many more)."""
    ids = list(dict.fromkeys(request_ids))
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return ", ".join(map(repr, ids[:most])) + more


def _take_queued(queue: deque, free: list[int]) -> tuple[list, list]:
    """Take free slots (a stack) for queued samples, in order: (plan [(slot, group, sample
    index)], [(group, slot its prompt is prefilled into)])."""
    plan: list[tuple[int, _Group, int]] = []
    to_prefill: list[tuple[_Group, int]] = []
    while free and queue:
        g = queue[0]
        if g.logits_V is not None and not g.live_slots:
            g.logits_V = None  # no running sibling holds the prompt any more: prefill again
        slots = [free.pop() for _ in range(min(len(free), len(g.pending)))]
        plan += [(s, g, g.pending.popleft()) for s in slots]
        if g.logits_V is None:
            to_prefill.append((g, slots[0]))
        if not g.pending:
            queue.popleft()
    return plan, to_prefill


def _requeue(queue: deque, plan: list, to_prefill: list) -> None:
    """Undo `_take_queued` after a failed admission: the plan's samples back at the front
    of their groups and the groups back at the head of the queue, in order; their prompts are
    prefilled again (the slots that held them are free)."""
    for s, g, _ in plan:
        g.live_slots.discard(s)
    for g, _ in to_prefill:
        g.logits_V = None
    for g in reversed(list({id(g): g for _, g, _ in plan}.values())):
        g.pending.extendleft(reversed([i for _, h, i in plan if h is g]))
        if not queue or queue[0] is not g:  # taken whole: it had left the queue
            queue.appendleft(g)


def _checked_version(version) -> int:
    if not isinstance(version, numbers.Integral):
        raise ValueError(f"version={version!r}: a weight version must be an int (the trainer "
                         "step that produced the weights); nothing was applied")
    return int(version)


def _request_ranks(requests: Sequence[Request], held: set) -> dict:
    """{request id: its position}; ids must be unique, and not among the ids `held` by the
    engine (generate() collects completions by id: they would be sorted under one position, and
    another caller's would be taken)."""
    rank = {r.request_id: i for i, r in enumerate(requests)}
    if len(rank) < len(requests):
        counts = Counter(r.request_id for r in requests)
        dup = [repr(i) for i, n in counts.items() if n > 1]
        raise ValueError(f"generate() got request ids {', '.join(dup)} more than once; give "
                         "each request its own id (n samples of a prompt: SamplingParams.n)")
    if not held.isdisjoint(rank):
        raise ValueError(f"generate() got request ids {_names(i for i in rank if i in held)} that "
                         "the engine already holds (queued, running, or finished and not yet "
                         "polled); give each request its own id, or poll_finished() first")
    return rank


def _held_ids(queue: deque, slot_info: list, finished: list[Completion]) -> set:
    """The request ids an engine holds: queued, running, or finished and not yet polled."""
    return ({g.request.request_id for g in queue} | {c.request_id for c in finished}
            | {i["group"].request.request_id for i in slot_info if i is not None})


def _compaction_moves(slot_info: list) -> tuple[list[int], list[int]]:
    """(src, dst) that make the owned slots (info not None) a prefix [0, n): the owned slots at
    or above n, and the free ones below n, both in ascending order."""
    n = sum(i is not None for i in slot_info)
    return ([s for s in range(n, len(slot_info)) if slot_info[s] is not None],
            [s for s in range(n) if slot_info[s] is None])


def _compact_choice(choice: bool | None, device: torch.device, compile_decode) -> bool:
    """`compact`: None = with eager decode on CPU. The GPU default stays off for now: there decode
    is a CUDA graph per cache-length bucket, and rows would multiply the graphs."""
    if choice is None:
        return device.type == "cpu" and compile_decode is False
    if choice and compile_decode is not False:
        raise ValueError(f"compact=True needs eager decode (compile_decode=False, got "
                         f"{compile_decode!r}): every row count would be a CUDA graph or a "
                         "compilation of its own; leave compact=None for the default")
    return bool(choice)


def _packed_linears(model: torch.nn.Module, device: torch.device, choice: bool | None,
                    compiled: bool) -> PackedLinears | None:
    """`pack_weights`: None = on CPU where oneDNN has the kernels and the decode step is not
    compiled (inductor does its own packing, and cannot lower ours), the linears large enough to
    gain (`packed_linear.MIN_NUMEL`), subject to the engine's timed trial; True = every fp32 or
    bf16 linear; False = none; a PackedLinears (another engine's): that one."""
    if isinstance(choice, PackedLinears):
        return choice
    ok = device.type == "cpu" and packed_linear.available() and not compiled
    if choice is None:
        packed = PackedLinears(model) if ok else None
        return packed if packed is not None and packed.modules else None
    if not choice:
        return None
    if not ok:
        raise ValueError(f"pack_weights=True needs an eager CPU engine and a torch build with "
                         f"oneDNN (device {device}, compiled decode: {compiled}, oneDNN kernels "
                         f"available: {packed_linear.available()}); leave pack_weights=None "
                         "(generator.pack_weights='auto') for the automatic choice")
    packed = PackedLinears(model, min_numel=0)
    if not packed.modules:
        dtype = next(model.parameters()).dtype
        raise ValueError(f"pack_weights=True: no linear of this {dtype} model can be packed on "
                         f"this CPU (oneDNN packs {list(packed_linear.packed_dtypes())} here); "
                         "leave pack_weights=None (generator.pack_weights='auto')")
    return packed


def _right_padded(seqs: list[Sequence[int]]) -> Tensor:
    """Token lists as one [B, T] batch, right-padded with 0 to the longest."""
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.int64)
    for r, q in enumerate(seqs):
        ids[r, : len(q)] = torch.as_tensor(q)
    return ids


def _length_chunks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` sorted by length, in `_chunks` (the last of each is its longest)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [[order[c] for c in chunk] for chunk in _chunks([lengths[i] for i in order], max_tokens)]


def _chunks(sorted_lengths: list[int], max_tokens: int, max_waste: float = 0.1) -> list[list[int]]:
    """Split ascending lengths into consecutive batches whose padded size (count x longest) stays
    under `max_tokens` and within `max_waste` of the real tokens (one item may exceed the budget)."""
    chunks, cur, real = [], [], 0
    for i, n in enumerate(sorted_lengths):
        padded = (len(cur) + 1) * n
        if cur and (padded > max_tokens or padded > (1 + max_waste) * (real + n)):
            chunks.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += n
    if cur:
        chunks.append(cur)
    return chunks
