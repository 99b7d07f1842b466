"""Apply tensor parallelism, activation checkpointing, compile and FSDP2 to a `model.Transformer`
from outside, in torchtitan's order (TP -> AC -> compile -> FSDP), then materialise and load.

TP (Megatron-style, no sequence parallelism):
  q/k/v, gate/up  ColwiseParallel  -> each rank holds whole heads (and their q/k/v bias slices)
  o, down         RowwiseParallel  -> partial sums all-reduced ("g" operator of Megatron)
  embed_tokens    RowwiseParallel  -> vocab-sharded lookup, all-reduced to a replicated output
  lm_head         ColwiseParallel  -> vocab-sharded logits, gathered to replicated logits
  norms           replicated
  q/k norms       (Qwen3, trainer only) replicated DTensors over the rank's heads (`_head_norm`),
                  so that their gradient, a partial sum over each rank's heads, is all-reduced
FSDP2 shards every parameter on dim 0 over the `fsdp` axis (after TP on the same 2-D mesh).
Gradients are *summed* over fsdp ranks (divide factor 1): the trainer normalises its loss by the
global token count itself, so gradient accumulation and data parallelism equal one big batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.checkpoint import checkpoint

from model import Transformer
from model.hf_io import CheckpointReader, check_tensors, expected_tensors, to_dtype
from parallel.dims import resolve_fsdp_units
from parallel.layout import local_box


def tp_plan(model: Transformer, grads: bool = False) -> dict:
    """Module FQN -> ParallelStyle; keyed by the same names as the HF checkpoint. `grads`: the
    plan of a trainer, whose per-head q/k norms (Qwen3) need their gradients reduced over TP."""
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
        if grads and model.args.qk_norm:
            plan[p + "self_attn.q_norm"] = plan[p + "self_attn.k_norm"] = _head_norm()
    return plan


def _head_norm() -> SequenceParallel:
    """A q/k RMSNorm (over head_dim) applied to each TP rank's own heads, [B, T, H_local, D]: its
    weight is one Replicate DTensor and its input is marked sharded on the head axis, so autograd
    all-reduces the weight's gradient (each rank's is the sum over its heads only; a plain
    replicated weight got just that, and the ranks' copies drifted apart). Megatron's treatment of
    sequence-parallel norms, applied to heads instead of tokens; forward values are unchanged."""
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, grads: bool = False) -> None:
    if model.args.tie_word_embeddings:
        raise ValueError("tensor parallelism with tied embeddings is not supported; set tp=1")
    parallelize_module(model, tp_mesh, tp_plan(model, grads))


def apply_ac(model: Transformer) -> None:
    """Recompute each decoder layer in backward. Patches `forward` on the instance so that module
    names (and therefore checkpoint keys and layouts) do not change."""
    for layer in model.model.layers:
        inner = layer.forward

        def forward(x, ctx, _inner=inner):
            return checkpoint(_inner, x, ctx, use_reentrant=False)

        layer.forward = forward


# Compiled TP blocks hold a graph per static token count for each of the trainer's forward, its
# no-grad forwards and the frozen KL reference's: 3 x 4 counts within the budget, and each count
# of a micro-batch past it (a sequence longer than trainer.micro_batch_tokens). Dynamo's limit is
# process-wide: a colocated rank's compiled decode step gets it too (it needs a few).
STATIC_RECOMPILE_LIMIT = 64


def apply_compile(model: Transformer, token_bucket: int | None = None) -> None:
    """torch.compile each decoder layer's blocks (norms, attention, MLP) in place, not the layer:
    a layer checkpointed by `apply_ac` then runs them compiled, forward and recompute alike (a
    compiled layer around the checkpoint was run eager whole). Attention over packed sequences
    stays eager inside (`model.transformer._Context._packed`). Module names do not change.

    The token count becomes symbolic at the second one seen, except with `token_bucket`: then
    the blocks compile for static counts, and the trainer pads each packed batch to a multiple
    of the bucket (`model.token_bucket`, `trainer.step._logits`). Tensor-parallel layers need
    that: torch 2.13 fails to recompile their DTensor code with a symbolic count (a
    RecursionError in the backward's tracing, BENCHMARKS.md "Training step")."""
    dynamic = None if token_bucket is None else False
    for layer in model.model.layers:
        for block in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                      layer.mlp):
            block.compile(dynamic=dynamic)
    model.token_bucket = token_bucket
    if token_bucket is not None:
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, STATIC_RECOMPILE_LIMIT)


def tp_token_bucket(micro_batch_tokens: int) -> int:
    """The static token counts of compiled TP layers: multiples of a quarter of the budget."""
    return -(-micro_batch_tokens // 4)


class AllToAllReduceScatter:
    """FSDP2's gradient reduce-scatter on gloo as one all-to-all plus a local sum: gloo's own
    reduce-scatter costs about an all-reduce of the whole input (2 gloo ranks: 15.3 ms for 13.6 MB
    and 3.2 ms for 1.7 MB, against 6.2 and 0.6 ms this way; BENCHMARKS.md). Same bytes on the
    wire as a ring reduce-scatter, (k-1)/k of the input per rank; one full-size receive buffer.
    FSDP2's `ReduceScatter` interface (`allocate` + call), duck-typed: that class is private."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        k = dist.get_world_size(group)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor.contiguous(), group=group)
        torch.sum(received.view(k, -1), dim=0, out=output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(k)
        return None


def apply_fsdp(model: Transformer, fsdp_mesh: DeviceMesh, param_dtype: torch.dtype | None,
               units: str = "layer") -> None:
    """FSDP2 units as `parallel.dims.resolve_fsdp_units` describes: per decoder layer plus a root
    unit (embeddings, final norm, head), or one root unit. On CPU (gloo) the gradient reduce-scatter is an
    all-to-all plus a sum (`AllToAllReduceScatter`). `model.fsdp_units` tells the train step
    whether to accumulate gradients unsharded ("model")."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    per_layer = units == "layer"
    if per_layer:
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=per_layer)
    model.fsdp_units = units
    for unit in (*(model.model.layers if per_layer else ()), model):  # setters apply per unit
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        if fsdp_mesh.device_type == "cpu" and hasattr(unit, "set_custom_reduce_scatter"):
            unit.set_custom_reduce_scatter(AllToAllReduceScatter())


def compute_dtype(choice: str, device_type: str, param_dtype: torch.dtype) -> torch.dtype:
    """The trainer's compute dtype (`model.compute_dtype`): "auto" is bf16 on CUDA and the
    parameters' own dtype elsewhere; never wider than the parameters, and fp16 parameters stay
    fp16 (no sideways bf16 cast)."""
    if choice not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"compute_dtype={choice!r}: choose 'auto', 'float32' or 'bfloat16'")
    if choice == "auto":
        want = torch.bfloat16 if device_type == "cuda" else param_dtype
    else:
        want = to_dtype(choice)
    return want if want == param_dtype or want.itemsize < param_dtype.itemsize else param_dtype


def parallelize_trainer(model: Transformer, mesh: DeviceMesh, *, activation_checkpointing=False,
                        compile=False, units: str = "auto", compute: str = "auto",
                        micro_batch_tokens: int | None = None) -> Transformer:
    """`mesh` is the trainer mesh (fsdp, tp). `compute` (`compute_dtype`): with FSDP it is FSDP's
    param dtype (the gathered parameters are cast); on one FSDP rank it is set as
    `model.autocast_dtype`, and the train step runs the forward under autocast. Either way the
    parameters, gradients and optimizer state keep the parameters' dtype. Compiled TP layers
    compile for static token counts (`apply_compile`), from the trainer's `micro_batch_tokens`."""
    param_dtype = next(model.parameters()).dtype
    want = compute_dtype(compute, mesh.device_type, param_dtype)
    cast = want if want != param_dtype else None
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], grads=True)
    if activation_checkpointing:
        apply_ac(model)
    if compile:
        bucket = None
        if mesh["tp"].size() > 1:
            if micro_batch_tokens is None:
                raise ValueError("compiled tensor-parallel layers pad packed batches to static "
                                 "token counts: pass micro_batch_tokens (the trainer's budget)")
            bucket = tp_token_bucket(micro_batch_tokens)
            # The embedding's all-reduced output is an AsyncCollectiveTensor; a compiled first
            # norm given one returned a wrong gradient for it (the embedding's, off by up to
            # 0.17 in the tiny test's against eager): the blocks get a plain tensor.
            model.model.embed_tokens.register_forward_hook(lambda _m, _i, out: out.clone())
        apply_compile(model, bucket)
    sharded = mesh["fsdp"].size() > 1
    if sharded:
        apply_fsdp(model, mesh["fsdp"], cast,  # FSDP2 composes with TP DTensors into 2-D
                   resolve_fsdp_units(units, mesh.device_type))
    model.autocast_dtype = None if sharded else cast
    return model


def parallelize_generator(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """TP only, no gradients; replicas along `dp` each hold a full TP-sharded copy."""
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    model.requires_grad_(False)
    return model


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


@torch.no_grad()
def load_sharded(model: Transformer, path) -> None:
    """Fill a materialised (possibly sharded) model from a HF folder, reading only each rank's
    own slice of every tensor: no rank ever holds a full tensor beyond its shard."""
    reader = CheckpointReader(path)
    check_tensors(reader, expected_tensors(model))
    for name, param in model.named_parameters():  # a tied head appears once, as the embedding
        box = local_box(name, param)  # what FSDP2/TP really stores, uneven shards included
        local_tensor(param).copy_(reader.get_slice(name, box.offsets, box.sizes))


def build_model(args, device: torch.device, dtype: torch.dtype,
                parallelize=None, path=None, seed: int = 0, attn_backend: str = "auto") -> Transformer:
    """meta -> parallelize -> to_empty -> load (or init): the model never exists unsharded.
    `attn_backend` (model.attn_backend) picks the packed forward's attention."""
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model.attn_backend = attn_backend
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=device)
    if model.args.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.tie_weights()  # to_empty re-creates parameters one by one: a plain tie is lost
    if path:
        load_sharded(model, path)
    else:
        model.init_weights(seed=seed)
    return model


def describe_layouts(dims, model_path: str) -> str:
    """Dry-run text: per-parameter placement on both meshes (no process group)."""
    from model.hf_io import load_model_args
    args = load_model_args(model_path)
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in Transformer(args).named_parameters()]
    lines = [f"model: {args.arch} {args.num_params() / 1e6:.1f}M params"]
    for name, shape in names[:12]:
        style = _style_of(name)
        lines.append(f"  {name} {list(shape)}: trainer fsdp Shard(0){style}, generator {style or 'replicated'}")
    return "\n".join(lines)


def _style_of(name: str) -> str:
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head",
                               "embed_tokens")):
        return " + tp Shard(0)"
    if any(k in name for k in ("o_proj", "down_proj")):
        return " + tp Shard(1)" if name.endswith("weight") else ""  # a row-parallel bias: replicated
    return ""
