"""Held-out evaluation (config `eval`): which prompts, the greedy scores against a plain forward
loop, the records a run keeps (eval.jsonl, TensorBoard), and what a resumed run redoes."""
import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from config import load_config
from model import load_pretrained
from model.tokenizer import load_tokenizer
from rollout import packed_linear
from rollout.data import HELD_OUT_START, load_held_out, load_prompts
from rollout.engine import Engine, Request, SamplingParams
from rollout.evaluate import PeriodicEval, accuracy
from rollout.rewards import RewardRunner
from rollout.role import build_eval, load_eval_items
from rollout.tasks import make_task
from tools.make_tiny_model import make_random_model

TINY = "configs/tiny_cpu.toml"


def digit_sum_reward(item, text, ids) -> float:
    """Differs between completions (a random policy's greedy ones included): a wrong weight or
    a wrong prompt would change it."""
    return (sum(ids) % 5) / 4


def test_held_out_prompts_are_the_tasks_far_items_or_eval_source(tmp_path):
    cfg = load_config(TINY, ["--eval.num_prompts=5"])
    held = load_held_out(cfg.data, cfg.eval)
    task = make_task("addition", digits=1, seed=cfg.data.seed)
    assert [(it.id, it.prompt, it.answer) for it in held] == [
        (i, task[HELD_OUT_START + i]["prompt"], task[HELD_OUT_START + i]["answer"]) for i in range(5)]
    train = load_prompts(cfg.data.source, num_prompts=5, digits=1)  # training draws from index 0
    assert [it.prompt for it in train] == [task[i]["prompt"] for i in range(5)]
    f = tmp_path / "held.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(3)))
    cfg = load_config(TINY, [f"--eval.source={f}"])
    assert [it.prompt for it in load_held_out(cfg.data, cfg.eval)] == ["0+1=", "1+1=", "2+1="]
    cfg = load_config(TINY, [f"--eval.source={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(ValueError, match=r"eval.source='.*missing.jsonl': prompt file .* does not "
                                         r"exist \(eval.source\)") as err:
        load_held_out(cfg.data, cfg.eval)
    assert "data.source" not in str(err.value)  # the file is eval.source's, not data.source's
    cfg = load_config(TINY, [f"--data.source={f}", "--eval.every_steps=5"])
    with pytest.raises(ValueError, match="is a file, so set eval.source"):
        load_held_out(cfg.data, cfg.eval)
    cfg = load_config(TINY, [f"--data.num_prompts={HELD_OUT_START + 1}"])
    with pytest.raises(ValueError, match="reaches the held-out items"):
        load_held_out(cfg.data, cfg.eval)


def test_eval_of_another_task_takes_its_defaults_and_of_the_training_file_warns(tmp_path, caplog):
    """data's task options go with data's own task only: another synthetic task got training's
    digits (and another reasoning_gym task options it does not take); evaluating on the training
    file is said in a warning."""
    cfg = load_config(TINY, ["--eval.num_prompts=3", "--eval.source=synthetic:reverse",
                             "--data.synthetic_digits=2"])
    reverse = make_task("reverse", seed=cfg.data.seed)  # its default 4 digits, not training's 2
    assert [it.prompt for it in load_held_out(cfg.data, cfg.eval)] == [
        reverse[HELD_OUT_START + i]["prompt"] for i in range(3)]
    cfg = load_config(TINY, ["--eval.num_prompts=3", "--data.synthetic_digits=4"])
    assert all(len(it.prompt.split("+")[0]) == 4 for it in load_held_out(cfg.data, cfg.eval))
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = load_config(TINY, [f"--data.source={f}", f"--eval.source={f}"])
    with caplog.at_level("WARNING", logger="tandem.data"):
        assert len(load_held_out(cfg.data, cfg.eval)) == 1
    assert "eval.source is data.source" in caplog.text and "training prompts" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                    reason="reasoning_gym not installed (optional)")
@pytest.mark.parametrize("task, given", [("basic_arithmetic", False), ("leg_counting", False),
                                         ("basic_arithmetic", True)])
def test_reasoning_gym_held_out_prompts_are_not_training_prompts(task, given):
    """Under the seed data.seed + 1, item i of most reasoning_gym tasks was training's item
    i + 1: every held-out prompt was a training one. Seeded apart by HELD_OUT_START, none is,
    whether eval.source is derived or names the training task itself."""
    source = f"reasoning_gym:{task}"
    cfg = load_config(TINY, [f"--data.source={source}", "--data.num_prompts=300",
                             "--eval.num_prompts=50", f"--eval.source={source if given else ''}"])
    train = {it.prompt for it in load_prompts(cfg.data.source, num_prompts=300, seed=cfg.data.seed)}
    held = [it.prompt for it in load_held_out(cfg.data, cfg.eval)]
    assert len(held) == 50 and len(set(held)) > 40 and not set(held) & train
    shifted = load_prompts(cfg.data.source, num_prompts=50, seed=cfg.data.seed + 1)
    assert {it.prompt for it in shifted} <= train  # what seed + 1 gave


def _greedy_by_hand(model, prompt_ids, max_new, eos) -> list[int]:
    """Greedy decoding by full forwards, no cache, no engine: the reference."""
    ids = list(prompt_ids)
    for _ in range(max_new):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(nxt)
        if nxt in eos:
            break
    return ids[len(prompt_ids):]


@pytest.fixture
def setup(tmp_path):
    folder = make_random_model(tmp_path / "model", hidden=32, seed=3)
    cfg = load_config(TINY, [f"--model.path={folder}", f"--run.dir={tmp_path / 'run'}",
                             "--eval.every_steps=3", "--eval.num_prompts=12", "--trainer.max_steps=7",
                             "--generator.num_slots=5", "--eval.max_new_tokens=4"])
    model = load_pretrained(folder, dtype="float32").eval()
    tok = load_tokenizer(folder)
    rewards = RewardRunner(digit_sum_reward, timeout_s=5.0)
    yield cfg, model, tok, rewards
    rewards.close()


def test_generation_config_eos_ids_end_training_and_evaluation_completions(setup):
    """A chat model's generation_config.json may list extra EOS ids (Llama 3 Instruct's
    <|eot_id|>): HF generate stops on them, so training and evaluation requests do too (they ran
    to max_new_tokens); generator.ignore_eos drops them with the EOS."""
    import transformers

    from rollout.evaluate import greedy_rewards
    from rollout.worker import sampling_params, stop_token_ids
    cfg, model, tok, _ = setup
    folder = Path(cfg.model.path)
    run = lambda params: Engine(model, num_slots=2, max_len=40).generate(  # noqa: E731
        [Request(0, prompt, params)])[0]
    for text in ("3", "12+34=", "0+0=", "7"):  # a prompt whose greedy start is not EOS
        prompt = tok.encode(text, add_bos=True)
        free = run(SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)).completion_ids
        if tok.eos_id not in free[:3]:
            break
    cut = next(i for i in range(1, 3) if free[i] not in free[:i])  # its first new token
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id,
                                                                                free[cut]]}))
    tok = load_tokenizer(folder)
    cfg = load_config(TINY, [f"--model.path={folder}", "--generator.greedy=true",
                             "--generator.max_new_tokens=8", "--generator.n_samples=1"])
    done = run(sampling_params(cfg, tok))
    assert done.completion_ids == free[:cut + 1] and done.finish_reason == "stop"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          pad_token_id=tok.pad_id)[0, len(prompt):]
    assert ref.tolist() == done.completion_ids
    evaluated, _ = greedy_rewards(Engine(model, num_slots=2, max_len=40), ["item"], [prompt],
                                  lambda its, d: [0.0] * len(d), 8, stop_token_ids(cfg, tok))
    assert evaluated[0].completion_ids == done.completion_ids
    cfg = load_config(TINY, ["--generator.ignore_eos=true", "--generator.stop_token_ids=[5]"])
    assert stop_token_ids(cfg, tok) == [5]


def _evaluator(cfg, model, tok, rewards, pack=False, stack=None, **kw):
    rollout_engine = Engine(model, num_slots=cfg.generator.num_slots, max_len=64, pack_weights=pack,
                            stack_weights=stack)
    return build_eval(cfg, rollout_engine, tok, rewards, **kw)


@pytest.mark.parametrize("pack, stack", [(False, None), (True, None), (False, True)],
                         ids=["plain", "packed", "stacked"])
def test_periodic_eval_scores_greedy_completions_like_a_plain_forward_loop(setup, pack, stack):
    cfg, model, tok, rewards = setup
    if pack and not packed_linear.available():
        pytest.skip("this torch build has no oneDNN packed linears")
    ev = _evaluator(cfg, model, tok, rewards, pack, stack, writer=True)
    assert ev.engine.num_slots == 5  # at most generator.num_slots: the 12 prompts in 3 rounds
    # the rollout engine's packed and stacked weights, shared (no third copy of the weights)
    assert (ev.engine.packed_weights is not None) == pack
    assert (ev.engine.stacked_weights is not None) == bool(stack)
    if stack:  # shared, not a copy of its own
        main = Engine(model, num_slots=2, max_len=64, stack_weights=True)
        assert build_eval(cfg, main, tok, rewards, writer=False).engine.stacked_weights is main.stacked_weights
    recs = [ev.maybe_run(v) for v in range(9)]
    assert [v for v, r in enumerate(recs) if r] == [0, 3, 6, 7]  # every 3rd, and the final one
    items, _, encode = load_eval_items(cfg, tok)
    done = [_greedy_by_hand(model, encode(it), 4, set(model.args.eos_ids)) for it in items]
    scores = [digit_sum_reward(it, tok.decode(c), c) for it, c in zip(items, done)]
    assert len(set(scores)) > 1  # a discriminating reward, or this test could not fail
    assert recs[0]["reward_mean"] == pytest.approx(sum(scores) / len(scores))
    assert recs[0]["completion_tokens_mean"] == pytest.approx(sum(map(len, done)) / len(done))
    assert recs[0]["prompts"] == 12
    # the same weights, the same scores (what changes between versions is the model)
    assert recs[3]["reward_mean"] == recs[0]["reward_mean"]
    assert ev.engine.version == 7  # each evaluation takes the version's weights (load_weights)
    lines = [json.loads(ln) for ln in open(f"{cfg.run.dir}/eval.jsonl")]
    assert lines == [r for r in recs if r]
    ev.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(f"{cfg.run.dir}/tb/eval")
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/reward_mean")] == [0, 3, 6, 7]


def test_accuracy_is_the_same_score(setup):
    cfg, model, tok, _ = setup
    items = load_held_out(cfg.data, cfg.eval)
    done = [_greedy_by_hand(model, tok.encode(it.prompt, add_bos=True), 4, set(model.args.eos_ids))
            for it in items]
    want = sum(digit_sum_reward(it, "", c) for it, c in zip(items, done)) / len(items)
    assert accuracy(model, tok, items, digit_sum_reward, 4, num_slots=5) == pytest.approx(want)


def test_accuracy_completions_reach_max_new_tokens(setup):
    """The engine's max_len was a fixed 256: with max_new_tokens=300 every completion that did
    not stop was cut at 256 - its prompt's length, and the score taken on those (the demo's
    before/after with a long generator.max_new_tokens)."""
    cfg, model, tok, _ = setup
    items = load_prompts("synthetic:addition", num_prompts=2, digits=2)
    lengths = []

    def length(it, text, ids):
        lengths.append(len(ids))
        return float(len(ids))
    got = accuracy(model, tok, items, length, 300, num_slots=2)
    assert max(lengths) == 300  # this random policy does not stop on one of them
    assert got == accuracy(model, tok, items, length, 300, num_slots=2, max_len=400)


def test_accuracy_renders_prompts_as_training_does(setup):
    """With chat_template=True the prompts go through the tokenizer's chat template
    (`render_prompt`, as data.chat_template has training render them), and the completions stop
    on the ids given: the same score as greedy decoding of those ids by hand."""
    from model.tokenizer import HFTokenizer
    from rollout.data import render_prompt
    cfg, model, tok, _ = setup
    hf = copy.deepcopy(tok.hf)  # the fixture's tokenizer stays as it is
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}={% endif %}")
    chat = HFTokenizer(hf)
    items = load_held_out(cfg.data, cfg.eval)
    rendered = [render_prompt(it, chat, chat_template=True) for it in items]
    assert rendered[0] != chat.encode(items[0].prompt, add_bos=True)  # the template's "=" too
    stops = {5, *model.args.eos_ids}
    done = [_greedy_by_hand(model, ids, 4, stops) for ids in rendered]
    want = sum(digit_sum_reward(it, "", c) for it, c in zip(items, done)) / len(items)
    got = accuracy(model, chat, items, digit_sum_reward, 4, num_slots=5, chat_template=True,
                   stop_token_ids=sorted(stops))
    assert got == pytest.approx(want)


def test_a_resumed_run_redoes_the_records_from_its_version(setup):
    cfg, model, tok, rewards = setup
    ev = _evaluator(cfg, model, tok, rewards, writer=True)
    for v in range(8):
        ev.maybe_run(v)
    ev.close()
    # resumed from the checkpoint of version 3: its evaluation and the later ones are redone
    again = _evaluator(cfg, model, tok, rewards, writer=True, start_version=3)
    steps = lambda: [json.loads(ln)["step"] for ln in open(f"{cfg.run.dir}/eval.jsonl")]  # noqa: E731
    assert steps() == [0]
    for v in range(3, 8):
        again.maybe_run(v)
    again.close()
    assert steps() == [0, 3, 6, 7]
    # a follower rank (writer=False) evaluates alike and writes nothing
    _, _, encode = load_eval_items(cfg, tok)
    follower = PeriodicEval(cfg, again.engine, again.items, encode, tok, rewards, writer=False)
    recorded = json.loads(open(f"{cfg.run.dir}/eval.jsonl").readlines()[2])
    assert follower.maybe_run(6)["reward_mean"] == recorded["reward_mean"]
    assert steps() == [0, 3, 6, 7]
    # the finished run trained on (max_steps 7 -> 10): version 7 is no longer due, so its final
    # evaluation is kept, not dropped for a redo that never comes
    longer = copy.deepcopy(cfg)
    longer.trainer.max_steps = 10
    on = _evaluator(longer, model, tok, rewards, writer=True, start_version=7)
    assert steps() == [0, 3, 6, 7]
    for v in range(7, 11):
        on.maybe_run(v)
    on.close()
    assert steps() == [0, 3, 6, 7, 9, 10]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_eval_follows_replaced_parameters(tmp_path):
    """Zero-copy weight sync replaces the generator's parameter tensors: the evaluation engine's
    CUDA graphs, captured over the old ones, must not replay them (bench/gpu_check.sh runs this)."""
    folder = make_random_model(tmp_path / "model", hidden=64, seed=1)
    cfg = load_config(TINY, [f"--model.path={folder}", f"--run.dir={tmp_path / 'run'}",
                             "--eval.every_steps=1", "--eval.num_prompts=8",
                             "--generator.decode=cudagraph", "--eval.max_new_tokens=4"])
    model = load_pretrained(folder, dtype="float32").cuda().eval()
    tok = load_tokenizer(folder)
    rewards = RewardRunner(digit_sum_reward, timeout_s=5.0)
    rollout_engine = Engine(model, num_slots=8, max_len=64, compile_decode="cudagraph")
    ev = build_eval(cfg, rollout_engine, tok, rewards, writer=False)
    first = ev.maybe_run(0)
    torch.manual_seed(5)
    for p in model.parameters():  # new tensors, as a zero-copy swap leaves them
        p.data = torch.randn_like(p) * p.detach().std()
    got = ev.maybe_run(1)
    fresh = build_eval(cfg, Engine(model, num_slots=8, max_len=64), tok, rewards, writer=False)
    want = fresh.maybe_run(1)
    rewards.close()
    key = lambda r: (r["reward_mean"], r["completion_tokens_mean"])  # noqa: E731
    assert key(first) != key(want), "the new weights must change the scores, or this cannot fail"
    assert key(got) == key(want)
