"""A tiny random policy with the project's character tokenizer (see tools/make_tiny_model.py)."""
from tools.make_tiny_model import make_random_model


def make_rl_model(folder, seed: int = 0, hidden: int = 32) -> str:
    return make_random_model(folder, hidden=hidden, seed=seed)
