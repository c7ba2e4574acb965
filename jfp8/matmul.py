"""The public tile-scaled GEMMs: one front door, the XLA reference or the Mosaic GPU kernels.

Every path computes `scaled_matmul_reference`'s numerics (chunked FP32 accumulation, DeepSeek-V3
§3.3); the kernels take raw arrays, so this module lays `Fp8Tensor`s out the way they expect.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jfp8.backend import Impl, resolve_impl
from jfp8.fp8 import TILE, Fp8Tensor
from jfp8.reference import (
    check_nt_operands,
    chunk_operand,
    grouped_scaled_matmul_reference,
    grouped_wgrad_reference,
    scaled_matmul_reference,
)
from pallas_kernels._mgpu import interpret_mode

_BLOCK = (TILE, TILE)


def _padded_k(t: Fp8Tensor) -> int:
    return -(-t.logical[1] // TILE) * TILE


def _k_padded_data(t: Fp8Tensor, kp: int) -> jax.Array:
    """`t.data` with exactly `kp` columns (per-tensor operands are stored unpadded)."""
    if t.data.shape[-1] == kp:
        return t.data
    k = t.logical[1]
    return jnp.pad(t.data[..., :k], [(0, 0)] * (t.data.ndim - 1) + [(0, kp - k)])


def scaled_matmul(
    a: Fp8Tensor,
    b: Fp8Tensor,
    *,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """`a @ b.T` for FP8 operands with DeepSeek-V3's per-128-K promotion to FP32.

    Args:
      a: (M, K) `Fp8Tensor`, tile-scaled `(1, 128)` (also accepted: `(bm, 128)` blocks, per tensor).
      b: (N, K) `Fp8Tensor`: `(128, 128)` blocks (Fprop/Dgrad), `(1, 128)` tiles (Wgrad) or per
        tensor.
      out_dtype: bfloat16 or float32.
      impl: "xla" (reference), "mosaic" (Hopper kernels) or "auto" (kernels on Hopper).
      interpret: run the Mosaic GPU kernels in the GPU interpreter (CPU; slow, for tests).

    Returns:
      (M, N) in `out_dtype`, equal to `scaled_matmul_reference(a, b, out_dtype)`.
    """
    check_nt_operands(a, b, out_dtype)
    if resolve_impl(impl, interpret) == "xla":
        return scaled_matmul_reference(a, b, out_dtype)
    from pallas_kernels import gemm

    kp = _padded_k(a)
    a_data, a_scale = chunk_operand(a, kp)
    if b.block == _BLOCK:
        b_data, b_scale, b_rows = _k_padded_data(b, kp), b.scale, TILE
    else:  # per-row scales serve every other layout (tiles, per tensor, other block heights)
        b_data, b_scale = chunk_operand(b, kp)
        b_rows = 1
    with interpret_mode(interpret):
        return gemm.scaled_matmul(
            a_data, a_scale, b_data, b_scale, n=b.logical[0], b_block_rows=b_rows, out_dtype=out_dtype
        )


def _check_grouped_rhs(b: Fp8Tensor) -> None:
    if not isinstance(b, Fp8Tensor) or b.ndim != 3:
        raise ValueError(f"b must be a (G, N, K) Fp8Tensor, one weight per group; got {getattr(b, 'shape', b)}")


def grouped_scaled_matmul(
    a: Fp8Tensor,
    b: Fp8Tensor,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """MoE grouped GEMM mirroring `jax.lax.ragged_dot(a, b, group_sizes)` with B stored K-major.

    Args:
      a: (T, K) tile-scaled `Fp8Tensor`, rows sorted by group.
      b: (G, N, K) `Fp8Tensor`, `(128, 128)`-block scaled, one weight per group.
      group_sizes: (G,) int32, any sizes (0 too); rows past their sum come out as zeros.

    Returns:
      (T, N) in `out_dtype`, equal to `grouped_scaled_matmul_reference`.
    """
    _check_grouped_rhs(b)
    if resolve_impl(impl, interpret) == "xla":
        return grouped_scaled_matmul_reference(a, b, group_sizes, out_dtype)
    if b.block != _BLOCK:
        raise NotImplementedError(
            f"the grouped kernel takes (128, 128)-block weights, got block {b.block}; use impl='xla'"
        )
    check_nt_operands(a, Fp8Tensor(b.data[0], b.scale[0], b.block, b.logical), out_dtype)
    from pallas_kernels import grouped_gemm

    kp = _padded_k(a)
    a_data, a_scale = chunk_operand(a, kp)
    with interpret_mode(interpret):
        return grouped_gemm.grouped_scaled_matmul(
            a_data,
            a_scale,
            _k_padded_data(b, kp),
            b.scale,
            jnp.asarray(group_sizes, jnp.int32),
            n=b.logical[0],
            out_dtype=out_dtype,
        )


def grouped_wgrad_matmul(
    a_t: Fp8Tensor,
    b_t: Fp8Tensor,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.float32,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Per group g, `a_g^T @ b_g` contracted over the (token) rows: the MoE Wgrad -> (G, K, N).

    Args:
      a_t: (K, T) `Fp8Tensor` of x^T scaled per 128 tokens: `quantize(x, (128, 1)).mT`.
      b_t: (N, T) `Fp8Tensor` of dy^T, likewise.
      group_sizes: (G,) int32 token counts per group (tokens sorted by group).

    Returns:
      (G, K, N) in `out_dtype` (float32 by default), equal to `grouped_wgrad_reference`.
    """
    check_nt_operands(a_t, b_t, out_dtype)
    if resolve_impl(impl, interpret) == "xla":
        return grouped_wgrad_reference(a_t, b_t, group_sizes, out_dtype)
    from pallas_kernels import grouped_wgrad

    tp = _padded_k(a_t)
    a_data, a_scale = chunk_operand(a_t, tp)
    b_data, b_scale = chunk_operand(b_t, tp)
    with interpret_mode(interpret):
        return grouped_wgrad.grouped_wgrad(
            a_data, a_scale, b_data, b_scale, jnp.asarray(group_sizes, jnp.int32),
            t=a_t.logical[1], out_dtype=out_dtype,
        )
