"""Exhaustive check that jfp8's quantizer rules are DeepGEMM's, on XLA:CPU, under jit and eagerly.

    python experiments/deepgemm_parity.py          # ~7 min on 2 CPUs
    python experiments/deepgemm_parity.py --out /tmp/parity

The quantizer is three elementwise steps (`pallas_kernels.fp8_math`): the scale from the amax, its
reciprocal, and the encode `cast_e4m3(clip(x * reciprocal))`. Each is checked here against the
numpy port of DeepGEMM's code as PyTorch runs it on CUDA (`tests/deepgemm_oracle.py`) for every
f32 input it can get, so the only step left unchecked is one f32 product:

- `scale_from_amax` (FP32 and power-of-two scales) for every f32 amax from 1e-6 (below the clamp)
  to the f32 max;
- `reciprocal` for every f32 scale a block can have (clamp / 448 up to f32 max / 448);
- `encode_scaled(v, 1)` (clip, then XLA's f32 -> E4M3 cast) against PyTorch's cast for every
  |v| <= 464 (DeepGEMM's quotients stay within a few ulps of 448), both signs; and ml_dtypes'
  cast (the tests' other oracle) against PyTorch's over the same values.

Also counts how many amax values get a different scale from PyTorch on the CPU, which divides by
448 instead of multiplying by f32(1/448). Writes `results.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.fp8_math import AMAX_FLOOR, E4M3_MAX, encode_scaled, reciprocal, scale_from_amax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import deepgemm_oracle as dg  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "results" / "deepgemm-parity"
F32_MAX = float(np.finfo(np.float32).max)
CAST_LIMIT = 464.0  # E4M3_MAX + 16: the tie between 448 and PyTorch's NaN at 480


def _f32_range(lo: float, hi: float, chunk: int):
    """Every f32 value from lo to hi (both >= 0), in chunks."""
    a, b = (int(np.float32(v).view(np.uint32)) for v in (lo, hi))
    for start in range(a, b + 1, chunk):
        yield np.arange(start, min(start + chunk, b + 1), dtype=np.uint32).view(np.float32)


def _mismatches(got, want) -> int:
    got, want = np.asarray(got), np.asarray(want)
    return int(np.count_nonzero(got.view(f"u{got.itemsize}") != want.view(f"u{want.itemsize}")))


def check_scales(chunk: int) -> dict:
    jitted = {p: jax.jit(lambda a, p=p: scale_from_amax(a, p)) for p in (False, True)}
    out = {f"{mode}_pow2={p}": 0 for mode in ("jit", "eager") for p in (False, True)}
    n = cpu_differs = cpu_differs_pow2 = 0
    for a in _f32_range(1e-6, F32_MAX, chunk):
        n += a.size
        ja = jnp.asarray(a)
        for p in (False, True):
            want = dg.scale_from_amax(a, p)
            out[f"jit_pow2={p}"] += _mismatches(jitted[p](ja), want)
            out[f"eager_pow2={p}"] += _mismatches(scale_from_amax(ja, p), want)
        cpu_differs += int(np.count_nonzero(dg.scale_from_amax(a, False, "cpu") != dg.scale_from_amax(a, False)))
        cpu_differs_pow2 += int(np.count_nonzero(dg.scale_from_amax(a, True, "cpu") != dg.scale_from_amax(a, True)))
    return dict(values=n, mismatches=out, pytorch_cpu_scale_differs=cpu_differs,
                pytorch_cpu_scale_differs_fraction=cpu_differs / n, pytorch_cpu_pow2_scale_differs=cpu_differs_pow2)


def check_reciprocals(chunk: int) -> dict:
    jitted = jax.jit(reciprocal)
    lo, hi = AMAX_FLOOR / E4M3_MAX * 0.99, F32_MAX / E4M3_MAX * 1.01
    n, bad = 0, {"jit": 0, "eager": 0}
    for s in _f32_range(lo, hi, chunk):
        n += s.size
        want = np.float32(1) / s
        bad["jit"] += _mismatches(jitted(jnp.asarray(s)), want)
        bad["eager"] += _mismatches(reciprocal(jnp.asarray(s)), want)
    return dict(values=n, mismatches=bad)


def check_cast(chunk: int) -> dict:
    one = jnp.float32(1)
    jitted = jax.jit(lambda v: encode_scaled(v, one))
    n, bad = 0, {"jit": 0, "eager": 0, "ml_dtypes": 0}
    for a in _f32_range(0.0, CAST_LIMIT, chunk):
        for v in (a, -a):
            n += v.size
            want = dg.c10_e4m3fn_bits(v)
            bad["jit"] += _mismatches(jitted(jnp.asarray(v)), want)
            bad["eager"] += _mismatches(encode_scaled(jnp.asarray(v), one), want)
            bad["ml_dtypes"] += _mismatches(v.astype(ml_dtypes.float8_e4m3fn), want)
    return dict(values=n, mismatches=bad)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", type=int, default=1 << 24, help="values per device call")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    args = p.parse_args(argv)
    results = dict(jax=jax.__version__, backend=jax.default_backend())
    for name, check in [("scale_from_amax", check_scales), ("reciprocal", check_reciprocals),
                        ("encode_cast", check_cast)]:
        t0 = time.perf_counter()
        results[name] = check(args.chunk) | dict(seconds=round(time.perf_counter() - t0, 1))
        print(name, json.dumps(results[name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
