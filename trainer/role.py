"""Build and run the trainer role on this rank: sharded model, optimizer, weight sender, link."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from launch import preemption
from launch.faults import maybe_kill
from model.hf_io import load_model_args, to_dtype
from parallel.checkpoint import seed_rngs
from parallel.sharding import build_model, parallelize_trainer
from trainer.checkpointing import clear_complete, mark_complete, read_extra, resume_path
from trainer.link import Link, PeerError
from trainer.metrics import MetricsLogger
from trainer.optim import build_optimizer, build_scheduler
from trainer.worker import TrainerWorker
from weights_sync.ipc import watch_link
from weights_sync.sync import make_sender, plan_between_meshes


def build_trainer_model(cfg, meshes, path: str):
    args = load_model_args(path)
    pcfg = cfg.parallel
    return build_model(args, meshes.device, to_dtype(cfg.model.dtype),
                       parallelize=lambda m: parallelize_trainer(
                           m, meshes.trainer, activation_checkpointing=pcfg.activation_checkpointing,
                           compile=pcfg.compile, units=pcfg.fsdp_units,
                           compute=cfg.model.compute_dtype,
                           micro_batch_tokens=cfg.trainer.micro_batch_tokens),
                       path=path, attn_backend=cfg.model.attn_backend)


def build_ref_model(cfg, meshes):
    """The frozen KL reference, sharded like the trainer; None without KL (algo.kl_coef = 0).
    `Config.resolve` made model.ref_path the starting policy where it was ''."""
    if cfg.algo.kl_coef == 0:
        return None
    return build_trainer_model(cfg, meshes, cfg.model.ref_path).requires_grad_(False)


def run_trainer(cfg, meshes, tokenizer=None) -> None:
    """Start-up (`start_trainer`), the steps, the end. The owner's link comes first, so that a
    failure of its start-up reaches the generators with its cause, as one in the steps does
    (`TrainerWorker.run`); another trainer rank's failure fails the owner's next collective with
    it. (Built after the model, a failure in the set-up of the optimizer or of a resume reached no
    generator: torchrun ends a failed rank's job at once on that rank's node only, and one on
    another node learnt of it from what broke next (the job's store, where node 0's agent held
    it), without the cause, or waited for weights until warmup_budget_s.)"""
    dims, rank = meshes.dims, meshes.rank
    owner = rank == dims.trainer_rank_list[0]
    leaders = [row[0] for row in dims.generator_mesh_ranks()]
    link = Link(rank, leaders, cfg.parallel.timeout_s) if owner else None
    with contextlib.ExitStack() as stack:  # closed last to first: the metrics log, the link
        if link is not None:
            stack.callback(link.close)
        try:
            worker = start_trainer(cfg, meshes, tokenizer, link, stack)
            maybe_kill(rank, 0)  # launch/faults.py: a failure at the end of start-up
        except BaseException as e:
            if link is not None:  # unannounced after a Ctrl-C: train_rl prints the run's one line
                link.broadcast_shutdown(f"trainer rank {rank}: {type(e).__name__}: {e}",
                                        announce=not (isinstance(e, (KeyboardInterrupt, PeerError))
                                                      or preemption.interrupted()))
            raise
        worker.run()  # tells the generators of its own failures
    if not worker.stopped:  # stopped early (SIGTERM): no final export, not complete
        finish_run(cfg, meshes, worker.model, tokenizer, worker.version, owner)


def start_trainer(cfg, meshes, tokenizer, link: Link | None,
                  stack: contextlib.ExitStack) -> TrainerWorker:
    """This rank's model (and KL reference), weight sender, optimizer and schedule, the owner's
    metrics log (its closing on `stack`), a resumed run's state restored and its weights sent."""
    rank = meshes.rank
    owner = link is not None
    seed_rngs(cfg.trainer.seed)  # before the model: a resume restores the checkpoint's states
    model = build_trainer_model(cfg, meshes, cfg.model.path)
    ref = build_ref_model(cfg, meshes)
    plan = plan_between_meshes(model, meshes.trainer_group, is_src_leader=owner, is_dst_leader=False)
    # CUDA IPC to a generator on this GPU (shared memory to a CPU one on this host), else NCCL/gloo
    sender = make_sender(model, plan, rank,
                         to_dtype(cfg.model.gen_dtype), meshes.weights_group, cfg.parallel.timeout_s,
                         meshes.gpu_of, ipc_buffers=cfg.parallel.ipc_buffers,
                         cpu_shm=cfg.parallel.cpu_shm)
    if link is not None:  # the CUDA-IPC waits end on a generator's failure, naming it
        watch_link(sender, link)
    path = resume_path(cfg)  # the same on every rank: they all read the run directory
    logger = None
    if owner:
        clear_complete(cfg)
        extra = read_extra(path) if path is not None else {"step": 0}
        logger = MetricsLogger.from_config(cfg, extra["step"])
        if cfg.checkpoint.resume == "auto":  # this folder's run: its step's row if it died before
            logger.restore(extra.get("metrics_row"))  # it (not another run's, resumed by path)
        stack.callback(logger.close)
    opt = build_optimizer(model, cfg.trainer)
    worker = TrainerWorker(cfg, meshes, model, opt, build_scheduler(opt, cfg.trainer), sender, link,
                           logger, ref, tokenizer=tokenizer)
    if path is not None:
        worker.resume(path)
    return worker


def finish_run(cfg, meshes, model, tokenizer, version: int, owner: bool) -> None:
    """Collective over the trainer mesh: the final policy as a Hugging Face folder (if
    configured), then the run's COMPLETE marker (one version per step: version = steps). A run
    of no step (an evaluation, `trainer.max_steps=0`) exports nothing: its policy is model.path."""
    if cfg.checkpoint.hf_export_final and version == 0:
        if owner:
            print(f"no step trained: the policy is {cfg.model.path} as it was loaded, so no "
                  "hf_final copy of it is written", flush=True)
    elif cfg.checkpoint.hf_export_final:
        from parallel.checkpoint import export_hf
        out = Path(cfg.run.dir) / "hf_final"
        t0 = time.perf_counter()
        export_hf(model, out, tokenizer=tokenizer if owner else None, group=meshes.trainer_group)
        if owner:  # as each export is reported: its folder and the seconds it took
            print(f"exported the final policy (version {version}) to {out} "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
    if owner:
        mark_complete(cfg, version)
