"""A tiny random policy with the project's character tokenizer (see tools/make_tiny_model.py)."""
from tools.make_tiny_model import make_random_model


def make_rl_model(folder, seed: int = 0, hidden: int = 32) -> str:
    return make_random_model(folder, hidden=hidden, seed=seed)


def length_reward(item, completion_text: str, completion_ids) -> float:
    """A user reward (loaded as `tests.rl_model:length_reward`) that varies even for a random
    policy, so end-to-end runs have non-zero advantages and the weights really move."""
    return len(completion_ids) / 8.0
