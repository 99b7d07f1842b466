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
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib
import importlib.util
import json
import logging
import math
import queue
import re
import threading
from fractions import Fraction
from typing import Callable

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


def _math_verify_equal(gold: str, completion: str) -> float:
    """math_verify's verdict on the two final answers, found as `math_fallback` finds them (a
    marked answer: \\boxed{...}, `#### X`, `<answer>X</answer>`; else the gold whole, and
    math_verify's own extraction over the completion) and read as LaTeX between $...$. Parsed
    as they stand, math_verify reads only a leading number or plain expression: a bare gold
    "2\\pi" became 2 (so "\\boxed{2}" scored 1), and "then <answer>7</answer>" gave the 5 of
    "think 5". Words ("yes", a name, a choice letter) compare as strings (`math_fallback`):
    between $...$ they parse as products of symbols."""
    from math_verify import parse, verify

    _quiet_math_verify_timeout_warning()
    gold_answer = extract_final_answer(gold, last_number=False) or gold
    gold_parsed = _parse_latex(gold_answer) if _MATHY_RE.search(gold_answer) else []
    if not gold_parsed:  # a non-mathematical answer: compare as strings
        return math_fallback(gold, completion)
    marked = extract_final_answer(completion, last_number=False)
    # Timeouts off (here and in _parse_latex): math_verify's own use signal.alarm, which fails
    # outside the main thread; RewardRunner enforces the time limit instead.
    answer = parse(completion, parsing_timeout=None) if marked is None else _parse_latex(marked)
    if any(_huge_number(x) for x in (*gold_parsed, *answer)):
        return math_fallback(gold, completion)
    return float(verify(gold_parsed, answer, timeout_seconds=None))


_MAX_POWER_BITS = 10**6  # 2^(10^8), 10^8 bits, took 1.2 s; 10^(10^10) never ended
_MAX_FACTORIAL_ARG = 10**4  # (10^7)! stalled the decode loop for 8 s at a time; 10^4! takes 10 ms


def _huge_number(expr) -> bool:
    """`expr` (parsed by math_verify, not yet evaluated) holds a power of numbers whose exact
    value has more than _MAX_POWER_BITS bits ("10^{10^{10}}", "(2^{10})^{10^{9}}"), or a
    factorial of a number above _MAX_FACTORIAL_ARG. verify() evaluates them in big-integer
    operations in C, which hold the GIL: the time limit could not stop them, and the
    generator's decode loop froze with them. Such answers compare as strings."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False  # the string math_verify keeps beside the expression
    factorials = (sympy.factorial, sympy.factorial2, sympy.binomial, sympy.gamma,
                  sympy.subfactorial, sympy.RisingFactorial, sympy.FallingFactorial)
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, factorials) and not node.free_symbols:
            if any(_huge_number(a) or not _size(a) <= _MAX_FACTORIAL_ARG for a in node.args):
                return True
        if not isinstance(node, sympy.Pow) or node.free_symbols:
            continue
        if _huge_number(node.base) or _huge_number(node.exp):
            return True
        base, size = _size(node.base), _size(node.exp)  # no huge power in them by now
        if base in (0.0, 1.0):  # (also not a number: zoo)
            continue
        b = node.base
        bits = (max(abs(b.p).bit_length(), b.q.bit_length()) if b.is_Rational
                else abs(math.log2(base)) + 1)
        if not size * bits <= _MAX_POWER_BITS:  # also nan, inf
            return True
    return False


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
_THOUSANDS_RE = re.compile(r"(?<=\d)(?:,|\\,)(?=\d{3}(?!\d))")
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def math_fallback(gold: str, completion: str) -> float:
    """Math equivalence without math_verify (the documented fallback).

    1. U+2212, the typeset minus sign, is read as "-" in both. The completion's
       final answer is, in order of preference: the content of the last
       `\\boxed{...}` (none if that box is never closed: the completion was cut off inside
       it, as math_verify reads it too), a last line `#### X` (GSM8K's marker; a `####` Markdown heading earlier
       in the text is not one), the last `<answer>X</answer>`, else its last number. The gold
       answer is used whole unless it carries one of those markers (GSM8K's "#### 72").
    2. Both are normalised: `$`, spaces and thousands separators (a comma or `\\,` before three
       digits) removed, `\\frac{a}{b}` -> a/b.
    3. If both parse as numbers (ints, decimals, a/b; via fractions.Fraction, so "46.0" == "46"
       and "0.5" == "1/2"), two integers must be equal (1000001 is not 1000000), other numbers
       within 1e-6 of the gold, relative above 1 ("0.333333" == "1/3"); otherwise (also for an
       exponent of 1000 or more, "1e1000") the normalised strings must match, case-insensitively.
    """
    gold, completion = gold.replace(MINUS_SIGN, "-"), completion.replace(MINUS_SIGN, "-")
    gold_answer = extract_final_answer(gold, last_number=False) or gold
    answer = extract_final_answer(completion)
    if answer is None:
        return 0.0
    g, a = _normalise(gold_answer), _normalise(answer)
    gn, an = _to_fraction(g), _to_fraction(a)
    if gn is not None and an is not None:
        if gn == an:
            return 1.0
        if gn.denominator == an.denominator == 1:  # integers compare exactly
            return 0.0
        # exactly, in fractions: through float, a number past 1e308 raised OverflowError
        return float(abs(gn - an) <= Fraction(1, 10**6) * max(1, abs(gn)))
    return float(g.lower() == a.lower() and g != "")


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
    s = answer.strip().strip("$").strip()
    s = _FRAC_RE.sub(r"(\1)/(\2)", s)
    s = _THOUSANDS_RE.sub("", s.replace("\\!", ""))  # "1,000" and "1\,000", not "2, 3" or "2,3"
    return s.replace(" ", "").rstrip(".,")


_EXPONENT_RE = re.compile(r"[eE][+-]?([\d_]+)")  # Fraction allows "1e1_0"
_MAX_EXPONENT_DIGITS = 3  # |exponent| < 1000: Fraction("1e10000000") took 16 s, holding the GIL


def _to_fraction(s: str) -> Fraction | None:
    """`s` as an exact number, or None (not a number, or an exponent too large to expand)."""
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


def resolve_reward(spec, format_weight: float = 0.0) -> RewardFn:
    """A reward callable from a built-in name, "package.module:function", or a callable.

    With `format_weight` > 0 the result adds `format_weight * format_reward`.
    """
    fn = spec if callable(spec) else _resolve_spec(spec)
    if format_weight < 0:
        raise ValueError(f"format_weight must be >= 0, got {format_weight}")
    if not format_weight:
        return fn

    def with_format(item, completion_text, completion_ids):
        return (_as_reward(fn(item, completion_text, completion_ids))  # named, as without it
                + format_weight * format_reward(item, completion_text, completion_ids))

    with_format.__name__ = f"{getattr(fn, '__name__', 'reward')}+{format_weight}*format"
    return with_format


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
    return fn


# ---------------------------------------------------------------------------------------------
# running rewards off the hot path


class _CallThread:
    """A daemon thread that runs reward calls one at a time from its queue. Reused across calls
    (a fresh thread per call cost ~0.12 ms of thread start and hand-offs, 3x the reused one:
    ~8 ms for a 64-sample batch); one that overran is abandoned and ends after that call."""

    def __init__(self, fn: RewardFn):
        self.fn, self.abandoned = fn, False
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="tandem-reward-call", daemon=True)
        self.thread.start()

    def call(self, item, text: str, ids: list[int]) -> concurrent.futures.Future:
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((item, text, ids, result))
        return result

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
                result.set_result(self.fn(item, text, ids))
            except BaseException as e:  # reported through the future, never raised here
                result.set_exception(e)


class RewardRunner:
    """Score completions in background threads; a failing or stuck reward scores 0.0.

    Each of `max_workers` supervisor threads owns a call thread that runs the reward, and waits
    at most `timeout_s` for each call. Python cannot kill a thread, so a reward that overruns
    keeps running in the background, but it is abandoned: its supervisor returns 0.0, counts a
    time-out, starts a new call thread and moves on, so a stuck reward never blocks the others
    or the caller (`stats()["stuck"]` counts the abandoned threads still alive). Supervisors bound
    how many rewards run at once. The first error traceback and the first time-out are logged;
    later ones are only counted.
    """

    def __init__(self, fn: RewardFn, timeout_s: float, max_workers: int = 2):
        if timeout_s <= 0 or max_workers < 1:
            raise ValueError(f"RewardRunner needs timeout_s > 0 and max_workers >= 1, got "
                             f"timeout_s={timeout_s}, max_workers={max_workers}")
        self.fn, self.timeout_s = fn, float(timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, "tandem-reward")
        self._lock = threading.Lock()
        self._local = threading.local()  # each supervisor's call thread
        self._callers: list[_CallThread] = []  # every call thread started, to stop on close
        self._counts = {"calls": 0, "errors": 0, "timeouts": 0}
        self._abandoned: list[threading.Thread] = []
        self._name = getattr(fn, "__name__", repr(fn))

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
        caller = getattr(self._local, "caller", None)
        if caller is None:
            caller = self._local.caller = _CallThread(self.fn)
            with self._lock:
                self._callers.append(caller)
        with self._lock:
            self._counts["calls"] += 1
        result = caller.call(item, text, ids)
        # wait() rather than result(timeout=): a reward that itself raises TimeoutError (a socket
        # time-out) is an error of the reward, not a time-out of its call thread
        if not concurrent.futures.wait([result], timeout=self.timeout_s).done:
            caller.abandoned = True
            self._local.caller = None
            self._record_timeout(item, caller.thread)
            return 0.0
        try:
            return _as_reward(result.result())
        except BaseException as e:  # even SystemExit from a reward must not escape the future
            self._record_error(item, e)
        return 0.0

    def _record_error(self, item, error: BaseException) -> None:
        with self._lock:
            self._counts["errors"] += 1
            first = self._counts["errors"] == 1
        if first:
            logger.error("reward %s failed on prompt %s; it scores 0.0 (further failures are only "
                         "counted, see RewardRunner.stats())", self._name, item.id,
                         exc_info=(type(error), error, error.__traceback__))

    def _record_timeout(self, item, worker: threading.Thread) -> None:
        with self._lock:
            self._counts["timeouts"] += 1
            first = self._counts["timeouts"] == 1
            self._abandoned = [t for t in self._abandoned if t.is_alive()] + [worker]
        if first:
            logger.warning("reward %s exceeded reward.timeout_s=%s on prompt %s; it scores 0.0 "
                           "and its thread is abandoned (further time-outs are only counted)",
                           self._name, self.timeout_s, item.id)

    def stats(self) -> dict:
        """{"calls", "errors", "timeouts", "stuck"}: totals since construction."""
        with self._lock:
            stuck = sum(t.is_alive() for t in self._abandoned)
            return {**self._counts, "stuck": stuck}

    def close(self) -> None:
        """Cancel the calls not started, wait for the running supervisors (each at most
        timeout_s), then end the idle call threads; abandoned ones end when their call returns.
        (Running every queued call first, a stuck reward held a generator's exit for
        timeout_s per queued completion divided by max_workers.)"""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for caller in self._callers:
                caller.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _as_reward(value) -> float:
    """Rewards must be finite numbers; anything else is a reward bug, reported as an error."""
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"a reward must return a float, got {value!r} "
                        f"({type(value).__name__})") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"a reward must be finite, got {reward}")
    return reward
