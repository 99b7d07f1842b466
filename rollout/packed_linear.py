"""oneDNN-prepacked weights for the engine's forwards on CPU.

`nn.Linear` on CPU calls MKL's sgemm, which re-lays-out the weight on every call and scales poorly
over threads at decode shapes (64 rows): on the 2-core AMD EPYC dev machine it reaches ~110 GFLOP/s
for [64, 256] x [256, 512] on 2 threads, where oneDNN's matmul over a weight reordered once into
its blocked layout reaches ~175 (BENCHMARKS.md, "Generation"). Not every CPU gains: on a 2-core
Intel Xeon with AMX, MKL was as fast per linear and the engine ran faster without packing, so
the engine's automatic choice times both (`pays_off`). This is the prepacking that inductor's CPU
backend does for inference; the engine does it without compiling anything:

    packed = PackedLinears(model)          # finds the large plain fp32/bf16 nn.Linear modules
    with torch.no_grad(), packed.active():  # their forwards run on packed weights
        logits = model(...)

The weights stay the model's own (no second model definition): a packed copy is made per weight
tensor (tied weights share one), or per stack of sibling weights that the model always applies to
one input (q|k|v, gate|up: `SIBLINGS`, one call for the group), and made again when a weight
changed since (in-place updates bump `Tensor._version`; a replaced tensor has a new data pointer).
Outside `active()` the modules are untouched, so a trainer sharing the model in the same process
keeps autograd and MKL. Writes through `.data` or through a flat buffer the parameters view do not
bump the version counter: whoever writes that way calls `invalidate()` (the engine does whenever
its weight version is set). Only fp32 and bf16 weights that are plain tensors are packed (bf16
only where the CPU has oneDNN's bf16 kernels: `packed_dtypes`): DTensor (TP) shards keep their
distributed forward. bf16 gains the most where the CPU has AMX: a plain bf16
linear re-lays its weight out for the tiles on every call (SmolLM2-135M generating in bf16 on the
AMX Xeon: 1.85 s a batch packed, 2.3-2.45 s plain). Numerics: the same products summed in a
different order (fp32: ~1e-6 relative on the outputs, well inside the engine's log-prob tolerance;
tested).
"""
from __future__ import annotations

import functools
import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import Tensor, nn


def available() -> bool:
    """True where this torch build has oneDNN's packed linear kernels."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


# A oneDNN call costs ~12 us more than MKL's before any arithmetic: below about a 256 x 256 weight
# that overhead eats the gain (a 64-wide model generated 28% slower packed, a 256-wide one 1.2-1.6x
# faster per large linear; BENCHMARKS.md, "Generation"). The engine's automatic choice packs only
# weights of at least this many elements, and only where packing measures faster (`pays_off`).
MIN_NUMEL = 1 << 16
# Whether packing pays at all depends on the CPU: on the 2-core AMD EPYC it did (above); on a
# 2-core Intel Xeon with AMX the same engine ran 8-12% slower packed (BENCHMARKS.md, "Generation").
# So the engine times both ways and packs only when the packed forward is faster by this fraction:
# a packed copy also costs a second copy of the weights.
MIN_GAIN = 0.02
TRIAL_PAIRS = 16  # timed pairs of the automatic choice (`trial`), fewer where 1 s runs out
PACKED_DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN may pack; `packed_dtypes`: here


@functools.cache
def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The PACKED_DTYPES oneDNN can pack on this CPU: fp32, and bf16 where it has bf16 kernels
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU such as the 2-core AMD EPYC of
    session 15, packing a bf16 weight raises). Found by packing a small weight of each."""
    if not available():
        return ()
    ok = []
    for dtype in PACKED_DTYPES:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
        except RuntimeError:
            continue
        ok.append(dtype)
    return tuple(ok)


def pair_ratio(packed_s: list[float], plain_s: list[float]) -> float:
    """The median over pairs of forwards timed back to back of packed / plain (MKL). A ratio per
    pair cancels what the two forwards of a pair share, the machine's speed of the moment (other
    jobs, the other ranks starting up), which two separate medians do not: under load the medians
    of 6 pairs picked the slower way in 3 of 12 trials, the ratios of 16 in 1 (BENCHMARKS.md)."""
    if not packed_s or len(packed_s) != len(plain_s):
        raise ValueError(f"the packing choice needs timings of both ways in pairs, got "
                         f"{len(packed_s)} packed and {len(plain_s)} plain")
    return statistics.median(p / q for p, q in zip(packed_s, plain_s))


def pays_off(packed_s: list[float], plain_s: list[float], min_gain: float = MIN_GAIN) -> bool:
    """The automatic choice: pack when `pair_ratio` is below 1 - `min_gain`."""
    return pair_ratio(packed_s, plain_s) < 1 - min_gain


@torch.inference_mode()
def trial(packed: "PackedLinears", forward, pairs: int = TRIAL_PAIRS,
          budget_s: float = 1.0) -> dict:
    """Time `forward()` with and without `packed` active, in pairs (the first one warms up and
    packs) whose order alternates, so that neither way always runs second in the caches the other
    left; up to `pairs` pairs or, past two, `budget_s`; `pays_off` decides. Returns the verdict
    ("packed"), both medians in ms, the median ratio packed / plain and the pairs timed."""
    times: dict[str, list[float]] = {"packed": [], "plain": []}
    start = time.perf_counter()
    for i in range(pairs + 1):
        for way in ("packed", "plain") if i % 2 else ("plain", "packed"):
            with packed.active() if way == "packed" else nullcontext():
                t = time.perf_counter()
                forward()
                if i:
                    times[way].append(time.perf_counter() - t)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    ms = {f"{k}_ms": round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    ratio = pair_ratio(times["packed"], times["plain"])
    return {"packed": pays_off(times["packed"], times["plain"]), **ms, "ratio": round(ratio, 3),
            "pairs": len(times["plain"])}


def describe(trial_result: dict | None, rows: int) -> str | None:
    """One log line on a `trial` of decode forwards of `rows` slots; None if none was run."""
    t = trial_result
    if t is None:
        return None
    way = "oneDNN-packed" if t["packed"] else "plain (MKL)"
    return (f"generator: {way} linears (a decode forward of {rows} slots timed "
            f"{t['packed_ms']:.2f} ms packed, {t['plain_ms']:.2f} ms plain, medians of "
            f"{t['pairs']} pairs, packed / plain {t['ratio']:.2f} by pair; "
            "generator.pack_weights pins it)")


def _packable(m: nn.Module, min_numel: int) -> bool:
    w = getattr(m, "weight", None)
    return (isinstance(m, nn.Linear) and isinstance(w, Tensor) and not hasattr(w, "to_local")
            and w.device.type == "cpu" and w.dtype in packed_dtypes() and w.dim() == 2
            and w.numel() >= min_numel)


# Linears that a module always calls on the same input, one after the other (model/transformer.py:
# attention's projections, the MLP's gate and up). One oneDNN call over their stacked weights
# does the work of all: at 64 rows, q|k|v of a 256-wide model with 4 of 8 kv heads took 97 us
# against 140 us for three calls, gate|up 175 against 200-210 (BENCHMARKS.md, "Generation").
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def sibling_groups(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """The packable sibling linears of `model` (SIBLINGS) that can share one packed weight: same
    input width and dtype, and biases on all or none."""
    groups = []
    for parent in model.modules():
        for names in SIBLINGS:
            mods = tuple(getattr(parent, n, None) for n in names)
            if (all(isinstance(m, nn.Module) and _packable(m, 0) for m in mods)
                    and len({m.in_features for m in mods}) == 1
                    and len({m.weight.dtype for m in mods}) == 1
                    and len({m.bias is None for m in mods}) == 1):
                groups.append(mods)
    return groups


class PackedLinears:
    """Packed forwards for the packable `nn.Linear`s of `model` (see the module docstring).
    Sibling linears (SIBLINGS) run as one call over their stacked weights when `fuse`; a linear
    or a group of siblings is packed when its weight has at least `min_numel` elements (0 packs
    every one)."""

    def __init__(self, model: nn.Module, min_numel: int = MIN_NUMEL, fuse: bool = True):
        groups = sibling_groups(model) if fuse else []
        self.groups = [g for g in groups if sum(m.weight.numel() for m in g) >= min_numel]
        grouped = {id(m) for g in groups for m in g}
        self.singles = [m for m in model.modules()
                        if _packable(m, min_numel) and id(m) not in grouped]
        self.modules = self.singles + [m for g in self.groups for m in g]  # every one served
        self._units = [(m,) for m in self.singles] + self.groups
        # ids of a unit's weights and biases -> (their stamps, its members' forwards, its shared call)
        self._cache: dict[tuple, tuple] = {}
        self.repacks = 0  # packed copies made (tests check that an unchanged weight is reused)

    def _forwards(self, unit: tuple) -> tuple[list, "_SharedCall | None"]:
        """The forwards of one linear or sibling group over its packed weights, made again when
        any weight or bias changed (version) or was replaced (data pointer), else reused: a
        decode step only checks the stamps."""
        params = [m._parameters for m in unit]  # not m.weight: nn.Module.__getattr__ is ~1 us
        tensors = [p["weight"] for p in params] + [p["bias"] for p in params if p["bias"] is not None]
        key, stamp = tuple(map(id, tensors)), tuple((t._version, t.data_ptr()) for t in tensors)
        hit = self._cache.get(key)
        if hit is None or hit[0] != stamp:
            w = torch.cat(tensors[:len(unit)]) if len(unit) > 1 else tensors[0]
            b = torch.cat(tensors[len(unit):]) if len(tensors) > len(unit) else None
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
            b = None if b is None else b.detach()
            if len(unit) == 1:
                hit = (stamp, [_packed_forward(packed, b, w.dtype)], None)
            else:
                shared = _SharedCall(packed, b, [m.out_features for m in unit], w.dtype)
                hit = (stamp, [shared.member(i) for i in range(len(unit))], shared)
            self._cache[key] = hit
            self.repacks += 1
        return hit[1], hit[2]

    def invalidate(self) -> None:
        """Forget every packed copy: the next `active()` packs again. For weights written without
        bumping their version counter (through `.data`, a flat buffer, CUDA IPC)."""
        self._cache.clear()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within this block (under no_grad) the packable modules run oneDNN on packed weights."""
        shared_calls = []
        for unit in self._units:  # through __dict__: nn.Module.__setattr__ costs ~3 us a module
            forwards, shared = self._forwards(unit)
            for m, fn in zip(unit, forwards):
                vars(m)["forward"] = fn
            if shared is not None:
                shared_calls.append(shared)
        try:
            yield
        finally:
            for m in self.modules:
                vars(m).pop("forward", None)  # back to nn.Linear.forward
            for shared in shared_calls:
                shared.release()


def _check_inference(x: Tensor, dtype: torch.dtype) -> None:
    if x.dtype != dtype or torch.is_grad_enabled():  # not what was packed for
        raise RuntimeError(f"PackedLinears.active() serves inference on {dtype} inputs only (got "
                           f"{x.dtype}); call the model outside it (or under torch.no_grad()) "
                           "for anything else")


def _packed_forward(w_packed: Tensor, bias: Tensor | None, dtype: torch.dtype):
    def forward(x: Tensor) -> Tensor:
        _check_inference(x, dtype)
        return torch.ops.mkldnn._linear_pointwise(x, w_packed, bias, "none", [], "")
    return forward


class _SharedCall:
    """One oneDNN call for a group of sibling linears. The first member called on an input
    computes every member's output; each sibling then takes its own columns (a view) for that
    same input tensor, and the last one releases them. A member called again, or on another
    input, computes afresh: the result is right in any order, and one call in the usual one.
    The input must not change in place between the siblings' calls (the model's code does not)."""

    def __init__(self, w_packed: Tensor, bias: Tensor | None, sizes: list[int], dtype: torch.dtype):
        self.w, self.bias, self.sizes, self.dtype = w_packed, bias, sizes, dtype
        self.x: Tensor | None = None
        self.outs: list = [None] * len(sizes)

    def member(self, i: int):
        def forward(x: Tensor) -> Tensor:
            _check_inference(x, self.dtype)
            if x is not self.x or self.outs[i] is None:
                y = torch.ops.mkldnn._linear_pointwise(x, self.w, self.bias, "none", [], "")
                self.x, self.outs = x, list(y.split(self.sizes, -1))
            out, self.outs[i] = self.outs[i], None
            if all(o is None for o in self.outs):
                self.x = None
            return out
        return forward

    def release(self) -> None:
        """Drop the input and outputs held for siblings not yet called."""
        self.x, self.outs = None, [None] * len(self.sizes)
