"""Prompt datasets: loading, validation, length filtering, rendering to ids, sharded iteration.

Flow on a generator rank:

    items = load_prompts(cfg.data.source, ...)                     # list[PromptItem], ids 0..N-1
    encode = lambda it: render_prompt(it, tokenizer, cfg.data.chat_template)
    items, n_skipped = filter_by_length(items, encode, cfg.data.max_prompt_len)
    source = PromptSource(items, seed=cfg.data.seed).shard(dp_rank, dp_size)
    batch = source.next_batch(k)                                   # stable ids, resumable cursor

Prompts become ids exactly once (`render_prompt`); completions are never decoded and re-encoded.
"""
from __future__ import annotations

import decimal
import hashlib
import json
import logging
import math
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

logger = logging.getLogger("tandem.data")

SYNTHETIC_DEFAULT_SIZE = 10_000   # items of a synthetic task when num_prompts = 0
HELD_OUT_START = 500_000  # a synthetic task's held-out items start here; training draws from 0
REASONING_GYM_DEFAULT_SIZE = 1_000
SOURCE_FORMS = "'synthetic:<task>', 'reasoning_gym:<task>', a .jsonl file or a .parquet file"


@dataclass
class PromptItem:
    """One prompt. Exactly what the reward needs to judge a completion: `answer` and `meta`.

    `prompt` (raw text) or `messages` (chat turns, [{"role", "content"}]) is set, or both.
    `id` is stable: the same prompt has the same id on every rank, epoch and resume.
    """

    id: int
    prompt: str | None
    messages: list[dict] | None
    answer: str
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.prompt is None and self.messages is None:
            raise ValueError(f"PromptItem {self.id} has neither prompt nor messages")


# ---------------------------------------------------------------------------------------------
# loading


def load_prompts(source: str, *, prompt_field: str = "prompt", messages_field: str = "messages",
                 answer_field: str = "answer", num_prompts: int = 0, seed: int = 0,
                 start: int = 0, key: str = "data.source", **source_kwargs) -> list[PromptItem]:
    """Load prompts from `source` (see SOURCE_FORMS). Ids are 0..N-1 in source order.

    num_prompts: keep the first N (0 = all; synthetic sources are infinite, so 0 means
        SYNTHETIC_DEFAULT_SIZE, and reasoning_gym generates REASONING_GYM_DEFAULT_SIZE).
    seed: generation seed of synthetic and reasoning_gym sources (files are read in order).
    start: a synthetic task's first item (`HELD_OUT_START` for held-out prompts); ids stay 0..N-1.
    source_kwargs: task parameters, e.g. digits=3 for synthetic:addition or a reasoning_gym
        dataset option; files take none.
    The *_field names choose the columns of .jsonl/.parquet records; `key` is the setting that
    named the source, for the messages (eval.source's file is not data.source's).
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0 (0 = all), got {num_prompts}")
    kind, _, name = source.partition(":")
    if kind == "synthetic" and name:
        return _load_synthetic(name, num_prompts, seed, source_kwargs, start)
    if kind == "reasoning_gym" and name:
        return _load_reasoning_gym(name, num_prompts, seed, source_kwargs)
    path = Path(source)
    if path.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"prompt source {source!r} is not one of {SOURCE_FORMS}")
    if source_kwargs:
        raise ValueError(f"prompt file {source!r} takes no task parameters, got "
                         f"{sorted(source_kwargs)}; leave data.task_options empty for files")
    if not path.is_file():
        where = "" if path.is_absolute() else f", looked for {path.absolute()}"
        raise ValueError(f"prompt file {str(path)!r} does not exist ({key}{where}); give the "
                         f"path of a .jsonl/.parquet file, absolute or relative to the directory "
                         f"train_rl.py runs in (launch/run_local.sh: the repository's root)")
    records = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    fields = (prompt_field, messages_field, answer_field)
    items = []
    for where, record in records:
        items.append(_record_to_item(record, len(items), where, path, fields))
        if num_prompts and len(items) == num_prompts:
            break
    if not items:
        raise ValueError(f"prompt file {str(path)!r} has no records (looked for fields "
                         f"{prompt_field!r}/{messages_field!r} and {answer_field!r}); "
                         f"point {key} at a non-empty file")
    return items


def _load_synthetic(name: str, num_prompts: int, seed: int, kwargs: dict,
                    start: int = 0) -> list[PromptItem]:
    from rollout.tasks import make_task

    task = make_task(name, seed=seed, **kwargs)
    n = num_prompts or (task.size if task.size is not None else SYNTHETIC_DEFAULT_SIZE)
    meta = {"source": f"synthetic:{name}", "task": name, "reward": task.default_reward}
    items = []
    for i in range(n):
        it = task[start + i]
        items.append(PromptItem(id=i, prompt=it["prompt"], messages=None, answer=it["answer"],
                                meta=dict(meta)))
    return items


def load_held_out(data, ev, warn: bool = True) -> list[PromptItem]:
    """The prompts of an evaluation (`config.EvalConfig` ev, `config.DataConfig` data): those of
    `ev.source` in data's fields, else of `data.source`. A task's prompts (given or derived) come
    from its held-out part, items training never draws: a synthetic task's from HELD_OUT_START
    on, a reasoning_gym task's under the seed data.seed + HELD_OUT_START. Most reasoning_gym
    tasks make item i from Random(seed + i), so those are the training seed's items from
    HELD_OUT_START on too (under seed + 1 every one was a training item: item i was training's
    i + 1)."""
    source, seed = ev.source or data.source, data.seed
    kind = source.partition(":")[0]
    is_task = kind in ("synthetic", "reasoning_gym")
    if not ev.source and not is_task:
        raise ValueError(f"eval.every_steps={ev.every_steps} needs held-out prompts: data.source "
                         f"{data.source!r} is a file, so set eval.source to a .jsonl/.parquet file "
                         "of prompts kept out of training")
    if is_task and source == data.source and data.num_prompts > HELD_OUT_START:
        raise ValueError(f"data.num_prompts={data.num_prompts} reaches the held-out items of "
                         f"{data.source} (from {HELD_OUT_START} on); use at most "
                         f"{HELD_OUT_START} training prompts, or set eval.source")
    if kind == "reasoning_gym":
        seed += HELD_OUT_START
    if not is_task and source == data.source and warn:
        logger.warning("eval.source is data.source (%s): the held-out score is taken on training "
                       "prompts", source)
    # data's task options go with data's own task only (another task has its own parameters; a
    # file takes none)
    try:
        return load_prompts(source, prompt_field=data.prompt_field,
                            messages_field=data.messages_field, answer_field=data.answer_field,
                            num_prompts=ev.num_prompts, seed=seed,
                            start=HELD_OUT_START if kind == "synthetic" else 0,
                            key="eval.source" if ev.source else "data.source",
                            **(task_options(data) if is_task and source == data.source else {}))
    except ValueError as e:
        if ev.source:  # which setting the file or task came from
            raise ValueError(f"eval.source={ev.source!r}: {e}") from None
        raise


_LOADER_KEYS = {"seed": "data.seed", "num_prompts": "data.num_prompts", "start": None,
                "size": "data.num_prompts",  # reasoning_gym's create_dataset(size=...)
                "prompt_field": "data.prompt_field", "messages_field": "data.messages_field",
                "answer_field": "data.answer_field", "source": "data.source"}


def task_options(data) -> dict:
    """The task parameters of `config.DataConfig` data: a synthetic task's digits, then
    data.task_options (which may override them). Keys that the loader itself takes are refused:
    data.task_options={seed=5} used to crash the loader, {start=500000} made training draw
    the held-out items, and a reasoning_gym {size=5000} failed as create_dataset's "multiple
    values for keyword argument 'size'"."""
    taken = sorted(set(data.task_options) & set(_LOADER_KEYS))
    if taken:
        fixes = [f"{k}: set by {_LOADER_KEYS[k]}" if _LOADER_KEYS[k] else f"{k}: the loader's own"
                 for k in taken]
        raise ValueError(f"data.task_options has key(s) {taken} that are not task parameters "
                         f"({'; '.join(fixes)}); remove them from data.task_options")
    digits = {"digits": data.synthetic_digits} if data.source.startswith("synthetic:") else {}
    return {**digits, **data.task_options}


def _load_reasoning_gym(name: str, num_prompts: int, seed: int, kwargs: dict) -> list[PromptItem]:
    """reasoning_gym entries are {"question", "answer", "metadata"}; the whole entry and the task
    options are kept in meta["reasoning_gym"], so that the "reasoning_gym" reward calls the
    task's own scorer, as configured."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError(f"source 'reasoning_gym:{name}' needs the optional package reasoning_gym; "
                         f"install it with `pip install reasoning-gym==0.1.25` (the version "
                         f"requirements-test.txt pins and the tests cover)") from e
    size = num_prompts or REASONING_GYM_DEFAULT_SIZE
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
    except Exception as e:  # unknown name (KeyError/ValueError) or a bad option (TypeError, ...)
        raise ValueError(f"reasoning_gym could not create dataset {name!r} with size={size}, "
                         f"seed={seed}, options={kwargs}: {type(e).__name__}: {e}") from e
    items = []
    for i in range(size):
        entry = dataset[i]
        answer = "" if entry.get("answer") is None else str(entry["answer"])
        items.append(PromptItem(id=i, prompt=str(entry["question"]), messages=None, answer=answer,
                                meta={"source": f"reasoning_gym:{name}", "reward": "reasoning_gym",
                                      "reasoning_gym": {"task": name, "entry": entry,
                                                        "options": dict(kwargs)}}))
    return items


def _read_jsonl(path: Path) -> Iterable[tuple[str, object]]:
    """Yield ("file:line", record) for every non-blank line (UTF-8, a leading BOM allowed; lines
    end in \\n, \\r\\n or \\r). Read as bytes, so that a byte that is not UTF-8 is named by line."""
    lineno = 0
    with path.open("rb") as f:
        for chunk in f:  # split at \\n: a file whose lines end in \\r alone is one chunk
            for raw in chunk.splitlines():
                lineno += 1
                yield from _jsonl_record(path, lineno, raw)


def _jsonl_record(path: Path, lineno: int, raw: bytes) -> Iterable[tuple[str, object]]:
    try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                         f"{e.start + 1}); save the file as UTF-8") from None
    if not line.strip():
        return
    try:
        yield f"{path}:{lineno}", json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                         f"every line of a .jsonl file must be one JSON object") from e


def _read_parquet(path: Path) -> Iterable[tuple[str, object]]:
    """Yield ("file row N", record) for every row. pyarrow is imported only here."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"reading {path} needs pyarrow, which is not installed; "
                         f"`pip install pyarrow`, or convert the file to .jsonl") from e
    import pyarrow as pa
    table = pq.read_table(str(path))
    narrow = {f.name: "e" if pa.types.is_float16(f.type) else "f" for f in table.schema
              if pa.types.is_float16(f.type) or pa.types.is_float32(f.type)}
    for i, record in enumerate(table.to_pylist()):
        for name, fmt in narrow.items():
            if record[name] is not None:
                record[name] = _as_written(record[name], fmt)
        yield f"{path} row {i}", record


def _as_written(x: float, fmt: str) -> float:
    """A float32 (`fmt` "f") or float16 ("e") value as the shortest decimal that reads back as
    it: an answer column of float32 0.1 became the answer "0.10000000149011612" (pyarrow gives
    the float64 of the same bits), which exact_match never matched."""
    if not math.isfinite(x):
        return x
    for digits in range(1, 18):
        short = float(f"{x:.{digits}g}")
        if struct.unpack(fmt, struct.pack(fmt, short))[0] == x:
            return short
    return x


def _record_to_item(record, index: int, where: str, path: Path,
                    fields: tuple[str, str, str]) -> PromptItem:
    """Validate one record and make it PromptItem `index`; errors name file:line and the field."""
    prompt_field, messages_field, answer_field = fields
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt, messages = record.get(prompt_field), record.get(messages_field)
    if prompt is None and messages is None:
        raise ValueError(
            f"{where}: record has neither prompt field {prompt_field!r} nor messages field "
            f"{messages_field!r} (its keys: {sorted(record)}); set data.prompt_field or "
            f"data.messages_field to the name this file uses")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}: prompt field {prompt_field!r} must be a string, "
                         f"got {type(prompt).__name__}")
    if messages is not None:
        _check_messages(messages, where, messages_field)
    answer = record.get(answer_field)
    if answer_field not in record:
        raise ValueError(f"{where}: record lacks answer field {answer_field!r} (its keys: "
                         f"{sorted(record)}); set data.answer_field to the name this file uses")
    if answer is None:
        raise ValueError(f"{where}: answer field {answer_field!r} is null; give every prompt its "
                         f"answer (a string or a number), or leave the record out")
    if isinstance(answer, decimal.Decimal):  # a Parquet decimal column (SQL exports)
        answer = _decimal_answer(answer, where, answer_field)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: answer field {answer_field!r} must be a string or a number, "
                         f"got {type(answer).__name__}")
    if isinstance(answer, float):  # a JSON number: 2.0 is the number 2 (exact_match reads "2")
        if not math.isfinite(answer):
            raise ValueError(f"{where}: answer field {answer_field!r} is {answer}; give a finite "
                             f"number or a string")
        answer = int(answer) if answer.is_integer() else answer
    extra = {k: v for k, v in record.items() if k not in fields}
    meta = {"source": str(path), "where": where, "record": extra}
    return PromptItem(id=index, prompt=prompt, messages=messages, answer=str(answer), meta=meta)


def _decimal_answer(d: decimal.Decimal, where: str, answer_field: str) -> int | str:
    """A Parquet decimal as the number it is: 7 for 7.00, "7.5" for 7.50 (not "7.50")."""
    if not d.is_finite():
        raise ValueError(f"{where}: answer field {answer_field!r} is {d}; give a finite number "
                         f"or a string")
    return int(d) if d == d.to_integral_value() else format(d.normalize(), "f")


def _check_messages(messages, where: str, messages_field: str) -> None:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise ValueError(f"{where}: messages field {messages_field!r} must be a non-empty list of "
                         f'{{"role": str, "content": str}} objects, got {messages!r:.200}')
    if messages[-1]["role"] == "assistant":  # SFT-style data: the reply (often the answer) would
        # sit in the prompt, and the policy would be asked for a second reply after it
        raise ValueError(f"{where}: messages field {messages_field!r} ends with an assistant turn "
                         f"({messages[-1]['content']!r:.80}); a prompt ends with the turn the "
                         f"policy answers: drop the assistant turn (its answer goes in the answer "
                         f"field)")


# ---------------------------------------------------------------------------------------------
# rendering and length filter


def render_prompt(item: PromptItem, tokenizer, chat_template: bool) -> list[int]:
    """The prompt ids of `item`, the only place prompt text becomes tokens.

    chat_template=True: `item.messages` (or the prompt as one user turn) through the tokenizer's
    chat template, with the generation prompt appended. Otherwise the raw prompt text.
    BOS is prepended when the tokenizer's own default encoding does so (`add_bos_default`) and
    the text does not already start with it (chat templates usually write it themselves).
    """
    if chat_template:
        messages = item.messages or [{"role": "user", "content": item.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    elif item.prompt is not None:
        text = item.prompt
    else:
        raise ValueError(f"prompt {item.id} ({item.meta.get('where', item.meta.get('source'))}) "
                         f"has only chat messages; set data.chat_template = true to render them")
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_id
    if tokenizer.add_bos_default and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids


def _where(item: PromptItem) -> str:
    """Where a prompt came from, for errors: its file:line, else its source and index."""
    return item.meta.get("where") or f"{item.meta.get('source', 'prompts')} item {item.id}"


def _encoded(item: PromptItem, encode_fn: Callable[[PromptItem], list[int]]) -> list[int]:
    try:
        ids = encode_fn(item)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 -- a template or tokenizer error, whatever its type
        raise ValueError(f"{_where(item)}: the prompt could not be rendered "
                         f"({type(e).__name__}: {str(e)[:200]}); fix the record, or "
                         "data.chat_template if the template cannot take its turns") from e
    if not ids:
        raise ValueError(f"{_where(item)}: the prompt renders to no tokens (empty text, and this "
                         "tokenizer adds no BOS); drop the record or give it a prompt")
    return ids


def filter_by_length(items: list[PromptItem], encode_fn: Callable[[PromptItem], list[int]],
                     max_prompt_len: int, what: str = "prompts", warn: bool = True,
                     unk_id: int | None = None) -> tuple[list[PromptItem], int]:
    """Drop prompts longer than `max_prompt_len` tokens; returns (kept, number skipped). `what`
    names the set in the messages (the training and the held-out prompts are filtered alike).

    Skips are logged as one warning with the count (`warn`), and so are prompts holding `unk_id`
    (text outside the tokenizer's vocabulary, e.g. a character a character-level tokenizer lacks:
    the model sees <unk> there, not the text). If nothing fits, that is a configuration
    error, and the message says how long the shortest prompt is. A prompt that cannot be rendered
    (a chat template refusing its turns, text the tokenizer rejects) or renders to no tokens at
    all (an empty prompt without BOS; the engine needs one) is an error naming its record.
    """
    if not items:
        raise ValueError(f"filter_by_length got no {what}; check data.source and data.num_prompts")
    kept, shortest, unknown = [], None, []
    for item in items:
        ids = _encoded(item, encode_fn)
        n = len(ids)
        shortest = n if shortest is None else min(shortest, n)
        if n <= max_prompt_len:
            kept.append(item)
        if unk_id is not None and unk_id in ids:
            unknown.append(item)
    n_skipped = len(items) - len(kept)
    if not kept:
        raise ValueError(
            f"all {len(items)} {what} are longer than data.max_prompt_len={max_prompt_len} "
            f"tokens (the shortest has {shortest}); raise data.max_prompt_len to at least "
            f"{shortest} or use shorter prompts")
    if n_skipped and warn:
        logger.warning("skipped %d of %d %s longer than data.max_prompt_len=%d tokens",
                       n_skipped, len(items), what, max_prompt_len)
    if unknown and warn:
        logger.warning("%d of %d %s hold text outside the tokenizer's vocabulary, which the model "
                       "reads as <unk> (the first: %s); check the tokenizer belongs to this data",
                       len(unknown), len(items), what, _where(unknown[0]))
    blank = [it for it in kept if not it.answer.strip()]
    if blank and warn:  # exact_match pays an empty completion 1.0 there: stopping at once pays
        logger.warning("%d of %d %s have an empty answer (the first: %s): exact_match scores an "
                       "empty completion 1.0 on them; give them their answers, or leave them out",
                       len(blank), len(kept), what, _where(blank[0]))
    return kept, n_skipped


# ---------------------------------------------------------------------------------------------
# sharded, shuffled, resumable iteration


class PromptSource:
    """An endless, epoch-shuffled, sharded stream of prompts with a resumable cursor.

    Each epoch permutes all N items with a seed derived from (seed, epoch); replica `rank` of
    `world` takes positions rank, rank+world, ... of that permutation. So, epoch by epoch, the
    shards are disjoint and together cover the dataset, and every replica computes its own shard
    with no communication. The cursor (epoch, offset) is the whole state.
    """

    def __init__(self, items: list[PromptItem], *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world: int = 1):
        if not items:
            raise ValueError("PromptSource needs at least one prompt; check data.source")
        if not 0 <= rank < world:
            raise ValueError(f"PromptSource needs 0 <= rank < world, got rank={rank}, world={world}")
        if world > len(items):
            raise ValueError(f"{len(items)} prompts cannot feed {world} generator replicas (each "
                             f"needs at least one); use more prompts or fewer replicas")
        self._items = list(items)
        self._by_id = {it.id: it for it in self._items}
        if len(self._by_id) != len(self._items):
            raise ValueError("PromptSource needs unique PromptItem ids; "
                             f"{len(self._items) - len(self._by_id)} duplicates found")
        self.seed, self.shuffle, self.rank, self.world = int(seed), bool(shuffle), rank, world
        self._epoch, self._offset = 0, 0
        self._order = self._epoch_order(0)
        self._fingerprint: str | None = None

    def shard(self, rank: int, world: int) -> "PromptSource":
        """Replica `rank` of `world` over the same (full) item list, cursor at the start."""
        return PromptSource(self._items, seed=self.seed, shuffle=self.shuffle, rank=rank, world=world)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._items)))
        if self.shuffle:
            random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
        return order[self.rank::self.world]

    def __len__(self) -> int:
        """Items per epoch in this shard."""
        return len(self._order)

    @property
    def epoch(self) -> int:
        return self._epoch

    def next_batch(self, k: int) -> list[PromptItem]:
        """The next `k` items of this shard, crossing epoch boundaries as needed."""
        if k < 1:
            raise ValueError(f"next_batch needs k >= 1, got {k}")
        batch = []
        while len(batch) < k:
            if self._offset == len(self._order):
                self._epoch, self._offset = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
            take = min(k - len(batch), len(self._order) - self._offset)
            batch += [self._items[i] for i in self._order[self._offset:self._offset + take]]
            self._offset += take
        return batch

    def lookup(self, ids: Iterable[int]) -> list[PromptItem]:
        """Items by id, e.g. to regenerate the prompts that were in flight at a checkpoint."""
        missing = [i for i in ids if i not in self._by_id]
        if missing:
            raise ValueError(f"unknown prompt ids {missing[:10]} (dataset has {len(self._items)})")
        return [self._by_id[i] for i in ids]

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "offset": self._offset, "seed": self.seed,
                "shuffle": self.shuffle, "rank": self.rank, "world": self.world,
                "num_items": len(self._items), "fingerprint": self.fingerprint}

    @property
    def fingerprint(self) -> str:
        """A digest of the prompt set (ids, prompts, answers, in order), made once: a resume over
        another file of the same length went on silently, the in-flight ids naming other
        prompts and the cursor another order."""
        if self._fingerprint is None:
            h = hashlib.sha1()
            for it in self._items:
                h.update(json.dumps([it.id, it.prompt, it.messages, it.answer],
                                    sort_keys=True, default=str).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next `next_batch` continues exactly where `state` was taken."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "rank", "world", "num_items", "fingerprint"):
            if key == "fingerprint" and key not in state:  # a checkpoint from before it was kept
                continue
            if key == "fingerprint" and state[key] != mine[key]:
                raise ValueError(f"the prompts changed since the checkpoint (as many as then, "
                                 f"but other rows or another order: fingerprint {state[key]} "
                                 f"then, {mine[key]} now); resume with "
                                 f"the prompt file (and data config) the run started with, or "
                                 f"start a new --run.dir")
            if state.get(key) != mine[key]:
                raise ValueError(f"prompt cursor was saved with {key}={state.get(key)!r} but this "
                                 f"source has {key}={mine[key]!r}; resume with the same data "
                                 f"config (data.source/path, task options, filters) and "
                                 f"generator layout, or start a new --run.dir")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        order = self._epoch_order(epoch)
        if not 0 <= offset <= len(order):
            raise ValueError(f"prompt cursor offset {offset} is outside this shard's epoch of "
                             f"{len(order)} items")
        self._epoch, self._offset, self._order = epoch, offset, order
