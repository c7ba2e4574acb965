#!/usr/bin/env bash
# The main job, from a clean clone: sets up .venv, then trains the tiny DeepSeek-style MoE twice
# on the Shakespeare corpus -- DeepSeek-V3 FP8 recipe vs BF16, same seed and data order -- and
# writes runs/parity-tiny/{summary.json,parity.png}. A few minutes on a CPU.
# Extra arguments go to experiments/compare_precision.py (e.g. --steps 400 --out runs/x).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh"
cd "$repo"
exec python experiments/compare_precision.py --preset tiny --steps 200 --out runs/parity-tiny "$@"
