"""GEMM benchmark: jfp8's tile-scaled FP8 kernels beside XLA bf16 and XLA per-tensor FP8, one run.

    python experiments/bench_gemm.py                 # GPU: DeepSeek-V3 shapes; CPU: small, XLA only
    python experiments/bench_gemm.py --shapes 4096x7168x2048 --repeats 50

Each implementation's output is checked against its reference before it is timed; timings are the
median of `--repeats` calls after `--warmup` calls, each synchronised with `block_until_ready`.
Writes `benchmarks/results/bench_gemm-<device>-<date>.json` (device, jax version, date, rows).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.backend import is_hopper
from jfp8.benchmarking import RESULTS, parse_shape, rel_error, time_median, write_record
from pallas_kernels.shapes import CPU_DENSE_SHAPES, DENSE_SHAPES, GemmShape

def _cases(shape: GemmShape, use_kernels: bool, seed: int):
    """(name, jitted fn, args, check) per implementation; check(out) -> relative error vs reference."""
    m, n, k = shape
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    bf16 = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    bf16_ref = lambda: jnp.dot(x, w.T, precision="highest")  # noqa: E731
    cases = [("xla-bf16", bf16, (xb, wb), bf16_ref, 2e-2)]

    # Per-tensor FP8: XLA fuses scalar scales into a cuBLASLt FP8 GEMM on GPU.
    pa, pb = jfp8.quantize(x, None), jfp8.quantize(w, None)
    fp8_tensor = jax.jit(
        lambda ad, sa, bd, sb: (
            jnp.dot(ad, bd.T, preferred_element_type=jnp.float32) * (sa * sb)
        ).astype(jnp.bfloat16)
    )
    cases.append((
        "xla-fp8-per-tensor", fp8_tensor, (pa.data, pa.scale[0, 0], pb.data, pb.scale[0, 0]),
        lambda: jfp8.scaled_matmul_oracle(pa, pb), 1e-2,
    ))

    a, b = jfp8.quantize(x, (1, jfp8.TILE)), jfp8.quantize(w, (jfp8.TILE, jfp8.TILE))
    ref = lambda: jfp8.scaled_matmul_reference(a, b, jnp.float32)  # noqa: E731
    impl = "mosaic" if use_kernels else "xla"
    tiled = jax.jit(lambda a, b: jfp8.scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl=impl))
    # bf16 output against the f32 reference: bounded by the bf16 rounding of the output
    cases.append((f"jfp8-{impl}-tile-x-block", tiled, (a, b), ref, 1e-2 if use_kernels else 5e-3))
    return cases


def run(shapes, warmup: int, repeats: int, use_kernels: bool, seed: int) -> list[dict]:
    rows = []
    for shape in shapes:
        m, n, k = shape
        flops = 2.0 * m * n * k
        bf16_time = None
        for name, fn, args, ref, tol in _cases(shape, use_kernels, seed):
            out = jax.block_until_ready(fn(*args))
            err = rel_error(out, ref())
            if not err <= tol:  # also catches NaN
                raise AssertionError(f"{name} at {shape}: relative error {err:.3e} > {tol} vs its reference")
            seconds = time_median(lambda: fn(*args), warmup, repeats)
            if name == "xla-bf16":
                bf16_time = seconds
            rows.append(dict(
                impl=name, m=m, n=n, k=k, ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                ratio_vs_bf16=bf16_time / seconds, rel_error=err,
            ))
            print(f"  {name:28s} {m:6d} {n:6d} {k:6d} {seconds * 1e3:10.3f} ms "
                  f"{flops / seconds / 1e12:9.2f} TFLOP/s  x{bf16_time / seconds:5.2f}  err {err:.1e}", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    use_kernels = is_hopper(device)
    shapes = args.shapes or (DENSE_SHAPES if on_gpu else CPU_DENSE_SHAPES)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    repeats = args.repeats if args.repeats is not None else (30 if on_gpu else 3)
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}")
    if not use_kernels:
        print("no Hopper GPU: the jfp8 row is the XLA reference path (same numerics), not the kernels;"
              " sizes are small. Run on an H100/H200 for kernel numbers.")
    rows = run(shapes, warmup, repeats, use_kernels, args.seed)

    path = write_record("bench_gemm", rows, args.out, warmup=warmup, repeats=repeats,
                        timing="median wall time, block_until_ready")
    print(f"\n{'impl':28s} {'M':>6} {'N':>6} {'K':>6} {'TFLOP/s':>9} {'vs bf16':>8}")
    for r in rows:
        print(f"{r['impl']:28s} {r['m']:6d} {r['n']:6d} {r['k']:6d} {r['tflops']:9.2f} {r['ratio_vs_bf16']:8.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
