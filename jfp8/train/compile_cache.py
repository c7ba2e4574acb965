"""jax's persistent compilation cache for jfp8's training scripts.

A training script compiles its train and eval steps on every start: on the 2-core CPU machine
8.5 s for `tiny`'s FP8 train step (BF16: 5.2 s). jax can keep compiled executables on disk, keyed
by the program, the compile options and the jax/jaxlib versions (a changed model or recipe is a
new key; nothing stale is read back), so a second start with the same program skips XLA's compile
and only traces and lowers: measured on that machine, `tiny`'s FP8 train step from 8.5 s to 2.2 s
and BF16's from 5.2 s to 1.0 s (`benchmarks/cpu_pace.py --cache`, docs/results.md).

`enable()` switches it on for this process, in `$XDG_CACHE_HOME/jfp8/jax-compile` (~/.cache/...)
unless the user chose otherwise: `JAX_COMPILATION_CACHE_DIR` (jax's own setting) wins, and
`JFP8_COMPILE_CACHE=0` turns it off (the test suite does, to stay hermetic). The scripts in
`experiments/` call it; library code never does.

It also keeps the Mosaic GPU kernels' lowerings in `$XDG_CACHE_HOME/jfp8/mosaic-kernels`
(`pallas_kernels.kernel_cache`; `JFP8_KERNEL_CACHE_DIR` overrides it): on a Hopper, jax's cache
can only be consulted after the whole program is lowered, which lowers every kernel again (the
`tiny` FP8 train step's trace + lowering for a deviceless H100: 11.5 s, 3.9 s with its kernels kept).
"""

from __future__ import annotations

import os
import pathlib

import jax

from jfp8 import api

# Programs that compile faster than this are not worth a disk entry (jax's default is 1 s, which
# would leave out a small preset's eval step).
MIN_COMPILE_SECONDS = 0.2


def default_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jfp8" / "jax-compile"


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Use jax's persistent compilation cache from now on in this process; returns its directory,
    or None when `JFP8_COMPILE_CACHE=0` turns it off. An existing `JAX_COMPILATION_CACHE_DIR` (or
    `jax_compilation_cache_dir` already set) is kept as it is. `path` is jax's folder; the lowered
    kernels go to `~/.cache/jfp8/mosaic-kernels` whatever it is (`JFP8_KERNEL_CACHE_DIR` moves them)."""
    if os.environ.get("JFP8_COMPILE_CACHE", "1") == "0":
        return None
    # The Mosaic GPU kernels' Pallas lowering, which jax's cache cannot skip (its key is the lowered
    # program): kept beside it (`JFP8_KERNEL_CACHE_DIR` wins; nothing is written on a CPU-only run).
    try:
        api.keep_lowered_kernels(default_dir().parent / "mosaic-kernels")
    except RuntimeError:  # no home folder to put it in: lower the kernels every time
        pass
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    directory = pathlib.Path(path) if path is not None else default_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: train without it rather than fail
        print(f"jfp8: no compilation cache ({directory}: {e}); set JAX_COMPILATION_CACHE_DIR to a writable folder")
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return str(directory)
