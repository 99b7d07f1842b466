"""The generator role: everything between a prompt and a scored trajectory.

- `data`:    prompt datasets (synthetic tasks, .jsonl/.parquet, reasoning_gym), validation, the
             length filter, prompt rendering to ids, and the sharded, resumable `PromptSource`.
- `tasks`:   built-in synthetic tasks with exact verifiers (the CPU demo's data).
- `rewards`: built-in rewards, `resolve_reward(spec)`, and `RewardRunner`, which scores off the hot
             path and turns a failing or stuck reward into 0.0 instead of a crash.

This package optimises nothing: it produces trajectories for the trainer.
"""
