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
K tile equals the scaling block (`TILE` = 128), every K step is one promotion.

Launch structure (the simple form; pipelining depth is a config knob, warp specialization and a
persistent grid are left for later): one CTA of one warpgroup per `(tile_m, tile_n)` output
tile. `plgpu.emit_pipeline` streams the K chunks of a, b and their scales GMEM -> SMEM with TMA
(`max_concurrent_steps` stages in flight), the fp8 tiles in the 128-byte swizzle that wgmma
needs. b is stored K-major, `(N, K)`, and handed to wgmma transposed (fp8 wgmma takes no other
B layout). The epilogue casts in registers and TMA-stores the tile through a swizzled SMEM tile.

Tails: TMA zero-fills loads past the inputs' edges (zero data and zero scales add exact zeros)
and drops stores past the output's edge, so partial tiles need no masking in the kernel. What
TMA cannot do is tile a GMEM array whose rows are not a multiple of 8 (or whose columns are not a
multiple of the swizzle width) for a swizzled copy: only then does the wrapper zero-pad (a, b
rows; output rows/columns, sliced afterwards), at the cost of one copy of that array.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _mgpu
from pallas_kernels.fp8_math import FP8_DTYPE, TILE

# The K tile of the kernel is the scaling block: one promotion per K step.
TILE_K = TILE
# Hopper TMA: every GMEM stride but the innermost must be a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16
# Swizzled SMEM tiles are 8 rows high, and TMA then tiles the GMEM array the same way: its rows
# must be a multiple of 8 and its columns a multiple of the swizzle width (the tails are padded).
SWIZZLE_ROWS = 8
# A warpgroup's wgmma covers 64 rows; one TMA box dimension spans at most 256 elements.
WGMMA_M = 64
MAX_TMA_BOX = 256
# The narrowest output tile whose bf16 rows can be swizzled (32 bytes).
MIN_TILE_N = 16
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_B_BLOCK_ROWS = (1, TILE)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling of the kernel.

    Attributes:
      tile_m: output rows per CTA, a multiple of 64 (one warpgroup's wgmma M). 64 keeps the two
        f32 register tiles of the promotion (`partial` and `out`, 64 registers/thread each at
        tile_n=128) well inside the register file.
      tile_n: output columns per CTA, a multiple of 16 and at most 256 (wgmma N, TMA box, and
        a swizzled bf16 output row).
      max_concurrent_steps: K steps whose TMA copies may be in flight at once (SMEM stages).
    """

    tile_m: int = 64
    tile_n: int = 128
    max_concurrent_steps: int = 2

    def __post_init__(self):
        if self.tile_m < WGMMA_M or self.tile_m % WGMMA_M or self.tile_m > MAX_TMA_BOX:
            raise ValueError(
                f"tile_m={self.tile_m} must be a multiple of {WGMMA_M} and at most {MAX_TMA_BOX}"
            )
        if self.tile_n < MIN_TILE_N or self.tile_n % MIN_TILE_N or self.tile_n > MAX_TMA_BOX:
            raise ValueError(
                f"tile_n={self.tile_n} must be a multiple of {MIN_TILE_N} and at most {MAX_TMA_BOX}"
            )
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _swizzle_elems(dtype, row_elems: int) -> int:
    """Elements per swizzled row segment: the largest swizzle (<= 128 B) that divides a row."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.find_swizzle(row_elems * itemsize * 8) // itemsize


def _swizzled(dtype, row_elems: int) -> tuple:
    """SMEM layout of a tile with rows of `row_elems`: 8-row tiles, the widest swizzle.

    The fp8 wgmma operands get the 128-byte swizzle (a row of TILE_K fp8 is 128 bytes); the
    output tile gets it too for tile_n * itemsize >= 128, for bank-conflict-free stores.
    """
    elems = _swizzle_elems(dtype, row_elems)
    return (
        plgpu.TilingTransform((SWIZZLE_ROWS, elems)),
        plgpu.SwizzleTransform(elems * jnp.dtype(dtype).itemsize),
    )


def _gemm_kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, out_smem, *, config: GemmConfig):
    """One `(tile_m, tile_n)` output tile.

    Refs (C = Kp // TILE_K; primes mark the padded extents of `_kernel_operands`/`_out_shape`):
      a_gmem [M', Kp] e4m3, b_gmem [Nb', Kp] e4m3 (K-major), sa_gmem [C, M''] f32, sb_gmem
      [C, N''] f32 (scales, K chunk-major), out_gmem [M_out, N_out], out_smem [tile_m, tile_n].
    """
    tm, tn = config.tile_m, config.tile_n
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    wgmma_layout = plgpu.Layout.WGMMA

    def promote(_, a_smem, b_smem, sa_smem, sb_smem, out):
        """One K chunk: fresh FP32 wgmma, then `out + partial * (sa * sb)` in registers."""

        def chunk_product(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))  # b is K-major: pass b.T
            plgpu.wgmma_wait(0)  # the promotion needs the finished partial sum
            return acc_ref[...]

        partial = pl.run_scoped(chunk_product, plgpu.ACC((tm, tn), jnp.float32))  # zeroed
        sa = plgpu.load(sa_smem, layout=wgmma_layout.reduce(1))  # [tm] per output row
        sb = plgpu.load(sb_smem, layout=wgmma_layout.reduce(0))  # [tn] per output column
        scale = lax.broadcast_in_dim(sa, (tm, tn), [0]) * lax.broadcast_in_dim(sb, (tm, tn), [1])
        return out + partial * scale

    fp8_tile = _swizzled(FP8_DTYPE, TILE_K)
    out0 = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), wgmma_layout)
    out = plgpu.emit_pipeline(
        promote,
        grid=(a_gmem.shape[1] // TILE_K,),
        in_specs=[
            plgpu.BlockSpec((tm, TILE_K), lambda k: (mi, k), transforms=fp8_tile),
            plgpu.BlockSpec((tn, TILE_K), lambda k: (ni, k), transforms=fp8_tile),
            plgpu.BlockSpec((None, tm), lambda k: (k, mi)),
            plgpu.BlockSpec((None, tn), lambda k: (k, ni)),
        ],
        max_concurrent_steps=config.max_concurrent_steps,
        init_carry=out0,
    )(a_gmem, b_gmem, sa_gmem, sb_gmem)

    # Epilogue: registers -> swizzled SMEM -> TMA store, which drops rows/columns past the edge.
    out_smem[...] = out.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)])
    plgpu.wait_smem_to_gmem(0)


def _check_inputs(a_data, a_scale, b_data, b_scale, n, b_block_rows, out_dtype) -> None:
    for name, x in (("a_data", a_data), ("b_data", b_data)):
        if x.ndim != 2 or x.dtype != FP8_DTYPE:
            raise TypeError(
                f"{name} must be a 2-D {jnp.dtype(FP8_DTYPE)} array, got {x.dtype}{list(x.shape)}"
            )
    for name, x in (("a_scale", a_scale), ("b_scale", b_scale)):
        if x.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
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


def _tma_extent(size: int, tile: int, align: int = 1) -> int:
    """The smallest extent >= size that a swizzled TMA copy can tile: a multiple of `tile`, or,
    for a dimension within one tile, a multiple of `align` (16-byte rows for a minor dimension)."""
    return _round_up(size, align) if size <= tile else _round_up(size, tile)


def _pad_axis(x: jax.Array, axis: int, extent: int) -> jax.Array:
    """Zero-pads `x` along `axis` to `extent` (no copy when it is already that long)."""
    pad = extent - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _kernel_operands(a_data, a_scale, b_data, b_scale, n, b_block_rows):
    """The layouts the kernel's TMA copies need.

    - Scales go K chunk-major, `[C, rows]`, so one K step's scales for a tile are one contiguous
      TMA box; b's are expanded to one scale per output column (a 128x128 block's scale repeated
      over its rows), which serves both pairings with one kernel. Both are small (1/32 of the
      fp8 data) and padded to 16-byte rows for TMA.
    - The fp8 operands' rows are zero-padded to a multiple of 8 for the swizzled TMA: this copies
      a (or b) only when it has more than 8 rows and their count is not a multiple of 8.
    """
    f32_align = TMA_ALIGN_BYTES // 4
    sa = _pad_axis(a_scale.T, 1, _round_up(a_scale.shape[0], f32_align))  # [C, M']
    sb = jnp.repeat(b_scale, b_block_rows, axis=0)[:n] if b_block_rows > 1 else b_scale[:n]
    sb = _pad_axis(sb.T, 1, _round_up(n, f32_align))  # [C, N']
    a_data = _pad_axis(a_data, 0, _tma_extent(a_data.shape[0], SWIZZLE_ROWS))
    b_data = _pad_axis(b_data, 0, _tma_extent(b_data.shape[0], SWIZZLE_ROWS))
    return a_data, b_data, sa, sb


def _out_shape(m: int, n: int, out_dtype, config: GemmConfig) -> tuple[int, int]:
    """The kernel's output array: (M, n), padded only where the swizzled TMA store cannot tile it.

    Rows go to a multiple of 8 and columns to a multiple of the swizzle width (64 bf16 or 32 f32
    at tile_n=128); a dimension within one swizzle tile only needs 16-byte rows. When padded, the
    result is sliced afterwards (one extra pass over the output; none for aligned shapes).
    """
    cols = _swizzle_elems(out_dtype, config.tile_n)
    align = TMA_ALIGN_BYTES // jnp.dtype(out_dtype).itemsize
    return _tma_extent(m, SWIZZLE_ROWS), _tma_extent(n, cols, align)


def _gemm_call(out_shape: tuple[int, int], out_dtype, config: GemmConfig, grid: tuple[int, int]):
    """The Mosaic GPU kernel: one CTA (one warpgroup) per output tile of the `(m, n)` grid."""
    out_tile = plgpu.SMEM(
        (config.tile_m, config.tile_n), out_dtype, transforms=_swizzled(out_dtype, config.tile_n)
    )
    return plgpu.kernel(
        functools.partial(_gemm_kernel, config=config),
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=grid,
        grid_names=("m", "n"),
        scratch_types=dict(out_smem=out_tile),
    )


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
      config: tiling; `GemmConfig()` when None.

    Returns:
      (M, n) array in `out_dtype`: `jfp8.reference.scaled_matmul_reference`, operation for
      operation, except for the order of the FP32 additions inside one 128-wide chunk product
      (the tensor core's, or the interpreter's matmul).
    """
    _check_inputs(a_data, a_scale, b_data, b_scale, n, b_block_rows, out_dtype)
    config = GemmConfig() if config is None else config
    out_dtype = jnp.dtype(out_dtype)
    m, kp = a_data.shape
    if m == 0 or n == 0 or kp == 0:
        return jnp.zeros((m, n), out_dtype)  # nothing to launch; K = 0 sums to zero
    operands = _kernel_operands(a_data, a_scale, b_data, b_scale, n, b_block_rows)
    m_out, n_out = _out_shape(m, n, out_dtype, config)
    grid = (pl.cdiv(m, config.tile_m), pl.cdiv(n, config.tile_n))
    out = _gemm_call((m_out, n_out), out_dtype, config, grid)(*operands)
    return out if (m_out, n_out) == (m, n) else out[:m, :n]


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
    b_rows = _round_up(n, b_block_rows) if b_rows is None else b_rows
    kp = _round_up(k, TILE_K)
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
