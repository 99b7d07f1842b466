"""A tiny random policy with the project's character tokenizer (see tools/make_tiny_model.py)."""
import os

from tools.make_tiny_model import make_random_model


def make_rl_model(folder, seed: int = 0, hidden: int = 32) -> str:
    return make_random_model(folder, hidden=hidden, seed=seed)


def length_reward(item, completion_text: str, completion_ids) -> float:
    """A user reward (loaded as `tests.rl_model:length_reward`) that varies even for a random
    policy, so end-to-end runs have non-zero advantages and the weights really move."""
    return len(completion_ids) / 8.0


def counted_length_reward(item, completion_text: str, completion_ids) -> float:
    """`length_reward` that also appends a line to `$TANDEM_TEST_REWARD_CALLS/<RANK>` a call:
    which ranks scored, and how often."""
    with open(os.path.join(os.environ["TANDEM_TEST_REWARD_CALLS"], os.environ["RANK"]), "a") as f:
        f.write(f"{len(completion_ids)}\n")
    return length_reward(item, completion_text, completion_ids)


def two_argument_reward(completion_text: str, answer: str) -> float:
    """A reward written against another signature (tests/test_bad_input.py): refused at start-up."""
    return float(completion_text == answer)


def raising_reward(item, completion_text: str, completion_ids) -> float:
    """A user reward whose every call fails (a judge that is down): scored 0.0 and counted."""
    raise RuntimeError("the judge is down")
