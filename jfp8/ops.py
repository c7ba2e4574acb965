"""FP8 training ops: `fp8_linear`, `grouped_fp8_linear` and `gathered_grouped_fp8_linear` (an MoE's
dispatch fused into its first expert GEMM; `take_rows`, the dispatch's gather, whose gradient is a
gather too); `fp8_dot_general`, the drop-in for `lax.dot_general` and Flax, is built on `fp8_linear`
in `jfp8.dot_general`. Each takes its weight's FP8 copies ready-made where given (`fp8_weight`): a
weight quantized once and used by many calls (frozen weights, an eval loop over many batches, the
micro-batches of one update) is not quantized again by each.

Each is a `jax.custom_vjp` whose three GEMMs follow DeepSeek-V3 §3.3 (Figure 6):
  Fprop  y  = x · W      x in 1x128 tiles, W in 128x128 blocks
  Dgrad  dx = dy · Wᵀ    dy in 1x128 tiles, the same W blocks transposed
  Wgrad  dW = xᵀ · dy    both scaled per 128 tokens; x's operand is its FP8 tiles dequantized and
                         re-tiled (§3.5.2), made in the forward pass with the tiles from one read
                         of x (`quantize_activation`) and kept for the backward; dW in FP32
The residuals are FP8 data + scales (about half the bytes of bf16 inputs), not the inputs. With
`Fp8Recipe.off()` the grouped ops are BF16 ragged dots (`jfp8.api.ragged_dot`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jfp8.api import (
    grouped_scaled_matmul,
    grouped_wgrad_matmul,
    quantize,
    quantize_activation,
    quantize_grad,
    quantize_weight,
    quantize_wgrad_operand,
    ragged_dot,
    ragged_dot_grads,
    retile_wgrad_operand,
    scaled_matmul,
)
from jfp8.fp8 import TILE, Fp8Tensor, move_bytes
from jfp8.recipe import Fp8Recipe
from jfp8.reference import check_group_sizes, ragged_dot_reference as _ragged

DEFAULT_RECIPE = Fp8Recipe()
_IO_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _check_float(name: str, x: jax.Array) -> None:
    if jnp.dtype(x.dtype) not in _IO_DTYPES:
        raise TypeError(
            f"{name} must be bfloat16 or float32, got {x.dtype}; cast it first (e.g. x.astype(jnp.bfloat16))"
        )


def _plain_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """The non-FP8 GEMM: inputs in x's dtype, FP32 accumulation, output in x's dtype."""
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def _varying(x: jax.Array) -> frozenset | None:
    """The mesh axes x varies over inside `shard_map` (empty outside); None if jax does not say."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return None if mat is None else frozenset(mat.varying)


def _vary_like(a: jax.Array, *others: jax.Array) -> jax.Array:
    """`a`, typed as varying over every mesh axis any of `others` varies over: `a + 0`, the zero an
    empty sum over each of `others`, where that adds an axis; `a` itself otherwise.

    Inside `shard_map`, a replicated weight used with sharded activations must enter a custom_vjp
    typed as varying over the activations' mesh axes: its FP8 gradient, computed from sharded
    tensors, varies over them, and autodiff then inserts the psum (the transpose of this implicit
    broadcast) exactly as it does for a plain matmul. Outside shard_map (and where `a` already
    varies over those axes) nothing is added: no ops to trace, and XLA's common-subexpression pass
    sees the very same operand in every layer that quantizes it.
    """
    mine = _varying(a)
    if mine is not None and all((v := _varying(o)) is not None and v <= mine for o in others):
        return a
    zero = sum(o.ravel()[:0].astype(a.dtype).sum() for o in others)
    return a + zero


def _q(x: jax.Array, block, recipe: Fp8Recipe, amax_floor: float) -> Fp8Tensor:
    """x quantized in `block` with the recipe's scale rule and the floor of x's role."""
    return quantize(x, block, pow2_scale=recipe.pow2_scale, amax_floor=amax_floor, impl=recipe.quantizer_impl,
                    interpret=recipe.interpret)


def _q_weight(w: jax.Array, recipe: Fp8Recipe) -> tuple[Fp8Tensor | None, Fp8Tensor | None]:
    """W [..., K, N] -> (its FP8 copy for Dgrad, its transpose for Fprop), each None when that
    GEMM is not FP8. With both, one fused pass writes the two orientations (`quantize_weight`)."""
    if not (recipe.fprop or recipe.dgrad):
        return None, None
    if recipe.fprop and recipe.dgrad and recipe.fuse_quantizers:
        return quantize_weight(
            w, recipe.weight_block, pow2_scale=recipe.pow2_scale, amax_floor=recipe.weight_amax_floor,
            impl=recipe.quantizer_impl, interpret=recipe.interpret,
        )
    qw = _q(w, recipe.weight_block, recipe, recipe.weight_amax_floor)
    return (qw if recipe.dgrad else None), (qw.mT if recipe.fprop else None)


def _weight_key(recipe: Fp8Recipe) -> tuple:
    """The recipe's fields that a weight's FP8 copies depend on (not `impl`: the kernels and the
    reference quantize to the same bits)."""
    return (recipe.fprop, recipe.dgrad, recipe.weight_block, recipe.pow2_scale, recipe.weight_amax_floor)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("dgrad", "fprop"), meta_fields=("shape", "key"))
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight's FP8 copies, quantized once for a recipe (`fp8_weight`), for the ops' `w_fp8`.

    Attributes:
      dgrad: W [..., K, N] in the recipe's weight blocks (Dgrad's operand), or None where Dgrad is
        not FP8.
      fprop: Wᵀ [..., N, K], the same blocks transposed (Fprop's operand), or None where Fprop is
        not FP8.
      shape: static: the master weight's shape.
      key: static: the recipe's fields the copies depend on (its FP8 GEMMs, weight block, scale
        rule and weight amax floor); an op run with another recipe refuses the copies.
    """

    dgrad: Fp8Tensor | None
    fprop: Fp8Tensor | None
    shape: tuple[int, ...]
    key: tuple


def fp8_weight(w: jax.Array, recipe: Fp8Recipe = DEFAULT_RECIPE) -> Fp8Weight:
    """W's FP8 copies under `recipe`, for `fp8_linear(x, w, recipe, w_fp8=...)` (and the grouped
    ops): the same bits the op would quantize itself, so passing them changes no result, only how
    often W is read and quantized. No gradient flows through them: the op's dW goes to `w`.

    Args:
      w: (K, N) or (G, K, N) master weight, float32 or bfloat16.
      recipe: the recipe of the ops that will use the copies.
    """
    w = jnp.asarray(w)
    _check_float("w", w)
    if w.ndim not in (2, 3):
        raise ValueError(f"w must be a (K, N) matrix or (G, K, N) experts' weights, got shape {w.shape}")
    qw, qw_t = _q_weight(jax.lax.stop_gradient(w.astype(jnp.float32)), recipe) if recipe.enabled else (None, None)
    return Fp8Weight(qw, qw_t, tuple(w.shape), _weight_key(recipe))


def _checked_fp8_weight(w_fp8, w: jax.Array, recipe: Fp8Recipe) -> Fp8Weight | None:
    """`w_fp8` if it holds `w`'s copies under `recipe` (None for None), else a clear error."""
    if w_fp8 is None:
        return None
    if not isinstance(w_fp8, Fp8Weight):
        raise TypeError(f"w_fp8 must be an Fp8Weight made by jfp8.fp8_weight(w, recipe), got {type(w_fp8).__name__}")
    if tuple(w_fp8.shape) != tuple(w.shape):
        raise ValueError(f"w_fp8 holds the copies of a {w_fp8.shape} weight, but w is {w.shape}: make it with "
                         "jfp8.fp8_weight(w, recipe) from this w")
    if w_fp8.key != _weight_key(recipe):
        fields = ("fprop", "dgrad", "weight_block", "pow2_scale", "weight_amax_floor")
        diff = ", ".join(f"{f}={a!r} (op's {b!r})" for f, a, b in zip(fields, w_fp8.key, _weight_key(recipe)) if a != b)
        raise ValueError(f"w_fp8 was quantized under another recipe ({diff}): make it with jfp8.fp8_weight(w, recipe) "
                         "and the recipe the op runs with")
    return w_fp8


def _weights(w: jax.Array, w_fp8: Fp8Weight | None, recipe: Fp8Recipe) -> tuple[Fp8Tensor | None, Fp8Tensor | None]:
    """(W's Dgrad copy, its Fprop copy): the given ones, or quantized here (`_q_weight`)."""
    return _q_weight(w, recipe) if w_fp8 is None else (w_fp8.dgrad, w_fp8.fprop)


def _vary_tree(tree, *others):
    return jax.tree.map(lambda a: _vary_like(a, *others), tree)


def _mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype, recipe: Fp8Recipe) -> jax.Array:
    return scaled_matmul(a, b, out_dtype=out_dtype, impl=recipe.impl, interpret=recipe.interpret)


class _Retiled(NamedTuple):
    """A residual that is already the Wgrad operand xᵀ (per 128 tokens), re-tiled in the forward
    pass from the FP8 x (`quantize_activation`), where the backward would otherwise re-tile it."""

    t: Fp8Tensor


def _q_x(x: jax.Array, recipe: Fp8Recipe, backward: bool = True) -> tuple[Fp8Tensor | None, Fp8Tensor | _Retiled | jax.Array | None]:
    """x -> (its Fprop operand or None, what the backward keeps of x for Wgrad; None without
    `backward`: the op's primal, outside autodiff, quantizes x for Fprop alone).

    With DeepSeek-V3's scaling for Fprop and Wgrad, one pass (`quantize_activation`) writes x's
    1x128 tiles and their re-tiling for Wgrad, and the backward keeps the latter (the same bytes
    as the FP8 copy it would re-tile), so x is read once. Otherwise x's FP8 copy (or x itself when
    Wgrad is not FP8) is kept and `_wgrad_x` re-tiles it."""
    if not backward:
        return (_q(x, recipe.activation_block, recipe, recipe.activation_amax_floor) if recipe.fprop else None), None
    if recipe.fprop and recipe.wgrad and recipe.fuse_quantizers and recipe.activation_block == (1, TILE):
        qx, qx_t = quantize_activation(
            x, pow2_scale=recipe.pow2_scale, amax_floor=recipe.activation_amax_floor, impl=recipe.quantizer_impl,
            interpret=recipe.interpret,
        )
        return qx, _Retiled(qx_t)
    qx = _q(x, recipe.activation_block, recipe, recipe.activation_amax_floor) if (recipe.fprop or recipe.wgrad) else None
    return qx, (qx if recipe.wgrad else x)


def _wgrad_x(saved: Fp8Tensor | _Retiled, recipe: Fp8Recipe) -> Fp8Tensor:
    """xᵀ scaled per 128 tokens, from the FP8 x saved by Fprop (dequantize, re-tile, §3.5.2)."""
    if isinstance(saved, _Retiled):
        return saved.t
    if recipe.wgrad_block is None:
        if saved.block is None:
            return saved.mT
        return _q(saved.dequantize(), None, recipe, recipe.activation_amax_floor).mT
    return retile_wgrad_operand(
        saved, pow2_scale=recipe.pow2_scale, amax_floor=recipe.activation_amax_floor, impl=recipe.quantizer_impl,
        interpret=recipe.interpret,
    )


def _wgrad_dy(dy: jax.Array, recipe: Fp8Recipe) -> Fp8Tensor:
    """dyᵀ scaled per 128 tokens (or per tensor for the per-tensor baseline)."""
    if recipe.wgrad_block is None:
        return _q(dy, None, recipe, recipe.grad_amax_floor).mT
    return quantize_wgrad_operand(
        dy, pow2_scale=recipe.pow2_scale, amax_floor=recipe.grad_amax_floor, impl=recipe.quantizer_impl,
        interpret=recipe.interpret,
    )


def _q_grad(dy: jax.Array, recipe: Fp8Recipe) -> tuple[Fp8Tensor | None, Fp8Tensor | None]:
    """dy -> (its Dgrad operand, its Wgrad operand dyᵀ), each None when that GEMM is not FP8.
    With DeepSeek-V3's scaling for both, one fused pass reads dy once (`quantize_grad`)."""
    if recipe.dgrad and recipe.wgrad and recipe.fuse_quantizers and (
        recipe.grad_block, recipe.wgrad_block
    ) == ((1, TILE), (TILE, 1)):
        return quantize_grad(
            dy, pow2_scale=recipe.pow2_scale, amax_floor=recipe.grad_amax_floor, impl=recipe.quantizer_impl,
            interpret=recipe.interpret,
        )
    return (
        _q(dy, recipe.grad_block, recipe, recipe.grad_amax_floor) if recipe.dgrad else None,
        _wgrad_dy(dy, recipe) if recipe.wgrad else None,
    )


# ------------------------------------------------------------------------------ dense linear


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear(x: jax.Array, w: jax.Array, w_fp8: Fp8Weight | None, recipe: Fp8Recipe) -> jax.Array:
    return _linear_fwd(x, w, w_fp8, recipe, backward=False)[0]


def _linear_fwd(x, w, w_fp8, recipe: Fp8Recipe, backward: bool = True):
    """x [M, K], w [K, N] -> y [M, N]; residuals are FP8 where the backward GEMM is FP8. With
    `w_fp8`, W's copies are taken from it (W itself is then read only by a GEMM that is not FP8)."""
    qx, x_res = _q_x(x, recipe, backward)
    qw, qw_t = _weights(w, w_fp8, recipe)  # [K, N], [N, K]
    y = _mm(qx, qw_t, x.dtype, recipe) if recipe.fprop else _plain_dot(x, w)
    return y, (x_res, qw if recipe.dgrad else w)


def _linear_bwd(recipe: Fp8Recipe, residuals, dy):
    x_res, w_res = residuals
    x_dtype = dy.dtype  # y, hence dy, has x's dtype
    q_dy, q_dy_t = _q_grad(dy, recipe)
    if recipe.dgrad:  # dx [M, K] = dy [M, N] · Wᵀ: b is W [K, N] itself (contracted on N)
        dx = _mm(q_dy, w_res, x_dtype, recipe)
    else:
        dx = _plain_dot(dy, w_res.T)
    if recipe.wgrad:  # dW [K, N] = xᵀ [K, M] · dy [M, N], both scaled per 128 tokens
        dw = _mm(_wgrad_x(x_res, recipe), q_dy_t, jnp.float32, recipe)
    else:
        dw = jnp.dot(x_res.T, dy, preferred_element_type=jnp.float32)
    return dx.astype(x_dtype), dw, None  # w_fp8: no cotangent (zeros)


_linear.defvjp(_linear_fwd, _linear_bwd)


def fp8_linear(
    x: jax.Array, w: jax.Array, recipe: Fp8Recipe = DEFAULT_RECIPE, *, w_fp8: Fp8Weight | None = None
) -> jax.Array:
    """`x @ w` with DeepSeek-V3's FP8 Fprop, Dgrad and Wgrad.

    Args:
      x: (..., K) bfloat16 or float32; leading axes are batch axes (any number, size 0 too).
      w: (K, N) master weight (float32 or bfloat16).
      recipe: an `Fp8Recipe`; `Fp8Recipe.off()` is a plain matmul in x's dtype.
      w_fp8: optional, `fp8_weight(w, recipe)`: w's FP8 copies, quantized once for many calls
        (the same results; the op then does not read or quantize w for its FP8 GEMMs). They must
        be w's own: a stale copy (of w before an update) gives the stale weight's results.

    Returns:
      (..., N) in x's dtype. Gradients: dx in x's dtype, dW computed in FP32 (cast to w's dtype).
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    _check_float("x", x)
    _check_float("w", w)
    if w.ndim != 2:
        raise ValueError(f"w must be a (K, N) matrix, got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"contraction sizes differ: x is {x.shape}, w is {w.shape} (x[..., K] @ w[K, N])")
    w_fp8 = _checked_fp8_weight(w_fp8, w, recipe)
    if not recipe.enabled:
        return _plain_dot(x, w)
    # The op sees an FP32 weight so that its FP32 dW is the cotangent as computed; autodiff of the
    # cast hands a bf16 master weight its gradient in bf16.
    x2, w32 = x.reshape(-1, x.shape[-1]), w.astype(jnp.float32)
    y = _linear(_vary_like(x2, w32), _vary_like(w32, x2), _vary_tree(w_fp8, x2), recipe)
    return y.reshape(*x.shape[:-1], w.shape[1])


# ------------------------------------------------------------------------------ grouped (MoE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _plain_grouped(x, w, group_sizes, recipe: Fp8Recipe):
    """No FP8 (the BF16 baseline's experts): `ragged_dot`, jax's Mosaic GPU ragged dots on Hopper,
    the reference (`_ragged`) elsewhere; the backward through `ragged_dot_grads`, whose reference
    is `_ragged`'s own autodiff, so the reference path computes what it always has."""
    return ragged_dot(x, w, group_sizes, impl=recipe.impl, interpret=recipe.interpret)


def _plain_grouped_fwd(x, w, group_sizes, recipe: Fp8Recipe):
    return _plain_grouped(x, w, group_sizes, recipe), (x, w, group_sizes)


def _plain_grouped_bwd(recipe: Fp8Recipe, residuals, dy):
    x, w, group_sizes = residuals
    dx, dw = ragged_dot_grads(x, w, group_sizes, dy, impl=recipe.impl, interpret=recipe.interpret)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_plain_grouped.defvjp(_plain_grouped_fwd, _plain_grouped_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped(x, w, w_fp8, group_sizes, recipe: Fp8Recipe):
    return _grouped_fwd(x, w, w_fp8, group_sizes, recipe, backward=False)[0]


def _gmm(a, b, group_sizes, out_dtype, recipe):
    return grouped_scaled_matmul(
        a, b, group_sizes, out_dtype=out_dtype, impl=recipe.impl, interpret=recipe.interpret
    )


def _grouped_fwd(x, w, w_fp8, group_sizes, recipe: Fp8Recipe, backward: bool = True):
    """x [T, K] sorted by group, w [G, K, N] -> y [T, N]; W's copies from `w_fp8` where given."""
    qx, x_res = _q_x(x, recipe, backward)
    qw, qw_t = _weights(w, w_fp8, recipe)  # [G, K, N], [G, N, K]
    y = _gmm(qx, qw_t, group_sizes, x.dtype, recipe) if recipe.fprop else _ragged(x, w, group_sizes)
    return y, (x_res, qw if recipe.dgrad else w, group_sizes)


def _grouped_bwd(recipe: Fp8Recipe, residuals, dy):
    x_res, w_res, group_sizes = residuals
    x_dtype = dy.dtype
    q_dy, q_dy_t = _q_grad(dy, recipe)
    if recipe.dgrad:  # dx [T, K] = dy [T, N] · W_gᵀ: b is W [G, K, N] (contracted on N)
        dx = _gmm(q_dy, w_res, group_sizes, x_dtype, recipe)
    else:
        dx = _ragged(dy, jnp.swapaxes(w_res, 1, 2), group_sizes)
    if recipe.wgrad:  # dW_g [K, N] = x_gᵀ · dy_g, grouped along the token axis
        dw = grouped_wgrad_matmul(
            _wgrad_x(x_res, recipe), q_dy_t, group_sizes,
            out_dtype=jnp.float32, impl=recipe.impl, interpret=recipe.interpret,
        )
    else:  # ragged_dot is linear in w: its VJP at any point is the grouped xᵀ·dy
        w_zero = jnp.zeros((group_sizes.shape[0], x_res.shape[1], dy.shape[1]), jnp.float32)
        _, vjp = jax.vjp(lambda w: _ragged(x_res.astype(jnp.float32), w, group_sizes), w_zero)
        (dw,) = vjp(dy.astype(jnp.float32))
    zero_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
    return dx.astype(x_dtype), dw, zero_sizes


def _grouped_vjp_bwd(recipe: Fp8Recipe, residuals, dy):
    dx, dw, zero_sizes = _grouped_bwd(recipe, residuals, dy)
    return dx, dw, None, zero_sizes  # w_fp8: no cotangent (zeros)


_grouped.defvjp(_grouped_fwd, _grouped_vjp_bwd)


def grouped_fp8_linear(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: Fp8Recipe = DEFAULT_RECIPE, *,
    w_fp8: Fp8Weight | None = None,
) -> jax.Array:
    """MoE experts in FP8, mirroring `jax.lax.ragged_dot(x, w, group_sizes)`.

    Args:
      x: (T, K) bfloat16/float32 tokens sorted by expert.
      w: (G, K, N) expert weights.
      group_sizes: (G,) int32 tokens per expert; sum <= T, rows past the sum give zeros.
      recipe: the FP8 recipe (Fprop grouped GEMM; Dgrad grouped GEMM with transposed blocks;
        Wgrad grouped along the token axis, FP32).
      w_fp8: optional, `fp8_weight(w, recipe)` (as in `fp8_linear`).

    Returns:
      (T, N) in x's dtype.
    """
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    _check_float("x", x)
    _check_float("w", w)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x must be (T, K) and w (G, K, N); got x {x.shape}, w {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"contraction sizes differ: x is {x.shape}, w is {w.shape} (x[T, K], w[G, K, N])")
    check_group_sizes(group_sizes, w.shape[0], x.shape[0])
    group_sizes = group_sizes.astype(jnp.int32)
    w_fp8 = _checked_fp8_weight(w_fp8, w, recipe)
    if not recipe.enabled:
        x, w = _vary_like(x, w, group_sizes), _vary_like(w, x, group_sizes)
        return _plain_grouped(x, w, _vary_like(group_sizes, x, w), recipe)
    w32 = w.astype(jnp.float32)
    x, w32 = _vary_like(x, w32, group_sizes), _vary_like(w32, x, group_sizes)
    return _grouped(x, w32, _vary_tree(w_fp8, x), _vary_like(group_sizes, x, w32), recipe)


# ------------------------------------------------------------------------------ gathered rows, summed back in order


def _take_rows_transpose(g: jax.Array, rows: jax.Array, token_rows: jax.Array | None, n: int) -> jax.Array:
    """The transpose of `jnp.take(·, rows, axis=0)` for an (n, ...) operand, at the cotangent g (R, ...):
    each token's rows summed in g's dtype, in the order of `rows` (what autodiff's scatter-add
    computes on the CPU, which applies a scatter's updates in order).

    Without `token_rows`, that scatter-add. With it ((n, C): each token's rows in ascending order,
    padded with R where a token has fewer than C), a gather of each token's rows and a chain of C
    additions in that order, each rounded to g's dtype as the scatter's combiner rounds it, from +0
    (so a lone -0 becomes +0, as when added into zeros): the same bits. On a GPU XLA runs a
    scatter-add whose indices repeat with atomic additions, in an order that changes from run to
    run (XLA rewrites it only under `--xla_gpu_exclude_nondeterministic_ops`), and it writes a
    zeroed (n, ...) buffer first; the chain is one gather fusion, deterministic. Other dtypes than
    bfloat16 and float32 keep the scatter."""
    if token_rows is None or jnp.dtype(g.dtype) not in _IO_DTYPES:
        take = lambda t: jnp.take(t, rows, axis=0)  # noqa: E731
        (out,) = jax.linear_transpose(take, jax.ShapeDtypeStruct((n,) + g.shape[1:], g.dtype))(g)
        return out
    if token_rows.shape[1] == 0:  # no rows at all (`_checked_token_rows` refuses C = 0 for R > 0)
        return jnp.zeros((n,) + g.shape[1:], g.dtype)
    # An entry R (past the last row) pads a token with fewer than C rows: it reads +0, which adds
    # nothing (the partial sum is never -0: it starts from +0, and x + -x rounds to +0).
    row = lambda j: jnp.take(g, token_rows[:, j], axis=0, mode="fill", fill_value=0).astype(jnp.float32)  # noqa: E731
    acc = row(0)
    acc = jnp.where(acc == 0, jnp.zeros_like(acc), acc)  # +0 + x: x, but +0 for a -0
    for j in range(1, token_rows.shape[1]):
        acc = acc + row(j)
        if g.dtype != jnp.float32:  # the scatter's bf16 combiner rounds every partial sum
            acc = jax.lax.reduce_precision(acc, exponent_bits=8, mantissa_bits=7)
    return acc.astype(g.dtype)


@jax.custom_vjp
def _take_rows(x, rows, token_rows):
    return jnp.take(x, rows, axis=0)


def _take_rows_fwd(x, rows, token_rows):
    return jnp.take(x, rows, axis=0), (rows, token_rows, jnp.zeros((x.shape[0], 0), x.dtype))


def _take_rows_bwd(residuals, g):
    rows, token_rows, probe = residuals
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return _take_rows_transpose(g, rows, token_rows, probe.shape[0]), zero(rows), zero(token_rows)


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def take_rows(x: jax.Array, rows: jax.Array, token_rows: jax.Array | None = None) -> jax.Array:
    """`jnp.take(x, rows, axis=0)` (an MoE's dispatch: token `rows[r]` copied to row r), whose
    gradient, with `token_rows`, is a gather instead of a scatter-add: the same bits on the CPU,
    deterministic on a GPU (`_take_rows_transpose`).

    Args:
      x: (N, ...) bfloat16/float32. rows: (R,) int32, each in [0, N).
      token_rows: (N, C) int32, optional: for each token of x the rows r with rows[r] == it, in
        ascending order, padded with R (every row exactly once; an MoE's top-k assignment gives
        C = k and no padding). Without it, autodiff's scatter-add.
    """
    x, rows = jnp.asarray(x), jnp.asarray(rows)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows must be (R,) integers; got {rows.shape} {rows.dtype}")
    if token_rows is None:
        return jnp.take(x, rows, axis=0)
    token_rows = _checked_token_rows(token_rows, x.shape[0], rows.shape[0])
    return _take_rows(x, rows.astype(jnp.int32), token_rows)


def _checked_token_rows(token_rows, n: int, r: int) -> jax.Array:
    """`token_rows` as int32, or a ValueError saying what it must be. Whether it lists each of the
    R rows exactly once cannot be checked on traced values: a wrong table gives a wrong gradient."""
    token_rows = jnp.asarray(token_rows)
    if token_rows.ndim != 2 or token_rows.shape[0] != n or not jnp.issubdtype(token_rows.dtype, jnp.integer):
        raise ValueError(f"token_rows must be (N, C) integers with N = {n}, the tokens' count: each token's rows "
                         f"in ascending order, padded with R = {r}; got {token_rows.shape} {token_rows.dtype}")
    if token_rows.shape[0] * token_rows.shape[1] < r:
        raise ValueError(f"token_rows {token_rows.shape} has room for {token_rows.size} rows, fewer than the {r} "
                         "rows gathered: it must list every row once (C = k for a top-k routing)")
    return token_rows.astype(jnp.int32)


# ------------------------------------------------------------------------------ grouped, gathered rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gathered(tokens, w, w_fp8, rows, token_rows, group_sizes, recipe: Fp8Recipe):
    return _gathered_fwd(tokens, w, w_fp8, rows, token_rows, group_sizes, recipe, backward=False)[0]


def _gathered_fwd(tokens, w, w_fp8, rows, token_rows, group_sizes, recipe: Fp8Recipe, backward: bool = True):
    """tokens [N, K], rows [R] (token of each grouped row) -> y [R, N']: the tokens quantized once,
    their FP8 rows (1x128 tiles are row-local: the same bits as quantizing the gathered rows)
    gathered into the grouped GEMM."""
    q, _ = _q_x(tokens, recipe, backward)  # the call the token's other GEMMs (the shared expert) make: one kernel
    qx = Fp8Tensor(move_bytes(lambda d: jnp.take(d, rows, axis=0), q.data), jnp.take(q.scale, rows, axis=0), q.block,
                   (rows.shape[0], q.logical[1]))
    qw, qw_t = _weights(w, w_fp8, recipe)  # [G, K, N'], [G, N', K]
    y = _gmm(qx, qw_t, group_sizes, tokens.dtype, recipe)
    probe = jnp.zeros((tokens.shape[0], 0), tokens.dtype)  # carries N and the dtype of d tokens
    return y, (qx, qw if recipe.dgrad else w, rows, token_rows, group_sizes, probe)


def _gathered_bwd(recipe: Fp8Recipe, residuals, dy):
    qx, w_res, rows, token_rows, group_sizes, probe = residuals
    dx_rows, dw, _ = _grouped_bwd(recipe, (qx, w_res, group_sizes), dy)  # Wgrad re-tiles the gathered rows
    dtokens = _take_rows_transpose(dx_rows.astype(probe.dtype), rows, token_rows, probe.shape[0])
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return dtokens, dw, None, zero(rows), None if token_rows is None else zero(token_rows), zero(group_sizes)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def gathered_grouped_fp8_linear(
    tokens: jax.Array, rows: jax.Array, w: jax.Array, group_sizes: jax.Array, recipe: Fp8Recipe = DEFAULT_RECIPE,
    *, token_rows: jax.Array | None = None, w_fp8: Fp8Weight | None = None,
) -> jax.Array:
    """`grouped_fp8_linear(jnp.take(tokens, rows, axis=0), w, group_sizes, recipe)` (an MoE's
    dispatch fused into its first expert GEMM), with each token quantized once instead of once per
    row it is copied to, and its FP8 rows gathered: the same bits, fewer bytes (DeepSeek-V3 §3.3.2
    quantizes tokens before the dispatch). With a recipe that does not quantize Fprop activations
    in 1x128 tiles, the gather and `grouped_fp8_linear`.

    Args:
      tokens: (N, K) bfloat16/float32. rows: (R,) int32 token of each grouped row, sorted by group.
      w, group_sizes, recipe: as `grouped_fp8_linear` (over the R gathered rows).
      token_rows: (N, C) int32, optional: each token's rows in ascending order, padded with R
        (`take_rows`); with it, d tokens is each token's row gradients summed by a gather (the
        same bits, deterministic on a GPU) instead of a scatter-add.
    """
    tokens, rows = jnp.asarray(tokens), jnp.asarray(rows)
    if tokens.ndim != 2 or rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"tokens must be (N, K) and rows (R,) integers; got {tokens.shape} and {rows.shape} {rows.dtype}")
    if token_rows is not None:
        token_rows = _checked_token_rows(token_rows, tokens.shape[0], rows.shape[0])
    if not (recipe.fprop and recipe.wgrad and recipe.activation_block == (1, TILE)):
        return grouped_fp8_linear(take_rows(tokens, rows, token_rows), w, group_sizes, recipe, w_fp8=w_fp8)
    _check_float("tokens", tokens)
    _check_float("w", w)
    w, group_sizes = jnp.asarray(w), jnp.asarray(group_sizes)
    if w.ndim != 3 or tokens.shape[1] != w.shape[1]:
        raise ValueError(f"w must be (G, K, N) with K = tokens' {tokens.shape[1]}; got w {w.shape}")
    check_group_sizes(group_sizes, w.shape[0], rows.shape[0])
    group_sizes, rows = group_sizes.astype(jnp.int32), rows.astype(jnp.int32)
    w_fp8 = _checked_fp8_weight(w_fp8, w, recipe)
    w32 = w.astype(jnp.float32)
    tokens, w32 = _vary_like(tokens, w32, group_sizes), _vary_like(w32, tokens, group_sizes)
    return _gathered(tokens, w32, _vary_tree(w_fp8, tokens), rows, token_rows, _vary_like(group_sizes, tokens, w32),
                     recipe)
