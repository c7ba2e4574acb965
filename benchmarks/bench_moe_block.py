"""A routed-expert block, forward + backward, in FP8 against BF16, one run, one device: router,
dispatch, grouped gate/up, SwiGLU, grouped down, combine, as the model's MoE layer runs them.

    python benchmarks/bench_moe_block.py             # GPU: the full-width block; CPU: a tiny one
    python benchmarks/bench_moe_block.py --shapes 4096x7168x2048x8

A shape TxDxHxE is T tokens [T, D] bf16 entering one MoE layer of E local experts of hidden width
H (`jfp8.nn.MoE`, no shared expert), each token routed to every local expert (top_k = E): every
expert gets exactly T tokens, so the groups are equal and a batched einsum is an exact BF16
baseline. The GPU default, 4096x7168x2048x8, is DeepSeek-V3's d_model 7168 and expert width 2048
with 8 local experts of 4096 tokens each (32768 dispatched rows), on one device: no all-to-all.
One timed call is one jitted `jax.vjp` of the block with a fixed random cotangent, returning y,
dx and the gradients of the router gate, w13 (gate | up) and w2 (down). Rows:
  bf16-einsum         the library's routing (`router_scores`, `route`, `dispatch`, `combine`) and
                      `swiglu` around two batched bf16 einsums over [experts, tokens, d] (f32
                      accumulation): the baseline, as bench_grouped's "bf16 einsum"
  bf16-<impl>         the library's own BF16 layer (`Fp8Recipe.off()`): on Hopper its experts run
                      jax's Mosaic GPU ragged dots (`pallas_kernels.ragged`), elsewhere the
                      reference's scan over (row tile, expert) work items
  fp8-dispatch-<impl> the issue's block: `ExpertParallelMoE` (FP8 dispatch: each token quantized
                      once to E4M3 in 1x128 tiles and its FP8 rows gathered into the expert order,
                      straight into the grouped GEMM) on a one-device mesh, where the all-to-alls
                      are identities XLA removes
  fp8-<impl>          the single-device model's layer, `MoE.__call__`: the BF16 tokens gathered,
                      then quantized per dispatched row by `grouped_fp8_linear`
  (impl: "mosaic", the kernels, on Hopper; the XLA reference path elsewhere)
Checks before timing, on y, dx and the three weight gradients (the largest relative Frobenius
error of the five): bf16-einsum and bf16-<impl> against the same block in f32 (`precision="highest"`), <= 2e-2;
each FP8 row against the FP8 layer on the XLA reference path (same numerics: <= 1e-2) and against
the f32 block (<= 0.15, recorded per tensor as `err_vs_f32`). FLOPs are the experts' GEMMs,
3 x 3 x 2 x (T E) x D x H (gate/up 2H wide and down H: Fprop, Dgrad, Wgrad); the router's
2 x T x D x E per GEMM is left out (< 0.1 %). Median of repeats after warm-up, device synchronised.
Record: `<out>/bench_moe_block-<device>-<date>.json`, with `ratio_vs_bf16` (bf16 time / own) per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

import jfp8
from jfp8.api import is_hopper
from jfp8.mesh import EXPERT_AXIS, make_mesh
from jfp8.nn import ModelConfig, MoE, combine, dispatch, route, router_scores
from jfp8.nn.expert_parallel import DropCounter, ExpertParallelMoE
from jfp8.nn.layers import swiglu
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
    random_normal,
    report_end,
    run_cases,
    timing_from_args,
    within_budget,
    write_record,
)

BASELINE = "bf16-einsum"
TOL_BF16 = 2e-2
TOL_SAME_NUMERICS = 1e-2
# Two chained FP8 GEMMs (x, the SwiGLU output and dy each rounded to E4M3): 6.8e-2 measured on CPU at
# 128x256x128x4, the largest of the five tensors; the same-numerics bound above is the tight one.
TOL_FP8_VS_F32 = 0.15
PARTS = ("y", "dx", "d_gate", "d_w13", "d_w2")

class BlockShape(NamedTuple):
    tokens: int  # T tokens entering the block, each routed to every local expert
    d_model: int
    hidden: int  # one expert's hidden width (w13 is [E, D, 2H], w2 [E, H, D])
    experts: int  # local experts E: E groups of T dispatched rows each


GPU_SHAPES = (BlockShape(4096, 7168, 2048, 8),)
CPU_SHAPES = (BlockShape(128, 256, 128, 4),)


def parse_block_shape(s: str) -> BlockShape:
    """'TxDxHxE' -> BlockShape, for argparse."""
    try:
        return BlockShape(*(int(v) for v in s.lower().split("x")))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"shape must look like TxDxHxE (tokens x d_model x expert hidden x experts, e.g. 4096x7168x2048x8), got {s!r}")


def label(shape: BlockShape) -> str:
    return "x".join(map(str, shape))


def model_config(shape: BlockShape, recipe: jfp8.Fp8Recipe) -> ModelConfig:
    """The MoE layer's config: E routed experts, top-E (every token to every expert), no shared one."""
    return ModelConfig(d_model=shape.d_model, moe_hidden=shape.hidden, n_routed=shape.experts,
                       top_k=shape.experts, n_shared=0, recipe=recipe)


def block_flops(shape: BlockShape) -> float:
    """The experts' GEMMs, forward + backward: 3 GEMMs (Fprop, Dgrad, Wgrad) of each of gate/up
    (2H wide) and down, over T·E dispatched rows."""
    t, d, h, e = shape
    return 3 * (2.0 * t * e * d * 2 * h + 2.0 * t * e * h * d)


# ------------------------------------------------------------------------------ the blocks
# Each is x [T, D] -> y [T, D], with params the layer's nnx.State (gate [D, E], w13 [E, D, 2H],
# w2 [E, H, D]), the router bias and the graph fixed.


def _layer(shape: BlockShape, recipe: jfp8.Fp8Recipe, seed: int):
    """(graphdef, params, rest) of the MoE layer at `shape` with `recipe`."""
    return nnx.split(MoE(model_config(shape, recipe), rngs=nnx.Rngs(seed)), nnx.Param, ...)


def _graphdef(shape: BlockShape, recipe: jfp8.Fp8Recipe, seed: int):
    """The layer's graph with `recipe` (no weights initialised: they come from `_layer`)."""
    return nnx.split(nnx.eval_shape(lambda: MoE(model_config(shape, recipe), rngs=nnx.Rngs(seed))),
                     nnx.Param, ...)[0]


def _moe_block(graphdef, rest) -> Callable:
    """The model's single-device layer, `MoE.__call__` (its balance statistics dropped)."""
    def block(x, params):
        y, _ = nnx.merge(graphdef, params, rest)(x[None])
        return y[0]

    return block


def _dispatch_block(graphdef, rest) -> Callable:
    """The expert-parallel layer with FP8 dispatch on a one-device mesh (its all-to-alls are
    identities)."""
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])

    def local(x, params):
        layer = nnx.merge(graphdef, params, rest)
        ep = ExpertParallelMoE(layer, axis=EXPERT_AXIS, dispatch="fp8", capacity_factor=None, drops=DropCounter())
        y, _ = ep(x[None])
        return y[0]

    # The tokens split over the (one-device) expert axis, the weights replicated, as the sharded
    # training step places them.
    tokens = PartitionSpec(EXPERT_AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, PartitionSpec()), out_specs=tokens)


def _fp8_block(shape: BlockShape, impl: str, seed: int, rest, fp8_dispatch: bool) -> Callable:
    """A measured FP8 block (module level so that tests can substitute a wrong one)."""
    graphdef = _graphdef(shape, jfp8.Fp8Recipe(impl=impl), seed)
    return (_dispatch_block if fp8_dispatch else _moe_block)(graphdef, rest)


def _einsum_block(shape: BlockShape, rest, dtype, precision=None) -> Callable:
    """The layer with the library's routing around batched einsums in `dtype` (f32 accumulation):
    exact for equal groups, which top_k = E guarantees (each group is all T tokens)."""
    t, d, _, e = shape
    cfg = model_config(shape, jfp8.Fp8Recipe.off())
    bias = rest["router_bias"][...]

    def gemm(x, w):  # [E, R, K] x [E, K, N] -> [E, R, N] in dtype
        return jnp.einsum("erk,ekn->ern", x, w.astype(dtype), precision=precision,
                          preferred_element_type=jnp.float32).astype(dtype)

    def block(x, params):
        x = x.astype(dtype)
        scores = router_scores(x, params["gate"][...])  # [T, E]
        experts, weights = route(scores, bias, cfg)  # [T, E] x2
        x_sorted, _, order = dispatch(x, experts, e)  # [T*E, D], expert-major
        gate_up = gemm(x_sorted.reshape(e, t, d), params["w13"][...])  # [E, T, 2H]
        y = gemm(swiglu(gate_up), params["w2"][...])  # [E, T, D]
        return combine(y.reshape(e * t, d), order, weights)

    return block


def _fwd_bwd(block):
    """jit of (y, dx, dparams) = the block and its VJP at the cotangent g."""
    def step(x, params, g):
        y, vjp = jax.vjp(block, x, params)
        return (y, *vjp(g.astype(y.dtype)))

    return jax.jit(step)


def _parts(out) -> dict[str, jax.Array]:
    y, dx, dparams = out
    return dict(y=y, dx=dx, d_gate=dparams["gate"][...], d_w13=dparams["w13"][...], d_w2=dparams["w2"][...])


def _errors(out, ref) -> dict[str, float]:
    """Relative Frobenius error of each part of `out` against `ref`."""
    a, b = _parts(out), _parts(ref)
    return {k: device_rel_error(a[k], b[k]) for k in PARTS}


# ------------------------------------------------------------------------------ the cases


def _operands(shape: BlockShape, seed: int):
    t, d, _, _ = shape
    x = random_normal(seed, (t, d)).astype(jnp.bfloat16)
    g = random_normal(seed + 2, (t, d))
    return x, g


def group_sizes(shape: BlockShape, params, rest, x) -> list[int]:
    """Rows per expert as the layer's routing makes them (each must be T for the einsum baseline)."""
    cfg = model_config(shape, jfp8.Fp8Recipe.off())
    scores = router_scores(x, params["gate"][...])
    experts, _ = route(scores, rest["router_bias"][...], cfg)
    return [int(v) for v in dispatch(x, experts, shape.experts)[1]]


def _cases(shape: BlockShape, impl: str, seed: int) -> tuple[list[Case], dict]:
    _, params, rest = _layer(shape, jfp8.Fp8Recipe(), seed)
    x, g = _operands(shape, seed)
    sizes = group_sizes(shape, params, rest, x)
    if sizes != [shape.tokens] * shape.experts:
        raise ValueError(f"groups {sizes} are not equal: the bf16 einsum baseline would be wrong")
    f32 = functools.cache(lambda: _fwd_bwd(_einsum_block(shape, rest, jnp.float32, "highest"))(x, params, g))
    same = functools.cache(lambda: _fwd_bwd(_moe_block(_graphdef(shape, jfp8.Fp8Recipe(impl="xla"), seed), rest))(
        x, params, g))
    bf16 = _fwd_bwd(_einsum_block(shape, rest, jnp.bfloat16))
    extra = {"group_sizes": sizes}

    def fp8_check(name):
        def check(out):
            # Both bounds: the same numerics as the XLA reference path (which on CPU is this path
            # itself), and E4M3's error against the f32 block.
            errs = _errors(out, f32())
            extra[name] = dict(err_vs_f32=errs)
            worst = max(errs.values())
            if not worst <= TOL_FP8_VS_F32:
                raise CheckFailed(f"error {worst:.3e} against the f32 block > {TOL_FP8_VS_F32} ({errs})")
            same_errs = _errors(out, same())
            extra[name]["err_vs_reference"] = same_errs
            worst = max(same_errs.values())
            if not worst <= TOL_SAME_NUMERICS:  # each part's error on both sides, not just the worst
                raise CheckFailed(
                    f"error {worst:.3e} > {TOL_SAME_NUMERICS} against the XLA reference path run here "
                    f"({format_errors(same_errs)}); against the f32 block: this path {format_errors(errs)}, the "
                    f"reference path {format_errors(_errors(same(), f32()))}")
            return worst

        return check

    def bf16_check(out):
        errs = _errors(out, f32())
        extra[BASELINE] = dict(err_vs_f32=errs)
        return max(errs.values())

    def library_check(name):
        def check(out):
            errs = _errors(out, f32())
            extra[name] = dict(err_vs_f32=errs)
            return max(errs.values())

        return check

    cases = [Case(BASELINE, lambda: bf16(x, params, g), bf16_check, TOL_BF16, "bf16")]
    library = _fwd_bwd(_moe_block(_graphdef(shape, jfp8.Fp8Recipe.off(impl=impl), seed), rest))
    cases.append(Case(f"bf16-{impl}", lambda: library(x, params, g), library_check(f"bf16-{impl}"), TOL_BF16, "bf16"))
    for fp8_dispatch in (True, False):
        name = f"fp8-dispatch-{impl}" if fp8_dispatch else f"fp8-{impl}"
        fn = _fwd_bwd(_fp8_block(shape, impl, seed, rest, fp8_dispatch))
        cases.append(Case(name, lambda fn=fn: fn(x, params, g), fp8_check(name), TOL_SAME_NUMERICS, "fp8"))
    return cases, extra


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'impl':20s} {'TxDxHxE':>18s} {'ms':>9} {'TFLOP/s':>8} {'x bf16':>7} {'err vs f32':>10}")
    for r in rows:
        ratio = "" if r.get("ratio_vs_bf16") is None else f"{r['ratio_vs_bf16']:7.2f}"
        err = max(r.get("err_vs_f32", {"-": r["rel_error"]}).values())
        print(f"{r['impl']:20s} {r['problem']:>18s} {r['ms']:9.3f} {r['tflops']:8.4g} {ratio:>7} {err:10.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_block_shape, nargs="+", default=None, metavar="TxDxHxE")
    add_common_args(p)
    args = p.parse_args(argv)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    impl = "mosaic" if is_hopper(device) else "xla"
    shapes = args.shapes or (GPU_SHAPES if on_gpu else CPU_SHAPES)
    timing = timing_from_args(args, on_gpu)
    print(f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; fp8 impl={impl}")

    start = time.perf_counter()
    rows, failed, skipped = [], [], []
    configs = {}

    def save():
        add_ratios(rows, BASELINE, (BASELINE,), key=lambda r: r["problem"])
        return write_record(
            "bench_moe_block", rows, args.out, command=["bench_moe_block.py", *(argv or sys.argv[1:])],
            timing=dict(dataclasses.asdict(timing), method=TIMING_METHOD),
            flops="experts' GEMMs: 3 (Fprop, Dgrad, Wgrad) x (2*(T*E)*D*2H + 2*(T*E)*H*D); router excluded",
            baseline=f"{BASELINE}: the library's routing and swiglu around batched bf16 einsums "
                     "[experts, tokens, d] with f32 accumulation (exact: equal groups)",
            shapes=[dict(zip(BlockShape._fields, s), label=label(s)) for s in shapes], configs=configs,
            failed=failed, skipped=skipped)

    for shape, problem in within_budget(shapes, label, args.budget_s, start, skipped):
        try:
            cases, extra = _cases(shape, impl, args.seed)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory preparing operands
            failed.append(error_entry("(operands)", problem, e))
            continue
        configs[problem] = dict(model=jax.tree.map(str, dataclasses.asdict(model_config(shape, jfp8.Fp8Recipe()))),
                                group_sizes=extra["group_sizes"])

        def row(case, meas, shape=shape, problem=problem, extra=extra):
            r = gemm_row(case, meas, device.device_kind, block_flops(shape), problem=problem,
                         **shape._asdict())
            r.update(extra.get(case.name, {}))
            return r

        run_cases(cases, problem, timing, row, rows, failed, args.only)
        save()
    path = save()
    print_rows(rows)
    return report_end(path, skipped, failed)


if __name__ == "__main__":
    sys.exit(main())
