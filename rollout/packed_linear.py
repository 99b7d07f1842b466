"""oneDNN-prepacked weights for the engine's forwards on CPU.

`nn.Linear` on CPU calls MKL's sgemm, which re-lays-out the weight on every call and scales poorly
over threads at decode shapes (64 rows): on the 2-core AMD EPYC dev machine it reaches ~110 GFLOP/s
for [64, 256] x [256, 512] on 2 threads, where oneDNN's matmul over a weight reordered once into
its blocked layout reaches ~175 (BENCHMARKS.md, "Generation"). This is the prepacking that
inductor's CPU backend does for inference; the engine does it without compiling anything:

    packed = PackedLinears(model)          # finds the large plain fp32 nn.Linear modules
    with torch.no_grad(), packed.active():  # their forwards run on packed weights
        logits = model(...)

The weights stay the model's own (no second model definition): a packed copy is made per weight
tensor (tied weights share one) and made again when the weight changed since (in-place updates bump
`Tensor._version`; a replaced tensor has a new data pointer).
Outside `active()` the modules are untouched, so a trainer sharing the model in the same process
keeps autograd and MKL. Writes through `.data` or through a flat buffer the parameters view do not
bump the version counter: whoever writes that way calls `invalidate()` (the engine does whenever
its weight version is set). Only fp32 weights that are plain tensors are packed: DTensor (TP) shards
keep their distributed forward. Numerics: the same fp32 products summed in a different order
(~1e-6 relative on the outputs, well inside the engine's log-prob tolerance; tested).
"""
from __future__ import annotations

from contextlib import contextmanager
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
# weights of at least this many elements.
MIN_NUMEL = 1 << 16


def _packable(m: nn.Module, min_numel: int) -> bool:
    w = getattr(m, "weight", None)
    return (isinstance(m, nn.Linear) and isinstance(w, Tensor) and not hasattr(w, "to_local")
            and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and w.numel() >= min_numel)


class PackedLinears:
    """Packed forwards for the packable `nn.Linear`s of `model` with at least `min_numel` weight
    elements (see the module docstring; 0 packs every one)."""

    def __init__(self, model: nn.Module, min_numel: int = MIN_NUMEL):
        self.modules = [m for m in model.modules() if _packable(m, min_numel)]
        self._cache: dict[int, tuple[int, int, Tensor]] = {}  # id(weight) -> (version, ptr, packed)
        self.repacks = 0  # packed copies made (tests check that an unchanged weight is reused)

    def _packed(self, w: Tensor) -> Tensor:
        key, stamp = id(w), (w._version, w.data_ptr())
        hit = self._cache.get(key)
        if hit is None or hit[:2] != stamp:
            hit = (*stamp, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
            self._cache[key] = hit
            self.repacks += 1
        return hit[2]

    def invalidate(self) -> None:
        """Forget every packed copy: the next `active()` packs again. For weights written without
        bumping their version counter (through `.data`, a flat buffer, CUDA IPC)."""
        self._cache.clear()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within this block (under no_grad) the packable modules run oneDNN on packed weights."""
        # through __dict__: nn.Module.__setattr__/__delattr__ would cost ~3 us a module a step
        for m in self.modules:
            vars(m)["forward"] = _packed_forward(self._packed(m.weight), m.bias)
        try:
            yield
        finally:
            for m in self.modules:
                vars(m).pop("forward", None)  # back to nn.Linear.forward


def _packed_forward(w_packed: Tensor, bias: Tensor | None):
    def forward(x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled():  # not what was packed for
            raise RuntimeError("PackedLinears.active() serves fp32 inference only; call the "
                               "model outside it (or under torch.no_grad()) for anything else")
        return torch.ops.mkldnn._linear_pointwise(x, w_packed, bias, "none", [], "")
    return forward

