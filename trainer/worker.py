"""The trainer role: take batches from the off-policy buffer, train, push weights, log.

Buffer ownership: trainer rank 0 owns the `OffPolicyBuffer`. Generator replica leaders send whole
prompt groups to it; it admits them, takes B groups per step (never older than eta versions), and
broadcasts the step's groups to every trainer rank over the trainer mesh. Each data-parallel rank
(fsdp coordinate) trains on groups[dp_rank::dp], so a group is never split. Tensor-parallel ranks of
one fsdp shard train on the same groups.
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from config import warmup_budget_s
from launch import preemption
from launch.faults import maybe_kill
from parallel.mesh import is_timeout
from trainer import checkpointing
from trainer.batch import Group
from trainer.buffer import OffPolicyBuffer
from trainer.link import Link, Msg, PeerError, left_error
from trainer.metrics import Heartbeat, duration, reduce_stats, step_metrics
from trainer.step import NonFiniteGuard, train_step


def broadcast_json(obj, src: int, group) -> object:
    """Broadcast a JSON-able object from global rank `src` over `group` (no pickle)."""
    if dist.get_world_size(group) == 1:
        return obj
    if dist.get_rank() == src:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    if dist.get_rank() != src:
        data = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.numpy()).decode())


def awaiting(owner: int, what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, a collective over the trainer mesh in which this rank waits for
    `what` (from trainer rank `owner`, the one that talks to the generators). Its failure names
    this rank and what it waited for, and where the owner failed and left its error in the job's
    store (its link's `broadcast_shutdown`), that error: gloo's own said only "Timed out waiting
    1200000ms for recv operation" or "Connection closed by peer"."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:  # gloo's and NCCL's errors (DistError) are RuntimeErrors
        if isinstance(e, PeerError):
            raise
        me = dist.get_rank()
        cause = left_error(owner) if me != owner else None
        if cause is not None:
            raise PeerError(f"trainer rank {owner} failed: {cause} (trainer rank {me} waited "
                            f"for {what})") from None
        kind = (TimeoutError if is_timeout(e) else
                ConnectionError if "onnection" in str(e) else RuntimeError)
        raise kind(f"trainer rank {me} waited for {what}, which failed: {e}") from None


def waiting_line(step: int, B: int, leaders: list[int], buffered: int,
                 evaluating: tuple[int, int, float] | None, now: float | None = None,
                 first: bool | None = None) -> str:
    """The heartbeat of trainer rank 0 while it waits for a step's batch; `first`: the first
    batch of this process (default: of the run), also after a resume."""
    first = step == 0 if first is None else first
    why = "; the first batch includes the generators' start-up" if first else ""
    if evaluating is not None:
        rank, version, since = evaluating
        now = time.monotonic() if now is None else now
        why += (f"; generator rank {rank} has been evaluating v{version} for "
                f"{duration(now - since)} (eval.every_steps)")
    return (f"step {step + 1}: waiting for {B} prompt groups from generator ranks {leaders} "
            f"({buffered} buffered{why})")


def training_order(groups: list[Group]) -> list[Group]:
    """A step's groups in the order they train: arrival order depends on reward threads and
    timing, training order must not. By oldest version, prompt id, and (a prompt drawn by two
    epochs comes twice) the completions."""
    return sorted(groups, key=lambda g: (g.min_version, g.prompt_id,
                                         [t.completion_ids for t in g.trajectories]))


class TrainerWorker:
    def __init__(self, cfg, meshes, model, optimizer, scheduler, sender, link: Link | None,
                 logger=None, ref_model=None, start_step: int = 0, tokenizer=None):
        self.cfg, self.meshes, self.model = cfg, meshes, model
        self.opt, self.sched, self.sender, self.link = optimizer, scheduler, sender, link
        self.logger, self.ref_model, self.tokenizer = logger, ref_model, tokenizer
        self.step, self.version = start_step, start_step
        # this process's first step waits for the generators' start-up, a resumed one's too
        self.warm = False
        self.dp_group = meshes.trainer["fsdp"].get_group()
        self.dp_rank, self.dp = meshes.trainer.get_coordinate()[0], meshes.dims.trainer_fsdp
        self.is_owner = meshes.rank == meshes.dims.trainer_rank_list[0]
        self.leaders = [row[0] for row in meshes.dims.generator_mesh_ranks()]
        self.buffer = None
        if self.is_owner:
            a, t, g = cfg.algo, cfg.trainer, cfg.generator
            self.buffer = OffPolicyBuffer(a.buffer_capacity, a.max_staleness, t.prompts_per_step, g.n_samples)
        self.acks: dict[int, float] = {}  # version -> the slowest replica's swap, as acknowledged
        # the generators' version before any acknowledgement: a resumed run's generators hold
        # the restored version before they generate again (0 read as if they had gone back)
        self.acked_floor = start_step  # `resume` raises it
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_steps)
        self.nonfinite_total = 0
        # when the previous step was stamped for its metrics row (None before the first): a
        # step's time runs from there, so that it includes the previous row's logging and the
        # steps' times add up to the run's wall time (the bench's TRL clock measures so)
        self.last_stamp: float | None = None
        self.evaluating: tuple[int, int, float] | None = None  # (rank, version, since) of an eval
        self.origin: str | None = None  # the explicit checkpoint.resume this run descends from
        self.stopped: dict | None = None  # the owner's stop decision (SIGTERM: launch/preemption.py)

    def resume(self, path) -> None:
        """Restore from a checkpoint (collective over the trainer mesh), then hand the generators
        the restored weights: they wait for this version before generating again."""
        checkpointing.load(self, path)  # metrics.jsonl was cut back to this step (MetricsLogger)
        self.acked_floor = self.version
        if self.is_owner:
            print(f"resumed from {path} at step {self.step} (version {self.version})", flush=True)
            if self.sched.resume_note:  # another max_steps or schedule: trainer/optim.py
                print(self.sched.resume_note, flush=True)
        self._alone(self._push_weights)

    def run(self) -> None:
        try:
            while self.step < self.cfg.trainer.max_steps and not self.stopped:
                self._one_step()
        except BaseException as e:
            # a generator's failure (PeerError) too: the other replicas learn its cause from
            # this, not from a timeout or a lost connection (the link skips the one that failed).
            # Not printed after a Ctrl-C, whatever it broke (a peer it ended first: "Connection
            # closed by peer"): train_rl prints the run's one interrupted line.
            if self.link is not None:
                self.link.broadcast_shutdown(f"trainer rank {self.meshes.rank}: {type(e).__name__}: {e}",
                                             announce=not (isinstance(e, (KeyboardInterrupt, PeerError))
                                                           or preemption.interrupted()))
            raise
        if not self.stopped:
            # the end of a finished run (the final SHUTDOWN, export and COMPLETE, the end barrier)
            # has waits with timeouts of their own, like a stop's checkpoint: a SIGTERM now no
            # longer cuts it off after the grace period (that left the export unfinished and the
            # run, trained to its end, not complete); torchrun's SIGKILL still bounds it, and an
            # export cut off there stays `hf_final.tmp` (parallel.checkpoint.export_hf)
            preemption.stopping()
        # the end takes the start-up budget on every trainer rank: rank 0 waits for replica 0's
        # final evaluation before the others meet it here (and in the final export's collectives)
        self.meshes.set_timeouts(warmup_budget_s(self.cfg.parallel))
        self._alone(self._shutdown_generators)
        self._stop_asked(at="the run's end")  # the meeting where `_alone`'s failures arrive

    def _one_step(self) -> None:
        maybe_kill(self.meshes.rank, self.step + 1)
        t0 = time.perf_counter()
        groups = self._take_batch()
        if groups is None:
            self._stop()
            return
        t_wait = time.perf_counter() - t0
        res = train_step(self.model, self.opt, self.sched, groups, self.cfg, self.dp_group,
                         self.meshes.device, self.version, self.ref_model,
                         before_update=self.sender.wait_sent, shard=(self.dp_rank, self.dp))
        self._check_finite(res)
        if not self.warm:
            self.meshes.set_timeouts(self.cfg.parallel.timeout_s)
            self.warm = True
        t_train = time.perf_counter() - t0 - t_wait
        # The version advances even when a non-finite step was skipped, so a synchronous
        # generator (waiting for v+1) is never left hanging; the weights are simply unchanged.
        self.version += 1
        self.step += 1
        stats = awaiting(self.meshes.dims.trainer_rank_list[0],
                         f"the stats of step {self.step} from the data-parallel ranks",
                         reduce_stats, res.stats, self.dp_group)
        # Checkpoint before announcing version v: in synchronous mode the generators then hold no
        # prompt in flight at the cut, so a resumed run regenerates nothing and stays bitwise equal.
        # The step's row goes with it (`row_so_far`): a crash in the push after the save lost it
        # for good, the resume going on after the saved step.
        self._maybe_save(lambda: self._row(groups, stats, res, t0, t_wait, t_train, None,
                                           time.perf_counter()))
        self._alone(self._finish_step, groups, stats, res, t0, t_wait, t_train)

    def _finish_step(self, groups, stats, res, t0: float, t_wait: float, t_train: float) -> None:
        """The step's weights to the generators, then (owner) its metrics row."""
        t1 = time.perf_counter()
        try:
            self._push_weights()
        finally:  # the step's row even when the push fails: a resume goes on after the saved step
            stamp = time.perf_counter()
            row = self._row(groups, stats, res, t0, t_wait, t_train, stamp - t1, stamp)
            self.last_stamp = stamp  # the step's time ends here: the next one's starts
            if row is not None:
                self.logger.log(row)

    def _row(self, groups, stats, res, t0: float, t_wait: float, t_train: float,
             t_sync: float | None, stamp: float) -> dict | None:
        """The step's metrics row (the owner's; None elsewhere), its time up to `stamp`; `t_sync`
        None: before the push."""
        if not (self.is_owner and self.logger is not None):
            return None
        start = t0 if self.last_stamp is None else self.last_stamp
        m = self._metrics(groups, stats, res, stamp - start, t_sync)
        return {**m, "time_wait_batch_s": t_wait, "time_train_s": t_train}

    def _alone(self, fn, *args) -> None:
        """`fn(*args)`: work between two meetings of the trainer mesh that the owner does alone
        (its messages to the generators, its metrics row, the end's SHUTDOWNs) while the other
        trainer ranks go on to the next meeting (`_stop_asked`: the next step's start, or the
        run's end). Its failure is sent to them there: they sat in it until gloo's time-out,
        naming neither the step nor the cause. (Where they failed too, or left, that send
        fails at once and the owner's own error goes up.)"""
        try:
            fn(*args)
        except Exception as e:
            if self.is_owner and len(self.meshes.dims.trainer_rank_list) > 1:
                try:
                    self._stop_asked(failed=f"{type(e).__name__}: {e}")
                except Exception:  # noqa: BLE001 (they are gone: this rank's error goes up)
                    pass
            raise

    def _push_weights(self) -> None:
        self.sender.push(self.version)
        if self.is_owner:  # with each replica's stale drops: its gate gets them back
            for replica, leader in enumerate(self.leaders):
                self.link.send(leader, Msg.WEIGHTS_READY, self.version,
                               {"dropped": self.buffer.dropped_of(replica)})

    def _maybe_save(self, row_so_far=lambda: None) -> None:
        # the export first: a crash between the two then resumes from an earlier checkpoint and
        # exports this step again (exported after the checkpoint, a crash in between lost it)
        checkpointing.maybe_export_hf(self.cfg, self.model, self.step,
                                      self.tokenizer if self.is_owner else None,
                                      self.meshes.trainer_group)
        c, last = self.cfg.checkpoint, self.step == self.cfg.trainer.max_steps
        # the last step too: a finished run trained on (a raised max_steps, as the "already
        # completed" line says) resumes there; without it, it redid the steps since the last N
        if c.every_steps and (self.step % c.every_steps == 0 or last):
            checkpointing.save(self, self.step, metrics_row=row_so_far)

    def _stop(self) -> None:
        """The stop that the owner announced (launch/preemption.py): a checkpoint of the last
        finished step, unless it is step 0 or already saved (collective over the trainer mesh);
        `run` then shuts the generators down."""
        preemption.stopping()
        path = checkpointing.checkpoint_dir(checkpointing.checkpoint_root(self.cfg), self.step)
        if self.stopped["save"]:
            path = checkpointing.save(self, self.step)
        if self.is_owner:
            print(checkpointing.stopped_line(self.cfg, self.stopped["reason"], self.step, path),
                  file=sys.stderr, flush=True)

    def collect_generator_states(self, step: int) -> dict:
        """The generator half of a consistent cut (owner only; see trainer/checkpointing.py)."""
        replies, before = checkpointing.gather_cut(self.link, self.leaders, step,
                                                   stop=bool(self.stopped))
        for m in before:  # groups shipped before each reply: into the buffer
            self._on_message(m)
        return {str(i): replies[leader] for i, leader in enumerate(self.leaders)}

    # ----- the buffer (owner only) ----------------------------------------------------------
    def _take_batch(self) -> list[Group] | None:
        """The step's groups on every trainer rank, or None (and `stopped` set) when the owner
        was asked to stop: its decision travels in this broadcast, which every step has."""
        groups, owner = None, self.meshes.dims.trainer_rank_list[0]
        asked = self._stop_asked()
        if self.is_owner:
            if asked is not None:
                preemption.request(f"SIGTERM on trainer rank {asked}")
            try:
                got = self._collect()
                groups = self._stop_decision() if got is None else [g.to_dict() for g in got]
            except Exception as e:  # the other trainer ranks wait in this broadcast: the cause
                try:
                    broadcast_json({"error": f"{type(e).__name__}: {e}"}, owner, self.meshes.trainer_group)
                except Exception:  # noqa: BLE001 (they are gone: this rank's error goes up)
                    pass
                raise
        what = (f"the other trainer ranks to take the batch of step {self.step + 1}" if self.is_owner
                else f"trainer rank {owner}'s batch for step {self.step + 1} (it waits for the "
                     "generators' groups)")
        groups = awaiting(owner, what, broadcast_json, groups, owner, self.meshes.trainer_group)
        if isinstance(groups, dict) and "error" in groups:  # (they wait twice as long: mesh.py)
            raise PeerError(f"trainer rank {owner} failed: {groups['error']}")
        if isinstance(groups, dict):
            self.stopped = groups
            return None
        return training_order([Group.from_dict(d) for d in groups])

    def _stop_asked(self, failed: str | None = None, at: str | None = None) -> int | None:
        """The highest trainer rank that got a SIGTERM (None: none), on every trainer rank: only
        the owner decides a stop, and a rank signalled alone (one node of several preempted)
        carried on until its grace period ended it with 143, and torchrun the job, the steps
        since the last checkpoint lost. One small all-reduce a step, before the owner waits for
        the batch (the others wait for it there anyway), and one at the run's end (`at`); none
        with one trainer rank.

        The meeting where the owner's failure in work it did alone since the last one arrives
        (`failed`, its error, on the owner: `_alone`): the others raise PeerError with it."""
        if len(self.meshes.dims.trainer_rank_list) == 1:
            return None
        owner, group = self.meshes.dims.trainer_rank_list[0], self.meshes.trainer_group
        at = at or f"the start of step {self.step + 1}"
        # on the host, as the batch broadcast: gloo's half of the group on GPUs, no device sync
        flag = torch.tensor([self.meshes.rank + 1 if preemption.requested() else 0,
                             int(failed is not None)])
        awaiting(owner, f"the other trainer ranks at {at}", dist.all_reduce, flag,
                 op=dist.ReduceOp.MAX, group=group)
        if flag[1]:
            error = awaiting(owner, f"trainer rank {owner}'s error after step {self.step}",
                             broadcast_json, {"error": failed}, owner, group)["error"]
            if not self.is_owner:
                raise PeerError(f"trainer rank {owner} failed after step {self.step}: {error}")
            return None
        return int(flag[0]) - 1 if flag[0] else None

    def _stop_decision(self) -> dict:
        """Why the run stops, and whether the last finished step still needs its checkpoint."""
        save = self.step > 0 and not checkpointing.saved(self.cfg, self.step)
        return {"reason": preemption.requested(), "save": save}

    def _collect(self) -> list[Group] | None:
        """B groups from the buffer, waiting for the generators; None once a stop is asked for."""
        B, timeout = self.cfg.trainer.prompts_per_step, self.cfg.parallel.timeout_s
        if not self.warm:
            timeout = warmup_budget_s(self.cfg.parallel)  # compile, first prefill
        deadline = time.monotonic() + timeout
        beat = Heartbeat(lambda: self._waiting_line(B), enabled=self.cfg.logging.progress)
        while True:
            for m in self.link.poll():
                self._on_message(m)
            if preemption.requested():
                return None
            got = self.buffer.try_take(B, self.version)
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"trainer rank 0 waited {timeout:.0f}s for {B} prompt groups at version "
                    f"{self.version} from generator ranks {self.leaders}; buffer holds "
                    f"{len(self.buffer)} groups, stats {self.buffer.stats()}"
                    + self._evaluating_note())
            try:  # in slices, for the heartbeat and a SIGTERM; the deadline decides when to give up
                m = self.link.wait_for({Msg.TRAJECTORIES, Msg.ACK, Msg.STOP}, f"{B} prompt groups for "
                                       f"step {self.step + 1}", timeout_s=min(left, beat.beat(), 1.0))
            except TimeoutError:
                continue
            self._on_message(m)

    def _evaluating_note(self) -> str:
        """Why a replica ships nothing, where it is evaluating (eval.every_steps)."""
        if self.evaluating is None:
            return ""
        rank, version, since = self.evaluating
        return (f"; generator rank {rank} has been evaluating v{version} for "
                f"{time.monotonic() - since:.0f}s (an evaluation must finish within "
                "parallel.timeout_s: lower eval.num_prompts or eval.max_new_tokens, or raise "
                "parallel.timeout_s)")

    def _waiting_line(self, B: int) -> str:
        return waiting_line(self.step, B, self.leaders, len(self.buffer), self.evaluating,
                            first=not self.warm)

    def _on_message(self, m) -> None:
        if m.type == Msg.TRAJECTORIES:  # a list of whole groups
            for d in m.payload:
                group = Group.from_dict(d)
                if not self.buffer.try_put(group):
                    self.buffer.put(group, timeout=self.cfg.parallel.timeout_s)
        elif m.type == Msg.ACK:
            seconds = (m.payload or {}).get("seconds", 0.0)  # the slowest replica's swap
            self.acks[m.version] = max(self.acks.get(m.version, 0.0), seconds)
        elif m.type == Msg.EVALUATING:  # starts (no payload) or ends
            self.evaluating = None if m.payload else (m.src, m.version, time.monotonic())
        elif m.type == Msg.STOP:  # a generator leader's SIGTERM
            preemption.request(m.payload["reason"])
        elif m.type == Msg.SHUTDOWN:
            raise PeerError(f"generator rank {m.src} shut down: {(m.payload or {}).get('error')}")

    def _shutdown_generators(self) -> None:
        if self.is_owner:
            for leader in self.leaders:
                self.link.send(leader, Msg.SHUTDOWN, self.version)
            # replica 0 evaluates the final version before it reads this (eval.every_steps):
            # the start-up budget, as for the barrier after the final export
            self.link.flush(warmup_budget_s(self.cfg.parallel))
        self.sender.close()

    # ----- bookkeeping ----------------------------------------------------------------------
    def _check_finite(self, res) -> None:
        self.nonfinite.check(res)
        self.nonfinite_total = self.nonfinite.total

    def _metrics(self, groups, s, res, dt, t_sync) -> dict:
        m = step_metrics(self.step, self.version, groups, s, res, dt, t_sync, self.nonfinite_total)
        m.update({"generator_sync_s": self.acks.get(self.version - 1),  # None: not acked yet
                  "generator_version": max(self.acks, default=self.acked_floor),
                  "buffer_groups": len(self.buffer),
                  "dropped_stale": self.buffer.stats()["dropped_stale"]})
        return m
