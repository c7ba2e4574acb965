#!/usr/bin/env bash
# Installs the deviceless Hopper build's toolchain (benchmarks/hopper/requirements.txt:
# jax's CUDA plugin, ptxas, nvcc, nvdisasm; no GPU or driver needed) and prints its directory.
# It goes to a cache shared by every clone, keyed by the pins (set JFP8_HOPPER_TOOLCHAIN to choose
# the directory), so CI installs it once per machine. Needs scripts/env.sh's .venv (its Python
# picks the plugin's wheel). Exit status 1, with the reason on stderr, when it cannot install.
# JFP8_HOPPER_CUDNN=1 also installs cuDNN (benchmarks/hopper/requirements-cudnn.txt) into
# "<directory>-cudnn" beside it, for a deviceless step with cuDNN's fused attention.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
reqs="$repo/benchmarks/hopper/requirements.txt"
py="${JFP8_VENV:-$repo/.venv}/bin/python"
if [ ! -x "$py" ]; then
    echo "no project environment at ${JFP8_VENV:-$repo/.venv}: run 'source scripts/env.sh' first" >&2
    exit 1
fi
key="$( (cat "$reqs"; "$py" -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-12)"
dir="${JFP8_HOPPER_TOOLCHAIN:-${XDG_CACHE_HOME:-$HOME/.cache}/jfp8/hopper-toolchain-$key}"
if [ ! -f "$dir/.installed" ]; then
    echo "installing the Hopper build toolchain into $dir (~270 MB, once) ..." >&2
    mkdir -p "$(dirname "$dir")"
    rm -rf "$dir.tmp"
    if ! "$py" -m pip install -q --no-deps --target "$dir.tmp" -r "$reqs" >"$dir.log" 2>&1; then
        echo "could not install the Hopper build toolchain (see $dir.log): $(grep -m1 -i error "$dir.log" || true)" >&2
        rm -rf "$dir.tmp"
        exit 1
    fi
    rm -rf "$dir"
    mv "$dir.tmp" "$dir"
    touch "$dir/.installed"
fi
if [ "${JFP8_HOPPER_CUDNN:-0}" = 1 ] && [ ! -f "$dir-cudnn/.installed" ]; then
    echo "installing cuDNN for the Hopper build into $dir-cudnn (~900 MB, once) ..." >&2
    rm -rf "$dir-cudnn.tmp"
    if ! "$py" -m pip install -q --no-deps --target "$dir-cudnn.tmp" -r "$repo/benchmarks/hopper/requirements-cudnn.txt" \
            >"$dir-cudnn.log" 2>&1; then
        echo "could not install cuDNN for the Hopper build (see $dir-cudnn.log): $(grep -m1 -i error "$dir-cudnn.log" || true)" >&2
        rm -rf "$dir-cudnn.tmp"
        exit 1
    fi
    rm -rf "$dir-cudnn"
    mv "$dir-cudnn.tmp" "$dir-cudnn"
    touch "$dir-cudnn/.installed"
fi
echo "$dir"
