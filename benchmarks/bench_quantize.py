"""Quantization benchmark: jfp8's fused FP8 quantization kernels against the device's measured copy
bandwidth, one run, one device.

    python benchmarks/bench_quantize.py                      # GPU: large inputs; CPU: tiny, XLA only
    python benchmarks/bench_quantize.py --shapes 8192x8192:bfloat16 7168x2048:float32
    python benchmarks/bench_quantize.py --config swizzle=false     # + the unswizzled kernels

Rows:
  copy-xla-add-one    jit(x + 1) on a large bf16 array: reads and writes every byte once (XLA
                      forwards a plain copy of an input without running anything)
  copy-torch          torch `dst.copy_(src)`, device to device (GPU with torch only)
  jfp8-<impl>-<kernel> for kernel in
    tile      jfp8.quantize(x, (1, 128))                 activations (Fprop / Dgrad lhs)
    block     jfp8.quantize(x, (128, 128))               weights
    block-t   jfp8.quantize_weight(x)                    weights in both orientations (Fprop and
                                                         Dgrad), one fused pass on Hopper
    block+mT  the same as quantize(x, (128, 128)) and .mT: the two-pass way block-t replaces
    column-t  jfp8.quantize_wgrad_operand(x)             x^T scaled per 128 tokens (Wgrad)
    grad      jfp8.quantize_grad(x)                      a gradient's Dgrad and Wgrad forms, one
                                                         fused pass on Hopper
    activation jfp8.quantize_activation(x)               an activation's Fprop tiles and their
                                                         re-tiling for Wgrad, one fused pass on Hopper
    grad-2    the same as quantize(x, (1, 128)) and quantize_wgrad_operand(x): two reads of x
    retile    jfp8.retile_wgrad_operand(tile-quantized x) dequantize, transpose, requantize (§3.5.2)
  (impl "mosaic", the fused kernels, on Hopper; the XLA reference path elsewhere)
  jfp8-xla-<kernel>   on a Hopper, after every kernel row: XLA's own run of the same quantization
                      (the reference, as `Fp8Recipe(quantize_impl="xla")` runs it inside a step) for
                      the kinds a training step runs (XLA_ROW_KERNELS), at the first --xla-rows
                      shapes; checked against the reference computed on the host's CPU, so a row
                      also says whether XLA:GPU reproduces the reference's bits
  jfp8-mosaic-<kernel>[<config>]  the same kernel from pallas_kernels.quantize with
                      QuantizeConfig(<config>), one row per --config (Hopper only)

Bytes are the fewest a kernel must move: its input read once plus its outputs (E4M3 data and
FP32 scales) written once, counted from the actual arrays. GB/s = bytes / median time; the
fraction is against the best copy row of the same run (the issue's target: >= 0.7). Every
quantizer's data and scales must equal the XLA reference bit for bit before it is timed.
Device time (`device`, on a GPU by default: `--device-time CALLS`): CALLS more calls under jax's
profiler, the kernels' summed durations per call and how many kernels a call launches, with GB/s
and the fraction of the copy row's device GB/s. The wall clock of a short call can be host
dispatch: on the H100 (2026-11-26) `tile` took 97, 87 and 84 µs at 203, 89 and 74 MB, times
that do not follow the bytes; the device time says what the kernel itself takes.
Record: `<out>/bench_quantize-<device>-<date>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jfp8
from jfp8.api import is_hopper
from pallas_kernels.shapes import QUANTIZE_SHAPES
from gpu_tables import TARGET_QUANTIZE_FRAC_OF_COPY
from step_profile import kernel_time
from _bench import (
    TIMING_METHOD,
    Case,
    Measurement,
    Skip,
    add_common_args,
    check_configs,
    config_label,
    error_entry,
    parse_config,
    random_normal,
    report_end,
    run_cases,
    timing_from_args,
    torch_cuda,
    torch_sync,
    within_budget,
    write_record,
)

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


class QShape(NamedTuple):
    m: int
    k: int
    dtype: str


GPU_SHAPES = tuple(QShape(*s) for s in QUANTIZE_SHAPES)
CPU_SHAPES = (QShape(256, 512, "bfloat16"),)
# The copy ceiling: large enough to dwarf the L2 (50-60 MB) several times over.
GPU_COPY_ELEMS = 1 << 27  # 256 MiB of bf16
CPU_COPY_ELEMS = 1 << 20


def parse_qshape(s: str) -> QShape:
    try:
        dims, _, dtype = s.partition(":")
        m, k = (int(v) for v in dims.lower().split("x"))
        dtype = dtype or "bfloat16"
        if dtype not in _DTYPES:
            raise ValueError(dtype)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must look like MxK[:dtype] with dtype in {sorted(_DTYPES)}, got {s!r}")
    return QShape(m, k, dtype)


def _fp8_outputs(out) -> list[jax.Array]:
    """The arrays a quantizer writes (data and scales), from Fp8Tensors or a kernel's arrays."""
    return jax.tree.leaves(out)


def _two_pass_weight(x, impl):
    q = jfp8.quantize(x, (jfp8.TILE, jfp8.TILE), impl=impl)
    return q, q.mT


def _two_pass_grad(x, impl):
    return jfp8.quantize(x, (1, jfp8.TILE), impl=impl), jfp8.quantize_wgrad_operand(x, impl=impl)


# Each kernel: (measured implementation, reference), both x -> Fp8Tensor. The measured side takes
# `impl`; the reference is always the XLA path. Module level so tests can substitute a wrong one.
@jax.jit
def _retile_input(x):
    return jfp8.quantize(x, (1, jfp8.TILE))


MEASURED: dict[str, Callable] = {
    "tile": lambda x, impl: jfp8.quantize(x, (1, jfp8.TILE), impl=impl),
    "block": lambda x, impl: jfp8.quantize(x, (jfp8.TILE, jfp8.TILE), impl=impl),
    "block-t": lambda x, impl: jfp8.quantize_weight(x, impl=impl),
    "block+mT": _two_pass_weight,
    "column-t": lambda x, impl: jfp8.quantize_wgrad_operand(x, impl=impl),
    "grad": lambda x, impl: jfp8.quantize_grad(x, impl=impl),
    "grad-2": _two_pass_grad,
    "activation": lambda x, impl: jfp8.quantize_activation(x, impl=impl),
    "retile": lambda t, impl: jfp8.retile_wgrad_operand(t, impl=impl),
}
REFERENCE: dict[str, Callable] = {
    "tile": jax.jit(lambda x: jfp8.quantize(x, (1, jfp8.TILE), impl="xla")),
    "block": jax.jit(lambda x: jfp8.quantize(x, (jfp8.TILE, jfp8.TILE), impl="xla")),
    "block-t": jax.jit(lambda x: _two_pass_weight(x, "xla")),
    "block+mT": jax.jit(lambda x: _two_pass_weight(x, "xla")),
    "column-t": jax.jit(lambda x: jfp8.quantize_wgrad_operand(x, impl="xla")),
    "grad": jax.jit(lambda x: _two_pass_grad(x, "xla")),
    "grad-2": jax.jit(lambda x: _two_pass_grad(x, "xla")),
    "activation": jax.jit(lambda x: jfp8.quantize_activation(x, impl="xla")),
    "retile": jax.jit(lambda t: jfp8.retile_wgrad_operand(t, impl="xla")),
}


def _both_config(config):
    """The config of the both-forms kernels (grad, activation): `config` where its column_chunks
    is a multiple of 4 (their row scales are stored 16 bytes at a time), else its other fields
    (swizzle) with `qk.BOTH_CONFIG`'s chunking (4 chunks per CTA through 2 slots)."""
    from pallas_kernels import quantize as qk

    if config.column_chunks % 4 == 0:
        return config
    return dataclasses.replace(config, column_chunks=qk.BOTH_CONFIG.column_chunks, stages=qk.BOTH_CONFIG.stages)


def _configured(kernel: str, config):
    """`kernel` straight from `pallas_kernels.quantize` with `config`: x (or, for retile, the
    (1, 128)-quantized x) -> the arrays of MEASURED[kernel]'s Fp8Tensors, in their order."""
    from pallas_kernels import quantize as qk

    def with_transposes(data, scale, data_t=None):
        return data, scale, data.T if data_t is None else data_t, scale.T

    return {
        "tile": lambda x: qk.quantize_tile(x, config=config),
        "block": lambda x: qk.quantize_block(x, config=config),
        "block-t": lambda x: with_transposes(*qk.quantize_block_and_transpose(x, config=config)),
        "block+mT": lambda x: with_transposes(*qk.quantize_block(x, config=config)),
        "column-t": lambda x: qk.quantize_column(x, transpose=True, config=config),
        "grad": lambda x: qk.quantize_tile_and_column_t(x, config=_both_config(config)),
        "activation": lambda x: qk.quantize_tile_and_retile_t(x, config=_both_config(config)),
        "grad-2": lambda x: (*qk.quantize_tile(x, config=config),
                             *qk.quantize_column(x, transpose=True, config=config)),
        "retile": lambda t: qk.retile_tile_to_column_t(
            t.data, t.scale, m=t.logical[0], k=t.logical[1], config=config
        ),
    }[kernel]


def _mismatches(out, ref) -> float:
    """Elements of data and scales whose bits differ from the reference (so NaN == NaN)."""
    bad = 0
    if len(_fp8_outputs(out)) != len(_fp8_outputs(ref)):
        return float("inf")
    for got, want in zip(_fp8_outputs(out), _fp8_outputs(ref)):
        if got.shape != want.shape or got.dtype != want.dtype:
            return float("inf")
        bits = np.uint8 if got.dtype.itemsize == 1 else np.uint32
        bad += int(np.sum(np.asarray(got).view(bits) != np.asarray(want).view(bits)))
    return float(bad)


def _nbytes(arrays) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in arrays))


class QCase(NamedTuple):
    case: Case
    bytes: int
    m: int
    k: int
    dtype: str
    kernel: str


def _copy_cases(on_gpu: bool, seed: int) -> tuple[list[QCase], list[Skip]]:
    elems = GPU_COPY_ELEMS if on_gpu else CPU_COPY_ELEMS
    cols = 8192 if on_gpu else 1024
    x = _input(QShape(elems // cols, cols, "bfloat16"), seed)
    add_one = jax.jit(lambda x: x + 1)
    mismatches = jax.jit(lambda out, x: jnp.sum(out != x + 1))
    nbytes = 2 * x.size * x.dtype.itemsize
    check = lambda out: float(mismatches(out, x))  # noqa: E731
    cases = [QCase(Case("copy-xla-add-one", lambda: add_one(x), check, 0, ""), nbytes,
                   x.shape[0], cols, "bfloat16", "copy")]
    skips = []
    torch, why = torch_cuda() if on_gpu else (None, "no GPU")
    if torch is None:
        skips.append(Skip("copy-torch", why))
        return cases, skips
    src = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    check_t = lambda out: float((out != src).sum().item())  # noqa: E731
    cases.append(QCase(Case("copy-torch", lambda: dst.copy_(src), check_t, 0, "", torch_sync(torch)),
                       nbytes, x.shape[0], cols, "bfloat16", "copy"))
    return cases, skips


@functools.partial(jax.jit, static_argnums=1)
def _scaled_rows(x: jax.Array, dtype: str) -> jax.Array:
    # Rows of different magnitudes (2^-4 .. 2^4), so that the scales vary: never time on constant
    # data.
    rows = jnp.arange(x.shape[0]) % 9 - 4
    return (x * jnp.exp2(rows.astype(jnp.float32))[:, None]).astype(_DTYPES[dtype])


def _input(shape: QShape, seed: int) -> jax.Array:
    return _scaled_rows(random_normal(seed, (shape.m, shape.k)), shape.dtype)


def _quantize_cases(shape: QShape, impl: str, seed: int, configs: list[str] = ()
                    ) -> tuple[list[QCase], list[Skip]]:
    m, k, dtype = shape
    x = _input(shape, seed)
    cases, skips = [], []
    for kernel in MEASURED:
        arg = _retile_input(x) if kernel == "retile" else x
        ref = functools.cache(lambda kernel=kernel, arg=arg: REFERENCE[kernel](arg))
        in_bytes = _nbytes(_fp8_outputs(arg)) if kernel == "retile" else _nbytes([arg])
        fns = [(f"jfp8-{impl}-{kernel}", jax.jit(functools.partial(MEASURED[kernel], impl=impl)))]
        for text in configs:
            name = f"jfp8-mosaic-{kernel}[{config_label(text)}]"
            if impl != "mosaic":
                skips.append(Skip(name, "needs a Hopper GPU"))
                continue
            from pallas_kernels.quantize import QuantizeConfig

            fns.append((name, jax.jit(_configured(kernel, parse_config(text, QuantizeConfig)))))
        for name, fn in fns:
            out_bytes = _nbytes(_fp8_outputs(jax.eval_shape(fn, arg)))
            case = Case(name, lambda fn=fn, arg=arg: fn(arg),
                        lambda out, ref=ref: _mismatches(out, ref()), 0, "")
            cases.append(QCase(case, in_bytes + out_bytes, m, k, dtype, kernel))
    return cases, skips


# The kinds of quantization a training step runs (`jfp8.ops`): x's 1x128 tiles alone (the primal
# outside autodiff), W in both orientations, the Wgrad form of dy alone, dy's two forms, x's two
# forms, and a re-tiling. The two-pass variants ("block+mT", "grad-2") and plain "block" are the
# same XLA programs as their fused kinds' references, so they get no rows of their own.
XLA_ROW_KERNELS = ("tile", "block-t", "column-t", "grad", "activation", "retile")


def _on_cpu(tree):
    cpu = jax.devices("cpu")[0]
    return jax.tree.map(lambda a: jax.device_put(a, cpu), tree)


def _xla_cases(shape: QShape, seed: int) -> list[QCase]:
    """XLA's run of each XLA_ROW_KERNELS quantization on this device (`impl="xla"`), checked against
    the reference computed on the host's CPU (the numerics' definition): bit for bit, or the row
    fails and says how many elements differ."""
    m, k, dtype = shape
    x = _input(shape, seed)
    cases = []
    for kernel in XLA_ROW_KERNELS:
        arg = _retile_input(x) if kernel == "retile" else x
        fn = jax.jit(functools.partial(MEASURED[kernel], impl="xla"))

        def ref(kernel=kernel, arg=arg):
            with jax.default_device(jax.devices("cpu")[0]):
                return REFERENCE[kernel](_on_cpu(arg))

        ref = functools.cache(ref)
        in_bytes = _nbytes(_fp8_outputs(arg)) if kernel == "retile" else _nbytes([arg])
        out_bytes = _nbytes(_fp8_outputs(jax.eval_shape(fn, arg)))
        case = Case(f"jfp8-xla-{kernel}", lambda fn=fn, arg=arg: fn(arg),
                    lambda out, ref=ref: _mismatches(out, ref()), 0, "")
        cases.append(QCase(case, in_bytes + out_bytes, m, k, dtype, kernel))
    return cases


def xla_row_shapes(shapes, impl: str, n: int | None) -> list:
    """The shapes that get jfp8-xla-* rows beside the kernels' (the first `n`, all with None): none
    where the measured rows are XLA's already (no Hopper)."""
    if impl != "mosaic":
        return []
    return list(shapes if n is None else shapes[:n])


def _device_time(case: Case, calls: int) -> dict:
    """`step_profile.kernel_time` of one case (errors recorded, never raised: the row stands)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return kernel_time(case.fn, case.sync, calls, tmp)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_qshape, nargs="+", default=None, metavar="MxK[:dtype]")
    p.add_argument("--device-time", type=int, default=None, metavar="CALLS",
                   help="per jax row, CALLS more calls under jax's profiler: the kernels' device time per "
                        "call beside the wall clock's (GPU 10, CPU 0: off)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a QuantizeConfig for the kernels, benched as its own rows (repeatable), "
                        "e.g. swizzle=false for the unswizzled form")
    p.add_argument("--xla-rows", type=int, default=None, metavar="N",
                   help="on a Hopper, XLA's own quantizers (jfp8-xla-* rows) at the first N shapes, after "
                        "every kernel row (default: all shapes; 0: none). Elsewhere every row is XLA's already")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.xla_rows is not None and args.xla_rows < 0:
        p.error(f"--xla-rows must be 0 or more, got {args.xla_rows}")
    if args.config:
        from pallas_kernels.quantize import QuantizeConfig

        check_configs(p, args.config, QuantizeConfig)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    impl = "mosaic" if is_hopper(device) else "xla"
    shapes = args.shapes or (GPU_SHAPES if on_gpu else CPU_SHAPES)
    timing = timing_from_args(args, on_gpu)
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; impl={impl}")

    start = time.perf_counter()
    rows, failed, skipped = [], [], []
    copy_gbps: list[float] = []

    device_calls = args.device_time if args.device_time is not None else (10 if on_gpu else 0)

    def row_fn(qcase: QCase, case: Case, meas: Measurement) -> dict:
        gbps = qcase.bytes / meas.seconds / 1e9
        row = dict(impl=case.name, kernel=qcase.kernel, m=qcase.m, k=qcase.k, dtype=qcase.dtype,
                   bytes=qcase.bytes, ms=meas.seconds * 1e3, ms_min=meas.seconds_min * 1e3,
                   ms_max=meas.seconds_max * 1e3, gbps=gbps, repeats=meas.repeats, inner=meas.inner,
                   mismatches=meas.check,
                   frac_of_copy=gbps / max(copy_gbps) if copy_gbps else None)
        if device_calls and not case.name.startswith("copy-torch"):  # the profiler sees jax's kernels only
            row["device"] = _device_time(case, device_calls)
            if "kernel_ms" in row["device"]:
                row["device"]["gbps"] = qcase.bytes / (row["device"]["kernel_ms"] / 1e3) / 1e9
        return row

    def run(qcases: list[QCase], label: str) -> None:
        for qc in qcases:
            run_cases([qc.case], label, timing, functools.partial(row_fn, qc), rows, failed, args.only)

    def save():
        return write_record(
            "bench_quantize", rows, args.out, timing=dict(dataclasses.asdict(timing), method=TIMING_METHOD),
            copy_gbps=max(copy_gbps) if copy_gbps else None, target_frac_of_copy=TARGET_QUANTIZE_FRAC_OF_COPY,
            bytes_counted="input read once + E4M3 data and FP32 scales written once",
            configs=args.config, failed=failed, skipped=skipped,
        )

    try:
        qcases, skips = _copy_cases(on_gpu, args.seed)
        skipped += [dict(impl=s.impl, problem="copy", reason=s.reason) for s in skips]
        run(qcases, "copy")
    except Exception as e:  # noqa: BLE001 - without a copy row the fractions stay empty
        failed.append(dict(impl="copy", problem="copy", error=f"{type(e).__name__}: {str(e)[:800]}"))
    copy_gbps += [r["gbps"] for r in rows if r["kernel"] == "copy"]
    for r in rows:
        r["frac_of_copy"] = r["gbps"] / max(copy_gbps) if copy_gbps else None
    save()
    device_copy = [r["device"]["gbps"] for r in rows if r["kernel"] == "copy" and "gbps" in r.get("device", {})]

    label_of = lambda s: f"{s.m}x{s.k}:{s.dtype}"  # noqa: E731
    for shape, label in within_budget(shapes, label_of, args.budget_s, start, skipped):
        try:
            qcases, skips = _quantize_cases(shape, impl, args.seed, args.config)
        except Exception as e:  # noqa: BLE001
            failed.append(error_entry("(operands)", label, e))
            continue
        skipped += [dict(impl=s.impl, problem=label, reason=s.reason) for s in skips]
        run(qcases, label)
        save()
    # XLA's quantizers beside the kernels: last, so that they never crowd the kernel rows out of
    # the budget.
    xla_shapes = xla_row_shapes(shapes, impl, args.xla_rows)
    xla_label = lambda s: f"{label_of(s)} (jfp8-xla rows)"  # noqa: E731
    for shape, label in within_budget(xla_shapes, xla_label, args.budget_s, start, skipped):
        try:
            qcases = _xla_cases(shape, args.seed)
        except Exception as e:  # noqa: BLE001
            failed.append(error_entry("jfp8-xla (operands)", label, e))
            continue
        run(qcases, label)
        save()
    for r in rows:  # device time against the copy's device time, measured the same way
        if device_copy and "gbps" in r.get("device", {}):
            r["device"]["frac_of_copy"] = r["device"]["gbps"] / max(device_copy)
    path = save()

    print(f"\n{'impl':36s} {'MxK:dtype':>20s} {'GB/s':>9} {'of copy':>8} {'device GB/s':>11} {'of copy':>8} {'kernels':>7}")
    for r in rows:
        frac = "" if r["frac_of_copy"] is None else f"{r['frac_of_copy']:8.1%}"
        d = r.get("device", {})
        dev = (f"{d['gbps']:11.4g} {'' if 'frac_of_copy' not in d else format(d['frac_of_copy'], '8.1%'):>8} "
               f"{d['kernels_per_call']:7.3g}" if "gbps" in d else f"{d.get('error', ''):>28.28s}")
        print(f"{r['impl']:36s} {'%dx%d:%s' % (r['m'], r['k'], r['dtype']):>20s} {r['gbps']:9.4g} {frac:>8} {dev}")
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())
