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
# install_into DIR REQUIREMENTS WHAT: pip-installs REQUIREMENTS into DIR once (DIR/.installed),
# through DIR.tmp so that an interrupted install leaves nothing half-done.
install_into() {
    local target="$1" requirements="$2" what="$3"
    [ -f "$target/.installed" ] && return 0
    echo "installing $what into $target, once ..." >&2
    mkdir -p "$(dirname "$target")"
    rm -rf "$target.tmp"
    if ! "$py" -m pip install -q --no-deps --target "$target.tmp" -r "$requirements" >"$target.log" 2>&1; then
        echo "could not install $what (see $target.log): $(grep -m1 -i error "$target.log" || true)" >&2
        rm -rf "$target.tmp"
        exit 1
    fi
    rm -rf "$target"
    mv "$target.tmp" "$target"
    touch "$target/.installed"
}
install_into "$dir" "$reqs" "the Hopper build toolchain (~270 MB)"
if [ "${JFP8_HOPPER_CUDNN:-0}" = 1 ]; then
    install_into "$dir-cudnn" "$repo/benchmarks/hopper/requirements-cudnn.txt" "cuDNN for the Hopper build (~900 MB)"
fi
echo "$dir"
