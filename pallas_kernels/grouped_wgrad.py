"""The grouped (MoE) Wgrad for Hopper in Pallas Mosaic GPU: grouped along the contraction (token)
axis, one (K, N) weight gradient per group from operands scaled per 128 tokens, with DeepSeek-V3's
FP32 promotion per 128-token chunk. Reference: `jfp8.reference.grouped_wgrad_reference`.

Forms as for `grouped_gemm` (`GroupedGemmConfig()` / `.simple()`). The warp-specialized form walks
the (group, K tile, N tile) tiles with a dynamic K loop over the group's own token chunks; each
consumer masks the other groups' tokens out of its rows of a shared chunk before its wgmma; an
empty group's tiles store zeros. In the interpreter both forms give the reference's bits; on a
Hopper GPU they are held to `jfp8.accumulation.grouped_wgrad_hardware_error_bound`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import (
    FP8_TRANSFORMS,
    LANE_SEMANTICS,
    WS_CONSUMER_WGS,
    cdiv,
    check_fp8,
    check_out_dtype,
    check_scale,
    check_tma_slot,
    pad_rows,
    round_up,
    store_width,
    swizzled,
    zeros,
)
from pallas_kernels._mainloop import (
    branch_once_tiles,
    chunk_product,
    cluster_shape,
    cluster_tiles,
    for_each_tile,
    launch_tiles,
    store_tile,
)
from pallas_kernels.configs import GroupedGemmConfig, check_smem, out_shape
from pallas_kernels.fp8_math import TILE
from pallas_kernels.schedule import check_group_sizes, group_bounds, tiles_touched

__all__ = ["GroupedGemmConfig", "grouped_wgrad"]

def _mask_tokens(a_smem, lo, hi) -> None:
    """Zero, in place, the token columns of an SMEM tile outside `[lo, hi)` (tile-relative).

    Mosaic GPU has no arithmetic on 8-bit registers but has bitwise ops: AND the E4M3 bit
    patterns with 0xFF (keep) or 0x00 (+0.0). Like the reference's `jnp.where` (and unlike a
    multiply by 0), this keeps a NaN or Inf of another group's token out of this group's sum.
    """
    shape = a_smem.shape  # [tile_m, 128 tokens]
    layout = plgpu.Layout.WGMMA_8BIT
    tokens = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    keep = ((tokens >= lo) & (tokens < hi)).astype(jnp.int32)
    bits = jax.lax.bitcast_convert_type(plgpu.load(a_smem, layout=layout), jnp.int8)
    masked = bits & (-keep).astype(jnp.int8)  # -1 = 0xFF keeps every bit, 0 clears them
    a_smem[...] = jax.lax.bitcast_convert_type(masked, a_smem.dtype)
    plgpu.commit_smem()  # make the register writes visible to the wgmma (async proxy)

def _grouped_wgrad_kernel(
    start_ref, end_ref, first_ref, count_ref,  # [G] int32: token range, first chunk, chunk count
    a_gmem,  # [K (8-aligned), Tp] e4m3: x^T
    sa_gmem,  # [C, Kpad] f32: chunk-major
    b_gmem,  # [N (8-aligned), Tp] e4m3: dy^T
    sb_gmem,  # [C, Npad] f32: chunk-major
    o_gmem,  # [G, K', N padded to 16 bytes] (K' = K, or whole row tiles: `_whole_tiles`)
    *,
    config: GroupedGemmConfig,
):
    tm, tn = config.tile_m, config.tile_n
    g, mi, ni = (jax.lax.axis_index(name) for name in ("g", "m", "n"))
    start, end, first, count = start_ref[g], end_ref[g], first_ref[g], count_ref[g]

    def promote(idx, a_smem, b_smem, sa_smem, sb_smem, out):
        # The group's `step`-th 128-token chunk, in order. Only its first and last chunks can
        # hold tokens of other groups: mask those tokens out of the lhs (as the reference does),
        # then promote with the per-K-row and per-N-column token-tile scales.
        (step,) = idx
        chunk_start = (first + step) * TILE

        @pl.when((step == 0) | (step == count - 1))
        def _():
            _mask_tokens(a_smem, start - chunk_start, end - chunk_start)

        partial = chunk_product(a_smem, b_smem, (tm, tn))
        sa = plgpu.load(sa_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [tm]
        sb = plgpu.load(sb_smem, layout=plgpu.Layout.WGMMA.reduce(0))  # [tn]
        s = jax.lax.broadcast_in_dim(sa, (tm, tn), (0,)) * jax.lax.broadcast_in_dim(
            sb, (tm, tn), (1,)
        )
        return out + partial * s

    # A dynamic grid: the group's own chunks only, so no CTA reads the other groups' tokens.
    check_tma_slot("x's scales", (tm,), jnp.float32)
    check_tma_slot("dy's scales", (tn,), jnp.float32)
    pipeline = plgpu.emit_pipeline(
        promote,
        grid=(count,),
        in_specs=[
            plgpu.BlockSpec((tm, TILE), lambda s: (mi, first + s), transforms=FP8_TRANSFORMS),
            plgpu.BlockSpec((tn, TILE), lambda s: (ni, first + s), transforms=FP8_TRANSFORMS),
            plgpu.BlockSpec((None, tm), lambda s: (first + s, mi)),
            plgpu.BlockSpec((None, tn), lambda s: (first + s, ni)),
        ],
        max_concurrent_steps=config.max_concurrent_steps,
        init_carry=zeros((tm, tn)),
    )

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tm, tn), o_gmem.dtype))
    def _(o_smem):
        @pl.when(count > 0)
        def _():
            o_smem[...] = pipeline(a_gmem, b_gmem, sa_gmem, sb_gmem).astype(o_smem.dtype)

        @pl.when(count == 0)
        def _():
            o_smem[...] = jnp.zeros((tm, tn), o_smem.dtype)  # an empty group's gradient

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g, pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

def _ws_wgrad_kernel(
    start_ref, end_ref, first_ref, count_ref,  # [G] int32: token range, first chunk, chunk count
    a_gmem,  # [K (8-aligned), Tp] e4m3: x^T
    sa_gmem,  # [C, Kpad] f32: chunk-major
    b_gmem,  # [N (8-aligned), Tp] e4m3: dy^T
    sb_gmem,  # [C, Npad] f32: chunk-major
    o_gmem,  # [G, K', N'] (`out_shape` of each group's (K, N) gradient, `_whole_tiles`)
    *,
    config: GroupedGemmConfig,
    kdim: int,
    n: int,
):
    """Warp-specialized, optionally persistent `grouped_wgrad`: the dense tile x tile GEMM
    (`branch_once_tiles`) over the (group, K tile, N tile) tiles, each with a dynamic K
    loop over its group's own token chunks. Each consumer masks the other groups' tokens out of
    its rows of a shared chunk (the first and last), as `_grouped_wgrad_kernel` does."""
    tm, tn = config.tile_m, config.tile_n
    wm = tm // WS_CONSUMER_WGS
    m_tiles = cdiv(kdim, tm)
    operands = (a_gmem, b_gmem, sa_gmem, sb_gmem)

    def schedule(k_tile, wg, out_rows, step):
        def tile(gm, ni, step):
            g, mi = gm // m_tiles, gm % m_tiles
            start, end, first, count = start_ref[g], end_ref[g], first_ref[g], count_ref[g]
            dst = o_gmem.at[g, pl.ds(mi * tm + wg * wm, wm), pl.ds(ni * tn, tn)]

            def epilogue(out, smem):
                store_tile(out, smem, dst)

            def edge_chunk(k, a_rows):  # the group's first or last chunk (k: its number in the loop)
                chunk_start = (first + k) * TILE
                _mask_tokens(a_rows, start - chunk_start, end - chunk_start)

            def k_loop(step):
                return k_tile(mi, ni, operands, epilogue, step, k_first=first, k_steps=count,
                              edge_chunk=edge_chunk)

            step = jax.lax.cond(count > 0, k_loop, lambda step: step, step)
            if out_rows is not None:  # None: the producer

                @pl.when(count == 0)
                def _():
                    epilogue(zeros((wm, tn)), out_rows)  # an empty group's gradient

            return step

        return for_each_tile(config, (start_ref.shape[0] * m_tiles, cdiv(n, tn)), tile, init_carry=step)

    out_transforms = swizzled(o_gmem.dtype, tn)
    branch_once_tiles(config, operands, o_gmem.dtype, schedule, out_transforms=out_transforms, dynamic_k=True)

def grouped_wgrad(
    lhs_t_data: jax.Array,
    lhs_t_scale: jax.Array,
    rhs_t_data: jax.Array,
    rhs_t_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    t: int,
    out_dtype=jnp.float32,
    config: GroupedGemmConfig | None = None,
) -> jax.Array:
    """MoE Wgrad: for each group g, `lhs_t[:, tokens of g] @ rhs_t[:, tokens of g].T`.

    Args:
      lhs_t_data: (K, Tp) e4m3: `x^T` for tokens sorted by group, the data of
        `quantize(x, (128, 1)).mT`; Tp = t rounded up to 128.
      lhs_t_scale: (K, Tp // 128) f32: one scale per K row and 128-token tile, tiles counted from
        token 0 of the whole batch (a tile may straddle two groups).
      rhs_t_data: (N, Tp) e4m3: `dy^T`, scaled the same way.
      rhs_t_scale: (N, Tp // 128) f32.
      group_sizes: (G,) int32 tokens per group, summing to at most t.
      t: the logical token count.
      out_dtype: float32 (default) or bfloat16.
      config: tiling; `GroupedGemmConfig()` by default.

    Returns:
      (G, K, N) in `out_dtype`, equal to `grouped_wgrad_reference`; empty groups give zeros.
    """
    config = config or GroupedGemmConfig()
    check_out_dtype(out_dtype)
    check_fp8(lhs_t_data, "lhs_t_data", 2)
    check_fp8(rhs_t_data, "rhs_t_data", 2)
    (kdim, tp), (n, tp_rhs) = lhs_t_data.shape, rhs_t_data.shape
    if t < 0 or tp != round_up(t, TILE) or tp_rhs != tp:
        raise ValueError(
            f"lhs_t_data {lhs_t_data.shape} and rhs_t_data {rhs_t_data.shape} must both have "
            f"{round_up(t, TILE)} token columns for t={t}"
        )
    chunks = tp // TILE
    check_scale(lhs_t_scale, "lhs_t_scale", (kdim, chunks))
    check_scale(rhs_t_scale, "rhs_t_scale", (n, chunks))
    group_sizes = jnp.asarray(group_sizes)
    check_group_sizes(group_sizes, t)
    groups = group_sizes.shape[0]
    if t == 0 or groups == 0 or kdim == 0 or n == 0:
        return jnp.zeros((groups, kdim, n), out_dtype)
    if config.warp_specialized:  # a dynamic K loop: the pipeline allocates every stage
        # Its b (dy^T) is tile-scaled: a per-column scale vector per stage.
        check_smem(config, out_dtype, max(chunks, config.max_concurrent_steps), scalar_b=False)

    return _grouped_wgrad_call(
        lhs_t_data, lhs_t_scale, rhs_t_data, rhs_t_scale, group_sizes,
        out_dtype=jnp.dtype(out_dtype), config=config,
    )

def _whole_tiles(k_out: int, n_out: int, config: GroupedGemmConfig) -> tuple[int, int]:
    """The output's (K', N') per group from the extents (`k_out`, `n_out`) the TMA store needs.

    A tile's store window (its rows of the group's gradient, `tile_n` columns) is contiguous in
    GMEM when `n_out == tile_n`, and Mosaic GPU lowers such a store from unswizzled SMEM to a flat
    bulk copy clamped only at the end of the whole array (`tests/tma_stores.py`): on Hopper the
    rows of a partial last row tile past K would land on the next group's first rows, and a
    cluster's CTA past N on the next rows. So in that case the output holds whole row tiles and
    whole cluster column tiles (a wider output's windows are not contiguous: they take the tensor
    map, which drops what lies past K or N). The simple form's store is such a flat copy; the
    fast form's output tile is swizzled (a tensor map), and is padded alike so as not to rely on
    it. Only an N of at most one tile is concerned, never a DeepSeek-V3 shape.
    """
    if n_out != config.tile_n:
        return k_out, n_out
    return round_up(k_out, config.tile_m), n_out * cluster_shape(config)[1]


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "num_sms"))
def _grouped_wgrad_call(
    lhs_t_data, lhs_t_scale, rhs_t_data, rhs_t_scale, group_sizes, *, out_dtype, config,
    num_sms=None,
):
    """The launch of `grouped_wgrad` on validated, non-empty operands."""
    (kdim, _), (n, _), groups = lhs_t_data.shape, rhs_t_data.shape, group_sizes.shape[0]
    tm, tn = config.tile_m, config.tile_n
    starts, ends = group_bounds(group_sizes)
    first, count = tiles_touched(starts, ends, TILE)
    # Chunk-major scales, padded to whole output tiles: one contiguous vector per chunk.
    sa_t = jnp.pad(lhs_t_scale.T, ((0, 0), (0, round_up(kdim, tm) - kdim)))  # [C, Kpad]
    sb_t = jnp.pad(rhs_t_scale.T, ((0, 0), (0, round_up(n, tn) - n)))  # [C, Npad]
    operands = (starts, ends, first, count, pad_rows(lhs_t_data), sa_t, pad_rows(rhs_t_data), sb_t)
    if config.warp_specialized:
        k_out, n_out = _whole_tiles(*out_shape(kdim, n, out_dtype, config), config)
        grid = cluster_tiles(config, (groups * cdiv(kdim, tm), cdiv(n, tn)))
        kernel = launch_tiles(
            functools.partial(_ws_wgrad_kernel, config=config, kdim=kdim, n=n),
            jax.ShapeDtypeStruct((groups, k_out, n_out), out_dtype), config, grid[0] * grid[1],
            num_sms,
        )
        out = kernel(*operands)
        return out if (k_out, n_out) == (kdim, n) else out[:, :kdim, :n]
    k_out, width = _whole_tiles(kdim, store_width(n, out_dtype), config)
    kernel = plgpu.kernel(
        functools.partial(_grouped_wgrad_kernel, config=config),
        out_type=jax.ShapeDtypeStruct((groups, k_out, width), out_dtype),
        grid=(groups, cdiv(kdim, tm), cdiv(n, tn)),
        grid_names=("g", "m", "n"),
        compiler_params=LANE_SEMANTICS,
    )
    out = kernel(*operands)
    return out if (k_out, width) == (kdim, n) else out[:, :kdim, :n]
