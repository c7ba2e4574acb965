"""`autocast`: DeepSeek-V3's FP8 recipe for the matmuls of any JAX function, without editing it.

`autocast(fn)` is a jaxpr interpreter (the pattern of JAX's "Writing custom interpreters in JAX"):
each call traces `fn` to a jaxpr and evaluates it equation by equation on the caller's trace, so
the result composes with `jit`, `grad`, `vmap`, `remat` and `shard_map` like any JAX code. A
`dot_general` between a weight and an activation becomes `fp8_dot_general` (the weight in 128x128
blocks, the activation in 1x128 tiles, all three GEMMs of its gradient in FP8); every other
equation is bound unchanged.

Weights are tracked, not guessed: a value is a weight when it comes from an argument in
`weight_argnums` through layout-only primitives (`LAYOUT_PRIMITIVES`: reshape, transpose, dtype
conversion, broadcast, slices, ...). Anything computed from a weight by arithmetic (`w * scale`,
`w1 @ w2`) is an activation; a gathered embedding row is an activation.

Sub-jaxprs are entered when a weight flows into them: `jit` (inlined), `scan`, `cond`, `while`
(rebuilt with `lax.scan` / `lax.switch` / `lax.while_loop`), `checkpoint` (rebuilt with
`jax.checkpoint`, same policy) and `custom_jvp` / `custom_vjp` functions (inlined: their matmuls
get the FP8 gradient, and their own derivative rule is dropped, which `DotRecord.scope` notes).
Functions with no weight flowing in (relu, softmax, attention cores) are bound untouched, custom
rules included. Other primitives with sub-jaxprs (`shard_map` inside `fn`, `pallas_call`, ...) are
left alone and their matmuls reported as not entered.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util

from jfp8.dot_general import Operand, fp8_dot_general
from jfp8.ops import DEFAULT_RECIPE
from jfp8.recipe import Fp8Recipe

# Primitives whose output is a weight when their first operand is (layout and dtype only).
LAYOUT_PRIMITIVES = frozenset({
    "reshape", "transpose", "convert_element_type", "broadcast_in_dim", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "rev", "copy", "copy_p", "sharding_constraint",
    "reduce_precision", "device_put",
    "pvary", "pbroadcast",  # inside shard_map: a replicated weight typed as varying over an axis
})
# ... and when all their operands are (fused weights: `jnp.concatenate([wq, wk, wv])`).
JOIN_PRIMITIVES = frozenset({"concatenate", "stack"})
_FP8_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))

Kind = Literal["weight x activation", "activation x activation", "weight x weight", "unknown"]


@dataclasses.dataclass(frozen=True)
class DotRecord:
    """One `dot_general` of the traced function and what autocast did with it.

    Attributes:
      kind: which operands are weights ("unknown" inside a primitive autocast does not enter).
      fp8: whether it runs through `fp8_dot_general` (with an enabled recipe: in FP8).
      lhs_shape, rhs_shape, dtype: the operands (dtype of lhs).
      dimension_numbers: as in the jaxpr.
      weight: the weight operand ("lhs" / "rhs"; "rhs" for FP8 activation x activation).
      note: why it is not FP8, if it is not.
      where: the user's source line (and Flax/JAX name scope) that made it.
      scope: the enclosing primitives autocast went through (e.g. ("jit:apply", "scan")).
    """

    kind: Kind
    fp8: bool
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    dtype: str
    dimension_numbers: Any
    weight: Operand | None
    note: str
    where: str
    scope: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Ctx:
    recipe: Fp8Recipe
    between_activations: Fp8Recipe | None
    records: list | None
    keep: Callable[[DotRecord], bool] | None = None
    scope: tuple[str, ...] = ()

    def inside(self, name: str) -> _Ctx:
        return dataclasses.replace(self, scope=(*self.scope, name))

    def make_record(self, eqn, kind, fp8, weight, note) -> DotRecord:
        lhs, rhs = (v.aval for v in eqn.invars[:2])
        stack = str(eqn.source_info.name_stack)
        where = source_info_util.summarize(eqn.source_info) + (f" [{stack}]" if stack else "")
        return DotRecord(
            kind=kind, fp8=fp8, lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
            dtype=str(lhs.dtype), dimension_numbers=eqn.params["dimension_numbers"],
            weight=weight, note=note, where=where, scope=self.scope,
        )

    def record(self, eqn, kind, fp8, weight, note):
        if self.records is not None:
            self.records.append(self.make_record(eqn, kind, fp8, weight, note))


# ------------------------------------------------------------------------------ the interpreter


def _eval_jaxpr(jaxpr, consts, args, weights: Sequence[bool], ctx: _Ctx):
    """Evaluate `jaxpr` on the current trace; returns (outputs, which outputs are weights)."""
    env: dict = {}
    is_weight: set = set()

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def weight(v):
        return not isinstance(v, jcore.Literal) and v in is_weight

    def write(v, val, w):
        if isinstance(v, jcore.DropVar):
            return
        env[v] = val
        if w:
            is_weight.add(v)

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c, False)
    for v, a, w in zip(jaxpr.invars, args, weights, strict=True):
        write(v, a, w)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inw = [weight(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name, _default_rule)
        if rule is not _default_rule and rule is not _dot_rule and not (
            any(inw) or ctx.between_activations is not None
        ):
            rule = _default_rule  # no weight enters: nothing inside can change
        outs, outw = rule(eqn, invals, inw, ctx)
        for v, o, w in zip(eqn.outvars, outs, outw, strict=True):
            write(v, o, w)
    return [read(v) for v in jaxpr.outvars], [weight(v) for v in jaxpr.outvars]


def _bind(eqn, invals):
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _sub_jaxprs(params):
    for val in params.values():
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, jcore.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jcore.Jaxpr):
                yield v


def _record_nested(eqn, inw, ctx: _Ctx):
    """Record the matmuls inside a primitive autocast leaves alone."""
    if ctx.records is None:
        return
    entered = any(inw)
    kind = "unknown" if entered else "activation x activation"
    note = (f"inside {eqn.primitive.name}, which autocast does not enter" if entered
            else "no weight flows into it")

    def walk(jaxpr, c):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                c.record(e, kind, False, None, note)
            for j in _sub_jaxprs(e.params):
                walk(j, c.inside(e.primitive.name))

    for j in _sub_jaxprs(eqn.params):
        walk(j, ctx.inside(eqn.primitive.name))


def _default_rule(eqn, invals, inw, ctx):
    _record_nested(eqn, inw, ctx)
    outs = _bind(eqn, invals)
    name = eqn.primitive.name
    w = (name in LAYOUT_PRIMITIVES and inw[0]) or (name in JOIN_PRIMITIVES and all(inw))
    return outs, [w] * len(outs)


def _dot_rule(eqn, invals, inw, ctx: _Ctx):
    (lhs, rhs), (lw, rw) = invals, inw
    dims = eqn.params["dimension_numbers"]
    if lw and rw:
        kind, recipe, side, note = "weight x weight", None, None, "both operands are weights"
    elif lw or rw:
        kind, recipe, side, note = "weight x activation", ctx.recipe, ("lhs" if lw else "rhs"), ""
    elif ctx.between_activations is not None:
        kind, recipe, side, note = "activation x activation", ctx.between_activations, "rhs", ""
    else:
        kind, recipe, side, note = "activation x activation", None, None, "kept in input precision"
    if recipe is not None and not dims[0][0]:
        recipe, note = None, "no contracting axis (an outer product)"
    dtypes = {jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)}
    if recipe is not None and not dtypes <= set(_FP8_DTYPES):
        recipe, note = None, f"{'/'.join(sorted(map(str, dtypes)))} operands (FP8 takes bf16/f32)"
    if recipe is not None and not recipe.enabled:
        recipe, note = None, "the recipe is off"
    if recipe is not None and ctx.keep is not None and ctx.keep(ctx.make_record(eqn, kind, True, side, "")):
        recipe, note = None, "kept by keep="
    ctx.record(eqn, kind, recipe is not None, side, note)
    if recipe is None:
        return _bind(eqn, invals), [False]
    y = fp8_dot_general(
        lhs, rhs, dims, preferred_element_type=eqn.params.get("preferred_element_type"),
        recipe=recipe, weight=side,
    )
    return [y.astype(eqn.outvars[0].aval.dtype)], [False]


def _jit_rule(eqn, invals, inw, ctx: _Ctx):
    """Inlined: under an outer `jit` it is one program anyway."""
    closed = eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"]
    name = eqn.params.get("name", eqn.primitive.name)
    return _eval_jaxpr(closed.jaxpr, closed.consts, invals, inw, ctx.inside(f"jit:{name}"))


def _custom_rule(eqn, invals, inw, ctx: _Ctx):
    """A custom_jvp / custom_vjp function a weight flows into: inlined (its rule is dropped)."""
    closed = eqn.params["call_jaxpr"]
    sub = ctx.inside(f"{eqn.primitive.name} (inlined; its custom rule is dropped)")
    return _eval_jaxpr(closed.jaxpr, closed.consts, invals, inw, sub)


def _remat_rule(eqn, invals, inw, ctx: _Ctx):
    jaxpr, p = eqn.params["jaxpr"], eqn.params
    outw = [False] * len(eqn.outvars)

    def body(*args):
        outs, outw[:] = _eval_jaxpr(jaxpr, (), args, inw, ctx.inside("checkpoint"))
        return outs

    outs = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals)
    return list(outs), outw


def _scan_rule(eqn, invals, inw, ctx: _Ctx):
    p, closed = eqn.params, eqn.params["jaxpr"]
    consts, carry, xs = (list(t) for t in p["ft_in"].update(invals).unpack())
    const_w, _, xs_w = (list(t) for t in p["ft_in"].update(inw).unpack())
    nk = len(carry)
    # Carries are activations (a weight carried through a loop would need a fixed point).
    body_w = [*const_w, *([False] * nk), *xs_w]
    sub = ctx.inside(f"scan(length={p['length']})")

    def body(c, x):
        outs, _ = _eval_jaxpr(closed.jaxpr, closed.consts, [*consts, *c, *x], body_w, sub)
        return outs[:nk], outs[nk:]

    c, ys = lax.scan(body, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    outs = [*c, *ys]
    return outs, [False] * len(outs)


def _cond_rule(eqn, invals, inw, ctx: _Ctx):
    index, ops, ops_w = invals[0], invals[1:], inw[1:]
    sub = ctx.inside("cond")

    def branch(closed, *args):
        return _eval_jaxpr(closed.jaxpr, closed.consts, args, ops_w, sub)[0]

    fns = [functools.partial(branch, b) for b in eqn.params["branches"]]
    outs = lax.switch(index, fns, *ops)
    return list(outs), [False] * len(outs)


def _while_rule(eqn, invals, inw, ctx: _Ctx):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cc, bc, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cw, bw, n = inw[:cn], inw[cn:cn + bn], len(init)
    sub = ctx.inside("while")
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]

    def cond(c):
        return _eval_jaxpr(cj.jaxpr, cj.consts, [*cc, *c], [*cw, *([False] * n)], sub)[0][0]

    def body(c):
        return _eval_jaxpr(bj.jaxpr, bj.consts, [*bc, *c], [*bw, *([False] * n)], sub)[0]

    outs = lax.while_loop(cond, body, list(init))
    return list(outs), [False] * len(outs)


_RULES: dict[str, Callable] = {
    "dot_general": _dot_rule,
    "jit": _jit_rule,
    "pjit": _jit_rule,
    "closed_call": _jit_rule,
    "custom_jvp_call": _custom_rule,
    "custom_vjp_call": _custom_rule,
    "remat2": _remat_rule,
    "checkpoint": _remat_rule,
    "scan": _scan_rule,
    "cond": _cond_rule,
    "while": _while_rule,
}


# ------------------------------------------------------------------------------ the transform


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


class Autocast:
    """`fn` with its weight x activation matmuls in FP8 (made by `autocast`)."""

    def __init__(self, fn, recipe, weight_argnums, between_activations, keep=None):
        self._fn, self._recipe, self._between, self._keep = fn, recipe, between_activations, keep
        self._weight_argnums = tuple(weight_argnums)
        functools.update_wrapper(self, fn)

    def _trace(self, args, kwargs):
        wa = {a % len(args) if -len(args) <= a < len(args) else a for a in self._weight_argnums}
        if any(not 0 <= a < len(args) for a in wa):
            raise ValueError(
                f"weight_argnums={self._weight_argnums} but the call has {len(args)} positional "
                "arguments; pass the weights positionally (e.g. model.apply(params, x): argnum 0)"
            )
        leaves, tree = jax.tree.flatten((args, kwargs))
        flags = jax.tree.leaves((
            tuple(jax.tree.map(lambda _, i=i: i in wa, a) for i, a in enumerate(args)),
            jax.tree.map(lambda _: False, kwargs),
        ))
        dyn = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def flat_fn(*dyn_vals):  # the non-array leaves (flags, names) stay static
            vals = list(leaves)
            for i, v in zip(dyn, dyn_vals):
                vals[i] = v
            a, k = jax.tree.unflatten(tree, vals)
            return self._fn(*a, **k)

        dyn_vals = [leaves[i] for i in dyn]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
        return closed, jax.tree.structure(out_shape), dyn_vals, [flags[i] for i in dyn]

    def _run(self, records, args, kwargs):
        closed, out_tree, dyn_vals, flags = self._trace(args, kwargs)
        ctx = _Ctx(self._recipe, self._between, records, self._keep)
        outs, _ = _eval_jaxpr(closed.jaxpr, closed.consts, dyn_vals, flags, ctx)
        return jax.tree.unflatten(out_tree, outs)

    def __call__(self, *args, **kwargs):
        return self._run(None, args, kwargs)

    def report(self, *args, **kwargs) -> tuple[DotRecord, ...]:
        """The `DotRecord` of every matmul `fn(*args, **kwargs)` makes, traced, not run (arrays
        or `jax.ShapeDtypeStruct`s). A scan body's matmul appears once, whatever the length."""
        records: list = []
        closed, _, dyn_vals, flags = self._trace(args, kwargs)
        ctx = _Ctx(self._recipe, self._between, records, self._keep)
        jax.eval_shape(lambda *a: _eval_jaxpr(closed.jaxpr, closed.consts, a, flags, ctx)[0], *dyn_vals)
        return tuple(records)


def autocast(
    fn: Callable,
    recipe: Fp8Recipe = DEFAULT_RECIPE,
    *,
    weight_argnums: int | Sequence[int] = (0,),
    between_activations: Fp8Recipe | None = None,
    keep: Callable[[DotRecord], bool] | None = None,
) -> Autocast:
    """`fn` with every matmul between a weight and an activation in FP8 (DeepSeek-V3 recipe).

    A function transform like `jax.grad`: the result has `fn`'s signature and composes with
    `jit`, `grad`, `vmap`, `checkpoint` and `shard_map`.

    Args:
      fn: any JAX function (a Flax `model.apply`, an NNX or equinox module call, plain code).
      recipe: the `Fp8Recipe` of weight x activation matmuls.
      weight_argnums: the positional arguments holding weights (a pytree each). Whatever is
        derived from them by layout-only primitives (`LAYOUT_PRIMITIVES`) is a weight.
      between_activations: recipe for activation x activation matmuls (attention scores,
        probs·V), with rhs scaled as `recipe.weight_block` says; None (default) keeps them in the
        input precision, as DeepSeek-V3 keeps attention in BF16.
      keep: a predicate on a matmul's `DotRecord` (shapes, `where`, Flax scope); True keeps that
        matmul in the input precision, as DeepSeek-V3 keeps its output head and MoE gate (e.g.
        `keep=lambda r: r.rhs_shape[-1] == vocab_size`).

    Returns:
      A callable; `.report(*args)` lists what each matmul became (`DotRecord`s).
    """
    if isinstance(weight_argnums, int):
        weight_argnums = (weight_argnums,)
    return Autocast(fn, recipe, weight_argnums, between_activations, keep)


def einsum(
    subscripts: str,
    x: jax.Array,
    w: jax.Array,
    *,
    recipe: Fp8Recipe = DEFAULT_RECIPE,
    preferred_element_type=None,
) -> jax.Array:
    """`jnp.einsum(subscripts, x, w)` with the contraction in FP8: w the weight (128x128 blocks),
    x the activation (1x128 tiles along the contracted indices, flattened in x's order). The
    result is in `preferred_element_type`, else x's dtype (as `fp8_linear`: bf16 activations with
    an f32 master weight give bf16).

    E.g. an attention output projection `jfp8.einsum("btnh,nhd->btd", o, w_o)` or stacked experts
    `jfp8.einsum("etk,ekn->etn", x, w)` (the shared index e is a batch axis: one GEMM per expert).
    Raises NotImplementedError when x and w share no contracted index (an outer product).
    """
    records: list = []
    x, w = jnp.asarray(x), jnp.asarray(w)
    out_dtype = preferred_element_type or x.dtype  # as fp8_linear: a f32 master w, bf16 out
    fn = Autocast(
        lambda w, x: jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype),
        recipe, (0,), None,
    )
    out = fn._run(records, (w, x), {})
    if not any(r.fp8 for r in records):
        raise NotImplementedError(
            f"einsum {subscripts!r} has no contraction between x and w for FP8 to run along "
            f"({[r.note for r in records] or 'no matmul at all'}); use jnp.einsum"
        )
    return out


def format_report(records: Sequence[DotRecord]) -> str:
    """A table of `Autocast.report`'s records, one matmul per line."""
    lines = [f"{sum(r.fp8 for r in records)} of {len(records)} matmuls in FP8"]
    for r in records:
        status = "FP8 " if r.fp8 else "kept"
        shapes = f"{r.lhs_shape} x {r.rhs_shape} {r.dtype}"
        scope = f" in {'/'.join(r.scope)}" if r.scope else ""
        note = f" ({r.note})" if r.note else ""
        lines.append(f"  {status} {r.kind:24s} {shapes:34s} {r.where}{scope}{note}")
    return "\n".join(lines)
