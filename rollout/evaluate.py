"""Held-out evaluation: greedy completions through the same engine the generator uses, scored by
the run's reward.

`accuracy` scores a model once (the warm start's stopping rule, the demo's before/after).
`PeriodicEval` is the in-run evaluation (config `eval`): generator replica 0 evaluates the policy
of every `eval.every_steps`-th version, version 0 and the final one as it takes those weights,
with an engine of its own over the same model (the rollout engine's slots stay as they are, its
in-flight samples resume after it). The replica's leader writes `<run_dir>/eval.jsonl` (one
object per evaluation: step, reward_mean, prompts, completion_tokens_mean, time_s), TensorBoard
scalars under `<run_dir>/tb/eval` (step = policy version) and one console line.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rollout.data import render_prompt
from rollout.engine import Engine, Request, SamplingParams
from trainer.checkpointing import truncate_steps


def greedy_rewards(engine: Engine, items, prompt_ids, score, max_new_tokens: int,
                   stop_token_ids=(), ignore_eos: bool = False):
    """The greedy completions of `items` (whose token ids are `prompt_ids`) and their rewards:
    `score(items, completions)` returns one float per completion. The stopping rule is the
    training requests' (`rollout.worker.stop_token_ids`, generator.ignore_eos)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, n=1,
                            stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    done = engine.generate([Request(i, ids, params) for i, ids in enumerate(prompt_ids)])
    return done, score([items[c.request_id] for c in done], done)


@torch.no_grad()
def accuracy(model, tokenizer, items, reward_fn, max_new_tokens: int, num_slots: int = 64,
             max_len: int | None = None, chat_template: bool = False,
             stop_token_ids=None) -> float:
    """Mean reward of greedy completions (exact match: the fraction solved). The prompts are
    rendered as training renders them (`rollout.data.render_prompt`, data.chat_template); the
    completions stop on `stop_token_ids` (a run's: `rollout.worker.stop_token_ids`), by default
    the tokenizer's EOS ids. `max_len` (prompt + completion) defaults to the longest prompt plus
    `max_new_tokens`: a fixed 256 cut completions short of max_new_tokens unsaid."""
    if not items:
        raise ValueError("accuracy needs at least one held-out prompt")
    prompt_ids = [render_prompt(it, tokenizer, chat_template) for it in items]
    if max_len is None:
        max_len = max(map(len, prompt_ids)) + max_new_tokens
    engine = Engine(model, num_slots=num_slots, max_len=max_len)

    def score(its, done):
        return [reward_fn(it, tokenizer.decode(c.completion_ids), c.completion_ids)
                for it, c in zip(its, done)]
    stops = tokenizer.stop_ids if stop_token_ids is None else stop_token_ids
    _, rewards = greedy_rewards(engine, items, prompt_ids, score, max_new_tokens, stops)
    return sum(rewards) / len(rewards)


def engine_shape(cfg, n_prompts: int) -> tuple[int, int]:
    """(slots, max_len) of the evaluation engine for `n_prompts` prompts: at most
    generator.num_slots slots, room for the longest prompt and eval's new tokens."""
    max_new = cfg.eval.max_new_tokens or cfg.generator.max_new_tokens
    return min(n_prompts, cfg.generator.num_slots), cfg.data.max_prompt_len + max_new


class PeriodicEval:
    """`eval.every_steps` on one generator replica. Every rank of the replica calls `maybe_run`
    at the same versions (TP ranks decode together); the one built with `writer=True` records.
    `start_version`: the version the run (re)starts from; records of it (where it is due) and
    later are dropped, since they are redone."""

    def __init__(self, cfg, engine: Engine, items, encode, tokenizer, rewards, writer: bool,
                 start_version: int = 0, stop_token_ids=()):
        self.every, self.final = cfg.eval.every_steps, cfg.trainer.max_steps
        self.max_new = cfg.eval.max_new_tokens or cfg.generator.max_new_tokens
        self.stop_ids, self.ignore_eos = list(stop_token_ids), cfg.generator.ignore_eos
        self.engine, self.items, self.tok, self.rewards = engine, items, tokenizer, rewards
        self.prompt_ids = [encode(it) for it in items]
        self.writer = writer
        self.path = Path(cfg.run.dir) / "eval.jsonl"
        self._tb = None
        if writer:
            # the start version is redone only where it is due: a finished run trained on (a
            # higher max_steps) lost its final evaluation for good
            first_redone = start_version if self.due(start_version) else start_version + 1
            truncate_steps(self.path, first_redone - 1)
            if cfg.logging.tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(Path(cfg.run.dir) / "tb" / "eval"),
                                         purge_step=first_redone)

    def due(self, version: int) -> bool:
        return version % self.every == 0 or version == self.final

    def maybe_run(self, version: int) -> dict | None:
        if not self.due(version):
            return None
        t0 = time.perf_counter()
        # the weights are in place already (the rollout engine took them); this drops what this
        # engine derived from the old ones: CUDA graphs over replaced parameters, packed copies
        self.engine.load_weights(lambda: None, version)

        def score(its, done):
            return self.rewards.score_batch(its, [self.tok.decode(c.completion_ids) for c in done],
                                            [c.completion_ids for c in done])
        done, rewards = greedy_rewards(self.engine, self.items, self.prompt_ids, score, self.max_new,
                                       self.stop_ids, self.ignore_eos)
        rec = {"step": version, "reward_mean": sum(rewards) / len(rewards), "prompts": len(rewards),
               "completion_tokens_mean": sum(len(c.completion_ids) for c in done) / len(done),
               "time_s": time.perf_counter() - t0}
        if self.writer:
            self._record(rec)
        return rec

    def _record(self, rec: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for key in ("reward_mean", "completion_tokens_mean"):
                self._tb.add_scalar(f"eval/{key}", rec[key], rec["step"])
            self._tb.flush()
        print(f"eval v{rec['step']} | greedy reward {rec['reward_mean']:.3f} on {rec['prompts']} "
              f"held-out prompts | {rec['completion_tokens_mean']:.1f} tokens each | "
              f"{rec['time_s']:.1f}s", flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()

