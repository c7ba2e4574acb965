#!/usr/bin/env bash
# The test suite, from a clean clone: sets up .venv (pinned jax 0.11.2, CPU) and runs pytest.
# Tests marked `gpu` skip themselves without a Hopper GPU. Extra arguments go to pytest.
# JFP8_TEST_WORKERS: pytest-xdist worker processes (default 2; 0 runs in this process). Each test
# module stays on one worker (--dist loadscope), so module fixtures (a trained tiny run, the
# benchmark records) are built once. The processes share one jax compilation cache in a fresh temporary
# folder, removed at the end (tests/conftest.py; JFP8_TEST_COMPILE_CACHE=0 runs without it).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh"
cd "$repo"
# The deviceless Hopper build's toolchain (jax's CUDA plugin, ptxas; tests/test_hopper_build.py
# compiles the default kernels for sm_90a with it). Without a package index the test says so and skips.
bash scripts/hopper_toolchain.sh >/dev/null || echo "the Hopper build toolchain did not install: its CI check will skip" >&2
set +e
python -m pytest -q --durations=15 -n "${JFP8_TEST_WORKERS:-2}" --dist loadscope "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating that as a failure" >&2
    exit 1
fi
exit "$rc"
