"""E4M3 quantization with DeepSeek-V3 scaling granularities (report §3.3, "Fine-Grained Quantization").

`quantize` is the single definition of how a tensor becomes FP8 in jfp8. The Pallas quantization
kernels in `pallas_kernels.quantize` reproduce it bit for bit, so every rule below (the amax clamp,
the order of operations, the clip before the cast, the handling of non-finite blocks) is part of
the numerics contract, not an implementation detail.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, TypeAlias

import jax
import jax.numpy as jnp

from jfp8.backend import Impl, resolve_impl
from pallas_kernels._mgpu import interpret_mode
from pallas_kernels.fp8_math import (
    AMAX_FLOOR,
    E4M3_MAX,
    FP8_DTYPE,
    TILE,
    abs_for_amax,
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
            jnp.swapaxes(self.data, -1, -2),
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


_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_KERNEL_BLOCKS = ((1, TILE), (TILE, 1), (TILE, TILE))


def _kernel_unsupported(x: jax.Array, block: Block) -> str | None:
    """Why the quantization kernels cannot take this input, or None when they can."""
    if block not in _KERNEL_BLOCKS:
        return f"block {block} (the kernels do {_KERNEL_BLOCKS})"
    if jnp.dtype(x.dtype) not in _KERNEL_DTYPES:
        return f"dtype {x.dtype} (the kernels take bf16, f16, f32)"
    if x.ndim > 2 and block != (1, TILE) and x.shape[-2] % TILE:
        return f"batched input whose rows ({x.shape[-2]}) are not a multiple of {TILE}"
    return None


def _use_kernels(x: jax.Array, block: Block, impl: Impl, interpret: bool) -> bool:
    if resolve_impl(impl, interpret) == "xla":
        return False
    why = _kernel_unsupported(x, block)
    if why is None:
        return True
    if impl == "mosaic":
        raise NotImplementedError(f"the Mosaic GPU quantization kernels do not handle {why}; use impl='xla'")
    return False  # "auto": the reference has the same numerics


def _quantize_kernel(x: jax.Array, block: Block, pow2_scale: bool, interpret: bool) -> Fp8Tensor:
    """`quantize` through the fused Mosaic GPU kernels (2-D; batch axes folded into rows)."""
    from pallas_kernels import quantize as qk

    *batch, m, k = x.shape
    # Rows of different batch items never share a block (checked above). Not reshape(-1, k):
    # that cannot infer the rows when k is 0.
    x2 = x.reshape(math.prod(batch) * m, k)
    fn = {(1, TILE): qk.quantize_tile, (TILE, 1): qk.quantize_column, (TILE, TILE): qk.quantize_block}[block]
    with interpret_mode(interpret):
        data, scale = fn(x2, pow2_scale=pow2_scale)
    rows = -(-m // block[0]) * block[0]
    data = data.reshape(*batch, rows, data.shape[-1])
    scale = scale.reshape(*batch, rows // block[0], scale.shape[-1])
    return Fp8Tensor(data, scale, block, (m, k))


def quantize(
    x: jax.Array,
    block: Block = (1, TILE),
    *,
    pow2_scale: bool = False,
    impl: Impl = "xla",
    interpret: bool = False,
) -> Fp8Tensor:
    """Online E4M3 quantization of the last two axes of `x`, one FP32 scale per block.

    Args:
      x: floating array of shape `(..., M, K)` (bf16, f16, f32 or f64); leading axes are batch.
      block: `(1, 128)` tile-wise (per row, 128 along the last axis: activations), `(128, 1)` (per
        column, 128 rows: the Wgrad layout), `(128, 128)` block-wise (weights), any other
        `(bm, bk)`, or None for one scale per matrix (per-tensor, the baseline).
      pow2_scale: round every scale up to a power of two (UE8M0-compatible).
      impl: "xla" (default), "mosaic" (the fused Hopper kernels, bit-identical) or "auto" (the
        kernels on Hopper where they apply, else XLA).
      interpret: run the kernels in the Mosaic GPU interpreter.

    Returns:
      An `Fp8Tensor` whose `data` is padded with zeros up to whole blocks and whose `logical` holds
      `(M, K)`. A block that contains NaN or ±Inf gets a NaN scale and NaN data.
    """
    _check_block(block)
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
    if _use_kernels(x, block, impl, interpret):
        return _quantize_kernel(x, block, pow2_scale, interpret)
    *batch, m, k = x.shape
    if block is None:
        # One scale per matrix: the amax runs over both axes, nothing is padded.
        amax = jnp.max(abs_for_amax(x), axis=(-2, -1), keepdims=True, initial=0.0)
        scale = scale_from_amax(amax, pow2_scale)
        return Fp8Tensor(encode(x, scale), scale, None, (m, k))

    bm, bk = block
    mp, kp = _round_up(m, bm), _round_up(k, bk)
    pad = [(0, 0)] * len(batch) + [(0, mp - m), (0, kp - k)]
    xp = jnp.pad(x, pad)
    blocks = xp.reshape(*batch, mp // bm, bm, kp // bk, bk)  # [..., rows, bm, cols, bk]
    amax = jnp.max(abs_for_amax(blocks), axis=(-3, -1), initial=0.0)  # [..., rows, cols]
    scale = scale_from_amax(amax, pow2_scale)
    data = encode(blocks, scale[..., :, None, :, None]).reshape(*batch, mp, kp)
    return Fp8Tensor(data, scale, block, (m, k))


def quantize_weight(
    w: jax.Array,
    block: Block = (TILE, TILE),
    *,
    pow2_scale: bool = False,
    impl: Impl = "xla",
    interpret: bool = False,
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """`(q, q.mT)` for `q = quantize(w, block)`: a weight in both orientations.

    Fprop contracts W [K, N] over K and Dgrad over N, and FP8 wgmma needs the contracted axis
    contiguous, so a layer uses its quantized weight both as is and transposed. For (128, 128)
    blocks on the kernels' path one fused pass reads W once and writes both E4M3 copies
    (`pallas_kernels.quantize.quantize_block_and_transpose`); otherwise (the XLA path, other
    blocks) this is `quantize` followed by `.mT`. Bit-identical either way.

    Args:
      w: `(..., K, N)`, as for `quantize`. 2-D weights and one stack of them (experts,
        `(G, K, N)`, K a multiple of 128) take the fused kernel; other shapes the two passes.
      block, pow2_scale, impl, interpret: as for `quantize`.
    """
    w = jnp.asarray(w)
    fused = (
        block == (TILE, TILE)
        and w.ndim in (2, 3)
        and jnp.issubdtype(w.dtype, jnp.floating)
        and _use_kernels(w, block, impl, interpret)
    )
    if not fused:
        q = quantize(w, block, pow2_scale=pow2_scale, impl=impl, interpret=interpret)
        return q, q.mT
    from pallas_kernels import quantize as qk

    with interpret_mode(interpret):
        data, scale, data_t = qk.quantize_block_and_transpose(w, pow2_scale=pow2_scale)
    m, k = w.shape[-2:]
    q = Fp8Tensor(data, scale, block, (m, k))
    return q, Fp8Tensor(data_t, jnp.swapaxes(scale, -1, -2), block, (k, m))


def quantize_wgrad_operand(
    x: jax.Array, *, pow2_scale: bool = False, impl: Impl = "xla", interpret: bool = False
) -> Fp8Tensor:
    """x (T, C) -> its transpose (C, T) scaled per 128 tokens: `quantize(x, (128, 1)).mT`.

    The Wgrad operand layout (DeepSeek-V3's 128x1 tiles): the token axis is contracted, so it must
    be the contiguous one for FP8 wgmma. The kernel writes it transposed in the same pass.
    """
    x = jnp.asarray(x)
    if x.ndim == 2 and _use_kernels(x, (TILE, 1), impl, interpret):
        from pallas_kernels import quantize as qk

        with interpret_mode(interpret):
            data, scale = qk.quantize_column(x, pow2_scale=pow2_scale, transpose=True)
        return Fp8Tensor(data, scale, (1, TILE), (x.shape[1], x.shape[0]))
    return quantize(x, (TILE, 1), pow2_scale=pow2_scale).mT


def quantize_grad(
    dy: jax.Array, *, pow2_scale: bool = False, impl: Impl = "xla", interpret: bool = False
) -> tuple[Fp8Tensor, Fp8Tensor]:
    """dy (T, N) -> `(quantize(dy, (1, 128)), quantize_wgrad_operand(dy))`: its Dgrad operand in
    1x128 tiles and its Wgrad operand (dyᵀ scaled per 128 tokens).

    On the kernels' path one fused pass reads dy once and writes both
    (`pallas_kernels.quantize.quantize_tile_and_column_t`); otherwise it is the two calls.
    Bit-identical either way.
    """
    dy = jnp.asarray(dy)
    if dy.ndim == 2 and jnp.issubdtype(dy.dtype, jnp.floating) and _use_kernels(
        dy, (TILE, 1), impl, interpret
    ):
        from pallas_kernels import quantize as qk

        t, n = dy.shape
        with interpret_mode(interpret):
            data, scale, data_t, scale_t = qk.quantize_tile_and_column_t(dy, pow2_scale=pow2_scale)
        return Fp8Tensor(data, scale, (1, TILE), (t, n)), Fp8Tensor(data_t, scale_t, (1, TILE), (n, t))
    kw = dict(pow2_scale=pow2_scale, impl=impl, interpret=interpret)
    return quantize(dy, (1, TILE), **kw), quantize_wgrad_operand(dy, **kw)


def retile_wgrad_operand(
    t: Fp8Tensor, *, pow2_scale: bool = False, impl: Impl = "xla", interpret: bool = False
) -> Fp8Tensor:
    """The FP8 x saved by Fprop, (T, C) in (1, 128) tiles -> (C, T) scaled per 128 tokens.

    DeepSeek-V3 §3.5.2: dequantize, transpose, re-quantize; equal to
    `quantize(t.dequantize(jnp.float32), (128, 1)).mT`, one fused pass on Hopper.
    """
    if t.ndim == 2 and t.block == (1, TILE) and resolve_impl(impl, interpret) == "mosaic":
        from pallas_kernels import quantize as qk

        m, k = t.logical
        with interpret_mode(interpret):
            data, scale = qk.retile_tile_to_column_t(t.data, t.scale, m=m, k=k, pow2_scale=pow2_scale)
        return Fp8Tensor(data, scale, (1, TILE), (k, m))
    return quantize(t.dequantize(jnp.float32), (TILE, 1), pow2_scale=pow2_scale).mT
