"""Reward functions and the runner that keeps them off the generator's hot path.

A reward is any callable

    reward(item: PromptItem, completion_text: str, completion_ids: list[int]) -> float

`completion_text` is the decoded completion (special tokens skipped) and is only ever read by the
reward: the trainer gets the ids. Built-ins (names for `resolve_reward` / `reward.fn`):

- "exact_match":   1.0 if the stripped completion equals the stripped `item.answer`.
- "math":          math answer equivalence. With `math_verify` installed it decides (on both
                   final answers, found as `math_fallback` finds them and read as LaTeX; words
                   compare as strings); otherwise `math_fallback` (documented there) compares
                   the final number.
- "format":        1.0 if the completion ends in a final-answer marker: `<answer>X</answer>` or a
                   last line `#### X` (X non-empty). Usually added with a small weight.
- "reasoning_gym": the task's own scorer, for items loaded from `reasoning_gym:<task>`.

A reward never crashes the run: `RewardRunner` turns an exception or a time-out into 0.0, counts
it, and logs the first traceback (logger "tandem.reward").

A model under RL sometimes writes answers that ask a checker for unbounded work: "10^{10^{10}}",
"\\prod_{k=1}^{10^{8}} k", brackets nested 50 deep, 20k tokens of "1 1 1". Two defences:

- Cheap guards in "math" (`_math_verify_equal`, `_huge_number`, `_to_fraction`): an answer too
  long, nested too deep, or holding a number too large to evaluate is compared as a string
  instead (linear time), counted in `RewardRunner.stats()["guarded"]`, the first one logged.
- Worker processes (`RewardRunner`): a Python thread cannot be killed, so a reward that overran
  its time limit kept running, taking CPU, memory and the GIL from the decode loop (8 stuck
  made it 100x slower; one in C holding the GIL froze the process). A reward whose attribute
  `isolate` is True ("math"; set it on your own, a function at module level of an importable
  module, e.g. `my_reward.isolate = True`) runs in `max_workers` (reward.workers) worker
  processes, fresh interpreters (CUDA-safe) killed at their time limit; optionally `my_reward.warm_up()` runs
  once in each before its first call (imports). Module state is then per worker process. Other
  rewards run in threads; once `max_stuck` of those are stuck, calls score 0.0 without running
  (counted, logged) until one ends.
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import math
import multiprocessing.connection
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from fractions import Fraction
from typing import Callable, NoReturn

logger = logging.getLogger("tandem.reward")

RewardFn = Callable[..., float]  # (item, completion_text, completion_ids) -> float


# ---------------------------------------------------------------------------------------------
# built-in rewards


def exact_match(item, completion_text: str, completion_ids=None) -> float:
    """1.0 if the completion, stripped of surrounding whitespace, equals the stripped answer."""
    return float(completion_text.strip() == item.answer.strip())


def math_reward(item, completion_text: str, completion_ids=None) -> float:
    """1.0 if the completion's final answer is mathematically equal to `item.answer`."""
    if _has_math_verify():
        return _math_verify_equal(item.answer, completion_text)
    return math_fallback(item.answer, completion_text)


@functools.cache
def _has_math_verify() -> bool:
    return importlib.util.find_spec("math_verify") is not None


@functools.cache
def _quiet_math_verify_timeout_warning() -> None:
    """math_verify warns that its timeouts are off; RewardRunner's time limit covers that."""
    drop = lambda record: not record.getMessage().startswith("Timeout is disabled")  # noqa: E731
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(drop)


_MATHY_RE = re.compile(r"[\d\\^_=+*/]")  # a digit, a LaTeX command or an operator
# Cheap guards before math_verify, whose parser took seconds to minutes on degenerate text, in
# pure Python or in regular expressions that hold the GIL (times on a busy 2-core machine):
_MAX_ANSWER_CHARS = 1000  # marked: "x+x+...+x" of 40k characters took 2.6 s, 10^6 digits 600 MB
_MAX_NESTING = 8  # brackets ([{ : "((...(1)...))" took 1.5 s 10 deep, 10 s 50 deep; 250 never ended
_MAX_SEARCHED_CHARS = 4000  # math_verify's own search of an unmarked completion is quadratic: "1 1
# 1 ..." of 40k characters held the GIL for 7 s. It prefers the last match: it reads the end.


def _math_verify_equal(gold: str, completion: str) -> float:
    """math_verify's verdict on the two final answers, found as `math_fallback` finds them (a
    marked answer: \\boxed{...}, `#### X`, `<answer>X</answer>`; else the gold whole, and
    math_verify's own extraction over the completion's last _MAX_SEARCHED_CHARS characters) and
    read as LaTeX between $...$. Parsed as they stand, math_verify reads only a leading number or
    plain expression: a bare gold "2\\pi" became 2 (so "\\boxed{2}" scored 1), and "then
    <answer>7</answer>" gave the 5 of "think 5". Words ("yes", a name, a choice letter) compare as
    strings (`math_fallback`): between $...$ they parse as products of symbols. So do answers
    that could take math_verify minutes or gigabytes (`_guarded`)."""
    from math_verify import parse, verify

    _quiet_math_verify_timeout_warning()
    gold, completion = _plain(gold), _plain(completion)
    gold_answer = extract_final_answer(gold, last_number=False) or gold
    if not _MATHY_RE.search(gold_answer) or _too_complex(gold_answer):
        return math_fallback(gold, completion)  # not mathematical, or not for math_verify
    gold_parsed = _parse_latex(gold_answer)
    if not gold_parsed:  # a non-mathematical answer: compare as strings
        return math_fallback(gold, completion)
    marked = extract_final_answer(completion, last_number=False)
    tail = completion[-_MAX_SEARCHED_CHARS:]
    why = _too_complex(marked) if marked is not None else _too_complex(tail, _MAX_SEARCHED_CHARS)
    if why:
        return _guarded(why, gold, completion)
    # Timeouts off (here and in _parse_latex): math_verify's own use signal.alarm, which fails
    # outside the main thread; RewardRunner enforces the time limit instead.
    answer = parse(tail, parsing_timeout=None) if marked is None else _parse_latex(marked)
    if any(_huge_number(x) for x in (*gold_parsed, *answer)):
        return _guarded("a huge number", gold, completion)
    return float(verify(gold_parsed, answer, timeout_seconds=None))


def _too_complex(answer: str, max_chars: int = _MAX_ANSWER_CHARS) -> str | None:
    """Why `answer` is not for math_verify (too long, brackets nested too deep), or None."""
    if len(answer) > max_chars:
        return f"{len(answer)} characters long (over {max_chars})"
    depth = deepest = 0
    for ch in answer:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    if deepest > _MAX_NESTING:
        return f"brackets nested {deepest} deep (over {_MAX_NESTING})"
    return None


_guards = threading.local()  # .count: answers `_guarded` kept from math_verify in this call
_guard_logged = threading.Event()


def _guarded(why: str, gold: str, completion: str) -> float:
    """An answer math_verify could take minutes or gigabytes over (`why`) compares as strings
    (`math_fallback`, linear in the text); counted (RewardRunner.stats()["guarded"]), the first
    in a process logged."""
    _guards.count = getattr(_guards, "count", 0) + 1
    if not _guard_logged.is_set():
        _guard_logged.set()
        logger.warning("math reward: an answer (%s) was compared as a string, not by math_verify, "
                       "which could take minutes or gigabytes over it; further ones are counted "
                       "in RewardRunner.stats()['guarded']", why)
    return math_fallback(gold, completion)


def _warm_up_math_verify() -> None:
    """Import math_verify and its LaTeX parser (~0.5 s), before a worker's first time limit."""
    if _has_math_verify():
        _quiet_math_verify_timeout_warning()
        _parse_latex("1")


# math_verify's worst cases are not all guarded against (sympy can be asked for too much in too
# many ways), and some hold the GIL: the math reward runs in worker processes (RewardRunner)
math_reward.isolate, math_reward.warm_up = True, _warm_up_math_verify


_MAX_POWER_BITS = 10**6  # 2^(10^8), 10^8 bits, took 1.2 s; 10^(10^10) never ended
_MAX_FACTORIAL_ARG = 10**4  # (10^7)! stalled the decode loop for 8 s at a time; 10^4! takes 10 ms
_MAX_SYMBOLIC_EXPONENT = 300  # "(x+1)^{300}" against "5" took 0.5 s, ^{1000} 4 s, ^{10^{6}} 3 GB


def _huge_number(expr) -> bool:
    """`expr` (parsed by math_verify, not yet evaluated) asks verify() for work without bound: a
    power of numbers of more than _MAX_POWER_BITS bits ("10^{10^{10}}", "(1+10^{-20})^{10^{30}}"),
    a factorial of a number above _MAX_FACTORIAL_ARG, a finite sum or product of more terms
    ("\\prod_{k=1}^{10^{8}} k" is (10^8)!), a derivative of a higher order, or a power of a
    symbol above _MAX_SYMBOLIC_EXPONENT (expanded: "(x+1)^{10^{6}}" took 3 GB in 10 s). verify()
    evaluates numbers in big-integer operations in C, which hold the GIL: the time limit could
    not stop them, and the generator's decode loop froze with them. Such answers compare as
    strings."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False  # the string math_verify keeps beside the expression
    for node in sympy.preorder_traversal(expr):
        if _huge_power(node) if isinstance(node, sympy.Pow) else _huge_count(node):
            return True
    return False


def _huge_power(node) -> bool:
    """A sympy Pow past the limits of `_huge_number` (its base and exponent checked first)."""
    import sympy

    if _huge_number(node.base) or _huge_number(node.exp):
        return True
    if node.free_symbols:  # a power of a symbol: expanded, integrated or differentiated
        return bool(node.exp.is_number) and not _size(node.exp) <= _MAX_SYMBOLIC_EXPONENT
    b, size = node.base, _size(node.exp)  # no huge power in them by now
    base = _size(b)
    # not 1.0 (of 15 digits): (1+10^{-20})^{10^{30}} was let by, and evaluated exactly
    if base == 0.0 or b in (sympy.S.One, sympy.S.NegativeOne):  # (0.0: also not a number, zoo)
        return False
    bits = (max(abs(b.p).bit_length(), b.q.bit_length()) if b.is_Rational
            else abs(math.log2(base)) + 1)
    return not size * bits <= _MAX_POWER_BITS  # also nan, inf


def _huge_count(node) -> bool:
    """A factorial of a number, a finite sum or product of numeric bounds, or a derivative, of a
    count above _MAX_FACTORIAL_ARG (or holding a huge number)."""
    import sympy

    factorials = (sympy.factorial, sympy.factorial2, sympy.binomial, sympy.gamma,
                  sympy.subfactorial, sympy.RisingFactorial, sympy.FallingFactorial)
    if isinstance(node, factorials) and not node.free_symbols:
        counts = list(node.args)
    elif isinstance(node, (sympy.Sum, sympy.Product)):
        bounds = [lim[1:] for lim in node.limits if len(lim) == 3]
        if any(_huge_number(x) for pair in bounds for x in pair):
            return True
        # infinite ones are summed symbolically (pi^2/6), not term by term
        counts = [n for n in (hi - lo for lo, hi in bounds)
                  if not n.free_symbols and not n.is_infinite]
    elif isinstance(node, sympy.Derivative):
        counts = [n for _, n in node.variable_count]
    else:
        return False
    return any(_huge_number(n) or not _size(n) <= _MAX_FACTORIAL_ARG for n in counts)


def _size(x) -> float:
    """|x| of a sympy number holding no huge power, in floats (inf: too large; 0: not a number)."""
    try:
        return abs(complex(x.evalf(15)))
    except (TypeError, ValueError):
        return 0.0
    except OverflowError:
        return float("inf")


def _parse_latex(answer: str) -> list:
    from math_verify import parse
    return parse(f"${answer.strip().strip('$')}$", parsing_timeout=None)


_NUMBER_RE = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:/\d+)?|-?\.\d+")  # "46," -> "46"
MINUS_SIGN = "\u2212"
_LATEX_THOUSANDS_RE = re.compile(r"(?<=\d)(?:\\,|\{,\})(?=\d{3}(?!\d))")  # 1\,000 1{,}000
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # "1,000", not "2, 3" or "2,3"
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_SHORT_FRAC_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")  # \frac12
_UNIT_RE = re.compile(r"(?<=[\d.}])\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}$")  # 5\text{ cm}
_TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm)\s*\{([^{}]*)\}")  # \text{A} -> A
_DEGREES_RE = re.compile(r"\^\s*(?:\\circ|\{\\circ\})")  # 90^\circ


def _plain(text: str) -> str:
    """`text` with U+2212, the typeset minus sign, as "-" and LaTeX's thousands separators
    between digits ("1\\,000", "1{,}000") removed: math_verify read "1\\,000" as 1*0."""
    return _LATEX_THOUSANDS_RE.sub("", text.replace(MINUS_SIGN, "-"))


def math_fallback(gold: str, completion: str) -> float:
    """Math equivalence without math_verify (the documented fallback).

    1. U+2212, the typeset minus sign, is read as "-" in both, and LaTeX's thousands separators
       (`1\\,000`, `1{,}000`) are removed. The completion's
       final answer is, in order of preference: the content of the last
       `\\boxed{...}` (none if that box is never closed: the completion was cut off inside
       it, as math_verify reads it too), a last line `#### X` (GSM8K's marker; a `####` Markdown heading earlier
       in the text is not one), the last `<answer>X</answer>`, else its last number; and where
       that does not meet a gold that is not a number ("yes", "B", "Paris"), an unmarked
       completion of at most 1000 characters read whole (a word written alone, not in a
       sentence). The gold
       answer is used whole unless it carries one of those markers (GSM8K's "#### 72").
    2. Both are normalised: `$` and `\\$`, `%` and `\\%`, `^\\circ`, a unit after a number
       (`5\\text{ cm}`), spaces and thousands separators (a comma before three digits) removed,
       `\\text{X}` -> X, `\\frac{a}{b}` and `\\frac12` -> a/b. So `\\boxed{\\$18}` scores as
       "$18" does (the last number of unmarked text): a boxed answer is not worth less.
    3. If both parse as numbers (ints, decimals, a/b; via fractions.Fraction, so "46.0" == "46"
       and "0.5" == "1/2"), an integer gold must be met exactly (1000001 or 1000000.9 is not
       1000000), other golds within 1e-6, relative above 1 ("0.333333" == "1/3"); otherwise
       (also for an exponent of 1000 or more, "1e1000", or a number of over 4300 characters)
       the normalised strings must match, case-insensitively.
    """
    gold, completion = _plain(gold), _plain(completion)
    gold_answer = extract_final_answer(gold, last_number=False) or gold
    g = _normalise(gold_answer)
    answer = extract_final_answer(completion)
    if answer is not None and _same_answer(g, answer):
        return 1.0
    # a gold that is not a number ("yes", "B") written alone, unmarked: no last number to read
    # (numbers that Fraction refuses, "2,3" or 4400 digits, matched by their last number above)
    unmarked = extract_final_answer(completion, last_number=False) is None
    if unmarked and "\\boxed{" not in completion and _to_fraction(g) is None:
        whole = _word_alone(completion)
        return float(whole is not None and _same_answer(g, whole))
    return 0.0


def _same_answer(g: str, answer: str) -> bool:
    """Whether `answer` meets the normalised gold `g` (`math_fallback` step 3)."""
    a = _normalise(answer)
    gn, an = _to_fraction(g), _to_fraction(a)
    if gn is not None and an is not None:
        if gn == an:
            return True
        if gn.denominator == 1:  # an integer gold is met exactly
            return False
        # exactly, in fractions: through float, a number past 1e308 raised OverflowError
        return abs(gn - an) <= Fraction(1, 10**6) * max(1, abs(gn))
    return g.lower() == a.lower() and g != ""


def _word_alone(completion: str) -> str | None:
    """An unmarked completion read whole, stripped, if short: the answer to a gold that is not a
    number ("yes", "B", "Paris") written alone (it scored 0: only its last number was read)."""
    whole = completion.strip()
    return whole if 0 < len(whole) <= _MAX_ANSWER_CHARS else None


def extract_final_answer(text: str, last_number: bool = True) -> str | None:
    """The final answer written in `text` (see `math_fallback` step 1), or None."""
    start = text.rfind("\\boxed{")
    if start >= 0:  # unbalanced: cut off inside the box ("\\boxed{46" of "\\boxed{465}"), none
        return _boxed_at(text, start)
    for find in (_last_line_marker, _last_answer_tag):
        found = find(text)
        if found is not None:
            return found.strip()
    if last_number:
        numbers = _NUMBER_RE.findall(text)
        return numbers[-1] if numbers else None
    return None


# The markers are found by string search, not by regular expressions: the patterns they replaced
# (r"<answer>(.*?)</answer>", r"\n####[ \t]*(\S[^\n]*?)\s*\Z") took time quadratic in the
# length of a degenerate completion (40k "<answer>": 51 s; "#### 1" and 40k spaces: 5 s), in C
# that holds the GIL: the time limit cannot stop it, and the generator's decode loop stalled.
def _last_line_marker(text: str) -> str | None:
    """X of a last line `#### X` (whitespace after it ignored; X starts with a non-space), or None."""
    text = text.rstrip()
    line = text[text.rfind("\n") + 1:]
    if not line.startswith("####"):
        return None
    x = line[len("####"):].lstrip(" \t")
    return x if x and not x[0].isspace() else None


def _last_answer_tag(text: str) -> str | None:
    """X of the last `<answer>X</answer>`, each tag closed by the first `</answer>` after it, or
    None."""
    found, pos = None, 0
    while (start := text.find("<answer>", pos)) >= 0:
        end = text.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        found, pos = text[start + len("<answer>"):end], end + len("</answer>")
    return found


def _boxed_at(text: str, start: int) -> str | None:
    """Content of the \\boxed{...} at `start` (braces balanced), or None if unbalanced."""
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def _normalise(answer: str) -> str:
    """An extracted answer in the form `math_fallback` compares (its step 2)."""
    s = answer.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    s = _TEXT_RE.sub(r"\1", _UNIT_RE.sub("", _DEGREES_RE.sub("", s)))
    s = _FRAC_RE.sub(r"(\1)/(\2)", _SHORT_FRAC_RE.sub(r"\\frac{\1}{\2}", s))
    s = _THOUSANDS_RE.sub("", s.replace("\\!", ""))
    return s.replace(" ", "").rstrip(".,")


_EXPONENT_RE = re.compile(r"[eE][+-]?([\d_]+)")  # Fraction allows "1e1_0"
_MAX_EXPONENT_DIGITS = 3  # |exponent| < 1000: Fraction("1e10000000") took 16 s, holding the GIL
# int(str) is quadratic in the digits and holds the GIL: Python's default limit of 4300 digits,
# which a library may lift (sys.set_int_max_str_digits(0)), whatever it is now
_MAX_NUMBER_CHARS = 4300


def _to_fraction(s: str) -> Fraction | None:
    """`s` as an exact number, or None (not a number, too long, or an exponent too large to
    expand)."""
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    e = _EXPONENT_RE.search(s)
    if e and len(e.group(1).replace("_", "").lstrip("0")) > _MAX_EXPONENT_DIGITS:
        return None
    m = re.fullmatch(r"(-?)\((-?[\d.]+)\)/\((-?[\d.]+)\)", s)  # from (-)\frac{a}{b}
    try:
        if m:
            return (-1) ** len(m.group(1)) * Fraction(m.group(2)) / Fraction(m.group(3))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def format_reward(item, completion_text: str, completion_ids=None) -> float:
    """1.0 if the completion ends with `<answer>X</answer>` or a last line `#### X`, X non-empty.

    Only the form is judged, not the answer; used as a small shaping term (reward.format_weight).
    """
    text = completion_text.strip()
    return float(_ends_in_answer_tag(text) or _last_line_marker(text) is not None)


def _ends_in_answer_tag(text: str) -> bool:
    """`text` (stripped) ends with `</answer>`, and some `<answer>` before it opens a non-blank
    span up to that end (by string search: see `_last_line_marker`)."""
    start = text.find("<answer>")
    if start < 0 or not text.endswith("</answer>"):
        return False
    return text[start + len("<answer>"):len(text) - len("</answer>")].strip() != ""


def reasoning_gym_reward(item, completion_text: str, completion_ids=None) -> float:
    """The reasoning_gym task's own scorer for items loaded from `reasoning_gym:<task>`.

    The answer scored is the content of the last `<answer>...</answer>` (reasoning_gym's
    convention), else the whole stripped completion.
    """
    rg = item.meta.get("reasoning_gym") or {}
    entry = rg.get("entry")
    if entry is None:
        raise ValueError(f"prompt {item.id} (source {item.meta.get('source')!r}) has no "
                         f"reasoning_gym entry; the 'reasoning_gym' reward only scores prompts "
                         f"loaded from 'reasoning_gym:<task>'")
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(completion_text)
    answer = completion_text.strip() if answer is None else answer
    task = entry.get("metadata", {}).get("source_dataset", rg.get("task"))
    # the scorer of the task as configured (data.task_options): some read their config (the
    # decimal tolerance of decimal_arithmetic), and the default config's would differ
    options = rg.get("options") if task == rg.get("task") else None
    return float(_rg_scorer(task, json.dumps(options or {}, sort_keys=True))(answer, entry))


@functools.cache
def _rg_scorer(task: str, options_json: str):
    import reasoning_gym

    options = json.loads(options_json)
    if not options:
        return reasoning_gym.get_score_answer_fn(task)
    return reasoning_gym.create_dataset(task, size=1, seed=0, **options).score_answer


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_reward,
    "format": format_reward,
    "reasoning_gym": reasoning_gym_reward,
}


# ---------------------------------------------------------------------------------------------
# resolving a spec


def reward_runner(rcfg, leader: bool = True) -> "RewardRunner | Unscored":
    """The RewardRunner of a `reward` config section (fn, format_weight, timeout_s, workers,
    isolate); for a generator TP follower (`leader` False), whose replica's leader scores,
    `Unscored`."""
    if not leader:
        return Unscored()
    isolate = {"auto": None, "process": True, "thread": False}[rcfg.isolate]
    return RewardRunner(resolve_reward(rcfg.fn, rcfg.format_weight), rcfg.timeout_s,
                        max_workers=rcfg.workers, isolate=isolate)


def resolve_reward(spec, format_weight: float = 0.0) -> RewardFn:
    """A reward callable from a built-in name, "package.module:function", or a callable.

    With `format_weight` > 0 the result adds `format_weight * format_reward`.
    """
    if callable(spec):
        _check_signature(spec, getattr(spec, "__name__", repr(spec)))
    fn = spec if callable(spec) else _resolve_spec(spec)
    if format_weight < 0:
        raise ValueError(f"format_weight must be >= 0, got {format_weight}")
    return _WithFormat(fn, format_weight) if format_weight else fn


class _WithFormat:
    """`fn` plus `weight * format_reward`: a class, not a closure, so that it pickles (a worker
    process of RewardRunner loads it by reference) and runs where `fn` runs."""

    def __init__(self, fn: RewardFn, weight: float):
        self.fn, self.weight = fn, weight
        self.__name__ = f"{getattr(fn, '__name__', 'reward')}+{weight}*format"
        self.isolate = getattr(fn, "isolate", False)

    def __call__(self, item, completion_text, completion_ids):
        return (_as_reward(self.fn(item, completion_text, completion_ids))  # named, as without it
                + self.weight * format_reward(item, completion_text, completion_ids))

    def warm_up(self) -> None:
        getattr(self.fn, "warm_up", lambda: None)()


def _resolve_spec(spec: str) -> RewardFn:
    if not isinstance(spec, str):
        raise ValueError(f"reward spec must be a string or a callable, got {type(spec).__name__}")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {spec!r} is neither a built-in ({sorted(BUILTIN_REWARDS)}) nor "
                         f"of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and not (module_name + ".").startswith(e.name + "."):
            raise ValueError(f"reward {spec!r}: importing module {module_name!r} failed: a module "
                             f"it imports is not installed ({e})") from e
        # train_rl.py's folder is on sys.path, the launch directory only when it is that folder
        raise ValueError(f"reward {spec!r}: module {module_name!r} not found ({e}); check the "
                         f"spelling, and put the folder that holds it on PYTHONPATH") from e
    except Exception as e:
        raise ValueError(f"reward {spec!r}: importing module {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(fn).__name__}, not callable; it "
                         f"must be a function (item, completion_text, completion_ids) -> float")
    _check_signature(fn, spec)
    return fn


def _check_signature(fn, name: str) -> None:
    """A reward that cannot take the runner's three arguments raised TypeError on every call:
    each scored 0.0, and the run trained on nothing after one logged traceback. So did an
    `async def` reward (an LLM judge, say) or a generator function: a call returns a coroutine
    or a generator, not a number."""
    call = fn if inspect.isroutine(fn) or isinstance(fn, functools.partial) else \
        getattr(type(fn), "__call__", fn)
    kind = ("an async function" if inspect.iscoroutinefunction(call) else
            "an async generator" if inspect.isasyncgenfunction(call) else
            "a generator function" if inspect.isgeneratorfunction(call) else None)
    if kind:
        raise ValueError(f"reward {name!r} is {kind}: a call returns a "
                         f"{'generator' if 'generator' in kind else 'coroutine'}, not the float "
                         "the runner needs, and every sample would score 0.0; make it a plain "
                         "def (an async client can be run inside it: asyncio.run(judge(...)); "
                         "the runner already calls it in reward.workers threads or processes)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a C callable without a readable signature: unchecked
        return
    try:
        sig.bind(None, "", [])
    except TypeError as e:
        raise ValueError(f"reward {name!r} takes {sig}, which a call fn(item, completion_text, "
                         f"completion_ids) does not fit ({e}); define it as "
                         f"def {getattr(fn, '__name__', 'reward')}(item, completion_text, "
                         f"completion_ids) -> float (item.answer is the prompt's answer)") from None


# ---------------------------------------------------------------------------------------------
# running rewards off the hot path


class _Overran(Exception):
    """A call of the reward did not return within the runner's timeout_s."""


class RewardWorkerError(RuntimeError):
    """A reward failed in a worker process; the message holds the worker's traceback."""


def _scored_call(fn: RewardFn, item, text: str, ids: list[int]) -> tuple[float, int]:
    """The reward (a finite float) and how many answers the math reward guarded against in it."""
    _guards.count = 0
    reward = _as_reward(fn(item, text, ids))
    return reward, _guards.count


class _CallThread:
    """A daemon thread that runs reward calls one at a time from its queue. Reused across calls
    (a fresh thread per call cost ~0.12 ms of thread start and hand-offs, 3x the reused one:
    ~8 ms for a 64-sample batch); one that overran is abandoned and ends after that call."""

    def __init__(self, fn: RewardFn):
        self.fn, self.abandoned = fn, False
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="tandem-reward-call", daemon=True)
        self.thread.start()

    def run(self, item, text: str, ids: list[int], timeout_s: float) -> tuple[float, int]:
        """`_scored_call` on this thread; raises _Overran after timeout_s, or the reward's error."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((item, text, ids, result))
        # wait() rather than result(timeout=): a reward that itself raises TimeoutError (a socket
        # time-out) is an error of the reward, not a time-out of its call thread
        if not concurrent.futures.wait([result], timeout=timeout_s).done:
            raise _Overran
        return result.result()

    def usable(self) -> bool:
        return not self.abandoned

    def abandon(self) -> None:
        """A thread cannot be killed: it ends when its call returns, if ever."""
        self.abandoned = True

    def stop(self) -> None:
        """End the thread once its queue is empty (it is then idle: nothing is queued behind)."""
        self._calls.put(None)

    def _loop(self) -> None:
        while not self.abandoned:
            call = self._calls.get()
            if call is None:
                return
            item, text, ids, result = call
            try:
                result.set_result(_scored_call(self.fn, item, text, ids))
            except BaseException as e:  # reported through the future, never raised here
                result.set_exception(e)


_LOAD_FAILED = "loading the reward in a worker process failed"
_WORKER_START_TIMEOUT_S = 120.0  # a fresh interpreter importing the reward and warming it up
_WORKER_MAIN = "import sys; from rollout.rewards import _serve; _serve(*map(int, sys.argv[1:]))"


class _CallProcess:
    """A worker process that runs reward calls one at a time, sent over a socket pair. A fresh
    interpreter (`_serve`), not a fork: the parent may hold CUDA state, which a fork cannot use,
    and a fork copies a large process. So the reward is loaded by reference (pickle): a function
    at module level of an importable module. It is killed when a call overruns: its CPU, its
    memory and its GIL are the run's again at once."""

    def __init__(self, fn_pickle: bytes):
        ours, theirs = multiprocessing.connection.Pipe()
        # the child finds the modules the parent found: the launch folder, PYTHONPATH, the venv
        path = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = ours
        try:
            ours.send_bytes(fn_pickle)
            if not ours.poll(_WORKER_START_TIMEOUT_S):
                raise TimeoutError(f"reward worker process {self.proc.pid} did not load the "
                                   f"reward within {_WORKER_START_TIMEOUT_S:.0f} s")
            self._reply()  # ("ready", None)
        except BaseException:
            self.abandon()
            raise

    def run(self, item, text: str, ids: list[int], timeout_s: float) -> tuple[float, int]:
        """`_scored_call` in the worker; raises _Overran after timeout_s, or the reward's error."""
        try:
            self.conn.send((item, text, ids))
        except OSError:  # it died since its last call
            self._died()
        if not self.conn.poll(timeout_s):  # (True also when the worker died: _reply says so)
            raise _Overran
        return self._reply()

    def _reply(self):
        try:
            status, payload = self.conn.recv()
        except (EOFError, OSError):
            self._died()
        if status == "error":
            raise RewardWorkerError(payload)
        return payload

    def _died(self) -> NoReturn:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.abandon()
        raise RewardWorkerError(f"reward worker process {self.proc.pid} ended (exit code {code}) "
                                f"before it answered; a new one takes the next call")

    def usable(self) -> bool:
        return self.proc.poll() is None

    def abandon(self) -> None:
        """Kill the worker (SIGKILL: a reward stuck in C ignores anything milder)."""
        self.proc.kill()
        self._reap()

    def stop(self) -> None:
        """End an idle worker: it exits when the socket closes."""
        self._reap()

    def _reap(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # closed while running a call (close() after a kill)
            self.proc.kill()
            self.proc.wait(timeout=10)


def _serve(fd: int, parent_pid: int) -> None:
    """The main of a reward worker process (`_CallProcess`): load the reward (and warm it up:
    imports), then run calls one at a time until the parent closes the socket."""
    # a Ctrl-C, or a SIGTERM to the whole job (preemption), is the parent's to handle: it may
    # still score the completions in flight. The worker ends with it (_die_with_parent).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    logging.basicConfig(format=f"[reward worker %(process)d of {parent_pid}] %(levelname)s "
                               f"%(name)s: %(message)s")
    conn = multiprocessing.connection.Connection(fd)
    try:
        fn = pickle.loads(conn.recv_bytes())
        getattr(fn, "warm_up", lambda: None)()
    except BaseException:
        conn.send(("error", _LOAD_FAILED + " (reward.isolate=thread runs it in threads):\n"
                            + traceback.format_exc()))
        return
    reply = ("ready", None)
    while True:
        conn.send(reply)
        try:
            item, text, ids = conn.recv()
        except EOFError:  # the runner closed, or its process ended
            return
        try:
            reply = ("ok", _scored_call(fn, item, text, ids))
        except BaseException:  # even SystemExit: reported, the worker lives on
            reply = ("error", traceback.format_exc())


def _die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when the thread that started it ends (the runner's
    supervisor: it lives until close()): a reward stuck in C would run on as an orphan of a
    crashed run. Elsewhere an idle worker ends on the socket's EOF."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent ended before that
        os._exit(0)


class RewardRunner:
    """Score completions in the background; a failing or stuck reward scores 0.0.

    Each of `max_workers` supervisor threads owns a caller that runs the reward, and waits at
    most `timeout_s` for each call; supervisors bound how many rewards run at once. The caller
    is, with `isolate` (default: the reward's own `isolate` attribute, True for "math"):

    - a worker process (`_CallProcess`): a reward that overruns is killed, and a new worker
      takes the next call. A reward's work (pure Python or C holding the GIL) never slows the
      generator's decode loop. The reward must pickle by reference (module level).
    - else a thread (`_CallThread`). Python cannot kill a thread: a reward that overruns keeps
      running, abandoned (`stats()["stuck"]` counts those still alive), taking CPU and the GIL
      from the decode loop (8 stuck made it 100x slower). Once `max_stuck` are stuck, calls
      score 0.0 without running (`stats()["skipped"]`, logged) until one of them ends.

    The supervisor returns 0.0 and counts an error or a time-out; the first error traceback and
    the first time-out are logged, later ones only counted.
    """

    def __init__(self, fn: RewardFn, timeout_s: float, max_workers: int = 2,
                 isolate: bool | None = None, max_stuck: int = 4):
        if timeout_s <= 0 or max_workers < 1 or max_stuck < 1:
            raise ValueError(f"RewardRunner needs timeout_s > 0, max_workers >= 1 and max_stuck "
                             f">= 1, got timeout_s={timeout_s}, max_workers={max_workers}, "
                             f"max_stuck={max_stuck}")
        self.fn, self.timeout_s, self.max_stuck = fn, float(timeout_s), max_stuck
        self._name = getattr(fn, "__name__", repr(fn))
        self.isolated = bool(getattr(fn, "isolate", False) if isolate is None else isolate)
        self._fn_pickle = _pickled(fn, self._name) if self.isolated else b""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, "tandem-reward")
        self._lock = threading.Lock()
        self._local = threading.local()  # each supervisor's caller
        self._callers: list = []  # callers in use, to stop on close
        self._counts = {"calls": 0, "errors": 0, "timeouts": 0, "skipped": 0, "guarded": 0}
        self._abandoned: list[threading.Thread] = []
        self._unloadable: RewardWorkerError | None = None  # a worker could not load the reward

    def submit(self, item, completion_text: str, completion_ids) -> concurrent.futures.Future:
        """A Future of the reward (a float); it never raises."""
        return self._pool.submit(self._supervise, item, completion_text, list(completion_ids))

    def score_batch(self, items, texts, ids) -> list[float]:
        """Rewards of completions `texts[i]` / `ids[i]` of prompts `items[i]`, in order."""
        if not len(items) == len(texts) == len(ids):
            raise ValueError(f"score_batch needs equal lengths, got {len(items)} items, "
                             f"{len(texts)} texts, {len(ids)} id lists")
        futures = [self.submit(it, t, i) for it, t, i in zip(items, texts, ids)]
        return [f.result() for f in futures]

    def _supervise(self, item, text: str, ids: list[int]) -> float:
        if self._too_many_stuck():
            return 0.0
        self._count("calls")
        caller = None
        try:
            caller = self._caller()
            reward, guarded = caller.run(item, text, ids, self.timeout_s)
        except _Overran:
            self._local.caller = None
            caller.abandon()
            self._record_timeout(item, caller)
            return 0.0
        except BaseException as e:  # even SystemExit from a reward must not escape the future
            self._record_error(item, e)
            return 0.0
        if guarded:
            self._count("guarded", guarded)
        return reward

    def _caller(self):
        caller = getattr(self._local, "caller", None)
        if caller is None or not caller.usable():
            if self._unloadable is not None:  # no new interpreter per call for the same failure
                raise self._unloadable
            try:
                caller = (_CallProcess(self._fn_pickle) if self.isolated else _CallThread(self.fn))
            except RewardWorkerError as e:
                if str(e).startswith(_LOAD_FAILED):
                    self._unloadable = e
                raise
            self._local.caller = caller
            with self._lock:
                self._callers = [c for c in self._callers if c.usable()] + [caller]
        return caller

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _too_many_stuck(self) -> bool:
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            if len(self._abandoned) < self.max_stuck:
                return False
            self._counts["skipped"] += 1
            first = self._counts["skipped"] == 1
        if first:
            logger.error("%d calls of reward %s are stuck past reward.timeout_s=%s in threads that "
                         "cannot be killed, taking CPU from generation; further calls score 0.0 "
                         "without running until one of them ends (counted in stats()['skipped']). "
                         "Make the reward return in time, or run it in worker processes that can "
                         "be killed: set `isolate = True` on it (a function at module level; see "
                         "rollout/rewards.py)", len(self._abandoned), self._name, self.timeout_s)
        return True

    def _record_error(self, item, error: BaseException) -> None:
        with self._lock:
            self._counts["errors"] += 1
            first = self._counts["errors"] == 1
        if first:
            logger.error("reward %s failed on prompt %s; it scores 0.0 (further failures are only "
                         "counted, and printed as they grow: RewardReport)", self._name, item.id,
                         exc_info=(type(error), error, error.__traceback__))

    def _record_timeout(self, item, caller) -> None:
        with self._lock:
            self._counts["timeouts"] += 1
            first = self._counts["timeouts"] == 1
            if isinstance(caller, _CallThread):
                self._abandoned.append(caller.thread)
        if first:
            fate = ("its worker process was killed" if self.isolated else
                    "its thread is abandoned (it cannot be killed)")
            logger.warning("reward %s exceeded reward.timeout_s=%s on prompt %s; it scores 0.0 "
                           "and %s (further time-outs are only counted)",
                           self._name, self.timeout_s, item.id, fate)

    def stats(self) -> dict:
        """Totals since construction: "calls" run, "errors" and "timeouts" among them (each
        scored 0.0), "skipped" (0.0 without running: too many stuck), "guarded" (answers the
        math reward kept from math_verify), and "stuck": abandoned threads still running."""
        with self._lock:
            stuck = sum(t.is_alive() for t in self._abandoned)
            return {**self._counts, "stuck": stuck}

    def close(self) -> None:
        """Cancel the calls not started, wait for the running supervisors (each at most
        timeout_s), then end the idle callers; abandoned threads end when their call returns.
        (Running every queued call first, a stuck reward held a generator's exit for
        timeout_s per queued completion divided by max_workers.)"""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            callers, self._callers = self._callers, []
        for caller in callers:
            if caller.usable():
                caller.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RewardReport:
    """A console line when a runner's rewards failed since the last line, at most one every
    EVERY_S: the runner logs only the first error and time-out, and a reward that scores 0.0 for
    most samples otherwise shows only as a flat reward curve."""

    EVERY_S = 60.0
    KEYS = ("errors", "timeouts", "skipped", "guarded")

    def __init__(self):
        self.failed = dict.fromkeys(self.KEYS, 0)
        self.next_at = 0.0  # time.monotonic() of the next line at the earliest

    def line(self, stats: dict, timeout_s: float) -> str | None:
        """'of N reward calls so far, E raised and T ran past reward.timeout_s=5.0 (scored 0.0)',
        then the skipped and the guarded (the math reward's) where there are any; None when
        nothing failed since the last line, or within EVERY_S of it."""
        now = time.monotonic()
        if not stats or now < self.next_at:
            return None
        failed = {k: stats.get(k, 0) for k in self.KEYS}
        if failed == self.failed:
            return None
        self.failed, self.next_at = failed, now + self.EVERY_S
        line = (f"of {stats['calls'] + stats.get('skipped', 0)} reward calls so far, "
                f"{failed['errors']} raised and {failed['timeouts']} ran past reward.timeout_s="
                f"{timeout_s} (scored 0.0)")
        if failed["skipped"]:
            line += f", {failed['skipped']} were skipped (too many stuck: scored 0.0 without running)"
        if failed["guarded"]:
            line += (f", {failed['guarded']} answers were compared as strings (too large for "
                     "math_verify)")
        return line


class Unscored:
    """The rewards of a generator TP follower: its replica's leader scores the same completions
    and alone sends them (and records the evaluation), so a follower's are never read. It runs
    nothing (a RewardRunner there ran the reward a second time, in worker processes of its own)
    and scores 0.0."""

    def submit(self, item, completion_text: str, completion_ids) -> concurrent.futures.Future:
        done = concurrent.futures.Future()
        done.set_result(0.0)
        return done

    def score_batch(self, items, texts, ids) -> list[float]:
        return [0.0] * len(items)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def _pickled(fn: RewardFn, name: str) -> bytes:
    try:
        return pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"reward {name} cannot run in a worker process: pickle cannot send it "
                         f"({e}). Define it at module level of an importable module "
                         f"('package.module:function'), or run it in threads "
                         f"(isolate=False)") from e


def _as_reward(value) -> float:
    """Rewards must be finite numbers; anything else is a reward bug, reported as an error
    (a string too, which float() would have parsed: "1.0" but not "correct")."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"a reward must return a float, got the string {value!r}")
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"a reward must return a float, got {value!r} "
                        f"({type(value).__name__})") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"a reward must be finite, got {reward}")
    return reward
