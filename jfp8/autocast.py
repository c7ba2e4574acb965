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
`w1 @ w2`) is an activation; a gathered embedding row is an activation. Each weight carries its
path in the argument pytree (`layers/0/attn/wq/kernel` for NNX state, `params/Dense_0/kernel` for
linen), which the report shows and `keep=` patterns match.

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
import re
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
_SITE_PACKAGES = re.compile(r"^.*[/\\](site|dist)-packages[/\\]")

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
      weight_path: where the weight operand comes from: its leaf's path in the weight argument
        (e.g. "layers/0/attn/wq/kernel", "params/Dense_0/kernel"; "arg0" for an argument that is
        one array), " + "-joined for a concatenation of weights; None without a weight.
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
    weight_path: str | None
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

    def make_record(self, eqn, kind, fp8, weight, weight_path, note) -> DotRecord:
        lhs, rhs = (v.aval for v in eqn.invars[:2])
        stack = str(eqn.source_info.name_stack)
        where = source_info_util.summarize(eqn.source_info) + (f" [{stack}]" if stack else "")
        where = _SITE_PACKAGES.sub("", where)  # flax/nnx/nn/linear.py:422, not the venv's path
        return DotRecord(
            kind=kind, fp8=fp8, lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
            dtype=str(lhs.dtype), dimension_numbers=eqn.params["dimension_numbers"],
            weight=weight, weight_path=weight_path, note=note, where=where, scope=self.scope,
        )

    def record(self, eqn, kind, fp8, weight, weight_path, note):
        if self.records is not None:
            self.records.append(self.make_record(eqn, kind, fp8, weight, weight_path, note))


# ------------------------------------------------------------------------------ the interpreter


def _eval_jaxpr(jaxpr, consts, args, weights: Sequence[str | None], ctx: _Ctx):
    """Evaluate `jaxpr` on the current trace; returns (outputs, each output's weight path or None).

    `weights` holds, per input, the path of the weight it is (None for an activation)."""
    env: dict = {}
    weight_of: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def weight(v):
        return None if isinstance(v, jcore.Literal) else weight_of.get(v)

    def write(v, val, w):
        if isinstance(v, jcore.DropVar):
            return
        env[v] = val
        if w:
            weight_of[v] = w

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c, None)
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
                c.record(e, kind, False, None, None, note)
            for j in _sub_jaxprs(e.params):
                walk(j, c.inside(e.primitive.name))

    for j in _sub_jaxprs(eqn.params):
        walk(j, ctx.inside(eqn.primitive.name))


def _default_rule(eqn, invals, inw, ctx):
    _record_nested(eqn, inw, ctx)
    outs = _bind(eqn, invals)
    name = eqn.primitive.name
    w = None
    if name in LAYOUT_PRIMITIVES:
        w = inw[0]
    elif name in JOIN_PRIMITIVES and all(inw):
        w = " + ".join(dict.fromkeys(inw))  # fused weights: each path once, in order
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
    path = (lw or rw) if kind == "weight x activation" else None
    if recipe is not None and ctx.keep is not None and ctx.keep(ctx.make_record(eqn, kind, True, side, path, "")):
        recipe, note = None, "kept by keep="
    ctx.record(eqn, kind, recipe is not None, side, path, note)
    if recipe is None:
        return _bind(eqn, invals), [None]
    y = fp8_dot_general(
        lhs, rhs, dims, preferred_element_type=eqn.params.get("preferred_element_type"),
        recipe=recipe, weight=side,
    )
    return [y.astype(eqn.outvars[0].aval.dtype)], [None]


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
    outw = [None] * len(eqn.outvars)

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
    body_w = [*const_w, *([None] * nk), *xs_w]
    sub = ctx.inside(f"scan(length={p['length']})")

    def body(c, x):
        outs, _ = _eval_jaxpr(closed.jaxpr, closed.consts, [*consts, *c, *x], body_w, sub)
        return outs[:nk], outs[nk:]

    c, ys = lax.scan(body, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    outs = [*c, *ys]
    return outs, [None] * len(outs)


def _cond_rule(eqn, invals, inw, ctx: _Ctx):
    index, ops, ops_w = invals[0], invals[1:], inw[1:]
    sub = ctx.inside("cond")

    def branch(closed, *args):
        return _eval_jaxpr(closed.jaxpr, closed.consts, args, ops_w, sub)[0]

    fns = [functools.partial(branch, b) for b in eqn.params["branches"]]
    outs = lax.switch(index, fns, *ops)
    return list(outs), [None] * len(outs)


def _while_rule(eqn, invals, inw, ctx: _Ctx):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cc, bc, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cw, bw, n = inw[:cn], inw[cn:cn + bn], len(init)
    sub = ctx.inside("while")
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]

    def cond(c):
        return _eval_jaxpr(cj.jaxpr, cj.consts, [*cc, *c], [*cw, *([None] * n)], sub)[0][0]

    def body(c):
        return _eval_jaxpr(bj.jaxpr, bj.consts, [*bc, *c], [*bw, *([None] * n)], sub)[0]

    outs = lax.while_loop(cond, body, list(init))
    return list(outs), [None] * len(outs)


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


# Path entries that wrap a leaf rather than name it (NNX `Variable.value`, penzai's `.value`).
_WRAPPER_KEYS = frozenset({"value", "raw_value"})


def _key_name(key) -> str | None:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name in _WRAPPER_KEYS else key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def leaf_path(argnum: int, keys: Sequence, several: bool) -> str:
    """A weight leaf's name: its path inside argument `argnum`, "/"-joined ("params/Dense_0/kernel",
    "layers/0/kernel"), prefixed by "arg{argnum}/" when several arguments hold weights; "arg{argnum}"
    for an argument that is one array."""
    names = [n for n in map(_key_name, keys) if n is not None]
    if not names:
        return f"arg{argnum}"
    return "/".join([f"arg{argnum}"] * several + names)


def keep_predicate(keep) -> Callable[[DotRecord], bool] | None:
    """`keep=` as a predicate: a callable as it is; a regular expression or a sequence of them
    matches (`re.search`) a matmul's `weight_path`."""
    if keep is None or callable(keep):
        return keep
    patterns = (keep,) if isinstance(keep, str) else tuple(keep)
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(
                f"keep= takes a predicate on DotRecord or regular expressions (str) matched against "
                f"weight paths, got {pattern!r}"
            )
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"keep pattern {pattern!r} is not a regular expression: {e}") from e

    def matches(record: DotRecord) -> bool:
        return record.weight_path is not None and any(c.search(record.weight_path) for c in compiled)

    return matches


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
        with_paths, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
        leaves = [leaf for _, leaf in with_paths]
        # Each leaf's weight path, None for an activation. The path's first key picks args or
        # kwargs, the second the argument.
        flags = [
            leaf_path(keys[1].idx, keys[2:], len(wa) > 1)
            if keys[0].idx == 0 and keys[1].idx in wa else None
            for keys, _ in with_paths
        ]
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
    keep: Callable[[DotRecord], bool] | str | Sequence[str] | None = None,
) -> Autocast:
    """`fn` with every matmul between a weight and an activation in FP8 (DeepSeek-V3 recipe).

    A function transform like `jax.grad`: the result has `fn`'s signature and composes with
    `jit`, `grad`, `vmap`, `checkpoint` and `shard_map`.

    Args:
      fn: any JAX function (a Flax `model.apply`, an NNX or equinox module call, plain code).
      recipe: the `Fp8Recipe` of weight x activation matmuls.
      weight_argnums: the positional arguments holding weights (a pytree each). Whatever is
        derived from them by layout-only primitives (`LAYOUT_PRIMITIVES`) is a weight. Check it
        in `.report`: with the default (0,), `autocast(lambda x, w: x @ w)` takes x as the
        weight (128x128 blocks on the activation); pass `weight_argnums=1` there.
      between_activations: recipe for activation x activation matmuls (attention scores,
        probs·V), with rhs scaled as `recipe.weight_block` says; None (default) keeps them in the
        input precision, as DeepSeek-V3 keeps attention in BF16.
      keep: which weight x activation matmuls stay in the input precision, as DeepSeek-V3 keeps
        its output head and MoE gate: regular expressions (a str or a sequence of them) searched
        in the weight's path (`DotRecord.weight_path`, e.g. `keep=(r"router", r"^head/")`), or a
        predicate on the matmul's `DotRecord` (True keeps it).

    Returns:
      A callable; `.report(*args)` lists what each matmul became (`DotRecord`s).
    """
    if isinstance(weight_argnums, int):
        weight_argnums = (weight_argnums,)
    return Autocast(fn, recipe, weight_argnums, between_activations, keep_predicate(keep))


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


def weight_on_the_left(r: DotRecord) -> bool:
    """Whether the weight is `a` of a plain `a @ b` (a's last axis against b's first non-batch
    axis): where `autocast(lambda x, w: x @ w)` with the default weight_argnums puts x."""
    if r.weight != "lhs":
        return False
    (lc, rc), (_, rb) = r.dimension_numbers
    return tuple(lc) == (len(r.lhs_shape) - 1,) and tuple(rc) == (len(rb),)


def format_report(records: Sequence[DotRecord]) -> str:
    """A table of `Autocast.report`'s records, one matmul per line: FP8 or kept, the kind, the
    operand taken as the weight and its path (`rhs: layers/0/attn/wq/kernel`), the shapes, the
    source line and scope, and why a matmul is not FP8."""
    lines = [f"{sum(r.fp8 for r in records)} of {len(records)} matmuls in FP8"]
    weights = [f"{r.weight}: {r.weight_path}" if r.weight_path else "-" for r in records]
    width = min(max(map(len, weights), default=0), 48)
    for r, w in zip(records, weights):
        status = "FP8 " if r.fp8 else "kept"
        shapes = f"{r.lhs_shape} x {r.rhs_shape} {r.dtype}"
        scope = f" in {'/'.join(r.scope)}" if r.scope else ""
        notes = [r.note] if r.note else []
        if weight_on_the_left(r):
            notes.append("the weight is a in a @ b: if a is the activation, set weight_argnums")
        note = f" ({'; '.join(notes)})" if notes else ""
        lines.append(f"  {status} {r.kind:24s} {w:{width}s} {shapes:34s} {r.where}{scope}{note}")
    return "\n".join(lines)
