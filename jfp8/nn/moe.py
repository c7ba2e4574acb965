"""DeepSeekMoE (DeepSeek-V3 report §2.1.2): shared + fine-grained routed experts, sigmoid routing,
auxiliary-loss-free load balancing and the complementary sequence-wise balance loss.

The routing is a chain of small pure functions, testable without Flax:

  router_scores      s = sigmoid(u · e)                        [T, E]   (FP32 gate, eq. 15)
  select_experts     top-K of s + b, optionally within the best groups   [T, K]   (eq. 16)
  top_k_routing      experts and gates g = route_scale · s / Σ_topK s    [T, K]   (eq. 13)
  dispatch           tokens sorted by expert + group sizes        [T*K, d]
  (experts)          grouped_fp8_linear on the sorted tokens      [T*K, d]   (module: the sort
                     fused into the first GEMM, `gathered_grouped_fp8_linear`, which
                     gathers each token's FP8 rows, quantized once)
  combine            unsort, Σ_k g_k · y_k                        [T, d]
  expert_loads       tokens per expert                            [E]
  sequence_balance_loss   α Σ_i f_i P_i per sequence              ()       (eq. 17-20)
  update_bias        b_i += γ · sign(mean − load_i)  or  γ · clip((mean − load_i)/mean, ±1)   [E]
  bias_update_speed  γ_t: constant, κ · lr_t, or κ · lr after warmup; 0 in the final `bias_freeze_frac`
  balance_statistics max/mean load, dead experts, bias spread per layer

Routing is dropless: every token reaches its K experts (no capacity factor).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfp8.nn.config import BIAS_RULES, BiasRule, ModelConfig, check_expert_groups
from jfp8.nn.layers import SwiGLU, given_fp8_weight, normal_init, swiglu
from jfp8.ops import gathered_grouped_fp8_linear, grouped_fp8_linear, take_rows

# ------------------------------------------------------------------------------ pure routing


def router_scores(x: jax.Array, gate: jax.Array) -> jax.Array:
    """Sigmoid token-to-expert affinities s_{i,t} = sigmoid(u_t · e_i), in FP32.

    x [T, d] (any float dtype), gate [d, E] FP32 -> [T, E] FP32. The gate is a plain FP32 matmul
    (not FP8, §3.3.2); HIGHEST precision keeps TF32 out of it on GPUs.
    """
    logits = jnp.dot(x.astype(jnp.float32), gate, precision=jax.lax.Precision.HIGHEST)
    return jax.nn.sigmoid(logits)


def select_experts(
    scores: jax.Array, bias: jax.Array, k: int, *, n_group: int = 1, topk_group: int = 1
) -> jax.Array:
    """The K experts of each token: the top-K of s + b, among the `topk_group` best groups.

    Group-limited routing (DeepSeek-V3 §2.1.2, node-limited routing; `n_group`/`topk_group` in its
    inference code): the N_r experts form `n_group` equal contiguous groups; a group's score is the
    sum of its two highest s + b (its one s + b for groups of one expert); each token keeps its
    `topk_group` best groups and picks its K experts inside them. `n_group=1` is plain top-K.

    Args:
      scores: [T, E] FP32 affinities.
      bias: [E] FP32 per-expert selection bias (gets no gradient).
      k: experts per token.
      n_group: groups of experts; must divide E.
      topk_group: groups kept per token; k <= topk_group * E / n_group.

    Returns:
      [T, K] int32 expert ids, distinct per token.
    """
    t, e = scores.shape
    if not 1 <= k <= e:
        raise ValueError(f"k={k} must lie in [1, {e}] (the number of experts)")
    check_expert_groups(e, k, n_group, topk_group)
    biased = scores + jax.lax.stop_gradient(bias)  # [T, E]
    if n_group > 1:
        grouped = biased.reshape(t, n_group, e // n_group)  # [T, G, E/G]
        best = jax.lax.top_k(grouped, min(2, e // n_group))[0]  # [T, G, 2]
        _, keep = jax.lax.top_k(jnp.sum(best, axis=-1), topk_group)  # [T, topk_group]
        kept = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)  # [T, G]
        biased = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, e)
    _, experts = jax.lax.top_k(biased, k)  # [T, K]
    return experts.astype(jnp.int32)


def top_k_routing(
    scores: jax.Array,
    bias: jax.Array,
    k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    route_scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Select K experts per token by s + b (`select_experts`); gate them by the unbiased s.

    The bias b (auxiliary-loss-free balancing) only changes which experts are chosen: the
    gating weights are g_{i,t} = route_scale · s_{i,t} / Σ_{j in topK} s_{j,t} (eq. 13, and
    DeepSeek-V3's `route_scale`), with no b in them.

    Args:
      scores: [T, E] FP32 affinities in (0, 1).
      bias: [E] FP32 per-expert selection bias (gets no gradient).
      k: experts per token.
      n_group, topk_group: group-limited routing (see `select_experts`); 1, 1 = plain top-K.
      route_scale: multiplies the normalised gates.

    Returns:
      experts [T, K] int32 (distinct per token), weights [T, K] FP32 (positive, each row sums to
      route_scale).
    """
    experts = select_experts(scores, bias, k, n_group=n_group, topk_group=topk_group)
    chosen = jnp.take_along_axis(scores, experts, axis=-1)  # [T, K]: unbiased affinities
    return experts, route_scale * chosen / jnp.sum(chosen, axis=-1, keepdims=True)


def route(scores: jax.Array, bias: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """`top_k_routing` with the routing fields of `cfg` (top_k, n_group, topk_group, route_scale)."""
    return top_k_routing(
        scores, bias, cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group, route_scale=cfg.route_scale
    )


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
    order, group_sizes = dispatch_order(experts, n_experts)
    k = experts.shape[-1]
    # Its gradient sums each token's K rows by a gather, not a scatter-add (`take_rows`).
    x_sorted = take_rows(x, order // k, token_rows(order, k))  # [T*K, d]
    return x_sorted, group_sizes, order


def dispatch_order(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """`dispatch` without the copy: order [T*K] int32 (row r of the sorted tokens is token
    order[r] // K) and group_sizes [E] int32."""
    order = jnp.argsort(experts.reshape(-1), stable=True).astype(jnp.int32)  # [T*K]
    return order, expert_loads(experts, n_experts)


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Undo `dispatch` and sum each token's K expert outputs weighted by its gating weights.

    y_sorted [T*K, d] (rows in dispatch order), order [T*K] from `dispatch`, weights [T, K] FP32
    -> [T, d] in y_sorted's dtype (weighted sum in FP32).
    """
    return _combine(y_sorted, order, inverse_order(order), weights)


def inverse_order(order: jax.Array) -> jax.Array:
    """The inverse permutation of `order`: row inverse[a] of the sorted tokens is assignment a."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def token_rows(order: jax.Array, k: int) -> jax.Array:
    """[T, K] int32: the rows of the sorted tokens that hold each token, in ascending order (what
    `jfp8.ops.gathered_grouped_fp8_linear` sums the tokens' gradients in: the same order as the
    scatter-add autodiff would run, as a gather)."""
    return jnp.sort(inverse_order(order).reshape(-1, k), axis=1)


def _weighted_sum(weights: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum("tk,tkd->td", weights, y.astype(jnp.float32))


@jax.custom_vjp
def _combine(y_sorted: jax.Array, order: jax.Array, inverse: jax.Array, weights: jax.Array) -> jax.Array:
    """`combine`, with `inverse` = order's inverse permutation; its gradient is autodiff's, bit for
    bit, computed in fewer passes.

    Autodiff computes d y_sorted in two passes over [T*K, d]: the einsum's transpose writes g·w as
    [T, K, d] in assignment order, then the unsort's transpose moves it into dispatch order (a
    scatter-add into a zeroed buffer, which XLA:GPU hoisted: the four MoE layers' buffers, 6.4 GB,
    live at once in the deviceless wide4k step at batch 16; a gather of the [T, K, d] copy until
    2026-11-28). Here it is one pass, a gather of g's rows: row r of d y_sorted is assignment
    a = order[r], weights[a] · g[a // K] in FP32 rounded to y_sorted's dtype, with -0 turned to +0
    as adding into zeros does. d weights is the einsum's own transpose."""
    t, k = weights.shape
    y = jnp.take(y_sorted, inverse, axis=0).reshape(t, k, -1)  # [T, K, d]: assignment order
    return _weighted_sum(weights, y).astype(y_sorted.dtype)


def _combine_fwd(y_sorted, order, inverse, weights):
    return _combine(y_sorted, order, inverse, weights), (y_sorted, order, inverse, weights)


def _combine_bwd(residuals, g):
    y_sorted, order, inverse, weights = residuals
    t, k = weights.shape
    g32 = g.astype(jnp.float32)  # the transpose of the sum's cast to y_sorted's dtype
    dy = (jnp.take(weights.reshape(-1), order).astype(jnp.float32)[:, None]
          * jnp.take(g32, order // k, axis=0)).astype(y_sorted.dtype)
    dy = jnp.where(dy == 0, jnp.zeros_like(dy), dy)
    y = jnp.take(y_sorted, inverse, axis=0).reshape(t, k, -1)
    _, weights_vjp = jax.vjp(lambda w: _weighted_sum(w, y), weights)
    (dweights,) = weights_vjp(g32)
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return dy, zero(order), zero(inverse), dweights


_combine.defvjp(_combine_fwd, _combine_bwd)


def expert_loads(experts: jax.Array, n_experts: int) -> jax.Array:
    """Tokens routed to each expert: experts [..., K] int -> [E] int32 counts."""
    return jnp.zeros((n_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def sequence_balance_loss(scores: jax.Array, k: int, alpha: float) -> jax.Array:
    """Complementary sequence-wise balance loss (eq. 17-20), averaged over the sequences.

    Per sequence of T tokens: L_Bal = α Σ_i f_i P_i with
      f_i = N_r / (K T) · #{t : s_{i,t} in Topk({s_{j,t}}, K)}       (f_i = 1 when balanced)
      P_i = (1/T) Σ_t s'_{i,t},  s'_{i,t} = s_{i,t} / Σ_j s_{j,t}    (Σ_i P_i = 1)
    Eq. 18 counts the top-K of the unbiased affinities s over all experts: not the routed
    selection, which adds the bias b and the group limit. f is a count (no gradient); the gradient
    reaches the gate through P.

    Args:
      scores: [B, T, E] FP32 unbiased affinities.
      k: K, experts per token.
      alpha: α.

    Returns:
      FP32 scalar.
    """
    b, t, n_r = scores.shape
    _, top = jax.lax.top_k(jax.lax.stop_gradient(scores), k)  # [B, T, K]
    seq = jnp.broadcast_to(jnp.arange(b)[:, None, None], top.shape)
    counts = jnp.zeros((b, n_r), jnp.float32).at[seq, top].add(1.0)  # [B, E]
    f = counts * (n_r / (k * t))  # [B, E]
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)  # [B, E]
    return alpha * jnp.mean(jnp.sum(f * p, axis=-1))


def update_bias(bias: jax.Array, loads: jax.Array, gamma: float | jax.Array, rule: BiasRule = "sign",
                gain: float = 1.0) -> jax.Array:
    """Auxiliary-loss-free balancing step, moving each b_i toward under-loaded experts.

      "sign"     b_i += γ · sign(mean − load_i)                          (DeepSeek-V3 §2.1.2)
      "clipped"  b_i += γ · clip(gain · (mean − load_i) / mean, −1, 1)   (|step| <= γ)

    The clipped rule is proportional near balance and saturates at γ; a larger `gain` saturates
    earlier (gain → ∞ is the sign rule). Overloaded experts (load above the mean) become less
    likely to be selected, underloaded ones more. bias [E] FP32, loads [E] (counts), γ >= 0 ->
    [E] FP32.
    """
    loads = loads.astype(jnp.float32)
    mean = jnp.mean(loads)
    if rule == "sign":
        step = jnp.sign(mean - loads)
    elif rule == "clipped":
        step = jnp.clip(gain * (mean - loads) / jnp.maximum(mean, 1.0), -1.0, 1.0)
    else:
        raise ValueError(f"bias rule must be one of {BIAS_RULES}, got {rule!r}")
    return bias + gamma * step


def bias_freeze_step(cfg: ModelConfig, total_steps: int) -> int:
    """The first step (0-based) whose bias update is 0: the last round(bias_freeze_frac · total)
    steps are frozen (DeepSeek-V3 sets γ = 0 for its final 500B of 14.8T tokens)."""
    return total_steps - round(cfg.bias_freeze_frac * total_steps)


def bias_update_speed(cfg: ModelConfig, step: jax.Array | int, lr: jax.Array | float, total_steps: int) -> jax.Array:
    """γ_t for the bias update after step `step` (0-based) of `total_steps`, whose learning rate is `lr`.

    `bias_schedule="constant"`: γ_t = bias_gamma; `"lr"` and `"lr_decay"`: γ_t = bias_lr_ratio · lr
    (DeepSeek-V3's γ/peak-LR ratio by default), where for `"lr_decay"` the caller passes the
    learning rate of step max(step, warmup), so γ skips the warmup (`jfp8.train.bias_gamma_schedule`
    does). Every way γ_t = 0 from `bias_freeze_step` on. Returns FP32 ().
    """
    if cfg.bias_schedule == "constant":
        gamma = jnp.float32(cfg.bias_gamma)
    else:
        gamma = jnp.float32(cfg.bias_lr_ratio) * jnp.asarray(lr, jnp.float32)
    return jnp.where(jnp.asarray(step) >= bias_freeze_step(cfg, total_steps), jnp.float32(0.0), gamma)


def balance_statistics(loads: jax.Array, biases: jax.Array) -> dict[str, jax.Array]:
    """Per-layer balance readouts of one step.

    loads [L, E] tokens per expert, biases [L, E] router biases -> {"load_max_over_mean": [L] FP32
    (1 = balanced, N_r/K = every token on the same K experts), "dead_experts": [L] int32 (experts
    that got no token), "bias_spread": [L] FP32 (max b − min b)}.
    """
    loads = loads.astype(jnp.float32)
    return {
        "load_max_over_mean": jnp.max(loads, axis=-1) / jnp.mean(loads, axis=-1),
        "dead_experts": jnp.sum(loads == 0, axis=-1).astype(jnp.int32),
        "bias_spread": jnp.max(biases, axis=-1) - jnp.min(biases, axis=-1),
    }


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
        self.gate = nnx.Param(normal_init(rngs, (d, e), cfg.gate_init_std))  # centroids e_i as columns
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
        experts, weights = route(scores, self.router_bias[...], cfg)  # [N, K] x2
        y, loads = self.routed_experts(tokens, experts, weights)  # [N, d], [E]
        y = y.reshape(b, t, d)
        if self.shared is not None:
            y = y + self.shared(x)
        balance = sequence_balance_loss(scores.reshape(b, t, -1), cfg.top_k, cfg.balance_alpha)
        return y, MoEStats(loads=loads, balance_loss=balance)

    def routed_experts(self, tokens: jax.Array, experts: jax.Array, weights: jax.Array):
        """Σ_k g_k FFN_{e_k}(u) for each token: tokens [N, d], experts/weights [N, K] -> (y [N, d],
        loads [E]). The tokens sorted by expert (the FP8 copy of each, gathered: no BF16 copy per
        expert), two grouped FP8 GEMMs (fused gate/up, then down), combined back with the gating
        weights. The one step an expert-parallel MoE replaces
        (`jfp8.nn.expert_parallel.ExpertParallelMoE`)."""
        cfg = self.cfg
        order, group_sizes = dispatch_order(experts, cfg.n_routed)
        # `dispatch` fused into the first GEMM: each token quantized once, its FP8 rows gathered;
        # d tokens sums each token's rows by a gather, in the scatter-add's order.
        k = experts.shape[-1]
        rows = order // k  # [N*K]: the token of each sorted row
        gate_up = gathered_grouped_fp8_linear(tokens, rows, self.w13[...], group_sizes, cfg.recipe,
                                              token_rows=token_rows(order, k),
                                              w_fp8=given_fp8_weight(self, "w13"))  # [N*K, 2h]
        y_sorted = grouped_fp8_linear(swiglu(gate_up), self.w2[...], group_sizes, cfg.recipe,
                                      w_fp8=given_fp8_weight(self, "w2"))  # [N*K, d]
        return combine(y_sorted, order, weights), group_sizes
