#!/usr/bin/env bash
# One command for a GPU session (issue #4), run from anywhere on the GPU machine:
#   bash scripts/gpu_session.sh [--gemm-config tile_m=128,...] [--budget-s 540] [--stages env,...]
# Environment, `pytest -m gpu`, the dense / grouped / quantize benchmarks, the jfp8 kernels' SASS
# (QGMMA/HGMMA counts), compute-sanitizer memcheck + racecheck and the fp8_linear layer benchmark,
# each with its own timeout; results under $OUT (else benchmarks/results), a short table at the
# end. `--stages tune_gemm` / `--stages tune_grouped` (each a call of its own) tune the GEMMs'
# configs.
# See experiments/gpu_session.py. Uses the machine's python3 (its image has jax with CUDA, torch,
# triton); JFP8_PYTHON overrides it.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${JFP8_PYTHON:-python3}" experiments/gpu_session.py "$@"
