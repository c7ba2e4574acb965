"""Grouped (MoE) GEMM benchmark: jfp8's grouped FP8 GEMM beside bf16 baselines, one run, one device.

    python benchmarks/bench_grouped.py                       # GPU: MoE shapes; CPU: tiny, XLA only
    python benchmarks/bench_grouped.py --shapes 8x4096x4096x7168
    python benchmarks/bench_grouped.py --mgpu-config block_m=128,block_n=128,max_concurrent_steps=4
    python benchmarks/bench_grouped.py --config warp_specialized=false,persistent=false,tile_m=64,max_concurrent_steps=2
    python benchmarks/bench_grouped.py --op wgrad            # the MoE Wgrad, grouped along tokens

A problem GxRxNxK is G experts with R tokens each (equal groups, T = G*R rows sorted by expert),
x (T, K) times one weight per expert, N outputs. Implementations (rows), output bf16:
  xla-bf16-einsum     per-expert batched jnp.einsum on bf16 ("gmk,gkn->gmn", equal groups): the
                      baseline the issue's ratio is taken against
  xla-ragged-dot-bf16 jax.lax.ragged_dot on bf16 (on GPU XLA makes it a dense masked dot)
  mgpu-ragged-dot-bf16  jax's Pallas Mosaic GPU ragged_dot_mgpu on bf16 (Hopper only)
  deepgemm-m-grouped  DeepGEMM's m-grouped contiguous FP8 GEMM (Hopper, with its harness built:
                      `--deepgemm`), same operands, in its own process timed by CUDA events
  jfp8-<impl>         jfp8.grouped_scaled_matmul: 1x128 tiles x 128x128 blocks, FP32 promotion
                      (impl "mosaic" on Hopper, else the XLA reference path)
  jfp8-mosaic[<config>]  pallas_kernels.grouped_gemm.grouped_scaled_matmul with
                      GroupedGemmConfig(<config>), one row per --config (e.g. the simple form)
The bf16 baselines get the weights in their preferred (G, K, N) layout; jfp8 stores them (G, N, K)
as its kernel needs. FLOPs are the useful 2*T*N*K for every row. Checks, timing and the record
(`<out>/bench_grouped-<device>-<date>.json`) work as in bench_gemm.py.

`--op wgrad` measures the same problems' weight gradient instead, dW_g (N, K) = dy_g^T x_g,
contracted over the group's R tokens (K grouped along the tokens), output float32 as in training:
  xla-bf16-einsum     per-expert "gmn,gmk->gnk" on bf16 (equal groups): the baseline
  xla-ragged-dot-bf16 jax.lax.ragged_dot_general with the ragged dimension contracted
  mgpu-transposed-ragged-dot-bf16  jax's Pallas Mosaic GPU transposed_ragged_dot on bf16 (Hopper
                      only; its output is bf16)
  jfp8-<impl>         jfp8.grouped_wgrad_matmul: dy^T and x^T scaled per 128 tokens, FP32
                      promotion per 128-token chunk (the operands quantized outside the timing)
  jfp8-mosaic[<config>]  pallas_kernels.grouped_wgrad.grouped_wgrad with GroupedGemmConfig(<config>)
Its record is `<out>/bench_grouped_wgrad-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.api import is_hopper
from gpu_tables import TARGET_GROUPED_VS_BF16
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
    parse_grouped_shape,
    random_normal,
    report_end,
    run_cases,
    run_harnessed,
    shape_label,
    timing_from_args,
    within_budget,
    write_record,
)
from jfp8.reference import chunk_operand
from pallas_kernels.shapes import GROUPED_SHAPES, GroupedShape

BASELINE = "xla-bf16-einsum"
# DeepGEMM's m-grouped contiguous FP8 GEMM through jfp8's host program (`hopper/deepgemm_harness.py`),
# Fprop only, timed by CUDA events in its own process (as bench_gemm's `deepgemm-1d2d`).
DEEPGEMM = "deepgemm-m-grouped"
BASELINES = ("xla-bf16-einsum", "xla-ragged-dot-bf16", "mgpu-ragged-dot-bf16", DEEPGEMM)
TOL_BF16_OPERANDS = 2e-2
TOL_FP8_OUTPUT = 1e-2
CPU_GROUPED_SHAPES = (GroupedShape(2, 128, 256, 256), GroupedShape(4, 64, 128, 512))
# ragged_dot_mgpu's tiling: one of the configurations its own autotuner (ragged_dot_mgpu.main)
# searches; override with --mgpu-config.
MGPU_DEFAULTS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2)


def parse_kv(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} must look like name=value")
        out[name.strip()] = int(value)
    return out


@functools.partial(jax.jit, static_argnums=2)
def _operands(x: jax.Array, w: jax.Array, rows_per_group: int) -> dict:
    """x (T, K) and per-expert weights w (G, N, K) in f32, bf16 (weights as (G, K, N)) and FP8
    (weights in 128x128 blocks), and the equal group sizes."""
    g = w.shape[0]
    return dict(x=x, w=w, xb=x.astype(jnp.bfloat16), wb_kn=jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16),
                a=jfp8.quantize(x, (1, jfp8.TILE)), b=jfp8.quantize(w, (jfp8.TILE, jfp8.TILE)),
                sizes=jnp.full((g,), rows_per_group, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _f32_reference(groups, x, w_nk):
    t, k = x.shape
    return jnp.einsum("gmk,gnk->gmn", x.reshape(groups, t // groups, k), w_nk,
                      precision="highest").reshape(t, -1)


@functools.partial(jax.jit, static_argnums=0)
def _einsum_bf16(groups, x, w_kn):
    t, k = x.shape
    return jnp.einsum("gmk,gkn->gmn", x.reshape(groups, t // groups, k), w_kn,
                      preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.jit
def _ragged_bf16(x, w_kn, sizes):
    return jax.lax.ragged_dot(x, w_kn, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.jit
def _fp8_reference(a, b, sizes):
    return jfp8.grouped_scaled_matmul_reference(a, b, sizes, jnp.float32)


def _check(ref):
    return lambda out: device_rel_error(out.reshape(ref().shape), ref())


def _mgpu_case(xb, wb_kn, sizes, mgpu_config: dict, ref):
    """ragged_dot_mgpu on bf16 (Hopper only), or the reason it cannot run."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as e:  # noqa: BLE001 - recorded as the reason
        return Skip("mgpu-ragged-dot-bf16", f"import failed: {type(e).__name__}: {e}")
    config = {**MGPU_DEFAULTS, **mgpu_config}
    fn = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, **config))
    return Case("mgpu-ragged-dot-bf16", lambda: fn(xb, wb_kn, group_sizes=sizes),
                _check(ref), TOL_BF16_OPERANDS, "bf16")


def _cases(shape: GroupedShape, use_kernels: bool, seed: int, mgpu_config: dict, configs: list[str],
           deepgemm=None):
    """(cases, skips, harnessed) for one shape; `harnessed`: DeepGEMM's m-grouped contiguous
    kernel in its harness's process (`_bench.run_harnessed`), when `deepgemm` is the usable program."""
    g, r, n, k = shape
    ops = _operands(random_normal(seed, (g * r, k)), random_normal(seed + 1, (g, n, k)) / np.sqrt(k), r)
    x, w, xb, wb_kn, a, b, sizes = (ops[key] for key in ("x", "w", "xb", "wb_kn", "a", "b", "sizes"))
    cases, skips = [], []

    bf16_ref = functools.cache(lambda: _f32_reference(g, x, w))
    cases.append(Case(BASELINE, lambda: _einsum_bf16(g, xb, wb_kn), _check(bf16_ref), TOL_BF16_OPERANDS, "bf16"))
    cases.append(Case("xla-ragged-dot-bf16", lambda: _ragged_bf16(xb, wb_kn, sizes), _check(bf16_ref),
                      TOL_BF16_OPERANDS, "bf16"))
    if use_kernels:
        case = _mgpu_case(xb, wb_kn, sizes, mgpu_config, bf16_ref)
        (cases if isinstance(case, Case) else skips).append(case)
    else:
        skips.append(Skip("mgpu-ragged-dot-bf16", "needs a Hopper GPU"))

    ref = functools.cache(lambda: _fp8_reference(a, b, sizes))
    harnessed = []
    if deepgemm is not None and (g * r, n, k, g) not in harness_module().built_for(deepgemm):
        skips.append(Skip(DEEPGEMM, "DeepGEMM's harness was not built for this shape (deepgemm_harness.py --build --shapes)"))
    elif deepgemm is not None:
        deepgemm_harness = harness_module()
        harnessed.append((DEEPGEMM, lambda timing: deepgemm_harness.run(
            a, b, n, warmup=timing.warmup, repeats=timing.repeats, inner=timing.inner, sizes=np.asarray(sizes),
            binary=deepgemm), lambda got: _check(ref)(jnp.asarray(got["out"])),
            deepgemm_harness.row_info(g * r, n, k, g)))
    impl = "mosaic" if use_kernels else "xla"
    grouped = jax.jit(lambda a, b, s: jfp8.grouped_scaled_matmul(a, b, s, out_dtype=jnp.bfloat16, impl=impl))
    kp = a.data.shape[1]
    chosen = _chosen(g, g * r, n, kp) if use_kernels else None  # the config the front door runs
    cases.append(Case(f"jfp8-{impl}", lambda: grouped(a, b, sizes), _check(ref), TOL_FP8_OUTPUT, "fp8",
                      info=chosen))

    if configs:
        from pallas_kernels import grouped_gemm

        # The kernel's operands, laid out once (outside the timed call): a's chunk scales per row.
        a_data, a_scale = jax.jit(chunk_operand, static_argnums=1)(a, a.data.shape[1])
        for text in configs:
            name = f"jfp8-mosaic[{config_label(text)}]"
            config = parse_config(text, grouped_gemm.GroupedGemmConfig)  # fails here on any machine
            if not use_kernels:
                skips.append(Skip(name, "needs a Hopper GPU"))
                continue
            kernel = jax.jit(lambda ad, sa, bd, sb, s, config=config: grouped_gemm.grouped_scaled_matmul(
                ad, sa, bd, sb, s, n=n, out_dtype=jnp.bfloat16, config=config))
            cases.append(Case(name, lambda kernel=kernel: kernel(a_data, a_scale, b.data, b.scale, sizes),
                              _check(ref), TOL_FP8_OUTPUT, "fp8",
                              info=kernel_info(config, g * r, n, kp, source="given", out_dtype=jnp.bfloat16,
                                               groups=g)))
    return cases, skips, harnessed


def _chosen(groups: int, rows: int, n: int, kp: int) -> dict:
    """`kernel_info` of the config `grouped_scaled_matmul` picks with none given (bf16 out): the
    measured grouped table's where it has one, else the rule's."""
    from pallas_kernels import _mgpu, tuning

    tabled = tuning.table_config(rows, n, kp, jnp.bfloat16, _mgpu.device_kind(), kind="grouped", groups=groups)
    config = tuning.grouped_config(rows, n, kp, jnp.bfloat16, groups=groups)
    return kernel_info(config, rows, n, kp, source="rule" if tabled is None else "table", out_dtype=jnp.bfloat16,
                       groups=groups)


def _wgrad_info(config, groups: int, rows: int, n: int, k: int, source: str) -> dict:
    """`kernel_info` of a Wgrad config: the kernel's output is each group's K x N (rows: K), its
    contraction the group's tokens, b tile-scaled, f32 out."""
    tp = -(-rows // jfp8.TILE) * jfp8.TILE
    return kernel_info(config, groups * k, n, tp, source=source, out_dtype=jnp.float32, scalar_b=False)


MGPU_WGRAD = "mgpu-transposed-ragged-dot-bf16"
WGRAD_BASELINES = ("xla-bf16-einsum", "xla-ragged-dot-bf16", MGPU_WGRAD)


@jax.jit
def _wgrad_operands(x: jax.Array, dy: jax.Array) -> dict:
    """x (T, K) and dy (T, N) in bf16, and both transposed and scaled per 128 tokens for jfp8."""
    return dict(xb=x.astype(jnp.bfloat16), dyb=dy.astype(jnp.bfloat16),
                a_t=jfp8.quantize(dy, (jfp8.TILE, 1)).mT, b_t=jfp8.quantize(x, (jfp8.TILE, 1)).mT)


@functools.partial(jax.jit, static_argnums=0)
def _wgrad_f32_reference(groups, x, dy):
    t = x.shape[0]
    return jnp.einsum("gmn,gmk->gnk", dy.reshape(groups, t // groups, -1), x.reshape(groups, t // groups, -1),
                      precision="highest")


@functools.partial(jax.jit, static_argnums=0)
def _wgrad_einsum_bf16(groups, xb, dyb):
    t = xb.shape[0]
    return jnp.einsum("gmn,gmk->gnk", dyb.reshape(groups, t // groups, -1), xb.reshape(groups, t // groups, -1),
                      preferred_element_type=jnp.float32)


@jax.jit
def _wgrad_ragged_bf16(xb, dyb, sizes):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(dyb, xb, sizes, dims, preferred_element_type=jnp.float32)


@jax.jit
def _wgrad_fp8_reference(a_t, b_t, sizes):
    return jfp8.grouped_wgrad_reference(a_t, b_t, sizes, jnp.float32)


def _wgrad_cases(shape: GroupedShape, use_kernels: bool, seed: int, mgpu_config: dict, configs: list[str]):
    """The Wgrad rows of one problem: dW_g (N, K) = dy_g^T x_g over each group's R tokens."""
    g, r, n, k = shape
    sizes = jnp.full((g,), r, jnp.int32)
    x, dy = random_normal(seed, (g * r, k)), random_normal(seed + 1, (g * r, n)) / np.sqrt(r)
    ops = _wgrad_operands(x, dy)
    xb, dyb, a_t, b_t = (ops[key] for key in ("xb", "dyb", "a_t", "b_t"))
    cases, skips = [], []

    bf16_ref = functools.cache(lambda: _wgrad_f32_reference(g, x, dy))
    cases.append(Case(BASELINE, lambda: _wgrad_einsum_bf16(g, xb, dyb), _check(bf16_ref), TOL_BF16_OPERANDS, "bf16"))
    cases.append(Case("xla-ragged-dot-bf16", lambda: _wgrad_ragged_bf16(xb, dyb, sizes), _check(bf16_ref),
                      TOL_BF16_OPERANDS, "bf16"))
    if not use_kernels:
        skips.append(Skip(MGPU_WGRAD, "needs a Hopper GPU"))
    else:
        try:
            from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
        except Exception as e:  # noqa: BLE001 - recorded as the reason
            skips.append(Skip(MGPU_WGRAD, f"import failed: {type(e).__name__}: {e}"))
        else:
            config = {**MGPU_DEFAULTS, **mgpu_config}
            fn = jax.jit(functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot, **config))
            cases.append(Case(MGPU_WGRAD, lambda: fn(dyb, xb, group_sizes=sizes), _check(bf16_ref),
                              TOL_BF16_OPERANDS, "bf16"))

    ref = functools.cache(lambda: _wgrad_fp8_reference(a_t, b_t, sizes))
    impl = "mosaic" if use_kernels else "xla"
    wgrad = jax.jit(lambda a_t, b_t, s: jfp8.grouped_wgrad_matmul(a_t, b_t, s, impl=impl))
    from pallas_kernels.configs import GroupedGemmConfig

    default = _wgrad_info(GroupedGemmConfig(), g, r, n, k, "default") if use_kernels else None
    cases.append(Case(f"jfp8-{impl}", lambda: wgrad(a_t, b_t, sizes), _check(ref), TOL_FP8_OUTPUT, "fp8",
                      info=default))

    if configs:
        from pallas_kernels import grouped_wgrad

        t, tp = g * r, -(-g * r // jfp8.TILE) * jfp8.TILE
        lay_out = jax.jit(chunk_operand, static_argnums=1)
        (ad, sa), (bd, sb) = lay_out(a_t, tp), lay_out(b_t, tp)  # outside the timed call
        for text in configs:
            name = f"jfp8-mosaic[{config_label(text)}]"
            config = parse_config(text, grouped_wgrad.GroupedGemmConfig)  # fails here on any machine
            if not use_kernels:
                skips.append(Skip(name, "needs a Hopper GPU"))
                continue
            kernel = jax.jit(lambda ad, sa, bd, sb, s, config=config: grouped_wgrad.grouped_wgrad(
                ad, sa, bd, sb, s, t=t, config=config))
            cases.append(Case(name, lambda kernel=kernel: kernel(ad, sa, bd, sb, sizes), _check(ref),
                              TOL_FP8_OUTPUT, "fp8", info=_wgrad_info(config, g, r, n, k, "given")))
    return cases, skips


OPS = {"fprop": ("bench_grouped", _cases, BASELINES), "wgrad": ("bench_grouped_wgrad", _wgrad_cases, WGRAD_BASELINES)}


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'impl':24s} {'GxRxNxK':>20s} {'TFLOP/s':>9} {'x bf16':>7} {'fp8 peak':>8}")
    for r in rows:
        ratio = "" if r.get("ratio_vs_bf16") is None else f"{r['ratio_vs_bf16']:7.2f}"
        frac = "" if r.get("frac_fp8_peak") is None else f"{r['frac_fp8_peak']:8.1%}"
        shape = f"{r['groups']}x{r['m'] // r['groups']}x{r['n']}x{r['k']}"
        print(f"{r['impl']:24s} {shape:>20s} {r['tflops']:9.4g} {ratio:>7} {frac:>8}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_grouped_shape, nargs="+", default=None, metavar="GxRxNxK")
    p.add_argument("--mgpu-config", type=parse_kv, default={}, metavar="NAME=INT,...",
                   help=f"ragged_dot_mgpu tiling overrides (defaults {MGPU_DEFAULTS})")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a GroupedGemmConfig for jfp8's grouped kernel, benched as its own row (repeatable)")
    p.add_argument("--op", choices=tuple(OPS), default="fprop",
                   help="fprop: y = x W_g^T per group (default); wgrad: dW_g = dy_g^T x_g, grouped along tokens")
    p.add_argument("--deepgemm", type=pathlib.Path, default=None,
                   help="DeepGEMM's harness for the fprop rows (default: benchmarks/hopper/bin/deepgemm_harness)")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.config:
        from pallas_kernels import grouped_gemm

        check_configs(p, args.config, grouped_gemm.GroupedGemmConfig)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    use_kernels = is_hopper(device)
    shapes = args.shapes or (GROUPED_SHAPES if on_gpu else CPU_GROUPED_SHAPES)
    timing = timing_from_args(args, on_gpu)
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}")
    if not use_kernels:
        print("no Hopper GPU: the jfp8 row is the XLA reference path and the Mosaic GPU rows are skipped.")

    start = time.perf_counter()
    rows, failed, skipped = [], [], []
    key = lambda r: (r["groups"], r["m"], r["n"], r["k"])  # noqa: E731

    record_name, make_cases, baselines = OPS[args.op]
    deepgemm, why = harness_module().usable(args.deepgemm, use_kernels)
    if args.op != "fprop":
        deepgemm, why = None, {"ok": False, "error": "DeepGEMM's rows are for the fprop op"}

    def save():
        add_ratios(rows, BASELINE, baselines, key=key)
        return write_record(
            record_name, rows, args.out, op=args.op, timing=dict(dataclasses.asdict(timing), method=TIMING_METHOD),
            peak_source=PEAK_SOURCE, target_vs_bf16=TARGET_GROUPED_VS_BF16,
            mgpu_config={**MGPU_DEFAULTS, **args.mgpu_config}, configs=args.config, failed=failed,
            skipped=skipped, deepgemm=why,
        )

    for shape, label in within_budget(shapes, shape_label, args.budget_s, start, skipped):
        try:
            if args.op == "fprop":
                cases, skips, harnessed = make_cases(shape, use_kernels, args.seed, args.mgpu_config, args.config,
                                                     deepgemm)
            else:
                (cases, skips), harnessed = make_cases(shape, use_kernels, args.seed, args.mgpu_config,
                                                       args.config), []
        except Exception as e:  # noqa: BLE001 - e.g. out of memory preparing operands
            failed.append(error_entry("(operands)", label, e))
            continue
        skipped += [dict(impl=s.impl, problem=label, reason=s.reason) for s in skips]
        g, r, n, k = shape
        row = functools.partial(gemm_row, device_kind=device.device_kind, flops=2.0 * g * r * n * k,
                                groups=g, m=g * r, n=n, k=k)
        run_cases(cases, label, timing, row, rows, failed, args.only)
        if deepgemm is None and args.op == "fprop":
            skipped.append(dict(impl=DEEPGEMM, problem=label, reason=why["error"]))
        elif not args.only or DEEPGEMM.startswith(tuple(args.only)):
            run_harnessed(harnessed, label, timing, row, rows, failed, TOL_FP8_OUTPUT)
        save()
    path = save()
    print_rows(rows)
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())
