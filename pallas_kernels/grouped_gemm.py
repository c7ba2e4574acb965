"""Grouped (MoE) FP8 GEMMs for Hopper in Pallas Mosaic GPU, with DeepSeek-V3's FP32 promotion.

* `grouped_scaled_matmul`: the Fprop/Dgrad grouped GEMM, `jax.lax.ragged_dot` with tile-scaled
  (1x128) rows and one block-scaled (128x128) K-major weight per group.
  Reference: `jfp8.reference.grouped_scaled_matmul_reference`.
* `grouped_wgrad`: the Wgrad, grouped along the contraction (token) axis: one (K, N) weight
  gradient per group from operands scaled per 128 tokens.
  Reference: `jfp8.reference.grouped_wgrad_reference`.

Both contract 128 elements at a time (DeepSeek-V3 §3.3, N_C = 128): per chunk, one wgmma into a
zeroed f32 accumulator, then `out = out + partial * (s_a[:, None] * s_b[None, :])` in registers,
chunk after chunk from the first: the reference's promotion, operation for operation. Only the
order in which a 128-term chunk product is summed can differ (the interpreter's matmul versus
XLA's dot), so in the interpreter the outputs are bit-identical whenever those sums are exact in
f32, and within a few f32 ulps of a chunk product otherwise. On a Hopper GPU the tensor core sums
a chunk in its own limited-precision accumulator: there the outputs are held to
`jfp8.accumulation.grouped_hardware_error_bound` / `grouped_wgrad_hardware_error_bound`.

Two forms, selected by the frozen `GroupedGemmConfig`:

- `GroupedGemmConfig.simple()`, the correct-first form: one CTA of one warpgroup per output tile
  (per work item and column tile for the row-grouped GEMM), a plain `emit_pipeline`, the
  weight-block scale read as one number per K step (Lane semantics, untiled output SMEM).
- `GroupedGemmConfig()`, the fast form (the default): the dense kernel's warp-specialized main
  loop, `gemm.warp_specialized_tiles` — one TMA warpgroup, two wgmma warpgroups on 64 rows each
  of a 128-row tile, 4 SMEM stages allocated once per CTA — with a persistent grid in grouped
  tile order (`gemm._for_each_tile`). What is grouped is only the schedule:
  * Fprop/Dgrad walks the (work item, column tile) pairs of `row_tile_work`; an item runs the
    dense K loop with its group's weight (`b.at[g]`) and per-column weight scales (each 128x128
    block's scale repeated over its columns, chunk-major, as the dense kernel takes them), and
    each consumer stores only its rows inside the item's `[lo, hi)` with the power-of-two
    ladder of TMA stores. Pseudo-group items store zeros without a K loop.
  * Wgrad walks the (group, K tile, N tile) tiles with a dynamic K loop over the group's own
    token chunks; each consumer masks the other groups' tokens out of its rows of a shared
    chunk before its wgmma; an empty group's tiles store zeros.
  Expected on a GPU for the same reasons as the dense kernel (see `gemm`'s docstring): the
  tensor cores busy while a consumer promotes, twice the rows per weight tile, no per-tile launch
  or pipeline fill, and a group's weight panels reused from L2 by the row tiles walked together.
  Nothing here has been timed; `experiments/bench_grouped.py --config ...` puts both forms side
  by side.

Both forms give the same bits: each output element gets the same chunk products promoted in the
same order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gemm
from pallas_kernels.fp8_math import FP8_DTYPE, TILE

_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Hopper wgmma: rows in multiples of 64 per warpgroup, at most 256 columns.
_WGMMA_M = 64
_WGMMA_MAX_N = 256
# Under lane semantics a TMA load must move a multiple of 128 bytes (one per thread of the
# warpgroup), so the per-column scale vector of a tile holds a multiple of 32 f32.
_N_STEP = 128 // jnp.dtype(jnp.float32).itemsize
# FP8 operands: a 128-element K chunk is exactly one 128-byte swizzle span, tiled in 8-row groups.
_SWIZZLE_BYTES = 128
_ROW_ALIGN = 8
_FP8_TRANSFORMS = (
    plgpu.TilingTransform((_ROW_ALIGN, _SWIZZLE_BYTES // jnp.dtype(FP8_DTYPE).itemsize)),
    plgpu.SwizzleTransform(_SWIZZLE_BYTES),
)
# TMA: every GMEM stride but the last must be a multiple of 16 bytes.
_TMA_STRIDE_BYTES = 16
# Lane semantics: explicit register layouts (WGMMA and its row/column reductions) and untiled
# SMEM for the output tile, which `_store_rows` slices at any row. (Under the default warpgroup
# semantics Mosaic tiles that buffer, and the output then needs whole 8-row tiles.)
_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiling and launch structure of the grouped kernels; the contraction tile is always `TILE`
    (the promotion step). The defaults are the fast form, `GroupedGemmConfig.simple()` the
    correct-first one (see the module docstring).

    Attributes:
      tile_m: output rows per CTA (token rows for `grouped_scaled_matmul`, K rows for
        `grouped_wgrad`). Simple form: a multiple of 64 up to 256 (one warpgroup holds the chunk
        accumulator and the running sum, 2 * tile_m * tile_n / 128 f32 registers a thread).
        Warp-specialized: a multiple of 128 up to 256, split between the consumer warpgroups.
      tile_n: output columns per CTA, at most 256. Simple form: a multiple of 32 (the tile's
        column-scale vector is TMA-loaded), and `grouped_scaled_matmul` needs `TILE` (one
        weight-block scale per tile). Warp-specialized: a multiple of 16 (the weight-block scales
        arrive expanded per column, as in the dense kernel).
      max_concurrent_steps: chunks in flight in the TMA pipeline (SMEM slots per operand).
      warp_specialized: one TMA warpgroup and two wgmma warpgroups per CTA
        (`gemm.warp_specialized_tiles`); otherwise one warpgroup per CTA does both.
      persistent: one CTA per SM walking its share of the (work item, column tile) pairs; needs
        `warp_specialized` (the simple kernels launch one CTA per tile).
      grid_tile_group: row tiles (work items) walked together along the tile order (L2 reuse of a
        group's weight and of the token rows); 1 walks them row by row.
    """

    tile_m: int = 128
    tile_n: int = TILE
    max_concurrent_steps: int = 4
    warp_specialized: bool = True
    persistent: bool = True
    grid_tile_group: int = 8

    def __post_init__(self):
        if self.warp_specialized:
            # The dense kernel's rules: the same main loop runs both.
            gemm.GemmConfig(self.tile_m, self.tile_n, self.max_concurrent_steps, True,
                            self.persistent, self.grid_tile_group)
            return
        if not 0 < self.tile_m <= _WGMMA_MAX_N or self.tile_m % _WGMMA_M:
            raise ValueError(f"tile_m={self.tile_m} must be a multiple of {_WGMMA_M} up to 256")
        if not 0 < self.tile_n <= _WGMMA_MAX_N or self.tile_n % _N_STEP:
            raise ValueError(f"tile_n={self.tile_n} must be a multiple of {_N_STEP} up to 256")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
        if self.persistent:
            raise ValueError("persistent=True needs warp_specialized=True (the simple grouped "
                             "kernels launch one CTA per tile)")

    @classmethod
    def simple(cls) -> GroupedGemmConfig:
        """The correct-first form: one warpgroup per CTA on a 64 x 128 tile, 2 stages, one CTA
        per tile (per work item and column tile for `grouped_scaled_matmul`)."""
        return cls(tile_m=64, tile_n=TILE, max_concurrent_steps=2, warp_specialized=False,
                   persistent=False, grid_tile_group=1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _store_width(n: int, out_dtype) -> int:
    """The output width the kernels write: `n` padded until a row is whole 16-byte units (TMA's
    stride rule); the caller slices back to `n` when they differ."""
    return _round_up(n, _TMA_STRIDE_BYTES // jnp.dtype(out_dtype).itemsize)


def _pad_rows(x: jax.Array) -> jax.Array:
    """`x` with zero rows appended up to a multiple of 8. Mosaic tiles the GMEM side of a TMA load
    like the swizzled SMEM tile, in whole 8-row tiles (a copy, only for odd row counts)."""
    rows = x.shape[0]
    if rows % _ROW_ALIGN == 0:
        return x
    return jnp.pad(x, ((0, _round_up(rows, _ROW_ALIGN) - rows), (0, 0)))


def _group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts, ends), each (G,) int32: the row range of every group in the sorted batch."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    return ends - sizes, ends


def _tiles_touched(starts: jax.Array, ends: jax.Array, tile: int) -> tuple[jax.Array, jax.Array]:
    """(first, count): the first tile of `tile` rows that each range touches, and how many it
    touches (0 for an empty range)."""
    first = starts // tile
    return first, jnp.where(ends > starts, (ends - 1) // tile - first + 1, 0)


def _chunk_product(a_smem, b_smem, shape: tuple[int, int]) -> jax.Array:
    """`a @ b.T` of one 128-wide chunk: FP8 wgmma into a fresh (zeroed) f32 accumulator.

    B is stored K-major (N, 128) and passed transposed: FP8 wgmma takes no other B layout. Reading
    the accumulator waits for the wgmma, so the pipeline may refill both SMEM slots afterwards.
    """

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.T)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _zero_acc(shape: tuple[int, int]) -> jax.Array:
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


# ------------------------------------------------------------------------------------------------
# Fprop / Dgrad: grouped along the output rows.
# ------------------------------------------------------------------------------------------------


def row_tile_work(group_sizes: jax.Array, rows: int, tile_m: int) -> tuple[jax.Array, ...]:
    """The (row tile, group) work items of the row-grouped GEMM, computed in XLA.

    A row tile that straddles group boundaries is visited once per group it holds, and every visit
    stores only that group's rows, so each output row is written exactly once, with its own
    group's weight. The rows past `sum(group_sizes)` form a pseudo-group `G` whose items store
    zeros without any matmul.

    Returns:
      `(group, tile, lo, hi)`, each `(cdiv(rows, tile_m) + G,)` int32 (a static bound on the
      number of items): item i stores rows `[lo, hi)` of row tile `tile` with the weight of
      `group`. Unused items have `group == G` and `lo == hi`.
    """
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    tail = jnp.maximum(rows - jnp.sum(sizes), 0)[None]
    starts, ends = _group_bounds(jnp.concatenate([sizes, tail]))  # [G + 1]
    first, count = _tiles_touched(starts, ends, tile_m)
    item_ends = jnp.cumsum(count)  # [G + 1]: items up to the end of each (pseudo-)group
    items = jnp.arange(_cdiv(rows, tile_m) + groups, dtype=jnp.int32)
    group = jnp.searchsorted(item_ends, items, side="right").astype(jnp.int32)
    used = group <= groups
    group = jnp.minimum(group, groups)
    tile = first[group] + items - (item_ends[group] - count[group])
    lo = jnp.maximum(starts[group], tile * tile_m)
    hi = jnp.minimum(ends[group], (tile + 1) * tile_m)
    zero = jnp.zeros_like(items)
    return group, jnp.where(used, tile, zero), jnp.where(used, lo, zero), jnp.where(used, hi, zero)


def _store_rows(o_smem, o_gmem, row0, lo, hi, col) -> None:
    """TMA-store rows `[lo, hi)` of the SMEM tile whose first row is output row `row0`.

    A TMA box is static, so the dynamic row count is split into powers of two: one predicated
    copy per bit of `hi - lo` (the ladder of jax's `ragged_dot_mgpu`). The copies are left in
    flight: wait for them to have read `o_smem` before writing it again.
    """
    rows, cols = o_smem.shape
    count, offset = hi - lo, lo - row0
    size = 1 << (rows.bit_length() - 1)
    while size:

        @pl.when((count & size) != 0)
        def _(size=size, offset=offset):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(offset, size)],
                o_gmem.at[pl.ds(row0 + offset, size), pl.ds(col, cols)],
            )

        offset = offset + (count & size)
        size //= 2


def _grouped_matmul_kernel(
    group_ref, tile_ref, lo_ref, hi_ref,  # [W] int32: the work items of `row_tile_work`
    a_gmem,  # [T (8-aligned), Kp] e4m3
    sa_gmem,  # [C, Tpad] f32: lhs scales, chunk-major
    b_gmem,  # [G, Np, Kp] e4m3
    sb_gmem,  # [G, Np // 128, C] f32
    o_gmem,  # [T, n padded to 16 bytes]
    *,
    config: GroupedGemmConfig,
    groups: int,
    chunks: int,
):
    tm, tn = config.tile_m, config.tile_n
    item, ni = jax.lax.axis_index("item"), jax.lax.axis_index("n")
    g, tile, lo, hi = group_ref[item], tile_ref[item], lo_ref[item], hi_ref[item]
    weight = jnp.minimum(g, groups - 1)  # the pseudo-group reads no weight

    def promote(idx, a_smem, b_smem, sa_smem, out):
        # K chunk c: `scaled_matmul_reference`'s `acc + partial * (sa[:, None] * sb[None, :])`.
        # The weight-block scale is one number for the tile's 128 columns, so sa * sb is a row
        # vector with the same bits as the reference's outer product.
        (c,) = idx
        partial = _chunk_product(a_smem, b_smem, (tm, tn))
        sa = plgpu.load(sa_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [tm]
        s = sa * sb_gmem[weight, ni, c]
        return out + partial * jax.lax.broadcast_in_dim(s, (tm, tn), (0,))

    pipeline = plgpu.emit_pipeline(
        promote,
        grid=(chunks,),
        in_specs=[
            plgpu.BlockSpec((tm, TILE), lambda c: (tile, c), transforms=_FP8_TRANSFORMS),
            plgpu.BlockSpec((tn, TILE), lambda c: (ni, c), transforms=_FP8_TRANSFORMS),
            plgpu.BlockSpec((None, tm), lambda c: (c, tile)),
        ],
        max_concurrent_steps=config.max_concurrent_steps,
        init_carry=_zero_acc((tm, tn)),
    )

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tm, tn), o_gmem.dtype))
    def _(o_smem):
        @pl.when(g < groups)
        def _():
            o_smem[...] = pipeline(a_gmem, b_gmem.at[weight], sa_gmem).astype(o_smem.dtype)

        @pl.when(g == groups)
        def _():
            o_smem[...] = jnp.zeros((tm, tn), o_smem.dtype)

        plgpu.commit_smem()
        _store_rows(o_smem, o_gmem, tile * tm, lo, hi, ni * tn)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ws_matmul_kernel(
    group_ref, tile_ref, lo_ref, hi_ref,  # [W] int32: the work items of `row_tile_work`
    a_gmem,  # [T (8-aligned), Kp] e4m3
    sa_gmem,  # [C, Tpad] f32: lhs scales, chunk-major
    b_gmem,  # [G, Np, Kp] e4m3
    sb_gmem,  # [G, C, Np] f32: each weight block's scale repeated over its 128 columns
    o_gmem,  # [T, n padded to the output tile's swizzle width (`gemm._out_shape`)]
    *,
    config: GroupedGemmConfig,
    groups: int,
    n: int,
):
    """Warp-specialized, optionally persistent `grouped_scaled_matmul`: the dense kernel's main
    loop (`gemm.warp_specialized_tiles`) over the (work item, column tile) pairs.

    A work item of group g < G is the dense tile (its row tile, ni) with g's weight and scales;
    each consumer then stores only its rows inside the item's `[lo, hi)`. Items of the
    pseudo-group G (rows past the groups) store zeros without a K loop; unused items do nothing.
    """
    tm, tn = config.tile_m, config.tile_n
    wm = tm // gemm.WS_CONSUMER_WGS
    operands = (a_gmem, b_gmem.at[0], sa_gmem, sb_gmem.at[0])  # the shapes the stages are cut to

    def schedule(run_tile, wg, out_rows):
        def tile(item, ni):
            g, row_tile, lo, hi = group_ref[item], tile_ref[item], lo_ref[item], hi_ref[item]
            row0 = row_tile * tm + wg * wm  # this consumer's first row
            lo_w, hi_w = (jnp.clip(x, row0, row0 + wm) for x in (lo, hi))

            def epilogue(out, smem):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores
                smem[...] = out.astype(smem.dtype)
                plgpu.commit_smem()
                _store_rows(smem, o_gmem, row0, lo_w, hi_w, ni * tn)

            @pl.when(g < groups)
            def _():
                views = (a_gmem, b_gmem.at[g], sa_gmem, sb_gmem.at[g])
                run_tile(row_tile, ni, views, epilogue)

            @pl.when((g == groups) & (hi > lo) & (wg < gemm.WS_CONSUMER_WGS))
            def _():
                epilogue(gemm._zeros((wm, tn)), out_rows)

        gemm._for_each_tile(config, (group_ref.shape[0], _cdiv(n, tn)), tile)

    gemm.warp_specialized_tiles(config, operands, o_gmem.dtype, schedule)


# ------------------------------------------------------------------------------------------------
# Wgrad: grouped along the contraction (token) axis.
# ------------------------------------------------------------------------------------------------


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
    o_gmem,  # [G, K, N padded to 16 bytes]
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

        partial = _chunk_product(a_smem, b_smem, (tm, tn))
        sa = plgpu.load(sa_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [tm]
        sb = plgpu.load(sb_smem, layout=plgpu.Layout.WGMMA.reduce(0))  # [tn]
        s = jax.lax.broadcast_in_dim(sa, (tm, tn), (0,)) * jax.lax.broadcast_in_dim(
            sb, (tm, tn), (1,)
        )
        return out + partial * s

    # A dynamic grid: the group's own chunks only, so no CTA reads the other groups' tokens.
    pipeline = plgpu.emit_pipeline(
        promote,
        grid=(count,),
        in_specs=[
            plgpu.BlockSpec((tm, TILE), lambda s: (mi, first + s), transforms=_FP8_TRANSFORMS),
            plgpu.BlockSpec((tn, TILE), lambda s: (ni, first + s), transforms=_FP8_TRANSFORMS),
            plgpu.BlockSpec((None, tm), lambda s: (first + s, mi)),
            plgpu.BlockSpec((None, tn), lambda s: (first + s, ni)),
        ],
        max_concurrent_steps=config.max_concurrent_steps,
        init_carry=_zero_acc((tm, tn)),
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
    o_gmem,  # [G, K', N'] (`gemm._out_shape` of each group's (K, N) gradient)
    *,
    config: GroupedGemmConfig,
    kdim: int,
    n: int,
):
    """Warp-specialized, optionally persistent `grouped_wgrad`: the dense tile x tile GEMM
    (`gemm.warp_specialized_tiles`) over the (group, K tile, N tile) tiles, each with a dynamic K
    loop over its group's own token chunks. Each consumer masks the other groups' tokens out of
    its rows of a shared chunk (the first and last), as `_grouped_wgrad_kernel` does."""
    tm, tn = config.tile_m, config.tile_n
    wm = tm // gemm.WS_CONSUMER_WGS
    m_tiles = _cdiv(kdim, tm)
    operands = (a_gmem, b_gmem, sa_gmem, sb_gmem)

    def schedule(run_tile, wg, out_rows):
        def tile(gm, ni):
            g, mi = gm // m_tiles, gm % m_tiles
            start, end, first, count = start_ref[g], end_ref[g], first_ref[g], count_ref[g]
            dst = o_gmem.at[g, pl.ds(mi * tm + wg * wm, wm), pl.ds(ni * tn, tn)]

            def epilogue(out, smem):
                gemm._store_tile(out, smem, dst)

            def before_chunk(step, a_rows):
                chunk_start = (first + step) * TILE

                @pl.when((step == 0) | (step == count - 1))
                def _():
                    _mask_tokens(a_rows, start - chunk_start, end - chunk_start)

            @pl.when(count > 0)
            def _():
                run_tile(mi, ni, operands, epilogue, k_first=first, k_steps=count,
                         before_chunk=before_chunk)

            @pl.when((count == 0) & (wg < gemm.WS_CONSUMER_WGS))
            def _():
                epilogue(gemm._zeros((wm, tn)), out_rows)  # an empty group's gradient

        gemm._for_each_tile(config, (start_ref.shape[0] * m_tiles, _cdiv(n, tn)), tile)

    out_transforms = gemm._swizzled(o_gmem.dtype, tn)
    gemm.warp_specialized_tiles(
        config, operands, o_gmem.dtype, schedule, out_transforms=out_transforms, dynamic_k=True
    )


# ------------------------------------------------------------------------------------------------
# Public entry points.
# ------------------------------------------------------------------------------------------------


def _check_out_dtype(out_dtype) -> None:
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")


def _check_fp8(x: jax.Array, name: str, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")
    if x.dtype != FP8_DTYPE:
        raise TypeError(f"{name} must be {jnp.dtype(FP8_DTYPE)}, got {x.dtype}")
    if x.shape[-1] % TILE:
        raise ValueError(
            f"{name} has {x.shape[-1]} contraction columns, not a multiple of {TILE}: "
            "pass the zero-padded data of jfp8.quantize"
        )


def _check_scale(s: jax.Array, name: str, shape: tuple[int, ...]) -> None:
    if s.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {s.shape}")
    if s.dtype != jnp.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")


def _check_group_sizes(group_sizes: jax.Array, rows: int, groups: int | None = None) -> None:
    if group_sizes.ndim != 1 or (groups is not None and group_sizes.shape[0] != groups):
        want = "(G,)" if groups is None else f"({groups},), one size per weight"
        raise ValueError(f"group_sizes must have shape {want}, got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers (int32), got {group_sizes.dtype}")
    if isinstance(group_sizes, jax.core.Tracer):
        return  # traced (under jit): the values cannot be checked here
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {sizes}")
    if sizes.sum() > rows:
        raise ValueError(f"group_sizes sum to {sizes.sum()}, more than the {rows} input rows")


def grouped_scaled_matmul(
    lhs_data: jax.Array,
    lhs_scale: jax.Array,
    rhs_data: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    n: int,
    out_dtype=jnp.bfloat16,
    config: GroupedGemmConfig | None = None,
) -> jax.Array:
    """Grouped FP8 GEMM mirroring `jax.lax.ragged_dot`: row t of group g is `lhs[t] @ rhs[g].T`.

    Args:
      lhs_data: (T, Kp) e4m3, rows sorted by group, Kp a multiple of 128.
      lhs_scale: (T, Kp // 128) f32: one scale per row and 128-wide K chunk (1x128 tiles).
      rhs_data: (G, Np, Kp) e4m3: one K-major weight per group, Np = n rounded up to 128.
      rhs_scale: (G, Np // 128, Kp // 128) f32: one scale per 128x128 weight block.
      group_sizes: (G,) int32, any sizes (zeros included) summing to at most T.
      n: the logical output width.
      out_dtype: bfloat16 or float32.
      config: tiling and form; when None, `tuning.grouped_config` picks one for this problem:
        `GroupedGemmConfig()` (warp-specialized, persistent) wherever its tiles fill the GPU.

    Returns:
      (T, n) in `out_dtype`, equal to `grouped_scaled_matmul_reference`; rows past
      `sum(group_sizes)` are zeros.
    """
    _check_out_dtype(out_dtype)
    _check_fp8(lhs_data, "lhs_data", 2)
    _check_fp8(rhs_data, "rhs_data", 3)
    if config is None:
        from pallas_kernels import tuning  # imports this module

        config = tuning.grouped_config(lhs_data.shape[0], n, lhs_data.shape[1], out_dtype,
                                       groups=rhs_data.shape[0])
    if not config.warp_specialized and config.tile_n != TILE:
        raise NotImplementedError(
            f"the simple grouped_scaled_matmul needs tile_n={TILE} (one weight-block scale per "
            f"output tile), got {config.tile_n}; the warp-specialized form takes any tile_n"
        )
    (rows, kp), (groups, np_, kp_rhs) = lhs_data.shape, rhs_data.shape
    if kp_rhs != kp:
        raise ValueError(
            f"contraction sizes differ: lhs_data {lhs_data.shape}, rhs_data {rhs_data.shape}"
        )
    if n < 1 or np_ != _round_up(n, TILE):
        raise ValueError(
            f"n={n} must be >= 1, with rhs_data padded to {_round_up(n, TILE)} rows; got {np_}"
        )
    chunks = kp // TILE
    _check_scale(lhs_scale, "lhs_scale", (rows, chunks))
    _check_scale(rhs_scale, "rhs_scale", (groups, np_ // TILE, chunks))
    group_sizes = jnp.asarray(group_sizes)
    _check_group_sizes(group_sizes, rows, groups)
    if rows == 0 or groups == 0:
        return jnp.zeros((rows, n), out_dtype)
    if config.warp_specialized:
        gemm._check_smem(config, out_dtype, chunks)

    return _grouped_matmul_call(
        lhs_data, lhs_scale, rhs_data, rhs_scale, group_sizes,
        n=n, out_dtype=jnp.dtype(out_dtype), config=config,
    )


@functools.partial(jax.jit, static_argnames=("n", "out_dtype", "config", "num_sms"))
def _grouped_matmul_call(
    lhs_data, lhs_scale, rhs_data, rhs_scale, group_sizes, *, n, out_dtype, config, num_sms=None
):
    """The launch of `grouped_scaled_matmul` on validated, non-empty operands (one XLA program
    with the work-item and layout preparation around the kernel)."""
    (rows, kp), (groups, np_, _) = lhs_data.shape, rhs_data.shape
    tm = config.tile_m
    work = row_tile_work(group_sizes, rows, tm)
    # Chunk-major lhs scales, padded to whole row tiles: each K step TMA-loads one contiguous
    # (tile_m,) vector, with a row stride that meets TMA's 16-byte rule.
    sa_t = jnp.pad(lhs_scale.T, ((0, 0), (0, _round_up(rows, tm) - rows)))  # [C, Tpad]
    if config.warp_specialized:
        # The row stores tile the output's columns like the SMEM tile (Mosaic's layout for it).
        width = gemm._out_shape(rows, n, out_dtype, config)[1]
        out_type = jax.ShapeDtypeStruct((rows, width), out_dtype)
        # Each weight block's scale repeated over its 128 columns, chunk-major: [G, C, Np]. One
        # vector per K step and column tile, as the dense kernel loads (1/32 of the fp8 bytes).
        sb_cols = jnp.repeat(rhs_scale, TILE, axis=1).transpose(0, 2, 1)
        num_tiles = work[0].shape[0] * _cdiv(n, config.tile_n)
        kernel = gemm.launch_tiles(
            functools.partial(_ws_matmul_kernel, config=config, groups=groups, n=n),
            out_type, config, num_tiles, num_sms,
        )
        out = kernel(*work, _pad_rows(lhs_data), sa_t, rhs_data, sb_cols)
    else:
        width = _store_width(n, out_dtype)
        kernel = plgpu.kernel(
            functools.partial(
                _grouped_matmul_kernel, config=config, groups=groups, chunks=kp // TILE
            ),
            out_type=jax.ShapeDtypeStruct((rows, width), out_dtype),
            grid=(work[0].shape[0], np_ // TILE),
            grid_names=("item", "n"),
            compiler_params=_COMPILER_PARAMS,
        )
        out = kernel(*work, _pad_rows(lhs_data), sa_t, rhs_data, rhs_scale)
    return out if width == n else out[:, :n]


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
    _check_out_dtype(out_dtype)
    _check_fp8(lhs_t_data, "lhs_t_data", 2)
    _check_fp8(rhs_t_data, "rhs_t_data", 2)
    (kdim, tp), (n, tp_rhs) = lhs_t_data.shape, rhs_t_data.shape
    if t < 0 or tp != _round_up(t, TILE) or tp_rhs != tp:
        raise ValueError(
            f"lhs_t_data {lhs_t_data.shape} and rhs_t_data {rhs_t_data.shape} must both have "
            f"{_round_up(t, TILE)} token columns for t={t}"
        )
    chunks = tp // TILE
    _check_scale(lhs_t_scale, "lhs_t_scale", (kdim, chunks))
    _check_scale(rhs_t_scale, "rhs_t_scale", (n, chunks))
    group_sizes = jnp.asarray(group_sizes)
    _check_group_sizes(group_sizes, t)
    groups = group_sizes.shape[0]
    if t == 0 or groups == 0 or kdim == 0 or n == 0:
        return jnp.zeros((groups, kdim, n), out_dtype)
    if config.warp_specialized:  # a dynamic K loop: the pipeline allocates every stage
        gemm._check_smem(config, out_dtype, max(chunks, config.max_concurrent_steps))

    return _grouped_wgrad_call(
        lhs_t_data, lhs_t_scale, rhs_t_data, rhs_t_scale, group_sizes,
        out_dtype=jnp.dtype(out_dtype), config=config,
    )


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "num_sms"))
def _grouped_wgrad_call(
    lhs_t_data, lhs_t_scale, rhs_t_data, rhs_t_scale, group_sizes, *, out_dtype, config,
    num_sms=None,
):
    """The launch of `grouped_wgrad` on validated, non-empty operands."""
    (kdim, _), (n, _), groups = lhs_t_data.shape, rhs_t_data.shape, group_sizes.shape[0]
    tm, tn = config.tile_m, config.tile_n
    starts, ends = _group_bounds(group_sizes)
    first, count = _tiles_touched(starts, ends, TILE)
    # Chunk-major scales, padded to whole output tiles: one contiguous vector per chunk.
    sa_t = jnp.pad(lhs_t_scale.T, ((0, 0), (0, _round_up(kdim, tm) - kdim)))  # [C, Kpad]
    sb_t = jnp.pad(rhs_t_scale.T, ((0, 0), (0, _round_up(n, tn) - n)))  # [C, Npad]
    operands = (starts, ends, first, count, _pad_rows(lhs_t_data), sa_t, _pad_rows(rhs_t_data), sb_t)
    if config.warp_specialized:
        k_out, n_out = gemm._out_shape(kdim, n, out_dtype, config)  # the swizzled store's extents
        num_tiles = groups * _cdiv(kdim, tm) * _cdiv(n, tn)
        kernel = gemm.launch_tiles(
            functools.partial(_ws_wgrad_kernel, config=config, kdim=kdim, n=n),
            jax.ShapeDtypeStruct((groups, k_out, n_out), out_dtype), config, num_tiles, num_sms,
        )
        out = kernel(*operands)
        return out if (k_out, n_out) == (kdim, n) else out[:, :kdim, :n]
    width = _store_width(n, out_dtype)
    kernel = plgpu.kernel(
        functools.partial(_grouped_wgrad_kernel, config=config),
        out_type=jax.ShapeDtypeStruct((groups, kdim, width), out_dtype),
        grid=(groups, _cdiv(kdim, tm), _cdiv(n, tn)),
        grid_names=("g", "m", "n"),
        compiler_params=_COMPILER_PARAMS,
    )
    out = kernel(*operands)
    return out if width == n else out[..., :n]
