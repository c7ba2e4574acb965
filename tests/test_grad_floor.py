"""The amax floor per role: activations and weights keep DeepGEMM's 1e-4, gradients get one that
binds only where a scale would leave f32's normal range, so dy's scales follow it at any size.

The interpreted kernels' bits at the gradient floor are checked in tests/test_quantize_kernels.py
(`test_bit_identical_at_the_gradient_floor`); DeepGEMM's bits at the default floor in
tests/test_deepgemm_parity.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jfp8
from jfp8.nn import ModelConfig
from jfp8 import AMAX_FLOOR, GRAD_AMAX_FLOOR, TILE, Fp8Recipe, fp8_linear, grouped_fp8_linear, quantize
from helpers import fresh_rng as _rng

F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # 2^-126, the smallest normal f32
XLA = Fp8Recipe(impl="xla")


def test_the_recipe_floors_per_role():
    r = Fp8Recipe()
    assert r.activation_amax_floor == r.weight_amax_floor == AMAX_FLOOR == 1e-4
    assert r.grad_amax_floor == GRAD_AMAX_FLOOR == 448 * 2.0**-126
    # The presets carry the same defaults (the model, autocast and the demo get them with no flag).
    assert ModelConfig.tiny().recipe.grad_amax_floor == GRAD_AMAX_FLOOR
    assert Fp8Recipe.per_tensor().grad_amax_floor == GRAD_AMAX_FLOOR


@pytest.mark.parametrize("bad", [0.0, -1.0, GRAD_AMAX_FLOOR / 2, float("nan"), float("inf")])
@pytest.mark.parametrize("role", ["activation_amax_floor", "weight_amax_floor", "grad_amax_floor"])
def test_a_floor_under_the_normal_range_is_a_clear_error(role, bad):
    with pytest.raises(ValueError, match=f"{role}.*at least"):
        Fp8Recipe(**{role: bad})
    with pytest.raises(ValueError, match="amax_floor"):
        jfp8.quantize(jnp.ones((2, 128)), amax_floor=bad)


def test_the_gradient_floor_keeps_every_scale_normal():
    """At the floor the scale is exactly 2^-126 (a normal f32; XLA flushes subnormal results to
    zero, so any lower floor would give zero scales and infinite reciprocals)."""
    scale = quantize(jnp.full((1, 128), GRAD_AMAX_FLOOR, jnp.float32), amax_floor=GRAD_AMAX_FLOOR).scale
    assert float(scale[0, 0]) == F32_TINY
    for pow2 in (False, True):
        q = quantize(jnp.zeros((3, 256)), (1, TILE), amax_floor=GRAD_AMAX_FLOOR, pow2_scale=pow2)
        assert np.all(np.asarray(q.data, np.float32) == 0)
        assert np.all(np.asarray(q.scale) == F32_TINY) and np.all(np.isfinite(np.asarray(q.dequantize())))


def test_under_the_gradient_floor_every_normal_value_keeps_e4m3_precision():
    """A tile of normal f32 values whose amax lies under the floor (< 5.3e-36) encodes each of them
    to an E4M3 value >= 1: a normal E4M3 number, within 2^-4 relative. Nothing flushes to zero."""
    rng, seed = _rng()
    x = F32_TINY * np.exp2(rng.uniform(0, 8.5, (4, 128))) * rng.choice([-1, 1], (4, 128))
    x = jnp.asarray(x, jnp.float32)
    q = quantize(x, (1, TILE), amax_floor=GRAD_AMAX_FLOOR)
    assert np.all(np.abs(np.asarray(q.data, np.float32)) >= 1), f"seed {seed}"
    rel = np.abs(np.asarray(q.dequantize(), np.float64) / np.asarray(x, np.float64) - 1)
    assert rel.max() <= 2.0**-4, f"seed {seed}"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(-80, 100),
       block=st.sampled_from([(1, TILE), (TILE, 1), (TILE, TILE), None]), pow2=st.booleans())
def test_gradient_quantization_is_equivariant_to_powers_of_two(seed, k, block, pow2):
    """Multiplying dy by 2^k multiplies its scales by 2^k and leaves its E4M3 data bit for bit,
    wherever the amax stays at or above the floor: no magnitude of gradient is treated differently.
    (k >= -80 keeps every element a normal f32, which XLA does not flush.)"""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((130, 300)) * np.exp2(rng.integers(-20, 0, (130, 1)))
    x, xk = jnp.asarray(x, jnp.float32), jnp.asarray(x * 2.0**k, jnp.float32)
    q, qk = (_q(v, block, pow2) for v in (x, xk))
    np.testing.assert_array_equal(np.asarray(qk.data).view(np.uint8), np.asarray(q.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(qk.scale), np.asarray(q.scale) * np.float32(2.0**k))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _q(x, block, pow2):
    return quantize(x, block, amax_floor=GRAD_AMAX_FLOOR, pow2_scale=pow2)


# ------------------------------------------------------------------ the training ops: dx, dW at 2^k


def _linear_grads(recipe, x, w, g, k):
    """dx, dW of sum(fp8_linear(x, w) * g) * 2^k, and of the same loss in f32 (the truth)."""
    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * g) * jnp.float32(2.0**k)
    got = jax.grad(loss(lambda x, w: fp8_linear(x, w, recipe)), (0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: x.astype(jnp.float32) @ w), (0, 1))(x, w)
    return got, want


def _grouped_grads(recipe, x, w, gs, g, k):
    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * g) * jnp.float32(2.0**k)
    got = jax.grad(loss(lambda x, w: grouped_fp8_linear(x, w, gs, recipe)), (0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: jax.lax.ragged_dot(x.astype(jnp.float32), w, gs)), (0, 1))(x, w)
    return got, want


@functools.partial(jax.jit, static_argnums=(0, 4))
def _linear_errors(recipe, x, w, g, k):
    (dx, dw), (tx, tw) = _linear_grads(recipe, x, w, g, k)
    return _rel_j(dx, tx), _rel_j(dw, tw)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _grouped_errors(recipe, x, w, gs, g, k):
    (dx, dw), (tx, tw) = _grouped_grads(recipe, x, w, gs, g, k)
    return _rel_j(dx, tx), _rel_j(dw, tw)


def _rel_j(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def _problem(rng, dtype):
    # A mean-like cotangent: every upstream gradient ~1e-4 (the 2^k scaling then takes it down).
    x = jnp.asarray(rng.standard_normal((256, 384)), dtype)
    w = jnp.asarray(rng.standard_normal((384, 256)) / 20, jnp.float32)
    g = jnp.asarray(rng.standard_normal((256, 256)) * 1e-4, jnp.float32)
    return x, w, g


KS = [0, -1, -7, -13, -20, -26, -33, -40]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_linear_gradient_error_is_the_same_at_every_loss_scale(dtype):
    """The relative error of dx and dW of `fp8_linear` when the loss is multiplied by 2^k, k in
    [-40, 0], against f32 autodiff of the same loss: the same for every k (the issue asks for
    within a few per cent; with no floor binding the bits themselves scale, so it is exact up to
    the f32 truth's own rounding)."""
    rng, seed = _rng()
    x, w, g = _problem(rng, dtype)
    errs = np.array([_linear_errors(XLA, x, w, g, k) for k in KS])  # [k, (dx, dW)]
    assert np.all(errs < 0.06), (seed, errs)
    np.testing.assert_allclose(errs, errs[:1].repeat(len(KS), 0), rtol=0.02, err_msg=f"seed {seed}")


def test_grouped_fp8_linear_gradient_error_is_the_same_at_every_loss_scale():
    rng, seed = _rng()
    x = jnp.asarray(rng.standard_normal((300, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 256, 130)) / 16, jnp.float32)
    gs = jnp.asarray([100, 0, 150, 20], jnp.int32)
    g = jnp.asarray(rng.standard_normal((300, 130)) * 1e-4, jnp.float32)
    errs = np.array([_grouped_errors(XLA, x, w, gs, g, k) for k in KS])
    assert np.all(errs < 0.06), (seed, errs)
    np.testing.assert_allclose(errs, errs[:1].repeat(len(KS), 0), rtol=0.02, err_msg=f"seed {seed}")


def test_the_old_floor_breaks_equivariance():
    """The check above can fail: with DeepGEMM's 1e-4 floor on dy (the default before the floors
    were split by role), the gradient error grows as the loss shrinks and reaches 100 % at 2^-40."""
    rng, seed = _rng()
    x, w, g = _problem(rng, jnp.float32)
    old = Fp8Recipe(impl="xla", grad_amax_floor=AMAX_FLOOR)
    e0, e40 = (np.array(_linear_errors(old, x, w, g, k)) for k in (0, -40))
    assert np.all(e0 < 0.06) and np.all(e40 > 0.5), (seed, e0, e40)
