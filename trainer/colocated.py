"""Colocated mode: every rank is both generator and trainer, time-shared and synchronous.

The fallback when two meshes do not fit (or for small jobs on few devices). Per step:
  1. generate: each generator replica (gen_dp x gen_tp over all ranks) produces its share of the
     B prompt groups with the current weights (on-policy: staleness 0, no buffer);
  2. gather: the replica leaders' groups are all-gathered as JSON over the world (one mesh set,
     so world collectives are allowed here);
  3. train: each trainer data-parallel rank trains on groups[dp_rank::fsdp] (same step code as
     split mode);
  4. reshard: the trainer layout (FSDP x TP) is copied into the generator layout (TP x DP) with the
     same weight-sync plan as split mode, all of a version's sends and receives as one batch
     (weights_sync/exchange.py); pieces a rank sends to itself are plain local copies.
The exchange (2) is where a rank waits for the slowest one's generation, rewards or evaluation: a
timed-out exchange names the step and the ranks it waited for, with what each was doing
(`_Progress`). The end (the final evaluation and export) takes the start-up budget, as in split
mode (config: parallel.warmup_timeout_s).
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch
import torch.distributed as dist

from config import warmup_budget_s
from launch.faults import maybe_kill
from parallel.mesh import is_timeout
from rollout.engine import Request
from rollout.rewards import RewardReport
from rollout.role import build_engine
from rollout.worker import replica_share, sampling_params
from trainer.batch import Group
from trainer.checkpointing import clear_complete, maybe_export_hf
from trainer.metrics import reduce_stats, step_metrics
from trainer.step import NonFiniteGuard, train_step


class _PlanWithoutSelf:
    """The weight-sync plan minus the pieces a rank would send to itself (copied locally)."""

    def __init__(self, plan, rank: int):
        self._plan, self._rank = plan, rank
        self.src, self.dst = plan.src, plan.dst  # the layouts, as the plan's

    def sends_from(self, rank):
        return {d: t for d, t in self._plan.sends_from(rank).items() if d != self._rank}

    def recvs_to(self, rank):
        return {s: t for s, t in self._plan.recvs_to(rank).items() if s != self._rank}

    def local(self):
        return self._plan.sends_from(self._rank).get(self._rank, [])


def gather_groups(mine: list[dict], group=None) -> list[Group]:
    """The colocated step's exchange: every rank's groups (as dicts), as Groups by prompt id."""
    groups = [Group.from_dict(d) for part in all_gather_json(mine, group) for d in part]
    return sorted(groups, key=lambda g: g.prompt_id)


def all_gather_json(obj, group=None) -> list:
    """Every rank's JSON-able object, in rank order (no pickle): lengths first, then bytes."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    n = int(max(sizes))
    padded = torch.zeros(n, dtype=torch.uint8)
    padded[:data.numel()] = data
    bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return [json.loads(bytes(b[:int(k)].numpy()).decode()) for b, k in zip(bufs, sizes)]


class _Progress:
    """What each rank is doing, one store key per rank (written as a rank enters each phase): a
    timed-out exchange names the ranks that had not arrived and where they were. gloo's own
    time-out named neither ("Timed out waiting 3000ms for send operation to complete")."""

    def __init__(self, rank: int, world: int, store=None):
        from trainer.link import attempt_store
        self.store = attempt_store("colocated", store)
        self.rank, self.world = rank, world

    def mark(self, phase: str) -> None:
        self.store.set(str(self.rank), phase)

    def elsewhere(self, phase: str) -> str:
        """The other ranks not in `phase`, each with its own ("no word yet" before its first
        mark), for an error message: it must not replace the error when the store is gone too."""
        try:
            late = {}
            for r in (r for r in range(self.world) if r != self.rank):
                key = str(r)
                mark = self.store.get(key).decode() if self.store.check([key]) else "no word yet"
                if mark != phase:
                    late[r] = mark
        except Exception as e:  # noqa: BLE001 (the job's store went with a crashed rank)
            return f"unknown (the job's store did not answer: {type(e).__name__}: {e})"
        return "; ".join(f"rank {r}: {what}" for r, what in late.items()) or "none (a lost peer)"


class ColocatedWorker:
    def __init__(self, cfg, meshes, t_model, g_model, opt, sched, exchange, local,
                 prompts, encode, tokenizer, rewards, logger=None, ref_model=None):
        self.cfg, self.meshes, self.t_model, self.g_model = cfg, meshes, t_model, g_model
        self.opt, self.sched, self.exchange = opt, sched, exchange
        self.local, self.prompts, self.encode, self.tok = local, prompts, encode, tokenizer
        self.rewards, self.logger, self.ref_model = rewards, logger, ref_model
        self.reward_report = RewardReport()  # a console line as reward failures grow
        dims = meshes.dims
        self.replica, self.tp_rank = dims.generator_coord(meshes.rank)
        self.share = replica_share(cfg.trainer.prompts_per_step, dims.gen_dp, self.replica)
        self.engine = build_engine(g_model, cfg, self.replica, meshes.device,
                                   print_choice=meshes.rank == 0)
        self.params = sampling_params(cfg, tokenizer)
        self.dp_group = meshes.trainer["fsdp"].get_group()
        self.dp_rank = meshes.trainer.get_coordinate()[0]
        self.step = self.version = self.started = 0
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_steps)
        self.warm = False  # past the first step: the process groups wait parallel.timeout_s
        self.last_stamp: float | None = None  # as TrainerWorker's, evaluations left out
        self.progress = _Progress(meshes.rank, dims.world_size)

    def run(self, evaluator=None) -> None:
        """`evaluator` (rollout.evaluate.PeriodicEval, on the ranks of generator replica 0): the
        starting policy, then each version it asks for, after the reshard."""
        self._evaluate(evaluator)
        while self.step < self.cfg.trainer.max_steps:
            maybe_kill(self.meshes.rank, self.step + 1)  # launch/faults.py
            t0 = time.perf_counter()
            start = t0 if self.last_stamp is None else self.last_stamp
            groups = self._exchange(self._generate())
            t_batch = time.perf_counter()
            res = train_step(self.t_model, self.opt, self.sched, groups, self.cfg, self.dp_group,
                             self.meshes.device, self.version, self.ref_model,
                             shard=(self.dp_rank, self.meshes.dims.trainer_fsdp))
            self.nonfinite.check(res)
            t_trained = time.perf_counter()
            self.version += 1
            self.step += 1
            maybe_export_hf(self.cfg, self.t_model, self.step,
                            self.tok if self.meshes.rank == 0 else None, self.meshes.trainer_group)
            t1 = time.perf_counter()
            self._reshard()
            if not self.warm:  # model load, compile and the first step are behind every rank
                self.meshes.set_timeouts(self.cfg.parallel.timeout_s)
                self.warm = True
            stats = reduce_stats(res.stats, self.dp_group)
            stamp = time.perf_counter()
            if self.logger is not None:  # split mode's timing keys: here the batch is generated
                m = step_metrics(self.step, self.version, groups, stats, res, stamp - start,
                                 stamp - t1, self.nonfinite.total)
                self.logger.log({**m, "time_wait_batch_s": t_batch - t0,
                                 "time_train_s": t_trained - t_batch})
            t_eval = time.perf_counter()
            self._evaluate(evaluator)  # after the step's metrics: its time is in eval.jsonl
            self.last_stamp = stamp + time.perf_counter() - t_eval  # the next step's start
        # the end (replica 0's final evaluation, which the other ranks wait for in the final export's
        # collectives, and the export rank 0 writes) takes the start-up budget, as split mode's
        # does: with timeout_s a large model's final export failed the finished run
        self.meshes.set_timeouts(warmup_budget_s(self.cfg.parallel))

    def _evaluate(self, evaluator) -> None:
        if evaluator is not None and evaluator.due(self.version):
            self.progress.mark(f"evaluating v{self.version} (eval.every_steps)")
            evaluator.maybe_run(self.version)

    def _exchange(self, mine: list[dict]) -> list[Group]:
        """Every rank's groups of this step (`gather_groups`), or an error that names the step,
        the ranks that did not arrive, what each was doing, and the budget they overran."""
        here = f"at the exchange of step {self.step + 1}"
        self.progress.mark(here)
        t0 = time.monotonic()
        try:
            return gather_groups(mine)
        except RuntimeError as e:
            who = self.progress.elsewhere(here)
            budget = (f"parallel.timeout_s={self.cfg.parallel.timeout_s:g}" if self.warm else
                      f"the start-up budget (the larger of parallel.timeout_s and "
                      f"parallel.warmup_timeout_s, {warmup_budget_s(self.cfg.parallel):g}s)")
            kind = TimeoutError if is_timeout(e) else ConnectionError
            raise kind(
                f"colocated step {self.step + 1}: rank {self.meshes.rank} waited "
                f"{time.monotonic() - t0:.0f}s for every rank's prompt groups (the step's "
                f"exchange, an all-gather over the world) and gave up; ranks not there: {who}. "
                f"A step's generation with its rewards (reward.timeout_s="
                f"{self.cfg.reward.timeout_s:g} per completion), and replica 0's evaluations, must "
                f"each finish within {budget}: raise it, or lower generator.max_new_tokens or "
                f"eval.num_prompts ({e})") from e

    def _generate(self) -> list[dict]:
        """This replica's share of the step's groups, all sampled with the current weights."""
        from rollout.sampling import mix32
        self.progress.mark(f"generating step {self.step + 1} (the rollout, then its rewards)")
        # by start index: a step across an epoch boundary may draw a prompt twice
        reqs, items = [], {}
        for item in self.prompts.next_batch(self.share):
            seed = mix32(self.cfg.generator.seed * 1_000_003 + self.replica) << 32 | mix32(self.started)
            reqs.append(Request(self.started, self.encode(item),
                                dataclasses.replace(self.params, seed=seed)))
            items[self.started] = item
            self.started += 1
        done = self.engine.generate(reqs)
        scores = self.rewards.score_batch([items[c.request_id] for c in done],
                                          [self.tok.decode(c.completion_ids) for c in done],
                                          [c.completion_ids for c in done])
        groups = Group.of_completions(done, scores, {i: it.id for i, it in items.items()})
        line = self.reward_report.line(self.rewards.stats(), self.cfg.reward.timeout_s)
        if line:  # a TP leader's (a follower's rewards are Unscored: no stats)
            print(f"replica {self.replica}: {line}", flush=True)
        return [g.to_dict() for g in groups] if self.tp_rank == 0 else []

    @torch.no_grad()
    def _reshard(self) -> None:
        """Trainer layout -> generator layout; local pieces copied, the rest over the network."""
        self.exchange.run(self.version)()
        src, dst = self.exchange.sender.tensors, self.exchange.receiver.tensors
        for t in self.local:
            dst[t.param][t.dst_box.slices()].copy_(src[t.param][t.src_box.slices()])
        self.engine.version = self.version


def run_colocated(cfg, meshes, tokenizer) -> None:
    from model.hf_io import to_dtype
    from parallel.checkpoint import seed_rngs
    from parallel.layout import Layout
    from rollout.data import PromptSource
    from rollout.rewards import reward_runner
    from rollout.role import build_eval, build_generator_model, load_items
    from trainer.metrics import MetricsLogger
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.role import build_ref_model, build_trainer_model, finish_run
    from weights_sync.plan import plan_cached
    from weights_sync.exchange import BatchedExchange
    from weights_sync.sync import WeightReceiver, WeightSender, transfer_specs

    dims, rank, timeout = meshes.dims, meshes.rank, cfg.parallel.timeout_s
    seed_rngs(cfg.trainer.seed)
    t_model = build_trainer_model(cfg, meshes, cfg.model.path)
    g_model = build_generator_model(cfg, meshes)
    src = Layout.from_module(t_model, group=meshes.trainer_group)
    dst = Layout.from_module(g_model, group=meshes.generator_group)
    plan = _PlanWithoutSelf(plan_cached(src, dst, transfer_specs(src, dst)), rank)
    exchange = BatchedExchange(
        WeightSender(t_model, plan, rank, to_dtype(cfg.model.gen_dtype), meshes.weights_group, timeout,
                     streams=False),
        WeightReceiver(g_model, plan, rank, meshes.weights_group, timeout))
    items, _, encode = load_items(cfg, tokenizer, warn=False)  # preflight warned
    replica, tp_rank = dims.generator_coord(rank)
    prompts = PromptSource(items, seed=cfg.data.seed, shuffle=cfg.data.shuffle, rank=replica,
                           world=dims.gen_dp)
    rewards = reward_runner(cfg.reward, leader=tp_rank == 0)  # a TP leader scores for its replica
    opt = build_optimizer(t_model, cfg.trainer)
    logger = None
    if rank == 0:
        clear_complete(cfg)
        logger = MetricsLogger.from_config(cfg)
    worker = ColocatedWorker(cfg, meshes, t_model, g_model, opt, build_scheduler(opt, cfg.trainer),
                             exchange, plan.local(), prompts, encode, tokenizer, rewards, logger,
                             build_ref_model(cfg, meshes))
    evaluator = None if replica else build_eval(cfg, worker.engine, tokenizer, rewards,
                                                 writer=worker.tp_rank == 0)
    try:
        maybe_kill(rank, 0)  # launch/faults.py: a failure at the end of start-up
        worker.run(evaluator)
    finally:
        if evaluator is not None:
            evaluator.close()
        rewards.close()
        if logger is not None:
            logger.close()
    finish_run(cfg, meshes, t_model, tokenizer, worker.version, rank == 0)
