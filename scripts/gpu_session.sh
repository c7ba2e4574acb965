#!/usr/bin/env bash
# A GPU session, one device call per command (each under 7 minutes), run from the repository root
# on the GPU machine with its preinstalled jax:
#   bash scripts/gpu_session.sh                      # record 1: env, smoke (each kernel alone), pytest -m gpu
#   bash scripts/gpu_session.sh --command check      # record 2: compute-sanitizer (with a planted race), training check
#   bash scripts/gpu_session.sh --command e2e        # FP8 vs BF16: the layer and the routed-expert block
#   bash scripts/gpu_session.sh --command step       # FP8 vs BF16: the training step, profiled
#   bash scripts/gpu_session.sh --command losses     # README's front door: 100 steps each, the loss gap
#   bash scripts/gpu_session.sh --command bench      # the benchmarks against their baselines
#   bash scripts/gpu_session.sh --command bisect     # when device time is left: config bisection, ncu, Mosaic profile
#   bash scripts/gpu_session.sh --command tune_gemm  # optional: the tuning tables (tune_grouped likewise)
# Set JFP8_COMMIT and JFP8_DIRTY where the tree has no .git (docs/gpu.md, "The one plan").
# Results under $OUT (else benchmarks/results); the log streams as it runs. Anywhere:
#   python benchmarks/gpu_session.py --dry-run      # a window's calls' plans, in order
#   python benchmarks/gpu_session.py --rehearse     # CPU: the same plumbing, kernels in the interpreter
# See benchmarks/gpu_session.py. Uses the machine's python3; JFP8_PYTHON overrides it.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${JFP8_PYTHON:-python3}" benchmarks/gpu_session.py "$@"
