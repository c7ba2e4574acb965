"""The reference tile-scaled GEMM: the numerics every jfp8 GEMM kernel reproduces.

DeepSeek-V3 §3.3 ("Increasing Accumulation Precision"): the tensor cores accumulate an FP8 GEMM
with limited precision, so partial sums are promoted to FP32 every N_C = 128 K-elements, and the
per-tile/per-block dequantization scales are applied at that moment. Here, in plain XLA:

    acc = 0                                   # [M, N] f32
    for c in range(K // 128):                 # in this order
        partial = dot(a[:, c], b[:, c].T)     # FP8 x FP8 -> f32, one 128-wide chunk
        acc = acc + partial * (sa[:, c, None] * sb[None, :, c])

Both operands are contracted on their last axis ("NT": a is (M, K), b is (N, K)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jfp8.fp8 import TILE, Fp8Tensor

_OUT_DTYPES = (jnp.bfloat16, jnp.float32)


def _check_operand(t: Fp8Tensor, name: str) -> None:
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"{name} must be an Fp8Tensor (from jfp8.quantize), got {type(t).__name__}")
    if t.ndim != 2:
        raise ValueError(
            f"{name} must be 2-D (rows, K), got shape {t.shape}; map batch axes with jax.vmap"
        )
    if t.block is not None and t.block[1] != TILE:
        hint = " (a (128, 1)-scaled operand is contracted on its rows: pass x.mT)" if t.block[1] == 1 else ""
        raise ValueError(
            f"{name} must be scaled per {TILE} elements along K (block (bm, {TILE})) or per tensor "
            f"(None), got block {t.block}{hint}"
        )


def check_nt_operands(a: Fp8Tensor, b: Fp8Tensor, out_dtype) -> None:
    """Validate an NT scaled-matmul call; shared by the reference and the kernels' front door."""
    _check_operand(a, "a")
    _check_operand(b, "b")
    if a.logical[1] != b.logical[1]:
        raise ValueError(
            f"contraction sizes differ: a is {a.shape} and b is {b.shape} (both contract their last "
            "axis: a is (M, K), b is (N, K))"
        )
    if jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in _OUT_DTYPES]:
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype)}")


def chunk_operand(t: Fp8Tensor, kp: int) -> tuple[jax.Array, jax.Array]:
    """Data cut to its logical rows and zero-padded to `kp` along K, and per-row chunk scales.

    Returns `(data [rows, kp] e4m3, scales [rows, kp // 128] f32)`: the scale of row r in K chunk c,
    whatever the operand's block shape (tile, block or per-tensor).
    """
    rows, k = t.logical
    data = t.data[:rows, :k]
    data = jnp.pad(data, ((0, 0), (0, kp - k)))
    chunks = kp // TILE
    if t.block is None:
        s = jnp.broadcast_to(t.scale.reshape(()), (rows, chunks))
    else:
        s = jnp.repeat(t.scale, t.block[0], axis=0)[:rows, :chunks]
    return data, s.astype(jnp.float32)


def zeros_accumulator(*rows_and_cols: tuple[jax.Array, jax.Array]) -> jax.Array:
    """An f32 [rows, cols] zero accumulator typed like its operands.

    Built from each (row operand, column operand) pair, as empty sums, rather than with
    `jnp.zeros`, so that inside `shard_map` it varies over the same mesh axes as the operands (a
    scan carry must keep its type). Each argument is `(r, c)` with r [rows, ...] and c [cols, ...].
    """

    def empty_sum(x):  # [len(x), 1] of +0.0, typed like x
        return x[:, :0].astype(jnp.float32).sum(axis=1, keepdims=True)

    acc = None
    for r, c in rows_and_cols:
        z = empty_sum(r) + empty_sum(c).T
        acc = z if acc is None else acc + z
    return acc


def scaled_matmul_reference(a: Fp8Tensor, b: Fp8Tensor, out_dtype=jnp.bfloat16) -> jax.Array:
    """`a @ b.T` with DeepSeek-V3's chunked FP32 accumulation.

    Args:
      a: (M, K) `Fp8Tensor` scaled per `(bm, 128)` block (tile-wise `(1, 128)` for activations) or
        per tensor.
      b: (N, K) `Fp8Tensor` scaled per `(bn, 128)` block: `(128, 128)` weights (Fprop, Dgrad),
        `(1, 128)` tiles (Wgrad, after `.mT` of the `(128, 1)`-scaled tensors) or per tensor.
      out_dtype: bfloat16 or float32.

    Returns:
      (M, N) array in `out_dtype`. Every jfp8 GEMM kernel computes exactly this.
    """
    check_nt_operands(a, b, out_dtype)
    m, k = a.logical
    n = b.logical[0]
    kp = -(-k // TILE) * TILE
    a_data, sa = chunk_operand(a, kp)
    b_data, sb = chunk_operand(b, kp)
    chunks = kp // TILE
    a_chunks = a_data.reshape(m, chunks, TILE).transpose(1, 0, 2)  # [C, M, 128]
    b_chunks = b_data.reshape(n, chunks, TILE).transpose(1, 0, 2)  # [C, N, 128]

    def promote(acc, xs):
        a_c, b_c, sa_c, sb_c = xs
        partial = jax.lax.dot_general(
            a_c, b_c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, N]
        return acc + partial * (sa_c[:, None] * sb_c[None, :]), None

    acc0 = zeros_accumulator((a_data, b_data), (sa, sb))
    acc, _ = jax.lax.scan(promote, acc0, (a_chunks, b_chunks, sa.T, sb.T))
    return acc.astype(out_dtype)


def dequantize_f64(t: Fp8Tensor) -> np.ndarray:
    """The exact value an `Fp8Tensor` represents, in float64 on the host (logical shape)."""
    data = np.asarray(t.data).astype(np.float64)
    scale = np.asarray(t.expanded_scale(jnp.float32)).astype(np.float64)
    m, k = t.logical
    return (data * scale)[..., :m, :k]


def scaled_matmul_oracle(a: Fp8Tensor, b: Fp8Tensor) -> np.ndarray:
    """The f64 oracle: dequantize both operands exactly and multiply in float64 (`a @ b.T`)."""
    return dequantize_f64(a) @ np.swapaxes(dequantize_f64(b), -1, -2)


def check_group_sizes(group_sizes: jax.Array, groups: int, rows: int) -> None:
    """Shape (groups,), integer dtype, and (when concrete) a sum of at most `rows`."""
    if group_sizes.ndim != 1 or group_sizes.shape[0] != groups:
        raise ValueError(
            f"group_sizes must have shape ({groups},), one size per group, got {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers (int32), got {group_sizes.dtype}")
    try:
        total = int(jnp.sum(group_sizes))
    except jax.errors.ConcretizationTypeError:
        return  # traced: the sizes are checked where they are concrete
    if total > rows:
        raise ValueError(f"group_sizes sum to {total}, more than the {rows} rows of the input")


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """[rows] int32: the group of each row for rows sorted by group; G for rows past the groups."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def grouped_scaled_matmul_reference(
    lhs: Fp8Tensor, rhs: Fp8Tensor, group_sizes: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:
    """Grouped (MoE) GEMM mirroring `jax.lax.ragged_dot`, with the chunked FP32 accumulation.

    Args:
      lhs: (T, K) `Fp8Tensor`, tile-scaled `(1, 128)` (or per tensor); rows sorted by group.
      rhs: (G, N, K) `Fp8Tensor`, one weight per group, block-scaled `(128, 128)`, stored K-major.
      group_sizes: (G,) int32; rows past `sum(group_sizes)` come out as zeros.

    Returns:
      (T, N): row t of group g is `scaled_matmul_reference(lhs[t], rhs[g])[t]`, bit for bit.
    """
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be (G, N, K), got shape {rhs.shape}")
    g, n, k = rhs.shape
    check_group_sizes(jnp.asarray(group_sizes), g, lhs.logical[0])
    ids = group_ids(group_sizes, lhs.logical[0])

    def one_group(carry, gi):
        w = jax.tree.map(lambda x: x[gi], rhs)
        w = Fp8Tensor(w.data, w.scale, rhs.block, rhs.logical)
        out = scaled_matmul_reference(lhs, w, jnp.float32)
        return jnp.where((ids == gi)[:, None], out, carry), None

    out0 = jnp.zeros((lhs.logical[0], n), jnp.float32)
    out, _ = jax.lax.scan(one_group, out0, jnp.arange(g))
    return out.astype(out_dtype)


def grouped_wgrad_reference(
    lhs_t: Fp8Tensor, rhs_t: Fp8Tensor, group_sizes: jax.Array, out_dtype=jnp.float32
) -> jax.Array:
    """Grouped GEMM along the contraction (token) axis: per group g, `lhs_g^T @ rhs_g` -> (G, K, N).

    The MoE Wgrad: `lhs_t` is `quantize(x, (128, 1)).mT` (K, T) and `rhs_t` is
    `quantize(dy, (128, 1)).mT` (N, T): both scaled per 128 tokens, tiles counted from token 0 of
    the whole sorted batch (a tile may straddle two groups). For group g, each 128-token chunk c
    that holds some of g's tokens adds `dot(lhs[:, c] * in_g, rhs[:, c].T) * (s_lhs * s_rhs)` in
    chunk order; chunks without tokens of g are skipped (so a NaN elsewhere does not leak in).
    """
    check_nt_operands(lhs_t, rhs_t, out_dtype)
    kdim, t = lhs_t.logical
    n = rhs_t.logical[0]
    sizes = jnp.asarray(group_sizes)
    check_group_sizes(sizes, sizes.shape[0], t)
    tp = -(-t // TILE) * TILE
    chunks = tp // TILE
    a_data, sa = chunk_operand(lhs_t, tp)  # [K, Tp], [K, C]
    b_data, sb = chunk_operand(rhs_t, tp)  # [N, Tp], [N, C]
    ids = jnp.pad(group_ids(sizes, t), (0, tp - t), constant_values=sizes.shape[0])
    zero = jnp.zeros((), a_data.dtype)

    def one_group(gi):
        in_g = (ids == gi).reshape(chunks, TILE)  # [C, 128]
        a_c = jnp.where(in_g[:, None, :], a_data.reshape(kdim, chunks, TILE).transpose(1, 0, 2), zero)
        b_c = b_data.reshape(n, chunks, TILE).transpose(1, 0, 2)

        def promote(acc, xs):
            a_i, b_i, sa_i, sb_i, live = xs
            partial = jax.lax.dot_general(
                a_i, b_i, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            return jnp.where(live, acc + partial * (sa_i[:, None] * sb_i[None, :]), acc), None

        acc0 = zeros_accumulator((a_data, b_data), (sa, sb))
        acc, _ = jax.lax.scan(promote, acc0, (a_c, b_c, sa.T, sb.T, in_g.any(axis=1)))
        return acc

    return jax.lax.map(one_group, jnp.arange(sizes.shape[0])).astype(out_dtype)
