"""The distributed tests' harness: real gloo ranks on CPU (see parallel/spawn.py)."""
from parallel.spawn import free_port, run_ranks  # noqa: F401
