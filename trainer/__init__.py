"""The trainer role: RL math and the trajectory buffer, as small pure pieces.

- `batch`:      `Trajectory` / `Group` (what the generator sends) and `PackedBatch` (padding-free
                packed sequences the trainer runs forward on), plus dynamic micro-batching.
- `advantages`: group baselines (LlamaRL group mean, GRPO, RLOO).
- `losses`:     AIPO (LlamaRL, default), PPO-clip, decoupled PPO (AReaL), token IS weights,
                KL estimators, entropy and log-prob helpers. Every loss returns a SUM over tokens;
                the caller divides by the global token count so gradient accumulation over
                micro-batches and data-parallel ranks equals one big batch.
- `buffer`:     the bounded off-policy buffer with AReaL's staleness gate (no transport).

Formulas come from shared/REFERENCES.md; each function cites the one it implements.
"""
