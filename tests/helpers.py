"""Small helpers shared by the test files (pytest puts tests/ on sys.path)."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    get_races,
    reset_gpu_interpret_mode_state,
)

from jfp8.reference import rel_error  # noqa: F401  re-exported: ||a - b|| / ||b|| in float64
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


def interpret_detecting_races(fn, *args):
    """`interpret` with the interpreter's race detector on; returns (result, races found).

    A race is printed ("RACE DETECTED", with both accesses) and recorded, not raised."""
    try:
        with _mgpu.interpret_mode(True, detect_races=True):
            out = jax.block_until_ready(fn(*args))
    except Exception:
        reset_gpu_interpret_mode_state()
        raise
    return out, get_races().races_found


def assert_bitwise_equal(out, ref, seed):
    """Same shape, dtype and bits (NaNs included); the message names the seed."""
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, seed)
    bits = {2: np.uint16, 4: np.uint32}[out.dtype.itemsize]
    diff = out.view(bits) != ref.view(bits)
    assert not diff.any(), (
        f"seed={seed}: {diff.sum()} of {diff.size} outputs differ "
        f"({np.isnan(out).sum()} NaN), first at {np.argwhere(diff)[0]}"
    )


def on_cpu(fn, *args):
    """`fn(*args)` computed on the CPU, as numpy arrays (a tree of them for a tree of results). On
    a GPU machine the references must not run there: XLA may give an FP8 dot to the tensor cores,
    whose chunk sums are exactly what the hardware bound is about, and the CPU's XLA is what
    defines the reference's bits (the quantizers' bit-exact GPU tests against a reference run by
    XLA:GPU differed in 169-4000 of 29 M bytes on an H100, 2026-11-28, where the smoke's, against
    the CPU's, matched)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        args = jax.tree.map(lambda x: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x, args)
        return jax.tree.map(np.asarray, fn(*args))


# `--model` for a script's plumbing test: the tiny preset cut to one MoE block without MTP, the
# same code paths (MLA, routing, FP8 GEMMs forward and backward) for a fraction of the whole
# preset's compile and step time. Tests of the model itself keep the whole preset. The same cut as
# `model_overrides` (a config's tuple) and as `--model` (a script's string).
ONE_MOE_LAYER_OVERRIDES = (("n_layers", 1), ("n_dense_layers", 0), ("mtp", False))
ONE_MOE_LAYER = ",".join(f"{k}={str(v).lower()}" for k, v in ONE_MOE_LAYER_OVERRIDES)

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"  # the science
BENCHMARKS = REPO / "benchmarks"  # the speed and hardware tooling


def _load_script(folder: pathlib.Path, name: str):
    """<folder>/<name>.py as a fresh module, the folder on sys.path for its sibling imports."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_experiment(name: str):
    """experiments/<name>.py as a fresh module."""
    return _load_script(EXPERIMENTS, name)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a fresh module."""
    return _load_script(BENCHMARKS, name)


def all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters (cond branches,
    loop bodies, custom-VJP calls, pjit)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for j in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def hard_row_gradients(rng: np.random.Generator, owners: np.ndarray, d: int, dtype) -> np.ndarray:
    """(R, d) float64 cotangents of gathered rows, where summing each owner's rows shows its order
    and its rounding: magnitudes 2^-30 to 2^30, cancellations (a row the negation of its owner's
    first), overflow past `dtype`'s largest, NaN, ±Inf, -0 alone and in whole rows, subnormals.
    owners[r]: the token row r was gathered from (any value for a row that belongs to none)."""
    g = rng.standard_normal((len(owners), d)) * np.exp2(rng.integers(-30, 31, (len(owners), d)))
    big = float(jax.numpy.finfo(dtype).max) * 0.75
    specials = [0.0, -0.0, np.nan, np.inf, -np.inf, big, -big, float(jax.numpy.finfo(dtype).smallest_subnormal) * 3]
    mask = rng.random(g.shape) < 0.15
    g[mask] = rng.choice(specials, mask.sum())
    g[rng.integers(0, len(owners), 3)] = -0.0  # whole rows of -0
    tokens, counts = np.unique(owners, return_counts=True)
    for t in tokens[counts >= 2][:4]:  # exact cancellation within a token
        r = np.flatnonzero(owners == t)
        g[r[1]] = -g[r[0]]
    return g


def nan_as_quiet(a) -> np.ndarray:
    """`a` with every NaN the quiet +NaN: a NaN's sign after NaN + NaN is not IEEE 754's to say
    (x86 keeps one operand's, and which operand comes first is the compiler's choice)."""
    a = np.asarray(a)
    return np.where(np.isnan(a), np.asarray(np.nan, a.dtype), a)


def float_scatter_adds(jaxpr) -> list:
    """The scatter-adds into floating-point arrays whose indices may repeat: on a GPU, atomic
    additions in an order that changes from run to run."""
    return [e for e in all_eqns(jaxpr) if e.primitive.name == "scatter-add" and not e.params.get("unique_indices")
            and jax.numpy.issubdtype(e.outvars[0].aval.dtype, jax.numpy.floating)]
