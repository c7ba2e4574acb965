"""Grouped (MoE) FP8 GEMMs for Hopper in Pallas Mosaic GPU, with DeepSeek-V3's FP32 promotion.

* `grouped_scaled_matmul`: the Fprop/Dgrad grouped GEMM, `jax.lax.ragged_dot` with tile-scaled
  (1x128) rows and one block-scaled (128x128) K-major weight per group.
  Reference: `jfp8.reference.grouped_scaled_matmul_reference`.
* `grouped_wgrad.grouped_wgrad` (its own module): the Wgrad, grouped along the contraction
  (token) axis: one (K, N) weight gradient per group from operands scaled per 128 tokens.
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
  loop, `branch_once_tiles` — one TMA warpgroup, two wgmma warpgroups on 64 rows each
  of a 128-row tile (or 128 rows each of a 256-row tile, in two 64-row waves through one
  accumulator: the rule's pick for groups of 256 rows or more), 4 SMEM stages allocated once
  per CTA — with a persistent grid in grouped tile order (`for_each_tile`). What is grouped is only the schedule:
  * Fprop/Dgrad walks the (work item, column tile) pairs of `row_tile_work`; an item runs the
    dense K loop with its group's weight (`b.at[g]`) and per-column weight scales (each 128x128
    block's scale repeated over its columns, chunk-major, as the dense kernel takes them), and
    each consumer stores only its rows inside the item's `[lo, hi)` with the power-of-two
    ladder of TMA stores. Pseudo-group items store zeros without a K loop.
  * Wgrad walks the (group, K tile, N tile) tiles with a dynamic K loop over the group's own
    token chunks; each consumer masks the other groups' tokens out of its rows of a shared
    chunk before its wgmma; an empty group's tiles store zeros.
  Issue 19's switches, each a `GroupedGemmConfig` field of the fast form and off until measured:
  `cluster_n=2` (column-tile pairs of one work item share its token rows by TMA multicast),
  `scalar_b_scale` (Fprop/Dgrad: a weight block's scale read as one scalar per K step) and
  `early_scale_loads`; and issue 45's `lean_release` (with `early_scale_loads`: the stage released
  right after the wgmma's wait, the proxy fence in the producer), off until racecheck is clean.
  Nothing here has been timed; what each form is predicted to change is in `docs/gpu.md`.

Both forms give the same bits: each output element gets the same chunk products promoted in the
same order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tuning
from pallas_kernels._hopper import (
    FP8_TRANSFORMS,
    LANE_SEMANTICS,
    SCALE_BOX,
    WS_CONSUMER_WGS,
    cdiv,
    check_fp8,
    check_out_dtype,
    check_scale,
    check_tma_slot,
    pad_rows,
    round_up,
    zeros,
)
from pallas_kernels._mainloop import (
    branch_once_tiles,
    chunk_product,
    cluster_shape,
    cluster_tiles,
    for_each_tile,
    launch_tiles,
)
from pallas_kernels.configs import GroupedGemmConfig, check_smem
from pallas_kernels.fp8_math import TILE
from pallas_kernels.schedule import check_group_sizes, row_tile_work

__all__ = ["GroupedGemmConfig", "grouped_scaled_matmul"]

def _store_rows(o_smem, o_gmem, row0, lo, hi, col) -> None:
    """TMA-store rows `[lo, hi)` of the SMEM tile whose first row is output row `row0`.

    A TMA box is static, so the dynamic row count is split into powers of two: one predicated
    copy per bit of `hi - lo` (the ladder of jax's `ragged_dot_mgpu`). The copies are left in
    flight: wait for them to have read `o_smem` before writing it again.

    The one-row copy is contiguous in GMEM, and Mosaic GPU lowers such a copy from unswizzled
    SMEM to a flat bulk copy clamped only at the array's end (`tests/tma_stores.py`): on Hopper
    its columns past the end of `o_gmem`'s row land in the next row. So `o_gmem` must hold every
    column tile whole (`_out_width`).
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
    o_gmem,  # [T, n padded to whole column tiles (`_out_width`)]
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
        partial = chunk_product(a_smem, b_smem, (tm, tn))
        sa = plgpu.load(sa_smem, layout=plgpu.Layout.WGMMA.reduce(1))  # [tm]
        s = sa * sb_gmem[weight, ni, c]
        return out + partial * jax.lax.broadcast_in_dim(s, (tm, tn), (0,))

    check_tma_slot("a's scales", (tm,), jnp.float32)
    pipeline = plgpu.emit_pipeline(
        promote,
        grid=(chunks,),
        in_specs=[
            plgpu.BlockSpec((tm, TILE), lambda c: (tile, c), transforms=FP8_TRANSFORMS),
            plgpu.BlockSpec((tn, TILE), lambda c: (ni, c), transforms=FP8_TRANSFORMS),
            plgpu.BlockSpec((None, tm), lambda c: (c, tile)),
        ],
        max_concurrent_steps=config.max_concurrent_steps,
        init_carry=zeros((tm, tn)),
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
    sb_gmem,  # [G, C, Np] f32: each weight block's scale repeated over its 128 columns, or with
    #           `scalar_b` [G, C, Np // 128 * SCALE_BOX]: each block's scale as one 128-byte box
    o_gmem,  # [T, n padded to whole (cluster) column tiles (`_out_width`)]
    *,
    config: GroupedGemmConfig,
    groups: int,
    n: int,
    scalar_b: bool,
):
    """Warp-specialized, optionally persistent `grouped_scaled_matmul`: the dense kernel's main
    loop (`branch_once_tiles`) over the (work item, column tile) pairs.

    A work item of group g < G is the dense tile (its row tile, ni) with g's weight and scales;
    each consumer then stores only its rows inside the item's `[lo, hi)`. Items of the
    pseudo-group G (rows past the groups) store zeros without a K loop; unused items do nothing.
    In clusters along N (`cluster_n`) both CTAs of a cluster take the same item, so they run the
    same branch and the same K loop, which their shared (multicast) loads of a require.
    """
    tm, tn = config.tile_m, config.tile_n
    wm = tm // WS_CONSUMER_WGS
    operands = (a_gmem, b_gmem.at[0], sa_gmem, sb_gmem.at[0])  # the shapes the stages are cut to
    tiles = (group_ref.shape[0], cdiv(n, tn))

    def item_tile(item, ni, wg, out_rows, k_tile, step):
        """Work item `item` with column tile `ni` on warpgroup `wg`: its K loop (`k_tile`) or,
        on a consumer (`out_rows` given), its zeros; returns the next pipeline step."""
        g, row_tile, lo, hi = group_ref[item], tile_ref[item], lo_ref[item], hi_ref[item]
        row0 = row_tile * tm + wg * wm  # this consumer's first row
        lo_w, hi_w = (jnp.clip(x, row0, row0 + wm) for x in (lo, hi))

        def epilogue(out, smem):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores
            smem[...] = out.astype(smem.dtype)
            plgpu.commit_smem()
            _store_rows(smem, o_gmem, row0, lo_w, hi_w, ni * tn)

        def k_loop(step):
            views = (a_gmem, b_gmem.at[g], sa_gmem, sb_gmem.at[g])
            return k_tile(row_tile, ni, views, epilogue, step)

        step = jax.lax.cond(g < groups, k_loop, lambda step: step, step)
        if out_rows is not None:  # None: the producer

            @pl.when((g == groups) & (hi > lo))
            def _():
                epilogue(zeros((wm, tn)), out_rows)

        return step

    def schedule(k_tile, wg, out_rows, step):  # each role walks the items on its own
        return for_each_tile(config, tiles, lambda item, ni, step: item_tile(item, ni, wg, out_rows, k_tile, step),
                             init_carry=step)

    branch_once_tiles(config, operands, o_gmem.dtype, schedule, scalar_b=scalar_b)

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
      config: tiling and form; when None, `tuning.grouped_config` picks one for this problem
        (a measured table, else the cost model's choice of tile and cluster).

    Returns:
      (T, n) in `out_dtype`, equal to `grouped_scaled_matmul_reference`; rows past
      `sum(group_sizes)` are zeros.
    """
    check_out_dtype(out_dtype)
    check_fp8(lhs_data, "lhs_data", 2)
    check_fp8(rhs_data, "rhs_data", 3)
    if config is None:
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
    if n < 1 or np_ != round_up(n, TILE):
        raise ValueError(
            f"n={n} must be >= 1, with rhs_data padded to {round_up(n, TILE)} rows; got {np_}"
        )
    chunks = kp // TILE
    check_scale(lhs_scale, "lhs_scale", (rows, chunks))
    check_scale(rhs_scale, "rhs_scale", (groups, np_ // TILE, chunks))
    group_sizes = jnp.asarray(group_sizes)
    check_group_sizes(group_sizes, rows, groups)
    if rows == 0 or groups == 0:
        return jnp.zeros((rows, n), out_dtype)
    if config.warp_specialized:
        check_smem(config, out_dtype, chunks)

    return _grouped_matmul_call(
        lhs_data, lhs_scale, rhs_data, rhs_scale, group_sizes,
        n=n, out_dtype=jnp.dtype(out_dtype), config=config,
    )

def _out_width(n: int, config: GroupedGemmConfig) -> int:
    """The kernels' output width: `n` padded to whole column tiles, and in clusters along N to
    whole cluster tiles (whose last CTA may lie wholly past `n`), so that every `_store_rows`
    copy stays inside its row (see there). Whole tiles are whole swizzle spans and 16-byte rows,
    as the TMA store needs; no padding at all where `n` is a multiple of them (every
    DeepSeek-V3 shape). The simple form's stores are flat copies on Hopper; the fast form's go
    through Mosaic's tensor map from the SMEM layout it picks, and are padded alike so as not to
    rely on that choice."""
    return round_up(n, config.tile_n * cluster_shape(config)[1])


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
    sa_t = jnp.pad(lhs_scale.T, ((0, 0), (0, round_up(rows, tm) - rows)))  # [C, Tpad]
    width = _out_width(n, config)
    out_type = jax.ShapeDtypeStruct((rows, width), out_dtype)
    if config.warp_specialized:
        scalar_b = config.scalar_b
        if scalar_b:  # each block's scale as one 128-byte box, chunk-major: [G, C, blocks * SCALE_BOX]
            sb = jnp.repeat(rhs_scale.transpose(0, 2, 1), SCALE_BOX, axis=2)
        else:
            # Each weight block's scale repeated over its 128 columns, chunk-major: [G, C, Np]. One
            # vector per K step and column tile, as the dense kernel loads (1/32 of the fp8 bytes).
            sb = jnp.repeat(rhs_scale, TILE, axis=1).transpose(0, 2, 1)
        grid = cluster_tiles(config, (work[0].shape[0], cdiv(n, config.tile_n)))
        kernel = launch_tiles(
            functools.partial(_ws_matmul_kernel, config=config, groups=groups, n=n, scalar_b=scalar_b),
            out_type, config, grid[0] * grid[1], num_sms,
        )
        out = kernel(*work, pad_rows(lhs_data), sa_t, rhs_data, sb)
    else:
        kernel = plgpu.kernel(
            functools.partial(
                _grouped_matmul_kernel, config=config, groups=groups, chunks=kp // TILE
            ),
            out_type=out_type,
            grid=(work[0].shape[0], np_ // TILE),
            grid_names=("item", "n"),
            compiler_params=LANE_SEMANTICS,
        )
        out = kernel(*work, pad_rows(lhs_data), sa_t, rhs_data, rhs_scale)
    return out if width == n else out[:, :n]
