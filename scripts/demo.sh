#!/usr/bin/env bash
# The main job, from a clean clone: sets up .venv and runs the numerics demo (quantize, multiply,
# print the error table). Extra arguments go to experiments/demo_numerics.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh"
cd "$repo"
exec python experiments/demo_numerics.py "$@"
