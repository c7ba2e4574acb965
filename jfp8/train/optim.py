"""AdamW with both moments in BF16 and FP32 master weights (DeepSeek-V3 §3.3, "Low-Precision
Optimizer States"), as optax transformations.

optax's `adamw` takes `mu_dtype` but keeps the second moment in the gradients' dtype; here both
moments are stored in bfloat16 and every update is computed in float32 from them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByAdamLowPrecisionState(NamedTuple):
    count: jax.Array  # int32 []
    mu: optax.Updates  # first moments, `moment_dtype`
    nu: optax.Updates  # second moments, `moment_dtype`


def scale_by_adam_low_precision(
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    moment_dtype=jnp.bfloat16,
) -> optax.GradientTransformation:
    """Adam's scaling with both moment estimates stored in `moment_dtype`.

    Each step reads the moments, updates them in float32 (mu = b1 mu + (1 - b1) g,
    nu = b2 nu + (1 - b2) g^2), stores them back rounded to `moment_dtype`, and returns the
    bias-corrected float32 update mu_hat / (sqrt(nu_hat) + eps) computed from the f32 values.
    """

    def init_fn(params):
        zeros = lambda p: jnp.zeros(jnp.shape(p), moment_dtype)  # noqa: E731
        return ScaleByAdamLowPrecisionState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(zeros, params),
            nu=jax.tree.map(zeros, params),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
        g = f32(updates)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, f32(state.mu), g)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), f32(state.nu), g)
        c = count.astype(jnp.float32)
        mu_hat_scale, nu_hat_scale = 1 / (1 - b1**c), 1 / (1 - b2**c)
        out = jax.tree.map(
            lambda m, v: (m * mu_hat_scale) / (jnp.sqrt(v * nu_hat_scale) + eps), mu, nu
        )
        cast = lambda t: jax.tree.map(lambda x: x.astype(moment_dtype), t)  # noqa: E731
        return out, ScaleByAdamLowPrecisionState(count=count, mu=cast(mu), nu=cast(nu))

    return optax.GradientTransformation(init_fn, update_fn)


def decay_mask(params) -> optax.Params:
    """Weight decay on matrices only: not on norms' scales nor biases (1-D parameters)."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW + warmup/cosine schedule + global-norm clipping."""

    peak_lr: float = 3e-3
    end_lr_ratio: float = 0.1  # the cosine decays to peak_lr * end_lr_ratio
    warmup_steps: int = 50
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    moment_dtype: str = "bfloat16"  # "float32" for the plain-AdamW comparison


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `peak_lr`, then cosine decay to `peak_lr * end_lr_ratio` at `total_steps`."""
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.peak_lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.peak_lr * config.end_lr_ratio,
    )


def make_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm -> Adam with low-precision moments -> decoupled weight decay -> -lr."""
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        scale_by_adam_low_precision(config.b1, config.b2, config.eps, jnp.dtype(config.moment_dtype)),
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(learning_rate_schedule(config, total_steps)),
    )


def update_count(opt_state) -> jax.Array:
    """Updates applied so far (int32 ()): the step whose learning rate the next update uses, read
    from the state of `make_optimizer`'s learning-rate schedule."""
    found = [
        s.count
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected one learning-rate schedule state in the optimizer state, found {len(found)}; "
            "build the optimizer with make_optimizer"
        )
    return found[0]
