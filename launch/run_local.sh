#!/usr/bin/env bash
# Single-node launcher: one torchrun, NPROC ranks, driven by environment variables.
#
#   launch/run_local.sh                                    # tiny CPU demo, 3 ranks
#   CONFIG=configs/tiny_cpu.toml NPROC=4 LOG_RANK=0 launch/run_local.sh --trainer.lr=1e-4
#
# CONFIG       TOML preset, relative to the repo root    (default configs/tiny_cpu.toml)
# NPROC        ranks (= world size)                      (default: derived from CONFIG, see below)
# PYTHON       interpreter                               (default .venv/bin/python, else python3)
# LOG_RANK     local ranks shown on the console, "0,2" or "all"   (default all)
#              Every rank's lines, prefixed [rankN]: train_rl.py keeps each role to its own few
#              (rank 0 the rank map, the first trainer rank the step lines, the first generator
#              rank its set-up, weight-sync and eval lines; logging.log_rank). LOG_RANK=0 shows
#              the trainer's alone; the filtered ranks' output is still kept in LOG_DIR.
# MAX_RESTARTS torchrun restarts of the whole worker group (default 0)
# RDZV_PORT    fixed rendezvous port                     (default: a free port, via --standalone)
# LOG_DIR      where torchrun keeps every rank's stdout/stderr (default runs/torchrun_logs)
# Arguments are passed through to train_rl.py as --section.key=value overrides.
set -euo pipefail

# train_rl.py, config.py and the default runs/ folder are all relative to the repo root.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CONFIG=${CONFIG:-configs/tiny_cpu.toml}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LOG_RANK=${LOG_RANK:-all}  # the generator's eval and weight-sync lines come from its own rank
MAX_RESTARTS=${MAX_RESTARTS:-0}
LOG_DIR=${LOG_DIR:-runs/torchrun_logs}

# The config does not store the world size: it is pinned only when the trainer's FSDP degree
# (split) or the replica count (colocated) is set. Otherwise take the smallest world in which the
# trainer mesh really shards (2 FSDP ranks): 1 generator + 2 trainers = 3 for the tiny demo.
# resolve() then checks the layout (for NPROC when given), so a bad config or override fails
# here, before any rank starts.
if [[ -n "${NPROC:-}" && ! "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_local.sh: NPROC=$NPROC must be a number of ranks (e.g. NPROC=3), or unset to derive it" \
       "from the config" >&2
  exit 2
fi
NPROC=$("$PYTHON" - "$CONFIG" "${NPROC:-}" "$@" <<'PY'
import math, sys
from config import ConfigError, load_config, parse_cli
try:
    path, overrides, _ = parse_cli(sys.argv[3:])  # a --config among the arguments wins, as in train_rl.py
    cfg = load_config(path or sys.argv[1], overrides)
except ConfigError as e:  # a key or value of the file or the overrides: NPROC has no part in it
    sys.exit(f"run_local.sh: {e}")
p = cfg.parallel
trainer = p.trainer_tp * (p.trainer_fsdp or 2)
if sys.argv[2]:
    world = int(sys.argv[2])
elif p.mode == "split":
    world = p.generator_ranks + trainer
else:
    world = p.gen_tp * p.gen_dp if p.gen_dp else math.lcm(p.gen_tp, trainer)
try:
    cfg.resolve(world)
except ConfigError as e:
    how = (f"NPROC={world}" if sys.argv[2] else
           f"{world} ranks, derived from the config as NPROC was unset; set NPROC for another world")
    sys.exit(f"run_local.sh: {e} ({how})")
print(world)
PY
)
# torchrun answers a malformed value with a traceback, and a LOG_RANK that names no rank with a
# console that stays empty to the end of the run
if [[ ! "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "run_local.sh: MAX_RESTARTS=$MAX_RESTARTS must be a count of restarts (0 or more)" >&2
  exit 2
fi
if [[ "$LOG_RANK" != all ]]; then
  if [[ ! "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    echo "run_local.sh: LOG_RANK=$LOG_RANK must be local ranks such as 0 or 0,2, or all" >&2
    exit 2
  fi
  for r in ${LOG_RANK//,/ }; do
    if (( 10#$r >= NPROC )); then
      echo "run_local.sh: LOG_RANK=$LOG_RANK names local rank $r, but NPROC=$NPROC ranks are" \
           "0..$((NPROC - 1)); pick ranks among them, or LOG_RANK=all" >&2
      exit 2
    fi
  done
fi

# --standalone picks a free port and ignores --rdzv-endpoint, so a fixed port needs explicit c10d.
if [[ -n "${RDZV_PORT:-}" ]]; then
  rdzv=(--nnodes 1 --rdzv-backend c10d --rdzv-endpoint "localhost:$RDZV_PORT")
else
  rdzv=(--standalone)
fi
# Without --tee, ranks removed by the filter lose their stderr (tracebacks included) entirely;
# teeing keeps every rank's output in LOG_DIR and prefixes console lines with [rankN].
logs=(--role rank --tee 3 --log-dir "$LOG_DIR")
if [[ "$LOG_RANK" != all ]]; then logs+=(--local-ranks-filter "$LOG_RANK"); fi

cmd=("$PYTHON" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node "$NPROC"
     --max-restarts "$MAX_RESTARTS" "${logs[@]}" train_rl.py --config "$CONFIG" "$@")
echo "+ ${cmd[*]}" >&2
# torchrun's own default for several ranks a node, set here: it prints a 4-line banner when it
# sets it (one rank keeps every core)
if (( NPROC > 1 )); then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
exec "${cmd[@]}"
