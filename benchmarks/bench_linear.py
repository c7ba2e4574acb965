"""Forward + backward of one FP8 linear layer (`jfp8.fp8_linear`) against the bf16 `x @ w`, one
run, one device: what a training step pays per layer, quantizers, transposes and all.

    python benchmarks/bench_linear.py                # GPU: DeepSeek-V3 shapes; CPU: small ones
    python benchmarks/bench_linear.py --shapes 4096x7168x2048
    python benchmarks/bench_linear.py --shapes layer     # issue 43's layers at M = 8192 (LAYER_SHAPES)

A shape MxNxK is x (M, K) bf16 times w (K, N) f32 master weight (cast to bf16 for the baseline);
one timed call is one jitted `jax.vjp` of the layer with a fixed random cotangent g (dy, not a
constant), returning y, dx and dw: Fprop, Dgrad and Wgrad, 3 x 2MNK FLOPs, plus on the FP8 side
every quantization (x, W in both orientations, dy in both forms, the §3.5.2 re-tiling of x). Rows:
  bf16          x @ w.astype(bf16), XLA (cuBLAS on a GPU)
  fp8-<impl>    fp8_linear with the DeepSeek-V3 recipe: impl "mosaic" (the kernels) on Hopper,
                the XLA reference elsewhere (on CPU its time says nothing about the kernels)
  fp8-mosaic-unfused  the same with Fp8Recipe(fuse_quantizers=False): W and dy quantized by
                separate kernels (and W's transpose by XLA), as before the fused quantizers
  fp8-<impl>-prequantized  with `--prequantized`: the layer given W's FP8 copies made before the
                timer (`jfp8.fp8_weight`, the ops' `w_fp8`): a weight quantized once for many calls
                or by the optimizer's update; its time below the fp8 row's is W's quantizer
Checks before timing, on y, dx and dw (the largest relative Frobenius error of the three): bf16
against f32 (`precision="highest"`) autodiff, <= 2e-2; the FP8 row against f32 autodiff (<= 0.1,
recorded as `err_vs_f32`; E4M3 puts it at a few percent) and against the same op on the XLA
reference path **run on the CPU**, whose XLA defines the reference's bits (same numerics: <= 1e-2,
recorded per output as `err_vs_reference`). At M = 8192 the CPU computes slices only: y and dx's
first 128 rows, dw's first 128 columns, each exactly what the whole layer gives there (x's and
dy's 1x128 tiles are rows of their own, the Wgrad's 128-token tiles columns, W's blocks 128
columns wide). On a GPU the row also records, per output, its error against XLA's run of the
reference on the GPU (`err_vs_xla_here`), which is not the check: on the H100 (2026-11-28) every
FP8 row was 1.29e-2 off it at all three layer shapes. Median of repeats after warm-up, device
synchronised. Record: `<out>/bench_linear-<device>-<date>.json`, with `ratio_vs_bf16` per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.api import is_hopper
from jfp8.reference import rel_error
from _bench import (
    TIMING_METHOD,
    Case,
    CheckFailed,
    add_common_args,
    add_ratios,
    device_rel_error,
    error_entry,
    format_errors,
    gemm_row,
    on_cpu,
    parse_shape,
    random_normal,
    report_end,
    run_cases,
    shape_label,
    timing_from_args,
    within_budget,
    write_record,
)
from pallas_kernels.shapes import CPU_DENSE_SHAPES, DENSE_SHAPES, LAYER_SHAPES

BASELINE = "bf16"
TOL_BF16 = 2e-2
TOL_SAME_NUMERICS = 1e-2
# E4M3 (3 mantissa bits) with 1x128 / 128x128 scales: a few percent (4.4e-2 measured on CPU at
# 256x256x512); a wrong layer is off by far more.
TOL_FP8_VS_F32 = 0.1


# Named sets for --shapes, beside MxNxK shapes.
SHAPE_SETS = {"layer": LAYER_SHAPES, "dense": DENSE_SHAPES}


def parse_shapes(s: str) -> tuple:
    """'MxNxK' -> (GemmShape,), or a set's name ('layer', 'dense') -> its shapes, for argparse."""
    return SHAPE_SETS.get(s.lower()) or (parse_shape(s),)


def _fwd_bwd(linear):
    """jit of one training step's work for the layer: y = linear(x, w), then (dx, dw) for the
    cotangent g (the gradient of sum(y * g)). Returns (y, dx, dw)."""
    def step(x, w, g):
        y, vjp = jax.vjp(linear, x, w)
        return (y, *vjp(g.astype(y.dtype)))

    return jax.jit(step)


def _bf16_linear(x, w):
    return x @ w.astype(jnp.bfloat16)


def _fp8_linear(impl, fuse_quantizers=True):
    """The measured FP8 layer (module level so that tests can substitute a wrong one)."""
    recipe = jfp8.Fp8Recipe(impl=impl, fuse_quantizers=fuse_quantizers)
    return lambda x, w: jfp8.fp8_linear(x, w, recipe)


def _fp8_linear_prequantized(impl):
    """(make the copies of w, jit of `_fwd_bwd`'s step given them): the layer with W's FP8 copies
    passed in (`jfp8.fp8_weight`), so that its timed call does not quantize W."""
    recipe = jfp8.Fp8Recipe(impl=impl)

    def step(x, w, w_fp8, g):
        y, vjp = jax.vjp(lambda x, w: jfp8.fp8_linear(x, w, recipe, w_fp8=w_fp8), x, w)
        return (y, *vjp(g.astype(y.dtype)))

    return jax.jit(lambda w: jfp8.fp8_weight(w, recipe)), jax.jit(step)


def _reference_fp8_linear(x, w):
    """What the FP8 row is checked against: the same op on the XLA reference path."""
    return jfp8.fp8_linear(x, w, jfp8.Fp8Recipe(impl="xla"))


def _error(out, ref) -> float:
    """max over y, dx, dw of the relative Frobenius error of `out` against `ref`."""
    return max(device_rel_error(o, r) for o, r in zip(out, ref))


OUTPUTS = ("y", "dx", "dw")
# The CPU reference's slices: y's and dx's first rows, dw's first columns (whole tiles: see
# `reference_slices`).
SLICE_ROWS = 128
SLICE_COLS = 128


def _slices(out, rows: int = SLICE_ROWS, cols: int = SLICE_COLS) -> tuple:
    """(y[:rows], dx[:rows], dw[:, :cols]) of a (y, dx, dw) triple, in float32 on the host."""
    y, dx, dw = out
    return tuple(np.asarray(jnp.asarray(a, jnp.float32)) for a in (y[:rows], dx[:rows], dw[:, :cols]))


def reference_slices(x, w, g, rows: int = SLICE_ROWS, cols: int = SLICE_COLS) -> tuple:
    """`_slices` of the FP8 layer's (y, dx, dw) on the XLA reference path, computed on the CPU
    (whose XLA defines the reference's bits) from slices of the operands: y and dx's first `rows`
    rows from x[:rows] and g[:rows], dw's first `cols` columns from w[:, :cols] and g[:, :cols].
    Each equals the whole layer's slice: x's and dy's 1x128 tiles lie within a row, the Wgrad's
    128-token tiles of x and dy within a column, and W's 128x128 blocks within a 128-column group,
    so `rows` and `cols` must be multiples of 128 (or the whole dimension)."""
    m, n = g.shape
    if (rows < m and rows % 128) or (cols < n and cols % 128):
        raise ValueError(f"slices must be whole 128-wide tiles, got rows {rows}, cols {cols}")
    step = _fwd_bwd(_reference_fp8_linear)
    y, dx, _ = on_cpu(step, x[:rows], w, g[:rows])
    _, _, dw = on_cpu(step, x, w[:, :cols], g[:, :cols])
    return _slices((y, dx, dw), rows, cols)


def _per_output(out, ref) -> dict[str, float]:
    """Each output's relative Frobenius error against `ref` (host arrays or device arrays)."""
    return {o: float(rel_error(np.asarray(u), np.asarray(v))) for o, u, v in zip(OUTPUTS, out, ref)}


def _f32_linear(x, w):
    return jnp.dot(x, w, precision="highest")  # not TF32 on a GPU


def _operands(seed: int, shape):
    m, n, k = shape
    x = random_normal(seed, (m, k)).astype(jnp.bfloat16)
    w = random_normal(seed + 1, (k, n)) / np.sqrt(k)
    g = random_normal(seed + 2, (m, n))
    return x, w, g


def _cases(shape, impl: str, seed: int, prequantized: bool = False) -> tuple[list[Case], dict]:
    x, w, g = _operands(seed, tuple(shape))
    f32 = functools.cache(lambda: _fwd_bwd(_f32_linear)(x.astype(jnp.float32), w, g))
    reference = functools.cache(lambda: reference_slices(x, w, g))
    runs_on_cpu = x.devices() == {jax.devices("cpu")[0]}
    here = functools.cache(lambda: _slices(_fwd_bwd(_reference_fp8_linear)(x, w, g)))
    bf16 = _fwd_bwd(_bf16_linear)
    extra = {}

    def fp8_check(name):
        def check(out):
            # Both bounds: E4M3's error against f32 autodiff, and the same numerics as the
            # reference path (its bits as the CPU's XLA computes them).
            err = _error(out, f32())
            extra[name] = info = {"err_vs_f32": err}
            if not err <= TOL_FP8_VS_F32:
                raise CheckFailed(f"error {err:.3e} against f32 autodiff > {TOL_FP8_VS_F32}")
            got = _slices(out)
            info["err_vs_reference"] = same = _per_output(got, reference())
            if not runs_on_cpu:  # what XLA's run of the reference on this device says, not the check
                info["err_vs_xla_here"] = _per_output(got, here())
            against_same = max(same.values())
            if not against_same <= TOL_SAME_NUMERICS:
                f32_slices = _slices(f32())
                raise CheckFailed(
                    f"error {against_same:.3e} > {TOL_SAME_NUMERICS} against the reference path run on the "
                    f"CPU ({format_errors(same)}; y and dx's first {SLICE_ROWS} rows, dw's first {SLICE_COLS} "
                    f"columns); against f32 autodiff: this path {format_errors(_per_output(got, f32_slices))}, "
                    f"the reference path {format_errors(_per_output(reference(), f32_slices))}"
                    + ("" if runs_on_cpu else f"; against XLA's run of the reference here: {format_errors(info['err_vs_xla_here'])}"))
            return against_same

        return check

    cases = [Case(BASELINE, lambda: bf16(x, w, g), lambda out: _error(out, f32()), TOL_BF16, "bf16")]
    # With the kernels, the layer with its quantizers fused and unfused (`fuse_quantizers`): the
    # fused ones' effect on a whole training step. The XLA path has no fused quantizers.
    for fused in (True, False) if impl == "mosaic" else (True,):
        name = f"fp8-{impl}" + ("" if fused else "-unfused")
        fn = _fwd_bwd(_fp8_linear(impl, fused))
        cases.append(Case(name, lambda fn=fn: fn(x, w, g), fp8_check(name), TOL_SAME_NUMERICS, "fp8"))
    if prequantized:  # W's copies made once, before the timer; checked as the fp8 row is
        name = f"fp8-{impl}-prequantized"
        make, fn = _fp8_linear_prequantized(impl)
        w_fp8 = make(w)
        cases.append(Case(name, lambda: fn(x, w, w_fp8, g), fp8_check(name), TOL_SAME_NUMERICS, "fp8"))
    return cases, extra


def print_rows(rows: list[dict]) -> None:
    width = max([14] + [len(r["impl"]) for r in rows])
    print(f"\n{'impl':{width}s} {'MxNxK':>18s} {'ms':>9} {'TFLOP/s':>8} {'x bf16':>7} {'err vs f32':>10}")
    for r in rows:
        ratio = "" if r.get("ratio_vs_bf16") is None else f"{r['ratio_vs_bf16']:7.2f}"
        err = r.get("err_vs_f32", r["rel_error"])
        print(f"{r['impl']:{width}s} {'%dx%dx%d' % (r['m'], r['n'], r['k']):>18s} {r['ms']:9.3f} "
              f"{r['tflops']:8.4g} {ratio:>7} {err:10.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shapes, nargs="+", default=None, metavar="MxNxK",
                   help=f"shapes, or a named set: {', '.join(SHAPE_SETS)}")
    p.add_argument("--prequantized", action="store_true",
                   help="also time the layer given W's FP8 copies made before the timer (jfp8.fp8_weight): "
                        "the fp8 row's time less W's quantizer")
    add_common_args(p)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    impl = "mosaic" if is_hopper(device) else "xla"
    shapes = [s for group in args.shapes for s in group] if args.shapes else (
        DENSE_SHAPES[:5] if on_gpu else CPU_DENSE_SHAPES[:1])
    timing = timing_from_args(args, on_gpu)
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; fp8 impl={impl}")

    start = time.perf_counter()
    rows, failed, skipped = [], [], []

    def save():
        add_ratios(rows, BASELINE, (BASELINE,))
        return write_record("bench_linear", rows, args.out,
                            timing=dict(dataclasses.asdict(timing), method=TIMING_METHOD),
                            flops="3 GEMMs of 2*M*N*K (Fprop, Dgrad, Wgrad)", failed=failed,
                            skipped=skipped)

    for shape, label in within_budget(shapes, shape_label, args.budget_s, start, skipped):
        m, n, k = shape
        try:
            cases, extra = _cases(shape, impl, args.seed, args.prequantized)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory preparing operands
            failed.append(error_entry("(operands)", label, e))
            continue

        def row(case, meas, m=m, n=n, k=k):
            r = gemm_row(case, meas, device.device_kind, 3 * 2.0 * m * n * k, m=m, n=n, k=k)
            r.update(extra.get(case.name, {}))  # err_vs_f32, err_vs_reference (, err_vs_xla_here)
            return r

        run_cases(cases, label, timing, row, rows, failed, args.only)
        save()
    path = save()
    print_rows(rows)
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())
