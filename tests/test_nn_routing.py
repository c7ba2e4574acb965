"""DeepSeekMoE routing: top-K invariants, dispatch/combine vs a per-token loop, load balancing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfp8.nn import (
    ModelConfig,
    MoE,
    combine,
    dispatch,
    expert_loads,
    router_scores,
    sequence_balance_loss,
    top_k_routing,
    update_bias,
)
from jfp8.recipe import Fp8Recipe
from helpers import fresh_rng as _rng


def _scores(rng, t, e):
    return jax.nn.sigmoid(jnp.asarray(rng.standard_normal((t, e)), jnp.float32))  # [T, E]


@pytest.mark.parametrize("t,e,k", [(64, 4, 2), (33, 16, 4), (8, 8, 1), (5, 6, 6)])
def test_top_k_invariants(t, e, k):
    rng, seed = _rng()
    scores = _scores(rng, t, e)
    bias = jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32)
    experts, weights = top_k_routing(scores, bias, k)
    chex.assert_shape((experts, weights), (t, k))
    experts, weights = np.asarray(experts), np.asarray(weights)
    assert ((experts >= 0) & (experts < e)).all(), f"seed {seed}"
    assert all(len(set(row)) == k for row in experts), f"seed {seed}: repeated expert in a token"
    assert (weights > 0).all(), f"seed {seed}"
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6, err_msg=f"seed {seed}")
    # selection is the top-K of s + b
    biased = np.asarray(scores + bias)
    kth = np.sort(biased, axis=-1)[:, -k]
    assert (np.take_along_axis(biased, experts, -1) >= kth[:, None]).all(), f"seed {seed}"


def test_bias_changes_selection_not_gating_formula():
    rng, seed = _rng()
    t, e, k = 128, 8, 2
    scores = _scores(rng, t, e)
    free, _ = top_k_routing(scores, jnp.zeros(e), k)
    bias = jnp.zeros(e).at[3].set(10.0)  # forces expert 3 into every token's top-K
    experts, weights = top_k_routing(scores, bias, k)
    assert (np.asarray(experts) == 3).any(-1).all(), f"seed {seed}"
    assert not (np.asarray(free) == 3).any(-1).all(), f"seed {seed}: the bias had nothing to change"
    chosen = np.take_along_axis(np.asarray(scores), np.asarray(experts), -1)  # unbiased s
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


def test_router_scores_are_fp32_sigmoid():
    rng, _ = _rng()
    x = jnp.asarray(rng.standard_normal((10, 16)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    s = router_scores(x, gate)
    assert s.dtype == jnp.float32
    want = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(gate, np.float64))))
    np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-6)


def test_dispatch_sorts_by_expert_and_combine_inverts_it():
    rng, seed = _rng()
    t, e, k, d = 50, 6, 3, 8
    experts, weights = top_k_routing(_scores(rng, t, e), jnp.zeros(e), k)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    x_sorted, sizes, order = dispatch(x, experts, e)
    chex.assert_shape(x_sorted, (t * k, d))
    assert int(sizes.sum()) == t * k
    row_expert = np.asarray(experts).reshape(-1)[np.asarray(order)]
    assert (np.diff(row_expert) >= 0).all(), f"seed {seed}: rows not sorted by expert"
    np.testing.assert_array_equal(np.bincount(row_expert, minlength=e), sizes)
    np.testing.assert_array_equal(expert_loads(experts, e), sizes)
    np.testing.assert_array_equal(x_sorted, np.asarray(x)[np.asarray(order) // k])
    # Identity experts: the gates of a token sum to 1, so combine(dispatch(x)) == x.
    np.testing.assert_allclose(combine(x_sorted, order, weights), x, rtol=1e-5, atol=1e-6)


def test_grouped_dispatch_combine_matches_per_token_loop():
    """Sort -> ragged_dot per expert -> unsort/combine equals Σ_k g_k x_t W_{e_k}, token by token."""
    rng, seed = _rng()
    t, e, k, d, n = 40, 5, 2, 8, 6
    scores = _scores(rng, t, e)
    experts, weights = top_k_routing(scores, jnp.asarray(rng.standard_normal(e), jnp.float32), k)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, d, n)), jnp.float32)
    x_sorted, sizes, order = dispatch(x, experts, e)
    y_sorted = jax.lax.ragged_dot(x_sorted, w, sizes, precision=jax.lax.Precision.HIGHEST)
    got = combine(y_sorted, order, weights)
    want = np.zeros((t, n))
    xe, we, ee, ge = (np.asarray(a, np.float64) for a in (x, w, experts, weights))
    for tok in range(t):
        for j in range(k):
            want[tok] += ge[tok, j] * xe[tok] @ we[int(ee[tok, j])]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")


def test_moe_module_matches_per_token_loop():
    """The MoE module (BF16-baseline recipe, FP32 compute) equals shared + Σ_k g_k SwiGLU_{e_k}."""
    rng, seed = _rng()
    cfg = ModelConfig.tiny(dtype="float32", recipe=Fp8Recipe.off())
    moe = MoE(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    moe.router_bias[...] = jnp.asarray(rng.standard_normal(cfg.n_routed) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 12, cfg.d_model)), jnp.float32)
    y, stats = jax.jit(lambda m, x: m(x))(moe, x)

    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    xs = f64(x).reshape(-1, cfg.d_model)
    gate, bias, w13, w2 = f64(moe.gate[...]), f64(moe.router_bias[...]), f64(moe.w13[...]), f64(moe.w2[...])
    sw13, sw2 = f64(moe.shared.w13.weight[...]), f64(moe.shared.w2.weight[...])
    h = cfg.moe_hidden
    want = np.zeros_like(xs)
    loads = np.zeros(cfg.n_routed, int)
    for tok, u in enumerate(xs):
        s = 1 / (1 + np.exp(-(u @ gate)))
        top = np.argsort(-(s + bias))[: cfg.top_k]
        loads[top] += 1
        for i in top:
            a = u @ w13[i]
            want[tok] += s[i] / s[top].sum() * (silu(a[:h]) * a[h:]) @ w2[i]
        a = u @ sw13
        want[tok] += (silu(a[: cfg.n_shared * h]) * a[cfg.n_shared * h :]) @ sw2
    np.testing.assert_allclose(y.reshape(-1, cfg.d_model), want, rtol=1e-3, atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(stats.loads, loads)


# ------------------------------------------------------------------------------ load balancing


def test_bias_updates_balance_a_skewed_router():
    """Auxiliary-loss-free balancing: ±γ bias steps drive max/mean load toward 1."""
    rng, seed = _rng()
    t, e, k, gamma = 2048, 8, 2, 0.01
    skew = np.linspace(2.0, -2.0, e)  # expert 0 is strongly preferred, expert 7 rarely chosen
    scores = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((t, e)) + skew, jnp.float32))

    @jax.jit
    def step(bias):
        experts, _ = top_k_routing(scores, bias, k)
        loads = expert_loads(experts, e)
        return update_bias(bias, loads, gamma), loads

    bias, trajectory = jnp.zeros(e, jnp.float32), []
    for _ in range(300):
        bias, loads = step(bias)
        trajectory.append(float(loads.max() / loads.mean()))
    print(f"seed {seed}: max/mean expert load every 25 steps:", [round(r, 3) for r in trajectory[::25]],
          "final", round(trajectory[-1], 3))
    assert trajectory[0] > 2.0, f"seed {seed}: the router was not skewed"
    assert max(trajectory[-50:]) < 1.15, f"seed {seed}: {trajectory[-50:]}"
    # the gating weights never saw the bias: still the normalised unbiased affinities
    experts, weights = top_k_routing(scores, bias, k)
    chosen = np.take_along_axis(np.asarray(scores), np.asarray(experts), -1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


def test_update_bias_sign():
    bias = jnp.array([0.0, 0.5, -0.5, 0.0])
    loads = jnp.array([10, 2, 4, 4])  # mean 5: expert 0 overloaded, the rest underloaded
    np.testing.assert_allclose(update_bias(bias, loads, 0.1), [-0.1, 0.6, -0.4, 0.1], rtol=1e-6)
    np.testing.assert_allclose(update_bias(bias, jnp.array([3, 3, 3, 3]), 0.1), bias)


def test_sequence_balance_loss_minimum_at_perfect_balance():
    """With the paper's L = α Σ_i f_i P_i (eq. 17-20), perfect balance gives α·1, not 0: f_i = 1
    for every expert and Σ_i P_i = 1. Balance minimises it when the affinities agree with the
    selection (P_i ∝ f_i): then L = α/N_r Σ_i f_i² >= α (Cauchy-Schwarz with Σ_i f_i = N_r), with
    equality exactly when every f_i = 1. (For arbitrary scores no such minimum holds: the loss is
    a pressure toward balance, not a distance to it.)"""
    rng, seed = _rng()
    b, t, e, k, alpha = 3, 32, 8, 2, 0.01

    # Perfect balance (each expert chosen by T·K/E tokens of every sequence): L = α for any scores.
    balanced = np.stack([(np.arange(t)[:, None] * k + np.arange(k)) % e] * b)  # [B, T, K]
    scores = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, e)), jnp.float32))
    loss = sequence_balance_loss(scores, jnp.asarray(balanced, jnp.int32), alpha)
    np.testing.assert_allclose(loss, alpha, rtol=1e-5, err_msg=f"seed {seed}")

    def consistent_scores(experts):  # affinity ~1 on the chosen experts, ~0 elsewhere
        onehot = np.zeros((b, t, e))
        np.put_along_axis(onehot, experts, 1.0, axis=-1)
        return jnp.asarray(np.where(onehot > 0, 1 - 1e-6, 1e-6), jnp.float32)

    at_balance = sequence_balance_loss(consistent_scores(balanced), jnp.asarray(balanced, jnp.int32), alpha)
    np.testing.assert_allclose(at_balance, alpha, rtol=1e-4)
    for _ in range(5):  # random, imbalanced routings: strictly larger
        prefer = np.linspace(3, 1, e) / np.linspace(3, 1, e).sum()  # low experts more popular
        skewed = np.array([[rng.choice(e, k, replace=False, p=prefer) for _ in range(t)] for _ in range(b)])
        loss = sequence_balance_loss(consistent_scores(skewed), jnp.asarray(skewed, jnp.int32), alpha)
        assert float(loss) > alpha * (1 + 1e-3), f"seed {seed}: {float(loss)} vs {alpha}"
