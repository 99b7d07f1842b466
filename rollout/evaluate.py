"""Greedy accuracy of a model on held-out prompts, through the same engine the generator uses."""
from __future__ import annotations

import torch

from rollout.engine import Engine, Request, SamplingParams


@torch.no_grad()
def accuracy(model, tokenizer, items, reward_fn, max_new_tokens: int, num_slots: int = 64,
             max_len: int = 256) -> float:
    """Mean reward of greedy completions (exact match: the fraction solved)."""
    if not items:
        raise ValueError("accuracy needs at least one held-out prompt")
    engine = Engine(model, num_slots=num_slots, max_len=max_len)
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, n=1)
    reqs = [Request(i, tokenizer.encode(it.prompt, add_bos=True), params) for i, it in enumerate(items)]
    done = engine.generate(reqs)
    scores = [reward_fn(items[c.request_id], tokenizer.decode(c.completion_ids), c.completion_ids)
              for c in done]
    return sum(scores) / len(scores)
