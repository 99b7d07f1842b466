"""Sibling projection weights stacked, for one matmul instead of several in the engine's forwards
on CUDA and in its compiled step on CPU: each layer's q|k|v (`KVCache.qkv`) and gate|up
(`KVCache.gate_up`).

At a decode step's 64 rows each projection is a launch-bound matmul: on the H200, for the 1.1B
shape, q took 6 us and k and v 5.4 us each for 8 and 2 MB of weights (BENCHMARKS.md, "GPU"), where
one matmul over the 12.6 MB of the three is bandwidth-bound; gate and up are two more matmuls a
layer (and kernels: the compiled step's ~280 each cost a launch gap inside the CUDA graph). On CPU
the compiled step of vs_trl's generator (16 rows) took 0.93x the time with q|k|v stacked and
0.97-0.98x more with gate|up stacked too; the eager step gained nothing. The copies cost that
much memory again, most of it gate|up's (2 x hidden x intermediate a layer: 1.07 GB for the
1.1B shape in bf16, 7.5 GB for Llama-3-8B), for a gain that is per kernel (a launch gap, a
small matmul's poor bandwidth) and shrinks as the matmuls grow: by default gate|up are stacked
only while their copies take at most GATE_UP_AUTO_BYTES (`stacks_gate_up`). They live in buffers
allocated once and refilled in place, so that CUDA graphs captured over them stay valid:
`refresh()` refills them when a weight's version counter or data pointer moved (an optimizer
step, `.data` set to another tensor), `refresh(force=True)` also after writes that move neither
(through `.data`, a flat buffer, CUDA IPC) and after parameters were replaced by new tensors (the
engine forces it whenever its weight version is set, as `load_weights` does).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

QKV = ("self_attn", ("q_proj", "k_proj", "v_proj"))
GATE_UP = ("mlp", ("gate_proj", "up_proj"))
GATE_UP_AUTO_BYTES = 2 << 30  # the 1.1B shape's 1.07 GB and a 1.5B Qwen2's 1.5 GB; not a 3B's


def stacks_gate_up(choice, gate_up_bytes: float) -> bool:
    """Whether stacking (`choice`: None = automatic, "qkv", True) covers gate|up, whose copies
    would take `gate_up_bytes`: automatically up to GATE_UP_AUTO_BYTES. The engine and the
    planner (launch/cost_model.py) both decide with this."""
    if choice is None:
        return gate_up_bytes <= GATE_UP_AUTO_BYTES
    return choice is True


def _modules(layer: nn.Module, group: tuple) -> list[nn.Module]:
    owner, names = group
    return [getattr(getattr(layer, owner), n) for n in names]


def stackable(model: nn.Module, group: tuple = QKV) -> bool:
    """Whether every layer's projections of `group` (QKV, GATE_UP) are plain tensors (not
    DTensor shards) of one dtype and device, with biases on all of them or none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    for layer in layers:
        mods = _modules(layer, group)
        ws = [m.weight for m in mods]
        if (any(hasattr(w, "to_local") for w in ws) or len({(w.dtype, w.device) for w in ws}) != 1
                or len({m.bias is None for m in mods}) != 1):
            return False
    return True


def gate_up_bytes(model: nn.Module) -> int:
    """Bytes the stacked gate|up copies of `model` take."""
    return sum(m.weight.numel() * m.weight.element_size()
               for layer in model.model.layers for m in _modules(layer, GATE_UP))


class StackedWeights:
    """`qkv`: for each layer (stacked weight [q + k + v rows, hidden], stacked bias or None, the
    three row counts), as `KVCache.qkv` takes it; `gate_up`: the same for gate|up (`KVCache.
    gate_up`), or None with `gate_up=False` (q|k|v only: the benches' A/B)."""

    def __init__(self, model: nn.Module, gate_up: bool = True):
        self._sources = []  # per stack: (its modules, the stacked entry)
        groups = {"qkv": QKV, "gate_up": GATE_UP} if gate_up else {"qkv": QKV}
        stacks: dict[str, list] = {name: [] for name in groups}
        with torch.no_grad():
            for layer in model.model.layers:
                for name, group in groups.items():
                    mods = _modules(layer, group)
                    ws = [m.weight for m in mods]
                    bias = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
                    entry = (torch.cat(ws), bias, [w.shape[0] for w in ws])
                    stacks[name].append(entry)
                    self._sources.append((mods, entry))
        self.qkv, self.gate_up = stacks["qkv"], stacks.get("gate_up")
        self._modules: list[nn.Module] = [m for mods, _ in self._sources for m in mods]
        self._gather()
        self._stamp = self._stamps()
        self.refills = 0  # refreshes that copied (tests check that an unchanged model copies none)

    def tensors(self) -> list[Tensor]:
        """The stacked copies (weights and biases), for memory accounting."""
        return [t for _, (w, b, _) in self._sources for t in (w, b) if t is not None]

    def _gather(self) -> None:
        """List the modules' current weights and biases, which the stamps read: `refresh` runs
        before every engine step, and reading them through the modules each time took 120 us a
        step for 16 layers; a forced refresh (after every weight swap) lists them again, since
        a swap may replace the tensors (load_state_dict with assign=True, a new nn.Parameter)."""
        self._tensors = [t for m in self._modules for t in (m.weight, m.bias) if t is not None]

    def _stamps(self) -> tuple:
        return tuple((t._version, t.data_ptr()) for t in self._tensors)

    @torch.inference_mode()  # the copies may have been made under it (inference tensors)
    def refresh(self, force: bool = False) -> None:
        """Refill the stacked copies in place if a weight changed (or always, with `force`)."""
        if force:
            self._gather()
        stamp = self._stamps()
        if not force and stamp == self._stamp:
            return
        for mods, (w, b, _) in self._sources:
            torch.cat([m.weight for m in mods], out=w)
            if b is not None:
                torch.cat([m.bias for m in mods], out=b)
        self._stamp = stamp
        self.refills += 1
