"""rollout.rewards: built-ins, spec resolution, and a runner that survives bad rewards."""
import importlib.util
import logging
import sys
import threading
import time
import types

import pytest

from rollout.data import PromptItem, load_prompts
from rollout.rewards import (RewardRunner, exact_match, extract_final_answer, format_reward,
                             math_fallback, math_reward, reasoning_gym_reward, resolve_reward)


def _item(answer, i=0, **meta):
    return PromptItem(id=i, prompt="q", messages=None, answer=answer, meta=meta)


def test_exact_match():
    assert exact_match(_item("46"), " 46\n", []) == 1.0
    assert exact_match(_item(" 46 "), "46", []) == 1.0
    assert exact_match(_item("46"), "460", []) == 0.0
    assert exact_match(_item("46"), "", []) == 0.0


@pytest.mark.parametrize("gold, completion, expected", [
    ("46", "so the answer is 46.", 1.0),
    ("46", "\\boxed{46}", 1.0),
    ("46", "46.0", 1.0),
    ("1234", "that is 1,234 apples", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("1/2", "the answer: 0.5", 1.0),
    ("-4", "#### -4", 1.0),
    ("72", "<answer>72</answer>", 1.0),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", 1.0),  # GSM8K-style gold
    ("46", "45, no wait, 47", 0.0),
    ("46", "no number here", 0.0),
    ("46", "\\boxed{46", 0.0),           # cut off inside the box (of "\\boxed{465}"?): no
    ("46", "46, so \\boxed{4", 0.0),      # answer, not the last number (math_verify: 0 too)
    ("46", "\\boxed{47", 0.0),
    ("yes", "\\boxed{Yes}", 1.0),        # non-numeric: normalised string match
    ("46", "", 0.0),
    ("1000000", "\\boxed{1000001}", 0.0),  # integers compare exactly (a relative 1e-6 let it by)
    ("2000000", "#### 2000002", 0.0),
    ("1/3", "\\boxed{0.333333}", 1.0),     # other numbers within 1e-6
    ("2, 3", "\\boxed{23}", 0.0),          # a comma before fewer than three digits is no
    ("1, 2, 3", "\\boxed{123}", 0.0),      # thousands separator
    ("1000", "\\boxed{1\\,000}", 1.0),
    ("46", "The answer is 46, I think", 1.0),
    ("-0.5", "\\boxed{-\\frac{1}{2}}", 1.0),
    ("7", "#### Step 2\nShe pays 2 + 5 = 7 dollars. The answer is 7.", 1.0),  # a Markdown
    ("3", "The result is 3.\n#### ", 1.0),  # heading, an empty marker: not GSM8K's "#### X" line
    ("-5", "\\boxed{\u22125}", 1.0),       # U+2212, the typeset minus sign
    ("-5", "so it is \u22125", 1.0),
    ("\u22125", "#### -5", 1.0),
    ("5", "\\boxed{\u22125}", 0.0),
    # a boxed answer scored 0 where the same answer written plainly scored 1 (its last number):
    # the fallback taught the policy not to box
    ("18", "\\boxed{\\$18}", 1.0), ("18", "The total is $18.", 1.0),
    ("50", "\\boxed{50\\%}", 1.0), ("50\\%", "It is 50%.", 1.0), ("50%", "\\boxed{50}", 1.0),
    ("5", "\\boxed{5\\text{ cm}}", 1.0), ("5", "\\boxed{5 \\mbox{cm}}", 1.0),
    ("A", "\\boxed{\\text{A}}", 1.0), ("90", "\\boxed{90^\\circ}", 1.0),
    ("1000", "\\boxed{1{,}000}", 1.0), ("1000", "It is 1\\,000.", 1.0),
    ("0.5", "\\boxed{\\frac12}", 1.0), ("-0.75", "\\boxed{-\\dfrac34}", 1.0),
    ("6", "\\boxed{6\\text{ cm}^2}", 0.0),  # no unit at the end: a string, not the number 6
    ("1000000", "\\boxed{1000000.9}", 0.0),  # an integer gold is met exactly
    ("1000000", "\\boxed{1e6}", 1.0),
    ("12345.67", "\\boxed{12345.66}", 1.0),  # a non-integer gold: within 1e-6, relative
    # a word gold and the word written alone, unmarked: only a last number was read (0)
    ("B", "B", 1.0), ("yes", " Yes\n", 1.0), ("Paris", "Paris", 1.0),
    ("Paris", "The capital is Paris", 0.0), ("B", "1", 0.0), ("yes", "", 0.0),
    ("B", "B" * 1001, 0.0),  # a long unmarked completion is not read whole
    # golds that Fraction refuses but a last number meets are still met so (the whole-completion
    # rule first replaced the last number for them)
    ("2,3", "so the pair is 2,3", 1.0), ("3,5", "Die Antwort ist 3,5", 1.0),
    ("9" * 4400, "the number is " + "9" * 4400, 1.0),
])
def test_math_fallback(gold, completion, expected):
    assert math_fallback(gold, completion) == expected


def test_math_reward_uses_math_verify_or_fallback():
    assert math_reward(_item("46"), "The answer is \\boxed{46}", []) == 1.0
    assert math_reward(_item("46"), "The answer is \\boxed{47}", []) == 0.0
    assert math_reward(_item("1/2"), "\\boxed{0.5}", []) == 1.0


GSM8K_GOLD = "She sold 48 / 2 = 24 clips in May.\nIn all she sold 48 + 24 = 72 clips.\n#### 72"


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                    reason="math_verify not installed (optional; make test installs it)")
@pytest.mark.parametrize("gold, completion, expected", [
    ("2\\pi", "so \\boxed{2\\pi}", 1.0),
    ("2\\pi", "\\boxed{2}", 0.0),  # a bare gold parsed as it stood read "2\\pi" as 2
    ("x+1", "\\boxed{1+x}", 1.0),   # symbolic equality (the fallback compares strings: 0)
    ("50\\%", "\\boxed{0.5}", 1.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
    ("$\\frac{3}{4}$", "\\boxed{0.75}", 1.0),
    (GSM8K_GOLD, "she sold \\boxed{72}", 1.0),
    (GSM8K_GOLD, "#### 48", 0.0),
    ("7", "think 5 then <answer>7</answer>", 1.0),  # the marked answer, as math_fallback reads
    ("5", "think 5 then <answer>7</answer>", 0.0),  # it (math_verify alone found the 5)
    ("1/2", "<answer>0.5</answer>", 1.0),
    ("7", "#### Step 2\nShe pays 2 + 5 = 7 dollars. The answer is 7.", 1.0),  # a heading
    ("1000000", "\\boxed{1000001}", 0.0),
    ("yes", "\\boxed{Yes}", 1.0),   # words compare as strings, not as products of symbols
    ("Paris", "\\boxed{Rome}", 0.0),
    ("46", "", 0.0),
    ("46", "\\boxed{46", 0.0),  # cut off inside the box: as the fallback reads it
    # LaTeX's thousands separator read as a product (1*000 = 0): both ways wrong
    ("1000", "\\boxed{1\\,000}", 1.0), ("12500", "\\boxed{12\\,500}", 1.0),
    ("0", "\\boxed{1\\,000}", 0.0), ("1000", "\\boxed{1{,}000}", 1.0),
    ("-5", "The answer is \u22125", 1.0),  # U+2212 in unmarked text: math_verify found nothing
    ("(1,234)", "\\boxed{(1,234)}", 1.0),  # a plain comma stays (a pair is not 1234)
])
def test_math_reward_with_math_verify(gold, completion, expected):
    assert math_reward(_item(gold), completion, []) == expected


def test_math_reward_falls_back_without_math_verify(monkeypatch):
    import rollout.rewards as rewards
    monkeypatch.setattr(rewards, "_has_math_verify", lambda: False)
    assert math_reward(_item("x+1"), "\\boxed{1+x}", []) == 0.0  # math_verify would say 1
    for gold, completion in (("46", "\\boxed{46}"), ("1/2", "\\boxed{0.5}"), (GSM8K_GOLD, "72")):
        assert math_reward(_item(gold), completion, []) == math_fallback(gold, completion) == 1.0


def test_extract_final_answer_prefers_box_then_markers():
    assert extract_final_answer("3 then \\boxed{x+1} then 5") == "x+1"
    assert extract_final_answer("3\n#### 7\n") == "7"
    assert extract_final_answer("1 2 3") == "3"
    assert extract_final_answer("none", last_number=False) is None


@pytest.mark.parametrize("completion, expected", [
    ("reasoning... <answer>42</answer>", 1.0),
    ("<answer>42</answer>\n", 1.0),
    ("work\n#### 42", 1.0),
    ("<answer></answer>", 0.0),
    ("<answer>42</answer> and more text", 0.0),
    ("#### ", 0.0),
    ("42", 0.0),
])
def test_format_reward(completion, expected):
    assert format_reward(_item("42"), completion, []) == expected


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                    reason="reasoning_gym not installed (optional)")
def test_reasoning_gym_passthrough():
    item = load_prompts("reasoning_gym:basic_arithmetic", num_prompts=1, seed=1)[0]
    assert reasoning_gym_reward(item, f"thinking <answer>{item.answer}</answer>", []) == 1.0
    assert reasoning_gym_reward(item, item.answer, []) == 1.0
    assert reasoning_gym_reward(item, "<answer>not it</answer>", []) == 0.0
    with pytest.raises(ValueError, match="prompt 0 .*only scores prompts loaded from"):
        reasoning_gym_reward(_item("1"), "1", [])


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                    reason="reasoning_gym not installed (optional)")
def test_reasoning_gym_reward_scores_with_the_configured_task():
    """decimal_arithmetic accepts an error of one unit in the last of max_num_decimal_places:
    0.0008 off passes at the default 3 places, not at 6 (the default config's scorer passed it)."""
    from decimal import Decimal

    def off(item, delta):
        return f"<answer>{Decimal(item.answer) + Decimal(delta)}</answer>"

    six = load_prompts("reasoning_gym:decimal_arithmetic", num_prompts=3, seed=0,
                       min_num_decimal_places=6, max_num_decimal_places=6)
    three = load_prompts("reasoning_gym:decimal_arithmetic", num_prompts=3, seed=0)
    assert [reasoning_gym_reward(it, off(it, "0.0008"), []) for it in six] == [0.0] * 3
    assert [reasoning_gym_reward(it, off(it, "0.0000008"), []) for it in six] == [1.0] * 3
    assert [reasoning_gym_reward(it, off(it, "0.0008"), []) for it in three] == [1.0] * 3


# ------------------------------------------------------------------------------------ resolve

@pytest.fixture
def user_module(monkeypatch):
    """A user reward module importable as `tandem_user_rewards`."""
    mod = types.ModuleType("tandem_user_rewards")
    mod.length = lambda item, text, ids: float(len(ids))
    mod.THRESHOLD = 3
    monkeypatch.setitem(sys.modules, "tandem_user_rewards", mod)
    return mod


def test_resolve_builtins_and_paths(user_module):
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("math") is math_reward
    assert resolve_reward("tandem_user_rewards:length")(_item("1"), "", [1, 2]) == 2.0
    combined = resolve_reward("exact_match", format_weight=0.5)
    assert combined(_item("1"), "1", []) == 1.0
    assert combined(_item("1"), "<answer>2</answer>", []) == 0.5
    # a user reward's None is named with a format weight too ("float() argument must be ...")
    with pytest.raises(TypeError, match=r"a reward must return a float, got None \(NoneType\)"):
        resolve_reward(lambda item, text, ids: None, format_weight=0.5)(_item("1"), "1", [])


@pytest.mark.parametrize("spec, pattern", [
    ("nope", r"reward 'nope' is neither a built-in .*'package.module:function'"),
    ("no_such_pkg_xyz.mod:fn", r"module 'no_such_pkg_xyz.mod' not found"),
    ("tandem_user_rewards:missing", r"module 'tandem_user_rewards' has no attribute 'missing'"),
    ("tandem_user_rewards:THRESHOLD", r"'THRESHOLD' is a int, not callable"),
    ("tandem_user_rewards:", r"neither a built-in"),
])
def test_resolve_errors_name_spec_and_cause(user_module, spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_reward(spec)


# ------------------------------------------------------------------------------------- runner

def test_runner_scores_in_order():
    with RewardRunner(exact_match, timeout_s=10.0) as runner:
        items = [_item(str(i), i) for i in range(6)]
        scores = runner.score_batch(items, ["0", "x", "2", "3", "", "5"], [[]] * 6)
        assert scores == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
        assert runner.submit(items[0], "0", []).result() == 1.0
        assert runner.stats() == {"calls": 7, "errors": 0, "timeouts": 0, "stuck": 0,
                                  "skipped": 0, "guarded": 0}


def test_raising_reward_scores_zero_counts_and_logs_first_traceback_once(caplog):
    def flaky(item, text, ids):
        if item.id % 2:
            raise RuntimeError(f"boom on {item.id}")
        return 1.0

    items = [_item("", i) for i in range(6)]
    with caplog.at_level(logging.ERROR, logger="tandem.reward"):
        with RewardRunner(flaky, timeout_s=10.0) as runner:
            scores = runner.score_batch(items, [""] * 6, [[]] * 6)
            stats = runner.stats()
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert stats["errors"] == 3 and stats["timeouts"] == 0
    failures = [r for r in caplog.records if r.name == "tandem.reward"]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert "RuntimeError: boom on" in caplog.text and "Traceback" in caplog.text


def test_a_reward_raising_timeout_error_is_an_error_not_a_time_out(caplog):
    """A reward's own TimeoutError (a socket time-out) is one of its errors: logged with its
    traceback, its call thread kept (Python 3.11's concurrent.futures.TimeoutError is the
    built-in one, which `Future.result(timeout=)` raised for both)."""
    import socket

    def reward(item, text, ids):
        raise socket.timeout(f"no answer from the grader for {item.id}")

    with caplog.at_level(logging.ERROR, logger="tandem.reward"):
        with RewardRunner(reward, timeout_s=5.0, max_workers=1) as runner:
            items = [_item("", i) for i in range(4)]
            assert runner.score_batch(items, [""] * 4, [[]] * 4) == [0.0] * 4
            assert runner.stats() == {"calls": 4, "errors": 4, "timeouts": 0, "stuck": 0,
                                      "skipped": 0, "guarded": 0}
    assert "TimeoutError: no answer from the grader for 0" in caplog.text


def test_bad_return_values_are_errors():
    # "1.0" too: float() parsed it, so a reward returning strings trained as if numbers
    values = iter(["abc", float("nan"), None, "1.0", b"1"])
    with RewardRunner(lambda item, text, ids: next(values), timeout_s=10.0, max_workers=1) as runner:
        assert runner.score_batch([_item("")] * 5, [""] * 5, [[]] * 5) == [0.0] * 5
        assert runner.stats()["errors"] == 5


def test_stuck_reward_times_out_without_blocking_others(caplog):
    release = threading.Event()

    def reward(item, text, ids):
        if text == "stuck":
            release.wait()  # stuck until the test releases it: overruns any time limit
        return 1.0

    try:
        with caplog.at_level(logging.WARNING, logger="tandem.reward"):
            with RewardRunner(reward, timeout_s=0.2, max_workers=1) as runner:
                # one supervisor: the second call only runs once the first is abandoned
                scores = runner.score_batch([_item("", 0), _item("", 1), _item("", 2)],
                                            ["stuck", "ok", "stuck"], [[]] * 3)
                stats = runner.stats()
        assert scores == [0.0, 1.0, 0.0]
        assert stats["timeouts"] == 2 and stats["errors"] == 0 and stats["stuck"] == 2
        assert caplog.text.count("exceeded reward.timeout_s=0.2") == 1
    finally:
        release.set()


def test_calls_reuse_their_threads_until_one_overruns():
    """Reward calls run on one persistent thread per supervisor (no thread start per call); a
    time-out replaces only the abandoned thread."""
    idents, release = [], threading.Event()

    def reward(item, text, ids):
        idents.append(threading.get_ident())
        if text == "stuck":
            release.wait()
        return 1.0

    try:
        with RewardRunner(reward, timeout_s=0.2, max_workers=1) as runner:
            assert runner.score_batch([_item("")] * 5, ["ok"] * 5, [[]] * 5) == [1.0] * 5
            assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
            assert runner.score_batch([_item("")] * 3, ["stuck", "ok", "ok"], [[]] * 3) == [0.0, 1.0, 1.0]
            assert idents[5] == idents[0] and idents[6] == idents[7] != idents[0]
        # closed: the idle call thread has ended (the abandoned one ends with its call)
        live = {t.ident for t in threading.enumerate()}
        deadline = time.monotonic() + 5
        while idents[6] in live and time.monotonic() < deadline:
            time.sleep(0.01)
            live = {t.ident for t in threading.enumerate()}
        assert idents[6] not in live
    finally:
        release.set()


def test_runner_argument_errors():
    with pytest.raises(ValueError, match="timeout_s > 0"):
        RewardRunner(exact_match, timeout_s=0)
    with RewardRunner(exact_match, timeout_s=1.0) as runner:
        with pytest.raises(ValueError, match="equal lengths"):
            runner.score_batch([_item("")], [], [])


# ------------------------------------------------------------------- degenerate completions

def test_markers_take_linear_time_on_degenerate_completions():
    """A degenerate completion (a tag or spaces repeated up to max_new_tokens) is scored in
    linear time. The regular expressions that found the markers were quadratic in it and ran in
    C holding the GIL, so the time limit could not stop them and the generator's decode loop
    stalled: these took 11 s, 7 s and 5 s (the bound below is 10x the new worst case on a busy
    2-core machine, and far below the old times)."""
    cases = [(math_fallback, "<answer>" * 20_000),                              # never closed
             (lambda g, c: format_reward(_item(g), c, []), "<answer>x</answer> y" * 10_000),
             (math_fallback, "#### 1" + " " * 40_000 + "x")]                    # not a last line
    for fn, completion in cases:
        t0 = time.perf_counter()
        assert fn("1", completion) == 0.0
        assert time.perf_counter() - t0 < 1.0, completion[:30]
    assert extract_final_answer("<answer>a<answer>b</answer> c <answer>d") == "a<answer>b"
    assert extract_final_answer("#### 5 \n\t\n") == "5"
    assert format_reward(_item(""), "<answer></answer> x <answer></answer>", []) == 1.0


def test_numbers_too_large_for_a_float_or_to_expand_score_as_strings():
    """The fallback compares numbers exactly: a number past 1e308 against a decimal gold raised
    OverflowError (counted and logged as a bug of the reward), and an exponent like 1e10000000
    was expanded by Fraction, 16 s holding the GIL (1e100000000 did not finish)."""
    from rollout.rewards import _to_fraction
    assert math_fallback("0.5", "\\boxed{1e400}") == 0.0
    assert math_fallback("0.5", "\\boxed{1" + "0" * 400 + "}") == 0.0
    assert math_fallback("1" + "0" * 400 + ".5", "\\boxed{1" + "0" * 400 + ".5}") == 1.0
    assert _to_fraction("1e10000000") is None and _to_fraction("1e-1_0000_000") is None
    assert _to_fraction("2.5e-003") == _to_fraction("0.0025") == _to_fraction("1/400")
    assert math_fallback("1e400", "\\boxed{1e400}") == 1.0          # still numbers
    assert math_fallback("1e10000000", "\\boxed{1e10000000}") == 1.0  # as strings
    assert math_fallback("1e10000000", "\\boxed{1e10000001}") == 0.0
    assert math_fallback("0.5", "\\boxed{0.500001}") == 1.0  # within 1e-6, exactly


def test_close_cancels_the_calls_not_started():
    """close() on a stuck reward waits for the running calls only: it ran every queued call to
    its time-out first, holding a generator's exit timeout_s per queued completion."""
    release = threading.Event()

    def stuck(item, text, ids):
        release.wait()
        return 1.0

    try:
        runner = RewardRunner(stuck, timeout_s=0.2, max_workers=1)
        futures = [runner.submit(_item("", i), "", []) for i in range(10)]
        runner.close()
        assert runner.stats()["calls"] <= 2 and sum(f.cancelled() for f in futures) >= 8
        assert all(f.result() == 0.0 for f in futures if not f.cancelled())
    finally:
        release.set()


def test_a_reward_module_whose_import_fails_on_a_missing_dependency_says_so(tmp_path, monkeypatch):
    """A user module that imports an uninstalled package was reported as itself not found
    ("module 'my_rewards_mod' not found"), so the user checked the wrong name."""
    (tmp_path / "tandem_test_rewards_mod.py").write_text(
        "import tandem_test_no_such_dependency\n\ndef score(item, text, ids):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"importing module 'tandem_test_rewards_mod' failed: a "
                                         r"module it imports is not installed \(No module named "
                                         r"'tandem_test_no_such_dependency'\)"):
        resolve_reward("tandem_test_rewards_mod:score")
    with pytest.raises(ValueError, match=r"module 'tandem_test_absent_mod' not found .* on PYTHONPATH"):
        resolve_reward("tandem_test_absent_mod:score")


def test_a_reward_that_cannot_take_the_three_arguments_is_refused_when_resolved(tmp_path, monkeypatch):
    """A user reward `score(completion, answer)` raised TypeError on every call: each scored 0.0,
    and the run trained on all-zero rewards to the end (rc 0) after one logged traceback.
    Refused when resolved (preflight), naming the signature to write; any signature that binds
    the call resolves."""
    (tmp_path / "tandem_test_sig_mod.py").write_text(
        "def score(completion, answer):\n    return 1.0\n"
        "def three(item, completion_text, completion_ids):\n    return 1.0\n"
        "def loose(item, *rest, extra=0, **kw):\n    return 1.0\n"
        "def too_many(item, text, ids, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("tandem_test_sig_mod:three")(None, "", []) == 1.0
    assert resolve_reward("tandem_test_sig_mod:loose", format_weight=0.5) is not None
    for name, sig in (("score", r"\(completion, answer\)"), ("too_many", r"\(item, text, ids, answer\)")):
        with pytest.raises(ValueError, match=rf"reward 'tandem_test_sig_mod:{name}' takes {sig}, .*"
                                             rf"define it as def {name}\(item, completion_text, "
                                             rf"completion_ids\) -> float"):
            resolve_reward(f"tandem_test_sig_mod:{name}")
    with pytest.raises(ValueError, match=r"reward '<lambda>' takes \(\)"):
        resolve_reward(lambda: 1.0)  # library use: a callable is checked too


def test_an_async_or_generator_reward_is_refused_when_resolved(tmp_path, monkeypatch):
    """An `async def` judge passed the signature check: every call returned a coroutine, scored
    0.0 as a bad return value, and the run trained on nothing to the end (rc 0)."""
    import functools
    (tmp_path / "tandem_test_async_mod.py").write_text(
        "async def judge(item, completion_text, completion_ids):\n    return 1.0\n"
        "def gen(item, completion_text, completion_ids):\n    yield 1.0\n"
        "async def agen(item, completion_text, completion_ids):\n    yield 1.0\n"
        "class Judge:\n    async def __call__(self, item, completion_text, completion_ids):\n"
        "        return 1.0\n"
        "judge_obj = Judge()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, kind in (("judge", "an async function"), ("gen", "a generator function"),
                       ("agen", "an async generator"), ("judge_obj", "an async function")):
        with pytest.raises(ValueError, match=rf"reward 'tandem_test_async_mod:{name}' is {kind}: "
                                             r"a call returns a .*make it a plain def"):
            resolve_reward(f"tandem_test_async_mod:{name}")
    import tandem_test_async_mod as mod
    with pytest.raises(ValueError, match="is an async function"):
        resolve_reward(functools.partial(mod.judge))


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                    reason="math_verify not installed (optional; make test installs it)")
def test_math_verify_is_not_asked_to_evaluate_huge_numbers():
    """verify() evaluated an answer like "10^{10^{10}}" exactly, in one big-integer power in C
    that holds the GIL: the reward's time limit could not stop it and the generator's decode
    loop froze for good ("(10^{7})!" stalled it 8 s at a time). Such answers compare as
    strings; powers and factorials of a sane size are still evaluated."""
    from rollout.rewards import _huge_number, _parse_latex
    assert _huge_number(_parse_latex("10^{10^{10}}")[0]) and _huge_number(_parse_latex("(10^{7})!")[0])
    cases = [("5", "\\boxed{2^{10^{9}}}", 0.0), ("5", "\\boxed{(10^{7})!}", 0.0),
             ("5", "\\boxed{(2^{10})^{10^{9}}}", 0.0),
             ("10^{10^{10}}", "\\boxed{10^{10^{10}}}", 1.0),  # the same string
             ("128", "\\boxed{2^{3+4}}", 1.0), ("1/8", "\\boxed{2^{-3}}", 1.0),
             ("120", "\\boxed{5!}", 1.0), ("x^{10^{10}}", "\\boxed{x^{10^{10}}}", 1.0)]
    with RewardRunner(math_reward, timeout_s=10.0, max_workers=1) as runner:
        scores = runner.score_batch([_item(g) for g, _, _ in cases], [c for _, c, _ in cases],
                                    [[]] * len(cases))
        assert runner.stats()["timeouts"] == 0 and runner.stats()["errors"] == 0
    assert scores == [want for _, _, want in cases]


def test_math_reward_reads_the_typeset_minus_sign_with_or_without_math_verify():
    """"\u22125" (U+2212, as typeset math writes it) scored 0 against "-5" in the fallback
    (math_verify reads it as a minus sign)."""
    assert math_reward(_item("-5"), "so \\boxed{\u22125}", []) == 1.0
    assert math_reward(_item("\u22125"), "The answer is \\boxed{-5}", []) == 1.0
    assert math_reward(_item("5"), "so \\boxed{\u22125}", []) == 0.0


# ----------------------------------------------------- blow-ups: guards and killable workers

needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                       reason="math_verify not installed (optional; make test "
                                              "installs it)")


def _depth(s: str) -> int:
    depth = deepest = 0
    for ch in s:
        depth += (ch in "([{") - (ch in ")]}")
        deepest = max(deepest, depth)
    return deepest


@needs_math_verify
def test_math_verify_is_handed_only_short_shallow_text(monkeypatch):
    """math_verify's parser took seconds to minutes on degenerate text, in pure Python or in
    regular expressions that hold the GIL: "\\boxed{((...(1)...))}" 50 deep took 10 s (250 deep
    never ended), a "1 1 1 ..." completion of 20k tokens froze every thread for 7 s, 10^6 digits
    took 600 MB. Such answers now compare as strings (0 here), counted in stats()["guarded"]."""
    import math_verify
    seen, parse = [], math_verify.parse

    def recording_parse(text, *args, **kwargs):
        seen.append(text)
        return parse(text, *args, **kwargs)

    monkeypatch.setattr(math_verify, "parse", recording_parse)
    cases = [("5", "\\boxed{" + "(" * 40 + "1" + ")" * 40 + "}", 0.0),   # too deep
             ("5", "\\boxed{" + "{" * 40 + "1" + "}" * 40 + "}", 0.0),
             ("5", "\\boxed{" + "+".join(["x"] * 2000) + "}", 0.0),       # too long
             ("5", "<answer>" + "9" * 100_000 + "</answer>", 0.0),
             ("5", "1 " * 20_000 + "so 5", 1.0),          # unmarked: math_verify reads its end
             ("5", "9" * 100_000 + " so 5", 1.0),
             ("\\frac{1}{1+\\frac{1}{1+\\frac{1}{2}}}", "\\boxed{\\frac{3}{5}}", 1.0)]  # 3 deep
    with RewardRunner(math_reward, timeout_s=30.0, max_workers=1, isolate=False) as runner:
        scores = runner.score_batch([_item(g) for g, _, _ in cases], [c for _, c, _ in cases],
                                    [[]] * len(cases))
        stats = runner.stats()
    assert scores == [want for _, _, want in cases]
    assert stats["guarded"] == 4 and stats["timeouts"] == stats["errors"] == 0
    assert seen and max(map(len, seen)) <= 5000 and max(map(_depth, seen)) <= 10


@needs_math_verify
@pytest.mark.parametrize("answer, huge", [
    ("(1+10^{-20})^{10^{30}}", True),   # a base within 1e-15 of 1 was skipped as exactly 1
    ("\\prod_{k=1}^{10^{8}} k", True),  # (10^8)! in C, holding the GIL
    ("\\sum_{k=1}^{10^{8}} k!", True),
    ("(x+1)^{10^{6}}", True),           # expanded: 3 GB in 10 s
    ("\\int_0^1 x^{10^{10}} dx", True),  # 1.3 GB in 15 s
    ("(1+10^{-2})^{3}", False), ("\\prod_{k=1}^{5} k", False), ("\\sum_{k=1}^{10} k", False),
    ("(x+1)^{3}", False), ("x^{300}", False), ("x^{2024}", True),
])
def test_huge_number_guard_covers_near_one_bases_products_sums_and_symbolic_powers(answer, huge):
    from rollout.rewards import _huge_number, _parse_latex
    assert any(_huge_number(x) for x in _parse_latex(answer)) == huge


@needs_math_verify
def test_sane_products_sums_and_symbolic_powers_are_still_verified():
    cases = [("120", "\\boxed{\\prod_{k=1}^{5} k}", 1.0),  # 5! = 120, 1+...+10 = 55, 1.01^3
             ("55", "\\boxed{\\sum_{k=1}^{10} k}", 1.0),
             ("(x+1)^{3}", "\\boxed{(1+x)^{3}}", 1.0),
             ("1.030301", "\\boxed{(1+10^{-2})^{3}}", 1.0),
             ("5", "\\boxed{(1+10^{-20})^{10^{30}}}", 0.0),
             ("5", "\\boxed{\\prod_{k=1}^{10^{8}} k}", 0.0)]
    with RewardRunner(math_reward, timeout_s=30.0, max_workers=1, isolate=False) as runner:
        scores = runner.score_batch([_item(g) for g, _, _ in cases], [c for _, c, _ in cases],
                                    [[]] * len(cases))
        assert runner.stats()["timeouts"] == 0 and runner.stats()["guarded"] == 2
    assert scores == [want for _, _, want in cases]


def test_fallback_numbers_are_bounded_whatever_the_int_digit_limit(monkeypatch):
    """int(str) is quadratic in the digits and holds the GIL; only Python's default limit of
    4300 digits (which any library may lift: sys.set_int_max_str_digits(0)) kept the fallback
    from parsing a 10^6-digit answer."""
    from rollout.rewards import _to_fraction
    monkeypatch.setattr(sys, "get_int_max_str_digits", sys.get_int_max_str_digits)
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        assert _to_fraction("9" * 50_000) is None and _to_fraction("0." + "9" * 50_000) is None
        assert math_fallback("9" * 50_000, "\\boxed{" + "9" * 50_000 + "}") == 1.0  # strings
        assert _to_fraction("9" * 300) == int("9" * 300)
    finally:
        sys.set_int_max_str_digits(before)


def hangs_on_request(item, text, ids):
    """An importable reward (tests.test_rewards:hangs_on_request) for the worker processes."""
    import os
    if text == "hang":
        threading.Event().wait()  # a reward that never returns
    if text == "crash":
        os._exit(3)  # a reward that takes its process down (a segfault in an extension)
    if text == "raise":
        raise RuntimeError(f"boom on {item.id}")
    return float(os.getpid())


def _gone(pid: int) -> bool:
    import os
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_an_isolated_reward_that_overruns_is_killed_not_abandoned(caplog):
    """A thread cannot be killed: each time-out left a thread running the reward (CPU, memory,
    and the GIL taken from the decode loop, which ran 100x slower with 8 stuck); a reward in C
    that holds the GIL froze the process. In a worker process it is killed at its time-out."""
    import os
    with caplog.at_level(logging.WARNING, logger="tandem.reward"):
        with RewardRunner(hangs_on_request, timeout_s=0.5, max_workers=1, isolate=True) as runner:
            first = runner.submit(_item("", 0), "pid", []).result()
            scores = runner.score_batch([_item("", i) for i in range(1, 4)],
                                        ["hang", "pid", "hang"], [[]] * 3)
            stats = runner.stats()
    assert first not in (0.0, os.getpid()) and scores[1] not in (0.0, first)  # a new worker
    assert scores[0] == scores[2] == 0.0 and _gone(int(first)) and _gone(int(scores[1]))
    assert stats == {"calls": 4, "errors": 0, "timeouts": 2, "stuck": 0, "skipped": 0,
                     "guarded": 0}
    assert caplog.text.count("exceeded reward.timeout_s=0.5") == 1 and "killed" in caplog.text


def test_an_isolated_reward_that_raises_or_dies_scores_zero_and_is_logged_once(caplog):
    with caplog.at_level(logging.ERROR, logger="tandem.reward"):
        with RewardRunner(hangs_on_request, timeout_s=10.0, max_workers=1, isolate=True) as runner:
            texts = ["raise", "pid", "crash", "pid", "raise"]
            scores = runner.score_batch([_item("", i) for i in range(5)], texts, [[]] * 5)
            stats = runner.stats()
    assert scores[0] == scores[2] == scores[4] == 0.0 and scores[1] != scores[3]  # restarted
    assert stats["errors"] == 3 and stats["timeouts"] == 0 and stats["calls"] == 5
    assert len([r for r in caplog.records if r.name == "tandem.reward"]) == 1
    assert "RuntimeError: boom on 0" in caplog.text and "Traceback" in caplog.text


def test_math_reward_runs_in_a_worker_process_others_in_threads():
    assert resolve_reward("math").isolate and resolve_reward("math", format_weight=0.5).isolate
    deep = "\\boxed{" + "(" * 20 + "46" + ")" * 20 + "}"  # guarded (with math_verify)
    with RewardRunner(resolve_reward("math", format_weight=0.5), timeout_s=30.0) as runner:
        assert runner.isolated
        assert runner.score_batch([_item("46")] * 3, ["<answer>46</answer>", "47", deep],
                                  [[]] * 3) == [1.5, 0.0, 0.0]
        # counted in the worker, summed here
        assert runner.stats()["guarded"] == int(importlib.util.find_spec("math_verify") is not None)
    with RewardRunner(exact_match, timeout_s=1.0) as runner:
        assert not runner.isolated
    with pytest.raises(ValueError, match=r"cannot run in a worker process.*module level"):
        RewardRunner(lambda item, text, ids: 1.0, timeout_s=1.0, isolate=True)


def test_too_many_stuck_threads_stop_the_calls_loudly_until_they_end(caplog):
    """Stuck call threads piled up without bound, each taking CPU from the decode loop."""
    release = threading.Event()

    def reward(item, text, ids):
        if text == "stuck":
            release.wait()
        return 1.0

    try:
        with caplog.at_level(logging.ERROR, logger="tandem.reward"):
            with RewardRunner(reward, timeout_s=0.2, max_workers=1, max_stuck=2) as runner:
                scores = runner.score_batch([_item("", i) for i in range(4)],
                                            ["stuck", "stuck", "ok", "ok"], [[]] * 4)
                stats = runner.stats()
                release.set()
                deadline = time.monotonic() + 10
                while runner.stats()["stuck"] and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert runner.score_batch([_item("")], ["ok"], [[]]) == [1.0]  # calls again
        assert scores == [0.0] * 4
        assert stats == {"calls": 2, "errors": 0, "timeouts": 2, "stuck": 2, "skipped": 2,
                         "guarded": 0}
        assert caplog.text.count("2 calls of reward") == 1
    finally:
        release.set()


def test_reward_isolate_setting_picks_processes_or_threads():
    """reward.isolate: 'auto' follows the reward's own attribute (math: processes), 'process' and
    'thread' override it either way, for the reward with its format term too."""
    from config import load_config
    from rollout.rewards import reward_runner
    got = {}
    for fn, isolate in (("math", "auto"), ("math", "thread"), ("exact_match", "auto"),
                        ("exact_match", "process")):
        cfg = load_config(None, [f"--reward.fn={fn}", f"--reward.isolate={isolate}",
                                 "--reward.format_weight=0.1"])
        runner = reward_runner(cfg.reward)
        got[fn, isolate] = runner.isolated
        runner.close()
    assert got == {("math", "auto"): True, ("math", "thread"): False,
                   ("exact_match", "auto"): False, ("exact_match", "process"): True}


def test_reward_workers_setting_runs_that_many_calls_at_once():
    """reward.workers: calls of a reward that waits (an HTTP judge) run that many at once; the
    runner's 2 were fixed, and a 0.3 s judge held 256 samples a step for ~38 s."""
    from config import load_config
    from rollout.rewards import reward_runner
    cfg = load_config(None, ["--reward.fn=tests.test_rewards:_waiting_reward", "--reward.workers=6"])
    with reward_runner(cfg.reward) as runner:
        assert runner.score_batch([_item("")] * 12, [""] * 12, [[]] * 12) == [1.0] * 12
    assert max(_WAITING["peak"]) == 6


_WAITING = {"now": 0, "peak": [0], "lock": threading.Lock()}


def _waiting_reward(item, completion_text, completion_ids):
    with _WAITING["lock"]:
        _WAITING["now"] += 1
        _WAITING["peak"].append(_WAITING["now"])
    time.sleep(0.3)
    with _WAITING["lock"]:
        _WAITING["now"] -= 1
    return 1.0


def _unloadable_reward(item, completion_text, completion_ids):
    return 1.0


def _failing_warm_up():
    raise RuntimeError("the judge model is not on this machine")


_unloadable_reward.isolate, _unloadable_reward.warm_up = True, _failing_warm_up


def test_a_reward_that_cannot_load_in_a_worker_starts_one_worker_not_one_a_call(monkeypatch):
    """A worker process that fails to load the reward (its warm_up raised) failed every call,
    each in a fresh interpreter started for it (~1 s of imports a call). The first failure is
    kept: later calls score 0.0 as errors at once, naming it."""
    from types import SimpleNamespace
    from rollout import rewards as R
    starts = []
    real = R._CallProcess.__init__

    def counted(self, fn_pickle):
        starts.append(1)
        real(self, fn_pickle)
    monkeypatch.setattr(R._CallProcess, "__init__", counted)
    runner = R.RewardRunner(_unloadable_reward, timeout_s=60, max_workers=1)
    try:
        item = SimpleNamespace(id="p0", answer="1")
        scores = [runner.submit(item, "1", [1]).result() for _ in range(3)]
    finally:
        runner.close()
    assert scores == [0.0, 0.0, 0.0] and len(starts) == 1
    assert runner.stats()["errors"] == 3
