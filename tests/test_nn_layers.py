"""Layers: Fp8Linear (FP8 vs BF16), RMSNorm, RoPE, and Multi-head Latent Attention."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfp8.nn import MLA, Fp8Linear, ModelConfig, RMSNorm, apply_rope, rope_angles
from jfp8.recipe import Fp8Recipe
from helpers import fresh_rng as _rng, rel_error as _rel

QUANT_BOUND = 0.06  # two E4M3 operands at ~2.6 % rms error each: ~3.7 % expected (as tests/test_ops.py)


def test_fp8_linear_module_fp8_vs_bf16_and_grads():
    rng, seed = _rng()
    rngs = nnx.Rngs(int(rng.integers(1 << 30)))
    lin = Fp8Linear(200, 96, recipe=Fp8Recipe.deepseek(), use_bias=True, rngs=rngs)
    lin.bias[...] = jnp.asarray(rng.standard_normal(96), jnp.float32)
    assert lin.weight[...].dtype == jnp.float32 and lin.weight[...].shape == (200, 96)
    x = jnp.asarray(rng.standard_normal((3, 40, 200)), jnp.bfloat16)
    fwd = jax.jit(lambda m, x: m(x))
    y = fwd(lin, x)
    chex.assert_shape(y, (3, 40, 96))
    assert y.dtype == jnp.bfloat16
    x64, w64, b64 = (np.asarray(a, np.float64) for a in (x, lin.weight[...], lin.bias[...]))
    assert _rel(y, x64 @ w64 + b64) < QUANT_BOUND, f"seed {seed}"
    bf16 = Fp8Linear(200, 96, recipe=Fp8Recipe.off(), use_bias=True, rngs=nnx.Rngs(0))
    nnx.update(bf16, nnx.state(lin))  # same weights, BF16 recipe
    assert _rel(y, fwd(bf16, x)) < QUANT_BOUND, f"seed {seed}"

    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)))(lin, x)
    for g in jax.tree.leaves(grads):
        assert jnp.isfinite(g).all()
    assert grads["weight"][...].dtype == jnp.float32
    with pytest.raises(ValueError, match="expects x"):
        lin(x[..., :100])


def test_rmsnorm_fp32():
    rng, _ = _rng()
    norm = RMSNorm(48, eps=1e-6)
    norm.scale[...] = jnp.asarray(rng.standard_normal(48), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 48)) * 3, jnp.bfloat16)
    y = norm(x)
    assert y.dtype == jnp.bfloat16 and norm.scale[...].dtype == jnp.float32
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(norm.scale[...])
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-2, atol=2e-2)


def test_rope_scores_depend_on_relative_position_only():
    rng, seed = _rng()
    dim, t = 16, 40
    q = jnp.asarray(rng.standard_normal((1, 1, 1, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, dim)), jnp.float32)
    cos, sin = rope_angles(jnp.arange(t), dim, 10000.0)

    def score(m, n):
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return float(jnp.sum(qm * kn))

    np.testing.assert_allclose(score(7, 3), score(30, 26), rtol=1e-4, err_msg=f"seed {seed}")
    np.testing.assert_allclose(score(0, 0), float(jnp.sum(q * k)), rtol=1e-5)  # position 0: identity
    assert abs(score(7, 3) - score(7, 5)) > 1e-4


@pytest.fixture(scope="module")
def mla_setup():
    cfg = ModelConfig.tiny()  # default FP8 recipe: 1x128 activation tiles keep rows independent
    mla = MLA(cfg, rngs=nnx.Rngs(0))
    return cfg, mla, jax.jit(lambda m, x: m(x))


def test_mla_shapes_and_projections(mla_setup):
    cfg, mla, fwd = mla_setup
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((2, 24, cfg.d_model)), jnp.bfloat16)
    y = fwd(mla, x)
    chex.assert_shape(y, (2, 24, cfg.d_model))
    assert y.dtype == jnp.bfloat16 and jnp.isfinite(y.astype(jnp.float32)).all()
    # compressed latents: d'_c for queries, d_c (+ shared RoPE key) for keys/values
    assert mla.wq_a.weight[...].shape == (cfg.d_model, cfg.q_lora_rank)
    assert mla.wkv_a.weight[...].shape == (cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv_b_out = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    assert mla.wkv_b.weight[...].shape == (cfg.kv_lora_rank, kv_b_out)
    assert all(isinstance(p, Fp8Linear) for p in (mla.wq_a, mla.wq_b, mla.wkv_a, mla.wkv_b, mla.wo))


def test_mla_is_causal(mla_setup):
    cfg, mla, fwd = mla_setup
    rng, seed = _rng()
    t, t0 = 24, int(rng.integers(1, 23))
    x = jnp.asarray(rng.standard_normal((2, t, cfg.d_model)), jnp.bfloat16)
    x2 = x.at[:, t0:].set(jnp.asarray(rng.standard_normal((2, t - t0, cfg.d_model)), jnp.bfloat16))
    y, y2 = fwd(mla, x), fwd(mla, x2)
    np.testing.assert_array_equal(y[:, :t0], y2[:, :t0], err_msg=f"seed {seed}, t0 {t0}: future leaked")
    assert not np.array_equal(y[:, t0:], y2[:, t0:])


def test_mla_depends_on_position_through_rope(mla_setup):
    """Without positions, causal attention at the last token sees its prefix as a set: permuting
    the earlier tokens leaves it unchanged. RoPE (MLA's only positional signal) makes it change;
    with the RoPE query/key columns zeroed it no longer does."""
    cfg, mla, fwd = mla_setup
    rng, seed = _rng()
    t, h, nope, rope = 24, cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    sharp = nnx.clone(mla)  # larger q/k weights: peaked attention instead of near-uniform at init
    sharp.wq_b.weight[...] *= 8
    sharp.wkv_a.weight[...] *= 8
    sharp.wkv_b.weight[...] *= 8
    no_rope = nnx.clone(sharp)
    wq_b = no_rope.wq_b.weight[...].reshape(cfg.q_lora_rank, h, nope + rope)
    no_rope.wq_b.weight[...] = wq_b.at[..., nope:].set(0).reshape(cfg.q_lora_rank, -1)
    no_rope.wkv_a.weight[...] = no_rope.wkv_a.weight[...].at[:, cfg.kv_lora_rank :].set(0)

    x = jnp.asarray(rng.standard_normal((2, t, cfg.d_model)), jnp.bfloat16)
    perm = np.concatenate([rng.permutation(t - 1), [t - 1]])  # shuffle the prefix, keep the last
    moved = lambda m: _rel(fwd(m, x[:, perm])[:, -1], fwd(m, x)[:, -1])  # noqa: E731
    with_rope, without_rope = moved(sharp), moved(no_rope)
    print(f"seed {seed}: last-token change after a prefix permutation: {with_rope:.3f} with RoPE, "
          f"{without_rope:.4f} without")
    assert with_rope > 0.1, f"seed {seed}: output ignores positions ({with_rope})"
    assert without_rope < 0.02, f"seed {seed}: position leaks in without RoPE ({without_rope})"


def test_normal_init_is_jax_normal_bit_for_bit_from_a_few_generators(monkeypatch):
    """A weight's initial values are `std * jax.random.normal(key, shape)` to the bit, drawn as the
    first elements of a power-of-two draw (threefry's element i depends on the key and i alone),
    so weights of several shapes share one compiled generator: fresh shapes on both sides of a
    draw's length, one element, an empty weight and one longer than the longest draw."""
    from jfp8.nn import layers

    rng, seed = _rng()
    edge = layers._MIN_DRAW
    shapes = [(1,), (0, 5), (edge,), (edge + 1,), (2, edge // 2, 3), (4, 64, 128)]
    shapes += [tuple(int(v) for v in rng.integers(1, 80, int(rng.integers(1, 4)))) for _ in range(8)]

    def check(shape):
        key_seed, std = int(rng.integers(1 << 30)), float(rng.uniform(0.001, 1.0))
        got = layers.normal_init(nnx.Rngs(key_seed), shape, std)
        want = std * jax.random.normal(nnx.Rngs(key_seed).params(), shape, jnp.float32)
        assert got.shape == shape and got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32),
                                      err_msg=f"seed {seed} shape {shape}")

    for shape in shapes:
        check(shape)
    with monkeypatch.context() as m:  # the longest draw made short: a weight past it
        m.setattr(layers, "_MAX_DRAW", 2 * edge)
        check((3, 2 * edge + 5))
    before = layers._flat_normal._cache_size()
    for shape in [(3, 7), (100, 100), (16, 1024)]:  # every one within the shortest draw
        layers.normal_init(nnx.Rngs(0), shape, 0.02)
    assert layers._flat_normal._cache_size() - before <= 1
