"""Build and run the generator role on this rank: TP model, engine, prompts, rewards, receiver."""
from __future__ import annotations

import contextlib

from launch.faults import maybe_kill
from model.hf_io import load_model_args, to_dtype
from parallel.sharding import build_model, parallelize_generator
from rollout.data import (PromptSource, filter_by_length, load_held_out, load_prompts,
                          render_prompt, task_options)
from rollout.engine import Engine, decode_mode
from rollout.evaluate import PeriodicEval, engine_shape
from rollout.packed_linear import describe as describe_packing
from rollout.rewards import reward_runner
from rollout.worker import GeneratorWorker, stop_token_ids
from trainer.checkpointing import generator_state, read_extra, resume_path
from trainer.link import Link, PeerError
from weights_sync.ipc import watch_link
from weights_sync.sync import describe_receiver, make_receiver, plan_between_meshes


def load_items(cfg, tokenizer, warn: bool = True):
    """Prompts that fit `data.max_prompt_len`, plus their token ids (tokens in, tokens out).
    `warn`: log the prompts skipped (train_rl.py: preflight on the first rank, the roles not)."""
    d = cfg.data
    items = load_prompts(d.source, prompt_field=d.prompt_field, messages_field=d.messages_field,
                         answer_field=d.answer_field, num_prompts=d.num_prompts, seed=d.seed,
                         **task_options(d))
    return _fitting(items, cfg, tokenizer, f"training prompts ({d.source})", warn)


def load_eval_items(cfg, tokenizer, warn: bool = True):
    """The held-out prompts of `eval` (rollout.data.load_held_out) that fit, and their encoder."""
    return _fitting(load_held_out(cfg.data, cfg.eval, warn), cfg, tokenizer,
                    "held-out prompts (eval)", warn)


def _fitting(items, cfg, tokenizer, what: str, warn: bool):
    encode = lambda it: render_prompt(it, tokenizer, cfg.data.chat_template)  # noqa: E731
    kept, skipped = filter_by_length(items, encode, cfg.data.max_prompt_len, what, warn,
                                     unk_id=getattr(tokenizer, "unk_id", None))
    return kept, skipped, encode


def build_eval(cfg, rollout_engine: Engine, tokenizer, rewards, writer: bool,
               start_version: int = 0) -> PeriodicEval | None:
    """`eval.every_steps`: an evaluator with an engine of its own over the rollout engine's model
    (greedy, at most generator.num_slots slots, the same decode mode, and the packed and stacked
    weight copies of the rollout engine)."""
    if not cfg.eval.every_steps:
        return None
    items, _, encode = load_eval_items(cfg, tokenizer, warn=False)  # preflight's warnings
    g, main = cfg.generator, rollout_engine
    slots, max_len = engine_shape(cfg, len(items))
    engine = Engine(main.model, num_slots=slots, max_len=max_len, seed=g.seed,
                    compile_decode=decode_mode(g.decode, main.device),
                    decode_attention=g.decode_attention, pack_weights=main.packed_weights or False,
                    stack_weights=main.stacked_weights or False)
    return PeriodicEval(cfg, engine, items, encode, tokenizer, rewards, writer, start_version,
                        stop_token_ids(cfg, tokenizer))


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
                    compile_decode=decode_mode(g.decode, device), decode_attention=g.decode_attention,
                    pack_weights={"auto": None, "on": True, "off": False}[g.pack_weights],
                    stack_weights={"auto": None, "all": True, "qkv": "qkv",
                                   "off": False}[g.stack_weights])
    line = describe_packing(engine.pack_trial, engine.num_slots)
    if print_choice and line:
        print(line, flush=True)
    return engine


def run_generator(cfg, meshes, tokenizer) -> None:
    """Start-up (`start_generator`), then the loop. The leader's link comes first, so that a
    failure anywhere after it, start-up included, reaches the trainer with its cause. (Built after
    the engine, a failure in the engine's, a resume's or the evaluator's set-up told nobody:
    torchrun ends a failed rank's job at once on that rank's node only, and trainer rank 0 on
    another node waited for the first groups until warmup_budget_s, then failed with a time-out.)"""
    dims, rank = meshes.dims, meshes.rank
    leader = dims.generator_coord(rank)[1] == 0  # a replica's tp-rank 0 talks to the trainer
    link = Link(rank, [dims.trainer_rank_list[0]], cfg.parallel.timeout_s) if leader else None
    with contextlib.ExitStack() as stack:  # closed last to first: evaluator, rewards, link
        if link is not None:
            stack.callback(link.close)
        try:
            worker, resumed = start_generator(cfg, meshes, tokenizer, link, stack)
            maybe_kill(rank, 0)  # launch/faults.py: a failure at the end of start-up
            if worker.evaluator is not None and not resumed:
                worker.evaluate(0)  # the starting policy (a resumed run: at its swap)
            worker.run()
        except PeerError:  # the trainer's own shutdown: it is gone, nobody to tell
            raise
        except BaseException as e:
            if link is not None:
                link.broadcast_shutdown(f"generator rank {rank}: {type(e).__name__}: {e}",
                                        announce=not isinstance(e, KeyboardInterrupt))
            raise


def start_generator(cfg, meshes, tokenizer, link: Link | None,
                    stack: contextlib.ExitStack) -> tuple[GeneratorWorker, bool]:
    """This rank's model, weight receiver, prompts, engine, rewards and evaluator (their closing
    on `stack`), a resumed run's cut restored; the worker, and whether the run resumed."""
    dims, rank = meshes.dims, meshes.rank
    replica, tp_rank = dims.generator_coord(rank)
    model = build_generator_model(cfg, meshes)
    plan = plan_between_meshes(model, meshes.generator_group, is_src_leader=False,
                               is_dst_leader=rank == dims.generator_rank_list[0])
    # a zero-copy trainer (ipc_buffers=0): apply straight from its shards, without a staged copy
    # here (the generator receives at the safe point where it applies, so nothing waits longer)
    receiver = make_receiver(model, plan, rank, meshes.weights_group, cfg.parallel.timeout_s,
                             meshes.gpu_of, cpu_shm=cfg.parallel.cpu_shm,
                             ipc_direct=cfg.parallel.ipc_buffers == 0)
    if rank == dims.generator_rank_list[0]:
        print(f"generator: {describe_receiver(receiver)}", flush=True)
    if link is not None:  # the CUDA-IPC waits end on the trainer's failure, naming it
        watch_link(receiver, link)
    items, skipped, encode = load_items(cfg, tokenizer, warn=False)  # preflight warned
    prompts = PromptSource(items, seed=cfg.data.seed, shuffle=cfg.data.shuffle, rank=replica,
                           world=dims.gen_dp)
    engine = build_engine(model, cfg, replica, meshes.device, print_choice=rank == dims.generator_rank_list[0])
    tp_group = meshes.generator["tp"].get_group() if dims.gen_tp > 1 else None
    rewards = reward_runner(cfg.reward, leader=tp_rank == 0)
    stack.callback(rewards.close)
    worker = GeneratorWorker(cfg, engine, prompts, tokenizer, rewards, link, receiver,
                             dims.trainer_rank_list[0], replica, tp_group, encode)
    worker.on_first_swap = lambda: meshes.set_timeouts(cfg.parallel.timeout_s)
    path = resume_path(cfg)  # the same checkpoint the trainer resumes from
    start = 0
    if path is not None:
        extra = read_extra(path)
        start = extra["version"]
        worker.resume(generator_state(extra, replica), start)
    if replica == 0:
        worker.evaluator = build_eval(cfg, engine, tokenizer, rewards, writer=tp_rank == 0,
                                      start_version=start)
        if worker.evaluator is not None:
            stack.callback(worker.evaluator.close)
    return worker, path is not None
