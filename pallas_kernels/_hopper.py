"""Hopper (sm_90) facts and layout helpers shared by the Mosaic GPU kernels: the constants of
wgmma, TMA and shared memory, the swizzled SMEM layouts, padding for TMA, and input checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_math import FP8_DTYPE, TILE

# The K tile of the kernel is the scaling block: one promotion per K step.
TILE_K = TILE

# Hopper TMA: every GMEM stride but the innermost must be a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16
# A TMA copy's SMEM end (cp.async.bulk.tensor) must start on a 128-byte boundary: every
# pipeline slot of a TMA-filled buffer must therefore be a multiple of 128 bytes, or slot 1 on
# faults with CUDA_ERROR_MISALIGNED_ADDRESS (seen on an H100, 2026-11-26, with 16-byte slots).
# The Mosaic GPU interpreter and the deviceless compile do not check it: `check_tma_slot`.
TMA_SMEM_ALIGN_BYTES = 128
# One f32 scale as a TMA box of its own: repeated to fill one 128-byte SMEM slot.
SCALE_BOX = TMA_SMEM_ALIGN_BYTES // 4


def check_tma_slot(what: str, shape: tuple[int, ...], dtype) -> None:
    """Raises unless one pipeline slot of `shape` x `dtype` keeps the next slot's TMA address
    128-byte aligned (`TMA_SMEM_ALIGN_BYTES`)."""
    nbytes = jnp.dtype(dtype).itemsize
    for d in shape:
        nbytes *= d
    if nbytes % TMA_SMEM_ALIGN_BYTES:
        raise ValueError(f"{what}: a TMA slot of {shape} {jnp.dtype(dtype).name} is {nbytes} bytes, "
                         f"not a multiple of {TMA_SMEM_ALIGN_BYTES} (TMA's SMEM alignment): the "
                         "next slot's copy would fault on the GPU")

# Swizzled SMEM tiles are 8 rows high, and TMA then tiles the GMEM array the same way: its rows
# must be a multiple of 8 and its columns a multiple of the swizzle width (the tails are padded).
SWIZZLE_ROWS = 8

# A warpgroup's wgmma covers 64 rows; one TMA box dimension spans at most 256 elements.
WGMMA_M = 64
WARPGROUP_THREADS = 128

MAX_TMA_BOX = 256

# The narrowest output tile whose bf16 rows can be swizzled (32 bytes).
MIN_TILE_N = 16

# Warp specialization: consumer (wgmma) warpgroups per CTA, besides the one producer (TMA)
# warpgroup, and the registers per thread the producer keeps (setmaxnreg; the rest of the
# register file goes to the consumers). 40 is what jax's Hopper matmul gives its producer.
WS_CONSUMER_WGS = 2

WS_PRODUCER_REGISTERS = 40

# Shared memory per block on Hopper (opt-in maximum, 227 KiB), and the alignment of each SMEM
# buffer (the 128-byte swizzle repeats every 8 rows = 1024 bytes).
SMEM_BYTES = 227 * 1024

SMEM_ALIGN = 1024

BARRIER_BYTES = 8

# wgmma's widest N, and the output dtypes every GEMM kernel writes.
WGMMA_MAX_N = 256
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

# Under lane semantics a TMA load must move a multiple of 128 bytes (one per thread of the
# warpgroup), so the per-column scale vector of a tile holds a multiple of 32 f32.
LANE_SCALE_STEP = 128 // jnp.dtype(jnp.float32).itemsize

# Lane semantics: explicit register layouts (WGMMA and its row/column reductions) and untiled
# SMEM for the output tile, which `_store_rows` slices at any row. (Under the default warpgroup
# semantics Mosaic tiles that buffer, and the output then needs whole 8-row tiles.)
LANE_SEMANTICS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swizzle_elems(dtype, row_elems: int) -> int:
    """Elements per swizzled row segment: the largest swizzle (<= 128 B) that divides a row."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.find_swizzle(row_elems * itemsize * 8) // itemsize

def swizzled(dtype, row_elems: int) -> tuple:
    """SMEM layout of a tile with rows of `row_elems`: 8-row tiles, the widest swizzle.

    The fp8 wgmma operands get the 128-byte swizzle (a row of TILE_K fp8 is 128 bytes); the
    output tile gets it too for tile_n * itemsize >= 128, for bank-conflict-free stores.
    """
    elems = swizzle_elems(dtype, row_elems)
    return (
        plgpu.TilingTransform((SWIZZLE_ROWS, elems)),
        plgpu.SwizzleTransform(elems * jnp.dtype(dtype).itemsize),
    )


# FP8 operands: a 128-element K chunk is exactly one 128-byte swizzle span, tiled in 8-row groups.
FP8_TRANSFORMS = swizzled(FP8_DTYPE, TILE)


def zeros(shape: tuple[int, int]) -> jax.Array:
    """An f32 register tile of zeros in the wgmma accumulator layout."""
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def tma_extent(size: int, tile: int, align: int = 1) -> int:
    """The smallest extent >= size that a swizzled TMA copy can tile: a multiple of `tile`, or,
    for a dimension within one tile, a multiple of `align` (16-byte rows for a minor dimension)."""
    return round_up(size, align) if size <= tile else round_up(size, tile)

def pad_axis(x: jax.Array, axis: int, extent: int) -> jax.Array:
    """Zero-pads `x` along `axis` to `extent` (no copy when it is already that long)."""
    pad = extent - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def store_width(n: int, out_dtype) -> int:
    """The output width the kernels write: `n` padded until a row is whole 16-byte units (TMA's
    stride rule); the caller slices back to `n` when they differ."""
    return round_up(n, TMA_ALIGN_BYTES // jnp.dtype(out_dtype).itemsize)

def pad_rows(x: jax.Array) -> jax.Array:
    """`x` with zero rows appended up to a multiple of 8. Mosaic tiles the GMEM side of a TMA load
    like the swizzled SMEM tile, in whole 8-row tiles (a copy, only for odd row counts)."""
    rows = x.shape[0]
    if rows % SWIZZLE_ROWS == 0:
        return x
    return jnp.pad(x, ((0, round_up(rows, SWIZZLE_ROWS) - rows), (0, 0)))

def check_out_dtype(out_dtype) -> None:
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")

def check_fp8(x: jax.Array, name: str, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")
    if x.dtype != FP8_DTYPE:
        raise TypeError(f"{name} must be {jnp.dtype(FP8_DTYPE)}, got {x.dtype}")
    if x.shape[-1] % TILE:
        raise ValueError(
            f"{name} has {x.shape[-1]} contraction columns, not a multiple of {TILE}: "
            "pass the zero-padded data of jfp8.quantize"
        )

def check_scale(s: jax.Array, name: str, shape: tuple[int, ...]) -> None:
    if s.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {s.shape}")
    if s.dtype != jnp.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")
