"""The training step on a mesh: the model under one `jax.shard_map`, tokens sharded over every
device, routed experts over `expert` (`jfp8.nn.expert_parallel`), the same update as the
single-device step (`jfp8.train.step.optimizer_step`). Autodiff of the shard_map psums the
gradients of replicated parameters over all devices and the expert gradients over `data`."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfp8.mesh import BATCH_AXES, param_specs, shard_params
from jfp8.nn.expert_parallel import ParallelOptions, install_expert_parallel
from jfp8.nn.model import loss_from_outputs
from jfp8.train.step import STATE_ARGNUMS, TrainSetup, bias_gamma_schedule, build, optimizer_step

def sharded_loss_fn(graphdef, mesh: Mesh, params, rest, options: ParallelOptions = ParallelOptions()):
    """`(params, rest, tokens) -> (loss, parts)` equal to `model_loss` on the global batch.

    Runs the model under `jax.shard_map` over `mesh`: tokens [B, T] sharded over (data, expert),
    experts over `expert`. parts: "ce", "mtp_ce", "balance" (global means), "expert_loads"
    [n_moe_layers, N_r] (summed over all devices), "dropped_assignments" (global count).
    """
    specs = (param_specs(params), param_specs(rest), P(BATCH_AXES))

    def local(params, rest, tokens):
        model = nnx.merge(graphdef, params, rest)
        drops = install_expert_parallel(model, dispatch=options.dispatch, capacity_factor=options.capacity_factor)
        logits, aux = model(tokens)
        loss, parts = loss_from_outputs(model.config, tokens, logits, aux)
        # Every device holds the same number of sequences: the global means are means of means.
        out = {k: jax.lax.pmean(v, BATCH_AXES) for k, v in parts.items() if k != "expert_loads"}
        out["expert_loads"] = jax.lax.psum(parts["expert_loads"], BATCH_AXES)
        out["dropped_assignments"] = jax.lax.psum(drops.total(), BATCH_AXES)
        return jax.lax.pmean(loss, BATCH_AXES), out

    out_specs = (P(), {k: P() for k in ("ce", "mtp_ce", "balance", "expert_loads", "dropped_assignments")})
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)

def make_sharded_train_step(graphdef, tx, mesh: Mesh, params, rest, options: ParallelOptions = ParallelOptions(),
                            loss_scale: float = 1.0, bias_gamma=None, *, donate: bool = True):
    """The jitted sharded counterpart of `jfp8.train.step.build`'s `train_step`.

    `step(params, rest, opt_state, tokens) -> (params, rest, opt_state, metrics)`, tokens a global
    [B, T] batch (placed with `shard_batch`), params/rest placed with `shard_params`. Gradients of
    replicated parameters are summed over all devices by autodiff of the shard_map; the router
    biases move by the global expert loads, with γ_t from `bias_gamma` (step -> γ_t,
    `jfp8.train.step.bias_gamma_schedule`; None: the config's constant γ). `donate`: the step
    donates params, rest and opt_state, as the single-device one does (`jfp8.train.step.TrainSetup`).
    """
    loss_fn = sharded_loss_fn(graphdef, mesh, params, rest, options)
    p_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params))
    r_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(rest))

    def step(params, rest, opt_state, tokens):
        params, rest, opt_state, metrics = optimizer_step(
            graphdef, tx, loss_fn, params, rest, opt_state, tokens, loss_scale, bias_gamma
        )
        params = jax.lax.with_sharding_constraint(params, p_shard)
        rest = jax.lax.with_sharding_constraint(rest, r_shard)
        return params, rest, opt_state, metrics

    return jax.jit(step, donate_argnums=STATE_ARGNUMS if donate else ())

def check_no_drops(metrics: dict) -> None:
    """Raise when a step with a finite `capacity_factor` dropped token assignments."""
    n = int(metrics.get("dropped_assignments", 0))
    if n:
        raise RuntimeError(
            f"{n} token-to-expert assignments exceeded the expert-parallel send capacity and were "
            "dropped this step; raise ParallelOptions.capacity_factor or use None (dropless)"
        )

def build_sharded(config, mesh: Mesh, options: ParallelOptions = ParallelOptions(), *, donate: bool = True):
    """`jfp8.train.step.build(config, donate=donate)` on a mesh: the same 8-tuple (model_cfg,
    graphdef, params, rest, tx, schedule, train_step, eval_step), with params/rest placed on `mesh`
    and sharded steps. Feed the steps batches placed with `shard_batch(tokens, mesh)`."""
    model_cfg, graphdef, params, rest, tx, schedule, _, _ = build(config, donate=donate)  # same model, init, optimizer
    params, rest = shard_params(params, mesh), shard_params(rest, mesh)
    gamma = bias_gamma_schedule(model_cfg, config.optimizer, config.steps)
    train_step = make_sharded_train_step(graphdef, tx, mesh, params, rest, options, config.loss_scale, gamma,
                                         donate=donate)
    loss_fn = sharded_loss_fn(graphdef, mesh, params, rest, options)
    eval_step = jax.jit(lambda params, rest, tokens: loss_fn(params, rest, tokens)[1]["ce"])
    return TrainSetup(model_cfg, graphdef, params, rest, tx, schedule, train_step, eval_step)
