"""tandem's configuration: one tree of dataclasses, TOML presets, `--section.key=value` overrides.

    cfg = load_config("configs/tiny_cpu.toml", ["--trainer.lr=1e-5"])   # parse + validate
    cfg = cfg.resolve(world_size)   # derived values (layout, buffer size, run dir), in ONE place
    cfg.save(f"{cfg.run.dir}/config.toml")

Every field is declared with `_f(default, help, **bounds)`: the help text lives in the field's
metadata (`dataclasses.fields(Section)[i].metadata["help"]`, also `field_docs()`), and the bounds
(`gt`, `ge`, `lt`, `le`) are checked by `Config.validate()`. A 0 or "" default documented as
"derived" is filled in by `Config.resolve()`.

TOML has no null. The writer writes None as `key = ""`, and the reader turns "" back into None for
Optional fields (so for an Optional[str] field "" and None are the same thing). On the command
line "none", "null" and "" all mean None for Optional fields.
"""
import argparse
import copy
import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Literal, Union


class ConfigError(ValueError):
    """A user error in a config file, an override or a value. The message names the fix."""


def _f(default, help: str, **bounds):
    """A field with its help text and optional numeric bounds (gt/ge/lt/le) in its metadata."""
    assert set(bounds) <= {"gt", "ge", "lt", "le"}, bounds
    mutable = isinstance(default, (list, dict))
    kw = {"default_factory": lambda: copy.copy(default)} if mutable else {"default": default}
    return field(metadata={"help": help, **bounds}, **kw)


Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    """Which weights to load and how to run them."""
    path: str = _f("", "Hugging Face model folder (config.json + safetensors); required: a run refuses the default '' at start-up. A dry run also takes 'preset:<name>', a model shape of launch/plan.py's PRESETS (e.g. 'preset:llama3-8b').")
    dtype: Dtype = _f("float32", "Dtype of the trainer's parameters (the master copy).")
    gen_dtype: Dtype = _f("float32", "Dtype of the generator's weights copy, e.g. 'bfloat16'.")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = _f("auto", "Dtype the trainer computes in (its parameters stay model.dtype): 'auto' = bfloat16 on CUDA, model.dtype on CPU; 'bfloat16' on CPU pays off with AMX (a tiny Llama's train step 1.5x faster, BENCHMARKS.md). With FSDP it is FSDP's param dtype, on one rank an autocast.")
    attn_backend: Literal["auto", "sdpa", "flash"] = _f("auto", "The trainer's attention over packed sequences: 'auto' = flash-attn (varlen) on CUDA in fp16/bf16 where importable, else SDPA per sequence; 'flash' fails at start-up where flash-attn or CUDA is missing, or where the trainer computes in fp32 (model.compute_dtype). The generator's KV-cache attention does not use it.")
    ref_path: str = _f("", "Reference model folder for the KL penalty (used when algo.kl_coef > 0); '' = the starting policy, model.path.")


@dataclass
class ParallelConfig:
    """How the world is split into the generator mesh and the trainer mesh."""
    mode: Literal["split", "colocated"] = _f("split", "'split': disjoint generator/trainer ranks; 'colocated': every rank does both.")
    generator_ranks: int = _f(1, "Ranks in the generator mesh (split mode). Colocated: resolve() sets it to the world size.", ge=0)
    gen_tp: int = _f(1, "Tensor-parallel degree of each generator replica.", ge=1)
    trainer_tp: int = _f(1, "Tensor-parallel degree of the trainer.", ge=1)
    trainer_fsdp: int = _f(0, "FSDP degree of the trainer; 0 = derived: trainer ranks / trainer_tp.", ge=0)
    gen_dp: int = _f(0, "Generator replicas; 0 = derived: generator ranks / gen_tp.", ge=0)
    activation_checkpointing: bool = _f(False, "Recompute trainer activations in the backward pass to save memory.")
    fsdp_units: Literal["auto", "layer", "model"] = _f("auto", "FSDP2 units of the trainer: 'layer' = one per decoder layer, resharded after forward, gradients reduce-scattered per micro-batch (least memory); 'model' = one for the whole model, gathered once per step, gradients accumulated unsharded and reduce-scattered once (full parameters + gradients at peak; fewest collectives); 'auto' = model on CPU (gloo), layer on GPUs.")
    compile: bool = _f(False, "torch.compile the trainer's decoder layers; attention over the packed sequences stays eager (their lengths change every step), the rest compiles once for any token count after the second (a tiny model's forward+backward on CPU: 0.92x eager's time, ~40 s to compile). With trainer_tp > 1 each micro-batch is padded up to a multiple of a quarter of trainer.micro_batch_tokens and the layers compile once for each such count (torch 2.13 fails to recompile tensor-parallel layers for a symbolic one); sequences longer than the budget add counts, and past dynamo's limit (64 graphs a block, ~20 counts) the blocks run eager. The generator's decode step: generator.decode.")
    backend: str = _f("cpu:gloo,cuda:nccl", "torch.distributed backend string for the default process group.")
    ipc_buffers: int = _f(1, "Weight sync between a trainer and a generator on the same GPU (CUDA IPC), or on the same host's CPUs (cpu_shm): staging buffers per pair (split mode; colocated mode reshards over gloo/NCCL point-to-point). 0 = zero copy: the generator applies straight from the trainer's shards (no staging memory on either side, fastest; the trainer's next update waits until the generator has applied the version); 2 = double buffering.", ge=0)
    cpu_shm: bool = _f(True, "Weight sync between CPU ranks on the same host through a shared-memory file (the protocol of ipc_buffers) instead of gloo over TCP loopback (split mode; colocated mode reshards over gloo). false = gloo, e.g. for containers on one host that do not share /dev/shm.")
    timeout_s: float = _f(300.0, "Timeout of every cross-mesh wait after start-up, in seconds (a weight version's transfer to or from all of a rank's peers shares one; ranks waiting for their mesh leader's decisions wait twice as long, so that the leader's error reaches them first); also how long a rank that got SIGTERM waits for the run to stop at a step boundary before it exits (launch/preemption.py).", gt=0)
    warmup_timeout_s: float = _f(900.0, "Timeout for start-up and the first step (model load, compile; the generators wait for that step's weights as long), and for the end (the final evaluation and export), in seconds; those waits take the longer of this and timeout_s.", gt=0)

    def described_world(self) -> int | None:
        """The world size the degrees as given pin (trainer_fsdp set: split = generator_ranks +
        trainer_fsdp * trainer_tp, colocated = trainer_fsdp * trainer_tp), else None."""
        if self.trainer_fsdp <= 0:
            return None
        trainer = self.trainer_fsdp * self.trainer_tp
        return trainer if self.mode == "colocated" else self.generator_ranks + trainer


@dataclass
class GeneratorConfig:
    """Rollout engine and sampling."""
    num_slots: int = _f(16, "Concurrent sequences per generator replica (KV-cache slots). On CUDA "
                        "and in the compiled step (generator.decode='compile') every decode step "
                        "computes all of them, filled or not (one CUDA graph or compilation per "
                        "shape); eager decode on CPU computes only the filled ones. More than the "
                        "replica's sequences per step (prompts_per_step / gen_dp x n_samples) costs "
                        "cache memory, and compute where all are computed.", ge=1)
    max_new_tokens: int = _f(32, "Maximum tokens generated per completion.", ge=1)
    temperature: float = _f(1.0, "Sampling temperature; 0 = greedy. With greedy decoding it picks no token, but the log-probs recorded (mu) and the trainer's are still taken at it (at 1 where it is 0).", ge=0)
    top_p: float = _f(1.0, "Nucleus sampling mass, in (0, 1]; 1 = off.", gt=0, le=1)
    top_k: int = _f(0, "Sample from the k most likely tokens; 0 = off.", ge=0)
    greedy: bool = _f(False, "Argmax decoding (evaluation / debugging; no exploration).")
    n_samples: int = _f(4, "Completions per prompt: the GRPO group size.", ge=1)
    stop_token_ids: list[int] = _f([], "Token ids that end a completion, in addition to the model's and the tokenizer's EOS and the extra EOS ids of generation_config.json (Llama 3 Instruct's <|eot_id|>), on which HF generate stops too.")
    seed: int = _f(0, "Sampling seed (offset by generator replica).")
    kv_policy: Literal["recompute", "keep"] = _f("keep", "On a weights update: 'keep' in-flight KV caches, or 'recompute' them with the new weights.")
    ignore_eos: bool = _f(False, "Generate exactly max_new_tokens (no EOS id stops, generation_config.json's included; stop_token_ids still do); for benchmarks with fixed lengths.")
    pack_weights: Literal["auto", "on", "off"] = _f("auto", "CPU engine with eager decode: run the large fp32 linears (and bf16 ones, where the CPU has oneDNN's bf16 kernels) on oneDNN-prepacked weights; the compiled step (generator.decode='compile') packs its own, and CUDA none, so 'on' fails there at start-up (preflight). 'auto' times a decode forward both ways at start-up and keeps the faster (it depends on the CPU; logged); 'on'/'off' pin it, e.g. for bitwise-repeatable runs (the two differ by fp32 rounding).")
    decode: Literal["auto", "eager", "cudagraph", "compile"] = _f("auto", "Decode step: 'auto' = a replayed CUDA graph on CUDA (23.0k tok/s for the 1.1B shape on an H200, 5.7x eager), eager on CPU; 'compile' = torch.compile of the step (+ a CUDA graph on CUDA): it costs a start-up compilation (20-40 s) and fuses the step's small ops: 36.7k tok/s on the H200 with FlexAttention (BENCHMARKS.md, 'GPU'); on CPU 1.3-1.9x faster than eager for small models (vs_trl's generator: 1.93x in bf16, 1.34x in fp32) and about even (0.98-1.05x) at rollout_vs_hf's fp32 model (BENCHMARKS.md, 'Generation').")
    stack_weights: Literal["auto", "all", "qkv", "off"] = _f("auto", "One matmul over each layer's stacked q|k|v weights, and one over gate|up, instead of one a projection (the compiled step of a 4-layer model on CPU: 0.93x the time for q|k|v, 0.97-0.98x more for gate|up). The stacked copies cost memory beside the model's own, mostly gate|up's (2 x hidden x intermediate a layer: 1.07 GB for the 1.1B shape in bf16, 7.5 GB for Llama-3-8B). 'auto' = on CUDA and in the compiled step on CPU, q|k|v, and gate|up while its copies take at most 2 GiB; 'all' = both, wherever (eager CPU too; not with parallel.gen_tp > 1: tensor-parallel shards are not stacked); 'qkv' = q|k|v only, where 'auto' stacks (CUDA, the compiled step on CPU; the eager CPU step stacks nothing); 'off' = neither. The planner counts the choice.")
    decode_attention: Literal["auto", "sdpa", "matmul", "flex"] = _f("auto", "Attention over the KV cache in decode: 'auto' = 'flex' (FlexAttention, reading each row's cache up to its length) for the compiled step on CUDA, 'sdpa' for the CUDA graph, 'matmul' on CPU. 'flex' needs generator.decode='compile'.")

    def samples_greedily(self) -> bool:
        """Argmax decoding, whose mu is the untruncated distribution's (rollout/sampling.py):
        `greedy` or a temperature of 0, as SamplingParams.is_greedy. (top_k=1 picks the argmax
        too, but through the truncation: mu = 0.)"""
        return self.greedy or self.temperature == 0


@dataclass
class TrainerConfig:
    """Optimizer and step structure."""
    max_steps: int = _f(20, "Optimizer steps to run (= policy versions produced).", ge=0)
    prompts_per_step: int = _f(8, "Prompt groups per optimizer step (each has n_samples completions).", ge=1)
    updates_per_step: int = _f(1, "Optimizer updates per trainer step (AReaL's PPO minibatches): the step's groups in this many parts, one update each; decoupled PPO's trust region (and PPO's pi_old with token_is) is the policy before the first. The policy version advances once per step, the LR schedule once per step that applied an update (a step skipped for a non-finite gradient leaves it).", ge=1)
    micro_batch_tokens: int = _f(4096, "Packed tokens per micro-batch per trainer rank (gradient accumulation unit).", ge=1)
    share_prompts: bool = _f(True, "Run each prompt's forward once for all its samples in a micro-batch (they attend to it), not once per sample; the same loss, fewer tokens.")
    lr: float = _f(1e-5, "Peak AdamW learning rate.", gt=0)
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay, on the weight matrices (embeddings and the head included); norm gains and biases are not decayed, as in HF Trainer/TRL.", ge=0)
    beta1: float = _f(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = _f(0.95, "AdamW beta2.", ge=0, lt=1)
    eps: float = _f(1e-8, "AdamW epsilon.", gt=0)
    warmup_steps: int = _f(0, "Linear learning-rate warm-up steps.", ge=0)
    schedule: Literal["constant", "cosine"] = _f("constant", "Learning-rate schedule after warm-up.")
    min_lr_ratio: float = _f(0.1, "Cosine schedule floor, as a fraction of lr.", ge=0, le=1)
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this; 0 = off.", ge=0)
    seed: int = _f(0, "Seed of the trainer ranks' torch and Python random generators, set at start-up (a resume restores the checkpoint's states instead). tandem's own trainer draws nothing from them (the model comes from model.path, the losses are deterministic): it seeds what a loss or model code of your own draws.")
    max_nonfinite_steps: int = _f(3, "Abort after this many consecutive steps with a non-finite loss/grad (they are skipped); 0 and 1 both abort at the first.", ge=0)


@dataclass
class AlgoConfig:
    """RL objective, advantages and the off-policy buffer."""
    loss: Literal["aipo", "ppo", "decoupled_ppo"] = _f("aipo", "Policy loss: AIPO truncated IS, PPO-clip, or decoupled PPO.")
    rho: float = _f(4.0, "AIPO truncation of the IS ratio pi/mu: min(pi/mu, rho).", ge=1)
    clip_eps: float = _f(0.2, "PPO clip range epsilon: around the generator's mu for algo.loss='ppo' with algo.token_is='none'; around the policy before the step's first update (pi_prox) for decoupled PPO and for PPO with algo.token_is, where it acts from a step's second update on, so it is inert with trainer.updates_per_step=1 (trainer/step._loss).", gt=0)
    dual_clip_c: float = _f(0.0, "Dual clip of PPO and decoupled PPO (Ye et al. 2020; verl's clip_ratio_c, 3 there): a token with advantage A < 0 has a surrogate of at least c*A, so a ratio above c gives it no gradient instead of one growing with the ratio. 0 = off, the references' PPO and decoupled PPO (AReaL); otherwise more than 1 + clip_eps. Not with algo.loss='aipo', whose weight is capped at rho.", ge=0)
    prox_cap: float = _f(5.0, "Decoupled PPO: tokens whose behaviour-to-proximal IS weight pi_prox/mu exceeds this are dropped from the loss, not truncated to it; they still count in its normalisation (trainer/losses.decoupled_ppo_loss).", ge=1)
    advantage: Literal["group_mean", "grpo", "rloo"] = _f("group_mean", "Baseline: group mean, GRPO (mean/std), or leave-one-out.")
    max_staleness: int = _f(1, "eta: max policy versions a sample may lag; 0 = synchronous on-policy. Split mode only: parallel.mode=colocated is on-policy whatever this says (each step generates with the weights it trains).", ge=0)
    buffer_capacity: int = _f(0, "Off-policy buffer size in samples; 0 = derived: prompts_per_step * n_samples * (max_staleness + 1), also the least split mode accepts (what the generators may deliver before the trainer takes a batch; colocated: one step).", ge=0)
    kl_coef: float = _f(0.0, "Weight of the KL penalty to the reference model; 0 = off.", ge=0)
    entropy_coef: float = _f(0.0, "Weight of an entropy bonus (loss -= coef * token entropy); keeps a policy exploring. 0 = off.", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator (Schulman's k1, k2 or k3) as a loss term: k1 and k2 give the gradient of KL(pi||ref), k3 (GRPO's) that of KL(ref||pi); see trainer/losses.kl_penalty.")
    token_is: Literal["none", "truncate", "mask"] = _f("none", "Extra per-token IS correction for engine/trainer mismatch (algo.loss='ppo' only; AIPO and decoupled PPO weight by pi/mu themselves). PPO with top-k or top-p < 1 - clip_eps sampling needs one (refused without: its clip around the truncated mu clips every negative advantage).")
    token_is_cap: float = _f(5.0, "Cap of the per-token IS ratio for token_is.", gt=0)


@dataclass
class DataConfig:
    """Prompt dataset."""
    source: str = _f("synthetic:addition", "'synthetic:<task>', a .jsonl/.parquet path, or 'reasoning_gym:<task>'.")
    prompt_field: str = _f("prompt", "Column holding the prompt text.")
    messages_field: str = _f("messages", "Column holding chat messages (used with chat_template).")
    answer_field: str = _f("answer", "Column holding the reference answer given to the reward.")
    chat_template: bool = _f(False, "Render prompts with the tokenizer's chat template.")
    max_prompt_len: int = _f(256, "Prompts longer than this many tokens are dropped.", ge=1)
    num_prompts: int = _f(0, "Use the first N prompts; 0 = all of a file, 10000 items of a synthetic task, 1000 of a reasoning_gym task.", ge=0)
    seed: int = _f(0, "Shuffle / synthetic generation seed.")
    shuffle: bool = _f(True, "Shuffle prompts each epoch.")
    synthetic_digits: int = _f(2, "Digits of a synthetic task's items: each operand's for synthetic:addition, the string's length for synthetic:reverse (in place of the task's own default, 4).", ge=1)
    task_options: dict = _f({}, "Options of a synthetic or reasoning_gym task, as a TOML table "
                                "(on the command line a JSON object), e.g. {digits = 1} for "
                                "synthetic:addition (it overrides synthetic_digits); a "
                                "reasoning_gym task takes its dataset's options.")


@dataclass
class RewardConfig:
    """Reward function (it never crashes the run: failures score 0)."""
    fn: str = _f("exact_match", "'exact_match', 'math', 'format', 'reasoning_gym' (the task's own scorer, for reasoning_gym sources), or 'package.module:function'.")
    timeout_s: float = _f(5.0, "Per-sample reward time limit, in seconds.", gt=0)
    format_weight: float = _f(0.0, "Weight of the format reward added to the task reward.", ge=0)
    workers: int = _f(2, "Reward calls run at once on each generator replica (its TP leader): threads, or worker processes with reward.isolate. Raise it for a reward that waits (an HTTP judge: 0.3 s a call at 2 workers held 256 samples a step for ~38 s); each worker process is an interpreter of its own.", ge=1)
    isolate: Literal["auto", "process", "thread"] = _f("auto", "Where reward calls run: 'process', worker processes killed at reward.timeout_s (the reward must be a module-level function; module state is per worker); 'thread', threads that cannot be killed (a stuck call keeps running; past 4 stuck, calls score 0 until one ends); 'auto', the reward's own `isolate` attribute (True for 'math').")


@dataclass
class EvalConfig:
    """Held-out evaluation during training: greedy completions of the current policy, scored by the reward."""
    every_steps: int = _f(0, "Evaluate the policy of every N-th version (0 = off), on generator replica 0 when it takes those weights; also version 0 (before training) and the final one. Results: <run.dir>/eval.jsonl, TensorBoard under <run.dir>/tb/eval, one console line. Training pauses on that replica meanwhile, so an evaluation must finish within parallel.timeout_s.", ge=0)
    num_prompts: int = _f(200, "Held-out prompts per evaluation.", ge=1)
    source: str = _f("", "Held-out prompts: like data.source (same fields and chat template); '' = data.source's. A task, given here or derived, is read from its held-out part: a synthetic task's items from index 500000 on (training draws from index 0), a reasoning_gym task's under seed data.seed + 500000 (most tasks seed item i by seed + i: training's items from 500000 on); a file needs an explicit eval.source. data.task_options and synthetic_digits apply when it is data.source's own task; another task runs with its defaults.")
    max_new_tokens: int = _f(0, "Completion length limit of an evaluation; 0 = generator.max_new_tokens.", ge=0)


@dataclass
class CheckpointConfig:
    """Checkpoints, resume and Hugging Face export."""
    every_steps: int = _f(0, "Checkpoint every N trainer steps and after the last one (split mode; colocated runs have no checkpoints); 0 = off.", ge=0)
    keep_last: int = _f(2, "Checkpoints kept on disk.", ge=1)
    resume: str = _f("auto", "'auto' = latest checkpoint in run.dir if any, 'never', or a checkpoint path.")
    hf_export_every: int = _f(0, "Export a Hugging Face model folder every N steps; 0 = off.", ge=0)
    hf_export_final: bool = _f(True, "Export a Hugging Face model folder at the end of training.")


@dataclass
class LoggingConfig:
    """Console, progress and TensorBoard output (metrics.jsonl is always written)."""
    console_every: int = _f(1, "Print a metrics line every N trainer steps (also the first and the last); 0: none, only the run's summary line at the end (metrics.jsonl and TensorBoard have every step).", ge=0)
    tensorboard: bool = _f(True, "Write TensorBoard events under <run.dir>/tb/.")
    progress: bool = _f(True, "Progress on the console: each step line ends with step/max_steps and the time left at the recent pace, and a wait for a batch of more than 10 s prints a line every 10 s saying what it waits for (at start-up: the generators' weights, engine and compilation).")
    log_rank: str = _f("all", "Ranks whose stdout is shown: 'all' (each rank prints only its role's few lines: rank 0 the rank map, the trainer's first rank the step lines, the first generator rank its set-up) or a comma-separated list of global ranks such as '0,3'; the others' stdout is dropped, their stderr (errors, tracebacks) kept. launch/run_local.sh filters by local rank instead (LOG_RANK).")


@dataclass
class RunConfig:
    """Identity and location of the run."""
    name: str = _f("tandem", "Run name.")
    dir: str = _f("", "Run directory; '' = derived: runs/<name>.")
    seed: int = _f(0, "Global seed, added to data.seed, generator.seed and trainer.seed when the config is resolved (a seed sweep varies this one key); the run's saved config.toml holds the sums and run.seed = 0.")
    dry_run: bool = _f(False, "Validate the config, print the rank map, the weight-sync plan and the memory per rank, and exit: no process group is created and no model is built (what --dry-run sets; launch/dry_run.py).")

    def folder(self) -> str:
        """The run directory: `dir`, or runs/<name> where it is derived (`Config.resolve`)."""
        return self.dir or os.path.join("runs", self.name)


@dataclass
class Config:
    """The whole tree. Sections are attributes: cfg.trainer.lr, cfg.run.dir."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "Config":
        """Build from {section: {key: value}} with TOML-typed values; errors name `source`."""
        cfg = cls()
        for section, table in d.items():
            sec = _section(cfg, section, source)
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: [{section}] must be a table of key = value, got {table!r}")
            for key, value in table.items():
                tp = _key_type(sec, section, key, source)
                try:
                    setattr(sec, key, _coerce(value, tp, f"{section}.{key}"))
                except ConfigError as e:
                    raise ConfigError(f"{source}: {e}") from None
        return cfg

    def to_dict(self) -> dict:
        """{section: {key: value}}; Config.from_dict(cfg.to_dict()) == cfg."""
        return dataclasses.asdict(self)

    def override(self, item: str) -> "Config":
        """Apply one "--section.key=value" (or "section.key=value"; a bare bool key means true) in place."""
        text = item[2:] if item.startswith("--") else item
        dotted, eq, value = text.partition("=")
        section, dot, key = dotted.strip().replace("-", "_").partition(".")
        if not dot or not key or "." in key:
            raise ConfigError(f"override {item!r} must look like --section.key=value, e.g. --trainer.lr=1e-5")
        sec = _section(self, section, f"override {item!r}")
        tp = _key_type(sec, section, key, f"override {item!r}")
        if not eq and tp is not bool:
            raise ConfigError(f"override {item!r} needs a value: --{section}.{key}=<{_type_name(tp)}>")
        try:
            setattr(sec, key, _coerce(value if eq else "true", tp, f"{section}.{key}", text=True))
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        return self

    def validate(self) -> "Config":
        """Check types, enum choices, bounds and cross-field rules; raise ConfigError with the fix."""
        for section, sec, f in _walk(self):
            key, value, meta = f"{section}.{f.name}", getattr(sec, f.name), f.metadata
            _coerce(value, typing.get_type_hints(type(sec))[f.name], key)  # type + Literal check for hand-built configs
            for op, bound in ((o, meta[o]) for o in ("gt", "ge", "lt", "le") if o in meta):
                if not _OPS[op][0](value, bound):
                    sym = _OPS[op][1]
                    raise ConfigError(f"{key}={value!r} is invalid: it must be {sym} {bound} "
                                      f"(set --{key}=<value {sym} {bound}>)")
            if f.name.endswith("timeout_s") and not math.isfinite(value):  # waits end: no hangs
                raise ConfigError(f"{key}={value!r} is invalid: a timeout must be a finite number "
                                  f"of seconds (set --{key}=<seconds>, e.g. {f.default})")
        g, a, t = self.generator, self.algo, self.trainer
        if a.token_is != "none" and a.loss != "ppo":
            raise ConfigError(f"algo.token_is={a.token_is!r} applies to algo.loss='ppo' only; "
                              f"algo.loss={a.loss!r} weights tokens by pi/mu itself (rho / "
                              "prox_cap): set --algo.token_is=none, or --algo.loss=ppo")
        _check_dual_clip(a)
        if a.advantage == "rloo" and g.n_samples < 2:
            raise ConfigError(f"algo.advantage='rloo' needs generator.n_samples >= 2, got {g.n_samples} "
                              "(set --generator.n_samples=4: every algo.advantage is a group "
                              "baseline, 0 for a group of one)")
        _check_ppo_clip_vs_truncation(a, g)
        # The staleness gate lets the generators deliver max_staleness + 1 steps of groups before
        # the trainer takes the next batch, and trainer rank 0's own thread puts them into the
        # buffer: a smaller one waits there for room that only that thread's take() could make.
        # Colocated mode generates each step on-policy and has no buffer: one step bounds it.
        split = self.parallel.mode == "split"
        ahead = a.max_staleness + 1 if split else 1
        need = t.prompts_per_step * g.n_samples * ahead
        if 0 < a.buffer_capacity < need:
            rule = (f"prompts_per_step*n_samples*(max_staleness+1) = {t.prompts_per_step}*{g.n_samples}*{ahead}"
                    if split else f"prompts_per_step*n_samples = {t.prompts_per_step}*{g.n_samples}")
            raise ConfigError(f"algo.buffer_capacity={a.buffer_capacity} cannot hold what the generators "
                              f"may deliver before the trainer takes a batch: {rule} = {need} samples "
                              f"(parallel.mode={self.parallel.mode!r}); set --algo.buffer_capacity to "
                              f">= {need}, or 0 to derive it")
        m = self.model
        if m.compute_dtype == "float32" and m.dtype != "float32":
            raise ConfigError(f"model.compute_dtype='float32' cannot compute wider than the parameters "
                              f"(model.dtype={m.dtype!r}); set --model.dtype=float32 or "
                              "--model.compute_dtype=auto")
        _check_table_values(self.data.task_options, "data.task_options")
        ranks = self.logging.log_rank.replace(" ", "")
        if ranks != "all" and not all(r.isdigit() for r in ranks.split(",")):
            raise ConfigError(f"logging.log_rank={self.logging.log_rank!r} is invalid: use 'all' or "
                              "comma-separated rank numbers (e.g. --logging.log_rank=0,4)")
        name = self.run.name
        folder = os.path.normpath(os.path.join("runs", name.strip()))
        if not self.run.dir and not folder.startswith("runs" + os.sep):
            raise ConfigError(f"run.name={name!r} is invalid: the run's folder is runs/<run.name>, "
                              f"and this one would be {folder!r}, not a folder of its own under "
                              "runs/; give a name such as --run.name=my_run, or a --run.dir")
        return self

    def resolve(self, world_size: int) -> "Config":
        """Return a copy with every derived value filled in and the layout checked. Idempotent.
        The keys it fills (DERIVED) remember the value they were given, which `to_toml` writes
        back, so that a saved config derives them again when reused (another run.name, another
        world size) instead of pinning this run's folder and layout."""
        cfg = copy.deepcopy(self).validate()
        given = {key: value_of(cfg, key) for key in DERIVED}
        _check_log_ranks(cfg.logging.log_rank, world_size)
        _resolve_layout(cfg.parallel, world_size, cfg.model.path)
        a, g, t = cfg.algo, cfg.generator, cfg.trainer
        if t.prompts_per_step < cfg.parallel.gen_dp:  # each replica generates its own share
            raise ConfigError(f"trainer.prompts_per_step={t.prompts_per_step} leaves some of the "
                              f"parallel.gen_dp={cfg.parallel.gen_dp} generator replicas without a "
                              f"prompt group to generate; set --trainer.prompts_per_step to >= "
                              f"{cfg.parallel.gen_dp}, or fewer generator replicas")
        least = cfg.parallel.trainer_fsdp * t.updates_per_step  # groups are dealt out whole
        if t.prompts_per_step < least:
            raise ConfigError(f"trainer.prompts_per_step={t.prompts_per_step} leaves some of the "
                              f"parallel.trainer_fsdp={cfg.parallel.trainer_fsdp} data-parallel "
                              f"trainer ranks without a prompt group for each of its "
                              f"trainer.updates_per_step={t.updates_per_step} updates; set "
                              f"--trainer.prompts_per_step to >= {least}, or fewer trainer ranks "
                              "or updates")
        if g.stack_weights == "all" and cfg.parallel.gen_tp > 1:  # the engine would refuse it
            raise ConfigError(f"generator.stack_weights='all' cannot stack the tensor-parallel "
                              f"shards of parallel.gen_tp={cfg.parallel.gen_tp}; set "
                              "--generator.stack_weights=auto (stacks where it can) or "
                              "--parallel.gen_tp=1")
        if a.buffer_capacity == 0:
            a.buffer_capacity = t.prompts_per_step * g.n_samples * (a.max_staleness + 1)
        if a.kl_coef > 0 and not cfg.model.ref_path:  # KL to the starting policy, as usual
            cfg.model.ref_path = cfg.model.path
        cfg.run.dir = cfg.run.folder()
        for section in (cfg.data, g, t):  # folded in once: resolving again adds nothing
            section.seed += cfg.run.seed
        cfg.run.seed = 0
        derived = dict(getattr(self, "_derived", {}))  # a resolved config's, resolved again
        for key, value in given.items():
            if value_of(cfg, key) != value:
                derived.setdefault(key, value)
        cfg._derived = derived  # not a field: equality compares the values only
        return cfg

    def to_toml(self) -> str:
        """The config as TOML, each key preceded by its help text. None is written as "". A key
        `resolve` derived is written as it was given (0, "": derive it), its derived value in a
        comment."""
        lines = ["# tandem config, written by config.py (None is written as \"\")."]
        derived = getattr(self, "_derived", {})
        for section, sec in ((f.name, getattr(self, f.name)) for f in fields(self)):
            lines += ["", f"[{section}]"]
            for f in fields(sec):
                value, key = getattr(sec, f.name), f"{section}.{f.name}"
                lines.append(f"# {f.metadata['help']}")
                if key in derived:
                    lines.append(f"# derived for this run: {_toml_value(value)}")
                    value = derived[key]
                lines.append(f"{f.name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def save(self, path: str) -> None:
        """Write to_toml() to `path` atomically (creating parent folders)."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(self.to_toml())
        os.replace(tmp, path)


def _check_log_ranks(log_rank: str, world_size: int) -> None:
    """logging.log_rank names ranks of the job: one it lacks showed nothing on the console at
    all (no rank map, no step line, no summary) and the run exited 0."""
    ranks = log_rank.replace(" ", "")
    missing = [] if ranks == "all" else [r for r in ranks.split(",") if int(r) >= world_size]
    if missing:
        raise ConfigError(f"logging.log_rank={log_rank!r} names rank(s) {', '.join(missing)}, "
                          f"which this job of {world_size} ranks lacks: the console would show "
                          f"nothing; name ranks 0..{world_size - 1} (--logging.log_rank=0), or "
                          "'all'")


def prints(log_rank: str, rank: int) -> bool:
    """Whether global `rank` keeps its stdout under logging.log_rank (validated: 'all' or digits)."""
    ranks = log_rank.replace(" ", "")
    return ranks == "all" or rank in {int(r) for r in ranks.split(",")}


def load_config(toml_path: str | None, overrides: typing.Iterable[str] = ()) -> Config:
    """Defaults <- TOML file (if any) <- overrides, then validate(). Call resolve() once the world size is known."""
    d, source = {}, "<defaults>"
    if toml_path:
        source = str(toml_path)
        try:
            with open(toml_path, "rb") as fh:
                d = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {toml_path} (cwd: {os.getcwd()})") from None
        except tomllib.TOMLDecodeError as e:  # message ends "(at line L, column C)"
            line = getattr(e, "lineno", None) or str(e).rpartition("line ")[2].split(",")[0]
            raise ConfigError(f"{toml_path}:{line}: invalid TOML: {e}") from None
    cfg = Config.from_dict(d, source)
    for item in [overrides] if isinstance(overrides, str) else overrides:
        cfg.override(item)
    return cfg.validate()


def parse_cli(argv: list[str]) -> tuple[str | None, list[str], dict]:
    """Split argv (without the program name) into (config path, overrides, plain flags).

    "--config F" / "--config=F" -> path; "--a.b=v" / "--a.b v" / "--a.b" -> override "a.b=v" / "a.b";
    "--dry-run" -> flags["dry_run"] = True; "--name=v" -> flags["name"] = "v".
    """
    path, overrides, flags, i = None, [], {}, 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("-"):
            raise ConfigError(f"unexpected argument {arg!r}; expected --config FILE, --section.key=value or --flag")
        name, eq, value = arg.lstrip("-").partition("=")
        if not eq and (name == "config" or "." in name) and i < len(argv) and not argv[i].startswith("--"):
            eq, value, i = "=", argv[i], i + 1
        if name == "config":
            if not eq or not value:
                raise ConfigError("--config needs a file: --config configs/tiny_cpu.toml")
            path = value
        elif "." in name:
            overrides.append(f"{name}={value}" if eq else name)
        else:
            flags[name.replace("-", "_")] = value if eq else True
    return path, overrides, flags


USAGE = """usage: torchrun --nproc-per-node N train_rl.py --config FILE [--section.key=value ...] [--dry-run]
       python train_rl.py --help [SECTION]

  --config FILE          a TOML preset (configs/); keys not in it keep their defaults
  --section.key=value    override one key, e.g. --trainer.lr=1e-5 --parallel.generator_ranks=2
  --dry-run              validate the config, build the rank map and the weight-sync plan and
                         print the memory per rank, without process groups
  --help [SECTION]       this text and every key (or one section's)
"""


def help_requested(argv) -> str | None:
    """The section asked for by `--help [SECTION]` / `-h` ("" for all), or None without it."""
    for i, arg in enumerate(argv):
        if arg in ("-h", "--help"):
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if nxt.startswith("-") else nxt
        if arg.startswith("--help="):
            return arg.partition("=")[2]
    return None


def resolve_config(argv: list[str]) -> Config:
    """The config of `train_rl.py ARGV`, resolved for this rank's WORLD_SIZE (a dry run without
    one is resolved by launch.dry_run from its degrees)."""
    path, overrides, flags = parse_cli(argv)
    unknown = set(flags) - {"dry_run"}
    if unknown:
        raise ConfigError(f"unknown flag(s) {sorted('--' + f.replace('_', '-') for f in unknown)}; "
                          f"valid: --config FILE, --dry-run, --section.key=value, --help")
    if "dry_run" in flags:  # --dry-run, or --dry-run=VALUE as run.dry_run reads it
        value = flags["dry_run"]
        overrides.append("run.dry_run=" + ("true" if value is True else value))
    cfg = load_config(path, overrides)
    if cfg.run.dry_run and "WORLD_SIZE" not in os.environ:
        return cfg  # launch.dry_run derives the world size from the config's degrees, then resolves
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        raise ConfigError(f"WORLD_SIZE={world!r} is not a number of ranks; torchrun sets it, and a "
                          f"dry run takes it as e.g. WORLD_SIZE=64 python train_rl.py --dry-run ...")
    return cfg.resolve(int(world))


def _check_ppo_clip_vs_truncation(a, g) -> None:
    """PPO without token IS clips pi/mu around the generator's mu, which top-k/top-p sampling
    records from the truncated distribution (rollout/sampling.py): on-policy pi/mu is then the
    kept mass, below 1 - clip_eps for any top_k (no floor) or a top_p under it, and every token
    of negative advantage is clipped (no gradient): only positive advantages learn."""
    if a.loss != "ppo" or a.token_is != "none" or g.samples_greedily():
        return
    if g.top_k > 0 or g.top_p < 1 - a.clip_eps:
        raise ConfigError(
            f"algo.loss='ppo' with algo.token_is='none' clips pi/mu around the generator's mu, "
            f"which generator.top_k={g.top_k} / top_p={g.top_p} truncates: on policy pi/mu is the "
            f"kept probability mass, which can be under 1 - algo.clip_eps = {1 - a.clip_eps:g} "
            f"(top_k keeps no least mass; top_p keeps top_p), and then every token with a "
            f"negative advantage is clipped and only positive ones learn; set "
            f"--algo.token_is=truncate (the clip then acts around the step's own policy), or "
            f"--algo.loss=aipo, or sample untruncated (--generator.top_k=0 --generator.top_p=1)")


def int_at_least(low: int):
    """An argparse type for the launch/ tools: an int >= low (argparse names the option
    in its error: "argument --nodes: 0 is below 1")."""
    def parse(text: str) -> int:
        v = int(text)
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} is below {low}")
        return v
    parse.__name__ = "int"  # argparse's "invalid int value" for a non-number
    return parse


def field_docs() -> dict[str, str]:
    """{"section.key": help text} for every field, in declaration order."""
    return {f"{s}.{f.name}": f.metadata["help"] for s, _, f in _walk(Config())}


def help_text(section: str | None = None) -> str:
    """Every key (or one section's) as `--section.key` with its type, default and help: what
    `train_rl.py --help [SECTION]` prints. An unknown section is a ConfigError naming the valid
    ones."""
    cfg = Config()
    if section is not None:
        _section(cfg, section, "--help")
    lines, current = [], None
    for s, sec, f in _walk(cfg):
        if section is not None and s != section:
            continue
        if s != current:
            current = s
            lines.append(f"\n[{s}]  {type(sec).__doc__.strip().splitlines()[0]}")
        tp = _type_name(typing.get_type_hints(type(sec))[f.name])
        default = _toml_value(getattr(sec, f.name))
        lines.append(f"  --{s}.{f.name}  ({tp}, default {default})\n      {f.metadata['help']}")
    return "\n".join(lines).lstrip("\n")


# ---- helpers -------------------------------------------------------------------------------------

_OPS = {"gt": (lambda v, b: v > b, ">"), "ge": (lambda v, b: v >= b, ">="),
        "lt": (lambda v, b: v < b, "<"), "le": (lambda v, b: v <= b, "<=")}
_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _walk(cfg: Config):
    for s in fields(cfg):
        sec = getattr(cfg, s.name)
        for f in fields(sec):
            yield s.name, sec, f


def _section(cfg: Config, section: str, source: str):
    names = [f.name for f in fields(cfg)]
    if section not in names:
        raise ConfigError(f"{source}: unknown section [{section}]{_did_you_mean(section, names)}; "
                          f"valid sections: {', '.join(names)}")
    return getattr(cfg, section)


def _key_type(sec, section: str, key: str, source: str):
    hints = typing.get_type_hints(type(sec))
    if key not in hints:
        raise ConfigError(f"{source}: unknown key '{section}.{key}'{_did_you_mean(key, list(hints))}; "
                          f"valid keys of [{section}]: {', '.join(hints)}")
    return hints[key]


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"{tp} (comma separated)"
    if tp is dict:
        return "a table (on the command line a JSON object)"
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")


def _coerce(raw, tp, key: str, text: bool = False):
    """`raw` as a value of type `tp`. text=True parses command-line strings; else types must match (int -> float ok)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):  # Optional[X]
        inner = next(a for a in args if a is not type(None))
        nones = ("", "none", "null") if text else ("",)
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in nones):
            return None
        return _coerce(raw, inner, key, text)
    if origin is Literal:
        if raw not in args:
            raise ConfigError(f"{key}={raw!r} is not a valid choice; choose one of "
                              f"{', '.join(repr(c) for c in args)} (e.g. --{key}={args[0]})")
        return raw
    if tp is dict:
        if text and isinstance(raw, str):
            try:
                raw = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}={raw!r} is not a JSON object ({e.msg}); write it as "
                                  f"--{key}='{{\"digits\":1}}'") from None
        if isinstance(raw, dict) and all(isinstance(k, str) for k in raw):
            return raw
    elif origin is list:
        if text and isinstance(raw, str):
            s = raw.strip()
            if s.startswith("[") != s.endswith("]") or "[" in s[1:-1] or "]" in s[1:-1]:
                raise ConfigError(f"{key}={raw!r} is not a list: write it as --{key}=1,2 or "
                                  f"--{key}=[1,2]")
            raw = [p.strip().strip("'\"") for p in s.removeprefix("[").removesuffix("]").split(",")
                   if p.strip()]
        if isinstance(raw, list):
            return [_coerce(x, args[0], key, text) for x in raw]
    elif isinstance(raw, str) and text and tp is not str:
        s = raw.strip().lower()
        try:
            return _BOOLS[s] if tp is bool else tp(s)
        except (KeyError, ValueError):
            pass
    elif tp is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    elif isinstance(raw, tp) and not (tp is int and isinstance(raw, bool)):
        return raw
    hint = " (true/false/1/0/yes/no)" if tp is bool else ""
    raise ConfigError(f"{key}={raw!r} has the wrong type: expected {_type_name(tp)}{hint}")


def _toml_value(v) -> str:
    if v is None:
        return '""'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # repr round-trips floats; TOML accepts 1e-05, inf and nan as written
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        keys = (k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k) for k in v)
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in zip(keys, v.values())) + "}"
    assert isinstance(v, str), f"cannot write {v!r} to TOML"
    esc = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return '"' + "".join(esc.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in v) + '"'


def _check_table_values(value, where: str) -> None:
    """A dict option's values must be what a saved config.toml can hold again: strings, numbers,
    booleans, lists and tables (JSON's null came back as "", a TOML date could not be written)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_table_values(v, f"{where}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_table_values(v, f"{where}[{i}]")
    elif not isinstance(value, (str, int, float)):
        what = "null" if value is None else type(value).__name__
        raise ConfigError(f"{where} is {what}, which a saved config.toml cannot hold (TOML has "
                          "strings, numbers, booleans, lists and tables); leave the key out for "
                          "the task's default, or give the value as a string")


def _check_dual_clip(a: AlgoConfig) -> None:
    """algo.dual_clip_c: 0 (off), or above 1 + clip_eps with a PPO loss. At or below 1 + clip_eps
    it would take the gradient of A < 0 tokens inside the clip range (trainer/losses.py)."""
    c = a.dual_clip_c
    if not c:
        return
    if a.loss == "aipo":
        raise ConfigError(f"algo.dual_clip_c={c} applies to algo.loss='ppo' and 'decoupled_ppo'; "
                          "AIPO's weight min(pi/mu, rho) is capped already (algo.rho): set "
                          "--algo.dual_clip_c=0, or --algo.loss=ppo")
    if not c > 1 + a.clip_eps:
        raise ConfigError(f"algo.dual_clip_c={c} must exceed 1 + algo.clip_eps = {1 + a.clip_eps}: "
                          "at or below it, tokens with A < 0 inside the clip range lose their "
                          "gradient; set --algo.dual_clip_c=3 (verl's), or 0 for none")


# the keys Config.resolve fills in from others (or from the world size)
DERIVED = ("parallel.generator_ranks", "parallel.gen_dp", "parallel.trainer_fsdp",
           "algo.buffer_capacity", "model.ref_path", "run.dir")


def warmup_budget_s(p) -> float:
    """How long a wait that spans the start-up, a first step or the run's end may take: the
    longer of `parallel` section `p`'s timeout_s and warmup_timeout_s."""
    return max(p.timeout_s, p.warmup_timeout_s)


def value_of(cfg: Config, key: str):
    """The value of the key "section.name" in `cfg`."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _resolve_layout(p: ParallelConfig, world: int, model_path: str = "") -> None:
    """Fill gen_dp / trainer_fsdp (and colocated generator_ranks) and check the mesh arithmetic.
    The error's fixes come from `layout_fixes`, each a whole valid layout by itself; where
    model_path's config.json can be read, only with degrees that split the model evenly."""
    given = copy.copy(p)
    problem = _layout_problem(p, world)
    if problem:
        factors = ", ".join(f"{k}={getattr(p, k)}" for k in _LAYOUT_KEYS)
        raise ConfigError(f"invalid parallel layout for world_size={world} (mode={p.mode!r}; {factors}): "
                          f"{problem}. Fix: {layout_fixes(given, world, model_tp_fits(model_path))}")


_LAYOUT_KEYS = ("generator_ranks", "gen_tp", "gen_dp", "trainer_tp", "trainer_fsdp")


def _layout_problem(p: ParallelConfig, world: int) -> str | None:
    """Fill p's derived degrees in place; the layout's first problem, or None when it is valid."""
    if world < 1:
        return "world_size must be >= 1"
    if p.mode == "colocated":
        p.generator_ranks = world
        gen_ranks = trainer_ranks = world
    elif not 1 <= p.generator_ranks < world:
        return "split mode needs 1 <= generator_ranks < world_size"
    else:
        gen_ranks, trainer_ranks = p.generator_ranks, world - p.generator_ranks
    for mesh, ranks, tp_key, dp_key in (("generator", gen_ranks, "gen_tp", "gen_dp"),
                                        ("trainer", trainer_ranks, "trainer_tp", "trainer_fsdp")):
        tp = getattr(p, tp_key)
        if ranks % tp:
            return f"{tp_key}={tp} does not divide the {ranks} {mesh} ranks"
        if getattr(p, dp_key) == 0:
            setattr(p, dp_key, ranks // tp)
        if tp * getattr(p, dp_key) != ranks:
            return f"{tp_key}*{dp_key} = {tp}*{getattr(p, dp_key)} != {ranks} {mesh} ranks"
    return None


def layout_fixes(p: ParallelConfig, world: int, tp_fits=None) -> str:
    """The changes that make the layout `p` (as given: derived degrees 0) valid for `world` ranks,
    with every tp degree passing `tp_fits` (None: any degree), as the text after "Fix: ".
    Alternatives are joined by "; or instead ": each one is a whole fix by itself, so that
    following one never leads to an error suggesting the other (an error once suggested
    trainer_tp 3 "or" generator_ranks=2, and the pair of them suggested trainer_tp 1 or 2)."""
    def valid(**change) -> bool:
        q = dataclasses.replace(p, **change)
        return _layout_problem(q, world) is None and all(
            tp_fits is None or tp_fits(tp) for tp in (q.gen_tp, q.trainer_tp))

    split = p.mode == "split"
    problem = _layout_problem(copy.copy(p), world) or ""
    keys = sorted((k for k in _LAYOUT_KEYS if split or k != "generator_ranks"),
                  key=lambda k: k not in problem)  # the degrees the problem names first
    alternatives = []
    for key in keys:
        values = [v for v in _candidates(key, p, world) if valid(**{key: v})]
        if key == "generator_ranks" and len(values) > 4:  # a large world has hundreds: the nearest
            values = sorted(sorted(values, key=lambda v: abs(v - p.generator_ranks))[:2])
        if values:
            alternatives.append("set " + _change(key, values))
    if not alternatives and world > 1:  # no single change does: the fewest of the simplest degrees
        simplest = {"generator_ranks": 1 if split else p.generator_ranks, "gen_tp": 1, "gen_dp": 0,
                    "trainer_tp": 1, "trainer_fsdp": 0}
        change = {k: v for k, v in simplest.items() if getattr(p, k) != v}
        for key in list(change):
            if valid(**{k: v for k, v in change.items() if k != key}):
                del change[key]
        if valid(**change):
            alternatives.append("set " + " and ".join(_change(k, [v]) for k, v in change.items()))
    if split and not 1 <= p.generator_ranks < world:
        if world == 1:
            alternatives.insert(0, "launch at least 2 ranks")
        if valid(mode="colocated"):
            alternatives.append("set --parallel.mode=colocated")
    pinned = p.described_world()
    if pinned not in (None, world) and _layout_problem(copy.copy(p), pinned) is None and (
            tp_fits is None or all(tp_fits(tp) for tp in (p.gen_tp, p.trainer_tp))):
        # degrees that describe another world: the launch may be what is wrong, first where
        # every degree is given (a plan's config, launch/plan.py), whose fixes rewrite the plan
        launch = f"launch {pinned} ranks, the world these degrees describe"
        alternatives.insert(0 if p.gen_dp else len(alternatives), launch)
    return "; or instead ".join(alternatives) or "launch at least one rank"


def _candidates(key: str, p: ParallelConfig, world: int) -> list[int]:
    """The values of `key` worth trying, other than its own: any degree up to the world size, and
    0 (derive it) for a data-parallel one."""
    if key == "generator_ranks":
        values = range(1, world)
    elif key in ("gen_dp", "trainer_fsdp"):
        values = range(0, world + 1)
    else:
        values = range(1, world + 1)
    return [v for v in values if v != getattr(p, key)]


def _change(key: str, values: list[int]) -> str:
    """'--parallel.key=v' or '--parallel.key to one of [...]'; a data-parallel degree's 0 (derive
    it) as a note."""
    shown = [v for v in values if v != 0] or values
    text = (f"--parallel.{key}={shown[0]}" if len(shown) == 1 else
            f"--parallel.{key} to one of {shown}")
    return text + (" (or 0 to derive it)" if 0 in values and len(values) > 1 else "")


def model_tp_fits(path: str):
    """tp degree -> whether it splits the model in folder `path` evenly: whole query and KV heads,
    an even share of the MLP's width, and no tied embeddings (ParallelDims.check_model's rules,
    read from config.json); None where there is no readable config.json (start-up checks the
    degrees then)."""
    if not path:
        return None
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            c = json.load(fh)
        heads = c["num_attention_heads"]
        sizes = (heads, c.get("num_key_value_heads") or heads, c.get("intermediate_size") or 0)
        tied = bool(c.get("tie_word_embeddings", False))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(isinstance(n, int) and n >= 0 for n in sizes):
        return None
    from parallel.dims import tp_fits_model
    return tp_fits_model(sizes, tied)
