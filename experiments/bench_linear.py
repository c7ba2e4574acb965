"""Forward+backward time of `jfp8.fp8_linear` against the bf16 `x @ w`, same run, same device.

    python experiments/bench_linear.py                # GPU: DeepSeek-like shapes; CPU: small ones
    python experiments/bench_linear.py --shapes 4096x7168x2048

A shape MxNxK is x (M, K) bf16 times w (K, N) f32 master weight (cast to bf16 for the baseline).
Both paths are checked against f32 autodiff before timing; median of repeats after warm-up,
synchronised. On CPU the FP8 path is the XLA reference (a scan over 128-wide K chunks), so its
overhead there says nothing about the kernels. Writes benchmarks/results/bench_linear-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.benchmarking import RESULTS, parse_shape, rel_error, time_median, write_record
from pallas_kernels.shapes import CPU_DENSE_SHAPES, DENSE_SHAPES


def _fwd_bwd(linear):
    def loss(x, w):
        return jnp.sum(linear(x, w).astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    shapes = args.shapes or (DENSE_SHAPES[:5] if on_gpu else CPU_DENSE_SHAPES)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    repeats = args.repeats if args.repeats is not None else (20 if on_gpu else 3)
    impl = "mosaic" if jfp8.is_hopper(device) else "xla"
    print(f"device: {device.device_kind}; jax {jax.__version__}; fp8 path: impl={impl}")
    cases = {
        "bf16": lambda x, w: x @ w.astype(jnp.bfloat16),
        f"fp8-{impl}": lambda x, w: jfp8.fp8_linear(x, w, jfp8.Fp8Recipe(impl=impl)),
    }
    rows = []
    for m, n, k in shapes:
        kx, kw = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
        _, (dx32, dw32) = jax.value_and_grad(lambda x, w: jnp.sum(x @ w), (0, 1))(x.astype(jnp.float32), w)
        base = None
        for name, linear in cases.items():
            fn = _fwd_bwd(linear)
            _, (dx, dw) = fn(x, w)
            err = max(rel_error(dx, dx32), rel_error(dw, dw32))
            if not err < 0.1:
                raise AssertionError(f"{name} at {(m, n, k)}: gradient error {err:.3e} vs f32 autodiff")
            seconds = time_median(lambda: fn(x, w), warmup, repeats)
            base = base or seconds
            # forward + backward = 3 GEMMs of 2*M*N*K flops
            tflops = 3 * 2.0 * m * n * k / seconds / 1e12
            rows.append(dict(impl=name, m=m, n=n, k=k, ms=seconds * 1e3, tflops=tflops,
                             speedup_vs_bf16=base / seconds, grad_rel_error=err))
            print(f"  {name:12s} {m:6d} {n:6d} {k:6d} {seconds * 1e3:10.2f} ms {tflops:8.2f} TFLOP/s "
                  f"x{base / seconds:5.2f}  grad err {err:.1e}", flush=True)
    path = write_record("bench_linear", rows, args.out, warmup=warmup, repeats=repeats,
                        timing="median wall time of jit(value_and_grad), block_until_ready")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
