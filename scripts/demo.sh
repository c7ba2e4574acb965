#!/usr/bin/env bash
# The main job, from a clean clone: sets up .venv, then trains the tiny DeepSeek-style MoE twice
# on the Shakespeare corpus -- DeepSeek-V3 FP8 recipe vs BF16, same seed and data order -- and
# writes runs/parity-tiny/{summary.json,parity.png}, and reads the gap against the committed band
# (seeds and machines). Each run shows a progress bar for training, then one for its evaluation on
# the whole validation split.
# Wall time on the 2-core CPU machine, nothing else running (2026-11-28, commit be47d59): 1 min 43 s
# for a first run from a fresh clone with an empty compile cache, creating .venv included (pip's
# cache warm; 1 min 55 s at 138d52e); on a slower 2-core machine later that day 2 min 35 s at
# 6a50ad3, 2 min 34 s at 67f73f4, 2 min 20 s at bdc16f4 and 2 min 24 s at 15e9b69 (same gap, -0.980 %, to all digits:
# the machine, not the change, moved it from -0.103 %); 54 s for a second run, whose compiled steps come from jax's persistent cache
# (~/.cache/jfp8/jax-compile; JFP8_COMPILE_CACHE=0 turns it off).
# Extra arguments go to experiments/compare_precision.py (e.g. --steps 400 --out runs/x).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh"
cd "$repo"
exec python experiments/compare_precision.py --preset tiny --steps 200 --out runs/parity-tiny "$@"
