"""Launchers: `run_local.sh` (one node, torchrun), `tandem.sbatch` (SLURM, one torchrun per node,
job arrays), and `sweep.py` (grid of --section.key overrides -> checked runs, local or SLURM)."""
