#!/usr/bin/env bash
# The main job, from a clean clone: sets up .venv, then trains the tiny DeepSeek-style MoE twice
# on the Shakespeare corpus -- DeepSeek-V3 FP8 recipe vs BF16, same seed and data order -- and
# writes runs/parity-tiny/{summary.json,parity.png}, and reads the gap against the committed band
# (seeds and machines). Each run shows a progress bar for training, then one for its evaluation on
# the whole validation split.
# Wall time, measured on a clean 2-core CPU machine: 2 min 27 s (2026-11-26, nothing else running;
# setup excluded: a first run also creates .venv, 41 s more here with pip's cache warm).
# Extra arguments go to experiments/compare_precision.py (e.g. --steps 400 --out runs/x).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh"
cd "$repo"
exec python experiments/compare_precision.py --preset tiny --steps 200 --out runs/parity-tiny "$@"
