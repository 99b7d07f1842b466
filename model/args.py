"""Model hyper-parameters, and their translation to and from a Hugging Face config.json.

One `ModelArgs` describes every supported family. The families differ only in a few switches:

| family   | HF architecture      | attention bias      | q/k RMSNorm | sliding window            |
|----------|----------------------|---------------------|-------------|---------------------------|
| llama    | LlamaForCausalLM     | optional, q/k/v/o   | no          | never                     |
| mistral  | MistralForCausalLM   | never               | no          | every layer, default 4096 |
| qwen2    | Qwen2ForCausalLM     | always, q/k/v only  | no          | with use_sliding_window   |
| qwen3    | Qwen3ForCausalLM     | optional, q/k/v/o   | yes         | with use_sliding_window   |

Every family's MLP is SwiGLU (hidden_act "silu"); rope is "default", "llama3" or "linear". One
window serves all layers: a Qwen config that slides only some of them is refused.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> (model_type, family defaults that config.json may omit), as the
# transformers config classes default them (Qwen's window applies only with use_sliding_window,
# to layers max_window_layers and up). max_position_embeddings differs by family: a missing key
# read as one default for all would be written back into the export as that value.
_QWEN = {"sliding_window": 4096, "max_window_layers": 28, "max_position_embeddings": 32768,
         "num_key_value_heads": 32}
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("llama", {"max_position_embeddings": 2048}),
    "MistralForCausalLM": ("mistral", {"sliding_window": 4096, "max_position_embeddings": 131072,
                                       "num_key_value_heads": 8}),
    "Qwen2ForCausalLM": ("qwen2", _QWEN),  # q/k/v biases always: _attention_bias_of
    "Qwen3ForCausalLM": ("qwen3", {"qk_norm": True, "head_dim": 128, **_QWEN}),
}
_ARCH_BY_TYPE = {mt: arch for arch, (mt, _) in SUPPORTED_ARCHITECTURES.items()}
# rope_type -> the keys it needs besides rope_type: what model/rope.py reads (rope_theta is
# ModelArgs.rope_theta), as transformers' rope validation requires them
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(_ROPE_KEYS)


@dataclass
class ModelArgs:
    """Shapes and switches of one decoder-only transformer."""

    arch: str = "LlamaForCausalLM"  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope parameters beyond theta, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases, and o_proj's where HF has one (`o_proj_bias`)
    qk_norm: bool = False
    sliding_window: int | None = None  # one window for every layer (not for llama)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # other config.json keys, written back unchanged

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                                 f"num_heads={self.num_heads}; set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.rope_scaling is not None:
            # The export writes this dict as transformers reads it: the forward must read it the
            # same way (4.x's "type" spelling included), or the two models rotate differently.
            self.rope_scaling = _spelled_rope_type(self.rope_scaling)
            _check_rope(self.rope_scaling, "ModelArgs.rope_scaling")
            theta = self.rope_scaling.pop("rope_theta", self.rope_theta)
            if theta != self.rope_theta:
                raise ValueError(f"ModelArgs.rope_scaling has rope_theta={theta} but rope_theta="
                                 f"{self.rope_theta}: the export would write the first, the "
                                 "forward use the second; set rope_theta only")
        _check_unsupported_keys(self.extra, self.model_type, "ModelArgs.extra")
        # The export could not represent these: transformers would build another model.
        if self.attention_bias and self.model_type == "mistral":
            raise ValueError("attention_bias=True with MistralForCausalLM: transformers' Mistral "
                             "has no attention biases; use LlamaForCausalLM (q/k/v/o biases) or "
                             "Qwen2ForCausalLM (q/k/v), or attention_bias=False")
        if self.sliding_window is not None and self.model_type == "llama":
            raise ValueError(f"sliding_window={self.sliding_window} with {self.arch}: "
                             "transformers' Llama has no sliding window; use MistralForCausalLM "
                             "(same layers otherwise), or sliding_window=None")

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.arch][0]

    @property
    def eos_ids(self) -> list[int]:
        """All end-of-sequence ids (config.json allows an int or a list)."""
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: with attention_bias in Llama and Qwen3 (all four
        projections), never in Qwen2 (q/k/v only) or Mistral (no biases)."""
        return self.attention_bias and self.model_type in ("llama", "qwen3")

    def num_params(self) -> int:
        """Parameter count, from the shapes alone (used by planners and benchmarks)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += h if self.o_proj_bias else 0
        attn += 2 * d if self.qk_norm else 0
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h
        return self.num_layers * layer + h + emb * (1 if self.tie_word_embeddings else 2)

    # ----- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelArgs":
        """Build from a parsed config.json (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        arch = _architecture_of(cfg, source)
        model_type, defaults = SUPPORTED_ARCHITECTURES[arch]
        _check_activation(cfg, source)
        _check_unsupported_keys(cfg, model_type, source)
        max_positions = cfg.get("max_position_embeddings", defaults["max_position_embeddings"])
        theta, scaling = _rope_of(cfg, max_positions, source)
        known = {f.name for f in dataclasses.fields(cls)} | {
            "architectures", "model_type", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rope_parameters", "use_sliding_window", "layer_types", "dtype",
            "hidden_act", "hidden_activation"}
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=_kv_heads_of(cfg, defaults),
            head_dim=cfg.get("head_dim", defaults.get("head_dim")) or 0,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias_of(cfg, model_type),
            qk_norm=defaults.get("qk_norm", False),
            sliding_window=_sliding_window_of(cfg, model_type, defaults, source),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_hf_config(self) -> dict:
        """A config.json dict that transformers 4.x and 5.x both read."""
        self._check_exportable()
        rope_params = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        cfg = dict(self.extra)
        cfg.update(
            architectures=[self.arch], model_type=self.model_type, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, rope_parameters=rope_params,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
            hidden_act="silu", torch_dtype=self.torch_dtype, dtype=self.torch_dtype,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            cfg["sliding_window"] = self.sliding_window  # explicit null: Mistral's default is 4096
        if self.model_type in ("qwen2", "qwen3"):
            # Qwen slides only the layers that layer_types marks (transformers 5), or else those
            # from max_window_layers on (4.x): both say every layer, or none.
            slides = self.sliding_window is not None
            cfg["use_sliding_window"] = slides
            kind = "sliding_attention" if slides else "full_attention"
            cfg["layer_types"] = [kind] * self.num_layers
            if slides:
                cfg["max_window_layers"] = 0
        return cfg

    def _check_exportable(self) -> None:
        """Refuse the switches that config.json cannot carry: transformers builds q/k norms for
        Qwen3 only and always, and Qwen2's q/k/v biases always, whatever the args say. Checked
        at export, not at construction: cost models build such shapes without exporting them."""
        if self.qk_norm != (self.model_type == "qwen3"):
            fix = ("qk_norm=True" if self.model_type == "qwen3"
                   else "arch='Qwen3ForCausalLM' (q/k norms), or qk_norm=False")
            raise ValueError(f"cannot export qk_norm={self.qk_norm} with {self.arch}: "
                             "transformers builds q/k RMSNorms for Qwen3ForCausalLM only and "
                             "always, so it would load another model (q_norm/k_norm weights "
                             f"added as ones, or dropped); use {fix}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError(f"cannot export attention_bias=False with {self.arch}: transformers' "
                             "Qwen2 always has q/k/v biases (our loader requires them in the "
                             "checkpoint); use attention_bias=True, or arch='LlamaForCausalLM' "
                             "(no biases, same layers otherwise)")


def _check_activation(cfg: dict, source: str) -> None:
    """Every family's MLP here is SwiGLU: refuse a config.json that asks for another activation."""
    for key in ("hidden_act", "hidden_activation"):
        act = cfg.get(key)
        if act is not None and act not in ("silu", "swish"):
            raise ValueError(f"{source}: {key}={act!r} is not supported: tandem's MLP applies SiLU "
                             "(silu/swish) only; use a model trained with silu, or add the "
                             "activation to model/transformer.py's MLP")


def _check_unsupported_keys(cfg: dict, model_type: str, source: str) -> None:
    """Refuse, by name, keys with which transformers builds a model tandem's layers cannot be:
    a quantized checkpoint, a partial rotary (only some of each head rotated) and Llama's MLP
    biases."""
    quant = cfg.get("quantization_config")
    if quant:  # its tensors (qweight, scales, ...) would be refused one by one as unexpected
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"{source}: quantization_config (quant_method={method!r}) is not "
                         "supported: tandem loads and trains unquantized bfloat16/float16/float32 "
                         "weights; use the model's unquantized release, or load it in "
                         "transformers, dequantize and save_pretrained it in bfloat16")
    _check_full_rotary(cfg.get("partial_rotary_factor"), f"{source}: partial_rotary_factor")
    # Only Llama reads mlp_bias: Mistral's and Qwen's MLPs have no biases whatever it says.
    if model_type == "llama" and cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias={cfg['mlp_bias']} is not supported: tandem's MLP "
                         "(model/transformer.py) has no biases; use a model without MLP biases "
                         "(mlp_bias false)")


def _check_full_rotary(factor, where: str) -> None:
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"{where}={factor} is not supported: tandem rotates every dimension of "
                         "each head (model/rope.py); use a model with full rotary embeddings "
                         "(partial_rotary_factor 1.0 or absent)")


def _kv_heads_of(cfg: dict, defaults: dict) -> int:
    """num_key_value_heads as transformers reads it: a missing key is the family's default
    (Mistral's 8, Qwen's 32, Llama's none), none is num_attention_heads (multi-head)."""
    kv = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else defaults.get(
        "num_key_value_heads")
    return kv or cfg["num_attention_heads"]


def _rope_of(cfg: dict, max_positions: int, source: str) -> tuple[float, dict | None]:
    """rope_theta and the rope dict beyond it (None for plain rope), as transformers 5 reads
    config.json: rope_scaling (4.x's key) wins over rope_parameters when both are set, the dict's
    rope_theta over the top-level one, and a llama3 rope's original_max_position_embeddings is
    the top-level one where config.json has it (over the dict's, as transformers'
    standardize_rope_params has it), else the dict's, else max_position_embeddings."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = _spelled_rope_type(cfg.get(key) or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope["rope_type"] == "llama3":
        if cfg.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", max_positions)
    _check_rope(rope, f"{source}: {key}")
    return theta, (rope if rope["rope_type"] != "default" else None)


def _spelled_rope_type(rope: dict) -> dict:
    """A copy of `rope` with its type under "rope_type": transformers 4.x wrote "type", and
    reads rope_type first, then type, then "default"."""
    rope = dict(rope)
    kind = rope.pop("type", "default")
    rope.setdefault("rope_type", kind)
    return rope


def _check_rope(rope: dict, where: str) -> None:
    """A rope type model/rope.py computes, with every key it reads, rotating whole heads."""
    kind = rope["rope_type"]
    if kind not in _ROPE_KEYS:
        raise ValueError(f"{where}: unsupported rope_type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}")
    missing = [k for k in _ROPE_KEYS[kind] if k not in rope]
    if missing:
        raise ValueError(f"{where}: rope_type {kind!r} needs {missing} (has {sorted(rope)}); "
                         "add them as the model was trained (see its original config.json)")
    _check_full_rotary(rope.get("partial_rotary_factor"), f"{where}.partial_rotary_factor")


def _attention_bias_of(cfg: dict, model_type: str) -> bool:
    """As transformers builds the family: Qwen2 always has q/k/v biases and Mistral none, whatever
    config.json says; Llama and Qwen3 follow attention_bias."""
    if model_type in ("qwen2", "mistral"):
        return model_type == "qwen2"
    return bool(cfg.get("attention_bias", False))


def _sliding_window_of(cfg: dict, model_type: str, defaults: dict, source: str) -> int | None:
    """The one window of every layer, as transformers reads config.json: Llama never slides,
    Mistral slides every layer (a missing key is its default window, null is none) unless
    config.json has layer_types (AutoConfig then reads it as Ministral: the layers marked
    "sliding_attention" slide), and Qwen only with use_sliding_window, in the layers that
    layer_types marks (without it: layers max_window_layers and up). A model whose layers mix
    the two is refused."""
    if model_type == "llama":
        return None
    window = cfg.get("sliding_window", defaults["sliding_window"])
    if model_type == "mistral":
        if window is None or cfg.get("layer_types") is None:
            return window
        return _one_window(window, cfg["layer_types"], "layer_types (read as Ministral's)", source)
    if window is None or not cfg.get("use_sliding_window", False):
        return None
    first = cfg.get("max_window_layers", defaults["max_window_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    return _one_window(window, types, f"use_sliding_window with max_window_layers={first}, or "
                                      "layer_types", source)


def _one_window(window: int, types: list, how: str, source: str) -> int | None:
    """`window` where every layer of `types` is "sliding_attention", None where none is."""
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if len(sliding) not in (0, len(types)):
        raise ValueError(f"{source}: sliding_window={window} applies to layers {sliding} of "
                         f"{len(types)} only ({how}); tandem has one window for all layers, so "
                         "it runs a model whose layers all slide or none do, not this mix")
    return window if sliding else None


def _architecture_of(cfg: dict, source: str) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and cfg.get("model_type") in _ARCH_BY_TYPE:
        return _ARCH_BY_TYPE[cfg["model_type"]]
    found = archs or cfg.get("model_type")
    raise ValueError(f"{source}: unsupported architecture {found!r}; "
                     f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
