"""Trainer -> generator weight sync (LlamaRL's DDMA, arXiv 2505.24034): every trainer rank sends
only its own shard, directly to the generator ranks whose boxes need it; no rank gathers the
model. `weights_sync.plan.plan` derives the typed transfers from two `parallel.layout.Layout`s
as a pure function (ReaL-style, arXiv 2406.14088); executors per transport run the plan."""
