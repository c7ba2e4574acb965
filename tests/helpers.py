"""Small helpers shared by the test files (pytest puts tests/ on sys.path)."""

import jax
import numpy as np
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

from jfp8.benchmarking import rel_error  # noqa: F401  re-exported: ||a - b|| / ||b|| in float64
from pallas_kernels import _mgpu


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A fresh generator per test, with its seed for the failure message."""
    seed = int(np.random.SeedSequence().generate_state(1)[0])
    return np.random.default_rng(seed), seed


def interpret(fn, *args, **kwargs):
    """`fn(...)` with its Mosaic GPU kernels in the interpreter (NaN-initialised buffers)."""
    try:
        with _mgpu.interpret_mode(True):
            return jax.block_until_ready(fn(*args, **kwargs))
    except Exception:
        reset_gpu_interpret_mode_state()  # the interpreter's state is unusable after a failure
        raise
