"""One Mosaic GPU kernel form, run once at a small shape and checked: the GPU session's smoke stage.

    python benchmarks/gpu_smoke.py --list
    python benchmarks/gpu_smoke.py --kernel gemm_default [--seed N] [--interpret]
    python benchmarks/gpu_smoke.py --kernel "gemm[tile_n=64,max_concurrent_steps=6]"
    python benchmarks/gpu_smoke.py --kernel gemm_default_tails --kernel mutant_early_release   # one process
    python benchmarks/gpu_smoke.py --launch 8192x8192x8192 --repeats 2 [--profile-dir DIR]

`benchmarks/gpu_session.py` runs each form in a subprocess of its own with a short timeout, so a
kernel that hangs or fails to compile is named at once, and nothing after it is held up.

Output protocol. Everything this script says goes to **stderr**, which the session streams into
its log as it comes:
    SMOKE start <kernel> seed=<seed>
    SMOKE result {"kernel": ..., "ok": ..., "metric": ..., "error": ..., "bound": ..., ...}
**stdout** is left to the Mosaic GPU compiler: with `MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1
MOSAIC_GPU_DUMP_SASS=1` it prints each module's PTX, ptxas report and SASS there (jaxlib's
mosaic/gpu dump code; `MOSAIC_GPU_DUMP_TO` would send them to files and ignore the three), and the
session keeps that text per kernel and parses it (`gpu_reports.py`).

Checks. Inputs are fresh random draws (the seed is printed); operands are quantized and the
reference computed **on the CPU** (on a GPU XLA may give an FP8 dot to the tensor cores, which
is what the check is about). GEMMs must be within `jfp8.accumulation`'s hardware bound of the
reference (relative Frobenius error; bit-exactness is a claim about the interpreter only, where
wgmma is an exact matmul); quantizers must match `jfp8.quantize` bit for bit (no accumulation).
`--interpret` runs the same forms in the Mosaic GPU interpreter on the CPU (the CI rehearsal).

`--launch` runs the default dense kernel at one large shape a few times, unchecked (the benchmark
stage checks that shape): the target of the session's ncu and Mosaic-profiler stages.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

# In the interpreter a 2-CTA cluster's warpgroups all run at once, which XLA:CPU does only with
# enough CPU devices (`_mgpu.INTERPRET_CLUSTER_CPU_DEVICES`): set before jax starts.
if "--interpret" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jfp8  # noqa: E402
from jfp8 import accumulation  # noqa: E402
from jfp8.reference import rel_error  # noqa: E402
from pallas_kernels import _mgpu, configs, gemm, grouped_gemm, grouped_wgrad, quantize as qk, tuning  # noqa: E402

import gpu_mutants  # noqa: E402
from _bench import on_cpu  # noqa: E402

TILE = jfp8.TILE
# The smoke shapes: two tiles on every axis and a K tail (300 = 2 chunks + 44), small enough
# for the interpreter; empty and chunk-straddling groups for the grouped kernels.
M, N, K = 256, 256, 300
SMALL_M = 48
GROUP_SIZES = (100, 0, 156)
QUANT_SHAPE = (256, 384)  # TMA tiles it whole: the swizzled kernels
QUANT_TAILS = (250, 500)  # it does not: the unswizzled ones
DENSE_TAILS = (200, 136)  # M, N: a partial tile on both axes (K = 300 has its tail already)


def say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _to_device(tree):
    return jax.device_put(tree, jax.devices()[0])


def _gaussian(rng, shape, row_spread=True):
    x = rng.standard_normal(shape)
    if row_spread:  # per-row magnitudes, so the scales differ
        x = x * np.exp(rng.normal(size=shape[:-1] + (1,)))
    return jnp.asarray(x, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Check:
    metric: str  # "rel_fro" (GEMMs, against the hardware bound) or "bits_differ" (quantizers)
    error: float
    bound: float  # the largest passing error
    detail: object = None  # where a quantizer differs (`_where_bits_differ`), when it does
    shape: str = ""  # the problem, as the record names it (a fault's row says where it happened)

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.bound)  # NaN fails


# ------------------------------------------------------------------------------ GEMM forms


# A bf16 output (the 256-row tiles' only one: beside an f32 output tile their stages do not fit)
# is held to the f32 reference with one more rounding: to nearest, at most 2^-9 of each element.
BF16_ROUNDING = 2.0**-9


def _dense(rng, interpret: bool, config: gemm.GemmConfig | None, *, m=M, n=N, k=K, b_block=(TILE, TILE),
           out_dtype=jnp.float32) -> Check:
    x, w = _gaussian(rng, (m, k)), _gaussian(rng, (n, k))
    a = on_cpu(jfp8.quantize, x, (1, TILE))
    b = on_cpu(jfp8.quantize, w, b_block)
    b_rows = b_block[0]
    if config is None:  # the library's own choice (`tuning.dense_config`), through the front door
        out = jfp8.scaled_matmul(_to_device(a), _to_device(b), out_dtype=jnp.float32, impl="mosaic",
                                 interpret=interpret)
    else:
        da, db = _to_device(a), _to_device(b)
        out = gemm.scaled_matmul(da.data, da.scale, db.data, db.scale, n=n, b_block_rows=b_rows,
                                 out_dtype=out_dtype, config=config)
    ref = on_cpu(jfp8.scaled_matmul_reference, a, b, jnp.float32)
    rounding = BF16_ROUNDING if jnp.dtype(out_dtype) == jnp.bfloat16 else 0.0
    return Check("rel_fro", rel_error(jnp.asarray(out, jnp.float32), ref),
                 accumulation.hardware_error_bound(a, b) + rounding,
                 shape=f"{m}x{n}x{k}, b block {b_block}, {jnp.dtype(out_dtype).name} out")


# The Wgrad of `fp8_linear` at issue 43's layer shapes (M = 8192 tokens contracted): x^T and dy^T
# tile-scaled along the tokens, an f32 dW, the tuning rule's config there. Never run on hardware
# before 2026-11-28's layer rows (their dw unchecked: every FP8 row was 1.29e-2 off XLA:GPU's
# reference), and in a cluster along M b's per-column scales are multicast, which the default
# tile x tile form does not do.
WGRAD_LAYER = (7168, 4096, 8192)  # (K, N, tokens) of the 7168 -> 4096 layer
LONG_K = 1100  # 9 K chunks: a 4-stage ring wraps twice, the last chunk 76 wide


# A narrow layer's Wgrad (the `gpu` preset's 768 -> 384 projection over 32 x 1024 tokens): 128-row
# tiles would leave most SMs idle, and the rule picks one warpgroup on 64 x 64 tiles, 8 stages.
FEW_TILE_WGRAD = (768, 384, 32768)


def wgrad_rule_config(layer: tuple[int, int, int] = WGRAD_LAYER) -> gemm.GemmConfig:
    """The rule's config for the Wgrad of a (K, N, tokens) layer on an H100's 132 SMs."""
    k, n, tokens = layer
    return tuning.rule_config(k, n, tokens, jnp.float32, 132, scalar_b=False)


def _dense_one_cta(rng, interpret: bool, config: gemm.GemmConfig, out_dtype=jnp.float32) -> Check:
    """The dense kernel on one persistent CTA that walks every tile of the smoke problem: its
    step counter runs on across the tiles, so with K's 3 chunks over 2 stages the tiles start at
    either slot, and the consumers' K loop runs its first loop, its rounds of static slots and
    its leftover steps (`_mainloop._static_slot_chunks`), which one tile per CTA never does."""
    x, w = _gaussian(rng, (M, K)), _gaussian(rng, (N, K))
    a = on_cpu(jfp8.quantize, x, (1, TILE))
    b = on_cpu(jfp8.quantize, w, (TILE, TILE))
    da, db = _to_device(a), _to_device(b)
    scalar_b = config.scalar_b
    operands = gemm._kernel_operands(da.data, da.scale, db.data, db.scale, N, TILE, scalar_b, config.tile_n)
    tiles = (-(-M // config.tile_m), -(-N // config.tile_n))
    call = gemm._gemm_call(configs.out_shape(M, N, out_dtype, config), out_dtype, config, tiles, num_sms=1,
                           scalar_b=scalar_b)
    out = call(*operands)[:M, :N]
    ref = on_cpu(jfp8.scaled_matmul_reference, a, b, jnp.float32)
    rounding = BF16_ROUNDING if jnp.dtype(out_dtype) == jnp.bfloat16 else 0.0
    return Check("rel_fro", rel_error(jnp.asarray(out, jnp.float32), ref),
                 accumulation.hardware_error_bound(a, b) + rounding,
                 shape=f"{M}x{N}x{K} on 1 CTA ({tiles[0] * tiles[1]} tiles), {jnp.dtype(out_dtype).name} out")


def _grouped(rng, config: grouped_gemm.GroupedGemmConfig | None, out_dtype=jnp.float32) -> Check:
    rows = sum(GROUP_SIZES) + 20  # rows past the groups must come out as zeros
    x, w = _gaussian(rng, (rows, K)), _gaussian(rng, (len(GROUP_SIZES), N, K))
    a = on_cpu(jfp8.quantize, x, (1, TILE))
    b = on_cpu(jfp8.quantize, w, (TILE, TILE))
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    da, db, ds = _to_device((a, b, sizes))
    out = grouped_gemm.grouped_scaled_matmul(da.data, da.scale, db.data, db.scale, ds, n=N,
                                             out_dtype=out_dtype, config=config)
    ref = on_cpu(jfp8.grouped_scaled_matmul_reference, a, b, sizes, jnp.float32)
    rounding = BF16_ROUNDING if jnp.dtype(out_dtype) == jnp.bfloat16 else 0.0
    return Check("rel_fro", rel_error(jnp.asarray(out, jnp.float32), ref),
                 accumulation.grouped_hardware_error_bound(a, b, GROUP_SIZES) + rounding,
                 shape=f"groups {GROUP_SIZES} of {rows} rows, N {N}, K {K}, {jnp.dtype(out_dtype).name} out")


def _grouped_wgrad(rng, config: grouped_gemm.GroupedGemmConfig | None) -> Check:
    tokens = sum(GROUP_SIZES) + 20
    x, dy = _gaussian(rng, (tokens, K), False), _gaussian(rng, (tokens, N), False)
    xt = on_cpu(jfp8.quantize, x, (TILE, 1)).mT
    dyt = on_cpu(jfp8.quantize, dy, (TILE, 1)).mT
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    dx, ddy, ds = _to_device((xt, dyt, sizes))
    out = grouped_wgrad.grouped_wgrad(dx.data, dx.scale, ddy.data, ddy.scale, ds, t=tokens,
                                     out_dtype=jnp.float32, config=config)
    ref = on_cpu(jfp8.grouped_wgrad_reference, xt, dyt, sizes, jnp.float32)
    return Check("rel_fro", rel_error(out, ref),
                 accumulation.grouped_wgrad_hardware_error_bound(xt, dyt, GROUP_SIZES),
                 shape=f"groups {GROUP_SIZES} of {tokens} tokens, {K} x {N}")


def _ragged_bf16(rng, interpret: bool) -> Check:
    """The BF16 baseline's experts (`jfp8.api.ragged_dot`, jax's ragged dots): y, dx and dW, the
    largest relative error against the CPU reference. Both round FP32 sums to BF16 (dW: the
    reference once per 256-row work item), so some outputs differ by a BF16 ulp or two (2^-8 of
    the value at most, each): the relative Frobenius error is bounded by 2^-8 (1e-5 to 3e-5 seen
    in the interpreter; a wrong group's weights give about 1)."""
    from jfp8.api import ragged_dot, ragged_dot_grads
    from jfp8.reference import ragged_dot_grads_reference, ragged_dot_reference

    rows, k = sum(GROUP_SIZES) + 20, 2 * TILE  # rows past the groups must come out as zeros
    x = _gaussian(rng, (rows, k)).astype(jnp.bfloat16)
    w = _gaussian(rng, (len(GROUP_SIZES), k, N))
    dy = _gaussian(rng, (rows, N)).astype(jnp.bfloat16)
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    dev = _to_device((x, w, sizes, dy))
    out = (ragged_dot(*dev[:3], impl="mosaic", interpret=interpret),
           *ragged_dot_grads(*dev, impl="mosaic", interpret=interpret))
    ref = (on_cpu(ragged_dot_reference, x, w, sizes), *[
        on_cpu(lambda *a, i=i: ragged_dot_grads_reference(*a)[i], x, w, sizes, dy) for i in (0, 1)])
    err = max(rel_error(jnp.asarray(o, jnp.float32), jnp.asarray(r, jnp.float32)) for o, r in zip(out, ref))
    return Check("rel_fro", err, 2.0**-8, shape=f"groups {GROUP_SIZES} of {rows} rows, K {k}, N {N}, bf16")


# ------------------------------------------------------------------------------ quantizer forms


def _bits_differ(got, want) -> int:
    """Differing bytes of data and scales over matching Fp8Tensors (or tuples of them)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got) != len(want):
        return -1
    total = 0
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            return -1
        total += int(np.sum(g.view(np.uint8) != w.view(np.uint8)))
    return total


def _where_bits_differ(got, want, samples: int = 4) -> list[dict]:
    """Where a quantizer's outputs differ from the reference, leaf by leaf (data, scales, and the
    transposed pair for the fused kernels): the count of differing elements, the span of their
    indices along each axis, and a few (index, got, want) samples, so that a mismatch seen on
    hardware says which output and which tiles without another device call."""
    found = []
    for leaf, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            found.append({"leaf": leaf, "mismatch": f"{g.shape} {g.dtype} vs {w.shape} {w.dtype}"})
            continue
        bits = np.uint8 if g.dtype.itemsize == 1 else np.uint32
        bad = np.argwhere(g.view(bits) != w.view(bits))
        if not len(bad):
            continue
        found.append({
            "leaf": leaf, "shape": list(g.shape), "dtype": str(g.dtype), "elements_differ": len(bad),
            "span": [[int(bad[:, a].min()), int(bad[:, a].max())] for a in range(bad.shape[1])],
            "samples": [[[int(i) for i in idx], float(g[tuple(idx)]), float(w[tuple(idx)])]
                        for idx in bad[:samples]],
        })
    return found


def _quantizer(kernel_fn, reference_fn, shape=QUANT_SHAPE, dtype=jnp.bfloat16, prepare=None, row_spread=True):
    """`prepare(x)`, on the CPU, makes the kernel's input when it is not x itself."""
    def run(rng, interpret: bool) -> Check:
        x = _gaussian(rng, shape, row_spread).astype(dtype)
        if prepare is not None:
            x = on_cpu(prepare, x)
        got = kernel_fn(_to_device(x), interpret)
        want = on_cpu(reference_fn, x)
        differ = _bits_differ(got, want)
        detail = _where_bits_differ(got, want) if differ else None
        return Check("bits_differ", float(differ if differ >= 0 else np.inf), 0.0, detail,
                     shape=f"{shape[0]}x{shape[1]} {jnp.dtype(dtype).name}")

    return run


def _ring_tile(x, interpret):
    """quantize_tile streaming 8 chunks per CTA through a 2-slot ring (`QuantizeConfig.stages`)."""
    cfg = qk.QuantizeConfig(chunks=8, stages=2)
    data, scale = qk.quantize_tile(x, config=cfg)
    return jfp8.Fp8Tensor(data, scale, (1, TILE), x.shape)


def _mosaic(fn, **kw):
    return lambda x, interpret: fn(x, impl="mosaic", interpret=interpret, **kw)


def _xla(fn, **kw):
    """The reference: XLA, also inside the interpreter's context (where impl="auto" would run
    the kernel itself, and a rehearsal would compare the kernel with itself)."""
    return lambda x: fn(x, impl="xla", **kw)




# ------------------------------------------------------------------------------ the registry

# name -> (what it is, run(rng, interpret) -> Check). Ordered by how much a failure would block:
# the session runs them in this order and a budget cut drops the tail.
KERNELS = {
    "gemm_simple": ("dense tile x block, GemmConfig.simple() (one warpgroup, 64x128 tiles)",
                    lambda rng, i: _dense(rng, i, gemm.GemmConfig.simple())),
    "quantize_tile": ("1x128 activation tiles, swizzled SMEM", _quantizer(_mosaic(jfp8.quantize, block=(1, TILE)),
                                                                    _xla(jfp8.quantize, block=(1, TILE)))),
    "gemm_default": ("dense tile x block, GemmConfig() (warp-specialized, persistent, 128x128)",
                     lambda rng, i: _dense(rng, i, gemm.GemmConfig())),
    # What the tuning rule picks at the benchmark shapes (`tuning.DENSE_LAYOUTS`, GROUPED_LAYOUTS;
    # hopper_build.RULE_FORMS): the library's defaults there, so early in the record.
    "gemm_rule_128x192_cluster_m": ("dense tile x block, GemmConfig(tile_n=192, cluster_m=2): the rule's pick at 8192^3",
                                    lambda rng, i: _dense(rng, i, gemm.GemmConfig(tile_n=192, cluster_m=2))),
    "gemm_rule_128x192_cluster_n": ("dense tile x block, GemmConfig(tile_n=192, cluster_n=2): a rule layout",
                                    lambda rng, i: _dense(rng, i, gemm.GemmConfig(tile_n=192, cluster_n=2))),
    "gemm_rule_256x128_cluster_n": (
        "dense tile x block, GemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3), bf16 out: the rule's pick "
        "at 5 of the 6 dense benchmark shapes (issue 45: 64-row waves through one accumulator)",
        lambda rng, i: _dense(rng, i, gemm.GemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3),
                              out_dtype=jnp.bfloat16)),
    "gemm_rule_wgrad": ("dense tile x tile (Wgrad operands), the rule's config at the layer shapes' Wgrad "
                        "(GemmConfig(cluster_m=2): b and its per-column scales multicast), f32 out",
                        lambda rng, i: _dense(rng, i, wgrad_rule_config(), b_block=(1, TILE))),
    "gemm_rule_wgrad_long_k": (f"the same at K = {LONG_K}: 9 chunks through the 4-stage ring, the multicast "
                               "stages refilled", lambda rng, i: _dense(rng, i, wgrad_rule_config(), k=LONG_K,
                                                                         b_block=(1, TILE))),
    "gemm_rule_wgrad_few_tiles": ("dense tile x tile (Wgrad operands), the rule's config for a narrow layer's "
                                  "Wgrad (GemmConfig.simple() on 64 x 64 tiles, 8 stages: few output tiles), f32 out",
                                  lambda rng, i: _dense(rng, i, wgrad_rule_config(FEW_TILE_WGRAD), k=LONG_K,
                                                        b_block=(1, TILE))),
    "grouped_fprop_rule_256x128_cluster_n": (
        "grouped Fprop/Dgrad, GroupedGemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3), bf16 out: the "
        "rule's pick at the MoE shapes (issue 45)",
        lambda rng, i: _grouped(rng, grouped_gemm.GroupedGemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3),
                                out_dtype=jnp.bfloat16)),
    # The consumers' K loop from every slot a tile can start at (issue 45's rounds of static
    # slots: a 128 x 128 tile's SMEM offsets constant, a 256-row tile's computed).
    "gemm_k_rounds_one_cta": ("dense tile x block, GemmConfig(max_concurrent_steps=2) on one CTA: 4 tiles of 3 K "
                              "chunks over 2 stages",
                              lambda rng, i: _dense_one_cta(rng, i, gemm.GemmConfig(max_concurrent_steps=2))),
    "gemm_k_rounds_256x128_one_cta": (
        "dense tile x block, GemmConfig(tile_m=256, max_concurrent_steps=2) on one CTA, bf16 out: 2 tiles of 3 K "
        "chunks over 2 stages, two waves a chunk",
        lambda rng, i: _dense_one_cta(rng, i, gemm.GemmConfig(tile_m=256, max_concurrent_steps=2),
                                      out_dtype=jnp.bfloat16)),
    "grouped_fprop_cluster_n": ("grouped Fprop/Dgrad, GroupedGemmConfig(cluster_n=2): a rule layout (the pick "
                                "for many small groups)",
                                lambda rng, i: _grouped(rng, grouped_gemm.GroupedGemmConfig(cluster_n=2))),
    "gemm_tile_x_tile": ("dense tile x tile (Wgrad operands), GemmConfig()",
                         lambda rng, i: _dense(rng, i, gemm.GemmConfig(), b_block=(1, TILE))),
    "grouped_fprop": ("grouped Fprop/Dgrad, GroupedGemmConfig()",
                      lambda rng, i: _grouped(rng, grouped_gemm.GroupedGemmConfig())),
    "grouped_wgrad": ("grouped Wgrad (K grouped along tokens), GroupedGemmConfig()",
                      lambda rng, i: _grouped_wgrad(rng, grouped_gemm.GroupedGemmConfig())),
    "quantize_block": ("128x128 weight blocks", _quantizer(_mosaic(jfp8.quantize, block=(TILE, TILE)),
                                                          _xla(jfp8.quantize, block=(TILE, TILE)),
                                                          dtype=jnp.float32)),
    "quantize_weight": ("fused weight quantizer: blocks and their transpose",
                        _quantizer(_mosaic(jfp8.quantize_weight), _xla(jfp8.quantize_weight), dtype=jnp.float32)),
    "quantize_grad": ("fused gradient quantizer: dy tiles and dy^T per 128 tokens",
                      _quantizer(_mosaic(jfp8.quantize_grad), _xla(jfp8.quantize_grad))),
    "quantize_activation": ("fused activation quantizer: x tiles and their re-tiling for Wgrad (issue 43)",
                            _quantizer(_mosaic(jfp8.quantize_activation), _xla(jfp8.quantize_activation))),
    "quantize_column_t": ("x^T per 128 tokens (Wgrad operand)",
                          _quantizer(_mosaic(jfp8.quantize_wgrad_operand), _xla(jfp8.quantize_wgrad_operand))),
    "retile": ("saved FP8 x re-tiled for Wgrad", _quantizer(
        _mosaic(jfp8.retile_wgrad_operand), _xla(jfp8.retile_wgrad_operand),
        prepare=_xla(jfp8.quantize, block=(1, TILE)))),
    "gemm_small_m": ("dense at M=48: the tuning rule's pick (one warpgroup, narrowed tiles)",
                     lambda rng, i: _dense(rng, i, None, m=SMALL_M)),
    "quantize_tile_unswizzled": ("1x128 tiles, a shape TMA cannot tile (unswizzled kernel)",
                                 _quantizer(_mosaic(jfp8.quantize, block=(1, TILE)),
                                            _xla(jfp8.quantize, block=(1, TILE)), shape=QUANT_TAILS)),
    "quantize_tile_ring": ("1x128 tiles through a 2-slot SMEM ring", _quantizer(
        _ring_tile, _xla(jfp8.quantize, block=(1, TILE)), shape=(128, 1024))),
    "grouped_fprop_simple": ("grouped Fprop/Dgrad, GroupedGemmConfig.simple()",
                             lambda rng, i: _grouped(rng, grouped_gemm.GroupedGemmConfig.simple())),
    "grouped_wgrad_simple": ("grouped Wgrad, GroupedGemmConfig.simple()",
                             lambda rng, i: _grouped_wgrad(rng, grouped_gemm.GroupedGemmConfig.simple())),
    "gemm_cluster": ("dense tile x block, GemmConfig(cluster_m=2): 2-CTA clusters, b multicast (issue 19)",
                     lambda rng, i: _dense(rng, i, gemm.GemmConfig(cluster_m=2))),
    "gemm_vector_b": ("dense tile x block, GemmConfig(scalar_b_scale=False): b's block scale as a per-column "
                      "vector (the default before the deviceless build's census)",
                      lambda rng, i: _dense(rng, i, gemm.GemmConfig(scalar_b_scale=False))),
    "gemm_early_scales": ("dense tile x block, GemmConfig(early_scale_loads=True): scales read before the wgmma (issue 19)",
                          lambda rng, i: _dense(rng, i, gemm.GemmConfig(early_scale_loads=True))),
    "gemm_cluster_n": ("dense tile x block, GemmConfig(cluster_n=2): 2-CTA clusters along N, a multicast (issue 19)",
                       lambda rng, i: _dense(rng, i, gemm.GemmConfig(cluster_n=2))),
    "gemm_run_ahead": ("dense tile x block, GemmConfig(run_ahead=True): one pipeline over each CTA's tiles (issue 19)",
                       lambda rng, i: _dense(rng, i, gemm.GemmConfig(run_ahead=True))),
    "gemm_wide_tiles": ("dense tile x block, GemmConfig(tile_n=192, scalar_b_scale=True, max_concurrent_steps=2): "
                        "128 x 192 tiles, a scalar per 64-column slice (issue 19)",
                        lambda rng, i: _dense(rng, i, gemm.GemmConfig(tile_n=192, scalar_b_scale=True,
                                                                      max_concurrent_steps=2))),
    "grouped_fprop_switches": (
        "grouped Fprop/Dgrad, GroupedGemmConfig(cluster_n=2, scalar_b_scale=True, early_scale_loads=True) (issue 19)",
        lambda rng, i: _grouped(rng, grouped_gemm.GroupedGemmConfig(
            cluster_n=2, scalar_b_scale=True, early_scale_loads=True))),
    "grouped_wgrad_cluster_n": (
        "grouped Wgrad, GroupedGemmConfig(cluster_n=2, early_scale_loads=True): a multicast (issue 19)",
        lambda rng, i: _grouped_wgrad(rng, grouped_gemm.GroupedGemmConfig(cluster_n=2, early_scale_loads=True))),
    # quantize_grad differed on an H100 at the smoke shape (256 x 384, rows spread: 3 column
    # chunks, a CTA owns 4) and not at the benchmarks' shapes (docs/gpu.md, "First contact"):
    # the same kernel with whole CTAs, and with rows of one magnitude, tell the two suspects apart.
    "quantize_grad_whole_ctas": ("quantize_grad at 256x512: every CTA's 4 column chunks in the array",
                                 _quantizer(_mosaic(jfp8.quantize_grad), _xla(jfp8.quantize_grad),
                                            shape=(256, 512))),
    "quantize_grad_flat_rows": ("quantize_grad at the smoke shape, rows of one magnitude",
                                _quantizer(_mosaic(jfp8.quantize_grad), _xla(jfp8.quantize_grad),
                                           row_spread=False)),
    "ragged_bf16": ("the BF16 baseline's experts: jax's ragged dots (Fprop, Dgrad, Wgrad; issue 43)", _ragged_bf16),
    # Issue 45's lean main loop: the stage released right after the wgmma's wait, no fence on the
    # consumers (the producer fences); not a default until racecheck is clean on a GPU.
    "gemm_lean_release": ("dense tile x block, GemmConfig(early_scale_loads=True, lean_release=True) (issue 45)",
                          lambda rng, i: _dense(rng, i, gemm.GemmConfig(early_scale_loads=True,
                                                                        lean_release=True))),
    "grouped_fprop_lean_release": (
        "grouped Fprop/Dgrad, GroupedGemmConfig(early_scale_loads=True, lean_release=True) (issue 45)",
        lambda rng, i: _grouped(rng, grouped_gemm.GroupedGemmConfig(early_scale_loads=True, lean_release=True))),
    "gemm_lean_release_128x192_cluster_m": (
        "dense tile x block, GemmConfig(tile_n=192, cluster_m=2, early_scale_loads=True, lean_release=True) "
        "(issue 45: the rule's pick at 8192^3, lean)",
        lambda rng, i: _dense(rng, i, gemm.GemmConfig(tile_n=192, cluster_m=2, early_scale_loads=True,
                                                      lean_release=True))),
    "gemm_lean_release_256x128_cluster_n": (
        "dense tile x block, GemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3, early_scale_loads=True, "
        "lean_release=True), bf16 out (issue 45: the rule's 256-row pick, lean; released after the second wave)",
        lambda rng, i: _dense(rng, i, gemm.GemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3,
                                                      early_scale_loads=True, lean_release=True),
                              out_dtype=jnp.bfloat16)),
    "grouped_fprop_lean_release_256x128_cluster_n": (
        "grouped Fprop/Dgrad, GroupedGemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3, "
        "early_scale_loads=True, lean_release=True), bf16 out (issue 45: the rule's grouped pick, lean)",
        lambda rng, i: _grouped(rng, grouped_gemm.GroupedGemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3,
                                                                    early_scale_loads=True, lean_release=True),
                                out_dtype=jnp.bfloat16)),
}


# What compute-sanitizer runs in the record's second call (`gpu_session.SANITIZED`): the default
# dense, grouped Fprop and grouped Wgrad kernels and every quantizer, each at a small shape with a
# partial tile (the grouped forms' groups are ragged and empty already), in one process per tool.
SANITIZER_FORMS = {
    "gemm_default_tails": (f"dense tile x block, GemmConfig(), M x N x K = {DENSE_TAILS[0]} x {DENSE_TAILS[1]} x {K}",
                           lambda rng, i: _dense(rng, i, gemm.GemmConfig(), m=DENSE_TAILS[0], n=DENSE_TAILS[1])),
    "quantize_tile_tails": ("1x128 tiles at a tail shape", _quantizer(
        _mosaic(jfp8.quantize, block=(1, TILE)), _xla(jfp8.quantize, block=(1, TILE)), shape=QUANT_TAILS)),
    "quantize_block_tails": ("128x128 blocks at a tail shape", _quantizer(
        _mosaic(jfp8.quantize, block=(TILE, TILE)), _xla(jfp8.quantize, block=(TILE, TILE)), shape=QUANT_TAILS,
        dtype=jnp.float32)),
    "quantize_weight_tails": ("fused weight quantizer at a tail shape", _quantizer(
        _mosaic(jfp8.quantize_weight), _xla(jfp8.quantize_weight), shape=QUANT_TAILS, dtype=jnp.float32)),
    "quantize_grad_tails": ("fused gradient quantizer at a tail shape", _quantizer(
        _mosaic(jfp8.quantize_grad), _xla(jfp8.quantize_grad), shape=QUANT_TAILS)),
    "quantize_column_t_tails": ("x^T per 128 tokens at a tail shape", _quantizer(
        _mosaic(jfp8.quantize_wgrad_operand), _xla(jfp8.quantize_wgrad_operand), shape=QUANT_TAILS)),
    "quantize_activation_tails": ("fused activation quantizer at a tail shape", _quantizer(
        _mosaic(jfp8.quantize_activation), _xla(jfp8.quantize_activation), shape=QUANT_TAILS)),
    "retile_tails": ("re-tiling at a tail shape", _quantizer(
        _mosaic(jfp8.retile_wgrad_operand), _xla(jfp8.retile_wgrad_operand), shape=QUANT_TAILS,
        prepare=_xla(jfp8.quantize, block=(1, TILE)))),
}


def _release(early: bool | None):
    """`gpu_mutants.release_pipeline`: the clean twin must pass its values through unchanged; the
    mutants (early release, None: unsynchronized) pass whatever they read (its verdict is the race detector's, not the output's)."""
    def run(rng, interpret: bool) -> Check:
        x = _gaussian(rng, (gpu_mutants.STEPS, gpu_mutants.ROWS, gpu_mutants.COLS), False)
        out = gpu_mutants.release_pipeline(_to_device(x), early_release=early)
        differ = _bits_differ(out, x)
        return Check("bits_differ", float(differ if differ >= 0 else np.inf), 0.0 if early is False else np.inf,
                     shape="x".join(map(str, x.shape)) + " float32")

    return run


MUTANTS = {
    "mutant_early_release": ("racy on purpose: a stage released before it is read (gpu_mutants.py)", _release(True)),
    "mutant_clean_release": ("the mutant's clean twin: released after it is read", _release(False)),
    "mutant_unsynchronized": ("racy on purpose, with no barrier at all between the stage's writes and reads",
                              _release(None)),
}


# Forms that test the session's own plumbing in the CPU rehearsal, never run on a GPU: a compiler
# dump from the committed samples (the parsers end to end), a hang (the per-kernel timeout and
# kill) and a crash before any result.
FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gpu"


def _sample_dump(rng, interpret: bool) -> Check:
    sys.stdout.write((FIXTURES / "smoke_dump_ws_gemm.txt").read_text())
    sys.stdout.flush()
    return Check("rel_fro", 0.0, accumulation.F32_ORDER_FLOOR)


def _hang(rng, interpret: bool) -> Check:
    time.sleep(3600)
    raise AssertionError("unreachable")


def _crash(rng, interpret: bool) -> Check:
    os.abort()


SELFTESTS = {"_sample_dump": ("rehearsal: a committed compiler dump on stdout", _sample_dump),
             "_hang": ("rehearsal: never returns", _hang),
             "_crash": ("rehearsal: dies without a result", _crash)}


def _config_form(name: str):
    """`gemm[field=value,...]` / `grouped[...]`: a config given on the command line (bisection)."""
    from _bench import parse_config  # the --config parser the benchmarks use

    kind, _, rest = name.partition("[")
    fields = rest.rstrip("]")
    if kind == "gemm":
        cfg = parse_config(fields, gemm.GemmConfig)
        return f"dense tile x block, {cfg}", lambda rng, i: _dense(rng, i, cfg)
    if kind == "grouped":
        cfg = parse_config(fields, grouped_gemm.GroupedGemmConfig)
        return f"grouped Fprop, {cfg}", lambda rng, i: _grouped(rng, cfg)
    raise KeyError(name)


def lookup(name: str):
    if name in KERNELS:
        return KERNELS[name]
    for registry in (SANITIZER_FORMS, MUTANTS, SELFTESTS):
        if name in registry:
            return registry[name]
    if "[" in name:
        return _config_form(name)
    raise SystemExit(f"unknown kernel {name!r}; --list shows the forms (or gemm[...] / grouped[...])")


def run(name: str, seed: int, interpret: bool) -> dict:
    what, fn = lookup(name)
    say(f"SMOKE start {name} seed={seed}")
    t0 = time.perf_counter()
    result = {"kernel": name, "what": what, "seed": seed, "interpret": interpret}
    try:
        context = _mgpu.interpret_mode(True) if interpret else contextlib.nullcontext()
        with context:
            check = fn(np.random.default_rng(seed), interpret)
        result.update(ok=check.ok, metric=check.metric, error=check.error, bound=check.bound, shape=check.shape)
        if check.detail is not None:
            result["detail"] = check.detail
    except Exception as e:  # noqa: BLE001 - reported as the kernel's result
        result.update(ok=False, failure=f"{type(e).__name__}: {str(e)[:2000]}")
    result["seconds"] = round(time.perf_counter() - t0, 3)
    say("SMOKE result " + json.dumps(result))
    return result


def launch(shape: str, repeats: int, profile_dir: str | None) -> int:
    """The default dense kernel (`GemmConfig()`, bf16 out) at `shape` (MxNxK), `repeats` times on
    the same operands, synchronised after each; with `profile_dir`, Mosaic GPU profiler traces."""
    m, n, k = (int(v) for v in shape.lower().split("x"))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (n, k), jnp.bfloat16) / np.sqrt(k)
    a, b = jfp8.quantize(x, (1, TILE)), jfp8.quantize(w, (TILE, TILE))
    context = _mgpu.profile(profile_dir) if profile_dir else contextlib.nullcontext()
    if profile_dir:
        pathlib.Path(profile_dir).mkdir(parents=True, exist_ok=True)
    with context:
        f = jax.jit(lambda a, b: gemm.scaled_matmul(a.data, a.scale, b.data, b.scale, n=n, b_block_rows=TILE,
                                                    out_dtype=jnp.bfloat16, config=gemm.GemmConfig()))
        for i in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(a, b))
            say(f"LAUNCH {shape} call {i + 1}/{repeats}: {time.perf_counter() - t0:.3f} s (wall, unchecked)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", action="append", default=[],
                   help="a name from --list, or gemm[field=value,...] / grouped[...]; repeat it to run several "
                        "forms in this one process, in order (the sanitizer's runs)")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    p.add_argument("--interpret", action="store_true", help="run in the Mosaic GPU interpreter (CPU)")
    p.add_argument("--list", action="store_true", help="print the kernel forms, in run order")
    p.add_argument("--launch", metavar="MxNxK", help="run the default dense kernel at this shape (no check)")
    p.add_argument("--repeats", type=int, default=2, help="with --launch: calls")
    p.add_argument("--profile-dir", help="with --launch: write Mosaic GPU profiler traces here")
    args = p.parse_args(argv)
    if args.launch:
        return launch(args.launch, args.repeats, args.profile_dir)
    if args.list:
        for registry in (KERNELS, SANITIZER_FORMS, MUTANTS):
            for name, (what, _) in registry.items():
                print(f"{name:26s} {what}")
        return 0
    if not args.kernel:
        p.error("--kernel is required (or --list)")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
    results = [run(name, seed, args.interpret) for name in args.kernel]
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
