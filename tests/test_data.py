"""rollout.tasks and rollout.data: synthetic tasks, loading errors, sharding, resume, rendering."""
import dataclasses
import decimal
import importlib.util
import json
import logging
import sys

import pytest

from model.tokenizer import build_char_tokenizer
from rollout.data import (SYNTHETIC_DEFAULT_SIZE, PromptItem, PromptSource, filter_by_length,
                          load_prompts, render_prompt)
from rollout.tasks import AdditionTask, ReverseTask, Task, make_task


# ------------------------------------------------------------------------------------- tasks

def test_addition_task_is_deterministic_and_correct():
    task = AdditionTask(digits=3, seed=7)
    assert isinstance(task, Task) and task.size is None
    for i in (0, 1, 10**9):
        item = task[i]
        assert item == AdditionTask(digits=3, seed=7)[i] and item["id"] == i
        a, b = item["prompt"].rstrip("=").split("+")
        assert int(a) < 1000 and int(b) < 1000 and item["answer"] == str(int(a) + int(b))
        assert set(item["prompt"] + item["answer"]) <= set(task.alphabet)
    assert [AdditionTask(seed=1)[i] for i in range(20)] != [AdditionTask(seed=0)[i] for i in range(20)]
    assert task.make_sft_examples(2, start=5) == [(task[5]["prompt"], task[5]["answer"]),
                                                  (task[6]["prompt"], task[6]["answer"])]


def test_reverse_task_and_make_task_errors():
    item = ReverseTask(digits=5)[3]
    assert item["answer"] == item["prompt"].rstrip(">")[::-1] and len(item["answer"]) == 5
    assert isinstance(make_task("reverse", digits=2), ReverseTask)
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'.*addition"):
        make_task("nope")
    with pytest.raises(ValueError, match="accepts.*digits"):
        make_task("addition", width=3)
    with pytest.raises(ValueError, match="digits >= 1"):
        AdditionTask(digits=0)
    with pytest.raises(IndexError):
        AdditionTask()[-1]


# ------------------------------------------------------------------------------------- loading

def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_load_synthetic():
    items = load_prompts("synthetic:addition", num_prompts=5, seed=3, digits=1)
    assert [it.id for it in items] == list(range(5))
    assert items[2].prompt == AdditionTask(digits=1, seed=3)[2]["prompt"]
    assert items[0].meta["reward"] == "exact_match"
    assert len(load_prompts("synthetic:reverse")) == SYNTHETIC_DEFAULT_SIZE


def test_load_jsonl_prompts_and_messages(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"q": "1+1=", "a": 2, "level": "easy"}, "",
        {"chat": [{"role": "user", "content": "hi"}], "a": "hello"}])
    items = load_prompts(path, prompt_field="q", messages_field="chat", answer_field="a")
    assert [(it.id, it.prompt, it.answer) for it in items] == [(0, "1+1=", "2"), (1, None, "hello")]
    assert items[1].messages == [{"role": "user", "content": "hi"}]
    assert items[0].meta["record"] == {"level": "easy"} and items[1].meta["where"] == f"{path}:3"
    assert len(load_prompts(path, prompt_field="q", messages_field="chat", answer_field="a",
                            num_prompts=1)) == 1


@pytest.mark.parametrize("records, pattern", [
    ([{"prompt": "x", "answer": "1"}, {"question": "y", "answer": "2"}],
     r"p\.jsonl:2: .*neither prompt field 'prompt' nor messages field 'messages'.*question"),
    ([{"prompt": "x"}], r"p\.jsonl:1: record lacks answer field 'answer'.*data.answer_field"),
    ([{"prompt": "x", "answer": "1"}, '{"prompt": "y", '], r"p\.jsonl:2: malformed JSON"),
    ([{"prompt": 3, "answer": "1"}], r"p\.jsonl:1: prompt field 'prompt' must be a string"),
    ([{"messages": [{"role": "user"}], "answer": "1"}], r"p\.jsonl:1: messages field 'messages'"),
    ([{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],
       "answer": "2"}], r"p\.jsonl:1: messages field 'messages' ends with an assistant turn"),
    ([{"prompt": "x", "answer": ["1"]}], r"p\.jsonl:1: answer field 'answer' must be"),
    ([{"prompt": "x", "answer": True}], r"p\.jsonl:1: answer field 'answer' must be"),
    ([{"prompt": "x", "answer": None}], r"p\.jsonl:1: answer field 'answer' is null"),
    (['{"prompt": "x", "answer": NaN}'], r"p\.jsonl:1: answer field 'answer' is nan; give a finite"),
    (["", "  "], r"p\.jsonl' has no records.*'prompt'.*'answer'"),
])
def test_load_jsonl_errors_name_file_line_and_field(tmp_path, records, pattern):
    path = _jsonl(tmp_path / "p.jsonl", records)
    with pytest.raises(ValueError, match=pattern):
        load_prompts(path)


def test_numeric_answers_read_as_numbers(tmp_path):
    """A JSON number has no format of its own: 2.0 is the integer 2 (exact_match compares text)."""
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": 2.0}, {"prompt": "b", "answer": 7},
                                         {"prompt": "c", "answer": 0.25}, {"prompt": "d", "answer": "2.0"}])
    assert [it.answer for it in load_prompts(path)] == ["2", "7", "0.25", "2.0"]


def test_load_jsonl_reads_a_bom_and_names_the_line_of_bytes_not_utf8(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": "2"}\n')
    assert [it.prompt for it in load_prompts(str(path))] == ["x", "y"]  # a BOM (Windows editors)
    for end in (b"\r\n", b"\r"):  # Windows and old Mac line ends, a blank line between
        path.write_bytes(end.join([b'{"prompt": "x", "answer": "1"}', b"", b'{"prompt": "y", "answer": "2"}']))
        assert [it.meta["where"][-2:] for it in load_prompts(str(path))] == [":1", ":3"]
    path.write_bytes(b'{"prompt": "x", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\); save"):
        load_prompts(str(path))


def test_load_source_errors(tmp_path):
    with pytest.raises(ValueError, match=r"prompt file '.*missing.jsonl' does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="is not one of 'synthetic:<task>'"):
        load_prompts(str(tmp_path / "data.csv"))
    with pytest.raises(ValueError, match="takes no task parameters"):
        load_prompts(_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "answer": "1"}]), digits=2)
    with pytest.raises(ValueError, match="num_prompts must be >= 0"):
        load_prompts("synthetic:addition", num_prompts=-1)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    # None in sys.modules makes the import fail as if the package were absent (installed or not)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="p.parquet needs pyarrow.*`pip install pyarrow`"):
        load_prompts(str(tmp_path / "p.parquet"))


def test_reasoning_gym_source_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ValueError, match="'reasoning_gym:basic_arithmetic' needs the optional "
                                         "package reasoning_gym.*`pip install reasoning-gym==0.1.25`"):
        load_prompts("reasoning_gym:basic_arithmetic", num_prompts=2)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed")
def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), str(tmp_path / "p.parquet"))
    items = load_prompts(str(tmp_path / "p.parquet"))
    assert [(it.id, it.prompt, it.answer) for it in items] == [(0, "a", "1"), (1, "b", "2")]
    pq.write_table(pa.table({"prompt": ["a"], "label": ["1"]}), str(tmp_path / "q.parquet"))
    with pytest.raises(ValueError, match=r"q\.parquet row 0: record lacks answer field 'answer'"):
        load_prompts(str(tmp_path / "q.parquet"))
    # a float32 (float16) answer column: the answer as written, not its float64 expansion
    for kind, values, want in (("float32", [0.1, 2.0, 1e-7, 123456.7],
                                ["0.1", "2", "1e-07", "123456.7"]),
                               ("float16", [0.1, 3.5], ["0.1", "3.5"])):
        answers = pa.array(values, type=getattr(pa, kind)())
        pq.write_table(pa.table({"prompt": ["q"] * len(values), "answer": answers}),
                       str(tmp_path / "f.parquet"))
        assert [it.answer for it in load_prompts(str(tmp_path / "f.parquet"))] == want, kind
    # a decimal column (SQL exports) is numbers too: it was refused as "got Decimal"
    answers = pa.array([decimal.Decimal(x) for x in ("7.00", "7.50", "-0.125", "1E+3")],
                       type=pa.decimal128(10, 3))
    pq.write_table(pa.table({"prompt": ["q"] * 4, "answer": answers}), str(tmp_path / "d.parquet"))
    assert [it.answer for it in load_prompts(str(tmp_path / "d.parquet"))] == [
        "7", "7.5", "-0.125", "1000"]


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                    reason="reasoning_gym not installed (optional)")
def test_load_reasoning_gym():
    items = load_prompts("reasoning_gym:basic_arithmetic", num_prompts=3, seed=1)
    assert len(items) == 3 and items[0].prompt and items[0].answer
    assert items[0].meta["reasoning_gym"]["entry"]["answer"] == items[0].answer
    with pytest.raises(ValueError, match="reasoning_gym could not create dataset 'no_such_task'"):
        load_prompts("reasoning_gym:no_such_task", num_prompts=2)
    easy = dict(min_terms=2, max_terms=2, max_digits=1, operators=["+"], allow_parentheses=False,
                allow_negation=False)
    for it in load_prompts("reasoning_gym:basic_arithmetic", num_prompts=20, seed=1, **easy):
        a, b = (int(x) for x in it.prompt.removeprefix("Calculate ").rstrip(".").split(" + "))
        assert 0 <= a <= 10 and 0 <= b <= 10 and it.answer == str(a + b)  # "1 digit": 0..10


def test_role_passes_task_options_to_the_task(tmp_path):
    """data.task_options reach the task (on top of synthetic_digits, which they override), and
    a prompt file refuses them by name."""
    from config import load_config
    from model.tokenizer import build_char_tokenizer
    from rollout.role import load_items
    from rollout.tasks import make_task
    tok = build_char_tokenizer(make_task("addition").alphabet)
    cfg = load_config(None, ["--data.source=synthetic:addition", "--data.num_prompts=30",
                             '--data.task_options={"digits": 3}'])
    items, _, _ = load_items(cfg, tok)
    assert max(len(it.prompt.split("+")[0]) for it in items) == 3
    cfg.data.source = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(ValueError, match=r"takes no task parameters, got \['digits'\]; leave "
                                         r"data.task_options empty for files"):
        load_items(cfg, tok)
    # the loader's own keys are not task parameters: {seed=5} crashed it, {start=500000} made
    # training draw the held-out items
    for options, words in (('{"seed": 5}', r"\['seed'\].*seed: set by data.seed"),
                           ('{"start": 500000}', r"\['start'\].*start: the loader's own"),
                           ('{"size": 50}', r"\['size'\].*size: set by data.num_prompts")):
        cfg = load_config(None, ["--data.source=synthetic:addition", f"--data.task_options={options}"])
        with pytest.raises(ValueError, match="data.task_options has key.*" + words):
            load_items(cfg, tok)


# ------------------------------------------------------------------------------ source/sharding

def _items(n):
    return [PromptItem(id=i, prompt=f"p{i}", messages=None, answer=str(i)) for i in range(n)]


@pytest.mark.parametrize("n, world", [(10, 3), (8, 4), (5, 5), (7, 1)])
def test_shards_are_disjoint_and_cover_every_epoch(n, world):
    source = PromptSource(_items(n), seed=1)
    shards = [source.shard(r, world) for r in range(world)]
    for _ in range(3):  # epochs
        seen = [[it.id for it in s.next_batch(len(s))] for s in shards]
        flat = [i for ids in seen for i in ids]
        assert sorted(flat) == list(range(n))


def test_epochs_reshuffle_and_unshuffled_is_in_order():
    source = PromptSource(_items(20), seed=0)
    first, second = source.next_batch(20), source.next_batch(20)
    assert source.epoch == 1 and [it.id for it in first] != [it.id for it in second]
    ordered = PromptSource(_items(5), shuffle=False).shard(1, 2)
    assert [it.id for it in ordered.next_batch(4)] == [1, 3, 1, 3]


def test_cursor_resume_yields_exactly_the_remaining_sequence():
    items = _items(11)
    reference = PromptSource(items, seed=4).shard(1, 3)
    expected = [it.id for it in reference.next_batch(25)]
    source = PromptSource(items, seed=4).shard(1, 3)
    head = [it.id for it in source.next_batch(7)]
    state = json.loads(json.dumps(source.state_dict()))  # survives a checkpoint file
    resumed = PromptSource(items, seed=4).shard(1, 3)
    resumed.load_state_dict(state)
    assert head + [it.id for it in resumed.next_batch(18)] == expected
    other = PromptSource(items, seed=4).shard(0, 3)
    with pytest.raises(ValueError, match="saved with rank=1 but this source has rank=0"):
        other.load_state_dict(state)
    assert [it.id for it in resumed.lookup([3, 5])] == [3, 5]
    # another prompt set of the same length (an edited or swapped file): it resumed silently
    edited = [dataclasses.replace(it, answer="0") if it.id == 6 else it for it in items]
    with pytest.raises(ValueError, match=r"the prompts changed since the checkpoint \(as many as "
                                         r"then, but other rows or another order: "
                                         r"fingerprint [0-9a-f]{16} then, [0-9a-f]{16} now\); "
                                         r"resume with the prompt file"):
        PromptSource(edited, seed=4).shard(1, 3).load_state_dict(state)
    del state["fingerprint"]  # a cursor from before fingerprints: resumed as before
    PromptSource(items, seed=4).shard(1, 3).load_state_dict(state)


def test_source_errors():
    with pytest.raises(ValueError, match="3 prompts cannot feed 4 generator replicas"):
        PromptSource(_items(3)).shard(0, 4)
    with pytest.raises(ValueError, match="unique PromptItem ids"):
        PromptSource(_items(2) + _items(1))
    with pytest.raises(ValueError, match="0 <= rank < world"):
        PromptSource(_items(2), rank=2, world=2)
    with pytest.raises(ValueError, match="unknown prompt ids"):
        PromptSource(_items(2)).lookup([5])


# ---------------------------------------------------------------------- length filter, rendering

def test_filter_by_length_counts_and_warns(caplog):
    items = [PromptItem(id=i, prompt="x" * i, messages=None, answer="") for i in range(1, 7)]
    encode = lambda it: list(range(len(it.prompt)))  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        kept, skipped = filter_by_length(items, encode, max_prompt_len=4)
    assert [it.id for it in kept] == [1, 2, 3, 4] and skipped == 2
    assert "skipped 2 of 6 prompts" in caplog.text
    with pytest.raises(ValueError, match="max_prompt_len=0.*shortest has 1.*at least 1"):
        filter_by_length(items, encode, max_prompt_len=0)


def test_prompts_with_an_empty_answer_get_one_warning(tmp_path, caplog):
    """An answer of "" (or spaces) loaded without a word, and exact_match paid an empty
    completion 1.0 on it: the policy learnt to stop at once."""
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": " "},
            {"prompt": "3+3=", "answer": ""}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_prompts(str(f))
    encode = lambda it: [1, 2]  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        filter_by_length(items, encode, max_prompt_len=4, what="training prompts")
        filter_by_length(items, encode, max_prompt_len=4, warn=False)  # said once
    assert [r.getMessage() for r in caplog.records] == [
        f"2 of 3 training prompts have an empty answer (the first: {f}:2): exact_match scores an "
        "empty completion 1.0 on them; give them their answers, or leave them out"]


def test_prompts_outside_the_tokenizers_vocabulary_get_one_warning(tmp_path, caplog):
    """A character-level tokenizer reads a character it lacks as <unk>, silently: an addition
    model given the reverse task's '>' (the demo's warm start did that) saw '<unk>' there."""
    from config import load_config
    from model.tokenizer import load_tokenizer
    from rollout.role import load_items
    from tools.make_tiny_model import make_random_model
    folder = make_random_model(tmp_path / "m", hidden=16, layers=1)  # the addition alphabet
    tok = load_tokenizer(folder)
    assert tok.unk_id is not None and tok.unk_id in tok.encode("8>3")
    for source, warned in (("synthetic:addition", False), ("synthetic:reverse", True)):
        cfg = load_config("configs/tiny_cpu.toml", [f"--model.path={folder}", f"--data.source={source}",
                                                    "--data.num_prompts=50"])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tandem.data"):
            load_items(cfg, tok)
            load_items(cfg, tok, warn=False)  # the roles: preflight has said it
        lines = [r.getMessage() for r in caplog.records if "vocabulary" in r.getMessage()]
        assert lines == ([f"50 of 50 training prompts ({source}) hold text outside the tokenizer's "
                          "vocabulary, which the model reads as <unk> (the first: synthetic:reverse "
                          "item 0); check the tokenizer belongs to this data"] if warned else []), lines


def test_the_training_and_held_out_sets_say_which_one_lost_prompts(tmp_path, caplog):
    """Both sets are filtered by data.max_prompt_len; their warnings and errors read alike."""
    from config import load_config
    from model.tokenizer import load_tokenizer
    from rollout.role import load_eval_items, load_items
    from tools.make_tiny_model import make_random_model
    folder = make_random_model(tmp_path / "m", hidden=16, layers=1)
    cfg = load_config("configs/tiny_cpu.toml", [f"--model.path={folder}", "--data.num_prompts=200",
                                                "--data.synthetic_digits=2", "--data.max_prompt_len=6"])
    tok = load_tokenizer(folder)
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        load_items(cfg, tok)
        load_eval_items(cfg, tok)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "training prompts (synthetic:addition) longer than data.max_prompt_len=6" in lines[0]
    assert "held-out prompts (eval) longer than data.max_prompt_len=6" in lines[1]
    with pytest.raises(ValueError, match=r"all 200 training prompts \(synthetic:addition\) are longer"):
        load_items(load_config("configs/tiny_cpu.toml", [f"--model.path={folder}", "--data.num_prompts=200",
                                                         "--data.max_prompt_len=1"]), tok)


def test_filter_by_length_names_a_record_that_renders_to_nothing_or_fails(tmp_path):
    """An empty prompt of a tokenizer without BOS became 0 tokens, passed the length filter and
    crashed the generator when drawn; a template error was a traceback naming no record."""
    items = load_prompts(_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "answer": "1"},
                                                       {"prompt": "", "answer": "2"}]))
    encode = lambda it: list(range(len(it.prompt)))  # noqa: E731
    with pytest.raises(ValueError, match=r"p\.jsonl:2: the prompt renders to no tokens"):
        filter_by_length(items, encode, max_prompt_len=8)

    def template(it):
        raise RuntimeError("Conversation roles must alternate user/assistant")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: the prompt could not be rendered "
                                         r"\(RuntimeError: Conversation roles must alternate"):
        filter_by_length(items, template, max_prompt_len=8)
    synthetic = [PromptItem(id=3, prompt="", messages=None, answer="", meta={"source": "s:t"})]
    with pytest.raises(ValueError, match="s:t item 3: the prompt renders to no tokens"):
        filter_by_length(synthetic, encode, max_prompt_len=8)


def test_render_prompt():
    task = AdditionTask()
    tok = build_char_tokenizer(task.alphabet)
    item = load_prompts("synthetic:addition", num_prompts=1)[0]
    ids = render_prompt(item, tok, chat_template=False)
    assert ids == [tok.bos_id] + tok.encode(item.prompt)  # BOS once, as the tokenizer's default
    assert tok.decode(ids) == item.prompt
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(item, tok, chat_template=True)
    chat_only = PromptItem(id=9, prompt=None, messages=[{"role": "user", "content": "1"}], answer="")
    with pytest.raises(ValueError, match="prompt 9 .*set data.chat_template = true"):
        render_prompt(chat_only, tok, chat_template=False)


def test_render_prompt_with_chat_template_writes_bos_once():
    from model.tokenizer import HFTokenizer

    hf = build_char_tokenizer("0123456789+=:u").hf
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
                        "{% endfor %}{% if add_generation_prompt %}={% endif %}")
    tok = HFTokenizer(hf)
    item = PromptItem(id=0, prompt="1+2", messages=None, answer="3")
    ids = render_prompt(item, tok, chat_template=True)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.decode(ids, skip_special=False) == "<bos>u:1+2="


@pytest.mark.parametrize("digits", [2.5, True, "x", None])
def test_task_digits_must_be_an_integer(digits):
    """data.task_options={"digits": 2.5} ran with 2 digits and {"digits": true} with 1, unsaid;
    "x" failed with int()'s message, naming neither the option nor the task."""
    with pytest.raises(ValueError, match=r"AdditionTask needs an integer digits >= 1, got "
                                         rf"digits={digits!r:.3}.*data.task_options"):
        load_prompts("synthetic:addition", num_prompts=2, digits=digits)
    with pytest.raises(ValueError, match=r"ReverseTask needs an integer digits >= 1"):
        make_task("reverse", digits=digits)
