"""The numerics demo: quantize with each DeepSeek-V3 granularity, multiply, print the errors.

    python experiments/demo_numerics.py [--ks 256 1024 4096] [--factors 1 1e3 1e4 1e5] [--out DIR]

Columns: GEMM = relative Frobenius error of the FP8 GEMM (chunked FP32 accumulation) against the
exact float64 product of the unquantized inputs; regular = quantization error of the activations
on the channels without outliers; accum = the reference GEMM against the f64 oracle on the same
FP8 operands (the accumulation's own share, tiny next to quantization).
"""

import argparse
import dataclasses
import json
import pathlib
import time

import jax

from jfp8.error_study import format_table, granularity_errors


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--factors", type=float, nargs="+", default=[1.0, 1e3, 1e4, 1e5])
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--outliers", type=int, default=4, help="number of outlier channels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write rows as JSON here")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    rows = granularity_errors(
        args.ks, args.factors, m=args.m, n=args.n, n_outliers=args.outliers, seed=args.seed
    )
    print(f"jfp8 numerics demo: E4M3, M=N={args.m}x{args.n}, {args.outliers} outlier channels "
          f"(x scaled by the factor, w divided by it), jax {jax.__version__} on {jax.devices()[0].platform}")
    print(format_table(rows))
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "granularity_errors.json"
        path.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
