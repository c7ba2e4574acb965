"""`fp8_dot_general`: `jax.lax.dot_general` between an activation and a weight, in FP8.

Any dimension numbers reduce to the 2-D form `fp8_linear` takes, x2 [M, K] · w2 [K, N]:
  - batch axes (on both operands, as `lax.dot_general` requires) are mapped with `jax.vmap`: each
    batch element is its own GEMM, so no scale spans two batch elements (the same numbers as a
    loop of `fp8_linear` over them);
  - the activation x is transposed to (free..., contracting...) and flattened to [M, K];
  - the weight w is transposed to (contracting..., free...) and flattened to [K, N];
  - several contracting axes flatten, in the activation's axis order, into one K: the 1x128
    activation tiles and the 128x128 weight blocks run along that flattened K (row-major over the
    contracting axes, the activation's last contracting axis fastest), so a tile may cover several
    rows of a small trailing contracting axis (e.g. 2 heads x 64 dims in `BTNH,NHD->BTD`).
The [M, N] result is reshaped to (x free..., w free...) and put in `lax.dot_general`'s order
(batch, lhs free, rhs free).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from jfp8.ops import DEFAULT_RECIPE, fp8_linear
from jfp8.recipe import Fp8Recipe

Operand = Literal["lhs", "rhs"]
_WIDE = jnp.dtype(jnp.float32)


def _normalize_dims(lhs_shape, rhs_shape, dimension_numbers):
    """Checked, non-negative ((lc, rc), (lb, rb)); raises ValueError naming the problem."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(a) for a in axes) for axes in (lc, rc, lb, rb))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)) "
            f"tuples of axes, got {dimension_numbers!r}"
        ) from e

    def norm(axes, ndim, what):
        out = tuple(a + ndim if a < 0 else a for a in axes)
        if any(not 0 <= a < ndim for a in out):
            raise ValueError(f"{what} axes {axes} out of range for a {ndim}-D operand")
        return out

    lc, lb = norm(lc, len(lhs_shape), "lhs"), norm(lb, len(lhs_shape), "lhs")
    rc, rb = norm(rc, len(rhs_shape), "rhs"), norm(rb, len(rhs_shape), "rhs")
    for name, a, b in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(a) != len(b):
            raise ValueError(f"lhs and rhs need as many {name} axes: {a} vs {b}")
        if [lhs_shape[i] for i in a] != [rhs_shape[j] for j in b]:
            raise ValueError(
                f"{name} axes differ in size: lhs {lhs_shape} axes {a}, rhs {rhs_shape} axes {b}"
            )
    for name, shape, axes in (("lhs", lhs_shape, lc + lb), ("rhs", rhs_shape, rc + rb)):
        if len(set(axes)) != len(axes):
            raise ValueError(f"{name} axes {axes} appear twice among {name}'s contracting and batch axes")
    return (lc, rc), (lb, rb)


def _nt_linear(x, w, xc, wc, xb, wb, recipe):
    """x (activation) and w (weight) -> (batch..., x free..., w free...) via `fp8_linear`."""
    # Contracting pairs in the activation's axis order: trailing contracting axes need no transpose.
    pairs = sorted(zip(xc, wc))
    xc, wc = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    x_free = tuple(a for a in range(x.ndim) if a not in xc + xb)
    w_free = tuple(a for a in range(w.ndim) if a not in wc + wb)
    batch = tuple(x.shape[a] for a in xb)
    x_free_shape = tuple(x.shape[a] for a in x_free)
    w_free_shape = tuple(w.shape[a] for a in w_free)
    k = math.prod(x.shape[a] for a in xc)
    b = math.prod(batch)
    # [B, M, K] and [B, K, N]
    x3 = jnp.transpose(x, xb + x_free + xc).reshape(b, math.prod(x_free_shape), k)
    w3 = jnp.transpose(w, wb + wc + w_free).reshape(b, k, math.prod(w_free_shape))
    linear = functools.partial(fp8_linear, recipe=recipe)
    y = linear(x3[0], w3[0])[None] if not batch else jax.vmap(linear)(x3, w3)
    return y.reshape(*batch, *x_free_shape, *w_free_shape), len(x_free_shape)


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
    *,
    recipe: Fp8Recipe = DEFAULT_RECIPE,
    weight: Operand = "rhs",
) -> jax.Array:
    """`jax.lax.dot_general(lhs, rhs, dimension_numbers)` with DeepSeek-V3's FP8 recipe.

    A drop-in for `lax.dot_general` and for Flax's `dot_general=` hook (`nnx.Linear`, linen
    `nn.Dense`, `nn.DenseGeneral`); for layers without the hook, `jfp8.autocast`. One operand is the weight (128x128 blocks, FP32
    gradient), the other the activation (1x128 tiles along the contraction); gradients follow
    `fp8_linear` (Fprop, Dgrad and Wgrad in FP8).

    Args:
      lhs, rhs: bfloat16 or float32 operands, any ranks.
      dimension_numbers: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))` as for
        `lax.dot_general`; at least one contracting axis. Several contracting axes are flattened
        into one K, along which the scaling tiles run (module docstring). Batch axes are mapped
        (`jax.vmap`): scales never span two batch elements.
      precision: ignored (no meaning for FP8 GEMMs).
      preferred_element_type: output dtype; float32 with bfloat16 activations gives the GEMM's
        FP32 result unrounded (the activation's FP8 copy is the same either way).
      out_sharding: applied to the result with `with_sharding_constraint`.
      recipe: the `Fp8Recipe`; `Fp8Recipe.off()` is `lax.dot_general` itself.
      weight: which operand is the weight, "rhs" (default, Flax's convention) or "lhs".

    Returns:
      lax.dot_general's result: (batch..., lhs free..., rhs free...), in `preferred_element_type`
      or else the activation's dtype.
    """
    del precision
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if weight not in ("lhs", "rhs"):
        raise ValueError(f'weight must be "lhs" or "rhs" (the weight operand), got {weight!r}')
    (lc, rc), (lb, rb) = _normalize_dims(lhs.shape, rhs.shape, dimension_numbers)
    if not lc:
        raise NotImplementedError(
            f"fp8_dot_general needs a contracting axis (the scaling tiles run along it); "
            f"dimension_numbers={dimension_numbers} contract none of lhs {lhs.shape}, rhs "
            f"{rhs.shape}. An outer product has no GEMM to put in FP8: use jax.lax.dot_general."
        )
    if weight == "rhs":
        x, w, xc, wc, xb, wb = lhs, rhs, lc, rc, lb, rb
    else:
        x, w, xc, wc, xb, wb = rhs, lhs, rc, lc, rb, lb
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if not recipe.enabled:
        w = w.astype(x.dtype)
        y = jax.lax.dot_general(
            *((x, w) if weight == "rhs" else (w, x)), ((lc, rc), (lb, rb)),
            preferred_element_type=preferred_element_type,
        )
    else:
        if out_dtype == _WIDE and jnp.dtype(x.dtype) != _WIDE:
            x = x.astype(_WIDE)  # exact: the same FP8 copy, an FP32 result
        y, n_x_free = _nt_linear(x, w, xc, wc, xb, wb, recipe)
        if weight == "lhs":  # (batch, x free, w free) -> (batch, w free, x free)
            nb = len(xb)
            nw = y.ndim - nb - n_x_free
            y = jnp.transpose(
                y, tuple(range(nb)) + tuple(range(nb + n_x_free, nb + n_x_free + nw))
                + tuple(range(nb, nb + n_x_free)),
            )
    y = y.astype(out_dtype)
    if out_sharding is not None:
        y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y


def make_fp8_dot_general(recipe: Fp8Recipe, weight: Operand = "rhs"):
    """`fp8_dot_general` bound to `recipe`, for `nnx.Linear(dot_general=...)`."""
    return functools.partial(fp8_dot_general, recipe=recipe, weight=weight)
