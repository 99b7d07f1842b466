"""Built-in synthetic tasks with exact verifiers: the data of the CPU demo.

A task is an indexable, usually infinite, source of `{"id", "prompt", "answer"}` dicts. Item `i`
depends only on (task parameters, seed, i), so every rank, every run and every resume sees the same
item for the same index without storing anything. The answers are checked exactly (reward
`default_reward`), and `alphabet` lists every character of prompts and answers, which is all a
character-level tokenizer (`model.tokenizer.build_char_tokenizer`) needs.

    >>> task = AdditionTask(digits=2, seed=0)
    >>> task[0]
    {'id': 0, 'prompt': '30+98=', 'answer': '128'}
"""
from __future__ import annotations

import random
from typing import Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
    """What `rollout.data.load_prompts("synthetic:<name>")` needs from a task."""

    name: str
    size: int | None        # number of items; None = infinite (any index >= 0 is valid)
    alphabet: str           # every character a prompt or an answer can contain
    default_reward: str     # a `rollout.rewards.resolve_reward` spec that verifies the answers

    def __getitem__(self, index: int) -> dict:
        """{"id": index, "prompt": str, "answer": str}."""
        ...


class _SyntheticTask:
    """Shared plumbing: per-index seeding, index checks, supervised examples."""

    name = "synthetic"
    size = None
    alphabet = ""
    default_reward = "exact_match"

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def _rng(self, index: int) -> random.Random:
        # str seeds hash with sha512: stable across processes (unlike hash() of a tuple)
        return random.Random(f"{self.name}:{self.seed}:{index}")

    def __getitem__(self, index: int) -> dict:
        if not isinstance(index, int) or index < 0:
            raise IndexError(f"{type(self).__name__} items are indexed by ints >= 0, got {index!r}")
        prompt, answer = self._make(self._rng(index))
        return {"id": index, "prompt": prompt, "answer": answer}

    def _make(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def make_sft_examples(self, n: int, start: int = 0) -> list[tuple[str, str]]:
        """`n` (prompt, completion) pairs, items start..start+n-1, for a supervised warm start.

        The completion is the bare answer; the trainer appends EOS so the model learns to stop.
        Pick `start` beyond the RL prompt range to keep warm-start and RL items apart.
        """
        if n < 0 or start < 0:
            raise ValueError(f"make_sft_examples needs n >= 0 and start >= 0, got n={n}, start={start}")
        return [(it["prompt"], it["answer"]) for it in (self[i] for i in range(start, start + n))]

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({params})"


def _digits(task: str, digits) -> int:
    """`digits` checked: an int >= 1 (int() took 2.5 as 2 and True as 1 unsaid, and "x" failed
    naming neither the option nor the task)."""
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise ValueError(f"{task} needs an integer digits >= 1, got digits={digits!r} "
                         f"(data.task_options or data.synthetic_digits)")
    return digits


class AdditionTask(_SyntheticTask):
    """"a+b=" -> "a+b" in decimal; each operand has at most `digits` digits ("12+34=" -> "46")."""

    name = "addition"
    alphabet = "0123456789+= "

    def __init__(self, digits: int = 2, seed: int = 0):
        super().__init__(seed)
        self.digits = _digits("AdditionTask", digits)

    def _make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(10 ** self.digits), rng.randrange(10 ** self.digits)
        return f"{a}+{b}=", str(a + b)


class ReverseTask(_SyntheticTask):
    """"1234>" -> "4321": reverse a string of `digits` random digits."""

    name = "reverse"
    alphabet = "0123456789> "

    def __init__(self, digits: int = 4, seed: int = 0):
        super().__init__(seed)
        self.digits = _digits("ReverseTask", digits)

    def _make(self, rng: random.Random) -> tuple[str, str]:
        digits = "".join(rng.choice("0123456789") for _ in range(self.digits))
        return f"{digits}>", digits[::-1]


TASKS: dict[str, type] = {"addition": AdditionTask, "reverse": ReverseTask}


def make_task(name: str, **kwargs) -> Task:
    """Build built-in task `name` (see TASKS) with its keyword parameters, e.g. digits=3."""
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; valid: {sorted(TASKS)} "
                         f"(source 'synthetic:<task>')")
    cls = TASKS[name]
    try:
        return cls(**kwargs)
    except TypeError as e:
        import inspect

        # seed comes from data.seed, and data.task_options refuses it: not the user's to give
        params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "seed")]
        unknown = sorted(set(kwargs) - set(params) - {"seed"})
        raise ValueError(f"synthetic task {name!r} does not take {unknown or sorted(kwargs)}: it "
                         f"accepts {params} (data.task_options; digits defaults to "
                         f"data.synthetic_digits){'' if unknown else f' ({e})'}") from e
