"""Dense GEMM benchmark: jfp8's tile x block FP8 GEMM beside XLA bf16, XLA per-tensor FP8 and
torch's cuBLAS blockwise FP8 (DeepSeek-style 1x128 x 128x128 scales), one run, one device.

    python benchmarks/bench_gemm.py                 # GPU: DeepSeek-V3 shapes; CPU: small, XLA only
    python benchmarks/bench_gemm.py --shapes 8192x8192x8192 --config tile_m=128,tile_n=128
    python benchmarks/bench_gemm.py --config tile_m=128 --config tile_m=64,max_concurrent_steps=4

Implementations (rows), per shape MxNxK (x (M, K) times w (N, K), output bf16):
  xla-bf16              jnp.dot on bf16 operands, f32 accumulation (cuBLAS on GPU): the baseline
  xla-fp8-per-tensor    one scale per tensor (XLA fuses it into a cuBLASLt FP8 GEMM)
  torch-bf16            torch.mm on bf16 (GPU with torch only): cuBLAS seen from torch
  torch-fp8-blockwise   torch scaled_mm with 1x128 (x) and 128x128 (w) FP32 scales: cuBLAS >= 12.9
                        on sm_90 (GPU with torch only; a failure is recorded, not raised)
  deepgemm-1d2d         DeepGEMM's SM90 FP8 GEMM (Hopper, with its harness built: `--deepgemm`), on the
                        same operands, in a process of its own timed by CUDA events per launch
  jfp8-<impl>           jfp8.scaled_matmul, the front door (impl "mosaic" on Hopper, else "xla")
  jfp8-mosaic-kernel    with --config (Hopper only): the kernel `jfp8-mosaic` runs, timed alone on
                        operands already in the kernel's TMA layouts (`gemm.split_scaled_matmul`):
                        its gap to `jfp8-mosaic` is what the wrapper's XLA ops cost (issue 19's
                        limiter 5, measured before the quantizers' output layout is changed for it)
  jfp8-mosaic[<config>] pallas_kernels.gemm.scaled_matmul with GemmConfig(<config>), per --config
                        (Hopper only), on operands already chunked for the kernel (its wrapper's
                        scale layout ops included)

Each implementation is checked against its reference before it is timed (a failed check is
recorded and makes the exit status 1); timings are medians of `--repeats` samples after warm-up,
each sample `--inner` back-to-back calls and one device synchronisation. The record
`<out>/bench_gemm-<device>-<date>.json` is rewritten after every shape, so a run cut short keeps
what it measured; shapes left when `--budget-s` runs out are listed under "skipped".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.api import is_hopper
from gpu_tables import TARGET_DENSE_VS_BF16
from _bench import (
    PEAK_SOURCE,
    TIMING_METHOD,
    Case,
    Skip,
    add_common_args,
    add_ratios,
    check_configs,
    config_label,
    device_rel_error,
    error_entry,
    gemm_row,
    harness_module,
    kernel_info,
    parse_config,
    parse_shape,
    random_normal,
    report_end,
    run_cases,
    run_harnessed,
    shape_label,
    timing_from_args,
    to_torch,
    torch_cuda,
    torch_rel_error,
    torch_sync,
    within_budget,
    write_record,
)
from jfp8.reference import chunk_operand
from pallas_kernels.shapes import CPU_DENSE_SHAPES, DENSE_SHAPES, SMALL_M_SHAPES, GemmShape

BASELINE = "xla-bf16"
# DeepGEMM's SM90 FP8 GEMM through jfp8's host program (`hopper/deepgemm_harness.py`): a process of
# its own, timed by CUDA events there, on the same operands and checked against the same reference.
DEEPGEMM = "deepgemm-1d2d"
KERNEL_ONLY = "jfp8-mosaic-kernel"
BASELINES = ("xla-bf16", "xla-fp8-per-tensor", "torch-bf16", "torch-fp8-blockwise", DEEPGEMM)
# The target for the tile x block kernel against the bf16 baseline.
# Tolerances of a bf16 output against an f32 reference: bf16 rounding (2^-9 relative) plus, for
# the bf16-operand rows, the rounding of the operands.
TOL_BF16_OPERANDS = 2e-2
TOL_FP8_OUTPUT = 1e-2


def _jax_check(ref: Callable[[], jax.Array]):
    return lambda out: device_rel_error(out, ref())


# ------------------------------------------------------------------------------------ torch


def _scaling_type(F, *names: str):
    """The member of torch's ScalingType enum under any of `names` (its spelling changed)."""
    enum = getattr(F, "ScalingType", None)
    for name in names:
        if enum is not None and hasattr(enum, name):
            return getattr(enum, name)
    raise AttributeError(f"torch.nn.functional.ScalingType has none of {names}")


def _torch_blockwise_call(torch, mat_a, mat_b, scale_a, scale_b):
    """(callable, api description) for cuBLAS's DeepSeek-style blockwise FP8 GEMM.

    torch >= 2.10 `torch.nn.functional.scaled_mm` with explicit recipes
    (ScalingType.BlockWise1x128 for a, BlockWise128x128 for b); else `torch._scaled_mm`, which
    infers the recipe from the scale shapes. Layouts (aten/src/ATen/native/cuda/ScaledBlas.cpp,
    `_scaled_block1x128_block128x128`; test/test_scaled_matmul_cuda.py,
    `test_scaled_mm_block_wise_numerics`):
      mat_a   (M, K) e4m3, row-major;   mat_b (K, N) e4m3, column-major (w (N, K) transposed)
      scale_a (M, K/128) f32, strides (1, M)            ("outer-dim-major")
      scale_b (round_up(K/128, 4), N/128) f32, strides (1, round_up(K/128, 4))
    Scales multiply (decode), like jfp8's. Tried in that order; the first that runs is returned.
    """
    errors = []
    F = torch.nn.functional
    if hasattr(F, "scaled_mm"):
        try:
            rec_a = _scaling_type(F, "BlockWise1x128", "Blockwise_1x128")
            rec_b = _scaling_type(F, "BlockWise128x128", "Blockwise_128x128")

            def v2():
                return F.scaled_mm(mat_a, mat_b, scale_a, rec_a, scale_b, rec_b,
                                   output_dtype=torch.bfloat16)

            v2()
            return v2, "torch.nn.functional.scaled_mm(BlockWise1x128, BlockWise128x128)"
        except Exception as e:  # noqa: BLE001 - recorded, then the next API is tried
            errors.append(f"F.scaled_mm: {type(e).__name__}: {str(e)[:300]}")
    try:
        def v1():
            return torch._scaled_mm(mat_a, mat_b, scale_a, scale_b, out_dtype=torch.bfloat16)

        v1()
        return v1, "torch._scaled_mm (recipe inferred from scale shapes)"
    except Exception as e:  # noqa: BLE001
        errors.append(f"torch._scaled_mm: {type(e).__name__}: {str(e)[:300]}")
    raise RuntimeError("; ".join(errors))


def _torch_cases(shape: GemmShape, xb, wb, bf16_ref, a, b, ref) -> tuple[list[Case], list[Skip], dict]:
    """torch-bf16 and torch-fp8-blockwise on the same data (GPU only)."""
    torch, why = torch_cuda()
    if torch is None:
        return [], [Skip("torch-bf16", why), Skip("torch-fp8-blockwise", why)], {}
    m, n, k = shape
    info = {"torch_version": torch.__version__, "torch_cuda": torch.version.cuda}

    sync = torch_sync(torch)

    def torch_check(ref_fn):
        return lambda out: torch_rel_error(out, ref_fn())

    cases, skips = [], []
    xt, wt = to_torch(torch, xb), to_torch(torch, wb)
    cases.append(Case("torch-bf16", lambda: torch.mm(xt, wt.t()), torch_check(bf16_ref),
                      TOL_BF16_OPERANDS, "bf16", sync))
    try:
        kp = a.data.shape[1]
        chunks = kp // jfp8.TILE
        l4 = -(-chunks // 4) * 4
        mat_a = to_torch(torch, a.data[:m])  # (M, Kp)
        mat_b = to_torch(torch, b.data[:n]).t()  # (Kp, N), column-major
        scale_a = to_torch(torch, a.scale[:m]).t().contiguous().t()  # (M, Kp/128), strides (1, M)
        sb = jnp.pad(b.scale, ((0, 0), (0, l4 - chunks)))  # (ceil(N/128), L4)
        scale_b = to_torch(torch, sb).t()  # (L4, ceil(N/128)), strides (1, L4)
        fn, api = _torch_blockwise_call(torch, mat_a, mat_b, scale_a, scale_b)
        info["torch_blockwise_api"] = api
        cases.append(Case("torch-fp8-blockwise", fn, torch_check(ref), TOL_FP8_OUTPUT, "fp8", sync))
    except Exception as e:  # noqa: BLE001 - the baseline is optional; the reason is recorded
        skips.append(Skip("torch-fp8-blockwise", f"{type(e).__name__}: {str(e)[:600]}"))
    return cases, skips, info


# ------------------------------------------------------------------------------------ cases


@jax.jit
def _operands(x: jax.Array, w: jax.Array) -> dict:
    """x (M, K), w (N, K) in f32 and bf16, and their per-tensor and tile x block FP8 forms."""
    return dict(x=x, w=w, xb=x.astype(jnp.bfloat16), wb=w.astype(jnp.bfloat16),
                pa=jfp8.quantize(x, None), pb=jfp8.quantize(w, None),
                a=jfp8.quantize(x, (1, jfp8.TILE)), b=jfp8.quantize(w, (jfp8.TILE, jfp8.TILE)))


# The implementations and references, jitted once. References take their operands as arguments
# (a closure would bake them into the program as constants).
@jax.jit
def _bf16_dot(a, b):
    return jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.jit
def _f32_dot(a, b):
    return jnp.dot(a, b.T, precision="highest")


@jax.jit
def _fp8_per_tensor(ad, sa, bd, sb):
    # Per-tensor FP8: XLA fuses scalar scales into a cuBLASLt FP8 GEMM on GPU.
    return (jnp.dot(ad, bd.T, preferred_element_type=jnp.float32) * (sa * sb)).astype(jnp.bfloat16)


@jax.jit
def _dequantized_dot(a, b):
    """The exact product of two FP8 tensors up to f32 rounding: the per-tensor reference."""
    return jnp.dot(a.dequantize(), b.dequantize().T, precision="highest")


@jax.jit
def _tiled_reference(a, b):
    return jfp8.scaled_matmul_reference(a, b, jnp.float32)


def _cases(shape: GemmShape, use_kernels: bool, seed: int, configs: list[str], on_gpu: bool,
           deepgemm: pathlib.Path | None = None):
    """(cases, skips, info, harnessed) for one shape; `harnessed`: implementations timed in a
    process of their own (`_bench.run_harnessed`; DeepGEMM, when `deepgemm` is its usable harness)."""
    m, n, k = shape
    ops = _operands(random_normal(seed, (m, k)), random_normal(seed + 1, (n, k)) / np.sqrt(k))
    x, w, xb, wb, pa, pb, a, b = (ops[key] for key in ("x", "w", "xb", "wb", "pa", "pb", "a", "b"))
    cases, skips, info = [], [], {}

    bf16_ref = functools.cache(lambda: _f32_dot(x, w))
    cases.append(Case(BASELINE, lambda: _bf16_dot(xb, wb), _jax_check(bf16_ref), TOL_BF16_OPERANDS, "bf16"))

    pargs = (pa.data, pa.scale[0, 0], pb.data, pb.scale[0, 0])
    cases.append(Case("xla-fp8-per-tensor", lambda: _fp8_per_tensor(*pargs),
                      _jax_check(lambda: _dequantized_dot(pa, pb)), TOL_FP8_OUTPUT, "fp8"))

    ref = functools.cache(lambda: _tiled_reference(a, b))
    if on_gpu:
        t_cases, t_skips, t_info = _torch_cases(shape, xb, wb, bf16_ref, a, b, ref)
        cases += t_cases
        skips += t_skips
        info.update(t_info)
    else:
        skips += [Skip(n_, "no GPU") for n_ in ("torch-bf16", "torch-fp8-blockwise")]

    harnessed = []
    if deepgemm is not None and (m, n, k, 1) not in harness_module().built_for(deepgemm):
        skips.append(Skip(DEEPGEMM, "DeepGEMM's harness was not built for this shape (deepgemm_harness.py --build --shapes)"))
    elif deepgemm is not None:
        deepgemm_harness = harness_module()
        harnessed.append((DEEPGEMM, lambda timing: deepgemm_harness.run(
            a, b, n, warmup=timing.warmup, repeats=timing.repeats, inner=timing.inner, binary=deepgemm),
            lambda got: device_rel_error(jnp.asarray(got["out"]), ref()), deepgemm_harness.row_info(m, n, k)))

    impl = "mosaic" if use_kernels else "xla"
    tiled = jax.jit(lambda a, b: jfp8.scaled_matmul(a, b, out_dtype=jnp.bfloat16, impl=impl))
    kp = a.data.shape[1]
    chosen = _chosen(m, n, kp) if use_kernels else None  # the config the front door runs
    cases.append(Case(f"jfp8-{impl}", lambda: tiled(a, b), _jax_check(ref), TOL_FP8_OUTPUT, "fp8",
                      info=chosen))

    if configs:
        from pallas_kernels import gemm

        # The kernel's operands, laid out once (outside the timed call): a's chunk scales per row,
        # b's (128, 128) block scales as stored.
        a_data, a_scale = jax.jit(chunk_operand, static_argnums=1)(a, kp)
        if use_kernels:  # the front door's kernel alone: every wrapper op done outside the timer
            laid_out, kernel = gemm.split_scaled_matmul(a_data, a_scale, b.data, b.scale, n=n, b_block_rows=jfp8.TILE,
                                                        out_dtype=jnp.bfloat16)
            laid_out, kernel = jax.block_until_ready(laid_out), jax.jit(kernel)
            cases.append(Case(KERNEL_ONLY, lambda: kernel(*laid_out), _jax_check(ref), TOL_FP8_OUTPUT, "fp8",
                              info=chosen))
        else:
            skips.append(Skip(KERNEL_ONLY, "needs a Hopper GPU"))
        for text in configs:
            name = f"jfp8-mosaic[{config_label(text)}]"
            config = parse_config(text, gemm.GemmConfig)  # bad fields fail here, on any machine
            if not use_kernels:
                skips.append(Skip(name, "needs a Hopper GPU"))
                continue
            kernel = jax.jit(lambda ad, sa, bd, sb, config=config: gemm.scaled_matmul(
                ad, sa, bd, sb, n=n, b_block_rows=jfp8.TILE, out_dtype=jnp.bfloat16, config=config))
            cases.append(Case(name, lambda kernel=kernel: kernel(a_data, a_scale, b.data, b.scale),
                              _jax_check(ref), TOL_FP8_OUTPUT, "fp8",
                              info=kernel_info(config, m, n, kp, source="given", out_dtype=jnp.bfloat16)))
    return cases, skips, info, harnessed


def _chosen(m: int, n: int, kp: int) -> dict:
    """`kernel_info` of the config `gemm.scaled_matmul` picks with none given (b block-scaled,
    bf16 out): the measured table's where it has one, else the rule's."""
    from pallas_kernels import _mgpu, tuning

    tabled = tuning.table_config(m, n, kp, jnp.bfloat16, _mgpu.device_kind())
    config = tuning.dense_config(m, n, kp, jnp.bfloat16)
    return kernel_info(config, m, n, kp, source="rule" if tabled is None else "table", out_dtype=jnp.bfloat16)


def print_rows(rows: list[dict], label=lambda r: f"{r['m']}x{r['n']}x{r['k']}") -> None:
    print(f"\n{'impl':34s} {'shape':>18s} {'TFLOP/s':>9} {'x bf16':>7} {'fp8 peak':>8}")
    for r in rows:
        ratio = "" if r.get("ratio_vs_bf16") is None else f"{r['ratio_vs_bf16']:7.2f}"
        frac = "" if r.get("frac_fp8_peak") is None else f"{r['frac_fp8_peak']:8.1%}"
        print(f"{r['impl']:34s} {label(r):>18s} {r['tflops']:9.4g} {ratio:>7} {frac:>8}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None)
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a GemmConfig for the Mosaic kernel, benched as its own row (repeatable)")
    p.add_argument("--deepgemm", type=pathlib.Path, default=None,
                   help="DeepGEMM's harness (default: benchmarks/hopper/bin/deepgemm_harness, built by "
                        "benchmarks/hopper/deepgemm_harness.py --build): a row per shape on a Hopper GPU")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.config:
        from pallas_kernels import gemm

        check_configs(p, args.config, gemm.GemmConfig)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    use_kernels = is_hopper(device)
    shapes = args.shapes or ((*DENSE_SHAPES, *SMALL_M_SHAPES) if on_gpu else CPU_DENSE_SHAPES)
    timing = timing_from_args(args, on_gpu)
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}")
    if not use_kernels:
        print("no Hopper GPU: the jfp8 row is the XLA reference path (same numerics), not the kernels."
              " Run on an H100/H200 for kernel numbers.")

    start = time.perf_counter()
    rows, failed, skipped, info = [], [], [], {}
    deepgemm, why = harness_module().usable(args.deepgemm, use_kernels)
    info["deepgemm"] = why

    def save():
        add_ratios(rows, BASELINE, BASELINES)
        return write_record(
            "bench_gemm", rows, args.out, timing=dict(dataclasses.asdict(timing), method=TIMING_METHOD),
            peak_source=PEAK_SOURCE, target_vs_bf16=TARGET_DENSE_VS_BF16, configs=args.config,
            failed=failed, skipped=skipped, **info,
        )

    for shape, label in within_budget(shapes, shape_label, args.budget_s, start, skipped):
        m, n, k = shape
        try:
            cases, skips, case_info, harnessed = _cases(shape, use_kernels, args.seed, args.config, on_gpu,
                                                        deepgemm)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory preparing operands
            failed.append(error_entry("(operands)", label, e))
            continue
        info.update(case_info)
        skipped += [dict(impl=s.impl, problem=label, reason=s.reason) for s in skips]
        row = functools.partial(gemm_row, device_kind=device.device_kind, flops=2.0 * m * n * k,
                                m=m, n=n, k=k)
        run_cases(cases, label, timing, row, rows, failed, args.only)
        if deepgemm is None:
            skipped.append(dict(impl=DEEPGEMM, problem=label, reason=why["error"]))
        elif not args.only or DEEPGEMM.startswith(tuple(args.only)):
            run_harnessed(harnessed, label, timing, row, rows, failed, TOL_FP8_OUTPUT)
        save()
    path = save()
    print_rows(rows)
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())
