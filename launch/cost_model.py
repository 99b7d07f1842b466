"""A hand-checkable cost model of one RL step: memory per rank and time per phase, for a given
placement of the generator and trainer meshes. It is the estimator behind the planner
(launch/plan.py), in the spirit of ReaL (arXiv 2406.14088): profiled (or datasheet) per-layer
costs plus memory estimates, evaluated per candidate layout; an over-memory plan is infeasible.

Units: bytes, seconds, FLOP. "GB" means 1e9 bytes. N = parameter count (ModelArgs.num_params),
L = layers, h = hidden, i = intermediate, q = heads*head_dim, kv = kv_heads*head_dim, V = vocab.

Memory per rank (feasible iff <= mem_headroom * gpu_mem)
  trainer   states  = N/(fsdp*tp) * (master + grad + 2 AdamW states) bytes   (16 B/param in fp32)
            gathered= (2 layers + root unit)/tp * compute bytes  (FSDP2 unshards a unit and
                      prefetches the next; only when fsdp > 1)
            acts    = micro_batch_tokens * (L * a + V * (cb + 8))    a = cb*(4h + (2q+2kv+4i)/tp)
                      with activation checkpointing: micro_batch_tokens * (L*cb*h + a + V*(cb+8))
            ref     = N/(fsdp*tp) * master bytes: a frozen KL reference's shard (kl_coef > 0)
  generator weights = N * gen_bytes / gen_tp;  KV = 2*L*(kv_heads/gen_tp)*head_dim*kv_bytes*slots*max_len
            (kv_bytes = gen_bytes, but 4 for a bf16/fp16 generator on CPU: `kv_elem_bytes`;
            max_len = max_prompt_len + R); plus one staged copy of the shard for the weight
            sync (N * gen_bytes / gen_tp) and the engine's weight copies:
            oneDNN-packed on CPU, stacked q|k|v (and gate|up up to 2 GiB) on GPUs at tp 1;
            with held-out evaluations (eval.every_steps) replica 0 also holds the evaluation
            engine's KV cache: min(eval prompts, slots) slots of max_prompt_len + eval tokens
  colocated ranks hold both.
Time (datasheet; a Profile replaces the per-layer and link numbers with measured ones)
  T_gen   = waves * (prefill + R * decode_step),  per generator replica (replicas run in parallel)
            prefill     = (2*N_mm*P + 2*L*q*P^2) * prompts / (gen_tp * flops * mfu_prefill)
            decode_step = max(bytes/(hbm*hbm_eff), flops/(flops*mfu_decode)) + 2L TP all-reduces
                          bytes = N_mm*gen_bytes/tp + slots*ctx*kv_bytes_per_token/tp (ctx = P + R/2)
  T_train = compute + max(0, comm - overlap*compute) + optimizer
            compute = ((6 + 2*ac + 2*ref)*N_mm*D + (3 + ac + ref)*2*L*q*l^2*seqs)
                      / (fsdp*tp * flops * mfu_train)   (ref = 1: a KL reference's forward)
            comm    = micro_batches * (FSDP "layer" units: 2 all-gathers (cb) + 1 reduce-scatter
                      (fp32) of N/tp over the fsdp link; TP: 4L + 4 (+2L with ac) all-reduces of
                      tokens*h*cb) + one latency per collective, per-step ones included
                      (`trainer_collectives`); one FSDP "model" unit (CPU): one all-gather and
                      one reduce-scatter per step, whatever the micro-batches; a KL
                      reference adds one all-gather of its N/tp (cb) and its forward's TP
                      all-reduces per micro-batch
  T_sync  = max(max bytes a trainer rank sends, max bytes a generator rank receives) / link,
            from the REAL weights_sync.plan (`sync_bytes_from_plan`) or its even-shard closed form
  step    eta = 0 (synchronous): T_gen + T_train + T_sync (+ 2 link hand-offs)
          eta >= 1 (asynchronous, LlamaRL): max(T_gen, T_train + T_sync); colocated is always
          synchronous (time-shared ranks). With fixed lengths eta = 1 already overlaps fully in
          steady state; a larger eta only absorbs variance.
CPU ranks that share cores (the validation machine) slow each other down: with s(k) the slowdown
of k busy ranks (measured by the profile, else max(1, k/cores)), `step_time` uses
  sync     : compute_gen*s(G) + compute_train*s(T) + comm + T_sync (a rank waiting in a
             collective leaves the cores to the others, which are idle or in the same collective)
  colocated: T_gen*s_gen(N) + T_train*s(N) + T_sync + gather(N): every rank is in the same
             phase, and its collective peers compete for the cores with the other ranks'
             compute; s_gen is the measured slowdown of generator TP=2 pairs where gen_tp = 2
             (they mostly wait on each other), else s(N); gather(N) is the measured exchange
             of the step's groups among all N ranks (trainer/colocated.py)
  async    : a*s(G+T) + (b-a)*s(ranks of b) (+ T_sync on the trainer's side),  a <= b the two
             whole phases, communication included: it competes with the other mesh's compute
which reduce to the formulas above when s = 1. Time-sharing also makes each phase's duration
vary (cv(k), measured with s(k)); the step is then the mean of launch/pipeline.py's recurrence
(staleness gate, the slowest of the gen_dp replicas) over phases drawn around those means, which
exceeds the max where the phases balance. With cv = 0 (GPUs) it is exactly the formulas above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from launch.pipeline import mean_step_s
from model.args import ModelArgs
from parallel.dims import resolve_fsdp_units
from parallel.layout import dtype_bytes

GB = 1e9
LINK_POLL_S = 1e-4  # hand-off delay of trainer.link.wait_for: it wakes on the message key (a store round trip)


# ----- inputs ---------------------------------------------------------------------------------
def _at_least(low: int, **values) -> None:
    """ValueError naming the first of `values` below `low`."""
    for name, v in values.items():
        if v < low:
            raise ValueError(f"{name}={v}: it must be >= {low}")


@dataclass(frozen=True)
class Cluster:
    """Hardware, per GPU unless said otherwise; the efficiency factors turn peaks into achieved."""
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    flops: float = 989e12          # dense bf16 peak FLOP/s (H100 SXM)
    hbm_gbps: float = 3350.0       # HBM bandwidth, GB/s
    intra_gbps: float = 450.0      # NVLink, per GPU and direction, GB/s
    inter_gbps: float = 50.0       # one 400 Gb/s NIC per GPU, GB/s
    link_latency_s: float = 10e-6  # per message / ring hop
    mfu_train: float = 0.40
    mfu_prefill: float = 0.50
    mfu_decode: float = 0.50
    hbm_eff: float = 0.70
    link_eff: float = 0.80
    overlap: float = 1.0           # fraction of training compute that can hide FSDP/TP traffic
    mem_headroom: float = 0.90     # allocator fragmentation, CUDA context, workspaces
    compute_bytes: int = 2         # bf16 compute (GPU); 4 on CPU
    shared_cores: int = 0          # > 0: all ranks share this many CPU cores (time dilation)
    fsdp_units: str = "layer"      # parallel.fsdp_units as resolved here (parallel.dims)
    name: str = "h100"

    def __post_init__(self) -> None:
        _at_least(1, nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        _at_least(0, shared_cores=self.shared_cores)

    @property
    def one_cpu_host(self) -> bool:
        """Every rank on one host's shared CPU cores (`cpu_cluster`)."""
        return self.nodes == 1 and self.shared_cores > 0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


GPUS = {  # datasheet numbers (dense bf16, SXM parts)
    "h100": dict(gpu_mem_gb=80.0, flops=989e12, hbm_gbps=3350.0, intra_gbps=450.0, inter_gbps=50.0),
    "h200": dict(gpu_mem_gb=141.0, flops=989e12, hbm_gbps=4800.0, intra_gbps=450.0, inter_gbps=50.0),
    "a100": dict(gpu_mem_gb=80.0, flops=312e12, hbm_gbps=2039.0, intra_gbps=300.0, inter_gbps=25.0),
}


def gpu_cluster(gpu: str, nodes: int, gpus_per_node: int = 8, **overrides) -> Cluster:
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; choose one of {sorted(GPUS)} (or 'cpu')")
    return Cluster(nodes=nodes, gpus_per_node=gpus_per_node, name=gpu, **{**GPUS[gpu], **overrides})


def cpu_cluster(ranks: int, cores: int, mem_gb: float = 16.0) -> Cluster:
    """One host running `ranks` single-threaded ranks on `cores` cores, fp32, no overlap."""
    _at_least(1, cores=cores)
    return Cluster(nodes=1, gpus_per_node=ranks, gpu_mem_gb=mem_gb / max(ranks, 1), flops=20e9,
                   hbm_gbps=10.0, intra_gbps=2.0, inter_gbps=2.0, link_latency_s=200e-6,
                   mfu_train=1.0, mfu_prefill=1.0, mfu_decode=1.0, hbm_eff=1.0, link_eff=1.0,
                   overlap=0.0, compute_bytes=4, shared_cores=cores,
                   fsdp_units=resolve_fsdp_units("auto", "cpu"), name="cpu")


@dataclass(frozen=True)
class Workload:
    """One RL step: B prompt groups of n samples, fixed prompt and response lengths.
    `share_prompts`: the trainer packs each group's prompt once (`trainer.share_prompts`).
    `max_prompt_len`: data.max_prompt_len, the longest prompt admitted (0: prompt_len); the
    engine's KV slots hold it plus response_len positions (rollout/role.py), whatever the mean.
    `kl_reference`: each trainer rank also holds its shard of a frozen KL reference model
    (algo.kl_coef > 0, trainer.role.build_ref_model). `updates`: optimizer updates per step
    (trainer.updates_per_step); `prox_loss`: the loss needs pi_prox (decoupled PPO, PPO with
    token IS), one more forward a micro-batch when updates > 1 (trainer.step).
    `eval_prompts`: eval.num_prompts where eval.every_steps > 0, else 0: generator replica 0 then
    also holds an evaluation engine's KV cache of min(eval_prompts, slots) slots of
    `eval_slot_len` positions (rollout.role.build_eval); `eval_new_tokens`: eval.max_new_tokens
    (0: response_len)."""
    prompts_per_step: int
    group_size: int
    prompt_len: int
    response_len: int
    eta: int = 1
    master_dtype: str = "float32"
    gen_dtype: str = "bfloat16"
    share_prompts: bool = True
    stack_weights: str = "auto"  # generator.stack_weights: the GPU engine's stacked copies
    max_prompt_len: int = 0
    kl_reference: bool = False
    updates: int = 1
    prox_loss: bool = False
    eval_prompts: int = 0
    eval_new_tokens: int = 0

    def __post_init__(self) -> None:
        _at_least(1, prompts_per_step=self.prompts_per_step, group_size=self.group_size,
                  prompt_len=self.prompt_len, response_len=self.response_len, updates=self.updates)
        _at_least(0, eta=self.eta, eval_prompts=self.eval_prompts,
                  eval_new_tokens=self.eval_new_tokens)
        if self.max_prompt_len and self.max_prompt_len < self.prompt_len:
            raise ValueError(f"max_prompt_len={self.max_prompt_len} < prompt_len={self.prompt_len}: "
                             "the longest prompt admitted cannot be shorter than the mean")

    @property
    def prompt_cap(self) -> int:
        """The longest prompt admitted: data.max_prompt_len of the config that runs this."""
        return self.max_prompt_len or self.prompt_len

    @property
    def slot_len(self) -> int:
        """Positions of one KV slot: the engine's max_len = max_prompt_len + max_new_tokens."""
        return self.prompt_cap + self.response_len

    @property
    def longest_seq(self) -> int:
        """Tokens of the longest sequence the trainer packs: the longest prompt admitted plus
        response_len (the KV slot's length)."""
        return self.slot_len

    @property
    def eval_slot_len(self) -> int:
        """Positions of one evaluation KV slot (rollout.evaluate.engine_shape)."""
        return self.prompt_cap + (self.eval_new_tokens or self.response_len)

    @property
    def seqs(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def group_train_tokens(self) -> int:
        """Tokens the trainer packs for one group (`trainer.batch.group_tokens`)."""
        from trainer.batch import group_tokens
        return group_tokens(self.prompt_len, [self.response_len] * self.group_size,
                            self.share_prompts)


@dataclass(frozen=True)
class Placement:
    """One candidate: the split of the world and each mesh's degrees."""
    world: int
    mode: str = "split"  # split | colocated
    generator_ranks: int = 1
    gen_tp: int = 1
    trainer_tp: int = 1
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        """The mesh arithmetic the runtime checks (config._resolve_layout), so that a hand-made
        placement cannot be costed with a gen_dp or trainer_fsdp rounded down or zero."""
        _at_least(1, world=self.world, gen_tp=self.gen_tp, trainer_tp=self.trainer_tp)
        factors = (f"world={self.world} mode={self.mode!r} generator_ranks={self.generator_ranks} "
                   f"gen_tp={self.gen_tp} trainer_tp={self.trainer_tp}")
        if self.mode not in ("split", "colocated"):
            raise ValueError(f"{factors}: mode must be 'split' or 'colocated'")
        if self.mode == "colocated" and self.generator_ranks != self.world:
            raise ValueError(f"{factors}: colocated, every rank generates: generator_ranks must be "
                             f"{self.world}")
        if self.mode == "split" and not 1 <= self.generator_ranks < self.world:
            raise ValueError(f"{factors}: split mode needs 1 <= generator_ranks < world (the rest "
                             f"train)")
        for mesh, ranks, tp in (("generator", self.generator_ranks, self.gen_tp),
                                ("trainer", self.trainer_ranks, self.trainer_tp)):
            if ranks % tp:
                raise ValueError(f"{factors}: the {mesh}'s tp {tp} does not divide its {ranks} ranks")

    @property
    def trainer_ranks(self) -> int:
        return self.world if self.mode == "colocated" else self.world - self.generator_ranks

    @property
    def gen_dp(self) -> int:
        return self.generator_ranks // self.gen_tp

    @property
    def trainer_fsdp(self) -> int:
        return self.trainer_ranks // self.trainer_tp

    def label(self) -> str:
        ac = " ac" if self.activation_checkpointing else ""
        if self.mode == "colocated":
            return f"coloc N={self.world} gen {self.gen_dp}x{self.gen_tp} | train {self.trainer_fsdp}x{self.trainer_tp}{ac}"
        return (f"G={self.generator_ranks} gen {self.gen_dp}x{self.gen_tp} | "
                f"train {self.trainer_fsdp}x{self.trainer_tp}{ac}")


# ----- model arithmetic ---------------------------------------------------------------------------
def matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in matmuls: all but the input embedding (a lookup), unless tied."""
    return args.num_params() - (0 if args.tie_word_embeddings else args.vocab_size * args.hidden_size)


def layer_params(args: ModelArgs) -> int:
    return (args.num_params() - args.hidden_size
            - args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)) // args.num_layers


def kv_bytes_per_token(args: ModelArgs, nbytes: int, tp: int = 1) -> int:
    """K and V of one token, all layers, one TP rank. Llama-3-8B bf16, tp 1: 2*32*8*128*2 = 131072."""
    return 2 * args.num_layers * (args.num_kv_heads // tp) * args.head_dim * nbytes


def act_bytes_per_token_layer(args: ModelArgs, cb: int, tp: int) -> int:
    """Saved activations of one decoder layer per token (flash-style attention, no S^2 term):
    norm inputs and outputs (4h, replicated under TP), q/k/v and attention output (2q + 2kv) and
    the SwiGLU gate/up/act/product (4i), column-parallel parts divided by tp.
    Llama-3-8B, bf16, tp 1: 2*(4*4096 + 2*4096 + 2*1024 + 4*14336) = 167936 B (164 KiB)."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return cb * (4 * args.hidden_size + (2 * q + 2 * kv + 4 * args.intermediate_size) // tp)


# ----- memory -----------------------------------------------------------------------------------
def trainer_state_bytes(args: ModelArgs, fsdp: int, tp: int, master_bytes: int = 4, cb: int = 2,
                        units: str = "layer") -> float:
    """Sharded master weights, grads and two AdamW states (4 copies in the master dtype), plus the
    FSDP2 working set when fsdp > 1: with "layer" units the unsharded units in the compute dtype
    (the unit in use, the prefetched next layer, and the root unit: embeddings + head); with one
    "model" unit the whole model gathered plus its unsharded fp32 gradients.
    Worked example, Llama-3-8B (N = 8.03e9), fsdp 8, tp 1, fp32 master, bf16 compute:
      states 8.03e9/8 * 16 = 16.06 GB; gathered (2*218.1e6 + 2*525.3e6)*2 = 2.97 GB -> 19.0 GB;
      "model" units: 16.06 + 8.03e9 * (2 + 4) = 64.24 GB."""
    n = args.num_params()
    states = n / (fsdp * tp) * 4 * master_bytes
    if fsdp == 1:
        return states
    if units == "model":
        return states + n / tp * (cb + 4)
    root = n - args.num_layers * layer_params(args)
    return states + (2 * layer_params(args) + root) / tp * cb


def reference_bytes(args: ModelArgs, wl: Workload, fsdp: int, tp: int) -> float:
    """A trainer rank's shard of the frozen KL reference (parameters only, in the master dtype,
    sharded like the trainer's), 0 without one. Llama-3-8B, fp32, fsdp 2 x tp 2: 8.03 GB."""
    return weight_bytes(args, fsdp * tp, dtype_bytes(wl.master_dtype)) if wl.kl_reference else 0.0


def trainer_act_bytes_per_token(args: ModelArgs, tp: int, cb: int, ac: bool) -> float:
    """Activation bytes per micro-batch token: L saved layers (or only L layer inputs plus one
    recomputed layer with activation checkpointing) and the full-vocab logits, stored in the
    compute dtype plus fp32 log-softmax and its gradient (V * (cb + 8))."""
    a = act_bytes_per_token_layer(args, cb, tp)
    layers = args.num_layers * cb * args.hidden_size + a if ac else args.num_layers * a
    return layers + args.vocab_size * (cb + 8)


def weight_bytes(args: ModelArgs, shards: int, nbytes: int) -> float:
    """One rank's share of the parameters, split evenly over `shards` ranks (a generator's TP
    shard; a frozen KL reference's FSDP x TP shard)."""
    return args.num_params() * nbytes / shards


def packed_copy_bytes(args: ModelArgs, cl: Cluster, wl: Workload, gen_tp: int) -> float:
    """Bytes of the engine's oneDNN-packed weight copies (rollout/packed_linear.py), which sit
    beside the model's own weights: on CPU, fp32 or bf16 (PACKED_DTYPES), tp 1, one per linear or
    sibling stack (q|k|v, gate|up) of at least MIN_NUMEL elements, biases stacked with their
    weights, and the LM head, in the generator's dtype. 0 elsewhere (GPUs, TP shards, fp16). An
    upper bound: the engine packs only where its timed trial finds packing faster on this CPU
    (`Engine.pack_trial`), and bf16 only where the CPU has oneDNN's bf16 kernels (AVX-512 or
    AVX-NE-CONVERT; `packed_linear.packed_dtypes`). SmolLM2-135M (hidden 576, 30 layers, 9/3
    heads of 64, intermediate 1536, vocab 49152): per layer 576*960 + 576*576 + 2*576*1536 +
    1536*576 = 3.54M, head 28.3M: (30*3.54M + 28.3M) * 4 B = 538 MB in fp32, half in bf16."""
    from rollout.packed_linear import MIN_NUMEL, PACKED_DTYPES
    packed = [str(d).removeprefix("torch.") for d in PACKED_DTYPES]
    if not cl.shared_cores or wl.gen_dtype not in packed or gen_tp > 1:
        return 0.0
    h, q, kv, inter = (args.hidden_size, args.num_heads * args.head_dim,
                       args.num_kv_heads * args.head_dim, args.intermediate_size)
    bias = q + 2 * kv if args.attention_bias else 0  # stacked with q|k|v, not counted for the size
    o_bias = h if args.o_proj_bias else 0  # Llama/Qwen3 attention_bias
    layer = [(h * (q + 2 * kv), bias), (q * h, o_bias), (2 * h * inter, 0), (inter * h, 0)]
    per_layer = sum(w + b for w, b in layer if w >= MIN_NUMEL)
    head = args.vocab_size * h
    return float(dtype_bytes(wl.gen_dtype)) * (args.num_layers * per_layer
                                               + (head if head >= MIN_NUMEL else 0))


def kv_elem_bytes(cl: Cluster, gen_dtype: str) -> int:
    """Bytes of one cached key/value element: the generator's dtype, but fp32 for a bf16/fp16
    generator on CPU (`cl.shared_cores`), whose engine keeps its cache in fp32
    (model.kv_cache.cache_dtype)."""
    gb = dtype_bytes(gen_dtype)
    return max(gb, 4) if cl.shared_cores else gb


def stacked_copy_bytes(args: ModelArgs, cl: Cluster, wl: Workload, gen_tp: int) -> float:
    """Bytes of the engine's stacked q|k|v and gate|up weight copies (rollout/stacked.py; biases
    too), beside the model's own on GPUs at gen_tp 1 (TP shards keep one matmul a projection), in
    the generator's dtype, as `wl.stack_weights` chooses (gate|up automatically up to
    `rollout.stacked.GATE_UP_AUTO_BYTES`). Llama-3-8B in bf16: q|k|v 32 * 4096 * (4096 + 2 *
    1024) * 2 B = 1.61 GB; gate|up 32 * 4096 * 2 * 14336 * 2 B = 7.52 GB, "all" only. On CPU
    counted for "all" only: the automatic choice stacks there with the compiled decode step,
    which the Workload does not name (the copies of the small models run on CPU are small: 0.14 GB
    for SmolLM2-135M in bf16: 33 MB q|k|v, 106 MB gate|up)."""
    from rollout.stacked import stacks_gate_up
    if gen_tp > 1 or wl.stack_weights == "off" or (cl.shared_cores and wl.stack_weights != "all"):
        return 0.0
    nbytes = float(dtype_bytes(wl.gen_dtype)) * args.num_layers
    rows = args.num_heads * args.head_dim + 2 * args.num_kv_heads * args.head_dim
    qkv = nbytes * rows * (args.hidden_size + (1 if args.attention_bias else 0))
    gate_up = nbytes * 2 * args.intermediate_size * args.hidden_size
    choice = {"auto": None, "all": True, "qkv": "qkv"}[wl.stack_weights]
    return qkv + (gate_up if stacks_gate_up(choice, gate_up) else 0.0)


def sync_staging_bytes(args: ModelArgs, wl: Workload, gen_tp: int) -> float:
    """The generator's staged copy of its shard, in the generator's dtype: each version is
    received whole into it, then swapped in at a safe point (weights_sync.sync.make_receiver:
    gloo/NCCL, CUDA IPC or shared memory with parallel.ipc_buffers >= 1; colocated ranks:
    trainer/colocated.py). The one receiver without it, CUDA IPC from a zero-copy trainer
    (ipc_buffers = 0: rollout/role.py applies straight from the trainer's shards), needs both
    meshes on one GPU, which the planner's layouts never are. Llama-3-8B in bf16 at gen_tp 2:
    8.03e9 * 2 / 2 = 8.03 GB."""
    return weight_bytes(args, gen_tp, dtype_bytes(wl.gen_dtype))


def colocated_send_bytes(args: ModelArgs, wl: Workload, trainer_ranks: int) -> float:
    """A colocated rank's send buffers (weights_sync/exchange.py: a version's sends go as one
    batch, each copied piece in a buffer of its own), at most its trainer shard in the
    generator's dtype; pieces already contiguous in that dtype go without one, so this bounds it.
    Llama-3-8B in bf16 on 8 ranks: 8.03e9 * 2 / 8 = 2.0 GB."""
    return weight_bytes(args, trainer_ranks, dtype_bytes(wl.gen_dtype))


def generator_kv_bytes(args: ModelArgs, tp: int, gen_bytes: int, slots: int, max_len: int) -> float:
    """Static KV cache: 2 * L * (kv_heads/tp) * head_dim * bytes * slots * max_len.
    Llama-3-8B bf16, tp 1, 256 slots x 2560 positions: 131072 * 256 * 2560 = 85.9 GB."""
    return kv_bytes_per_token(args, gen_bytes, tp) * slots * max_len


def eval_kv_bytes(args: ModelArgs, cl: Cluster, wl: Workload, gen_tp: int, slots: int) -> float:
    """The held-out evaluation engine's KV cache on generator replica 0, beside the rollout
    engine's (rollout.role.build_eval: min(eval prompts, generator.num_slots) slots of
    max_prompt_len + eval tokens, the rollout cache's dtype); 0 without evaluations.
    Llama-3-8B bf16, tp 2, 200 prompts, 256 slots, 512 + 2048 positions: 200 * 2560 * 65536
    = 33.6 GB."""
    kvt = kv_bytes_per_token(args, kv_elem_bytes(cl, wl.gen_dtype), gen_tp)
    return kvt * min(wl.eval_prompts, slots) * wl.eval_slot_len


@dataclass
class Memory:
    trainer: float = 0.0    # bytes per trainer rank
    generator: float = 0.0  # bytes per generator rank
    per_rank: float = 0.0   # the larger of the two; on colocated ranks their sum and the send buffers
    slots: int = 0
    micro_batch_tokens: int = 0
    why: str = ""           # empty when feasible


def generator_memory(args: ModelArgs, cl: Cluster, wl: Workload, gen_tp: int, gen_dp: int,
                     reserved: float = 0.0, slots: int = 0) -> tuple[float, int, str]:
    """(bytes per generator rank, KV slots, why-infeasible). slots=0 picks the most that fit,
    capped at the replica's sequences per step; `reserved` is memory already taken (colocated).
    The bytes are replica 0's, the largest: with held-out evaluations each of its first
    `wl.eval_prompts` slots has an evaluation slot beside it (`eval_kv_bytes`)."""
    cap = cl.mem_headroom * cl.gpu_mem_gb * GB
    gb = dtype_bytes(wl.gen_dtype)
    weights = (weight_bytes(args, gen_tp, gb) + packed_copy_bytes(args, cl, wl, gen_tp)
               + stacked_copy_bytes(args, cl, wl, gen_tp) + sync_staging_bytes(args, wl, gen_tp))
    kvt = kv_bytes_per_token(args, kv_elem_bytes(cl, wl.gen_dtype), gen_tp)
    per_slot, eval_slot = kvt * wl.slot_len, (kvt * wl.eval_slot_len if wl.eval_prompts else 0)
    seqs = -(-wl.prompts_per_step // gen_dp) * wl.group_size
    free = cap - reserved - weights
    if not slots and free > 0:
        slots = int(free // (per_slot + eval_slot))  # each slot with an evaluation slot
        if slots >= wl.eval_prompts:  # the evaluation slots stop at eval_prompts
            slots = int((free - wl.eval_prompts * eval_slot) // per_slot)
        slots = min(seqs, slots)
    used = weights + slots * per_slot + eval_kv_bytes(args, cl, wl, gen_tp, slots)
    if slots < 1:
        return used, 0, (f"generator: weights {weights / GB:.1f} GB (+{reserved / GB:.1f} GB reserved) "
                         f"leave no room for one KV slot of {(per_slot + eval_slot) / GB:.2f} GB"
                         + (" (with its evaluation slot)" if eval_slot else ""))
    if used + reserved > cap:
        return used, slots, f"generator: needs {(used + reserved) / GB:.1f} GB > {cap / GB:.1f} GB usable"
    return used, slots, ""


def trainer_memory(args: ModelArgs, cl: Cluster, wl: Workload, fsdp: int, tp: int, ac: bool,
                   reserved: float = 0.0, micro_batch_tokens: int = 0) -> tuple[float, int, str]:
    """(bytes per trainer rank, micro-batch tokens, why-infeasible). micro_batch_tokens=0 picks the
    largest power of two that fits, capped at the rank's tokens per step; one sequence at least.
    A given micro_batch_tokens below one sequence is charged one sequence: the runtime packs
    whole sequences, at least one a micro-batch (trainer.batch.token_budget_bins). "One
    sequence" is the longest the config admits, max_prompt_len + R (`wl.longest_seq`), not the
    mean: a micro-batch of that one sequence is the peak the budget must hold."""
    cap = cl.mem_headroom * cl.gpu_mem_gb * GB
    one = wl.longest_seq
    state = trainer_state_bytes(args, fsdp, tp, dtype_bytes(wl.master_dtype), cl.compute_bytes,
                                cl.fsdp_units) + reference_bytes(args, wl, fsdp, tp)
    per_tok = trainer_act_bytes_per_token(args, tp, cl.compute_bytes, ac)
    tokens = -(-wl.prompts_per_step // fsdp) * wl.group_size * wl.seq_len
    free = cap - reserved - state
    if not micro_batch_tokens:
        fit = int(free // per_tok) if free > 0 else 0
        micro_batch_tokens = min(_pow2_floor(fit), _pow2_ceil(tokens))
        if fit >= one:
            micro_batch_tokens = max(micro_batch_tokens, one)
        else:
            return state + micro_batch_tokens * per_tok, micro_batch_tokens, (
                f"trainer: states {state / GB:.1f} GB (+{reserved / GB:.1f} GB reserved) leave room "
                f"for {max(free, 0) / per_tok:.0f} activation tokens < one sequence of {one}")
    used = state + max(micro_batch_tokens, one) * per_tok
    if used + reserved > cap:
        return used, micro_batch_tokens, f"trainer: needs {(used + reserved) / GB:.1f} GB > {cap / GB:.1f} GB usable"
    return used, micro_batch_tokens, ""


def plan_memory(args: ModelArgs, cl: Cluster, wl: Workload, p: Placement,
                slots: int = 0, micro_batch_tokens: int = 0) -> Memory:
    """Both meshes' per-rank memory. Colocated ranks hold both: the generator's KV slots are sized
    after reserving the trainer states and one sequence of activations, then the micro-batch takes
    what is left."""
    if p.mode == "colocated":
        ac = p.activation_checkpointing
        send = colocated_send_bytes(args, wl, p.trainer_fsdp * p.trainer_tp)
        state, _, why = trainer_memory(args, cl, wl, p.trainer_fsdp, p.trainer_tp, ac, 0.0,
                                       wl.longest_seq)
        gen, slots, why_g = generator_memory(args, cl, wl, p.gen_tp, p.gen_dp, state + send, slots)
        tr, mbt, why_t = trainer_memory(args, cl, wl, p.trainer_fsdp, p.trainer_tp, ac, gen + send,
                                        micro_batch_tokens)
        # the trainer's states alone first: where they do not fit, the generator's "no room for
        # a KV slot" named the wrong cause (and shorter responses as the fix)
        return Memory(tr, gen, tr + gen + send, slots, mbt, why or why_g or why_t)
    gen, slots, why_g = generator_memory(args, cl, wl, p.gen_tp, p.gen_dp, 0.0, slots)
    tr, mbt, why_t = trainer_memory(args, cl, wl, p.trainer_fsdp, p.trainer_tp,
                                    p.activation_checkpointing, 0.0, micro_batch_tokens)
    return Memory(tr, gen, max(tr, gen), slots, mbt, why_g or why_t)


def _pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1) if x >= 1 else 0


def _pow2_ceil(x: int) -> int:
    return 1 << (int(x) - 1).bit_length() if x > 1 else 1


# ----- communication primitives --------------------------------------------------------------------
def allreduce_s(k: int, nbytes: float, bw: float, lat: float) -> float:
    """Ring all-reduce of `nbytes` over k ranks: 2(k-1)/k * nbytes / bw + 2(k-1) * lat.
    k = 8, 1 MB on 360 GB/s, 10 us: 2*7/8*1e6/360e9 + 14e-5 = 4.9 us + 140 us = 144.9 us."""
    if k <= 1:
        return 0.0
    return 2 * (k - 1) / k * nbytes / bw + 2 * (k - 1) * lat


def allgather_s(k: int, full_bytes: float, bw: float, lat: float) -> float:
    """Ring all-gather (or reduce-scatter) of a `full_bytes` tensor: (k-1)/k * bytes/bw + (k-1)*lat."""
    if k <= 1:
        return 0.0
    return (k - 1) / k * full_bytes / bw + (k - 1) * lat


def link_bw(cl: Cluster, ranks_spanned: int) -> float:
    """Achieved bytes/s of the slowest link a group of `ranks_spanned` consecutive ranks uses."""
    gbps = cl.intra_gbps if ranks_spanned <= cl.gpus_per_node else cl.inter_gbps
    return gbps * GB * cl.link_eff


# ----- time: the three phases --------------------------------------------------------------------------
@dataclass
class Times:
    gen: float = 0.0
    train: float = 0.0
    sync: float = 0.0
    detail: dict = field(default_factory=dict)


def generation_time(args: ModelArgs, cl: Cluster, wl: Workload, gen_tp: int, gen_dp: int,
                    slots: int, prof=None, link_poll: bool = True) -> dict:
    """Seconds for one generator replica to produce its share of a step (replicas run in
    parallel; the replica with the most prompts sets the pace). Worked example, Llama-3-8B on one
    H100 (tp 1), 16 slots, P = 512, R = 2048, bf16: bytes/step = 7.50e9*2 + 16*1536*131072
    = 18.2 GB -> 18.2e9/(3350e9*0.7) = 7.77 ms; flops/step = 2*7.50e9*16 = 2.4e11 -> 0.49 ms;
    decode = 2048 * 7.77 ms = 15.92 s; prefill = one prompt: (2*7.5e9*512 + 2*32*4096*512^2)/
    (989e12*0.5) = 15.7 ms -> T_gen = 15.94 s.
    `slots` is the engine's KV slot count per replica. Its decode step runs every slot, live or
    not (static shapes, rollout/engine.py), so a replica given more slots than it has sequences
    pays for the empty ones; the planner gives it at most its sequences (generator_memory).
    `link_poll`: the split generator loop polls the trainer's link before every decode step and
    broadcasts what it got to its TP followers, one more collective per step; the colocated loop
    generates without a link (trainer/colocated.py)."""
    prompts = -(-wl.prompts_per_step // gen_dp)
    seqs = prompts * wl.group_size
    slots = max(1, slots)
    waves = -(-seqs // slots)
    prompts_per_wave = -(-prompts // waves)
    gb = dtype_bytes(wl.gen_dtype)
    tp_bw = link_bw(cl, gen_tp)
    # a decode step's TP all-reduce over the cluster's links (the datasheet's, or a profile's)
    ar = allreduce_s(gen_tp, slots * args.hidden_size * gb, tp_bw, cl.link_latency_s)
    if prof is not None and prof.matches(args):
        # per decode step: 2 all-reduces per layer, embedding + head, and in split mode the TP
        # followers' broadcast of the link poll (rollout/worker.py); the cluster's links where
        # the profile has none (one GPU)
        if gen_tp == 1:
            step_comm = 0.0
        elif prof.has_links:
            step_comm = ((2 * args.num_layers + 2 + int(link_poll))
                         * (prof.decode_collective_s + prof.ring_steps_s(gen_tp)))
        else:
            step_comm = 2 * args.num_layers * ar
        step = prof.decode_step_s(slots, gen_tp) + step_comm
        # the replica's share of the batch's hand-off (scoring, shipping), spread over its waves
        prefill = prof.gen_fixed_s(prompts_per_wave, gen_tp) \
            + prof.handoff_s(prompts, wl.prompts_per_step) / waves
        comm = waves * wl.response_len * step_comm
    else:
        n_mm, ctx = matmul_params(args), wl.prompt_len + wl.response_len / 2
        q = args.num_heads * args.head_dim
        kvb = kv_bytes_per_token(args, kv_elem_bytes(cl, wl.gen_dtype), gen_tp)
        step_bytes = n_mm * gb / gen_tp + slots * ctx * kvb
        step_flops = (2 * n_mm + 4 * args.num_layers * q * ctx) * slots / gen_tp
        step = (max(step_bytes / (cl.hbm_gbps * GB * cl.hbm_eff), step_flops / (cl.flops * cl.mfu_decode))
                + 2 * args.num_layers * ar)
        comm = 0.0  # on GPUs no core sharing: nothing to separate
        pf_tokens = prompts_per_wave * wl.prompt_len
        pf_flops = (2 * n_mm * wl.prompt_len + 2 * args.num_layers * q * wl.prompt_len ** 2) * prompts_per_wave
        prefill = (pf_flops / gen_tp / (cl.flops * cl.mfu_prefill)
                   + 2 * args.num_layers * allreduce_s(gen_tp, pf_tokens * args.hidden_size * gb,
                                                       tp_bw, cl.link_latency_s))
    total = waves * (prefill + wl.response_len * step)
    return {"total": total, "decode_step": step, "prefill": prefill, "waves": waves, "slots": slots,
            "comm": comm}


def norm_reductions(fsdp: int, tp: int) -> int:
    """All-reduces of the global gradient norm (trainer.optim.global_grad_norm): one per mesh
    dimension of more than one rank."""
    return (fsdp > 1) + (tp > 1)


# a trainer step's collectives besides the model's: the batch broadcast over the trainer mesh (its
# size, then its bytes), and over the data-parallel (fsdp) ranks the token counts and the
# statistics (one all-gather each: trainer.metrics.gather_rows)
BROADCAST, DP_REDUCTIONS = 2, 2


def trainer_collectives(args: ModelArgs, micro: int, fsdp: int, tp: int, ac: bool,
                        units: str = "layer", forwards: int = 0, updates: int = 1,
                        regathers: int | None = None) -> dict:
    """Collectives of one trainer step. FSDP2 "layer" units: per micro-batch and unit (L layers +
    root) an all-gather in forward and in backward and a reduce-scatter; one "model" unit: one
    all-gather and one reduce-scatter per step. TP: per micro-batch 2 all-reduces
    per layer in forward and 2 in backward (+2 recomputed with AC), and embedding + head (4).
    Per step once the params are DTensors: the gradient norm (one reduction per mesh dim), the
    batch broadcast, and with fsdp > 1 the token counts and statistics; they are charged to FSDP
    when fsdp > 1. Each extra forward a micro-batch (`forwards`: a frozen KL reference's, pi_prox's)
    adds its TP all-reduces (2L + 2) and its all-gathers: L + 1 units; the one "model" unit only
    for the `regathers` of them (default all) that reshard after their forward (the KL
    reference: trainer.step.reference_logp; pi_prox's forwards keep the policy's gathered
    parameters for the first update); with `updates` > 1
    the "model" unit gathers and reduce-scatters once per update, and the norm is taken per update.
    Tiny Llama (L = 2), fsdp 2, tp 1, 4 micro-batches: fsdp = 3*3*4 + 1 + 2 + 2 = 41, tp = 0;
    with a KL reference 41 + 3*4 = 53."""
    L, U = args.num_layers, updates
    norms = norm_reductions(fsdp, tp) * U
    per_step = norms + BROADCAST + DP_REDUCTIONS * (fsdp > 1) if fsdp * tp > 1 else 0
    units_n = 1 if units == "model" else L + 1
    gathering = (forwards if regathers is None else regathers) if units == "model" else forwards
    f = ((2 * U if units == "model" else 3 * units_n * micro) + gathering * units_n * micro
         if fsdp > 1 else 0)
    t = (4 * L + 4 + 2 * L * ac + forwards * (2 * L + 2)) * micro if tp > 1 else 0
    return {"fsdp": f + (per_step if fsdp > 1 else 0), "tp": t + (per_step if fsdp == 1 else 0)}


def _measured_train_comm(prof, n_coll: dict, fsdp: int, tp: int, fsdp_bytes: float) -> tuple:
    """(FSDP, TP) seconds per step from the profile: measured per collective (incl. DTensor
    overhead) and per step (grad norm + AdamW) on 2 ranks, plus one wire latency per extra ring
    step on k ranks (`ring_steps_s`); the grad-norm reductions are in the per-step part."""
    per_step = norm_reductions(fsdp, tp)
    fsdp_comm = tp_comm = 0.0
    if fsdp > 1:
        fsdp_comm = ((n_coll["fsdp"] - per_step) * prof.collective_s + prof.fsdp_step_s
                     + n_coll["fsdp"] * prof.ring_steps_s(fsdp))
        if prof.allgather:
            fsdp_comm += prof.gather_bytes_s(fsdp, fsdp_bytes)
    if tp > 1:
        n_tp = n_coll["tp"] - (per_step if fsdp == 1 else 0)
        tp_comm = n_tp * prof.tp_collective_s + prof.tp_step_s + n_coll["tp"] * prof.ring_steps_s(tp)
    return fsdp_comm, tp_comm


def train_time(args: ModelArgs, cl: Cluster, wl: Workload, fsdp: int, tp: int, ac: bool,
               micro_batch_tokens: int, prof=None) -> dict:
    """Seconds for one optimizer step on the trainer mesh. Worked example: Llama-3-8B on 64 H100s
    (8 nodes), fsdp 64, tp 1, no AC, 512 prompts x 16 samples of 512 + 2048 tokens, prompts not
    shared (share_prompts=False): a rank trains 8 prompts = 327680 tokens;
    compute = (6*7.505e9*327680 + 3*2*32*4096*2560^2*128) / (989e12*0.4)
    = (1.476e16 + 6.6e14)/3.956e14 = 39.0 s; FSDP per micro-batch (16384 tokens, 20 of them):
    (2*2 + 4) * 63/64 * 8.03e9 B / 40 GB/s = 1.58 s -> 31.6 s (+ latencies) < 39.0 s, hidden
    under compute (overlap 1); optimizer 8.03e9/64 * 32 B / 2345 GB/s = 1.7 ms. Shared, a rank
    packs 8 x (511 + 16 * 2048) = 266232 tokens: compute 32.0 s, 17 micro-batches. The attention
    term stays that of whole sequences (an upper bound)."""
    groups_per_rank = -(-wl.prompts_per_step // fsdp)
    seqs_per_rank = groups_per_rank * wl.group_size
    tokens = groups_per_rank * wl.group_train_tokens
    mbt, U = max(micro_batch_tokens, wl.seq_len), wl.updates
    per_update = -(-tokens // U)  # each update packs its own share of the groups
    micro = U * -(-per_update // mbt)
    mb_tokens = min(per_update, mbt)
    cb = cl.compute_bytes
    n, L, h = args.num_params(), args.num_layers, args.hidden_size
    bw_f, bw_t, lat = link_bw(cl, fsdp * tp), link_bw(cl, tp), cl.link_latency_s
    # one more forward a micro-batch: a frozen KL reference's, and pi_prox's past one update
    kl, prox = int(wl.kl_reference), int(wl.prox_loss and U > 1)
    ref = kl + prox
    n_coll = trainer_collectives(args, micro, fsdp, tp, ac, cl.fsdp_units, ref, U, regathers=kl)
    # bytes through FSDP2 per step: all-gathers (cb) and reduce-scatters (fp32) of n / tp; an
    # extra forward's shards are gathered once per micro-batch (one "model" unit: the KL
    # reference's only; pi_prox's forwards use the policy's first gather)
    fsdp_bytes = n / tp * ((cb + 4) * U if cl.fsdp_units == "model" else micro * (2 * cb + 4))
    fsdp_bytes += (kl if cl.fsdp_units == "model" else ref) * micro * n / tp * cb
    measured = prof is not None and prof.matches(args)
    if measured:
        compute = micro * (prof.train_microbatch_s(mb_tokens, tp, ac)
                           + ref * prof.forward_microbatch_s(mb_tokens, tp)) \
            + U * prof.train_overhead_s(fsdp, tp)  # its optimizer part runs per update
        optimizer = 0.0  # measured inside train_overhead_s
    else:
        q = args.num_heads * args.head_dim
        flops = ((6 + 2 * ac + 2 * ref) * matmul_params(args) * tokens
                 + (3 + ac + ref) * 2 * L * q * wl.seq_len ** 2 * seqs_per_rank) / tp
        compute = flops / (cl.flops * cl.mfu_train)
        optimizer = U * n / (fsdp * tp) * 32 / (cl.hbm_gbps * GB * cl.hbm_eff)  # AdamW + clip: ~32 B/param
    if measured and prof.has_links:
        fsdp_comm, tp_comm = _measured_train_comm(prof, n_coll, fsdp, tp, fsdp_bytes)
    else:  # the cluster's link numbers (a profile of one GPU has none: calibrate.py skips them)
        fsdp_comm = 0.0
        if fsdp > 1:
            fsdp_comm = fsdp_bytes * (fsdp - 1) / fsdp / bw_f + n_coll["fsdp"] * (fsdp - 1) * lat
        tp_comm = n_coll["tp"] * allreduce_s(tp, mb_tokens * h * cb, bw_t, lat)
    exposed = max(0.0, fsdp_comm + tp_comm - cl.overlap * compute)
    return {"total": compute + exposed + optimizer, "compute": compute, "comm": exposed,
            "fsdp_comm": fsdp_comm, "tp_comm": tp_comm, "optimizer": optimizer, "micro_batches": micro}


@dataclass(frozen=True)
class SyncBytes:
    """Weight-sync traffic of one version: the busiest sender and receiver, and the receiver with
    the most peers (each peer is one message stream: one latency)."""
    max_send: float
    max_recv: float
    peers_per_recv: int
    source: str  # "plan" (weights_sync.plan) or "even shards" (closed form)


def sync_bytes_even(args: ModelArgs, p: Placement, gen_bytes: int) -> SyncBytes:
    """Closed form for even shards: every generator replica needs the whole model, so trainer
    ranks send gen_dp * N * bytes / T each, and each generator rank receives N * bytes / gen_tp.
    Llama-3-8B bf16, T = 768, gen 32 x 8: send 32*16.06e9/768 = 0.67 GB, receive 2.0 GB."""
    m = args.num_params() * gen_bytes
    peers = p.trainer_fsdp * max(1, p.trainer_tp // p.gen_tp)
    return SyncBytes(p.gen_dp * m / p.trainer_ranks, m / p.gen_tp, peers, "even shards")


def sync_time(sb: SyncBytes, cl: Cluster, p: Placement, prof=None) -> float:
    """max(bytes out of the busiest sender, bytes into the busiest receiver) over the slowest link
    type any pair uses (inter-node as soon as the world spans nodes), plus one latency per peer.
    Colocated: each rank already holds its trainer shard; it receives its generator shard.
    A profile's measured links price it instead: its shared-memory hand-off for split mode on
    one CPU host, else its p2p messages."""
    if prof is not None and prof.shm and p.mode == "split" and cl.one_cpu_host:
        # split CPU ranks of one host: weights go through host shared memory (parallel.cpu_shm);
        # colocated ranks send theirs point to point (trainer/colocated.py)
        return prof.shm_s(max(sb.max_send, sb.max_recv)) + (sb.peers_per_recv - 1) * prof.shm_latency
    if prof is not None and prof.p2p:
        return prof.p2p_s(max(sb.max_send, sb.max_recv)) + (sb.peers_per_recv - 1) * prof.p2p_latency
    bw = link_bw(cl, p.world)
    return max(sb.max_send, sb.max_recv) / bw + sb.peers_per_recv * cl.link_latency_s


# ----- one candidate ------------------------------------------------------------------------------------
@dataclass
class Estimate:
    placement: Placement
    memory: Memory
    times: Times
    step_sync: float = math.inf
    step_async: float = math.inf
    step: float = math.inf  # at the workload's eta
    feasible: bool = False
    why: str = ""


def slowdown(k: int, cl: Cluster, prof=None) -> float:
    """How much slower each of k simultaneously busy ranks runs than one rank alone: 1 with a
    device per rank (GPUs); on shared CPU cores the profile's measured curve (it includes other
    users' load), else max(1, k/cores). Two cores, no profile: slowdown(3) = 1.5. A CPU
    profile's curve never reaches a GPU cluster's plan (it made an 8B step on H100s 8x slower)."""
    if _measured_sharing(cl, prof, "concurrency"):
        return prof.slowdown(k)  # may exceed 1 even for k = 1: other users' load
    return max(1.0, k / cl.shared_cores) if cl.shared_cores else 1.0


def _measured_sharing(cl: Cluster, prof, curve: str) -> bool:
    """Whether `prof` holds a measured core-sharing `curve` (launch/core_share.py's) that prices
    `cl`: only ranks sharing CPU cores; GPUs have a device each."""
    return bool(cl.shared_cores) and prof is not None and bool(getattr(prof, curve, None))


def gen_slowdown(k: int, gen_tp: int, cl: Cluster, prof=None) -> float:
    """The slowdown of a generation phase on k busy ranks: for TP=2 replicas the profile's pair
    curve where it has one (their decode mostly waits on the peer, and a waiting rank leaves its
    core to the others: ~1.8 against s(4) ~2.4 on 2 cores; launch/core_share.py), else s(k)."""
    if gen_tp == 2 and _measured_sharing(cl, prof, "tp_concurrency"):
        return prof.tp_pair_slowdown(k)
    return slowdown(k, cl, prof)


def step_time(t_gen: float, t_train: float, t_sync: float, eta: int, p: Placement, cl: Cluster,
              prof=None, gen_comm: float = 0.0, train_comm: float = 0.0) -> float:
    """Seconds per step. s(k) = slowdown(k), 1 on GPUs; G/T = generator/trainer ranks; *_comm is
    the part of a phase spent in communication. On a host whose cores the ranks share, a rank
    waiting in a collective uses little CPU, so where the phases take turns (synchronous,
    colocated) only their compute cg = t_gen - gen_comm, ct = t_train - train_comm is slowed:
    Synchronous split (eta = 0): cg*s(G) + gen_comm + ct*s(T) + train_comm + t_sync
    Colocated, all N ranks are in the same phase at once: a collective waits for peers that share
    the cores with the other ranks' compute, so whole phases are slowed: t_gen*s_gen(N) +
    t_train*s(N) + t_sync (2026-11-30, bench/plan_vs_measured.py: with only compute slowed, the
    colocated layouts were underpredicted by 20-48%, most where generator TP all-reduces
    dominate). s_gen = gen_slowdown: generator TP pairs were measured apart, because with s(N)
    the generator-TP layout was overpredicted by 30-39%.
    Where the two meshes run at once (asynchronous split), each side's communication (gloo:
    copies and wake-ups on CPU threads) competes with the other side's compute, and whole phases
    are slowed (the quiet 2026-11-30 runs of bench/plan_vs_measured.py: exempting it there
    underpredicted every FSDP layout by 20-45%). The shorter phase (a) runs alongside the longer
    (b), which then runs alone (processor sharing): cpu = a*s(G+T) + (b-a)*s(ranks of b), and
        step = max(cpu + sync if b trains, a*s(G+T) + sync if a trains)
    With s = 1 both are the formulas of the module docstring. E.g. 2 shared cores, G = 1, T = 2,
    T_gen = 0.1, T_train = 0.2, no sync: a = 0.1, b = 0.2: 0.1*1.5 + 0.1*1.0 = 0.25 s.
    These are the phases' means. Where the profile measured how much a phase's duration varies
    among busy ranks (cv), the step is launch/pipeline.py's mean over phases that vary so: a
    step waits for the latest of the generator replicas and the trainer, and time-sharing's
    spread made the balanced 4-rank layouts slower than their max (BENCHMARKS.md, "Planner")."""
    g, t = (p.world, p.world) if p.mode == "colocated" else (p.generator_ranks, p.trainer_ranks)
    s = lambda k: slowdown(k, cl, prof)  # noqa: E731
    cv = lambda k: phase_cv(k, cl, prof)  # noqa: E731
    cg, ct = t_gen - gen_comm, t_train - train_comm
    if p.mode == "colocated":
        return mean_step_s(t_gen * gen_slowdown(p.world, p.gen_tp, cl, prof),
                           t_train * s(p.world) + t_sync, 0, p.gen_dp,
                           cv(p.world), cv(p.world))
    if eta == 0:
        return mean_step_s(cg * s(g) + gen_comm, ct * s(t) + train_comm + t_sync + 2 * LINK_POLL_S,
                           0, p.gen_dp, cv(g), cv(t))
    shared = min(t_gen, t_train) * s(g + t)
    alone = abs(t_gen - t_train) * s(t if t_train >= t_gen else g)
    gen, train = (shared, shared + alone) if t_train >= t_gen else (shared + alone, shared)
    return mean_step_s(gen, train + t_sync, eta, p.gen_dp, cv(g + t), cv(g + t))


def phase_cv(k: int, cl: Cluster, prof=None) -> float:
    """The spread (cv) of a phase's duration among k busy ranks sharing cores: the profile's
    measurement (launch/core_share.py), else 0 (a device per rank: GPUs)."""
    return prof.phase_cv(k) if _measured_sharing(cl, prof, "concurrency") else 0.0


def estimate(args: ModelArgs, cl: Cluster, wl: Workload, p: Placement, prof=None,
             sync: SyncBytes | None = None, slots: int = 0, micro_batch_tokens: int = 0) -> Estimate:
    """Memory, phase times and step times of one placement. `sync` overrides the closed-form
    weight-sync bytes (pass `sync_bytes_from_plan(...)` for the real plan)."""
    mem = plan_memory(args, cl, wl, p, slots, micro_batch_tokens)
    if mem.why:
        return Estimate(p, mem, Times(), why=mem.why)
    g = generation_time(args, cl, wl, p.gen_tp, p.gen_dp, mem.slots, prof, p.mode == "split")
    tr = train_time(args, cl, wl, p.trainer_fsdp, p.trainer_tp, p.activation_checkpointing,
                    mem.micro_batch_tokens, prof)
    return assemble(args, cl, wl, p, mem, g, tr, sync, prof)


def assemble(args: ModelArgs, cl: Cluster, wl: Workload, p: Placement, mem: Memory, g: dict,
             tr: dict, sync: SyncBytes | None = None, prof=None) -> Estimate:
    """An Estimate from the phase results: adds the weight sync and the step times."""
    gb = dtype_bytes(wl.gen_dtype)
    if p.mode == "colocated":
        sb = SyncBytes(0.0, args.num_params() * gb / p.gen_tp, p.trainer_fsdp, "colocated")
    else:
        sb = sync or sync_bytes_even(args, p, gb)
    ts = sync_time(sb, cl, p, prof)
    if p.mode == "colocated" and prof is not None and getattr(prof, "coloc_gather", None):
        ts += prof.gather_s(p.world)  # every rank gets every group (trainer/colocated.py)
    e = Estimate(p, mem, Times(g["total"], tr["total"], ts, {"gen": g, "train": tr, "sync_bytes": sb}))
    comm = dict(gen_comm=g.get("comm", 0.0), train_comm=tr.get("comm", 0.0))
    e.step_sync = step_time(g["total"], tr["total"], ts, 0, p, cl, prof, **comm)
    e.step_async = step_time(g["total"], tr["total"], ts, max(wl.eta, 1), p, cl, prof, **comm)
    e.step = e.step_sync if wl.eta == 0 else e.step_async
    e.feasible = True
    return e


def with_profile(cl: Cluster, prof) -> Cluster:
    """A cluster whose link numbers come from a profile (measured between two local ranks); the
    cluster as it is where the profile measured no links (calibrate.py on one GPU)."""
    if prof is None or not prof.p2p:
        return cl
    return replace(cl, intra_gbps=prof.p2p_gbps, link_latency_s=prof.p2p_latency,
                   inter_gbps=min(cl.inter_gbps, prof.p2p_gbps) if cl.nodes > 1 else prof.p2p_gbps)


# ----- measured numbers (launch/calibrate.py writes them) ---------------------------------------------
SIGNATURE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
             "head_dim", "vocab_size")


def model_signature(args: ModelArgs) -> dict:
    return {k: getattr(args, k) for k in SIGNATURE}


def fit(points, degree: int = 1) -> tuple[float, ...]:
    """Least-squares polynomial through [[x, y], ...], lowest order first, falling back to a lower
    degree when the curve falls anywhere over the measured range (noise on a loaded machine: a
    negative top coefficient, or a quadratic whose slope is negative at the smallest x), so that
    a fit never predicts less time for more work. fit([[1, 3], [2, 5], [3, 7]]) == (1.0, 2.0)."""
    if not points:
        raise ValueError("fit: no measured points")
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    degree = min(degree, len(set(xs)) - 1)
    if degree <= 0:
        return (sum(ys) / len(ys),)
    n = degree + 1  # normal equations, solved by Gaussian elimination (n <= 3)
    a = [[sum(x ** (r + c) for x in xs) for c in range(n)] + [sum(y * x ** r for x, y in zip(xs, ys))]
         for r in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col and a[col][col]:
                f = a[r][col] / a[col][col]
                a[r] = [u - f * v for u, v in zip(a[r], a[col])]
    coef = tuple(a[r][n] / a[r][r] for r in range(n))
    # the slope b + 2cx is lowest at the smallest x where c >= 0
    if coef[-1] < 0 or (degree == 2 and coef[1] + 2 * coef[2] * min(xs) < 0):
        return fit(points, degree - 1)
    return tuple(max(c, 0.0) if i == 0 else c for i, c in enumerate(coef))


def _slowdown_at(pts, k: int) -> float:
    """A measured [[k, slowdown]] curve at k: interpolated, at least 1, growing as k beyond the
    last point (k ranks time-share the cores)."""
    if k <= pts[0][0]:
        return max(1.0, pts[0][1]) if k >= 1 else 1.0
    if k > pts[-1][0]:
        return max(1.0, pts[-1][1] * k / pts[-1][0])
    return max(1.0, _interpolate(pts, k))


def _interpolate(pts, x: float) -> float:
    """Linear interpolation in sorted [[x, y]] points, x within their range."""
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def _message_s(points, nbytes: float, gbps: float) -> float:
    """One message of nbytes over a link measured at [[bytes, s]]: interpolated in the measured
    sizes; below the smallest, its time; beyond the largest, that time plus the rest at gbps."""
    pts = sorted(points)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1] + (nbytes - pts[-1][0]) / (gbps * GB)
    return _interpolate(pts, nbytes)


def small_size_intercept(points) -> float:
    """The time at 0 bytes of the line through the two smallest sizes of [[bytes, s]] (>= 0): a
    link's latency. A fit through all sizes leans on the large ones, whose time varies 2-3x from
    one calibration to the next on gloo. small_size_intercept([[4, 3], [8, 5], [99, 0]]) == 1;
    0 where nothing was measured."""
    if not points:
        return 0.0
    pts = sorted(points)
    (b0, t0), (b1, t1) = pts[0], pts[min(1, len(pts) - 1)]
    slope = (t1 - t0) / (b1 - b0) if b1 > b0 else 0.0
    return max(0.0, t0 - b0 * max(slope, 0.0))


def poly(coef, x: float) -> float:
    return sum(c * x ** i for i, c in enumerate(coef))


@dataclass
class Profile:
    """Measured costs of one model on one machine (launch/calibrate.py). Per-layer times are fitted
    as a + b*T + c*T^2 in the micro-batch tokens T (the c term is the attention score matrix);
    collectives between two ranks as a + b*bytes and extended to k ranks as rings."""
    device: str
    dtype: str
    threads: int
    model: dict                   # model_signature of the profiled model
    layer_fwd: list               # [[tokens, s]] one decoder layer, packed sequences
    layer_bwd: list
    head_fwd: list                # embedding + final norm + lm_head + log-softmax
    head_bwd: list
    decode_step: list             # [[batch, s]] one engine decode step, whole model
    gen_fixed: list               # [[prompts, s]] prefill + admission of that many prompt groups
    train_overhead: float         # s per trainer step beyond fwd/bwd (optimizer, packing, stats)
    p2p: list                     # [[bytes, s]] send/recv between two ranks
    allreduce: list               # [[bytes, s]] two ranks
    allgather: list               # [[full bytes, s]] two ranks
    collective_s: float = 0.0     # one trainer collective over 2 FSDP ranks, DTensor/hook cost included
    tp_collective_s: float = 0.0  # one TP collective over 2 ranks, likewise
    tp_decode_collective_s: float = 0.0  # one generator TP collective in a decode step, likewise
    gen_handoff_s: float = 0.0    # profiles before `handoff`: the step's batch, shared pro rata
    handoff: list = field(default_factory=list)  # [[prompts, s]] rewards scored + groups shipped in one message
    fsdp_step_s: float = 0.0      # per step: grad-norm clip + AdamW on FSDP DTensors beyond plain
    tp_step_s: float = 0.0        # likewise on TP DTensors
    concurrency: list = field(default_factory=list)  # [[k, slowdown, phase cv]] of k busy ranks
    tp_concurrency: list = field(default_factory=list)  # [[k, slowdown]] of k/2 generator TP=2 pairs
    coloc_gather: list = field(default_factory=list)  # [[k, s]] colocated exchange of a step's groups
    shm: list = field(default_factory=list)  # [[bytes, s]] a hand-off through host shared memory (CPU)
    notes: dict = field(default_factory=dict)

    # ----- I/O
    # the point lists every use of a matching profile fits (the link ones may be empty: one GPU)
    COMPUTE_POINTS = ("layer_fwd", "layer_bwd", "head_fwd", "head_bwd", "decode_step", "gen_fixed")
    LINK_POINTS = ("p2p", "allreduce", "allgather", "handoff", "coloc_gather", "shm")

    @classmethod
    def load(cls, path: str) -> "Profile":
        """The profile at `path`; a ValueError naming the file and the key where it cannot be
        read or lacks what the cost model fits (launch/calibrate.py writes complete ones)."""
        import dataclasses
        import json
        try:
            with open(path) as fh:
                d = json.load(fh)
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"cannot read profile {path}: {e}") from e
        fix = "write one with python launch/calibrate.py --model ... --out FILE"
        if not isinstance(d, dict):
            raise ValueError(f"profile {path} is not a JSON object; {fix}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"profile {path} lacks the key(s) {missing}; {fix}")
        for key in cls.COMPUTE_POINTS + cls.LINK_POINTS:
            pts = d.get(key, [])
            if not isinstance(pts, list) or not all(
                    isinstance(p, list) and len(p) >= 2
                    and all(isinstance(x, (int, float)) for x in p) for p in pts):
                raise ValueError(f"profile {path}: {key} must be a list of [x, seconds] points, "
                                 f"got {str(pts)[:80]}; {fix}")
            if key in cls.COMPUTE_POINTS and not pts:
                raise ValueError(f"profile {path}: {key} has no measured points; {fix}")
        if not isinstance(d["model"], dict):
            raise ValueError(f"profile {path}: model must be the profiled model's shape, got "
                             f"{d['model']!r}; {fix}")
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def save(self, path: str) -> None:
        import dataclasses
        import json
        with open(path, "w") as fh:
            json.dump(dataclasses.asdict(self), fh, indent=1)

    def matches(self, args: ModelArgs) -> bool:
        return self.model == model_signature(args)

    @property
    def has_links(self) -> bool:
        """Whether link or collective costs were measured (calibrate.py skips them on one GPU,
        where the profile then holds none of them)."""
        return bool(self.allreduce) or max(self.collective_s, self.tp_collective_s,
                                           self.tp_decode_collective_s) > 0

    # ----- fitted costs
    def _c(self, key: str, degree: int):
        cache = self.__dict__.setdefault("_fits", {})
        if key not in cache:
            cache[key] = fit(getattr(self, key), degree)
        return cache[key]

    def _split(self, key: str, degree: int, x: float, tp: int) -> float:
        """Fixed part once, the work-proportional part divided over tp ranks."""
        c = self._c(key, degree)
        return c[0] + (poly(c, x) - c[0]) / tp

    def train_microbatch_s(self, tokens: int, tp: int = 1, ac: bool = False) -> float:
        L = self.model["num_layers"]
        f, b = self._split("layer_fwd", 2, tokens, tp), self._split("layer_bwd", 2, tokens, tp)
        return L * (f + b + (f if ac else 0.0)) + poly(self._c("head_fwd", 1), tokens) \
            + poly(self._c("head_bwd", 1), tokens)

    def forward_microbatch_s(self, tokens: int, tp: int = 1) -> float:
        """A forward alone (the frozen KL reference's, under no_grad: no backward)."""
        L = self.model["num_layers"]
        return L * self._split("layer_fwd", 2, tokens, tp) + poly(self._c("head_fwd", 1), tokens)

    def train_overhead_s(self, fsdp: int, tp: int) -> float:
        return self.train_overhead / fsdp  # per-trajectory work and optimizer shards split over fsdp

    def decode_step_s(self, batch: int, tp: int = 1) -> float:
        return self._split("decode_step", 1, batch, tp)

    def handoff_s(self, prompts: int, per_step: int = 0) -> float:
        """A replica's hand-off of `prompts` groups in one message: the fit through `handoff`
        (a fixed part plus one per group), or, for a profile that has only `gen_handoff_s`,
        that batch's time shared pro rata over `per_step` groups."""
        if self.handoff:
            return poly(fit(self.handoff, 1), prompts)
        return self.gen_handoff_s * prompts / per_step if per_step else 0.0

    def gen_fixed_s(self, prompts: int, tp: int = 1) -> float:
        return self._split("gen_fixed", 1, prompts, tp)

    def allreduce_s(self, k: int, nbytes: float) -> float:
        """Ring over k ranks from the 2-rank fit t2 = a + b*B: (k-1) * (a + 2*B/k * b)."""
        if k <= 1:
            return 0.0
        a, b = (self._c("allreduce", 1) + (0.0,))[:2]
        return (k - 1) * (a + 2 * nbytes / k * b)

    def allgather_s(self, k: int, full_bytes: float) -> float:
        if k <= 1:
            return 0.0
        a, b = (self._c("allgather", 1) + (0.0,))[:2]
        return (k - 1) * (a + 2 * full_bytes / k * b)

    def ring_steps_s(self, k: int) -> float:
        """What a collective measured on 2 ranks costs more on k: one wire latency (the 2-rank
        all-reduce fit's intercept) per extra ring step. Not (k - 1) times the 2-rank cost: that
        is mostly per-call CPU work (DTensor, FSDP2 bookkeeping, waiting for the peer), the same
        on any k; scaled by k - 1 it overpredicted the 3- and 4-rank FSDP trainers by 5-40%
        (BENCHMARKS.md, "Planner")."""
        return max(0, k - 2) * self.wire_latency_s  # 0 where no all-reduce was measured

    @property
    def wire_latency_s(self) -> float:
        """The 2-rank all-reduce's intercept, from its two smallest sizes (latency-bound): the fit
        through all sizes leans on the large ones, whose time varies 2x from one calibration to
        the next on gloo (4 MB: 1.9-4.6 ms), and put it anywhere in 0.1-0.54 ms (2026-11-30)."""
        return small_size_intercept(self.allreduce)

    def gather_bytes_s(self, k: int, full_bytes: float) -> float:
        """The bandwidth part of a ring all-gather (no latency): (k-1) * 2*B/k * b."""
        c = self._c("allgather", 1)
        return (k - 1) * 2 * full_bytes / k * c[1] if k > 1 and len(c) > 1 else 0.0

    def slowdown(self, k: int) -> float:
        """Measured slowdown of k busy ranks, interpolated; beyond the last point it grows as k."""
        return _slowdown_at(sorted(row[:2] for row in self.concurrency), k)

    def gather_s(self, k: int) -> float:
        """The colocated exchange of a step's groups among k ranks: interpolated in the measured
        points; beyond them, or from a single point, in proportion to the k - 1 peers."""
        pts = sorted(self.coloc_gather)
        if k <= 1 or not pts:
            return 0.0
        if len(pts) > 1 and pts[0][0] <= k <= pts[-1][0]:
            return _interpolate(pts, k)
        k0, t0 = pts[-1] if k > pts[-1][0] else pts[0]
        return t0 * (k - 1) / (k0 - 1)

    def tp_pair_slowdown(self, k: int) -> float:
        """Measured slowdown of k ranks in generator TP=2 pairs decoding at once, likewise."""
        return _slowdown_at(sorted(self.tp_concurrency), k)

    def phase_cv(self, k: int) -> float:
        """Measured spread (cv) of a phase's duration among k busy ranks, interpolated and held
        beyond the ends; 0 for profiles written before it was measured."""
        pts = sorted((row[0], row[2]) for row in self.concurrency if len(row) > 2)
        if not pts:
            return 0.0
        return _interpolate(pts, min(max(k, pts[0][0]), pts[-1][0]))

    @property
    def decode_collective_s(self) -> float:
        """A generator TP collective; profiles written before the decode probe have only the
        training one."""
        return self.tp_decode_collective_s or self.tp_collective_s

    @property
    def p2p_latency(self) -> float:
        """One message's fixed cost, from the two smallest sizes, as wire_latency_s: the fit's
        intercept leans on the 4-16 MB sizes and came out anywhere in 0-0.51 ms over 26
        calibrations of 2026-11-30, where the two smallest sizes give 0.05-0.10 ms; at 0.51 ms it
        charged a 3-peer weight sync of a 300 KB model 1.6 ms instead of ~0.4 (BENCHMARKS.md,
        "Planner", session 10)."""
        return small_size_intercept(self.p2p)

    @property
    def p2p_gbps(self) -> float:
        """Bandwidth: the fit's slope, which the large sizes set."""
        return self._gbps("p2p")

    def _gbps(self, key: str) -> float:
        c = self._c(key, 1)
        return 1.0 / c[1] / GB if len(c) > 1 and c[1] > 0 else 1e3

    def p2p_s(self, nbytes: float) -> float:
        """One message of nbytes: interpolated in the measured sizes; below the smallest, its
        time; beyond the largest, that time plus the rest at p2p_gbps."""
        return _message_s(self.p2p, nbytes, self.p2p_gbps)

    @property
    def shm_latency(self) -> float:
        """One shared-memory hand-off's fixed cost (store round trips), as p2p_latency."""
        return small_size_intercept(self.shm)

    def shm_s(self, nbytes: float) -> float:
        """One weight hand-off of nbytes through host shared memory (weights_sync/ipc.py over
        `CpuShmMemory`: a copy in, a store ring, a copy out), from the `shm` points as p2p_s."""
        return _message_s(self.shm, nbytes, self._gbps("shm"))


# ----- layouts and the real weight-sync plan ------------------------------------------------------------
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")
ROWWISE = ("o_proj", "down_proj")


def param_specs(args: ModelArgs, dtype: str = "bfloat16", layers=None) -> list:
    """`named_parameters()` of model.Transformer(args), from the shapes alone (no torch), in the
    same order; `layers` restricts the decoder layers listed (e.g. [0])."""
    from parallel.layout import ParamSpec
    h, d, V = args.hidden_size, args.head_dim, args.vocab_size
    q, kv, i = args.num_heads * d, args.num_kv_heads * d, args.intermediate_size
    specs = [ParamSpec("model.embed_tokens.weight", (V, h), dtype)]
    for li in range(args.num_layers) if layers is None else layers:
        p = f"model.layers.{li}."
        attn = [("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h))]
        for name, shape in attn:
            specs.append(ParamSpec(f"{p}self_attn.{name}.weight", shape, dtype))
            if args.attention_bias:
                specs.append(ParamSpec(f"{p}self_attn.{name}.bias", shape[:1], dtype))
        specs.append(ParamSpec(f"{p}self_attn.o_proj.weight", (h, q), dtype))
        if args.o_proj_bias:  # Llama/Qwen3 attention_bias (model/args.py)
            specs.append(ParamSpec(f"{p}self_attn.o_proj.bias", (h,), dtype))
        if args.qk_norm:
            specs += [ParamSpec(f"{p}self_attn.q_norm.weight", (d,), dtype),
                      ParamSpec(f"{p}self_attn.k_norm.weight", (d,), dtype)]
        specs += [ParamSpec(f"{p}mlp.gate_proj.weight", (i, h), dtype),
                  ParamSpec(f"{p}mlp.up_proj.weight", (i, h), dtype),
                  ParamSpec(f"{p}mlp.down_proj.weight", (h, i), dtype),
                  ParamSpec(f"{p}input_layernorm.weight", (h,), dtype),
                  ParamSpec(f"{p}post_attention_layernorm.weight", (h,), dtype)]
    specs.append(ParamSpec("model.norm.weight", (h,), dtype))
    if not args.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (V, h), dtype))
    return specs


def _tp_dim(name: str):
    """Tensor dim that TP shards (parallel/sharding.py's plan), or None when replicated."""
    if any(k in name for k in ROWWISE):
        return 1 if name.endswith("weight") else None
    return 0 if any(k in name for k in COLWISE) else None


def trainer_layout(specs, fsdp: int, tp: int, first_rank: int = 0):
    """Trainer mesh (fsdp, tp) on ranks first_rank.. : TP (colwise Shard(0), rowwise Shard(1),
    norms replicated), then FSDP2 Shard(0); FSDP over a TP-sharded dim 0 is `_StridedShard`."""
    from parallel.layout import Layout
    pl = {}
    for s in specs:
        d = _tp_dim(s.name) if tp > 1 else None
        f = (("shard", 0),) if fsdp > 1 else (("replicate",),)
        if d == 0 and fsdp > 1:
            f = (("strided_shard", 0, tp),)
        pl[s.name] = [*f, ("shard", d) if d is not None else ("replicate",)]
    return Layout.from_placements(specs, range(first_rank, first_rank + fsdp * tp), (fsdp, tp),
                                  ("fsdp", "tp"), pl)


def generator_layout(specs, dp: int, tp: int, first_rank: int):
    """Generator mesh (dp, tp): TP only, one replica per dp row."""
    from parallel.layout import Layout
    pl = {s.name: [("replicate",), ("shard", d) if (d := _tp_dim(s.name)) is not None and tp > 1
                   else ("replicate",)] for s in specs}
    return Layout.from_placements(specs, range(first_rank, first_rank + dp * tp), (dp, tp),
                                  ("dp", "tp"), pl, replica_axis="dp")


def sync_bytes_from_plan(args: ModelArgs, p: Placement, gen_dtype: str, reduced: bool = True) -> SyncBytes:
    """Per-rank weight-sync bytes from the real `weights_sync.plan` between the two layouts.
    reduced=True plans the non-layer params and ONE decoder layer and scales that layer by L:
    exact for the pieces that have a single holder (every sharded matrix); the replicated norms
    it may balance differently are < 0.1% of a Llama-8B's bytes; ~30x faster for the search."""
    from weights_sync.plan import plan
    if p.mode != "split":
        raise ValueError("the weight-sync plan is for split placements")
    layer_sets = [(None, 1)] if not reduced else [([], 1), ([0], args.num_layers)]
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    peers = 0
    for layers, mult in layer_sets:
        specs = param_specs(args, gen_dtype, layers)
        if layers == []:  # non-layer params only
            specs = [s for s in specs if ".layers." not in s.name]
        elif layers is not None:
            specs = [s for s in specs if ".layers." in s.name]
        src = trainer_layout(specs, p.trainer_fsdp, p.trainer_tp, 0)
        dst = generator_layout(specs, p.gen_dp, p.gen_tp, p.trainer_ranks)
        pl = plan(src, dst, specs)
        for r, v in pl.send_volume_by_rank().items():
            send[r] = send.get(r, 0) + mult * v
        size = {s.name: s.itemsize for s in specs}
        for r in dst.ranks[:p.gen_tp]:  # replicas are identical: the first one's ranks suffice
            recv[r] = recv.get(r, 0) + mult * sum(b.numel * size[n] for n, b in dst.boxes[r].items())
        peers = max(peers, len(pl.recvs_to(dst.ranks[0])))
    return SyncBytes(max(send.values()), max(recv.values()), peers, "plan" + (" (1 layer x L)" if reduced else ""))
