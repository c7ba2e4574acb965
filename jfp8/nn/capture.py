"""Record the FP8 GEMM operands of a model: each `Fp8Linear`'s input x and output gradient dy.

    tensors = capture_linear_operands(model, tokens)      # {"blocks.1.attn.wq_a": {"x": ..., "dy": ...}}

x is what Fprop quantizes in 1x128 tiles (and Wgrad in 128x1 blocks); dy is what Dgrad quantizes in
1x128 tiles (the Appendix B.2 ablation: 128x128 blocks) and Wgrad in 128x1 blocks. These are the
real tensors behind the scaling-granularity experiment (`experiments/capture_tensors.py`).

How: each `Fp8Linear` gets a tap for the duration of the call. The tap passes x and y through
unchanged, records x on the forward pass and, through an identity `custom_vjp`, y's cotangent on
the backward pass (both with `jax.debug.callback`, so it works under `jit`). A layer called
several times (none in this model) has its calls stacked along the rows. The routed experts'
grouped GEMMs are not `Fp8Linear`s and are not recorded.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from jfp8.nn.layers import Fp8Linear
from jfp8.nn.model import Transformer, model_loss


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grad_tap(record, y):
    return y


def _grad_tap_fwd(record, y):
    return y, None


def _grad_tap_bwd(record, _, dy):
    jax.debug.callback(record, dy)
    return (dy,)


_grad_tap.defvjp(_grad_tap_fwd, _grad_tap_bwd)


class _Tap:
    """Records one layer's x and dy into `store[name]` (lists of [rows, features] f32 arrays)."""

    def __init__(self, name: str, store: dict):
        self.name, self.store = name, store

    def _record(self, key: str, value) -> None:
        value = np.asarray(value, np.float32)
        self.store.setdefault(self.name, {}).setdefault(key, []).append(value.reshape(-1, value.shape[-1]))

    def input(self, x: jax.Array) -> jax.Array:
        jax.debug.callback(functools.partial(self._record, "x"), x)
        return x

    def output(self, y: jax.Array) -> jax.Array:
        return _grad_tap(functools.partial(self._record, "dy"), y)


def linear_layers(model: nnx.Module) -> dict[str, Fp8Linear]:
    """Every `Fp8Linear` in `model`, by its dotted path ("blocks.0.attn.wq_a")."""
    return {
        ".".join(str(p) for p in path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, Fp8Linear)
    }


def capture_linear_operands(
    model: Transformer, tokens: jax.Array, loss_scale: float = 1.0
) -> dict[str, dict[str, np.ndarray]]:
    """x and dy of every `Fp8Linear` for one loss-and-gradient evaluation on `tokens` [B, T].

    Returns {layer path: {"x": [B*T, in_features], "dy": [B*T, out_features]}} as f32 NumPy
    arrays (the values the FP8 GEMMs quantize: x in the compute dtype, dy the cotangent of the
    layer's output). The gradient is of `loss_scale * model_loss` (CE + λ·MTP CE + balance), as in
    training with `TrainConfig.loss_scale`: dy is what the Dgrad/Wgrad quantizers see there.
    The model is left as it was.
    """
    layers = linear_layers(model)
    store: dict = {}
    for name, layer in layers.items():
        layer.tap = _Tap(name, store)
    try:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            return model_loss(nnx.merge(graphdef, p, rest), tokens)[0] * loss_scale

        jax.block_until_ready(jax.jit(jax.grad(loss))(params))
        jax.effects_barrier()
    finally:
        for layer in layers.values():
            layer.tap = None
    return {
        name: {key: np.concatenate(values) for key, values in store[name].items()}
        for name in layers if name in store
    }
