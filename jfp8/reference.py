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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jfp8.fp8 import TILE, Fp8Tensor, as_bytes, from_bytes, move_bytes
from pallas_kernels.schedule import row_tile_work  # noqa: F401  shared with the kernels (and jfp8.ops)

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
    data = move_bytes(lambda d: zero_past_k(d[:rows], k, kp), t.data)
    chunks = kp // TILE
    if t.block is None:
        s = jnp.broadcast_to(t.scale.reshape(()), (rows, chunks))
    else:
        s = jnp.repeat(t.scale, t.block[0], axis=0)[:rows, :chunks]
    return data, s.astype(jnp.float32)


def zero_past_k(d: jax.Array, k: int, kp: int) -> jax.Array:
    """d [..., >= k] -> [..., kp]: its first k columns, zeros after.

    Where `d` is at least `kp` wide (every blocked operand: its data is padded to whole blocks)
    the columns past k are masked to zero in place rather than sliced off and padded back: the
    same array, but XLA:CPU fuses a pad into its producer (the quantizer) as per-element index
    tests that keep the whole fusion from vectorizing (measured: quantize + this + the dot's
    f32 operand on [2048, 64] -> [2048, 128], 0.91 ms with the pad, 0.22 ms masked; issue 44).
    Per-tensor operands are stored unpadded and are padded.
    """
    if d.shape[-1] < kp:
        return jnp.pad(d[..., :k], [(0, 0)] * (d.ndim - 1) + [(0, kp - k)])
    d = d[..., :kp]
    if k == kp:
        return d
    col = jax.lax.broadcasted_iota(jnp.int32, d.shape, d.ndim - 1)
    return jnp.where(col < k, d, jnp.zeros((), d.dtype))


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
    kp = -(-a.logical[1] // TILE) * TILE
    return chunked_matmul(*chunk_operand(a, kp), *chunk_operand(b, kp), k=a.logical[1]).astype(out_dtype)


# Up to this many K chunks the promotion loop is unrolled (one dot per chunk, no while loop: faster
# on the CPU at small shapes); longer contractions (Wgrad over tokens) keep the scan, which is
# faster there. Same bits either way.
MAX_UNROLLED_CHUNKS = 8
_NT = (((1,), (1,)), ((), ()))  # dot_general dimension numbers: a [M, k] . b [N, k] -> [M, N]
# The last chunk's dot stops at the first multiple of this past K (see `chunked_matmul`).
CHUNK_TAIL_MULTIPLE = 32


def chunk_width(k: int | None, c: int) -> int:
    """The columns of K chunk `c` that its dot takes: all 128, or for the last chunk of a
    contraction of logical width `k` its first multiple of `CHUNK_TAIL_MULTIPLE` past `k` (the
    columns after it hold zeros). `k=None`: all 128."""
    if k is None:
        return TILE
    return max(0, min(TILE, -(-(k - c * TILE) // CHUNK_TAIL_MULTIPLE) * CHUNK_TAIL_MULTIPLE))


@functools.partial(jax.jit, static_argnames="k")
def chunked_matmul(a_data, sa, b_data, sb, k: int | None = None) -> jax.Array:
    """The promotion loop on chunk-laid-out operands: a_data [M, Kp], sa [M, C], b_data [N, Kp],
    sb [N, C] -> f32 [M, N] = sum over chunks c, in order, of dot(a_c, b_c) * (sa_c * sb_c).

    `k`, the contraction's logical width (columns past it zero in both operands), lets the last
    chunk's dot skip the zero columns past `chunk_width(k, c)`: the dot of a chunk whose columns
    past some multiple of 32 are zero gives the same f32 bits with or without them on XLA:CPU
    (checked at 3,150 shapes, M 1-2048, N 1-1024, every multiple of 8 below 128: zero products
    add nothing to a sum, and the kept columns' order is the same), and at `tiny`'s widths (32,
    64) it halves or quarters the FP8 GEMMs' work on the CPU (issue 44). Short of a multiple of 8
    the bits moved (K 100, 127).

    XLA:CPU contracts each promotion `partial * scale + acc` into one FMA per element. Unrolled,
    an optimization barrier ends each promotion, as the scan's loop does, so that XLA cannot fuse
    two promotions into one expression and pick another product to contract (measured: other
    bits). Jitted so that eager calls compile the same fusions (and bits) as traced ones.
    """
    (m, kp), n = a_data.shape, b_data.shape[0]
    chunks = kp // TILE
    acc = zeros_accumulator((a_data, b_data), (sa, sb))
    if chunks <= MAX_UNROLLED_CHUNKS:
        for c in range(chunks):
            cols = slice(c * TILE, c * TILE + chunk_width(k, c))
            partial = jax.lax.dot_general(a_data[:, cols], b_data[:, cols], _NT, preferred_element_type=jnp.float32)
            acc = jax.lax.optimization_barrier(partial * (sa[:, c, None] * sb[None, :, c]) + acc)  # [M, N]
        return acc

    # The chunks enter the loop as bytes (`as_bytes`): a while loop over f8 arrays XLA:CPU carries
    # in f16, converting them in and out.
    a_chunks = as_bytes(a_data).reshape(m, chunks, TILE).transpose(1, 0, 2)  # [C, M, 128]
    b_chunks = as_bytes(b_data).reshape(n, chunks, TILE).transpose(1, 0, 2)  # [C, N, 128]

    def promote(acc, xs):
        a_c, b_c, sa_c, sb_c = xs
        a_c, b_c = from_bytes(a_c, a_data.dtype), from_bytes(b_c, b_data.dtype)
        partial = jax.lax.dot_general(a_c, b_c, _NT, preferred_element_type=jnp.float32)  # [M, N]
        return partial * (sa_c[:, None] * sb_c[None, :]) + acc, None

    acc, _ = jax.lax.scan(promote, acc, (a_chunks, b_chunks, sa.T, sb.T))
    return acc


def exact_f32(data: jax.Array) -> jax.Array:
    """An FP8 operand's values in f32 (exact), for the grouped references to convert once.

    Their dots then take f32 operands, which is what XLA:CPU multiplies anyway (it converts an f8
    dot operand to f32 first; same products, same sums, same bits), but each element is converted
    once instead of once per work item that reads it: a weight was converted again for every row
    tile of its group (39 ms of thread time in the FP8 `small` eval step, 339 ms, on the 2-core
    machine; grouped Fprop at 8192 x 256 -> 512, 16 groups: 16-18 -> 11-14 ms; issue 44). The
    dense `chunked_matmul` keeps converting per chunk: there f32 operands were no faster, and its
    scan over the transposed chunks slower (it moves 4 bytes per element instead of 1). Other
    dtypes pass through. On every platform: where the reference runs on a GPU (`impl="xla"`, or
    `"auto"` without the kernels) the f32 copies take 4 bytes per element beside the FP8 data
    while the op runs (an expert weight bank of 1 GB in E4M3 needs 4 GB more).
    """
    return data.astype(jnp.float32) if jnp.dtype(data.dtype).itemsize == 1 else data


def rel_error(x, ref) -> float:
    """||x - ref||_F / ||ref||_F in float64: 0 when both are 0, inf when only ref is, NaN when x
    holds a NaN (so every `<=` check fails). The one normwise error of the library, its tests and
    experiments."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    num, den = float(np.linalg.norm(x - ref)), float(np.linalg.norm(ref))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


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


# Rows per work item of the grouped references: each (row tile, group) pair is one item, so the
# work is about (T + G * REF_TILE_M) rows instead of G * T.
REF_TILE_M = 256


def ragged_dot_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The non-FP8 grouped GEMM (the BF16 baseline's experts): `jax.lax.ragged_dot(x, w,
    group_sizes)` in x's dtype with an FP32 accumulator, computed one (row tile, group) work item at
    a time: about (T + G * tile) rows of work. (XLA lowers ragged_dot to a dense masked dot, G times
    the FLOPs, on CPU and GPU.)"""
    t, g, n = x.shape[0], w.shape[0], w.shape[2]
    tm = REF_TILE_M
    tp = -(-t // tm) * tm
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))
    w = w.astype(x.dtype)

    def item(out, it):
        gi, tile, lo, hi = it
        row0 = tile * tm
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(xp, row0, tm), w[jnp.minimum(gi, g - 1)],
                    preferred_element_type=jnp.float32)
        rows = row0 + jnp.arange(tm)
        keep = (rows >= lo) & (rows < hi) & (gi < g)
        cur = jax.lax.dynamic_slice_in_dim(out, row0, tm)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep[:, None], y, cur), row0, 0), None

    out0 = jnp.zeros((tp, n), jnp.float32) + xp[:, :0].sum(1, keepdims=True).astype(jnp.float32)
    out, _ = jax.lax.scan(item, out0, row_tile_work(group_sizes, t, tm))
    return out[:t].astype(x.dtype)


def ragged_dot_grads_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, dy: jax.Array):
    """(dx, dw) of `ragged_dot_reference(x, w, group_sizes)` for the cotangent dy: its autodiff,
    the same operations a gradient through it has always run (dx in x's dtype, dw in w's)."""
    _, vjp = jax.vjp(lambda x, w: ragged_dot_reference(x, w, group_sizes), x, w)
    return vjp(dy)


def grouped_scaled_matmul_reference(
    lhs: Fp8Tensor, rhs: Fp8Tensor, group_sizes: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:
    """Grouped (MoE) GEMM mirroring `jax.lax.ragged_dot`, with the chunked FP32 accumulation.

    Args:
      lhs: (T, K) `Fp8Tensor`, tile-scaled `(1, 128)` (or per tensor); rows sorted by group.
      rhs: (G, N, K) `Fp8Tensor`, one weight per group, block-scaled `(128, 128)`, stored K-major.
      group_sizes: (G,) int32; rows past `sum(group_sizes)` come out as zeros.

    Returns:
      (T, N): row t of group g is row t of `scaled_matmul_reference(lhs, rhs[g])`: the same
      per-row promotion, computed tile by tile (each row tile once per group it holds).
    """
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be (G, N, K), got shape {rhs.shape}")
    g, n, k = rhs.shape
    check_group_sizes(jnp.asarray(group_sizes), g, lhs.logical[0])
    check_nt_operands(lhs, Fp8Tensor(rhs.data[0], rhs.scale[0], rhs.block, rhs.logical), out_dtype)
    t = lhs.logical[0]
    kp = -(-k // TILE) * TILE
    a_data, sa = chunk_operand(lhs, kp)
    b_data, sb = jax.vmap(lambda d, s: chunk_operand(Fp8Tensor(d, s, rhs.block, rhs.logical), kp))(
        rhs.data, rhs.scale
    )  # [G, N, Kp], [G, N, C]
    tm = REF_TILE_M
    tp = -(-t // tm) * tm
    a_data = exact_f32(move_bytes(lambda d: jnp.pad(d, ((0, tp - t), (0, 0))), a_data))
    b_data = exact_f32(b_data)
    sa = jnp.pad(sa, ((0, tp - t), (0, 0)))
    items = row_tile_work(jnp.asarray(group_sizes), t, tm)  # (group, tile, lo, hi)

    def item(out, it):
        gi, tile, lo, hi = it
        row0 = tile * tm
        a_t = jax.lax.dynamic_slice_in_dim(a_data, row0, tm)
        sa_t = jax.lax.dynamic_slice_in_dim(sa, row0, tm)
        gw = jnp.minimum(gi, g - 1)  # the pseudo-group G (rows past the total) keeps zeros
        y = chunked_matmul(a_t, sa_t, b_data[gw], sb[gw], k=k)  # [tm, N]
        rows = row0 + jnp.arange(tm)
        keep = (rows >= lo) & (rows < hi) & (gi < g)
        cur = jax.lax.dynamic_slice_in_dim(out, row0, tm)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep[:, None], y, cur), row0, 0), None

    out0 = zeros_accumulator((a_data, b_data[0]), (sa, sb[0]))
    out, _ = jax.lax.scan(item, out0, items)
    return out[:t].astype(out_dtype)


def _chunk_work(group_sizes: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
    """The (group, 128-token chunk) pairs in which a group holds tokens, group-major and in chunk
    order, padded to the static bound cdiv(tokens, 128) + G with group = G (unused)."""
    groups = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    first = starts // TILE
    count = jnp.where(ends > starts, (ends - 1) // TILE - first + 1, 0)
    item_ends = jnp.cumsum(count)
    items = jnp.arange(-(-tokens // TILE) + groups, dtype=jnp.int32)
    # One fusion, not a while loop: as `pallas_kernels.schedule.row_tile_work`.
    group = jnp.searchsorted(item_ends, items, side="right", method="compare_all").astype(jnp.int32)
    gc = jnp.minimum(group, groups - 1)
    chunk = first[gc] + items - (item_ends[gc] - count[gc])
    return group, jnp.where(group < groups, chunk, 0)


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
    groups = sizes.shape[0]
    tp = -(-t // TILE) * TILE
    a_data, sa = chunk_operand(lhs_t, tp)  # [K, Tp], [K, C]
    b_data, sb = chunk_operand(rhs_t, tp)  # [N, Tp], [N, C]
    a_data, b_data = exact_f32(a_data), exact_f32(b_data)
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    starts = ends - sizes.astype(jnp.int32)
    zero = jnp.zeros((), a_data.dtype)

    def item(acc, it):
        gi, c = it
        used = gi < groups
        gc = jnp.minimum(gi, groups - 1)
        tok = c * TILE + jnp.arange(TILE)
        in_g = (tok >= starts[gc]) & (tok < ends[gc])  # this group's tokens of chunk c
        a_c = jnp.where(in_g[None, :], jax.lax.dynamic_slice_in_dim(a_data, c * TILE, TILE, 1), zero)
        b_c = jax.lax.dynamic_slice_in_dim(b_data, c * TILE, TILE, 1)
        partial = jax.lax.dot_general(
            a_c, b_c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [K, N]
        sa_c = jax.lax.dynamic_index_in_dim(sa, c, 1, keepdims=False)
        sb_c = jax.lax.dynamic_index_in_dim(sb, c, 1, keepdims=False)
        new = acc[gc] + partial * (sa_c[:, None] * sb_c[None, :])
        return acc.at[gc].set(jnp.where(used, new, acc[gc])), None

    acc0 = jnp.broadcast_to(zeros_accumulator((a_data, b_data), (sa, sb)), (groups, kdim, n))
    acc, _ = jax.lax.scan(item, acc0, _chunk_work(sizes, t))
    return acc.astype(out_dtype)
