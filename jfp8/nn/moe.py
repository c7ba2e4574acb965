"""DeepSeekMoE (DeepSeek-V3 report §2.1.2): shared + fine-grained routed experts, sigmoid routing,
auxiliary-loss-free load balancing and the complementary sequence-wise balance loss.

The routing is a chain of small pure functions, testable without Flax:

  router_scores      s = sigmoid(u · e)                        [T, E]   (FP32 gate, eq. 15)
  top_k_routing      top-K of s + b, gates g = s / Σ_topK s       [T, K]   (eq. 13, 16)
  dispatch           tokens sorted by expert + group sizes        [T*K, d]
  (experts)          grouped_fp8_linear on the sorted tokens      [T*K, d]   (module)
  combine            unsort, Σ_k g_k · y_k                        [T, d]
  expert_loads       tokens per expert                            [E]
  sequence_balance_loss   α Σ_i f_i P_i per sequence              ()       (eq. 17-20)
  update_bias        b_i += γ · sign(mean load − load_i)          [E]

Routing is dropless: every token reaches its K experts (no capacity factor).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jfp8.nn.config import ModelConfig
from jfp8.nn.layers import SwiGLU, normal_init, swiglu
from jfp8.ops import grouped_fp8_linear

# ------------------------------------------------------------------------------ pure routing


def router_scores(x: jax.Array, gate: jax.Array) -> jax.Array:
    """Sigmoid token-to-expert affinities s_{i,t} = sigmoid(u_t · e_i), in FP32.

    x [T, d] (any float dtype), gate [d, E] FP32 -> [T, E] FP32. The gate is a plain FP32 matmul
    (not FP8, §3.3.2); HIGHEST precision keeps TF32 out of it on GPUs.
    """
    logits = jnp.dot(x.astype(jnp.float32), gate, precision=jax.lax.Precision.HIGHEST)
    return jax.nn.sigmoid(logits)


def top_k_routing(scores: jax.Array, bias: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Select K experts per token by s + b; gate them by the unbiased s, normalised over the K.

    The bias b (auxiliary-loss-free balancing) only changes which experts are chosen: the
    gating weights are g_{i,t} = s_{i,t} / Σ_{j in topK} s_{j,t} (eq. 13), with no b in them.

    Args:
      scores: [T, E] FP32 affinities in (0, 1).
      bias: [E] FP32 per-expert selection bias (gets no gradient).
      k: experts per token.

    Returns:
      experts [T, K] int32 (distinct per token), weights [T, K] FP32 (positive, each row sums to 1).
    """
    if not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"k={k} must lie in [1, {scores.shape[-1]}] (the number of experts)")
    _, experts = jax.lax.top_k(scores + jax.lax.stop_gradient(bias), k)  # [T, K]
    chosen = jnp.take_along_axis(scores, experts, axis=-1)  # [T, K]: unbiased affinities
    return experts.astype(jnp.int32), chosen / jnp.sum(chosen, axis=-1, keepdims=True)


def dispatch(x: jax.Array, experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Copy each token once per chosen expert and sort the copies by expert (dropless).

    Args:
      x: [T, d] tokens.
      experts: [T, K] int32 expert ids.
      n_experts: E.

    Returns:
      x_sorted [T*K, d] (the rows of expert 0, then expert 1, ...), group_sizes [E] int32
      (rows per expert, summing to T*K), order [T*K] int32 (row r of x_sorted is assignment
      order[r] of `experts.ravel()`, i.e. token order[r] // K).
    """
    k = experts.shape[-1]
    flat = experts.reshape(-1)  # [T*K]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [T*K]
    x_sorted = jnp.take(x, order // k, axis=0)  # [T*K, d]
    return x_sorted, expert_loads(experts, n_experts), order


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Undo `dispatch` and sum each token's K expert outputs weighted by its gating weights.

    y_sorted [T*K, d] (rows in dispatch order), order [T*K] from `dispatch`, weights [T, K] FP32
    -> [T, d] in y_sorted's dtype (weighted sum in FP32).
    """
    t, k = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = jnp.take(y_sorted, inverse, axis=0).reshape(t, k, -1)  # [T, K, d]: assignment order
    out = jnp.einsum("tk,tkd->td", weights, y.astype(jnp.float32))
    return out.astype(y_sorted.dtype)


def expert_loads(experts: jax.Array, n_experts: int) -> jax.Array:
    """Tokens routed to each expert: experts [..., K] int -> [E] int32 counts."""
    return jnp.zeros((n_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def sequence_balance_loss(scores: jax.Array, experts: jax.Array, alpha: float) -> jax.Array:
    """Complementary sequence-wise balance loss (eq. 17-20), averaged over the sequences.

    Per sequence of T tokens: L_Bal = α Σ_i f_i P_i with
      f_i = N_r / (K T) · #{t : expert i in the top-K of token t}   (f_i = 1 when balanced)
      P_i = (1/T) Σ_t s'_{i,t},  s'_{i,t} = s_{i,t} / Σ_j s_{j,t}    (Σ_i P_i = 1)
    f is a count (no gradient); the gradient reaches the gate through P.

    Args:
      scores: [B, T, E] FP32 unbiased affinities.
      experts: [B, T, K] int32 selected experts (selection includes the bias).
      alpha: α.

    Returns:
      FP32 scalar.
    """
    b, t, n_r = scores.shape
    k = experts.shape[-1]
    seq = jnp.broadcast_to(jnp.arange(b)[:, None, None], experts.shape)
    counts = jnp.zeros((b, n_r), jnp.float32).at[seq, experts].add(1.0)  # [B, E]
    f = counts * (n_r / (k * t))  # [B, E]
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)  # [B, E]
    return alpha * jnp.mean(jnp.sum(f * p, axis=-1))


def update_bias(bias: jax.Array, loads: jax.Array, gamma: float) -> jax.Array:
    """Auxiliary-loss-free balancing step: b_i += γ·sign(mean load − load_i).

    Overloaded experts (load above the mean) become less likely to be selected, underloaded ones
    more. bias [E] FP32, loads [E] (counts) -> [E] FP32.
    """
    loads = loads.astype(jnp.float32)
    return bias + gamma * jnp.sign(jnp.mean(loads) - loads)


# ------------------------------------------------------------------------------ module


class RouterBias(nnx.Variable):
    """The per-expert selection bias b_i: state, not a parameter. `nnx.grad` and optimizers that
    filter on `nnx.Param` skip it; `update_router_biases` changes it between steps."""


class MoEStats(NamedTuple):
    """Per-layer routing statistics of one forward pass."""

    loads: jax.Array  # [E] int32: tokens routed to each expert
    balance_loss: jax.Array  # () FP32: α-weighted sequence-wise balance loss


class MoE(nnx.Module):
    """DeepSeekMoE FFN: N_s shared experts plus top-K of N_r routed SwiGLU experts.

    h'_t = Σ_shared FFN_s(u_t) + Σ_{i in topK} g_{i,t} FFN_i(u_t) (eq. 12; the residual is added by
    the block). Routed experts are two grouped FP8 GEMMs (fused gate/up, then down) over the tokens
    sorted by expert; the gate and the router bias are FP32.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, d, h, std = cfg.n_routed, cfg.d_model, cfg.moe_hidden, cfg.init_std
        self.gate = nnx.Param(normal_init(rngs, (d, e), std))  # centroids e_i as columns
        self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32))
        self.w13 = nnx.Param(normal_init(rngs, (e, d, 2 * h), std))  # [gate | up] of each expert
        self.w2 = nnx.Param(normal_init(rngs, (e, h, d), std))  # down projection
        self.shared = (
            SwiGLU(d, cfg.n_shared * h, recipe=cfg.recipe, init_std=std, rngs=rngs)
            if cfg.n_shared
            else None
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEStats]:
        """x [B, T, d] -> (y [B, T, d] in x's dtype, MoEStats)."""
        cfg = self.cfg
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)  # [N, d], N = B*T
        scores = router_scores(tokens, self.gate[...])  # [N, E]
        experts, weights = top_k_routing(scores, self.router_bias[...], cfg.top_k)  # [N, K] x2

        x_sorted, group_sizes, order = dispatch(tokens, experts, cfg.n_routed)  # [N*K, d]
        gate_up = grouped_fp8_linear(x_sorted, self.w13[...], group_sizes, cfg.recipe)  # [N*K, 2h]
        y_sorted = grouped_fp8_linear(swiglu(gate_up), self.w2[...], group_sizes, cfg.recipe)  # [N*K, d]
        y = combine(y_sorted, order, weights).reshape(b, t, d)  # [B, T, d]

        if self.shared is not None:
            y = y + self.shared(x)
        balance = sequence_balance_loss(
            scores.reshape(b, t, -1), experts.reshape(b, t, -1), cfg.balance_alpha
        )
        return y, MoEStats(loads=group_sizes, balance_loss=balance)
