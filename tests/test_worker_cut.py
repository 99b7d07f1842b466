"""A generator replica's checkpoint cut (rollout/worker.py `_cut`) and its resume: every prompt
that was in flight is regenerated with its own start index (and so its seed), also when the cut
is taken while a resumed run has not yet admitted them again."""
import concurrent.futures
import types

import pytest

from model import load_pretrained
from rollout.data import PromptItem, PromptSource
from rollout.engine import Engine
from rollout.worker import GeneratorWorker
from tools.make_tiny_model import make_random_model
from trainer.link import Message, Msg

ns = types.SimpleNamespace


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_random_model(tmp_path_factory.mktemp("m"), hidden=32)
    return load_pretrained(folder, dtype="float32").eval()


class _Link:
    def __init__(self, inbox=()):
        self.inbox, self.sent = list(inbox), []

    def poll(self):
        out, self.inbox = self.inbox, []
        return out

    def send(self, dst, kind, version, payload=None):
        self.sent.append((kind, version, payload))


def _worker(model, link):
    cfg = ns(trainer=ns(prompts_per_step=2), parallel=ns(gen_dp=1), algo=ns(max_staleness=1),
             generator=ns(max_new_tokens=3, temperature=1.0, top_p=1.0, top_k=0, greedy=False,
                          n_samples=2, stop_token_ids=[], ignore_eos=True, seed=0))
    items = [PromptItem(id=i, prompt=f"p{i}", messages=None, answer="") for i in range(10)]

    def reward(item, text, ids):
        f = concurrent.futures.Future()
        f.set_result(0.0)
        return f
    engine = Engine(model, num_slots=4, max_len=32)
    engine.load_weights = lambda apply, version: None  # no trainer: the weights stay as they are
    return GeneratorWorker(cfg, engine, PromptSource(items, seed=0), ns(decode=str),
                           ns(submit=reward), link, ns(receive=lambda v: None), 0, 0,
                           encode=lambda it: [1, 5 + it.id, 7])


def _admitted(w):
    return [(p.item.id, p.index) for p in w.pending.values()]


def test_a_cut_before_the_resumed_prompts_are_admitted_keeps_them(model):
    first = _worker(model, _Link())
    first._admit()  # the gate lets 4 groups start (2 a step, eta 1); none finishes
    cut = first._cut()
    inflight = _admitted(first)
    assert len(inflight) == 4 and cut["started"] == 4
    # resumed from that cut, its first poll holds the resume's weights and the next checkpoint:
    # the cut is taken before the in-flight prompts are admitted again
    link = _Link([Message(Msg.WEIGHTS_READY, 0, 1), Message(Msg.CHECKPOINT, 1, 1)])
    second = _worker(model, link)
    second.resume(cut, 0)
    second._handle(second._poll())
    again = next(p for kind, _, p in link.sent if kind == Msg.CHECKPOINT)
    assert again["started"] == 4 and [tuple(x) for x in again["inflight"]] == inflight
    # a run resumed from the second cut regenerates the same prompts with the same indices
    third = _worker(model, _Link())
    third.resume(again, 0)
    third.version = 0
    third._admit()
    assert _admitted(third)[:4] == inflight
    assert third.started == 4  # then new prompts from start index 4 on
