"""Fused FP8 (E4M3) quantization kernels for Hopper, in Pallas Mosaic GPU.

Each kernel reads its input once and writes E4M3 data plus one FP32 scale per block, bit-identical
to `jfp8.quantize` (DeepSeek-V3 §3.3, "Fine-Grained Quantization") because both call the same
elementwise rules of `fp8_math` (`abs_for_amax`, `scale_from_amax`, `encode_scaled`), and the
kernels take a scale's reciprocal as `_mgpu.ieee_reciprocal`, the correctly rounded
`fp8_math.reciprocal` (a plain `1 / x` compiles to an approximate reciprocal in Mosaic GPU).
Raw arrays in, raw arrays out; `jfp8` wraps them in `Fp8Tensor`s.

  quantize_tile            (1, 128) tiles along the last axis: activations.
  quantize_block           (128, 128) blocks: weights.
  quantize_block_and_transpose
                           the same, also writing the E4M3 blocks transposed (Fprop and Dgrad
                           use a weight in both orientations), from one read of the input.
  quantize_column          (128, 1) tiles (128 rows per scale): the Wgrad operand, optionally
                           written transposed, the layout the Wgrad GEMM consumes.
  quantize_tile_and_column_t
                           an output gradient's two forms, (1, 128) tiles (Dgrad) and
                           transposed (128, 1) tiles (Wgrad), from one read of it.
  quantize_tile_and_retile_t
                           an activation's two forms, (1, 128) tiles (Fprop) and their re-tiling
                           for Wgrad (as `retile_tile_to_column_t`), from one read of it.
  retile_tile_to_column_t  the backward-pass re-tiling (§3.5.2): dequantize a (1, 128)-tiled
                           tensor, transpose it and requantize it as (128, 1) tiles, in one pass.

Structure: grids of one-warpgroup CTAs (one CTA per tile of the output, no persistent schedule).
- Row-scale kernels (`quantize_tile`, transposed `quantize_column`, `retile_tile_to_column_t`):
  grid (cdiv(R, rows), cdiv(C, chunks)) over R output rows and C output chunks of 128 columns; a
  CTA owns `rows` x `chunks` chunks (64 x 4 by default) and stores their scales with one TMA copy.
  The transposing ones quantize in the stored orientation (amax down columns) and transpose the
  E4M3 result through SMEM.
- Column kernels (`quantize_block`, `quantize_column`): grid (Mp / 128, cdiv(K, 128 *
  column_chunks)); a CTA owns 128 rows x `column_chunks` chunks of 128 columns and reduces each
  chunk over its rows (across the four warps). `quantize_block_and_transpose` also writes each
  block transposed; `quantize_tile_and_column_t` reduces each chunk both along its rows and down
  its columns and writes both quantizations, the column one transposed. Both transpose E4M3
  through SMEM as f16, as the row-scale kernels do.
By default a CTA issues all its TMA loads at once (one barrier per chunk, so later chunks stream
in while earlier ones are computed); with `QuantizeConfig.stages` its chunks go through a ring of
that many SMEM slots instead, each refilled as soon as its chunk is done (`_chunk_loop`). Each
chunk is quantized in registers (WGMMA layout), staged as E4M3 in SMEM and TMA-stored. Memory
speed needs the SMEM <-> register transfers free of bank conflicts: by default
(`QuantizeConfig.swizzle`) every staged tile is kept in 8-row tiles with the widest swizzle, as
the GEMMs keep theirs, where TMA can tile the arrays (rows a multiple of 8, widths a multiple of
the swizzle span: every DeepSeek-V3 shape); elsewhere the kernels stage unswizzled boxes, with
8-way conflicts (`QuantizeConfig.simple()` always does; speeds: `docs/gpu.md`, not measured yet).
TMA also does the tails: loads past the end of the input are zero-filled, exactly
`jfp8.quantize`'s zero padding, and stores past the end of an output are dropped. The wrappers
pad or slice only where TMA's 16-byte stride rule forces it (see `_tma_aligned` and the scale
slices), or where a store must not rely on that clipping (below).

A store may run past an output's end only along its outermost axis. Mosaic GPU lowers a store
whose GMEM window is contiguous (a [1, 128] row of scales; a [rows, 128] window of an array 128
wide) with unswizzled SMEM to a flat bulk copy clamped only at the end of the whole array, so the
part of such a window past the end of an inner axis lands in the next rows on Hopper (an H100
showed it: `quantize_tile_and_column_t` at 256 x 384; the interpreter clips every store per
axis and cannot). Hence a CTA skips its chunks past the last one (`_chunk_loop`: no load, no
compute, no store), and arrays of [1, 128] scale rows are padded to whole chunks and sliced.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_math import (
    AMAX_FLOOR,
    FP8_DTYPE,
    TILE,
    abs_for_amax,
    encode_scaled,
    scale_from_amax,
)
from pallas_kernels._hopper import SWIZZLE_ROWS, swizzle_elems
from pallas_kernels._mgpu import ieee_reciprocal
from pallas_kernels._hopper import swizzled as swizzled_layout

# TMA: every GMEM stride but the innermost, and the innermost extent of a copy, must be a multiple
# of 16 bytes.
_TMA_ALIGN_BYTES = 16
# f32 scales per 16 bytes: a TMA copy of scales spans a multiple of this along their last axis.
_SCALE_GROUP = _TMA_ALIGN_BYTES // 4
# Rows of a WGMMA-layout register array come in multiples of a warpgroup's 64.
_WG_ROWS = 64
# The column kernels reduce a [128, 128] chunk as two [128, 64] halves (64 f32 values per thread).
_HALF = TILE // 2
_INPUT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_WGMMA = plgpu.Layout.WGMMA
_WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)  # [rows] of a WGMMA-layout [rows, cols] array
_ZEROS = plgpu.OOBFillMode.ZEROS
# Lane semantics: layouts are explicit (WGMMA and its reductions); the default warpgroup semantics
# failed to infer layouts for these reductions and broadcasts.
_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Tiling of the quantization kernels (a CTA is one warpgroup).

    Not every combination fits the 227 KiB of SMEM for every input dtype (e.g. rows=128 fits
    `quantize_tile` on 16-bit input and `retile_tile_to_column_t`, not f32 input nor the
    transposed `quantize_column`); lowering raises a clear error when one does not.

    Attributes:
      rows: output rows per CTA in the kernels with one scale per output row and 128-wide chunk
        (`quantize_tile`, transposed `quantize_column`, `retile_tile_to_column_t`); 64 or 128.
      chunks: 128-wide chunks per CTA in those kernels; a multiple of 4 so that a CTA's f32 scales
        span whole 16-byte TMA units.
      column_chunks: [128, 128] chunks per CTA in the kernels whose CTA owns 128 rows
        (`quantize_block`, `quantize_block_and_transpose`, `quantize_column`,
        `quantize_tile_and_column_t`: 80 to 96 KiB of SMEM each for f32 input, unless `stages`
        bounds them).
      stages: SMEM slots for a CTA's input chunks (and for its E4M3 output chunks). None: one
        per chunk, every load issued at once. Fewer than the CTA's chunks: a ring, each slot
        refilled by TMA as soon as its chunk is quantized and stored, so a CTA can own many
        chunks (e.g. chunks=16, stages=4: a 64 x 2048 strip through 4 slots) without the SMEM
        for all of them: fewer, longer-lived CTAs, with `stages - 1` loads in flight while one
        chunk is computed (stages=1 alternates loading and computing). Which is faster is for a
        GPU to say (not measured). f32 input fits at most 2 slots in the column kernels.
      swizzle: stage tiles in SMEM in 8-row tiles with the widest swizzle (128 bytes for 16- and
        32-bit input) and move them between SMEM and registers bank-conflict free. Unswizzled,
        the WGMMA-layout transfers hit one bank group with all 8 rows a warp touches (rows of
        128 elements are 256 or 512 bytes apart): 8-way conflicts, which by arithmetic cap
        `quantize_tile` near HBM speed on an H100 (not measured). Applies where TMA can tile the
        arrays (`_swizzle_fits`: row counts a multiple of 8, row widths a multiple of the
        swizzle span); other shapes run unswizzled. The numerics are the same either way.
    """

    rows: int = 64
    chunks: int = 4
    column_chunks: int = 2
    swizzle: bool = True
    stages: int | None = None

    def __post_init__(self):
        if self.rows not in (_WG_ROWS, TILE):
            raise ValueError(f"rows must be {_WG_ROWS} or {TILE}, got {self.rows}")
        if self.chunks < 1 or self.chunks % _SCALE_GROUP:
            raise ValueError(
                f"chunks must be a positive multiple of {_SCALE_GROUP}, got {self.chunks}"
            )
        if self.column_chunks < 1:
            raise ValueError(f"column_chunks must be positive, got {self.column_chunks}")
        if self.stages is not None and self.stages < 1:
            raise ValueError(f"stages must be None or positive, got {self.stages}")

    def slots(self, chunks: int) -> int:
        """SMEM slots for a CTA that owns `chunks` chunks."""
        return chunks if self.stages is None else min(self.stages, chunks)

    @classmethod
    def simple(cls) -> QuantizeConfig:
        """The correct-first form: unswizzled SMEM tiles (8-way bank conflicts; see `swizzle`)."""
        return cls(swizzle=False)


def _smem(shape: tuple[int, ...], dtype, swizzled: bool):
    """An SMEM scratch buffer; with `swizzled`, in 8-row tiles with the widest swizzle that
    divides its rows (`_hopper.swizzled`: 128 bytes for a row of 128 bf16, 64 bytes for 64 fp8)."""
    transforms = swizzled_layout(dtype, shape[-1]) if swizzled else ()
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _swizzle_fits(x: jax.Array, box_cols: int) -> bool:
    """Whether TMA can copy `box_cols`-wide boxes of 2-D `x` into swizzled tiles: Mosaic views the
    GMEM array in whole tiles, so its rows must be a multiple of 8 and its columns of the span."""
    return x.shape[0] % SWIZZLE_ROWS == 0 and x.shape[1] % swizzle_elems(x.dtype, box_cols) == 0


def _load_f32(ref, swizzled: bool) -> jax.Array:
    # A swizzled SMEM tile has a bank-conflict-free transfer plan, which `optimized=True` demands
    # (lowering fails without one); an unswizzled one (TMA boxes of any width) has none.
    return plgpu.load(ref, layout=_WGMMA, optimized=swizzled).astype(jnp.float32)


def _chunk_loop(chunks: int, slots: int, bars, fetch, quantize_chunk, *,
                stores_per_chunk: int, valid) -> None:
    """A CTA's loop over its `chunks` chunks through `slots` SMEM slots (chunk c in slot c % slots).

    Only the first `valid` (dynamic) chunks exist: those past the end of the array are not
    loaded, quantized nor stored (see the module doc: a store past an inner axis's end is not
    dropped on Hopper when Mosaic lowers it as a flat copy). They are the last ones of the CTA,
    so the ring below sees exactly the chunks it would see in an array that ended there.

    `fetch(c, slot)` issues chunk c's TMA loads on barrier `bars.at[slot]`; `quantize_chunk(c, slot)`
    quantizes the loaded chunk and issues its TMA stores (`stores_per_chunk` bulk groups, from
    the output slot `slot`). With a slot per chunk every load is issued up front. With fewer, a
    slot is refilled once its chunk is done: every read of the input slot precedes the chunk's
    `commit_smem` (a warpgroup barrier orders all threads' reads before it, its proxy fence
    orders them before the refill's TMA write), and before an output slot is rewritten the TMA
    stores issued from it `slots` chunks earlier must have read it.
    """
    @pl.loop(0, slots)
    def _(c):
        @pl.when(c < valid)
        def _():
            fetch(c, c)

    @pl.loop(0, chunks)
    def _(c):
        @pl.when(c < valid)
        def _():
            slot = c % slots
            plgpu.barrier_wait(bars.at[slot])
            if slots < chunks:
                plgpu.wait_smem_to_gmem(stores_per_chunk * (slots - 1), wait_read_only=True)
            quantize_chunk(c, slot)
            if slots < chunks:
                @pl.when(c + slots < valid)
                def _():
                    fetch(c + slots, slot)


def _valid_chunks(total: int, chunks: int):
    """How many of the `chunks` chunks of CTA column `j` (grid axis "chunks") lie in an array of
    `total` chunks: `chunks`, except in the last CTA column of a partial grid."""
    return jnp.minimum(chunks, total - jax.lax.axis_index("chunks") * chunks)


# ---------------------------------------------------------------------------------------------
# Kernels with one scale per output row and 128-wide chunk: tile, transposed column, retile.


def _rows_chunk(x_ref, *, pow2_scale: bool, amax_floor: float, swizzled: bool):
    """x_ref [rows, 128] → E4M3 [rows, 128] and scales [rows] (amax along the row)."""
    rows = x_ref.shape[0]
    x = _load_f32(x_ref, swizzled)
    scale = scale_from_amax(jnp.max(abs_for_amax(x), axis=1), pow2_scale, amax_floor)
    q = encode_scaled(x, jax.lax.broadcast_in_dim(ieee_reciprocal(scale), (rows, TILE), (0,)))
    return q, scale


def _transposed_chunk(x_ref, xs_ref, bounce_refs, *, pow2_scale: bool, amax_floor: float, swizzled: bool):
    """x_ref [128, rows] → E4M3 of its transpose [rows, 128], scales [rows] (amax down columns).

    Quantizes in the stored orientation (reduction over rows, across warps), then transposes the
    E4M3 result through SMEM as f16 (exact for every E4M3 value): Hopper transposes 16-bit tiles
    with ldmatrix.trans, but has no transposed 8- or 32-bit SMEM transfer. `bounce_refs` are the
    SMEM buffers for that: f16 [128, rows] and f32 [rows]. With `xs_ref` [128] (the
    input's (1, 128) scales of these 128 rows) the input is E4M3 and is dequantized first, exactly
    as `Fp8Tensor.dequantize`: data.astype(f32) * scale.
    """
    rows = x_ref.shape[1]
    x = _load_f32(x_ref, swizzled)  # [128, rows]
    if xs_ref is not None:
        s_in = plgpu.load(xs_ref, layout=_WGMMA_ROW, optimized=False)
        x = x * jax.lax.broadcast_in_dim(s_in, (TILE, rows), (0,))
    scale = scale_from_amax(jnp.max(abs_for_amax(x), axis=0), pow2_scale, amax_floor)  # [rows]
    q = encode_scaled(x, jax.lax.broadcast_in_dim(ieee_reciprocal(scale), (TILE, rows), (1,)))
    q_ref, scale_ref = bounce_refs
    q_ref[...] = q.astype(jnp.float16)
    q_t = plgpu.load(q_ref.T, layout=_WGMMA, optimized=swizzled).astype(FP8_DTYPE)
    # The scales come out of the reduction in the column layout (pairs of values per thread),
    # which cannot be stored into a strided SMEM column; a contiguous round trip turns them into
    # the row layout of `_rows_chunk`.
    scale_ref[...] = scale
    return q_t, plgpu.load(scale_ref, layout=_WGMMA_ROW, optimized=False)


def _row_scale_body(*refs, cfg: QuantizeConfig, transposed: bool, dequant: bool, pow2_scale: bool, amax_floor: float,
                    swizzled: bool):
    """One CTA: output rows [rows i, rows (i + 1)) x `chunks` 128-wide output chunks.

    Output element (r, c) is input element (r, c), or (c, r) when `transposed`. Outputs: data
    [R, chunks_total * 128] and scales [R, >= chunks_total], one per output row and chunk.
    """
    if dequant:
        x_gmem, xs_gmem, d_gmem, s_gmem, x_smem, xs_smem, *bounce, d_smem, s_smem, bars = refs
    elif transposed:
        x_gmem, d_gmem, s_gmem, x_smem, *bounce, d_smem, s_smem, bars = refs
    else:
        x_gmem, d_gmem, s_gmem, x_smem, d_smem, s_smem, bars = refs
    rows, chunks = cfg.rows, cfg.chunks
    i, j = jax.lax.axis_index("rows"), jax.lax.axis_index("chunks")
    out_rows = pl.ds(i * rows, rows)

    def chunk(c):
        return pl.ds((j * chunks + c) * TILE, TILE)

    # dequant: the input's (1, 128) scale column covering input columns `out_rows`, fetched as
    # part of a 16-byte group of scale columns.
    in_chunk = i * rows // TILE
    group = pl.ds(in_chunk // _SCALE_GROUP * _SCALE_GROUP, _SCALE_GROUP)

    def fetch(c, slot):
        src = x_gmem.at[chunk(c), out_rows] if transposed else x_gmem.at[out_rows, chunk(c)]
        plgpu.copy_gmem_to_smem(src, x_smem.at[slot], bars.at[slot], oob_mode=_ZEROS)
        if dequant:
            plgpu.copy_gmem_to_smem(
                xs_gmem.at[chunk(c), group], xs_smem.at[slot], bars.at[slot], oob_mode=_ZEROS
            )

    def quantize_chunk(c, slot):
        if transposed:
            xs = xs_smem.at[slot, :, in_chunk % _SCALE_GROUP] if dequant else None
            q, scale = _transposed_chunk(
                x_smem.at[slot], xs, bounce, pow2_scale=pow2_scale, amax_floor=amax_floor, swizzled=swizzled
            )
        else:
            q, scale = _rows_chunk(x_smem.at[slot], pow2_scale=pow2_scale, amax_floor=amax_floor, swizzled=swizzled)
        d_smem[slot] = q
        s_smem[:, c] = scale
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(d_smem.at[slot], d_gmem.at[out_rows, chunk(c)])

    _chunk_loop(chunks, cfg.slots(chunks), bars, fetch, quantize_chunk, stores_per_chunk=1,
                valid=_valid_chunks(d_gmem.shape[1] // TILE, chunks))
    # Columns of chunks past the end were not written: they land in the padding (sliced by the
    # caller) or past the array's end (a window this wide is contiguous only if it spans whole
    # rows of `s_gmem`, so its flat copy ends where the array does).
    plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[out_rows, pl.ds(j * chunks, chunks)])
    plgpu.wait_smem_to_gmem(0)


def _row_scale_call(inputs, *, out_rows: int, out_chunks: int, transposed: bool, pow2_scale: bool, amax_floor: float,
                    cfg: QuantizeConfig):
    """Runs `_row_scale_body` → data [out_rows, out_chunks * 128], scale [out_rows, out_chunks].

    `inputs` is (x,) or, to dequantize first, (E4M3 data, its scales padded to 16-byte rows).
    """
    rows, chunks = cfg.rows, cfg.chunks
    slots = cfg.slots(chunks)
    dequant = len(inputs) == 2
    x = inputs[0]
    # The input's SMEM box is [rows, 128], or [128, rows] when transposed.
    box = (TILE, rows) if transposed else (rows, TILE)
    swizzled = cfg.swizzle and _swizzle_fits(x, box[1]) and out_rows % SWIZZLE_ROWS == 0
    bounce = [_smem((TILE, rows), jnp.float16, swizzled), plgpu.SMEM((rows,), jnp.float32)]
    scratch = [
        _smem((slots, *box), x.dtype, swizzled),
        *([plgpu.SMEM((slots, TILE, _SCALE_GROUP), jnp.float32)] if dequant else []),
        *(bounce if transposed else []),
        _smem((slots, rows, TILE), FP8_DTYPE, swizzled),
        plgpu.SMEM((rows, chunks), jnp.float32),
        plgpu.Barrier(num_arrivals=len(inputs), num_barriers=slots),
    ]
    kernel = plgpu.kernel(
        functools.partial(
            _row_scale_body, cfg=cfg, transposed=transposed, dequant=dequant,
            pow2_scale=pow2_scale, amax_floor=amax_floor, swizzled=swizzled,
        ),
        out_type=(
            jax.ShapeDtypeStruct((out_rows, out_chunks * TILE), FP8_DTYPE),
            # Scale rows padded to 16 bytes (a TMA rule); sliced below. Small: 1/32 of the data.
            jax.ShapeDtypeStruct((out_rows, _round_up(out_chunks, _SCALE_GROUP)), jnp.float32),
        ),
        grid=(pl.cdiv(out_rows, rows), pl.cdiv(out_chunks, chunks)),
        grid_names=("rows", "chunks"),
        scratch_types=scratch,
        compiler_params=_COMPILER_PARAMS,
    )
    data, scale = kernel(*inputs)
    return data, scale[:, :out_chunks]


# ---------------------------------------------------------------------------------------------
# Kernels whose CTA owns 128 rows and reduces down columns: block and (non-transposed) column.


def _halves_smem(slots: int, swizzled: bool):
    """E4M3 slots [slots, 128, 128] of the column kernels (64-byte swizzled tiles when `swizzled`):
    the output, written in [128, 64] halves (in [64, 64] quarters with a transpose), and the
    transposed block, written in [64, 64] quarters."""
    return plgpu.SMEM((slots, TILE, TILE), FP8_DTYPE,
                      transforms=swizzled_layout(FP8_DTYPE, _HALF) if swizzled else ())


def _row_block_cta(x_gmem, x_smem, bars, chunks: int):
    """A column-kernel CTA: rows [128 i, 128 i + 128) x `chunks` chunks of 128 columns.

    Returns (i, j, rows, chunk, fetch): the CTA's grid indices, its rows, chunk c's columns and
    `fetch(c, slot)`, chunk c's TMA load into an SMEM slot (for `_chunk_loop`).
    """
    i, j = jax.lax.axis_index("rows"), jax.lax.axis_index("chunks")
    rows = pl.ds(i * TILE, TILE)

    def chunk(c):
        return pl.ds((j * chunks + c) * TILE, TILE)

    def fetch(c, slot):
        plgpu.copy_gmem_to_smem(
            x_gmem.at[rows, chunk(c)], x_smem.at[slot], bars.at[slot], oob_mode=_ZEROS
        )

    return i, j, rows, chunk, fetch


def _store_half_transposed(q, half, dt_ref, bounce_ref, swizzled: bool) -> None:
    """E4M3 `q` [128, 64], columns `half` of a chunk, into rows `half` of `dt_ref` [128, 128],
    transposed through `bounce_ref` (f16 [128, 64]; exact for every E4M3 value): Hopper
    transposes 16-bit tiles, not 8-bit ones (see `_transposed_chunk`)."""
    bounce_ref[...] = q.astype(jnp.float16)
    dt_ref[half, :] = plgpu.load(bounce_ref.T, layout=_WGMMA, optimized=swizzled).astype(FP8_DTYPE)


def _store_piece_transposed(q, rows, cols, dt_ref, bounce_ref, swizzled: bool) -> None:
    """E4M3 `q` [64, 64], rows `rows` and columns `cols` of a chunk, into rows `cols` and columns
    `rows` of `dt_ref` [128, 128], transposed through `bounce_ref` (f16 [64, 64]; exact for every
    E4M3 value): Hopper transposes 16-bit tiles, not 8-bit ones (see `_transposed_chunk`). A
    quarter of the chunk at a time keeps the bounce at 8 KiB, so that the f32 weight quantizer at
    one chunk per CTA fits two CTAs on an SM (`_column_chunk`)."""
    bounce_ref[...] = q.astype(jnp.float16)
    dt_ref[cols, rows] = plgpu.load(bounce_ref.T, layout=_WGMMA, optimized=swizzled).astype(FP8_DTYPE)


def _column_chunk(x_ref, d_ref, dt_ref=None, bounce_ref=None, *, per_column: bool,
                  pow2_scale: bool, amax_floor: float, swizzled: bool):
    """Quantizes one SMEM chunk [128, 128] into `d_ref`, in two [128, 64] halves.

    With `dt_ref` (and its f16 `bounce_ref`, [64, 64]) it writes `d_ref` in four [64, 64]
    pieces instead, and each piece also transposed into `dt_ref`.
    Returns the two halves' [64] column scales when `per_column`, else the chunk's one scale.
    """
    assert dt_ref is None or not per_column, "the transposed store is for block scaling"
    halves = [pl.ds(h * _HALF, _HALF) for h in range(TILE // _HALF)]
    col_amax = [
        jnp.max(abs_for_amax(_load_f32(x_ref.at[:, h], swizzled)), axis=0) for h in halves
    ]
    if per_column:
        scale = [scale_from_amax(a, pow2_scale, amax_floor) for a in col_amax]
        inv = [jax.lax.broadcast_in_dim(ieee_reciprocal(s), (TILE, _HALF), (1,)) for s in scale]
    elif dt_ref is not None:
        # With the transpose (block scaling only): each half in two [64, 64] pieces (a WGMMA
        # layout's 64 rows), each stored and transposed through the quarter-size bounce. The same
        # elements encoded with the same reciprocal: the same bytes as a whole half at a time.
        scale = scale_from_amax(jnp.maximum(*[jnp.max(a, axis=0) for a in col_amax]), pow2_scale, amax_floor)
        piece_inv = jnp.broadcast_to(ieee_reciprocal(scale), (_HALF, _HALF))
        for h in halves:
            for r in halves:
                q = encode_scaled(_load_f32(x_ref.at[r, h], swizzled), piece_inv)
                d_ref[r, h] = q
                _store_piece_transposed(q, r, h, dt_ref, bounce_ref, swizzled)
        return scale
    else:
        scale = scale_from_amax(jnp.maximum(*[jnp.max(a, axis=0) for a in col_amax]), pow2_scale, amax_floor)
        inv = [jnp.broadcast_to(ieee_reciprocal(scale), (TILE, _HALF))] * len(halves)
    for h, inv_h in zip(halves, inv):
        d_ref[:, h] = encode_scaled(_load_f32(x_ref.at[:, h], swizzled), inv_h)
    return scale


def _column_body(x_gmem, d_gmem, s_gmem, *refs, chunks: int, slots: int, per_column: bool,
                 item_blocks: int | None, pow2_scale: bool, amax_floor: float, swizzled: bool):
    """One CTA: rows [128 i, 128 i + 128) x `chunks` chunks of 128 columns.

    `per_column`: (128, 1) tiles, one scale per column; else one scale per (128, 128) block,
    written straight to GMEM (a single f32 is below the 16-byte TMA minimum). With `item_blocks`
    (block scaling only) the kernel also writes each block transposed into `dt_gmem` [items, Kp,
    item_blocks * 128]: the input's rows are `items` stacked matrices of `item_blocks` row blocks
    each, and each matrix is transposed on its own (`_store_piece_transposed`).
    """
    dt_smem = bounce = None
    if item_blocks is not None:
        dt_gmem, x_smem, d_smem, dt_smem, bounce, bars = refs
    elif per_column:
        x_smem, d_smem, s_smem, bars = refs
    else:
        x_smem, d_smem, bars = refs
    i, j, rows, chunk, fetch = _row_block_cta(x_gmem, x_smem, bars, chunks)

    def quantize_chunk(c, slot):
        scale = _column_chunk(
            x_smem.at[slot], d_smem.at[slot], None if dt_smem is None else dt_smem.at[slot],
            bounce, per_column=per_column, pow2_scale=pow2_scale, amax_floor=amax_floor, swizzled=swizzled,
        )
        if per_column:
            for h, s in enumerate(scale):
                s_smem[slot, 0, pl.ds(h * _HALF, _HALF)] = s
        else:
            s_gmem[i, j * chunks + c] = scale
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(d_smem.at[slot], d_gmem.at[rows, chunk(c)])
        if per_column:
            plgpu.copy_smem_to_gmem(s_smem.at[slot], s_gmem.at[pl.ds(i, 1), chunk(c)])
        if item_blocks is not None:
            item_rows = pl.ds(i % item_blocks * TILE, TILE)
            plgpu.copy_smem_to_gmem(
                dt_smem.at[slot], dt_gmem.at[i // item_blocks, chunk(c), item_rows]
            )

    stores = 1 + (per_column or item_blocks is not None)
    _chunk_loop(chunks, slots, bars, fetch, quantize_chunk, stores_per_chunk=stores,
                valid=_valid_chunks(pl.cdiv(d_gmem.shape[1], TILE), chunks))
    plgpu.wait_smem_to_gmem(0)


def _column_call(x, *, out_cols: int, per_column: bool, pow2_scale: bool, amax_floor: float, cfg: QuantizeConfig,
                 items: int | None = None):
    """Runs `_column_body` on x [M, K] → data [Mp, out_cols] and scale [Mp // 128, ...].

    With `items` (block scaling), also the transposed data [items, out_cols, Mp // items] of the
    `items` stacked matrices (M a multiple of 128 * items when items > 1).
    """
    chunks = cfg.column_chunks
    slots = cfg.slots(chunks)
    row_blocks = pl.cdiv(x.shape[0], TILE)
    grid = (row_blocks, pl.cdiv(out_cols, chunks * TILE))
    # Block scales: one per chunk, stored one by one (not by TMA). Per-column scales: rows padded
    # to whole chunks, so that a chunk's [1, 128] row of them (a flat copy: see the module doc)
    # never runs into the next row; sliced by the caller.
    scale_cols = _round_up(out_cols, TILE) if per_column else pl.cdiv(out_cols, TILE)
    # The E4M3 output is staged in [128, 64] halves (`_column_chunk`): 64-byte swizzled tiles.
    swizzled = (
        cfg.swizzle and _swizzle_fits(x, TILE) and out_cols % swizzle_elems(FP8_DTYPE, _HALF) == 0
    )
    out_type = [
        jax.ShapeDtypeStruct((row_blocks * TILE, out_cols), FP8_DTYPE),
        jax.ShapeDtypeStruct((row_blocks, scale_cols), jnp.float32),
    ]
    transposed = []
    if items is not None:
        out_type.append(
            jax.ShapeDtypeStruct((items, out_cols, row_blocks // items * TILE), FP8_DTYPE)
        )
        # The transposed block [128, 128] E4M3, written in [64, 64] quarters (64-byte swizzled
        # tiles, as the output's halves), and the f16 bounce of one quarter
        # (`_store_piece_transposed`; 128-byte swizzled tiles).
        transposed = [
            _halves_smem(slots, swizzled),
            _smem((_HALF, _HALF), jnp.float16, swizzled),
        ]
    kernel = plgpu.kernel(
        functools.partial(
            _column_body, chunks=chunks, slots=slots, per_column=per_column,
            item_blocks=None if items is None else row_blocks // items, pow2_scale=pow2_scale, amax_floor=amax_floor,
            swizzled=swizzled,
        ),
        out_type=tuple(out_type),
        grid=grid,
        grid_names=("rows", "chunks"),
        scratch_types=[
            _smem((slots, TILE, TILE), x.dtype, swizzled),
            _halves_smem(slots, swizzled),
            *transposed,
            # Per-column scales are staged for a TMA store; a block's one scale is not.
            *([plgpu.SMEM((slots, 1, TILE), jnp.float32)] if per_column else []),
            plgpu.Barrier(num_barriers=slots),
        ],
        compiler_params=_COMPILER_PARAMS,
    )
    return kernel(x)


# ---------------------------------------------------------------------------------------------
# Both quantizations of an output gradient in one pass: (1, 128) tiles and transposed (128, 1);
# or of an activation, the transposed (128, 1) tiles re-tiled from the first (`retile`).


def _both_chunk(x_ref, d_ref, dt_ref, bounce_ref, *, retile: bool, pow2_scale: bool, amax_floor: float,
                swizzled: bool):
    """x_ref [128, 128] → its (1, 128)-tile E4M3 in `d_ref` [128, 128] and its (128, 1)-tile E4M3,
    transposed, in `dt_ref` [128, 128], one [128, 64] half at a time (`_store_half_transposed`).

    The (128, 1) tiles quantize x itself, or with `retile` the (1, 128) tiles' dequantized values
    (`q.astype(f32) * row_scale`, as `Fp8Tensor.dequantize`): the Fprop operand and the §3.5.2
    re-tiling of it for Wgrad from one read of x, bit for bit `retile_tile_to_column_t` of the
    first output. Returns the [128] row scales and the two halves' [64] column scales. A row's
    amax is the max of its two halves' maxima: the same value as one reduction over the row (max
    is exact).
    """
    halves = [pl.ds(h * _HALF, _HALF) for h in range(TILE // _HALF)]
    row_amax, col_scales = None, []
    for h in halves:
        a = abs_for_amax(_load_f32(x_ref.at[:, h], swizzled))
        r = jnp.max(a, axis=1)
        row_amax = r if row_amax is None else jnp.maximum(row_amax, r)
        if not retile:
            col_scales.append(scale_from_amax(jnp.max(a, axis=0), pow2_scale, amax_floor))
    row_scale = scale_from_amax(row_amax, pow2_scale, amax_floor)
    inv_row = jax.lax.broadcast_in_dim(ieee_reciprocal(row_scale), (TILE, _HALF), (0,))
    for i, h in enumerate(halves):
        x = _load_f32(x_ref.at[:, h], swizzled)
        q = encode_scaled(x, inv_row)
        d_ref[:, h] = q
        if retile:
            x = q.astype(jnp.float32) * jax.lax.broadcast_in_dim(row_scale, (TILE, _HALF), (0,))
            col_scales.append(scale_from_amax(jnp.max(abs_for_amax(x), axis=0), pow2_scale, amax_floor))
        inv_col = jax.lax.broadcast_in_dim(ieee_reciprocal(col_scales[i]), (TILE, _HALF), (1,))
        _store_half_transposed(encode_scaled(x, inv_col), h, dt_ref, bounce_ref, swizzled)
    return row_scale, col_scales


def _both_body(x_gmem, d_gmem, s_gmem, dt_gmem, st_gmem, x_smem, d_smem, dt_smem, bounce,
               s_smem, st_smem, bars, *, chunks: int, slots: int, retile: bool, pow2_scale: bool, amax_floor: float,
               swizzled: bool):
    """One CTA: rows [128 i, 128 i + 128) x `chunks` chunks of 128 columns of x [M, N].

    Outputs: the (1, 128) tiles d [M, Np] with row scales s [M, >= Np // 128] (stored once per
    CTA, `chunks` columns: a multiple of 16 bytes), and the (128, 1) tiles written transposed, dt
    [N, Mp], with their column scales st [Mp // 128, Np] untransposed (each chunk's 128 scales
    are one contiguous TMA row, inside its row of st; the caller slices and transposes that small
    array).
    """
    i, j, rows, chunk, fetch = _row_block_cta(x_gmem, x_smem, bars, chunks)

    def quantize_chunk(c, slot):
        row_scale, col_scales = _both_chunk(
            x_smem.at[slot], d_smem.at[slot], dt_smem.at[slot], bounce, retile=retile, pow2_scale=pow2_scale,
            amax_floor=amax_floor, swizzled=swizzled,
        )
        s_smem[:, c] = row_scale
        for h, s in enumerate(col_scales):
            st_smem[slot, 0, pl.ds(h * _HALF, _HALF)] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(d_smem.at[slot], d_gmem.at[rows, chunk(c)])
        plgpu.copy_smem_to_gmem(dt_smem.at[slot], dt_gmem.at[chunk(c), rows])
        plgpu.copy_smem_to_gmem(st_smem.at[slot], st_gmem.at[pl.ds(i, 1), chunk(c)])

    _chunk_loop(chunks, slots, bars, fetch, quantize_chunk, stores_per_chunk=3,
                valid=_valid_chunks(d_gmem.shape[1] // TILE, chunks))
    # As in `_row_scale_body`: unwritten columns land in the padding or past the end.
    plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[rows, pl.ds(j * chunks, chunks)])
    plgpu.wait_smem_to_gmem(0)


def _both_call(x, *, m: int, n: int, pow2_scale: bool, amax_floor: float, cfg: QuantizeConfig,
               retile: bool = False):
    """Runs `_both_body` on x [m, >= n] (rows 16-byte aligned) → d, s, dt, st (see there)."""
    chunks = cfg.column_chunks
    slots = cfg.slots(chunks)
    row_blocks, col_chunks = pl.cdiv(m, TILE), pl.cdiv(n, TILE)
    grid = (row_blocks, pl.cdiv(col_chunks, chunks))
    # Every array TMA touches must be whole swizzle tiles: x's rows and columns (x is padded to
    # 16-byte rows, so its width can be whole spans while dt's rows, n, are not whole 8s: checked
    # apart); d's and dt's columns are whole 128s.
    swizzled = cfg.swizzle and _swizzle_fits(x, TILE) and n % SWIZZLE_ROWS == 0
    kernel = plgpu.kernel(
        functools.partial(
            _both_body, chunks=chunks, slots=slots, retile=retile, pow2_scale=pow2_scale, amax_floor=amax_floor,
            swizzled=swizzled,
        ),
        out_type=(
            jax.ShapeDtypeStruct((m, col_chunks * TILE), FP8_DTYPE),
            jax.ShapeDtypeStruct((m, _round_up(col_chunks, _SCALE_GROUP)), jnp.float32),
            jax.ShapeDtypeStruct((n, row_blocks * TILE), FP8_DTYPE),
            # Column scales, rows padded to whole chunks: a chunk's [1, 128] row of them is a
            # flat copy (see the module doc), which must not run into the next row. Sliced by
            # the caller.
            jax.ShapeDtypeStruct((row_blocks, col_chunks * TILE), jnp.float32),
        ),
        grid=grid,
        grid_names=("rows", "chunks"),
        scratch_types=[
            _smem((slots, TILE, TILE), x.dtype, swizzled),
            _halves_smem(slots, swizzled),
            _smem((slots, TILE, TILE), FP8_DTYPE, swizzled),
            _smem((TILE, _HALF), jnp.float16, swizzled),
            plgpu.SMEM((TILE, chunks), jnp.float32),
            plgpu.SMEM((slots, 1, TILE), jnp.float32),
            plgpu.Barrier(num_barriers=slots),
        ],
        compiler_params=_COMPILER_PARAMS,
    )
    return kernel(x)


# ---------------------------------------------------------------------------------------------
# Public API.


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check_input(x: jax.Array) -> None:
    if jnp.dtype(x.dtype) not in _INPUT_DTYPES:
        raise TypeError(f"x must be bf16, f16 or f32, got {x.dtype}; cast it first")
    if x.ndim != 2:
        raise ValueError(
            f"x must be 2-D (rows, cols), got shape {x.shape}; the jfp8 layer maps batch axes"
        )


def _tma_aligned(x: jax.Array) -> jax.Array:
    """Zero-pads the last axis of `x` so that its rows are a multiple of 16 bytes (a TMA rule).

    An extra pass over memory, only for odd widths (K not a multiple of 8 in bf16, of 4 in f32).
    The padding is zeros, which the quantizer pads with anyway.
    """
    k = x.shape[-1]
    kp = _round_up(k, _TMA_ALIGN_BYTES // x.dtype.itemsize)
    return x if kp == k else jnp.pad(x, ((0, 0), (0, kp - k)))


def _empty(data_shape, scale_shape):
    return jnp.zeros(data_shape, FP8_DTYPE), jnp.zeros(scale_shape, jnp.float32)


def quantize_tile(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, config: QuantizeConfig = QuantizeConfig()
):
    """(1, 128) tile-wise E4M3 quantization along the last axis: `jfp8.quantize(x, (1, 128))`.

    Args:
      x: [M, K] bf16, f16 or f32.
      pow2_scale: round every scale up to a power of two.
      amax_floor: the smallest amax a scale is computed from (`fp8_math.AMAX_FLOOR` for activations
        and weights, `GRAD_AMAX_FLOOR` for gradients).

    Returns:
      data [M, Kp] float8_e4m3fn (Kp = K rounded up to 128, zero padded), scale [M, Kp // 128] f32.
    """
    _check_input(x)
    m, k = x.shape
    kp = _round_up(k, TILE)
    if m == 0 or k == 0:
        return _empty((m, kp), (m, kp // TILE))
    return _row_scale_call(
        (_tma_aligned(x),), out_rows=m, out_chunks=kp // TILE, transposed=False,
        pow2_scale=pow2_scale, amax_floor=amax_floor, cfg=config,
    )


def quantize_block(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, config: QuantizeConfig = QuantizeConfig()
):
    """(128, 128) block-wise E4M3 quantization: `jfp8.quantize(x, (128, 128))`.

    Args:
      x: [M, K] bf16, f16 or f32.

    Returns:
      data [Mp, Kp] float8_e4m3fn (both axes zero padded up to 128), scale [Mp // 128, Kp // 128].
    """
    _check_input(x)
    m, k = x.shape
    mp, kp = _round_up(m, TILE), _round_up(k, TILE)
    if m == 0 or k == 0:
        return _empty((mp, kp), (mp // TILE, kp // TILE))
    data, scale = _column_call(
        _tma_aligned(x), out_cols=kp, per_column=False, pow2_scale=pow2_scale, amax_floor=amax_floor, cfg=config
    )
    return data, scale[:, : kp // TILE]


def quantize_block_and_transpose(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, config: QuantizeConfig = QuantizeConfig()
):
    """`quantize_block` that also writes the E4M3 data transposed, in the same pass.

    A weight W [K, N] is used as blocks of W in one GEMM and of Wᵀ in the other (Fprop needs the
    contracted K contiguous, Dgrad N): this reads W once and writes both orientations, instead of
    quantizing and then transposing the E4M3 copy in a second pass over it. A (128, 128) block's
    scale is the same for both (the scale array is transposed, a tiny array, by the caller).

    Args:
      x: [M, K] or [G, M, K] (G stacked matrices, e.g. experts; then M must be a multiple of 128)
        in bf16, f16 or f32.

    Returns:
      data [..., Mp, Kp] float8_e4m3fn and scale [..., Mp // 128, Kp // 128], as `quantize_block`,
      and data_t [..., Kp, Mp]: data with its last two axes swapped.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be [M, K] or [G, M, K], got shape {x.shape}")
    *batch, m, k = x.shape
    if batch and m % TILE:
        raise ValueError(
            f"stacked matrices need rows (here {m}) that are a multiple of {TILE}, so that no block "
            "spans two of them; quantize them one by one (e.g. with jax.vmap) instead"
        )
    items = batch[0] if batch else 1
    x2 = x.reshape(items * m, k)
    _check_input(x2)
    mp, kp = _round_up(m, TILE), _round_up(k, TILE)
    if m == 0 or k == 0 or items == 0:
        data, scale = _empty((*batch, mp, kp), (*batch, mp // TILE, kp // TILE))
        return data, scale, jnp.zeros((*batch, kp, mp), FP8_DTYPE)
    data, scale, data_t = _column_call(
        _tma_aligned(x2), out_cols=kp, per_column=False, pow2_scale=pow2_scale, amax_floor=amax_floor, cfg=config,
        items=items,
    )
    scale = scale[:, : kp // TILE].reshape(*batch, mp // TILE, kp // TILE)
    return data.reshape(*batch, mp, kp), scale, data_t.reshape(*batch, kp, mp)


# `quantize_tile_and_column_t`'s default: 4 chunks per CTA (its row scales span 16 bytes) through
# 2 SMEM slots (f32 input fits 2, not 4).
BOTH_CONFIG = QuantizeConfig(column_chunks=4, stages=2)


def quantize_tile_and_column_t(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, config: QuantizeConfig = BOTH_CONFIG
):
    """Both FP8 forms of an output gradient dy, from one read of it.

    Dgrad consumes dy in (1, 128) tiles and Wgrad consumes dyᵀ scaled per 128 tokens; this reads
    dy once and writes both (`quantize_tile(x)` and `quantize_column(x, transpose=True)`, bit
    for bit), instead of reading it once for each.

    Args:
      x: [M, N] bf16, f16 or f32.
      config: `column_chunks` (a multiple of 4: a CTA stores its row scales as one 16-byte-wide
        TMA copy), `stages` and `swizzle` are used (`BOTH_CONFIG` by default; with
        `swizzle=False`, the unswizzled form). Four chunks fit SMEM only through a ring
        (`stages` <= 3 for 16-bit input, 2 for f32).

    Returns:
      data [M, Np], scale [M, Np // 128] (the (1, 128) tiles; Np = N rounded up to 128) and
      data_t [N, Mp], scale_t [N, Mp // 128] (the transposed (128, 1) tiles; Mp = M rounded up).
    """
    return _both_forms("quantize_tile_and_column_t", x, pow2_scale, amax_floor, config, retile=False)


def _both_forms(name: str, x: jax.Array, pow2_scale: bool, amax_floor: float, config: QuantizeConfig, *,
                retile: bool):
    """The two public both-forms quantizers' checks, empty case, launch and output slicing."""
    _check_input(x)
    if config.column_chunks % _SCALE_GROUP:
        raise ValueError(
            f"{name} needs column_chunks a multiple of {_SCALE_GROUP}, got "
            f"{config.column_chunks}; e.g. pallas_kernels.quantize.BOTH_CONFIG"
        )
    m, n = x.shape
    mp, np_ = _round_up(m, TILE), _round_up(n, TILE)
    if m == 0 or n == 0:
        return (*_empty((m, np_), (m, np_ // TILE)), *_empty((n, mp), (n, mp // TILE)))
    data, scale, data_t, scale_t = _both_call(
        _tma_aligned(x), m=m, n=n, pow2_scale=pow2_scale, amax_floor=amax_floor, cfg=config, retile=retile
    )
    return data, scale[:, : np_ // TILE], data_t, scale_t[:, :n].T


def quantize_tile_and_retile_t(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, config: QuantizeConfig = BOTH_CONFIG
):
    """An activation's two FP8 forms from one read of it: its (1, 128) tiles (the Fprop operand,
    `quantize_tile(x)`) and their §3.5.2 re-tiling for Wgrad, transposed (128, 1) tiles of the
    dequantized tiles (`retile_tile_to_column_t` of the first), bit for bit both.

    Instead of quantizing x in the forward pass and reading the FP8 copy back in the backward to
    re-tile it, the forward writes both: x is read once, and the backward keeps the Wgrad
    operand (the same bytes as the FP8 copy it replaces).

    Args and returns: as `quantize_tile_and_column_t`.
    """
    return _both_forms("quantize_tile_and_retile_t", x, pow2_scale, amax_floor, config, retile=True)


def quantize_column(x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, transpose: bool = False,
                    config: QuantizeConfig = QuantizeConfig()):
    """(128, 1) E4M3 quantization, one scale per column and 128 rows: `jfp8.quantize(x, (128, 1))`.

    Args:
      x: [M, K] bf16, f16 or f32.
      transpose: write the transposed layout, `jfp8.quantize(x, (128, 1)).mT`, the one the Wgrad
        GEMM consumes: it contracts over tokens (M), which FP8 wgmma needs as the contiguous axis.

    Returns:
      data [Mp, K] and scale [Mp // 128, K]; with `transpose`, data [K, Mp] and scale
      [K, Mp // 128]. Mp = M rounded up to 128 (zero padded).
    """
    _check_input(x)
    m, k = x.shape
    mp = _round_up(m, TILE)
    if m == 0 or k == 0:
        return _empty((k, mp), (k, mp // TILE)) if transpose else _empty((mp, k), (mp // TILE, k))
    if transpose:
        return _row_scale_call(
            (_tma_aligned(x),), out_rows=k, out_chunks=mp // TILE, transposed=True,
            pow2_scale=pow2_scale, amax_floor=amax_floor, cfg=config,
        )
    # E4M3 rows must be 16-byte aligned too: for K not a multiple of 16 the kernel writes a wider
    # array that is sliced here (an extra pass over the output, for such widths only).
    k16 = _round_up(k, _TMA_ALIGN_BYTES)
    data, scale = _column_call(
        _tma_aligned(x), out_cols=k16, per_column=True, pow2_scale=pow2_scale, amax_floor=amax_floor, cfg=config
    )
    return (data if k16 == k else data[:, :k]), scale[:, :k]


def retile_tile_to_column_t(data: jax.Array, scale: jax.Array, *, m: int, k: int,
                            pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR, config: QuantizeConfig = QuantizeConfig()):
    """Re-tiles a (1, 128)-quantized tensor into transposed (128, 1) tiles (DeepSeek-V3 §3.5.2).

    Dequantizes (`data.astype(f32) * scale`, as `Fp8Tensor.dequantize`), transposes and requantizes
    in one kernel: `quantize(Fp8Tensor(data, scale, (1, 128), (m, k)).dequantize(), (128, 1)).mT`.

    Args:
      data: [m, Kp] float8_e4m3fn, Kp = k rounded up to 128.
      scale: [m, Kp // 128] f32.
      m, k: the logical shape.
      pow2_scale: round every new scale up to a power of two.

    Returns:
      data [k, Mp] float8_e4m3fn and scale [k, Mp // 128] f32, Mp = m rounded up to 128.
    """
    kp, mp = _round_up(k, TILE), _round_up(m, TILE)
    if data.dtype != FP8_DTYPE or scale.dtype != jnp.float32:
        raise TypeError(
            f"need float8_e4m3fn data and f32 scales, got {data.dtype} and {scale.dtype}"
        )
    if data.shape != (m, kp) or scale.shape != (m, kp // TILE):
        raise ValueError(
            f"for the logical shape ({m}, {k}) with (1, {TILE}) tiles, data must be {(m, kp)} and "
            f"scale {(m, kp // TILE)}; got {data.shape} and {scale.shape}"
        )
    if m == 0 or k == 0:
        return _empty((k, mp), (k, mp // TILE))
    # The kernel fetches the input's scales in 16-byte groups (TMA): pad the (small) scale array
    # to whole groups; an extra pass over the scales only, when Kp // 128 is not a multiple of 4.
    groups = _round_up(kp // TILE, _SCALE_GROUP)
    scale = jnp.pad(scale, ((0, 0), (0, groups - kp // TILE)))
    return _row_scale_call(
        (data, scale), out_rows=k, out_chunks=mp // TILE, transposed=True, pow2_scale=pow2_scale, amax_floor=amax_floor,
        cfg=config,
    )
