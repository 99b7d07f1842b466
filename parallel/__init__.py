"""Parallelism applied from outside model/: meshes (dims, mesh), TP/FSDP2 (sharding), layouts."""
