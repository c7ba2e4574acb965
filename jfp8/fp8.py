"""E4M3 quantization with DeepSeek-V3 scaling granularities (report §3.3, "Fine-Grained Quantization").

`quantize` is the single definition of how a tensor becomes FP8 in jfp8, in plain XLA. The Pallas
quantization kernels in `pallas_kernels.quantize` reproduce it bit for bit (they share the
elementwise rules of `pallas_kernels.fp8_math`), so every rule below (the amax clamp, the order of
operations, the clip before the cast, the handling of non-finite blocks) is part of the numerics
contract, not an implementation detail. `jfp8.api` chooses between this module and the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, TypeAlias

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_math import (  # noqa: F401  AMAX_FLOOR, E4M3_MAX, FP8_DTYPE...: re-exported
    AMAX_FLOOR,
    GRAD_AMAX_FLOOR,
    E4M3_MAX,
    FP8_DTYPE,
    TILE,
    abs_for_amax,
    check_amax_floor,
    encode,
    scale_from_amax,
)

Block: TypeAlias = tuple[int, int] | None
BlockName = Literal["tile", "column", "block", "tensor"]

#: The scaling layouts of the recipe: 1x128 activation tiles along the last axis, 128x1 tiles along
#: rows (the Wgrad layout, 128 tokens per scale), 128x128 weight blocks, and one scale per matrix.
BLOCKS: dict[BlockName, Block] = {
    "tile": (1, TILE),
    "column": (TILE, 1),
    "block": (TILE, TILE),
    "tensor": None,
}


def _check_block(block: Block) -> None:
    if block is None:
        return
    if (
        not isinstance(block, tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b >= 1 for b in block)
    ):
        raise ValueError(
            f"block must be None (per-tensor) or a pair of positive ints such as (1, {TILE}), "
            f"({TILE}, 1) or ({TILE}, {TILE}); got {block!r}"
        )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """An E4M3 tensor with one FP32 scale per block of its last two axes.

    Attributes:
      data: float8_e4m3fn, shape `(..., Mp, Kp)`: the logical `(M, K)` zero-padded up to whole
        blocks. Leading axes are batch axes.
      scale: float32, shape `(..., Mp // bm, Kp // bk)` for `block=(bm, bk)`, or `(..., 1, 1)` for
        a per-tensor (per-matrix) scale. The represented value is `data * scale`, blockwise.
      block: static: the scaling block `(bm, bk)`, or None for one scale per matrix.
      logical: static: the logical sizes `(M, K)` of the last two axes (padding excluded).
    """

    data: jax.Array
    scale: jax.Array
    block: Block
    logical: tuple[int, int]

    def tree_flatten(self):
        return (self.data, self.scale), (self.block, self.logical)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: batch axes of `data`, then `logical`."""
        return tuple(self.data.shape[:-2]) + tuple(self.logical)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def mT(self) -> Fp8Tensor:
        """The matrix transpose of the last two axes, with the scaling block transposed too.

        Exact (no requantization): `quantize(x, (128, 1)).mT` equals `quantize(x.mT, (1, 128))`
        bit for bit. This is how the Wgrad operands, scaled per 128 tokens, become NT operands.
        """
        block = None if self.block is None else (self.block[1], self.block[0])
        return Fp8Tensor(
            move_bytes(lambda d: jnp.swapaxes(d, -1, -2), self.data),
            jnp.swapaxes(self.scale, -1, -2),
            block,
            (self.logical[1], self.logical[0]),
        )

    def expanded_scale(self, dtype=jnp.float32) -> jax.Array:
        """The scales broadcast to the padded data shape `(..., Mp, Kp)`."""
        s = self.scale.astype(dtype)
        if self.block is None:
            return jnp.broadcast_to(s, self.data.shape)
        bm, bk = self.block
        return jnp.repeat(jnp.repeat(s, bm, axis=-2), bk, axis=-1)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """`data * scale` multiplied in f32 (f64 for f64), then rounded once to `dtype`, cut back
        to the logical shape.

        As DeepSeek-V3's FP8 -> BF16 conversion (`inference/kernel.py`, `weight_dequant`: E4M3 to
        f32, times the f32 scale, stored as BF16); not in a 16-bit `dtype` itself, where both the
        scale and the product would be rounded to 16 bits.
        """
        compute = jnp.promote_types(dtype, jnp.float32)
        x = (self.data.astype(compute) * self.expanded_scale(compute)).astype(dtype)
        m, k = self.logical
        return x[..., :m, :k]

    @property
    def nbytes(self) -> int:
        return int(self.data.size * self.data.dtype.itemsize + self.scale.size * 4)


def quantize(
    x: jax.Array,
    block: Block = (1, TILE),
    *,
    pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR,
) -> Fp8Tensor:
    """Online E4M3 quantization of the last two axes of `x`, one FP32 scale per block, in XLA.

    Args:
      x: floating array of shape `(..., M, K)` (bf16, f16, f32 or f64); leading axes are batch.
      block: `(1, 128)` tile-wise (per row, 128 along the last axis: activations), `(128, 1)` (per
        column, 128 rows: the Wgrad layout), `(128, 128)` block-wise (weights), any other
        `(bm, bk)`, or None for one scale per matrix (per-tensor, the baseline).
      pow2_scale: round every scale up to a power of two (UE8M0-compatible).
      amax_floor: a block's amax is raised to at least this before its scale is taken, so that an
        all-zero block gets a finite scale. `AMAX_FLOOR` (1e-4, DeepGEMM's) for activations and
        weights; `GRAD_AMAX_FLOOR` (448 * 2^-126) for gradients, which binds only where the scale
        would not be a normal f32 (gradients of a mean loss lie far under 1e-4).

    Returns:
      An `Fp8Tensor` whose `data` is padded with zeros up to whole blocks and whose `logical` holds
      `(M, K)`. A block that contains NaN or ±Inf gets a NaN scale and NaN data.
    """
    _check_block(block)
    amax_floor = check_amax_floor(amax_floor)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"quantize needs a floating-point array (bf16, f16, f32 or f64), got {x.dtype}; "
            "cast integer data with x.astype(jnp.float32) first"
        )
    if x.ndim < 2:
        raise ValueError(
            f"quantize works on the last two axes and needs x.ndim >= 2, got shape {x.shape}; "
            "use x[None, :] for a vector"
        )
    *batch, m, k = x.shape
    if block is None:
        # One scale per matrix: the amax runs over both axes, nothing is padded.
        amax = jnp.max(abs_for_amax(x), axis=(-2, -1), keepdims=True, initial=0.0)
        scale = scale_from_amax(amax, pow2_scale, amax_floor)
        return Fp8Tensor(encode(x, scale), scale, None, (m, k))

    bm, bk = block
    mp, kp = _round_up(m, bm), _round_up(k, bk)
    if bm == 1 and 0 < k < bk:
        return _one_partial_row_tile(x, bk, pow2_scale, amax_floor)
    pad = [(0, 0)] * len(batch) + [(0, mp - m), (0, kp - k)]
    # The barrier keeps x's producer (an RMSNorm, say) out of the pad: XLA:CPU fused it into the
    # pad as a scalar loop (tiny's d_model 64 padded to 128: 1.9 ms of the FP8 eval step's 11 ms
    # of thread time). With it the tiny eval step took 6.1-6.2 ms against 6.8-7.1 (3 interleaved
    # processes each, 300 calls; same bits). Nothing is padded at the GPU presets' widths.
    xp = jnp.pad(jax.lax.optimization_barrier(x), pad) if (mp, kp) != (m, k) else x
    blocks = xp.reshape(*batch, mp // bm, bm, kp // bk, bk)  # [..., rows, bm, cols, bk]
    amax = jnp.max(abs_for_amax(blocks), axis=(-3, -1), initial=0.0)  # [..., rows, cols]
    scale = scale_from_amax(amax, pow2_scale, amax_floor)
    data = encode(blocks, scale[..., :, None, :, None]).reshape(*batch, mp, kp)
    return Fp8Tensor(data, scale, block, (m, k))


def _one_partial_row_tile(x: jax.Array, bk: int, pow2_scale: bool, amax_floor: float) -> Fp8Tensor:
    """`quantize(x, (1, bk))` for K < bk (one partial tile per row), without padding x first.

    The same scales and the same bytes as padding x with zeros to bk columns and quantizing that:
    each row's amax over its K columns only (|0| cannot raise a max, and NaN / ±Inf map to +Inf
    either way), every element encoded as before, and the padding's bytes those of a zero encoded
    with the row's scale (E4M3 +0, or NaN in a row that holds a NaN or ±Inf), appended to the
    E4M3 bytes. On the CPU the pad copied x (bf16) before the quantizer could read it; now only
    the quantized bytes are padded (issue 44: `tiny`'s d_model 64 padded to 128 in every FP8
    GEMM; its eval step 5.7-6.4 -> 5.0-5.5 ms, docs/results.md). Where K also has whole tiles,
    encoding the pieces and joining them was slower than the pad (`small`'s eval step +12-17 %),
    so those keep it.
    `tests/test_quantize.py` checks both against quantizing the padded x, bit for bit.
    """
    *batch, m, k = x.shape
    # The barrier materializes x as given (the padded path's did too): fused into the quantizer,
    # x's producer would lose its rounding to x's dtype (XLA's excess precision) and the bits
    # would move (measured: tiny's FP8 eval loss, 5.5441318 -> 5.544117).
    x = jax.lax.optimization_barrier(x)
    amax = jnp.max(abs_for_amax(x), axis=-1, keepdims=True, initial=0.0)  # [..., M, 1]
    scale = scale_from_amax(amax, pow2_scale, amax_floor)
    zero = encode(jnp.zeros((*batch, m, 1), x.dtype), scale)  # what a padded column encodes to
    pad = jnp.broadcast_to(as_bytes(zero), (*batch, m, bk - k))
    data = jnp.concatenate([as_bytes(encode(x, scale)), pad], axis=-1)
    return Fp8Tensor(from_bytes(data, FP8_DTYPE), scale, (1, bk), (m, k))


def as_bytes(x: jax.Array) -> jax.Array:
    """An FP8 array's `uint8` view (other dtypes unchanged): see `move_bytes`."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if jnp.dtype(x.dtype).itemsize == 1 else x


def from_bytes(b: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_bytes` for an array of `dtype`."""
    return jax.lax.bitcast_convert_type(b, dtype) if jnp.dtype(dtype).itemsize == 1 else b


def move_bytes(fn, x: jax.Array) -> jax.Array:
    """`fn(x)` for a data movement `fn` (slices, zero pads, gathers, transposes, reshapes) of an
    FP8 array, carried out on its bytes (`uint8` views): the same bits. XLA:CPU moves f8 arrays
    through f16, converting every element out and back in (each f16 -> E4M3 conversion a
    software rounding), which made such moves the costliest ops of the FP8 reference's small
    steps (issue 44). Other dtypes: `fn(x)`. `fn` may pad or mask with zeros only (byte 0 is E4M3 +0)."""
    return from_bytes(fn(as_bytes(x)), x.dtype)


def quantize_weight(
    w: jax.Array, block: Block = (TILE, TILE), *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """`(q, q.mT)` for `q = quantize(w, block)`: a weight in both orientations (Fprop contracts
    W [K, N] over K and Dgrad over N, and FP8 wgmma needs the contracted axis contiguous)."""
    q = quantize(w, block, pow2_scale=pow2_scale, amax_floor=amax_floor)
    return q, q.mT


def quantize_wgrad_operand(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR
) -> Fp8Tensor:
    """x (T, C) -> its transpose (C, T) scaled per 128 tokens: `quantize(x, (128, 1)).mT`, the
    Wgrad operand layout (DeepSeek-V3's 128x1 tiles; the contracted token axis contiguous)."""
    return quantize(x, (TILE, 1), pow2_scale=pow2_scale, amax_floor=amax_floor).mT


def quantize_grad(
    dy: jax.Array, *, pow2_scale: bool = False, amax_floor: float = GRAD_AMAX_FLOOR
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """dy (T, N) -> `(quantize(dy, (1, 128)), quantize_wgrad_operand(dy))`: its Dgrad operand in
    1x128 tiles and its Wgrad operand (dyᵀ scaled per 128 tokens)."""
    return (quantize(dy, (1, TILE), pow2_scale=pow2_scale, amax_floor=amax_floor),
            quantize_wgrad_operand(dy, pow2_scale=pow2_scale, amax_floor=amax_floor))


def retile_wgrad_operand(
    t: Fp8Tensor, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR
) -> Fp8Tensor:
    """The FP8 x saved by Fprop, (T, C) in (1, 128) tiles -> (C, T) scaled per 128 tokens
    (DeepSeek-V3 §3.5.2: dequantize, transpose, re-quantize)."""
    return quantize(t.dequantize(jnp.float32), (TILE, 1), pow2_scale=pow2_scale, amax_floor=amax_floor).mT


def quantize_activation(
    x: jax.Array, *, pow2_scale: bool = False, amax_floor: float = AMAX_FLOOR
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """x (T, C) -> `(q, retile_wgrad_operand(q))` for `q = quantize(x, (1, 128))`: its Fprop operand
    and the Wgrad operand the backward re-tiles from it (§3.5.2), both computed when x is."""
    q = quantize(x, (1, TILE), pow2_scale=pow2_scale, amax_floor=amax_floor)
    return q, retile_wgrad_operand(q, pow2_scale=pow2_scale, amax_floor=amax_floor)
