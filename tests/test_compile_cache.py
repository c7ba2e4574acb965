"""jax's persistent compilation cache as the training scripts switch it on (`jfp8.train.compile_cache`):
where it goes, what overrides it, and that a second process reads the first one's executables."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO

# A program that takes XLA a while to compile on the CPU (an unrolled chain of matmuls), timed
# in-process: compile seconds, and whether jax read it from the cache.
PROBE = """
import json, time, jax, jax.numpy as jnp
from jfp8.train import compile_cache
where = compile_cache.enable()
def f(x):
    for i in range(60):
        x = jnp.tanh(x @ x.T + i)
    return x
lowered = jax.jit(f).trace(jax.ShapeDtypeStruct((64, 64), jnp.float32)).lower()
t0 = time.perf_counter(); lowered.compile(); seconds = time.perf_counter() - t0
print(json.dumps(dict(where=where, seconds=seconds, config=jax.config.jax_compilation_cache_dir)))
"""


def _probe(env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JFP8_COMPILE_CACHE")}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**base, **env}, capture_output=True,
                          text=True, check=True, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_reads_the_first_ones_executables(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    first, second = _probe(env), _probe(env)
    cache = tmp_path / "jfp8" / "jax-compile"
    assert first["where"] == second["where"] == first["config"] == str(cache)
    assert any(cache.iterdir()), "nothing was written"
    assert second["seconds"] < first["seconds"] / 2, (first, second)


def test_the_users_own_setting_and_the_switch_win(tmp_path):
    own = tmp_path / "mine"
    got = _probe({"XDG_CACHE_HOME": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": str(own)})
    assert got["where"] == got["config"] == str(own)
    assert not (tmp_path / "jfp8").exists()
    off = _probe({"XDG_CACHE_HOME": str(tmp_path), "JFP8_COMPILE_CACHE": "0"})
    assert off["where"] is None and not off["config"]


def test_the_suite_shares_one_fresh_cache_of_its_own():
    """conftest.py: this session's processes share a temporary cache folder (not ~/.cache, not a
    developer's JAX_COMPILATION_CACHE_DIR), or none with JFP8_TEST_COMPILE_CACHE=0."""
    import pathlib
    import tempfile

    import jax

    if os.environ.get("JFP8_TEST_COMPILE_CACHE", "1") == "0":
        assert not os.environ.get("JAX_COMPILATION_CACHE_DIR")
        return
    folder = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert folder == pathlib.Path(os.environ["JFP8_TEST_SESSION_CACHE"]) == pathlib.Path(jax.config.jax_compilation_cache_dir)
    assert folder.parent == pathlib.Path(tempfile.gettempdir()) and folder.name.startswith("jfp8-test-compile-cache-")
    assert folder.is_dir()
