"""Look inside a training run: restore its state, and measure gradient error at its parameters.

    config, params, rest = load_run("runs/parity-small/fp8")              # newest checkpoint
    config, model = load_model("runs/parity-small/fp8")                   # the same, as an nnx model
    batches = val_batches(config, 2)                                      # held-out [B, T] token batches
    errors = gradient_errors(config.model_config(), params, rest, batches,
                             {"deepseek": Fp8Recipe(), "dgrad 128x128": Fp8Recipe(grad_block=(128, 128))})

`gradient_errors` compares the parameter gradient of the training loss under each recipe with an
FP32 reference (the same parameters, router biases and batches; every GEMM in FP32, activations
in FP32): the relative error ‖g − g_ref‖ / ‖g_ref‖ and the cosine similarity, over all
parameters and per parameter group. The error includes routing: quantization can flip a token's
top-K choice, and that flip is part of what FP8 does to a gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfp8.nn import ModelConfig, Transformer, model_loss
from jfp8.recipe import Fp8Recipe
from jfp8.train import data
from jfp8.train.checkpoint import Checkpointer
from jfp8.train.config import TrainConfig
from jfp8.train.step import _split, build, scaled_value_and_grad


def load_run(run_dir: str | pathlib.Path, step: int | None = None):
    """(TrainConfig, params, rest) of the checkpoint at `step` (the newest when None) of a run
    written by `jfp8.train.train` / `experiments/train_moe.py`."""
    run_dir = pathlib.Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise FileNotFoundError(f"{run_dir} has no config.json: pass the --out directory of a training run")
    config = TrainConfig.from_json(json.loads((run_dir / "config.json").read_text()))
    _, _, params, rest, tx, *_ = build(config)
    like = {"params": params, "rest": rest, "opt_state": tx.init(params)}
    ckpt = Checkpointer(run_dir / "checkpoints")
    try:
        state, _ = ckpt.restore(step, like)
    finally:
        ckpt.close()
    return config, state["params"], state["rest"]


def load_model(run_dir: str | pathlib.Path, step: int | None = None):
    """(TrainConfig, Transformer) of a run's checkpoint: `load_run`'s state merged into the model."""
    config, params, rest = load_run(run_dir, step)
    return config, nnx.merge(_graphdef(config.model_config()), params, rest)


def val_batches(config: TrainConfig, n: int) -> list[np.ndarray]:
    """The first `n` held-out [batch_size, seq_len] token batches of the run's corpus and split."""
    split = data.train_val_split(data.load_bytes(config.corpus), config.val_fraction)
    return data.eval_batches(split.val, config.batch_size, config.seq_len, n)


def _graphdef(config: ModelConfig):
    return _split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]


@functools.lru_cache(maxsize=16)
def _gradient_fn(config: ModelConfig, loss_scale: float = 1.0):
    graphdef = _graphdef(config)

    @jax.jit
    def grad(params, rest, tokens):
        loss = lambda p: model_loss(nnx.merge(graphdef, p, rest), tokens)  # noqa: E731
        return scaled_value_and_grad(loss, loss_scale)(params)[1]

    return grad


def _group(path: str) -> str:
    """A parameter's group: attention, dense FFN, shared expert, routed experts, router, other."""
    if ".attn." in path:
        return "attention"
    if ".shared." in path:
        return "shared expert"
    if path.endswith((".ffn.w13", ".ffn.w2")):  # stacked [E, ...] routed-expert weights
        return "routed experts"
    if path.endswith(".ffn.gate"):
        return "router"
    return "dense ffn" if ".ffn." in path else "other"


def _flat(tree) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [k.key if hasattr(k, "key") else k.idx if hasattr(k, "idx") else k.name for k in path]
        out[".".join(str(k) for k in keys if k != "value")] = np.asarray(leaf, np.float64)
    return out


def gradient_errors(
    config: ModelConfig, params, rest, batches, recipes: dict[str, Fp8Recipe], *, bf16_floor: bool = True,
    loss_scale: float = 1.0,
) -> dict[str, dict]:
    """Gradient error of each recipe vs the FP32 reference, summed over `batches` ([B, T] tokens).

    Returns {recipe name: {"rel_error", "cosine", "groups": {group: rel_error}}}; the reference
    itself is the model with `Fp8Recipe.off()` and FP32 activations. With `bf16_floor`, also
    returned under "bf16": the BF16 model without FP8, the floor that FP8 error is read against.
    `loss_scale` differentiates `loss_scale * loss` and divides the gradient by it, as training
    with `TrainConfig.loss_scale` does (the FP32 reference is unaffected by a power of two).
    """
    # Committed like a checkpoint's arrays: fresh and restored parameters share one compilation.
    params, rest = jax.device_put((params, rest), jax.devices()[0])
    configs = {name: dataclasses.replace(config, recipe=r) for name, r in recipes.items()}
    if bf16_floor:
        configs["bf16"] = dataclasses.replace(config, recipe=Fp8Recipe.off(), dtype="bfloat16")
    reference = dataclasses.replace(config, recipe=Fp8Recipe.off(), dtype="float32")

    def total(cfg):
        fn = _gradient_fn(cfg, loss_scale)
        grads = [_flat(fn(params, rest, jnp.asarray(b))) for b in batches]
        return {k: sum(g[k] for g in grads) for k in grads[0]}

    ref = total(reference)
    out = {}
    for name, cfg in configs.items():
        g = total(cfg)
        diff2 = {k: float(np.sum((g[k] - ref[k]) ** 2)) for k in ref}
        norm2 = {k: float(np.sum(ref[k] ** 2)) for k in ref}
        dot = sum(float(np.sum(g[k] * ref[k])) for k in ref)
        gnorm = np.sqrt(sum(float(np.sum(g[k] ** 2)) for k in ref))
        groups: dict[str, list[float]] = {}
        for k in ref:
            d, n = groups.setdefault(_group(k), [0.0, 0.0]), norm2[k]
            d[0] += diff2[k]
            d[1] += n
        out[name] = {
            "rel_error": float(np.sqrt(sum(diff2.values()) / sum(norm2.values()))),
            "cosine": float(dot / (gnorm * np.sqrt(sum(norm2.values())))),
            "groups": {k: float(np.sqrt(d / n)) if n > 0 else float("nan") for k, (d, n) in sorted(groups.items())},
        }
    return out
