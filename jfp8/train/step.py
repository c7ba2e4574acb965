"""The training step on one device: the model's initial state and the jitted step functions
(`build`), the optimizer update with the router-bias update (`optimizer_step`, shared with the
sharded step of `jfp8.train.sharded`), and loss scaling."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jfp8.nn import ModelConfig, Transformer, balance_statistics, bias_update_speed, model_loss, router_biases, update_router_biases
from jfp8.train.config import TrainConfig
from jfp8.train.optim import OptimizerConfig, learning_rate_schedule, make_optimizer, update_count


# `train_step`'s arguments that it donates: params, rest, opt_state (not the batch).
STATE_ARGNUMS = (0, 1, 2)


class TrainSetup(NamedTuple):
    """What `build` returns: the model, its state and the run's jitted steps.
    `train_step(params, rest, opt_state, tokens) -> (params, rest, opt_state, metrics)`;
    `eval_step(params, rest, tokens) -> CE`.

    `train_step` donates its params, rest and opt_state (unless built with `donate=False`): the
    new state is written over the old one's device buffers, so a step holds one copy of the
    parameters and optimizer state, not two, and the arrays passed in are deleted by the call
    (use the ones it returns; pass copies, `jax.tree.map(jnp.copy, state)`, to keep a state)."""

    model_cfg: ModelConfig
    graphdef: object
    params: object
    rest: object
    tx: optax.GradientTransformation
    schedule: Callable
    train_step: Callable
    eval_step: Callable


def _split(model: Transformer):
    """(graphdef, params, rest): params are what the optimizer updates; rest holds the router
    biases (updated outside the gradient) and any other state."""
    return nnx.split(model, nnx.Param, ...)


def build(config: TrainConfig, *, donate: bool = True) -> TrainSetup:
    """The model's initial (params, rest) and the run's jitted step functions; `donate`: whether
    `train_step` donates the state it is given (`TrainSetup`)."""
    model_cfg = config.model_config()
    graphdef, params, rest = _split(Transformer(model_cfg, rngs=nnx.Rngs(config.seed)))
    return TrainSetup(model_cfg, graphdef, params, rest,
                      *_step_functions(graphdef, model_cfg, config.optimizer, config.steps, config.loss_scale,
                                       donate))


@functools.lru_cache(maxsize=8)
def _step_functions(
    graphdef, model_cfg: ModelConfig, opt_cfg: OptimizerConfig, total_steps: int, loss_scale: float = 1.0,
    donate: bool = True,
):
    """(tx, schedule, train_step, eval_step), cached so that runs of the same model and schedule in
    one process (a resume, the two halves of a comparison) compile once. `donate`: `train_step`
    donates params, rest and opt_state (`TrainSetup`)."""
    tx = make_optimizer(opt_cfg, total_steps)
    schedule = learning_rate_schedule(opt_cfg, total_steps)
    gamma = bias_gamma_schedule(model_cfg, opt_cfg, total_steps)

    def loss_fn(params, rest, tokens):
        return model_loss(nnx.merge(graphdef, params, rest), tokens)

    @functools.partial(jax.jit, donate_argnums=STATE_ARGNUMS if donate else ())
    def train_step(params, rest, opt_state, tokens):
        return optimizer_step(graphdef, tx, loss_fn, params, rest, opt_state, tokens, loss_scale, gamma)

    @jax.jit
    def eval_step(params, rest, tokens):
        _, parts = loss_fn(params, rest, tokens)
        return parts["ce"]

    return tx, schedule, train_step, eval_step

def bias_gamma_schedule(model_cfg: ModelConfig, opt_cfg: OptimizerConfig, total_steps: int):
    """step -> γ_t of the router-bias update (`jfp8.nn.bias_update_speed` at that step's learning
    rate; with `bias_schedule="lr_decay"`, at the learning rate of step max(step, warmup), which
    holds γ at its peak through the warmup)."""
    schedule = learning_rate_schedule(opt_cfg, total_steps)
    if model_cfg.bias_schedule != "lr_decay":
        return lambda step: bias_update_speed(model_cfg, step, schedule(step), total_steps)
    warmup = min(opt_cfg.warmup_steps, max(total_steps - 1, 0))  # as learning_rate_schedule clamps it
    return lambda step: bias_update_speed(model_cfg, step, schedule(jnp.maximum(step, warmup)), total_steps)

def optimizer_step(
    graphdef, tx, loss_fn, params, rest, opt_state, tokens, loss_scale: float = 1.0, bias_gamma=None
):
    """One training step (traced inside jit): gradients of `loss_fn(params, rest, tokens)`, the
    optimizer update, then the router-bias update from the step's expert loads, outside the
    gradient (auxiliary-loss-free balancing). Returns (params, rest, opt_state, metrics).
    `loss_scale` multiplies the loss for the backward pass; the gradients are divided by it.
    `bias_gamma`: step -> γ_t (`bias_gamma_schedule`), the step read from `opt_state`; None uses
    the config's constant `bias_gamma`.

    metrics: the loss parts, "loss", "grad_norm", "bias_gamma" (γ_t), and per MoE layer ([L], in
    `ModelConfig.moe_layer_names` order) "load_max_over_mean" (of this step's loads),
    "dead_experts" and "bias_spread" (after the update)."""
    step = update_count(opt_state)
    (loss, parts), grads = scaled_value_and_grad(loss_fn, loss_scale)(params, rest, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    model = nnx.merge(graphdef, params, rest)
    gamma = None if bias_gamma is None else bias_gamma(step)  # None: constant γ (or an error)
    loads = jax.lax.stop_gradient(parts["expert_loads"])  # [L, E]
    update_router_biases(model, loads, gamma)
    _, _, rest = _split(model)
    metrics = {k: v for k, v in parts.items() if k != "expert_loads"}
    metrics["loss"] = loss
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["bias_gamma"] = jnp.float32(model.config.bias_gamma) if gamma is None else gamma
    metrics.update(balance_statistics(loads, router_biases(model)))
    return params, rest, opt_state, metrics

def scaled_value_and_grad(loss_fn, loss_scale: float = 1.0):
    """`jax.value_and_grad(loss_fn, has_aux=True)`, differentiating `loss_scale * loss` and
    returning the gradients divided by `loss_scale` (exact for a power of two, barring overflow)."""
    if loss_scale == 1.0:
        return jax.value_and_grad(loss_fn, has_aux=True)

    def scaled(*args):
        loss, aux = loss_fn(*args)
        return loss * loss_scale, (loss, aux)

    def fn(*args):
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(*args)
        return (loss, aux), jax.tree.map(lambda g: g / jnp.asarray(loss_scale, g.dtype), grads)

    return fn
