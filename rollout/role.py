"""Build and run the generator role on this rank: TP model, engine, prompts, rewards, receiver."""
from __future__ import annotations

from model.hf_io import load_model_args, to_dtype
from parallel.sharding import build_model, parallelize_generator
from rollout.data import PromptSource, filter_by_length, load_prompts, render_prompt
from rollout.engine import Engine, decode_mode
from rollout.packed_linear import describe as describe_packing
from rollout.rewards import RewardRunner, resolve_reward
from rollout.worker import GeneratorWorker
from trainer.checkpointing import generator_state, read_extra, resume_path
from trainer.link import Link
from weights_sync.sync import describe_receiver, make_receiver, plan_between_meshes


def load_items(cfg, tokenizer):
    """Prompts that fit `data.max_prompt_len`, plus their token ids (tokens in, tokens out)."""
    d = cfg.data
    digits = {"digits": d.synthetic_digits} if d.source.startswith("synthetic:") else {}
    items = load_prompts(d.source, prompt_field=d.prompt_field, messages_field=d.messages_field,
                         answer_field=d.answer_field, num_prompts=d.num_prompts, seed=d.seed,
                         **{**digits, **d.task_options})
    encode = lambda it: render_prompt(it, tokenizer, d.chat_template)  # noqa: E731
    kept, skipped = filter_by_length(items, encode, d.max_prompt_len)
    return kept, skipped, encode


def build_generator_model(cfg, meshes):
    """The generator's copy: TP over its replica, gen dtype, no gradients."""
    return build_model(load_model_args(cfg.model.path), meshes.device, to_dtype(cfg.model.gen_dtype),
                       parallelize=lambda m: parallelize_generator(m, meshes.generator),
                       path=cfg.model.path)


def build_engine(model, cfg, replica: int, device, print_choice: bool) -> Engine:
    """The rollout engine of one generator replica, from `cfg.generator` (split and colocated)."""
    g = cfg.generator
    engine = Engine(model, num_slots=g.num_slots, max_len=cfg.data.max_prompt_len + g.max_new_tokens,
                    seed=g.seed + replica, kv_policy=g.kv_policy,
                    compile_decode=decode_mode(g.decode, device),
                    pack_weights={"auto": None, "on": True, "off": False}[g.pack_weights])
    line = describe_packing(engine.pack_trial, engine.num_slots)
    if print_choice and line:
        print(line, flush=True)
    return engine


def run_generator(cfg, meshes, tokenizer) -> None:
    dims, rank = meshes.dims, meshes.rank
    replica, tp_rank = dims.generator_coord(rank)
    model = build_generator_model(cfg, meshes)
    plan = plan_between_meshes(model, meshes.generator_group, is_src_leader=False,
                               is_dst_leader=rank == dims.generator_rank_list[0])
    receiver = make_receiver(model, plan, rank, meshes.weights_group, cfg.parallel.timeout_s,
                             meshes.gpu_of, cpu_shm=cfg.parallel.cpu_shm)
    if rank == dims.generator_rank_list[0]:
        print(f"generator: {describe_receiver(receiver)}", flush=True)
    items, skipped, encode = load_items(cfg, tokenizer)
    prompts = PromptSource(items, seed=cfg.data.seed, shuffle=cfg.data.shuffle, rank=replica,
                           world=dims.gen_dp)
    engine = build_engine(model, cfg, replica, meshes.device, print_choice=rank == dims.generator_rank_list[0])
    trainer0 = dims.trainer_rank_list[0]
    link = Link(rank, [trainer0], cfg.parallel.timeout_s) if tp_rank == 0 else None
    tp_group = meshes.generator["tp"].get_group() if dims.gen_tp > 1 else None
    rewards = RewardRunner(resolve_reward(cfg.reward.fn, cfg.reward.format_weight), cfg.reward.timeout_s)
    worker = GeneratorWorker(cfg, engine, prompts, tokenizer, rewards, link, receiver, trainer0,
                             replica, tp_group, encode)
    worker.on_first_swap = lambda: meshes.shorten_timeouts(cfg.parallel.timeout_s)
    path = resume_path(cfg)  # the same checkpoint the trainer resumes from
    if path is not None:
        extra = read_extra(path)
        state = generator_state(extra, replica)
        if state is not None:
            worker.resume(state, extra["version"])
    try:
        worker.run()
    except BaseException as e:
        if link is not None:
            link.broadcast_shutdown(f"generator rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        rewards.close()
        if link is not None:
            link.close()
