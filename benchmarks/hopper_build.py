"""Every Mosaic GPU kernel form compiled for Hopper (sm_90a) through ptxas to SASS, with no GPU.

    python benchmarks/hopper_build.py                         # every form, h100_sxm and h200
    python benchmarks/hopper_build.py --target h100_sxm --only gemm_default quantize_grad
    python benchmarks/hopper_build.py --list

XLA compiles *deviceless* for a GPU described by a target config
(`benchmarks/hopper/targets/<target>.txtpb`, handed to
`jax.experimental.topologies.get_topology_desc`), and the Mosaic GPU custom call compiles its
kernel when XLA instantiates it: Mosaic passes, LLVM NVPTX, ptxas, a cubin. With
`MOSAIC_GPU_DUMP_PTXAS/SASS/RESOURCES=1` each kernel's ptxas `-v` report, SASS and SMEM count are
printed on the compiling process's stdout, read here (`MOSAIC_GPU_DUMP_TO` would also write every
MLIR pass, megabytes per kernel and most of the time).
The toolchain (jax's CUDA plugin, ptxas, nvdisasm; `benchmarks/hopper/requirements.txt`)
is installed by `scripts/hopper_toolchain.sh`, outside the project's environment.

Each form compiles in a subprocess of its own (a crash or a compiler error is that form's row,
not the end of the run), at the benchmarks' shapes (dense 4096x7168x7168, grouped 8 x 4096 rows,
N 4096, K 7168; quantizers 4096x7168): the smoke forms of `gpu_smoke.py` and every bisect variant of
`gpu_session.py`. One row per form: compiled or the compiler's error, registers, spill bytes,
barriers, SMEM, ptxas warnings, the SASS census (`gpu_reports.sass_census`), lower and compile
seconds, the ptxas version. Writes `--out`/kernels-<target>.json (default
benchmarks/results/hopper-build/) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
TARGETS_DIR = REPO / "benchmarks" / "hopper" / "targets"
TARGETS = {"h100_sxm": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200 141GB HBM3e"}
HOPPER_SMS = 132  # both targets
OUT = REPO / "benchmarks" / "results" / "hopper-build"
# The benchmarks' shapes (pallas_kernels/shapes.py): a dense problem, a grouped one, a quantizer's.
DENSE = (4096, 7168, 7168)
GROUPED = (8, 4096, 4096, 7168)  # experts, rows per expert, N, K
QUANT = (4096, 7168)
WARPGROUP_THREADS = 128
REGISTERS_PER_SM = 65536
# Hopper's shared memory per SM, and what the driver reserves per resident CTA (CUDA's occupancy
# arithmetic): two CTAs fit where each takes at most (233,472 - 2 x 1,024) / 2 = 115,712 bytes.
SMEM_PER_SM = 233472
SMEM_RESERVED_PER_CTA = 1024


@dataclasses.dataclass(frozen=True)
class Form:
    """A kernel form: `build()` gives `(fn, args)`, args a pytree of ShapeDtypeStructs."""

    name: str
    what: str
    build: Callable[[], tuple[Callable, tuple]]
    warpgroups: int  # per CTA: 3 when warp-specialized (1 producer + 2 consumers), else 1
    cluster: bool = False  # 2-CTA clusters: TMA multicast expected
    ctas_per_sm: int = 1  # CTAs the form is built to fit on one SM (its SMEM and registers)


# ------------------------------------------------------------------------------ the forms


def _sds(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype)


def _abstract_fp8(shape, block, dtype="bfloat16"):
    import jax
    import jax.numpy as jnp

    import jfp8

    return jax.eval_shape(lambda x: jfp8.quantize(x, block, impl="xla"), _sds(shape, jnp.dtype(dtype)))


def _dense(config, b_block=(128, 128), shape=DENSE, out_dtype="bfloat16"):
    def build():
        import jax.numpy as jnp

        import jfp8
        from pallas_kernels import gemm

        m, n, k = shape
        a, b = _abstract_fp8((m, k), (1, 128)), _abstract_fp8((n, k), b_block)
        out = jnp.dtype(out_dtype)
        if config is None:  # the library's own choice, through the front door
            return (lambda a, b: jfp8.scaled_matmul(a, b, out_dtype=out, impl="mosaic")), (a, b)

        def fn(a_data, a_scale, b_data, b_scale):
            return gemm.scaled_matmul(a_data, a_scale, b_data, b_scale, n=n, b_block_rows=b_block[0],
                                      out_dtype=out, config=config)

        return fn, (a.data, a.scale, b.data, b.scale)

    return build


def _grouped(config):
    def build():
        import jax.numpy as jnp

        from pallas_kernels import grouped_gemm

        g, rows, n, k = GROUPED
        a, b = _abstract_fp8((g * rows, k), (1, 128)), _abstract_fp8((n, k), (128, 128))
        b_data = _sds((g, *b.data.shape), b.data.dtype)
        b_scale = _sds((g, *b.scale.shape), b.scale.dtype)

        def fn(a_data, a_scale, b_data, b_scale, sizes):
            return grouped_gemm.grouped_scaled_matmul(a_data, a_scale, b_data, b_scale, sizes, n=n,
                                                      out_dtype=jnp.bfloat16, config=config)

        return fn, (a.data, a.scale, b_data, b_scale, _sds((g,), jnp.int32))

    return build


def _ragged_bf16():
    """The BF16 baseline's experts (`jfp8.api.ragged_dot` and its grads: jax's ragged dots) at
    the grouped benchmark shape: three kernels in one form."""
    def build():
        import jax.numpy as jnp

        from jfp8.api import ragged_dot, ragged_dot_grads

        g, rows, n, k = GROUPED

        def fn(x, w, sizes, dy):
            return ragged_dot(x, w, sizes, impl="mosaic"), ragged_dot_grads(x, w, sizes, dy, impl="mosaic")

        return fn, (_sds((g * rows, k), jnp.bfloat16), _sds((g, k, n), jnp.bfloat16), _sds((g,), jnp.int32),
                    _sds((g * rows, n), jnp.bfloat16))

    return build


def _grouped_wgrad(config):
    def build():
        import jax.numpy as jnp

        from pallas_kernels import grouped_wgrad

        g, rows, n, k = GROUPED
        t = g * rows
        xt = _abstract_fp8((k, t), (1, 128))  # x^T scaled per 128 tokens
        dyt = _abstract_fp8((n, t), (1, 128))

        def fn(x_data, x_scale, dy_data, dy_scale, sizes):
            return grouped_wgrad.grouped_wgrad(x_data, x_scale, dy_data, dy_scale, sizes, t=t,
                                               out_dtype=jnp.float32, config=config)

        return fn, (xt.data, xt.scale, dyt.data, dyt.scale, _sds((g,), jnp.int32))

    return build


def _quantizer(name, dtype="bfloat16", shape=QUANT, config=None):
    def build():
        import jax.numpy as jnp

        import jfp8
        from pallas_kernels import quantize as qk

        x = _sds(shape, jnp.dtype(dtype))
        fns = {
            "tile": lambda x: jfp8.quantize(x, (1, 128), impl="mosaic"),
            "block": lambda x: jfp8.quantize(x, (128, 128), impl="mosaic"),
            "weight": lambda x: jfp8.quantize_weight(x, impl="mosaic"),
            "grad": lambda x: jfp8.quantize_grad(x, impl="mosaic"),
            "activation": lambda x: jfp8.quantize_activation(x, impl="mosaic"),
            "column_t": lambda x: jfp8.quantize_wgrad_operand(x, impl="mosaic"),
            "tile_ring": lambda x: qk.quantize_tile(x, config=config),
            "grad_config": lambda x: qk.quantize_tile_and_column_t(x, config=config),
            "activation_config": lambda x: qk.quantize_tile_and_retile_t(x, config=config),
            "weight_config": lambda x: qk.quantize_block_and_transpose(x, config=config),
        }
        if name == "retile":
            t = _abstract_fp8(shape, (1, 128), dtype)
            return (lambda t: jfp8.retile_wgrad_operand(t, impl="mosaic")), (t,)
        return fns[name], (x,)

    return build


def forms() -> dict[str, Form]:
    """Every smoke form (gpu_smoke.KERNELS' names) and bisect variant (gpu_session's configs)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _bench import parse_config
    from gpu_session import BISECT_CONFIGS, GROUPED_BISECT_CONFIGS, WGRAD_BISECT_CONFIGS
    from pallas_kernels.configs import GemmConfig, GroupedGemmConfig
    from pallas_kernels.quantize import QuantizeConfig
    from pallas_kernels.tuning import MAX_STAGES, _fit_smem, rule_config
    import jax.numpy as jnp

    def wgs(cfg) -> int:
        return 3 if cfg.warp_specialized else 1

    def clustered(cfg) -> bool:
        return cfg is not None and max(getattr(cfg, "cluster_m", 1), cfg.cluster_n) > 1

    out: list[Form] = []

    def dense(name, what, cfg, **kw):
        # No config: the library's pick for the shape (`tuning.rule_config`; no tuned tables yet).
        picked = cfg or rule_config(*kw.get("shape", DENSE), jnp.dtype(kw.get("out_dtype", "bfloat16")),
                                    HOPPER_SMS, scalar_b=kw.get("b_block", (128, 128))[0] > 1)
        out.append(Form(name, what, _dense(cfg, **kw), wgs(picked), clustered(picked)))

    def grouped(name, what, cfg, wgrad=False):
        build = (_grouped_wgrad if wgrad else _grouped)(cfg)
        out.append(Form(name, what, build, wgs(cfg), clustered(cfg)))

    quant = [("quantize_tile", "1x128 activation tiles", _quantizer("tile")),
             ("quantize_block", "128x128 weight blocks (f32 master)", _quantizer("block", "float32")),
             ("quantize_weight", "fused weight quantizer: blocks and their transpose", _quantizer("weight", "float32")),
             ("quantize_grad", "fused gradient quantizer: dy tiles and dy^T per 128 tokens", _quantizer("grad")),
             ("quantize_activation", "fused activation quantizer: x tiles and their re-tiling for Wgrad",
              _quantizer("activation")),
             ("quantize_column_t", "x^T per 128 tokens (Wgrad operand)", _quantizer("column_t")),
             ("retile", "saved FP8 x re-tiled for Wgrad", _quantizer("retile")),
             ("quantize_tile_unswizzled", "1x128 tiles, a shape TMA cannot tile", _quantizer("tile", shape=(4090, 7166))),
             ("quantize_weight_unswizzled", "fused weight quantizer, a shape TMA cannot tile (f32 master)",
              _quantizer("weight", "float32", shape=(4090, 7166))),
             ("quantize_tile_ring", "1x128 tiles through a 2-slot SMEM ring",
              _quantizer("tile_ring", config=QuantizeConfig(chunks=8, stages=2))),
             # The bisect call's occupancy candidates (gpu_session.QUANTIZE_BISECT_CONFIGS): SMEM for
             # two CTAs per SM (`TWO_CTA_FORMS`, checked by `check_row`).
             ("quantize_grad_one_slot", "fused gradient quantizer, 4 chunks through 1 SMEM slot",
              _quantizer("grad_config", config=QuantizeConfig(column_chunks=4, stages=1))),
             ("quantize_activation_one_slot", "fused activation quantizer, 4 chunks through 1 SMEM slot",
              _quantizer("activation_config", config=QuantizeConfig(column_chunks=4, stages=1))),
             ("quantize_weight_one_chunk", "fused weight quantizer, 1 chunk per CTA (f32 master)",
              _quantizer("weight_config", "float32", config=QuantizeConfig(column_chunks=1)))]
    dense("gemm_default", "dense tile x block, GemmConfig()", GemmConfig())
    dense("gemm_simple", "dense tile x block, GemmConfig.simple()", GemmConfig.simple())
    dense("gemm_tile_x_tile", "dense tile x tile (Wgrad operands), GemmConfig()", GemmConfig(), b_block=(1, 128))
    dense("gemm_small_m", "dense at M=48: the tuning rule's pick", None, shape=(48, DENSE[1], DENSE[2]))
    grouped("grouped_fprop", "grouped Fprop/Dgrad, GroupedGemmConfig()", GroupedGemmConfig())
    grouped("grouped_wgrad", "grouped Wgrad, GroupedGemmConfig()", GroupedGemmConfig(), wgrad=True)
    grouped("grouped_fprop_simple", "grouped Fprop/Dgrad, simple()", GroupedGemmConfig.simple())
    grouped("grouped_wgrad_simple", "grouped Wgrad, simple()", GroupedGemmConfig.simple(), wgrad=True)
    for name, what, build in quant:
        out.append(Form(name, what, build, 1, ctas_per_sm=2 if name in TWO_CTA_FORMS else 1))
    out.append(Form("ragged_bf16", "the BF16 baseline's experts: jax's ragged dots (Fprop, Dgrad, Wgrad)",
                    _ragged_bf16(), 1))
    # The rest of gpu_smoke.py's forms, by their smoke names (the GPU session compares its rows).
    dense("gemm_cluster", "dense, GemmConfig(cluster_m=2)", GemmConfig(cluster_m=2))
    dense("gemm_vector_b", "dense, GemmConfig(scalar_b_scale=False)", GemmConfig(scalar_b_scale=False))
    dense("gemm_early_scales", "dense, GemmConfig(early_scale_loads=True)", GemmConfig(early_scale_loads=True))
    dense("gemm_cluster_n", "dense, GemmConfig(cluster_n=2)", GemmConfig(cluster_n=2))
    dense("gemm_run_ahead", "dense, GemmConfig(run_ahead=True)", GemmConfig(run_ahead=True))
    dense("gemm_wide_tiles", "dense, GemmConfig(tile_n=192, scalar_b_scale=True, max_concurrent_steps=2)",
          GemmConfig(tile_n=192, scalar_b_scale=True, max_concurrent_steps=2))
    grouped("grouped_fprop_switches", "grouped Fprop, GroupedGemmConfig(cluster_n=2, scalar_b_scale=True, "
            "early_scale_loads=True)", GroupedGemmConfig(cluster_n=2, scalar_b_scale=True, early_scale_loads=True))
    grouped("grouped_wgrad_cluster_n", "grouped Wgrad, GroupedGemmConfig(cluster_n=2, early_scale_loads=True)",
            GroupedGemmConfig(cluster_n=2, early_scale_loads=True), wgrad=True)
    # Issue 45's lean main loop: the stage released right after the wgmma's wait, the proxy
    # fence in the producer (`GemmConfig.lean_release`); off by default until racecheck is clean.
    dense("gemm_lean_release", "dense, GemmConfig(early_scale_loads=True, lean_release=True)",
          GemmConfig(early_scale_loads=True, lean_release=True))
    grouped("grouped_fprop_lean_release", "grouped Fprop, GroupedGemmConfig(early_scale_loads=True, "
            "lean_release=True)", GroupedGemmConfig(early_scale_loads=True, lean_release=True))
    dense("gemm_lean_release_128x192_cluster_m", "dense, GemmConfig(tile_n=192, cluster_m=2, "
          "early_scale_loads=True, lean_release=True): the rule's pick at 8192^3, lean",
          GemmConfig(tile_n=192, cluster_m=2, early_scale_loads=True, lean_release=True))
    # Layouts the tuning rule may pick that no form above compiles (`RULE_FORMS`).
    dense("gemm_rule_128x192_cluster_m", "dense, GemmConfig(tile_n=192, cluster_m=2): a rule layout",
          GemmConfig(tile_n=192, cluster_m=2))
    dense("gemm_rule_128x192_cluster_n", "dense, GemmConfig(tile_n=192, cluster_n=2): a rule layout",
          GemmConfig(tile_n=192, cluster_n=2))
    # The one-warpgroup form where warp-specialized tiles would leave SMs idle (`tuning._few_tiles`):
    # a narrow layer's Wgrad (d_model 768, 32k tokens: 6 row tiles of 128), tile-scaled b, f32 out.
    # Staged as the rule stages it: `MAX_STAGES`, fewer where SMEM does not hold them.
    for tile_n in (128, 64):
        wgrad_shape = (768, 3 * tile_n, 32768)
        cfg = _fit_smem(dataclasses.replace(GemmConfig.simple(), tile_n=tile_n, max_concurrent_steps=MAX_STAGES),
                        wgrad_shape[2], jnp.float32)
        dense(f"gemm_rule_64x{tile_n}_wgrad", f"dense tile x tile (Wgrad operands), f32 out, at "
              f"{'x'.join(map(str, wgrad_shape))}: GemmConfig.simple() on 64 x {tile_n} tiles, "
              f"{cfg.max_concurrent_steps} stages (a rule layout for few-tile problems)",
              cfg, b_block=(1, 128), shape=wgrad_shape, out_dtype="float32")
    grouped("grouped_fprop_rule_128x64", "grouped Fprop, GroupedGemmConfig(tile_n=64, "
            f"max_concurrent_steps={MAX_STAGES}): a rule layout",
            GroupedGemmConfig(tile_n=64, max_concurrent_steps=MAX_STAGES))
    # Issue 45: 256-row tiles, each consumer promoting its 128 rows in two 64-row waves through
    # one accumulator (`_mainloop._promote_waves`); 3 stages beside the bf16 output tile. The
    # rule's pick at most benchmark shapes is the form in clusters along N (DeepGEMM's).
    tall = dict(tile_m=256, max_concurrent_steps=3)
    dense("gemm_rule_256x128", "dense, GemmConfig(tile_m=256, max_concurrent_steps=3): a rule layout",
          GemmConfig(**tall))
    dense("gemm_rule_256x128_cluster_m", "dense, GemmConfig(tile_m=256, cluster_m=2, max_concurrent_steps=3): "
          "a rule layout", GemmConfig(**tall, cluster_m=2))
    dense("gemm_rule_256x128_cluster_n", "dense, GemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3): "
          "the rule's pick at 5 of the 6 dense benchmark shapes", GemmConfig(**tall, cluster_n=2))
    dense("gemm_rule_256x128_cluster_n_tile_x_tile", "dense tile x tile (Wgrad operands), "
          "GemmConfig(tile_m=256, cluster_n=2, max_concurrent_steps=3)", GemmConfig(**tall, cluster_n=2),
          b_block=(1, 128))
    dense("gemm_lean_release_256x128_cluster_n", "dense, GemmConfig(tile_m=256, cluster_n=2, "
          "max_concurrent_steps=3, early_scale_loads=True, lean_release=True): the rule's pick, lean",
          GemmConfig(**tall, cluster_n=2, early_scale_loads=True, lean_release=True))
    grouped("grouped_fprop_rule_256x128", "grouped Fprop, GroupedGemmConfig(tile_m=256, max_concurrent_steps=3): "
            "a rule layout", GroupedGemmConfig(**tall))
    grouped("grouped_fprop_rule_256x128_cluster_n", "grouped Fprop, GroupedGemmConfig(tile_m=256, cluster_n=2, "
            "max_concurrent_steps=3): the rule's pick at the grouped benchmark shapes",
            GroupedGemmConfig(**tall, cluster_n=2))
    grouped("grouped_fprop_lean_release_256x128_cluster_n", "grouped Fprop, GroupedGemmConfig(tile_m=256, "
            "cluster_n=2, max_concurrent_steps=3, early_scale_loads=True, lean_release=True): the rule's pick, lean",
            GroupedGemmConfig(**tall, cluster_n=2, early_scale_loads=True, lean_release=True))
    for text in BISECT_CONFIGS:
        dense(f"gemm[{text}]", f"dense, GemmConfig({text})", parse_config(text, GemmConfig))
    for text in GROUPED_BISECT_CONFIGS:
        grouped(f"grouped[{text}]", f"grouped Fprop, GroupedGemmConfig({text})",
                parse_config(text, GroupedGemmConfig))
    for text in WGRAD_BISECT_CONFIGS:
        grouped(f"grouped_wgrad[{text}]", f"grouped Wgrad, GroupedGemmConfig({text})",
                parse_config(text, GroupedGemmConfig), wgrad=True)
    return {f.name: f for f in out}


# The quantizer configs built to fit two CTAs on an SM (the bisect call times them beside the
# defaults, which fit one): `check_row` holds them to it.
TWO_CTA_FORMS = ("quantize_grad_one_slot", "quantize_activation_one_slot", "quantize_weight_one_chunk")
# Compiled on every CI run (tests/test_hopper_build.py): the default dense form, grouped Fprop
# and Wgrad, and the fused quantizers the training step runs (the f32 weight quantizer also at one
# chunk per CTA, where it fits two CTAs on an SM).
CI_FORMS = ("gemm_default", "grouped_fprop", "grouped_wgrad", "quantize_tile", "quantize_weight", "quantize_grad",
            "quantize_activation", "quantize_weight_one_chunk",
            "gemm[cluster_m=2]",
            # what the tuning rule runs at the benchmark shapes (tests/test_gemm_tuning.py DENSE_PICKS,
            # GROUPED_PICKS): 128 x 192 in clusters along M, 128 x 128 along N, grouped along N
            "gemm_rule_128x192_cluster_m", "gemm_cluster_n", "grouped[cluster_n=2]",
            # issue 45's lean main loop (not a default until racecheck on a GPU is clean): CI holds
            # the targets it meets ("no MEMBAR") from now on
            "gemm_lean_release", "grouped_fprop_lean_release", "gemm_lean_release_128x192_cluster_m",
            # issue 45's 256-row tiles: the rule's picks at the other benchmark shapes, and lean
            "gemm_rule_256x128_cluster_n", "grouped_fprop_rule_256x128_cluster_n",
            "gemm_lean_release_256x128_cluster_n", "grouped_fprop_lean_release_256x128_cluster_n")
# The CI GEMM forms' main loops against `MAINLOOP_TARGETS` (form -> its kind), and the targets
# each does not meet yet, exactly (`mainloop_problems`; numbers in docs/gpu.md, "Issue 45's
# deviceless targets"). CI asserts every other target; a target newly met fails too, until it
# is taken off this list (and so held from then on).
MAINLOOP_FORMS = {"gemm_default": "gemm", "gemm[cluster_m=2]": "gemm", "gemm_rule_128x192_cluster_m": "gemm",
                  "gemm_cluster_n": "gemm", "grouped_fprop": "grouped_fprop",
                  "grouped[cluster_n=2]": "grouped_fprop", "grouped_wgrad": "grouped_wgrad",
                  "gemm_lean_release": "gemm", "grouped_fprop_lean_release": "grouped_fprop",
                  "gemm_lean_release_128x192_cluster_m": "gemm", "gemm_rule_256x128_cluster_n": "gemm",
                  "grouped_fprop_rule_256x128_cluster_n": "grouped_fprop",
                  "gemm_lean_release_256x128_cluster_n": "gemm",
                  "grouped_fprop_lean_release_256x128_cluster_n": "grouped_fprop"}
_MEMBAR = "MEMBAR in the main loop"
MAINLOOP_UNMET: dict[str, tuple[str, ...]] = {
    # The per-K-block proxy fence and warpgroup barrier (MEMBAR.ALL.CTA, FENCE.VIEW.ASYNC.S,
    # BAR.SYNC): gone in the lean forms, which become defaults only after compute-sanitizer's
    # racecheck is clean on a GPU (docs/gpu.md).
    "gemm_default": (_MEMBAR,),
    "gemm[cluster_m=2]": (_MEMBAR,),
    "gemm_rule_128x192_cluster_m": (_MEMBAR,),
    "gemm_cluster_n": (_MEMBAR,),
    "grouped_fprop": (_MEMBAR,),
    "grouped[cluster_n=2]": (_MEMBAR,),
    "grouped_wgrad": (_MEMBAR,),
    "gemm_rule_256x128_cluster_n": (_MEMBAR,),
    "grouped_fprop_rule_256x128_cluster_n": (_MEMBAR,),
}
# Every layout the tuning rule picks among (`tuning.DENSE_LAYOUTS`, `GROUPED_LAYOUTS`,
# `ONE_WARPGROUP_LAYOUTS`: tile_m, tile_n, cluster_m, cluster_n) -> the form that compiles it;
# tests/test_hopper_build.py holds each to a committed row without problems, so that the rule
# picks only what compiles without spills.
RULE_FORMS: dict[tuple[str, tuple[int, int, int, int]], str] = {
    ("dense", (128, 128, 1, 1)): "gemm_default",
    ("dense", (128, 128, 2, 1)): "gemm_cluster",
    ("dense", (128, 128, 1, 2)): "gemm_cluster_n",
    ("dense", (128, 192, 1, 1)): "gemm[tile_n=192,scalar_b_scale=true]",
    ("dense", (128, 192, 2, 1)): "gemm_rule_128x192_cluster_m",
    ("dense", (128, 192, 1, 2)): "gemm_rule_128x192_cluster_n",
    ("dense", (128, 64, 1, 1)): "gemm[tile_n=64]",
    ("grouped", (128, 128, 1, 1)): "grouped_fprop",
    ("grouped", (128, 128, 1, 2)): "grouped[cluster_n=2]",
    ("grouped", (128, 64, 1, 1)): "grouped_fprop_rule_128x64",
    ("dense", (256, 128, 1, 1)): "gemm_rule_256x128",
    ("dense", (256, 128, 2, 1)): "gemm_rule_256x128_cluster_m",
    ("dense", (256, 128, 1, 2)): "gemm_rule_256x128_cluster_n",
    ("grouped", (256, 128, 1, 1)): "grouped_fprop_rule_256x128",
    ("grouped", (256, 128, 1, 2)): "grouped_fprop_rule_256x128_cluster_n",
    ("dense", (64, 128, 1, 1)): "gemm_rule_64x128_wgrad",
    ("dense", (64, 64, 1, 1)): "gemm_rule_64x64_wgrad",
}
# Defects the build found and that are not fixed (docs/gpu.md, "Compiled for Hopper without a
# Hopper", item 2): form -> its `check_row` problems, exactly, at ptxas 13.5. No default form has
# one. The committed tables are held to this for every form, and CI's compile of `CI_FORMS` too: a
# form showing other problems fails, and so does one whose problems went away (delete its entry).
KNOWN_DEFECTS: dict[str, tuple[str, ...]] = {
    # A consumer's 64 x 256 f32 result plus its chunk's 64 x 256 partial sum is 2 x 128 registers,
    # over its 232. (256-row tiles no longer spill: their consumers promote in 64-row waves
    # through one accumulator, `_mainloop._promote_waves`; a 256-wide tile would need column
    # waves, which fp8 wgmma's K-major b allows but nothing here builds.)
    "gemm[tile_n=256,scalar_b_scale=true,max_concurrent_steps=3]": ("spills: 356 bytes stored, 356 loaded",),
}


# ------------------------------------------------------------------------------ the child: one compile


def compile_form(name: str, target: str) -> dict:
    """Lower and compile one form deviceless for `target` (in this process); times and XLA's
    memory analysis. The kernel's dumps go where MOSAIC_GPU_DUMP_TO points."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels import _mgpu

    form = forms()[name]
    text = (TARGETS_DIR / f"{target}.txtpb").read_text()
    topo = topologies.get_topology_desc("", "cuda", target_config=text, topology="1x1x1")
    sharding = SingleDeviceSharding(topo.devices[0])
    fn, args = form.build()
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    t0 = time.perf_counter()
    # The kernels read the SM count and the GPU model (persistent grids, tuned configs) from the
    # build target: there is no GPU to ask. (An abstract mesh would make jax lower for "gpu",
    # a platform this host does not have.) The kernels are traced when lowered.
    with _mgpu.build_target(TARGETS[target], HOPPER_SMS):
        lowered = jax.jit(fn).trace(*args).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    return {"lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
            "mosaic_custom_calls": lowered.as_text().count("@mosaic_gpu"),
            "xla_temp_bytes": getattr(mem, "temp_size_in_bytes", None)}


def _child(name: str, target: str, result_path: str) -> int:
    try:
        result = {"ok": True, **compile_form(name, target)}
    except Exception as e:  # noqa: BLE001 - the compiler's error is the row
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-3000:]}"}
    pathlib.Path(result_path).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------ the parent


def toolchain(cudnn: bool = False) -> pathlib.Path:
    """The toolchain's directory (installed by scripts/hopper_toolchain.sh), or SystemExit; with
    `cudnn`, cuDNN beside it too (`cudnn_dir`)."""
    env = dict(os.environ, JFP8_HOPPER_CUDNN="1") if cudnn else None
    r = subprocess.run(["bash", str(REPO / "scripts" / "hopper_toolchain.sh")], capture_output=True, text=True,
                       env=env)
    if r.returncode:
        raise SystemExit(f"the Hopper build toolchain is not available: {r.stderr.strip()}")
    return pathlib.Path(r.stdout.strip().splitlines()[-1])


def cudnn_dir(tools: pathlib.Path) -> pathlib.Path:
    """Where `toolchain(cudnn=True)` installs cuDNN: beside the toolchain."""
    return tools.with_name(tools.name + "-cudnn")


def child_env(tools: pathlib.Path, cudnn: bool = False) -> dict:
    """The compiling process's environment: the toolchain on PATH (ptxas) and PYTHONPATH (jax's
    CUDA plugin), nvdisasm for Mosaic's SASS dump, and the dumps on stdout; with `cudnn`, cuDNN on
    PYTHONPATH too (jax's plugin finds it there), so that a step's attention can be cuDNN's."""
    cuda = tools / "nvidia" / "cu13"
    if cudnn and not (cudnn_dir(tools) / ".installed").exists():
        raise SystemExit(f"no cuDNN beside the Hopper toolchain ({cudnn_dir(tools)}): run "
                         "JFP8_HOPPER_CUDNN=1 bash scripts/hopper_toolchain.sh")
    paths = [str(tools), str(cudnn_dir(tools)) if cudnn else None, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", PATH=f"{cuda / 'bin'}:{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, paths)),
               CUDA_ROOT=str(cuda), MOSAIC_GPU_CUDA_ROOT=str(cuda), TF_CPP_MIN_LOG_LEVEL="2",
               MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_RESOURCES="1")
    for name in ("XLA_FLAGS", "MOSAIC_GPU_DUMP_TO"):  # the test suite's host devices; files
        env.pop(name, None)
    return env


def ptxas_version(tools: pathlib.Path) -> str:
    r = subprocess.run([str(tools / "nvidia" / "cu13" / "bin" / "ptxas"), "--version"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 else f"unknown ({r.stderr.strip()[:200]})"


def read_dump(text: str) -> dict:
    """What the compiler said about the kernel(s) of one form (its process's stdout): ptxas
    report, SASS census, SMEM."""
    from gpu_reports import parse_ptxas, sass_census

    ptxas = parse_ptxas(text)
    smem = [int(v) for v in re.findall(r"smem_scratch_bytes=(\d+)", text)]
    sass = sass_census(text)
    return {
        "kernels": len(re.findall(r"Compiling entry function", text)),
        "registers": ptxas["registers"],
        "spill_stores": sum(f.get("spill_stores", 0) for f in ptxas["functions"].values()) if ptxas["functions"] else None,
        "spill_loads": sum(f.get("spill_loads", 0) for f in ptxas["functions"].values()) if ptxas["functions"] else None,
        "barriers": ptxas.get("barriers"),
        "smem_bytes": max(smem) if smem else None,
        "ptxas_warnings": ptxas["warnings"],
        "setmaxnreg_ignored": ptxas["setmaxnreg_ignored"],
        "wgmma_serialized": ptxas["wgmma_serialized"],
        "sass": sass if sass["instructions"] else None,
        "mainloop": mainloop_summary(text) if sass["qgmma"] else None,
    }


def mainloop_summary(sass_text: str) -> dict | None:
    """The GEMM main loop's census (`hopper/sass_loops.mainloop_census`: the loop around the
    QGMMAs), per 128-K block of one consumer warpgroup: instructions, the same per 64x128x128 of
    MMA work, the fewest-instruction path, MEMBARs, local-memory loads and stores, and the
    accumulator waves per K block with the QGMMA chains that do not start from zero (the
    promotion needs every chunk's product in a zeroed accumulator: `RZ, !UPT` on its first
    QGMMA, as 64-row waves through one accumulator must show too); None when no loop issues
    QGMMA."""
    sys.path.insert(0, str(REPO / "benchmarks" / "hopper"))
    from sass_loops import mainloop_census

    main = mainloop_census(sass_text)["main"]
    if main is None:
        return None
    k128, fewest = main["per_k128"], main["fewest_path_per_k128"]
    return {"instructions_per_k128": k128["instructions"],
            "instructions_per_64x128x128": (main["per_64x128x128"] or {}).get("instructions"),
            "fewest_path_per_k128": fewest["instructions"] if fewest else None,
            "membar_per_k128": sum(v for k, v in k128["fences"].items() if k.startswith("MEMBAR")),
            "ldl_stl_per_k128": k128["ldl_stl"],
            "m_waves": main["m_waves"], "chains": main["chains"]["lengths"],
            "carried_accumulators": sorted(main["chains"]["carried"])}


# Issue 45's deviceless targets for the default forms' main loops (DeepGEMM's loop: 96
# instructions per 64x128x128, no MEMBAR; the grouped Wgrad at the dense per-column-scale
# class, 212 static): form kind -> (instructions per 64x128x128, static instructions per
# 128-K block); either may be None. Every main loop: no MEMBAR, no local memory.
MAINLOOP_TARGETS = {"gemm": (100, None), "grouped_fprop": (100, None), "grouped_wgrad": (None, 212)}


def mainloop_problems(row: dict, kind: str) -> list[str]:
    """The issue-45 main-loop targets a row does not meet yet, as sentences without numbers (the
    numbers are in the row and in docs/gpu.md); `kind`: a `MAINLOOP_TARGETS` key."""
    loop = row.get("mainloop")
    if loop is None:
        return ["no main loop found in the SASS"]
    per_unit, static = MAINLOOP_TARGETS[kind]
    bad = []
    if per_unit is not None and loop["instructions_per_64x128x128"] > per_unit:
        bad.append(f"main loop over {per_unit} instructions per 64x128x128")
    if static is not None and loop["instructions_per_k128"] > static:
        bad.append(f"main loop over {static} static instructions per 128-K block")
    if loop["membar_per_k128"]:
        bad.append("MEMBAR in the main loop")
    if loop["ldl_stl_per_k128"]:
        bad.append("local memory in the main loop")
    if loop.get("carried_accumulators"):
        bad.append("a QGMMA chain in the main loop does not start from a zeroed accumulator")
    return bad


def check_row(row: dict, form: Form) -> list[str]:
    """What a default form must satisfy (tests/test_hopper_build.py, the issue's CI check): each
    failure as a sentence; empty when the row passes."""
    bad = []
    if not row.get("ok"):
        return [f"did not compile: {row.get('error', '?')[:500]}"]
    if row.get("kernels", 0) < 1 or row.get("registers") is None:
        return ["no ptxas report was dumped"]
    if row["spill_stores"] or row["spill_loads"]:
        bad.append(f"spills: {row['spill_stores']} bytes stored, {row['spill_loads']} loaded")
    if row["wgmma_serialized"]:
        bad.append("ptxas serialized the wgmma instructions")
    if row["setmaxnreg_ignored"]:
        bad.append("ptxas ignored setmaxnreg (C7508)")
    sass = row["sass"] or {}
    gemm = form.name.startswith(("gemm", "grouped"))
    if gemm and not any("E4M3" in shape for shape in sass.get("qgmma", {})):
        bad.append(f"no E4M3 QGMMA in the SASS (QGMMA: {sass.get('qgmma')}, HGMMA: {sass.get('hgmma')})")
    if form.warpgroups > 1:
        regs = sass.get("usetmaxreg", {})
        if not regs:
            bad.append("warp-specialized but no USETMAXREG in the SASS")
        else:  # 1 producer warpgroup at the DEALLOC value, the consumers at the ALLOC value
            budget = WARPGROUP_THREADS * (max(regs.get("DEALLOC", [0])) + (form.warpgroups - 1) * max(regs.get("ALLOC", [0])))
            if budget > REGISTERS_PER_SM:
                bad.append(f"setmaxnreg budget {budget} registers exceeds the SM's {REGISTERS_PER_SM}")
            if row["registers"] > max(regs.get("ALLOC", [0])):
                bad.append(f"{row['registers']} registers at launch exceed the consumers' setmaxnreg "
                           f"{max(regs.get('ALLOC', [0]))}")
    if row["registers"] * WARPGROUP_THREADS * form.warpgroups > REGISTERS_PER_SM:
        bad.append(f"{row['registers']} registers x {form.warpgroups * WARPGROUP_THREADS} threads exceed the SM")
    if form.ctas_per_sm > 1:
        n = form.ctas_per_sm
        if row.get("smem_bytes") is None:
            bad.append(f"{n} CTAs per SM cannot be checked: no SMEM count in the dump")
        elif n * (row["smem_bytes"] + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
            bad.append(f"{n} CTAs per SM do not fit: {row['smem_bytes']} bytes of SMEM each, at most "
                       f"{SMEM_PER_SM // n - SMEM_RESERVED_PER_CTA}")
        if n * row["registers"] * WARPGROUP_THREADS * form.warpgroups > REGISTERS_PER_SM:
            bad.append(f"{n} CTAs per SM do not fit: {row['registers']} registers x "
                       f"{n * form.warpgroups * WARPGROUP_THREADS} threads exceed the SM")
    if form.cluster and not sass.get("utmaldg_multicast"):
        bad.append(f"a cluster form without multicast TMA loads (UTMALDG: {sass.get('utmaldg')})")
    return bad


def build(names: list[str], target: str, tools: pathlib.Path, timeout: float = 600, log=print,
          keep_dumps: pathlib.Path | None = None) -> list[dict]:
    """One row per form, each compiled in its own subprocess; `keep_dumps`: a folder to keep each
    form's compiler dump in (PTX, ptxas report, SASS), one subfolder per form and target."""
    all_forms = forms()
    version = ptxas_version(tools)
    rows = []
    for name in names:
        form = all_forms[name]
        with tempfile.TemporaryDirectory(prefix="hopper-build-") as tmp:
            result, out = pathlib.Path(tmp) / "result.json", pathlib.Path(tmp) / "stdout.txt"
            t0 = time.perf_counter()
            try:
                with open(out, "w") as stdout:
                    p = subprocess.run([sys.executable, __file__, "--child", name, "--target", target,
                                        "--result", str(result)], env=child_env(tools), stdout=stdout,
                                       stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=REPO)
                got = json.loads(result.read_text()) if result.exists() else {
                    "ok": False, "error": f"the compile process died (exit {p.returncode}): {p.stderr[-2000:]}"}
            except subprocess.TimeoutExpired:
                got = {"ok": False, "error": f"timed out after {timeout} s"}
            text = out.read_text(errors="replace")
            row = {"form": name, "what": form.what, "target": target, **got, **read_dump(text),
                   "wall_s": round(time.perf_counter() - t0, 1), "ptxas_version": version}
            if keep_dumps is not None:
                kept = keep_dumps / target / ("".join(c if c.isalnum() or c in "_-=," else "_" for c in name) + ".txt")
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(text)
        row["problems"] = check_row(row, form)
        rows.append(row)
        log(format_row(row))
    return rows


def format_row(r: dict) -> str:
    if not r.get("ok"):
        return f"{r['form']:58s} FAILED: {r.get('error', '')[:300]}"
    s = r["sass"] or {}
    q = ",".join(f"{k.split('.')[0]}x{v}" for k, v in s.get("qgmma", {}).items()) or "-"
    return (f"{r['form']:58s} regs {r['registers']!s:>4} spill {r['spill_stores']}/{r['spill_loads']} "
            f"smem {r['smem_bytes']!s:>6} QGMMA {q:14s} FFMA {s.get('ffma', 0):4d} FMUL {s.get('fmul', 0):4d} "
            f"setmaxnreg {s.get('usetmaxreg', {})} multicast {s.get('utmaldg_multicast', 0)} "
            f"compile {r['compile_s']} s" + (f"  PROBLEMS: {r['problems']}" if r["problems"] else ""))


def markdown_table(doc: dict) -> str:
    """The committed rows of one target as the table in docs/gpu.md."""
    head = ("| form | compiled | regs | spill st/ld | barriers | SMEM | QGMMA | FFMA/FMUL | LDL/STL | setmaxnreg "
            "| TMA loads (multicast) | instr | problems |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in doc["rows"]:
        if not r.get("ok"):
            lines.append(f"| `{r['form']}` | **no**: {r.get('error', '')[:120]} |" + " |" * 11)
            continue
        s = r["sass"] or {}
        q = ", ".join(f"{k.split('.')[0]} ×{v}" for k, v in s.get("qgmma", {}).items()) or "–"
        regs = s.get("usetmaxreg", {})
        setmax = "/".join(str(regs[k][0]) for k in ("DEALLOC", "ALLOC") if k in regs) or "–"
        loads = sum(s.get("utmaldg", {}).values())
        lines.append(
            f"| `{r['form']}` | yes | {r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['barriers']} "
            f"| {r['smem_bytes']} | {q} | {s.get('ffma', 0)}/{s.get('fmul', 0)} | {s.get('ldl', 0)}/{s.get('stl', 0)} "
            f"| {setmax} | {loads} ({s.get('utmaldg_multicast', 0)}) | {s.get('instructions')} "
            f"| {'; '.join(r['problems']) or '–'} |")
    return "\n".join(lines)


def write(rows: list[dict], target: str, out: pathlib.Path) -> pathlib.Path:
    import jax

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernels-{target}.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    names = {r["form"] for r in rows}
    order = list(forms())
    # --only updates its rows in place; rows of forms that no longer exist are dropped
    merged = [r for r in old if r["form"] not in names and r["form"] in order] + rows
    merged.sort(key=lambda r: order.index(r["form"]) if r["form"] in order else len(order))
    doc = {"target": target, "device_kind": TARGETS[target], "jax": jax.__version__,
           "ptxas": rows[0]["ptxas_version"] if rows else None,
           "date": datetime.date.today().isoformat(), "host": platform.node(),
           "command": "python benchmarks/hopper_build.py --target " + target, "rows": merged}
    return write_json(path, doc)


def write_json(path: pathlib.Path, doc: dict) -> pathlib.Path:
    """`doc` as indented JSON at `path`, atomically (a temporary file beside it, renamed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    p.add_argument("--only", nargs="+", metavar="FORM", help="these forms (names from --list)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--timeout", type=float, default=600, help="seconds per form")
    p.add_argument("--keep-dumps", type=pathlib.Path, help="keep each form's ptxas report and SASS here (FORM.txt)")
    p.add_argument("--table", action="store_true", help="print the committed results as markdown tables")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.target, args.result)
    if args.table:
        for target in (TARGETS if args.target == "all" else [args.target]):
            doc = json.loads((args.out / f"kernels-{target}.json").read_text())
            print(f"{target} ({doc['device_kind']}), ptxas {doc['ptxas']}, jax {doc['jax']}, {doc['date']}:\n")
            print(markdown_table(doc) + "\n")
        return 0
    all_forms = forms()
    if args.list:
        for f in all_forms.values():
            print(f"{f.name:60s} {f.what}")
        return 0
    names = args.only or list(all_forms)
    unknown = [n for n in names if n not in all_forms]
    if unknown:
        raise SystemExit(f"unknown forms {unknown}; --list shows them")
    tools = toolchain()
    failed = 0
    for target in (TARGETS if args.target == "all" else [args.target]):
        print(f"== {target} ({TARGETS[target]}), ptxas {ptxas_version(tools)}", flush=True)
        rows = build(names, target, tools, args.timeout, log=lambda s: print(s, flush=True),
                     keep_dumps=args.keep_dumps)
        print(f"wrote {write(rows, target, args.out)}")
        failed += sum(bool(r["problems"]) for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.exit(main())
