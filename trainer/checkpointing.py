"""Consistent checkpoints of the whole RL job at a trainer step boundary, and resume.

The cut, at the end of trainer step k (weights of version k already pushed):
  1. trainer rank 0 sends CHECKPOINT(k) to every generator replica leader;
  2. each leader replies with its data cursor, its started-group count and the prompts it has in
     flight (started, not yet shipped). Groups it shipped before replying reach trainer rank 0
     before the reply (one ordered ticket queue per receiver);
  3. trainer rank 0 takes those into the buffer (not the ones shipped after the reply: they are
     in its in-flight list; `gather_cut`), then every trainer rank writes its model and
     optimizer shards with DCP; `extra.json` holds step, version, LR schedule, RNG, the buffer's
     groups and the generators' states. Written to a temporary folder, then renamed; last K kept.
On resume (torchrun --max-restarts, or `checkpoint.resume`), every rank reads the same finished
checkpoint from the run directory (a shared filesystem, as for metrics): the trainer reloads its
shards and the buffer, the generators restore their cursors and *regenerate* the in-flight prompts
first, with the same per-group seeds. Groups generated after the cut died with the crash and are
regenerated from the restored cursor. So every prompt is trained exactly once, none is dropped.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from parallel.checkpoint import (checkpoint_dir, complete_checkpoints, latest_checkpoint,
                                 prune_checkpoints)

EXTRA_FILE = "extra.json"


def checkpoint_root(cfg) -> Path:
    return Path(cfg.run.dir) / "checkpoints"


def resume_path(cfg) -> Path | None:
    """The checkpoint to resume from, the same on every rank: 'auto' (latest, if any), 'never', or
    an explicit path (which must exist). An explicit path starts a lineage: once this run has
    saved checkpoints of its own that descend from it (`origin`), a restart or requeue of the
    same command resumes from the latest of those, not from the path again."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    latest = latest_checkpoint(checkpoint_root(cfg))
    if mode == "auto":
        return latest
    path = Path(mode)
    if latest is not None and read_extra(latest).get("origin") == origin_of(path):
        return latest  # also once pruning (checkpoint.keep_last) removed the path itself
    path = stand_in(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"checkpoint.resume={mode!r} is not a finished checkpoint folder (no .metadata); "
                         f"latest under {checkpoint_root(cfg)}: {latest}")
    return path


def stand_in(path: Path) -> Path:
    """`path`, or where it is not a finished checkpoint, its finished `.old` copy: a save of that
    step again was cut off between its renames (parallel/checkpoint.py), and the copy stands for
    the step, as for an 'auto' resume (a path naming the step was refused)."""
    if (path / ".metadata").is_file() or not path.name:  # ("", "/": no folder name to extend)
        return path
    aside = path.with_name(path.name + ".old")
    return aside if (aside / ".metadata").is_file() else path


def origin_of(path: Path) -> str:
    """How a checkpoint records the explicit checkpoint.resume its lineage started from."""
    return str(Path(path).resolve())


# The settings a checkpoint's generator gates, cursors and buffer were counted in: a resume with
# others does not work (the gates wait forever or overfill the buffer, cursors refuse late).
RESUME_SETTINGS = ("trainer.prompts_per_step", "generator.n_samples", "parallel.gen_dp")


def settings_of(cfg) -> dict:
    """Every setting of `cfg` by key ("trainer.lr": 1e-05), as a checkpoint records its run's: a
    resume refuses changed `RESUME_SETTINGS` (`check_settings`) and lists the others that changed
    (`resume_changes_line`). model.ref_path is the KL reference the run uses or would use ('' =
    the starting policy, model.path), so that a changed model.path shows as a moved reference."""
    settings = {f"{section}.{key}": value
                for section, table in cfg.to_dict().items() for key, value in table.items()}
    settings["model.ref_path"] = reference_folder(cfg)
    return settings


def check_resume(cfg) -> Path | None:
    """Before any process group (launch/preflight.py): checkpoint.resume names a usable choice,
    its checkpoint was saved with settings this run can go on with (`check_settings`), and the
    run folder holds no checkpoint later than where this run starts; returns the
    checkpoint resumed from (`resume_path`), or None. An earlier run's
    later checkpoints would outrank this run's: pruning keeps the highest steps (it deleted the
    one just saved) and an 'auto' resume would take them, mixing two runs in one folder."""
    start = resume_path(cfg)  # raises for a path that is not a finished checkpoint
    if start is not None and cfg.parallel.mode == "colocated":
        raise ValueError(
            f"parallel.mode='colocated' has no checkpoints, but this run would resume from {start} "
            f"(checkpoint.resume={cfg.checkpoint.resume!r}): it would start over at step 0 and "
            f"overwrite {cfg.run.dir}'s metrics; resume it with --parallel.mode=split, or pass a "
            "new --run.dir")
    extra = {"step": 0} if start is None else read_extra(start)
    if start is not None:
        check_settings(cfg, start, extra)
    elif cfg.checkpoint.resume == "auto":
        _check_no_finished_run(cfg)
    step = extra["step"]
    later = [d for s, d in complete_checkpoints(checkpoint_root(cfg)) if s > step]
    if later:
        raise ValueError(
            f"checkpoint.resume={cfg.checkpoint.resume!r} starts this run at step {step}, but "
            f"{checkpoint_root(cfg)} holds later checkpoints of an earlier run ({later[-1].name}"
            f"{f' and {len(later) - 1} more' if len(later) > 1 else ''}), which would outrank "
            "this run's; pass a new --run.dir, or move those checkpoints away")
    return start


def _check_no_finished_run(cfg) -> None:
    """A run with nothing to resume from, in a folder whose earlier run finished fewer steps
    without checkpoints (colocated mode, or checkpoint.every_steps=0): relaunched with a higher
    trainer.max_steps, or in split mode, it started over at step 0 without a word, overwriting
    that run's metrics and hf_final (a colocated run relaunched as a split one, to resume it)."""
    done = completed_steps(cfg)
    if done is None or done >= cfg.trainer.max_steps:
        return  # no finished run here, or one this run leaves as it is (already_complete_line)
    raise ValueError(
        f"run {cfg.run.dir} already completed {done} steps and has no checkpoint to train on from "
        f"(colocated mode, or checkpoint.every_steps=0): this run (trainer.max_steps="
        f"{cfg.trainer.max_steps}, parallel.mode={cfg.parallel.mode!r}) would start over at step "
        f"0 and overwrite its metrics and hf_final. Pass a new --run.dir (--model.path="
        f"{Path(cfg.run.dir) / 'hf_final'} starts from its weights), or --checkpoint.resume=never "
        "to start over in this folder")


def saved_settings(extra: dict) -> dict:
    """The settings a checkpoint's run had (`settings_of`). Checkpoints from before every key was
    saved hold RESUME_SETTINGS only, older ones none: their generator replicas are counted."""
    return extra.get("settings") or {"parallel.gen_dp": len(extra.get("generators") or {}) or None}


def check_settings(cfg, path: Path, extra: dict) -> None:
    """A resume keeps the settings its checkpoint's state was counted in (`RESUME_SETTINGS`),
    and its KL reference model (`_check_reference`), and has a buffer that still fits its groups.
    A changed sampling setting is applied to the groups generated from then on: the buffered
    groups' log-probs are those of the distribution they were sampled from, and their importance
    weights against the trainer's policy correct for the change as for any lag."""
    saved, now = saved_settings(extra), settings_of(cfg)
    changed = {k: saved[k] for k in RESUME_SETTINGS
               if saved.get(k) is not None and now[k] != saved[k]}
    if changed:
        was = ", ".join(f"{k}={now[k]} (the checkpoint's run: {v})" for k, v in changed.items())
        keep = " ".join(_keep_flag(cfg, k, v) for k, v in changed.items())
        raise ValueError(
            f"resuming {path} with {was}: the generators' staleness gates, prompt "
            f"cursors and the buffer were counted in the old values, and a resume with others "
            f"waits forever or overfills the buffer. Resume with {keep}, or start a new --run.dir "
            "(its --model.path an HF export of this run to keep the weights)")
    _check_reference(cfg, path, saved.get("model.ref_path"))
    samples = sum(len(g["trajectories"]) for g in (extra.get("buffer") or {}).get("groups", []))
    if samples > cfg.algo.buffer_capacity:
        raise ValueError(
            f"resuming {path}: its buffer holds {samples} samples, more than algo.buffer_capacity="
            f"{cfg.algo.buffer_capacity} (derived from prompts_per_step, n_samples and "
            f"max_staleness={cfg.algo.max_staleness} unless set); set --algo.buffer_capacity="
            f"{samples} or more" + _staleness_too(cfg, extra))
    _check_staleness(cfg, path, extra)


def _staleness_too(cfg, extra: dict) -> str:
    """The end of the buffer-capacity refusal where a lower max_staleness is what shrank it: a
    bigger buffer alone resumed, and then dropped the groups or waited (`_check_staleness`)."""
    need = _staleness_lowered(cfg, extra)
    return (f", and --algo.max_staleness={need} or more (its groups were generated up to {need} "
            "versions before the steps that train them)" if need else "")


def _staleness_lowered(cfg, extra: dict) -> int | None:
    """The least max_staleness this resume needs where it lowered the checkpoint's run's below
    what its groups need, else None. Only a lowered one: under the run's own value a buffered
    straggler (a long completion that arrived late) is dropped as that run would have dropped
    it, the gates counting the drop. Never more than the run's own value."""
    was = saved_settings(extra).get("algo.max_staleness")
    if was is None or cfg.algo.max_staleness >= was:
        return None
    need = min(staleness_needed(extra, cfg.trainer.prompts_per_step), was)
    return need if need > cfg.algo.max_staleness else None


def _keep_flag(cfg, key: str, was) -> str:
    """The flags that resume with the checkpoint's `was` of `key`. parallel.gen_dp is derived
    from generator_ranks / gen_tp: "--parallel.gen_dp=1" alone was refused as a bad layout on a
    job requeued with the generator ranks of the new gen_dp, so the generator ranks are named."""
    if key != "parallel.gen_dp":
        return f"--{key}={was}"
    p = cfg.parallel
    trainers = p.trainer_fsdp * p.trainer_tp
    return (f"--parallel.generator_ranks={was * p.gen_tp} ({was} replicas x gen_tp={p.gen_tp}; "
            f"with this run's {trainers} trainer ranks, a world size of "
            f"{was * p.gen_tp + trainers})")


def staleness_needed(extra: dict, batch_groups: int) -> int:
    """The least algo.max_staleness under which a resume trains every group its checkpoint holds:
    the buffered ones (taken in (min_version, arrival) order, as `OffPolicyBuffer.take` does, the
    order `state_dict` saves them in) and then the in-flight ones, regenerated at the checkpoint's
    version. Backlog group j is taken at trainer version `version + j // batch_groups`; one made
    at an older version than that less max_staleness is dropped as stale.
    >>> g = lambda v: {"trajectories": [{"token_versions": [v, v + 1]}]}
    >>> staleness_needed({"version": 4, "buffer": {"groups": [g(2), g(3), g(3)]}}, batch_groups=2)
    2
    """
    version = extra.get("version", extra.get("step", 0))
    made = [min(min(t["token_versions"]) for t in g["trajectories"])  # Group.min_version
            for g in (extra.get("buffer") or {}).get("groups", [])]
    made += [version] * inflight_groups(extra)
    return max([0] + [version + j // batch_groups - v for j, v in enumerate(made)])


def _check_staleness(cfg, path: Path, extra: dict) -> None:
    """A lower algo.max_staleness than the checkpoint's groups need: the first take dropped the
    stalest buffered groups (their prompts never trained, the resume saying nothing), and where
    it dropped more than a step's worth at once the trainer waited for groups that the
    generators' gates, still counting them, would not start (until parallel.timeout_s)."""
    need = _staleness_lowered(cfg, extra)
    if need is None:
        return
    was = saved_settings(extra)["algo.max_staleness"]
    backlog = buffered_groups(extra) + inflight_groups(extra)
    raise ValueError(
        f"resuming {path} with algo.max_staleness={cfg.algo.max_staleness} (the checkpoint's "
        f"run: {was}): its {backlog} buffered and in-flight groups are trained up to {need} version"
        f"{'s' if need > 1 else ''} after the one they were generated with, so the first steps "
        "would drop them as stale (their prompts never trained) and could wait for groups the "
        "generators' gates do not start. "
        f"Resume with --algo.max_staleness={need} or more, or start a new --run.dir (its "
        "--model.path an HF export of this run to keep the weights)")


def inflight_groups(extra: dict) -> int:
    """Groups the checkpoint's generators had started and not shipped (regenerated on resume)."""
    return sum(len(g.get("inflight") or []) for g in (extra.get("generators") or {}).values())


def buffered_groups(extra: dict) -> int:
    """Groups the checkpoint's buffer holds: generated, not yet trained."""
    return len((extra.get("buffer") or {}).get("groups", []))


def reference_folder(cfg) -> str:
    """The KL reference's folder as an absolute path ('' = model.path): "runs/m", "./runs/m/" and
    "/work/runs/m" are one folder, and a resume that spells it another way moves nothing."""
    import os
    return os.path.realpath(cfg.model.ref_path or cfg.model.path)


def ref_path_given(cfg) -> bool:
    """model.ref_path was set (not '' and not filled in from model.path by `Config.resolve`)."""
    return bool(cfg.model.ref_path) and "model.ref_path" not in getattr(cfg, "_derived", {})


def _check_reference(cfg, path: Path, was: str | None) -> None:
    """With KL, model.ref_path '' means the starting policy, model.path: a resume with another
    model.path (the policy's weights come from the checkpoint all the same) moved the reference,
    and the objective changed mid-run without a word. A reference set explicitly is applied."""
    import os
    ref = reference_folder(cfg)
    if cfg.algo.kl_coef == 0 or was is None or ref == os.path.realpath(was) or ref_path_given(cfg):
        return
    raise ValueError(
        f"resuming {path} with model.path={cfg.model.path!r} and algo.kl_coef={cfg.algo.kl_coef} "
        f"would move the KL penalty's reference model from {was!r} (the checkpoint's run's) to "
        f"{ref!r}: model.ref_path='' means model.path, while the policy's weights come from the "
        f"checkpoint. Set --model.ref_path={was} to keep the run's reference, or "
        f"--model.ref_path={ref} if the reference should change (e.g. the same model, moved)")


# What a resume does with a setting that differs from its checkpoint's run's (`resume_changes`):
# how to resume is no setting of the run, and a key missing here is applied from the next step.
_NOT_COMPARED = ("checkpoint.resume", "run.dry_run", "run.dir")  # run.dir: another run's resumed
_KEPT = {"trainer.seed": "its RNG state is restored"}
_SCHEDULE = "the lr schedule keeps its position"
_WHY = {"model.path": "tokenizer and model config; the policy's weights are the checkpoint's",
        "model.dtype": "the checkpoint's weights and optimizer state are cast to it",
        **{f"trainer.{k}": _SCHEDULE for k in ("lr", "max_steps", "warmup_steps", "schedule",
                                                "min_lr_ratio")}}
# made into a group by the generator (sampling) or stored with it (rewards): the groups the
# checkpoint's buffer holds keep what they were made with
_PER_GROUP = tuple(f"generator.{k}" for k in ("max_new_tokens", "temperature", "top_p", "top_k",
                                              "greedy", "stop_token_ids", "seed", "ignore_eos")) + (
    "reward.fn", "reward.timeout_s", "reward.format_weight")


def resume_changes(cfg, extra: dict) -> list[tuple[str, object, object, str, str]]:
    """(key, the checkpoint's run's value, this config's, what happens, why) of every setting that
    differs, in the config's order; what happens: 'applied', 'applied to new groups' or 'kept
    from the checkpoint'. Keys the checkpoint did not record are not compared."""
    saved, now = saved_settings(extra), settings_of(cfg)
    rows = []
    for key, value in now.items():
        if key in _NOT_COMPARED or key not in saved or saved[key] == value:
            continue
        how, why = "applied", _WHY.get(key, "")
        if key in _KEPT:
            how, why = "kept from the checkpoint", _KEPT[key]
        elif key in _PER_GROUP and buffered_groups(extra):
            how = "applied to new groups"
        elif key == "model.ref_path":
            why = (f"the KL reference; unused while algo.kl_coef=0, set --model.ref_path="
                   f"{saved[key]} to keep the run's" if cfg.algo.kl_coef == 0 and
                   not ref_path_given(cfg) else "the KL penalty's reference")
        rows.append((key, saved[key], value, how, why))
    return rows


def resume_changes_line(cfg, path: Path, extra: dict) -> str | None:
    """One line naming every setting changed since the checkpoint's run, and what the resume does
    with each (`resume_changes`); None where none did."""
    rows = resume_changes(cfg, extra)
    if not rows:
        return None
    parts = []
    for how in ("applied", "applied to new groups", "kept from the checkpoint"):
        items = [f"{k} {was!r} -> {now!r}" + (f" ({why})" if why else "")
                 for k, was, now, h, why in rows if h == how]
        if items:
            label = (f"applied to groups generated from now on (the checkpoint's "
                     f"{buffered_groups(extra)} buffered groups keep the old)"
                     if how == "applied to new groups" else how)
            parts.append(f"{label}: {', '.join(items)}")
    return (f"resuming {path} (step {extra['step']}) with settings changed from its run's: "
            + "; ".join(parts))


COMPLETE_FILE = "COMPLETE"


def mark_complete(cfg, steps: int) -> None:
    """Written by the trainer's owner rank once the run has trained `steps` steps and exported."""
    write_atomic(Path(cfg.run.dir, COMPLETE_FILE), json.dumps({"steps": steps}) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` all at once: a crash midway leaves the old file (or none), never
    a truncated one that every relaunch would then fail to read."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def clear_complete(cfg) -> None:
    """A run that starts training in a folder an earlier run completed: that run's marker no longer
    holds (this one may stop early), and left there it made a stopped run exit 0 and its re-run
    do nothing. Every rank has read it by now (`already_complete_line`, before process groups)."""
    Path(cfg.run.dir, COMPLETE_FILE).unlink(missing_ok=True)


def is_complete(cfg) -> bool:
    """The run in cfg.run.dir has trained its trainer.max_steps steps and exported."""
    done = completed_steps(cfg)
    return done is not None and done >= cfg.trainer.max_steps


def already_complete_line(cfg) -> str | None:
    """A finished run relaunched as is (torchrun twice, a requeued SLURM job) does nothing rather
    than replay its last steps from the latest checkpoint and overwrite hf_final: what it says."""
    if not is_complete(cfg) or cfg.checkpoint.resume != "auto":
        return None
    more = ("Raise --trainer.max_steps to train on from its latest checkpoint, or pass a new "
            "--run.dir" if latest_checkpoint(checkpoint_root(cfg)) is not None else
            "It saved no checkpoint to train on from: pass a new --run.dir to run again")
    return (f"run {cfg.run.dir} already completed {completed_steps(cfg)} steps (trainer.max_steps="
            f"{cfg.trainer.max_steps}): nothing to do. {more}")


def completed_steps(cfg) -> int | None:
    """Steps of a run in cfg.run.dir that finished, or None (never finished, or no run there)."""
    path = Path(cfg.run.dir, COMPLETE_FILE)
    return int(json.loads(path.read_text())["steps"]) if path.is_file() else None


def read_extra(path: Path) -> dict:
    return json.loads((path / EXTRA_FILE).read_text())


def generator_state(extra: dict, replica: int) -> dict | None:
    """What generator replica `replica` reported at the cut (None for a checkpoint without it)."""
    return (extra.get("generators") or {}).get(str(replica))


def gather_cut(link, leaders: list[int], step: int,
               stop: bool = False) -> tuple[dict[int, object], list]:
    """Steps 1-2 of the cut (module docstring), on trainer rank 0: send CHECKPOINT(step) to every
    generator leader, and return each one's reply payload and the messages they sent before
    their replies, in order (the groups in them belong in the checkpoint's buffer). A leader
    goes on generating after its reply; what it sends then belongs after the cut, is not
    returned, and stays queued on the link for the next poll: a group shipped after the reply is
    in that reply's in-flight list, so taking it into the buffer would train it twice after a
    resume. `stop`: this is a stop's checkpoint (its leaders' own SIGTERM is then done with)."""
    from trainer.link import Msg

    for leader in leaders:
        link.send(leader, Msg.CHECKPOINT, step, {"stop": True} if stop else None)
    replies, before, after = {}, [], []
    deadline = time.monotonic() + link.timeout_s  # one for all replies, not one per message
    while len(replies) < len(leaders):
        # every type a generator sends (a SHUTDOWN raises): the queue's order is the send order
        m = link.wait_for({Msg.CHECKPOINT, Msg.TRAJECTORIES, Msg.ACK, Msg.STOP, Msg.STATS, Msg.EVALUATING},
                          f"generator states for checkpoint {step} (from {sorted(set(leaders) - set(replies))})",
                          timeout_s=max(deadline - time.monotonic(), 0.0))
        if m.src in replies:
            after.append(m)
        elif m.type == Msg.CHECKPOINT:
            replies[m.src] = m.payload
        else:
            before.append(m)
    link.put_back(after)
    return replies, before


def save(worker, step: int, metrics_row=lambda: None) -> Path:
    """Collective over the trainer mesh: called by every trainer rank after step `step`.
    `metrics_row()`: the owner's row of the step so far, which a resume writes where the run
    died before it did (`MetricsLogger.restore`)."""
    from parallel.checkpoint import save_sharded
    from trainer.link import PeerError
    from trainer.worker import broadcast_json

    t0 = time.perf_counter()
    owner, group = worker.meshes.dims.trainer_rank_list[0], worker.meshes.trainer_group
    sent = None
    if worker.is_owner:
        try:
            sent = {"extra": {**_owner_extra(worker, step), "metrics_row": metrics_row()}}
        except Exception as e:  # the other trainer ranks wait in this broadcast: the cause
            try:
                broadcast_json({"error": f"{type(e).__name__}: {e}"}, owner, group)
            except Exception:  # noqa: BLE001 (the group is gone too: this rank's cause goes up)
                pass
            raise
    sent = broadcast_json(sent, owner, group)
    if "error" in sent:  # (they wait twice as long as the owner's cut: parallel/mesh.py)
        raise PeerError(f"trainer rank {owner} failed in the checkpoint of step {step}: {sent['error']}")
    extra = sent["extra"]
    root = checkpoint_root(worker.cfg)
    path = save_sharded(checkpoint_dir(root, step), worker.model, worker.opt, extra,
                        group=worker.meshes.trainer_group)
    if worker.is_owner:
        _prune(root, worker.cfg.checkpoint.keep_last)
        print(f"checkpoint of step {step} saved to {path} ({time.perf_counter() - t0:.1f}s)",
              flush=True)
    return path


def _prune(root: Path, keep_last: int) -> None:
    """Delete the checkpoints before the last `keep_last` (the owner, after the save's last sync
    point). A file-system error (a network file system's "Directory not empty", a permission) is a
    warning: it killed a run that had just saved a new checkpoint, and the other trainer ranks,
    waiting for the owner in their next collective, failed without the cause. The old folders stay
    on disk; the next save's prune tries again. (A bad keep_last still raises.)"""
    try:
        prune_checkpoints(root, keep_last)
    except OSError as e:
        print(f"warning: could not prune the old checkpoints under {root} (checkpoint.keep_last="
              f"{keep_last}): {type(e).__name__}: {e}. The run goes on and the next checkpoint's "
              "prune tries again; if this repeats, delete them by hand (a folder that lost its "
              ".metadata is no checkpoint any more, and no prune deletes it)",
              file=sys.stderr, flush=True)


def _owner_extra(worker, step: int) -> dict:
    """The checkpoint's `extra.json`, on the trainer's owner rank: the generators' half of the
    cut (`gather_cut`) is collected here."""
    from parallel.checkpoint import rng_state
    return {"step": step, "version": worker.version, "scheduler": worker.sched.state_dict(),
            "generators": worker.collect_generator_states(step), "rng": rng_state(),
            "buffer": worker.buffer.state_dict(), "nonfinite_total": worker.nonfinite_total,
            "settings": settings_of(worker.cfg), "origin": worker.origin}


def load(worker, path: Path) -> dict:
    """Collective over the trainer mesh: restore shards, schedule, buffer and counters."""
    from parallel.checkpoint import load_sharded, set_rng_state

    fresh = [{k: v for k, v in g.items() if k != "params"} for g in worker.opt.param_groups]
    extra = load_sharded(path, worker.model, worker.opt, group=worker.meshes.trainer_group)
    worker.sched.load_state_dict(extra["scheduler"])
    keep_config_hyperparameters(worker.opt, worker.sched, fresh)
    mode = worker.cfg.checkpoint.resume
    worker.origin = extra.get("origin") if mode in ("auto", "never") else origin_of(Path(mode))
    worker.step, worker.version = extra["step"], extra["version"]
    worker.nonfinite_total = worker.nonfinite.total = extra.get("nonfinite_total", 0)
    set_rng_state(extra["rng"])
    if worker.is_owner:
        worker.buffer.load_state_dict(extra["buffer"])
    return extra


def keep_config_hyperparameters(opt, sched, fresh: list[dict]) -> None:
    """After loading an optimizer's state: the settings are this run's config's, not the
    checkpoint's (which `load_state_dict` restores with the state): lr, betas, eps, weight decay
    and the kernel choice (`fused`: FSDP's optimizer was fused, a TP one cannot be; resumed as
    fused, its first step failed). The schedule keeps its position, from the config's lr."""
    import torch
    for group, mine in zip(opt.param_groups, fresh):
        group.update({k: v for k, v in mine.items() if k not in ("lr", "initial_lr")})
        group["initial_lr"] = mine.get("initial_lr", mine["lr"])
    sched.base_lrs = [g["initial_lr"] for g in opt.param_groups]
    for group, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
        if group.get("fused"):  # a non-fused checkpoint left its step counts on the CPU
            for p in group["params"]:
                state = opt.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(p.device, torch.float32)
    sched._last_lr = [g["lr"] for g in opt.param_groups]


def interrupted_line(cfg) -> str:
    """What an interrupted run (Ctrl-C) left behind, and how to go on from it."""
    if cfg is None or cfg.run.dry_run:
        return "interrupted"
    latest = latest_checkpoint(checkpoint_root(cfg))
    if latest is None:
        how = ("colocated mode has no checkpoints: parallel.mode=split can resume"
               if cfg.parallel.mode == "colocated" else
               f"the first is due after step {cfg.checkpoint.every_steps}; a re-run starts over"
               if cfg.checkpoint.every_steps else
               "set --checkpoint.every_steps=N to make a run resumable")
        return f"interrupted: {cfg.run.dir} has no checkpoint to resume from ({how})"
    return (f"interrupted: run the same command again to resume {cfg.run.dir} from its latest "
            f"checkpoint, {latest.name}")


def saved(cfg, step: int) -> bool:
    """A finished checkpoint of `step` is on disk in its own folder (the periodic one, or the one
    resumed from). A `.old` copy that stands for the step (`stand_in`) does not count: a stop
    saves the step again, which puts it back in its own folder."""
    return (checkpoint_dir(checkpoint_root(cfg), step) / ".metadata").is_file()


def stopped_line(cfg, reason: str, step: int, path: Path) -> str:
    """What a run stopped early (SIGTERM, launch/preemption.py) left behind."""
    if step == 0:
        return f"{reason}: stopped before the first step of {cfg.run.dir}; nothing to save"
    return (f"{reason}: stopped after step {step} of {cfg.trainer.max_steps}, checkpoint {path}; "
            f"run the same command again to resume")


def truncate_steps(f: Path, last_step: int) -> None:
    """Drop the lines of a jsonl log (metrics.jsonl, eval.jsonl) whose "step" is after the
    checkpoint's `last_step`: they are redone, so the file's steps stay contiguous. Lines that
    are not whole records go too, with a line saying so: a write cut off (a full disk, a node's
    crash on a network file system) left one, and every resume failed on it (JSONDecodeError)."""
    if not f.is_file():
        return
    keep, torn = [], 0
    for line in f.read_text(errors="replace").splitlines():
        step = _step_of(line)
        torn += step is None and line.strip() != ""
        if step is not None and step <= last_step:
            keep.append(line)
    if torn:
        print(f"{f}: dropped {torn} line(s) that are not whole JSON records with a \"step\" (a "
              "write that was cut off)", file=sys.stderr, flush=True)
    write_atomic(f, "".join(line + "\n" for line in keep))


def logged_steps(f: Path) -> set[int]:
    """The steps of a jsonl log's records (metrics.jsonl, eval.jsonl)."""
    with open(f, encoding="utf-8", errors="replace") as fh:
        return {step for step in map(_step_of, fh) if step is not None}


def _step_of(line: str) -> int | None:
    """The "step" of one jsonl record, or None for a line that is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def maybe_export_hf(cfg, model, step: int, tokenizer, group) -> None:
    """checkpoint.hf_export_every: `<run_dir>/hf/step_NNNNNN`, a Hugging Face folder of the policy
    after `step` (collective over the trainer mesh `group`; pass the tokenizer on one rank, the
    one that reports it)."""
    every = cfg.checkpoint.hf_export_every
    if every and step % every == 0:
        from parallel.checkpoint import export_hf
        t0 = time.perf_counter()
        out = export_hf(model, f"{cfg.run.dir}/hf/step_{step:06d}", tokenizer=tokenizer, group=group)
        if tokenizer is not None:
            print(f"exported the policy after step {step} to {out} "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
