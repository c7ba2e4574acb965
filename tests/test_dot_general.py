"""fp8_dot_general for any dimension numbers, and jfp8.einsum: layout against a float64 oracle,
numerics against fp8_linear on the flattened 2-D problem, gradients against f32 autodiff."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import jfp8
from jfp8 import Fp8Recipe, fp8_dot_general, fp8_linear
from helpers import fresh_rng as _rng, rel_error as _rel

XLA = Fp8Recipe(impl="xla")
QUANT_BOUND = 0.06  # as in test_ops: two E4M3 operands, ~3.7 % rms expected


def _oracle(lhs, rhs, dims):
    """lax.dot_general in float64 numpy, through np.einsum."""
    (lc, rc), (lb, rb) = dims
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    ls, rs = [""] * lhs.ndim, [""] * rhs.ndim
    for a, b in zip((*lb, *lc), (*rb, *rc)):
        ls[a] = rs[b] = next(letters)
    lf = [a for a in range(lhs.ndim) if not ls[a]]
    rf = [b for b in range(rhs.ndim) if not rs[b]]
    for a in lf:
        ls[a] = next(letters)
    for b in rf:
        rs[b] = next(letters)
    out = "".join(ls[a] for a in lb) + "".join(ls[a] for a in lf) + "".join(rs[b] for b in rf)
    return np.einsum(f"{''.join(ls)},{''.join(rs)}->{out}", np.asarray(lhs, np.float64),
                     np.asarray(rhs, np.float64))


@st.composite
def _problems(draw):
    """A random dot_general: roles (batch, contracting, free) of each operand's axes, in random
    order, with the weight on a random side. Sizes keep K >= 128 and >= 32 outputs."""
    batch = draw(st.lists(st.integers(1, 3), max_size=2))
    contract = draw(st.sampled_from([[130], [256], [2, 64], [3, 50], [2, 3, 40]]))
    x_free = draw(st.lists(st.integers(2, 9), max_size=2))
    w_free = draw(st.lists(st.integers(3, 40), max_size=2))
    assume(math.prod(batch + x_free + w_free) >= 32)
    x_roles = [("b", i) for i in range(len(batch))] + [("c", i) for i in range(len(contract))] + [
        ("f", i) for i in range(len(x_free))]
    w_roles = [("b", i) for i in range(len(batch))] + [("c", i) for i in range(len(contract))] + [
        ("g", i) for i in range(len(w_free))]
    x_roles, w_roles = draw(st.permutations(x_roles)), draw(st.permutations(w_roles))
    pair_order = draw(st.permutations(range(len(contract))))
    weight = draw(st.sampled_from(["lhs", "rhs"]))
    sizes = {"b": batch, "c": contract, "f": x_free, "g": w_free}
    x_shape = tuple(sizes[r][i] for r, i in x_roles)
    w_shape = tuple(sizes[r][i] for r, i in w_roles)
    xc = tuple(x_roles.index(("c", i)) for i in pair_order)
    wc = tuple(w_roles.index(("c", i)) for i in pair_order)
    xb = tuple(x_roles.index(("b", i)) for i in range(len(batch)))
    wb = tuple(w_roles.index(("b", i)) for i in range(len(batch)))
    if weight == "rhs":
        return x_shape, w_shape, ((xc, wc), (xb, wb)), weight
    return w_shape, x_shape, ((wc, xc), (wb, xb)), weight


@jax.jit(static_argnames=("dims", "weight"))
def _fp8_and_f32_vjps(lhs, rhs, dy, dims, weight):
    """(y, dlhs, drhs) of fp8_dot_general and (dlhs, drhs) of lax.dot_general in f32."""
    y, vjp = jax.vjp(lambda a, b: fp8_dot_general(a, b, dims, recipe=XLA, weight=weight), lhs, rhs)
    want = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs)[1](dy)
    return (y, *vjp(dy)), want


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_any_dimension_numbers_match_the_oracle_with_fp8_grads(problem):
    """Output layout against float64 numpy; dlhs, drhs against f32 autodiff of lax.dot_general."""
    lhs_shape, rhs_shape, dims, weight = problem
    rng, seed = _rng()
    lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)

    want = _oracle(lhs, rhs, dims)
    dy = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
    (y, *grads), want_grads = _fp8_and_f32_vjps(lhs, rhs, dy, dims, weight)
    assert y.shape == want.shape, (y.shape, want.shape, problem)
    assert _rel(y, want) < QUANT_BOUND, f"seed {seed}, {problem}"
    for g, w in zip(grads, want_grads):
        assert g.shape == w.shape and _rel(g, w) < QUANT_BOUND, f"seed {seed}, {problem}"


@jax.jit
def _vjp_pair(x2, w2, o, w, dy2, dy):
    """(y, dx, dw) of fp8_linear on the flattened problem and of the 4-D einsum form."""
    lin = jax.vjp(lambda a, b: fp8_linear(a, b, XLA), x2, w2)
    gen = jax.vjp(lambda a, b: jfp8.einsum("btnh,nhd->btd", a, b, recipe=XLA), o, w)
    return (lin[0], *lin[1](dy2)), (gen[0], *gen[1](dy))


def test_several_contracting_axes_are_one_flattened_k():
    """`BTNH,NHD->BTD` is exactly fp8_linear on [B*T, N*H] x [N*H, D]: the 1x128 tiles run along
    the flattened (N, H), H fastest, and so do the gradients (bit for bit)."""
    rng, seed = _rng()
    b, t, n, h, d = 2, 9, 3, 64, 72
    o = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, h, d)) / 14, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16)
    lin, gen = _vjp_pair(o.reshape(b * t, n * h), w.reshape(n * h, d), o, w,
                         dy.reshape(b * t, d), dy)
    for got, want in zip(gen, (lin[0].reshape(b, t, d), lin[1].reshape(o.shape), lin[2].reshape(w.shape))):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                      err_msg=f"seed {seed}")


def test_batch_axes_are_one_gemm_per_element_and_weight_on_the_left():
    """Stacked experts `ekn,etk->etn` (weight as lhs, expert axis a batch axis) equal a loop of
    fp8_linear, one expert at a time, gradients included."""
    rng, seed = _rng()
    e, t, k, n = 3, 20, 136, 48
    w = jnp.asarray(rng.standard_normal((e, k, n)) / 12, jnp.float32)
    x = jnp.asarray(rng.standard_normal((e, t, k)), jnp.float32)
    dims = (((1,), (2,)), ((0,), (0,)))  # lhs = w [e, k, n], rhs = x [e, t, k] -> [e, n, t]

    def loss_gen(w, x):
        y = fp8_dot_general(w, x, dims, recipe=XLA, weight="lhs")
        return jnp.sum(jnp.sin(y)), y

    def loss_loop(w, x):
        y = jnp.stack([fp8_linear(x[i], w[i], XLA).T for i in range(e)])
        return jnp.sum(jnp.sin(y)), y

    (_, y), g = jax.jit(jax.value_and_grad(loss_gen, (0, 1), has_aux=True))(w, x)
    (_, y2), g2 = jax.jit(jax.value_and_grad(loss_loop, (0, 1), has_aux=True))(w, x)
    assert y.shape == (e, n, t)
    for got, want in ((y, y2), *zip(g, g2)):
        assert _rel(got, want) <= 1e-6, f"seed {seed}"


def test_f32_output_from_bf16_activations_is_unrounded():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((7, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 40)), jnp.float32)
    y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, recipe=XLA)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, fp8_linear(x.astype(jnp.float32), w, XLA))


def test_off_recipe_is_lax_dot_general():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((4, 3, 130)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 130, 5)), jnp.float32)
    dims = (((2, 1), (1, 0)), ((), ()))
    np.testing.assert_array_equal(
        fp8_dot_general(x, w, dims, recipe=Fp8Recipe.off()), jax.lax.dot_general(x, w, dims))


def test_einsum_attention_projection_grads_within_bound_of_f32():
    rng, seed = _rng()
    o = jnp.asarray(rng.standard_normal((2, 16, 4, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 32, 96)) / 11, jnp.float32)
    loss = lambda f: lambda o, w: jnp.sum(jnp.sin(f("btnh,nhd->btd", o, w)))  # noqa: E731
    g8 = jax.jit(jax.grad(loss(lambda s, o, w: jfp8.einsum(s, o, w, recipe=XLA)), (0, 1)))(o, w)
    g32 = jax.grad(loss(jnp.einsum), (0, 1))(o, w)
    # Each gradient multiplies two E4M3-quantized operands: about sqrt(2) x E4M3's 3.6 % rms,
    # 5.1 %. Measured over seeds 0-399 (2026-11-28): do 4.86 % mean, 5.47 % max; dw 5.37 % mean,
    # 5.90 % at the 99th percentile, 6.15 % max (seed 1766254805 also gave 6.04 %), so QUANT_BOUND
    # failed about 1 run in 400 for dw. Bounds about 5 standard deviations above each mean:
    for a, b, bound in zip(g8, g32, (QUANT_BOUND, 0.065)):
        assert _rel(a, b) < bound, f"seed {seed}"


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: fp8_dot_general(jnp.ones((4, 3)), jnp.ones((5, 3)), (((), ()), ((), ()))),
         NotImplementedError, "needs a contracting axis.*jax.lax.dot_general"),
        (lambda: fp8_dot_general(jnp.ones((4, 3)), jnp.ones((4, 3)), (((1,), (0,)), ((), ()))),
         ValueError, "contracting axes differ in size"),
        (lambda: fp8_dot_general(jnp.ones((4, 3)), jnp.ones((3, 2)), (((1,), (0, 1)), ((), ()))),
         ValueError, "as many contracting axes"),
        (lambda: fp8_dot_general(jnp.ones((4, 3)), jnp.ones((3, 2)), (((2,), (0,)), ((), ()))),
         ValueError, "out of range"),
        (lambda: fp8_dot_general(jnp.ones((4, 3)), jnp.ones((3, 2)), (((1,), (0,)), ((), ())), weight="w"),
         ValueError, '"lhs" or "rhs"'),
        (lambda: fp8_dot_general(jnp.ones((4, 3), jnp.int32), jnp.ones((3, 2)), (((1,), (0,)), ((), ()))),
         TypeError, "bfloat16 or float32"),
        (lambda: jfp8.einsum("i,j->ij", jnp.ones(3), jnp.ones(4)), NotImplementedError, "jnp.einsum"),
    ],
    ids=["outer", "sizes", "counts", "range", "side", "dtype", "einsum-outer"],
)
def test_what_cannot_be_fp8_says_so(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_batch_axes_reach_the_kernels_in_the_interpreter():
    """Batch axes are a `jax.vmap` of fp8_linear: the Mosaic GPU kernels (interpreted) batch
    correctly and give the XLA reference's bits, gradients included."""
    rng, seed = _rng()
    w = jnp.asarray(rng.standard_normal((2, 128, 136)) / 12, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 40, 128)), jnp.bfloat16)
    dims = (((2,), (1,)), ((0,), (0,)))

    def vjp(recipe):
        y, back = jax.vjp(lambda x, w: fp8_dot_general(x, w, dims, recipe=recipe), x, w)
        return (y, *back(jnp.ones_like(y)))

    got = jax.jit(lambda: vjp(Fp8Recipe(interpret=True)))()
    want = jax.jit(lambda: vjp(XLA))()
    for g, w_ in zip(got, want):
        assert _rel(g, w_) <= 1e-6, f"seed {seed}"
