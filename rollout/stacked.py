"""The q|k|v projection weights of every layer stacked, for one matmul instead of three in the
engine's forwards on CUDA and in its compiled step on CPU (`KVCache.qkv`).

At a decode step's 64 rows each projection is a launch-bound matmul: on the H200, for the 1.1B
shape, q took 6 us and k and v 5.4 us each for 8 and 2 MB of weights (BENCHMARKS.md, "GPU"), where
one matmul over the 12.6 MB of the three is bandwidth-bound. The stacked copies cost that much
memory again (0.2 GB for the 1.1B shape). On CPU the compiled step of vs_trl's generator (16 rows)
took 0.93x the time with them; the eager step gained nothing. They live in buffers allocated once
and refilled in place, so that CUDA graphs captured over them stay valid: `refresh()` refills them
when a weight's version counter or data pointer moved (an optimizer step, a replaced tensor),
`refresh(force=True)` also after writes that move neither (through `.data`, a flat buffer, CUDA
IPC; the engine forces it whenever its weight version is set).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

NAMES = ("q_proj", "k_proj", "v_proj")


def stackable(model: nn.Module) -> bool:
    """Whether every layer's q/k/v projections are plain tensors (not DTensor shards) of one
    dtype and device, with biases on all three or none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    for layer in layers:
        mods = [getattr(layer.self_attn, n) for n in NAMES]
        ws = [m.weight for m in mods]
        if (any(hasattr(w, "to_local") for w in ws) or len({(w.dtype, w.device) for w in ws}) != 1
                or len({m.bias is None for m in mods}) != 1):
            return False
    return True


class StackedQKV:
    """`per_layer`: for each layer (stacked weight [q + k + v rows, hidden], stacked bias or
    None, the three row counts), as `KVCache.qkv` takes it."""

    def __init__(self, model: nn.Module):
        self._sources = []  # per layer: ([q, k, v weights], [biases] or None)
        self.per_layer = []
        with torch.no_grad():
            for layer in model.model.layers:
                mods = [getattr(layer.self_attn, n) for n in NAMES]
                ws = [m.weight for m in mods]
                bs = None if mods[0].bias is None else [m.bias for m in mods]
                self._sources.append((ws, bs))
                self.per_layer.append((torch.cat(ws), None if bs is None else torch.cat(bs),
                                       [w.shape[0] for w in ws]))
        # what the stamps read, listed once: `refresh` runs before every engine step
        self._tensors: list[Tensor] = [t for ws, bs in self._sources for t in ws + (bs or [])]
        self._stamp = self._stamps()
        self.refills = 0  # refreshes that copied (tests check that an unchanged model copies none)

    def _stamps(self) -> tuple:
        return tuple((t._version, t.data_ptr()) for t in self._tensors)

    @torch.inference_mode()  # the copies may have been made under it (inference tensors)
    def refresh(self, force: bool = False) -> None:
        """Refill the stacked copies in place if a weight changed (or always, with `force`)."""
        stamp = self._stamps()
        if not force and stamp == self._stamp:
            return
        for (ws, bs), (w, b, _) in zip(self._sources, self.per_layer):
            torch.cat(ws, out=w)
            if bs is not None:
                torch.cat(bs, out=b)
        self._stamp = stamp
        self.refills += 1
