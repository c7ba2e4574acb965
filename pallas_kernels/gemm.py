"""Tile-scaled E4M3 NT GEMM for Hopper (sm_90), written with Pallas Mosaic GPU.

Computes `out = a @ b.T` for FP8 operands that carry one FP32 scale per row (a) or per row block
(b) and per 128 contraction elements, with DeepSeek-V3's promotion (report §3.3, "Increasing
Accumulation Precision"): each 128-wide K chunk is multiplied by a fp8 `wgmma` into a *zeroed* FP32
accumulator, and the partial sum is then scaled and added to the running FP32 result in
registers:

    out = 0                                              # [tile_m, tile_n] f32, registers
    for c in range(Kp // 128):                           # in this order
        partial = wgmma(a[:, c], b[:, c].T)              # FP8 x FP8 -> f32, fresh accumulator
        out = out + partial * (sa[:, c, None] * sb[None, :, c])

which is exactly `jfp8.reference.scaled_matmul_reference`, operation for operation. Because the
K tile equals the scaling block (`TILE` = 128), every K step is one promotion. Bit-exactness is a
claim about the Mosaic GPU interpreter, whose wgmma is an exact matmul (the tests check it there):
on a Hopper GPU the tensor core sums each chunk's products in its own limited-precision
accumulator, the very reason for the promotion, and the outputs are held to
`jfp8.accumulation.hardware_error_bound` instead.

Launch structure, two forms selected by `GemmConfig`:

- `GemmConfig.simple()`, the correct-first form: one CTA of one warpgroup per 64 x 128 output
  tile. `plgpu.emit_pipeline` streams the K chunks of a, b and their scales GMEM -> SMEM with TMA
  (2 stages), and the same warpgroup waits for each chunk, runs the wgmma, waits for it and
  promotes.
- `GemmConfig()`, the fast form (the default): 128 x 128 tiles, 4 SMEM stages, warp-specialized
  (`_mainloop.branch_once_tiles`: warpgroup 2 only issues TMA, with 40 registers per thread;
  consumer warpgroups 0 and 1 each own 64 rows of the tile, with 232 registers; each role
  branches once and loops over all the CTA's tiles, meeting the other at the stages' mbarriers),
  and persistent (one CTA per SM looping over tiles in a grouped order, `plgpu.nd_loop` +
  `plgpu.planar_snake`). The stages are allocated once per CTA and reused by every tile, and the
  producer fills them across tile boundaries. The four changes are independent fields, so each
  can be measured alone.
- `GemmConfig(cluster_m=2)` (off by default until measured): the fast form in clusters of two
  CTAs along M that share each K step's b chunk, loaded half by each and TMA-multicast to both;
  `GemmConfig(cluster_n=2)`: along N, sharing a's chunk instead.
- `GemmConfig(scalar_b_scale=...)` (on by default where the tile allows, `GemmConfig.scalar_b`):
  for 128 x 128-block-scaled b, the tile's one block scale per K step is read as a scalar
  instead of a per-column vector; a 192- or 256-wide tile, which spans two weight blocks, is
  promoted in 64- or 128-column slices with one scalar each.
- `GemmConfig(tile_m=256, max_concurrent_steps=3)`: 256-row tiles (DeepGEMM's 256 x 128, the
  rule's pick at most large shapes with a bf16 output): each consumer promotes its 128 rows in
  two 64-row waves through one accumulator (`_mainloop._promote_waves`), which keeps a consumer
  within its registers (0 spills; one 128-row accumulator spilled).
- `GemmConfig(early_scale_loads=True)` (off by default until measured): a K step's scales are
  read from SMEM before its wgmma is issued rather than after its wait.
- `GemmConfig(early_scale_loads=True, lean_release=True)` (off by default until racecheck on a
  GPU is clean): each consumer hands a K step's stage back right after its wgmma's wait, before
  the promotion, with no proxy fence or warpgroup barrier of its own (DeepGEMM's loop); the
  producer fences before the refill instead.
- `GemmConfig(run_ahead=True)` (off by default): the same schedule through jax's
  `plgpu.emit_pipeline_warp_specialized`, one pipeline over all of a persistent CTA's (tile, K
  step) pairs with the tile's store in a `cond` inside the K loop; a bisect row for the default
  loop.

In both, the fp8 tiles are in the 128-byte swizzle that wgmma needs, b is stored K-major, `(N, K)`,
and handed to wgmma transposed (fp8 wgmma takes no other B layout), and each warpgroup casts its
rows in registers and TMA-stores them through a swizzled SMEM tile, leaving the store in flight
until that SMEM is needed again. The numerics do not depend on the config: every output element
gets the same chunk products promoted in the same order. Called without a config,
`scaled_matmul` runs the one `tuning.dense_config` picks for the problem: what
`benchmarks/tune_gemm.py` measured best on this GPU model, else the tile and 2-CTA cluster a
cost model predicts fastest (`tuning.rule_config`; at the DENSE_SHAPES DeepGEMM's own layouts:
256 x 128 tiles in clusters along N, 128 x 192 along M at 4096 x 2112 x 7168), one-warpgroup
forms on 64-row tiles for small M and where larger tiles would leave SMs idle.

What each form is predicted to change on a GPU, and what to look for there (SASS, ncu), is in
`docs/gpu.md`; nothing here has been timed.

Tails: TMA zero-fills loads past the inputs' edges (zero data and zero scales add exact zeros)
and drops stores past the output's edge, so partial tiles need no masking in the kernel. What
TMA cannot do is tile a GMEM array whose rows are not a multiple of 8 (or whose columns are not a
multiple of the swizzle width) for a swizzled copy: only then does the wrapper zero-pad (a, b
rows; output rows/columns, sliced afterwards), at the cost of one copy of that array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mgpu, tuning
from pallas_kernels._hopper import (
    OUT_DTYPES,
    SCALE_BOX,
    SWIZZLE_ROWS,
    TILE_K,
    TMA_ALIGN_BYTES,
    WS_CONSUMER_WGS,
    pad_axis,
    round_up,
    swizzled,
    tma_extent,
    zeros,
)
from pallas_kernels._mainloop import (
    cluster_tiles,
    for_each_tile,
    in_specs,
    launch_tiles,
    persistent_units,
    promote,
    branch_once_tiles,
    run_ahead_tiles,
    store_tile,
)
from pallas_kernels.configs import GemmConfig, block_pieces, check_smem, out_shape, smem_bytes
from pallas_kernels.fp8_math import FP8_DTYPE, TILE

__all__ = ["GemmConfig", "lower_scaled_matmul", "scaled_matmul", "smem_bytes", "split_scaled_matmul"]

_B_BLOCK_ROWS = (1, TILE)


def _simple_kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, out_smem, *, config, tiles, scalar_b):
    """One warpgroup per CTA: TMA and wgmma issued from the same warpgroup.

    Refs (C = Kp // TILE_K; primes mark the padded extents of `_kernel_operands`/`out_shape`):
      a_gmem [M', Kp] e4m3, b_gmem [Nb', Kp] e4m3 (K-major), sa_gmem [C, M''] f32, sb_gmem
      [C, N''] f32 (scales, K chunk-major), out_gmem [M_out, N_out], out_smem [tile_m, tile_n].
    """
    tm, tn = config.tile_m, config.tile_n

    def tile(mi, ni):
        out = plgpu.emit_pipeline(
            lambda _, a_smem, b_smem, sa_smem, sb_smem, out: promote(
                a_smem, b_smem, sa_smem, sb_smem, out, scalar_b=scalar_b,
                early_scales=config.early_scale_loads,
            ),
            grid=(a_gmem.shape[1] // TILE_K,),
            in_specs=in_specs(config, mi, ni, scalar_b=scalar_b),
            max_concurrent_steps=config.max_concurrent_steps,
            init_carry=zeros((tm, tn)),
        )(a_gmem, b_gmem, sa_gmem, sb_gmem)
        store_tile(out, out_smem, out_gmem.at[pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)])

    for_each_tile(config, tiles, tile)
    plgpu.wait_smem_to_gmem(0)

def _ws_kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, config, tiles, scalar_b, units):
    """Warp-specialized dense GEMM (`branch_once_tiles`) over the tiles of `for_each_tile`,
    or with `run_ahead` one pipeline over all of them (`run_ahead_tiles`; `units` CTAs or
    clusters launched). Refs as in `_simple_kernel`."""
    tm, tn = config.tile_m, config.tile_n
    wm = tm // WS_CONSUMER_WGS
    operands = (a_gmem, b_gmem, sa_gmem, sb_gmem)
    out_transforms = swizzled(out_gmem.dtype, tn)

    if config.run_ahead:
        def store(out, out_rows, mi, ni, wg):
            store_tile(out, out_rows, out_gmem.at[pl.ds(mi * tm + wg * wm, wm), pl.ds(ni * tn, tn)])

        run_ahead_tiles(config, operands, out_gmem.dtype, tiles, units, store,
                        out_transforms=out_transforms, scalar_b=scalar_b)
        return

    def schedule(k_tile, wg, _, step):
        def tile(mi, ni, step):
            def epilogue(out, out_rows):
                rows = out_gmem.at[pl.ds(mi * tm + wg * wm, wm), pl.ds(ni * tn, tn)]
                store_tile(out, out_rows, rows)

            return k_tile(mi, ni, operands, epilogue, step)

        return for_each_tile(config, tiles, tile, init_carry=step)

    branch_once_tiles(config, operands, out_gmem.dtype, schedule, out_transforms=out_transforms,
                      scalar_b=scalar_b)

def _check_inputs(a_data, a_scale, b_data, b_scale, n, b_block_rows, out_dtype) -> None:
    for name, x in (("a_data", a_data), ("b_data", b_data)):
        if x.ndim != 2 or x.dtype != FP8_DTYPE:
            raise TypeError(
                f"{name} must be a 2-D {jnp.dtype(FP8_DTYPE)} array, got {x.dtype}{list(x.shape)}"
            )
    for name, x in (("a_scale", a_scale), ("b_scale", b_scale)):
        if x.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    if b_block_rows not in _B_BLOCK_ROWS:
        raise ValueError(
            f"b_block_rows must be 1 (tile-scaled b) or {TILE} (block-scaled b), got {b_block_rows}"
        )
    m, kp = a_data.shape
    b_rows, b_kp = b_data.shape
    if kp % TILE_K:
        raise ValueError(f"Kp={kp} must be a multiple of {TILE_K}: zero-pad K to whole scale tiles")
    if b_kp != kp:
        raise ValueError(f"Kp differs: a_data is {a_data.shape} and b_data is {b_data.shape}")
    if not isinstance(n, int) or not 0 <= n <= b_rows:
        raise ValueError(f"n must be an int between 0 and the {b_rows} rows of b_data, got {n!r}")
    chunks = kp // TILE_K
    if a_scale.shape != (m, chunks):
        raise ValueError(
            f"a_scale must have shape (M, Kp // {TILE_K}) = {(m, chunks)}, got {a_scale.shape}"
        )
    b_scale_shape = (-(-b_rows // b_block_rows), chunks)
    if b_scale.shape != b_scale_shape:
        raise ValueError(
            f"b_scale must have shape (ceil(rows / b_block_rows), Kp // {TILE_K}) = {b_scale_shape}"
            f" for b_data {b_data.shape} and b_block_rows={b_block_rows}, got {b_scale.shape}"
        )

def _kernel_operands(a_data, a_scale, b_data, b_scale, n, b_block_rows, scalar_b=False, tile_n=TILE):
    """The layouts the kernel's TMA copies need.

    - Scales go K chunk-major, `[C, rows]`, so one K step's scales for a tile are one contiguous
      TMA box; b's are expanded to one scale per output column (a 128x128 block's scale repeated
      over its rows), which serves both pairings with one kernel. Both are small (1/32 of the
      fp8 data) and padded to 16-byte rows for TMA. With `scalar_b` (block-scaled b,
      `GemmConfig.scalar_b_scale`) b's are one per block instead, each repeated to a 128-byte
      box (one TMA slot, `SCALE_BOX`):
      `[C, blocks * SCALE_BOX]`; for `tile_n` wider than a block, one box per column tile,
      holding the scales of the blocks under its `block_pieces`: `[C, tiles * SCALE_BOX]`.
    - The fp8 operands' rows are zero-padded to a multiple of 8 for the swizzled TMA: this copies
      a (or b) only when it has more than 8 rows and their count is not a multiple of 8.
    """
    f32_align = TMA_ALIGN_BYTES // 4
    sa = pad_axis(a_scale.T, 1, round_up(a_scale.shape[0], f32_align))  # [C, M']
    if scalar_b and tile_n > TILE:
        width, _ = block_pieces(tile_n)
        starts = np.arange(pl.cdiv(n, tile_n))[:, None] * tile_n + np.arange(SCALE_BOX) * width
        blocks = np.minimum(starts // TILE, b_scale.shape[0] - 1)  # past the tile's pieces: unused
        sb = b_scale.T[:, blocks.reshape(-1)]  # [C, tiles * SCALE_BOX]
    elif scalar_b:
        sb = jnp.repeat(b_scale.T, SCALE_BOX, axis=1)  # [C, blocks * SCALE_BOX]
    else:
        sb = jnp.repeat(b_scale, b_block_rows, axis=0)[:n] if b_block_rows > 1 else b_scale[:n]
        sb = pad_axis(sb.T, 1, round_up(n, f32_align))  # [C, N']
    a_data = pad_axis(a_data, 0, tma_extent(a_data.shape[0], SWIZZLE_ROWS))
    b_data = pad_axis(b_data, 0, tma_extent(b_data.shape[0], SWIZZLE_ROWS))
    return a_data, b_data, sa, sb

def _gemm_call(
    out_shape: tuple[int, int],
    out_dtype,
    config: GemmConfig,
    tiles: tuple[int, int],
    num_sms: int | None = None,
    scalar_b: bool = False,
):
    """The Mosaic GPU kernel over `tiles = (row tiles, column tiles)` output tiles; `scalar_b`:
    b's scales are laid out per block (`_kernel_operands`)."""
    out_type = jax.ShapeDtypeStruct(out_shape, out_dtype)
    grid = cluster_tiles(config, tiles)
    kernel, scratch = functools.partial(_simple_kernel, config=config, tiles=tiles, scalar_b=scalar_b), {}
    if config.warp_specialized:
        units = persistent_units(config, grid[0] * grid[1], num_sms)
        kernel = functools.partial(_ws_kernel, config=config, tiles=tiles, scalar_b=scalar_b, units=units)
    else:
        transforms = swizzled(out_dtype, config.tile_n)
        scratch["out_smem"] = plgpu.SMEM((config.tile_m, config.tile_n), out_dtype, transforms=transforms)
    return launch_tiles(kernel, out_type, config, grid[0] * grid[1], num_sms, scratch_types=scratch)

def scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    n: int,
    b_block_rows: int,
    out_dtype=jnp.bfloat16,
    config: GemmConfig | None = None,
) -> jax.Array:
    """`a @ b[:n].T` with per-128-K-chunk FP32 promotion (DeepSeek-V3 §3.3), on Hopper.

    Args:
      a_data: (M, Kp) float8_e4m3fn, Kp a multiple of 128 (K zero-padded).
      a_scale: (M, Kp // 128) float32: the scale of row m in K chunk c.
      b_data: (Nb_rows, Kp) float8_e4m3fn, stored K-major; Nb_rows >= n (rows past n are ignored).
      b_scale: (ceil(Nb_rows / b_block_rows), Kp // 128) float32.
      n: the number of output columns (logical rows of b).
      b_block_rows: 128 for 128x128-block-scaled b (Fprop, Dgrad), 1 for 1x128-tile-scaled b
        (Wgrad: the b scale varies per output column).
      out_dtype: bfloat16 or float32.
      config: tiling; when None, `tuning.dense_config` picks one for this problem and GPU (a
        measured table where one covers it, else a rule).

    Returns:
      (M, n) array in `out_dtype`: `jfp8.reference.scaled_matmul_reference`, operation for
      operation, except for the order of the FP32 additions inside one 128-wide chunk product
      (the tensor core's, or the interpreter's matmul).
    """
    operands, kernel = split_scaled_matmul(a_data, a_scale, b_data, b_scale, n=n, b_block_rows=b_block_rows,
                                           out_dtype=out_dtype, config=config)
    return kernel(*operands)

def split_scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    n: int,
    b_block_rows: int,
    out_dtype=jnp.bfloat16,
    config: GemmConfig | None = None,
):
    """`scaled_matmul` cut where the wrapper ends: `(operands, kernel)` with `kernel(*operands)`
    equal to `scaled_matmul(...)` bit for bit (same arguments).

    `operands` are the arrays in the layouts the kernel's TMA reads (`_kernel_operands`: the
    scales K-chunk-major and 16-byte aligned, b's expanded or boxed, fp8 rows padded to 8); making
    them costs the XLA ops that issue 19's limiter 5 would have the quantizers do instead.
    `kernel` is the Mosaic GPU call plus, where the output was padded, the slice back to (M, n).
    The benchmark times `kernel` alone beside the whole `scaled_matmul`, which measures what
    those ops cost before anyone changes the quantizers' output layout for it.
    """
    _check_inputs(a_data, a_scale, b_data, b_scale, n, b_block_rows, out_dtype)
    out_dtype = jnp.dtype(out_dtype)
    m, kp = a_data.shape
    if m == 0 or n == 0 or kp == 0:
        return (), lambda: jnp.zeros((m, n), out_dtype)  # nothing to launch; K = 0 sums to zero
    if config is None:
        config = tuning.dense_config(m, n, kp, out_dtype, scalar_b=b_block_rows == TILE)
    scalar_b = config.scalar_b and b_block_rows == TILE
    check_smem(config, out_dtype, kp // TILE_K, scalar_b=scalar_b)
    operands = _kernel_operands(a_data, a_scale, b_data, b_scale, n, b_block_rows, scalar_b, config.tile_n)
    m_out, n_out = out_shape(m, n, out_dtype, config)
    tiles = (pl.cdiv(m, config.tile_m), pl.cdiv(n, config.tile_n))
    call = _gemm_call((m_out, n_out), out_dtype, config, tiles, scalar_b=scalar_b)

    def kernel(*laid_out: jax.Array) -> jax.Array:
        out = call(*laid_out)
        return out if (m_out, n_out) == (m, n) else out[:m, :n]

    return operands, kernel

def lower_scaled_matmul(
    m: int,
    n: int,
    k: int,
    *,
    b_block_rows: int,
    b_rows: int | None = None,
    out_dtype=jnp.bfloat16,
    config: GemmConfig | None = None,
) -> str:
    """StableHLO text of `scaled_matmul` lowered for CUDA at these shapes, without running it.

    The operands are laid out as jfp8 stores them: K zero-padded to whole 128-chunks, and b's rows
    (`b_rows`) padded to whole blocks of `b_block_rows` unless given. Lowering is where Mosaic GPU
    checks the Hopper limits (wgmma layouts, TMA boxes and strides, the SMEM budget).
    """
    b_rows = round_up(n, b_block_rows) if b_rows is None else b_rows
    kp = round_up(k, TILE_K)
    chunks = kp // TILE_K
    args = (
        jax.ShapeDtypeStruct((m, kp), FP8_DTYPE),
        jax.ShapeDtypeStruct((m, chunks), jnp.float32),
        jax.ShapeDtypeStruct((b_rows, kp), FP8_DTYPE),
        jax.ShapeDtypeStruct((-(-b_rows // b_block_rows), chunks), jnp.float32),
    )
    fn = functools.partial(
        scaled_matmul, n=n, b_block_rows=b_block_rows, out_dtype=out_dtype, config=config
    )
    return _mgpu.lower_for_cuda(fn, *args)
